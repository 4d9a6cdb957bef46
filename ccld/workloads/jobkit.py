"""What the parallelism workloads share (pipeline_job.py, fsdp_job.py, hybrid_job.py): the common
flags, the fault injectors, compute, the data loader, the op counts and the final line.

These workloads stand in for a user's training script: nothing here imports ccld. A workload script
imports this file as a sibling module (`import jobkit`, the script's directory is sys.path[0]) or as
ccld.workloads.jobkit when run with -m. Times printed are Unix seconds (time.time()), compute times
are milliseconds. Every line goes out in one write(2) (say()): ranks share torchrun's stdout.

Common faults (where in a step each acts; the workloads' headers say where theirs differ):
  --hang-rank R --hang-step K       R sleeps forever in step K (pipeline: before its next send;
                                    others: before the step's first collective)
  --slow-rank R --slow-ms M [--slow-step K]   R computes M ms more per step from step K
  --io-rank R --io-step K --io-path P         R reads P at the start of step K (a StuckFuse file: D)
  --loader-rank R --loader-step K   inputs come from a DataLoader (one worker); R's worker sleeps
                                    forever at step K's batch, so R waits on its loader (--loader
                                    alone: the same loader, healthy)
  --ckpt-rank R --ckpt-step K --ckpt-s S      R writes checkpoints for S s at the start of step K
  --pause-step K --pause-s S        every rank sleeps S s at the start of step K (an evaluation)
  --batch-change-step K --batch-factor F      from step K compute and activation sizes scale by F
                                    (parameters and gradients keep theirs, as in a real job)
  --wrong-op-rank R --wrong-op-step K [--wrong-op-group G]   R calls another collective in G
  --fault-file F                    the one-rank faults above (hang, slow, io, ckpt, wrong-op; not the
                                    loader's, whose worker reads ahead) also wait for F: each acts at
                                    the first of its steps >= K once F exists (FaultGate), so a
                                    harness places the onset in time, not at a step it must guess

Lines a harness reads (one per injected fault, written when it begins; "t" is its onset):
  rank R: hanging at step K before send to rank D t UNIX      (pipeline; others "... before its first
                                                              collective t UNIX")
  rank R: slowed by M ms per step from step K t UNIX
  rank R: reading P at step K t UNIX                          (then "rank R: read of P ..." if it ends)
  rank R: waiting on a stalled data loader worker at step K t UNIX
  rank R: checkpointing for S s t UNIX / rank R: checkpoint done (N writes) t UNIX
  rank R: pausing S s before step K t UNIX                    (every rank)
  rank R: batch x F from step K t UNIX                        (every rank)
  rank R: calling all_gather instead of OP in group G at step K t UNIX   (fsdp: all_reduce instead of
                                                              all_gather_into_tensor)
  rank R step N t UNIX                                        (--progress-every N)
  rank R done: N steps, ops {op: count}                       (at exit, then destroy_process_group)
Op counts are exact calls made by this rank: the torch function's name ("all_reduce", "send",
"recv", "all_gather_into_tensor", ...; each P2POp of a batch_isend_irecv counts as one "send" or
"recv"), with "@group" appended for a group other than the default one ("all_reduce@tp").
Caveat: a hung rank never prints its done line; the harness kills the job.
"""
import argparse
import datetime
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.utils.data as tud

PARENT_CHECK_S = 1.0      # a rank or loader worker "asleep forever" looks up every second whether its
                          # parent is gone (launcher killed): it exits rather than outlive the job
STOP_CHECK_EVERY = 10     # --seconds: steps between looks at the agreed last step (a store read)
STOP_MARGIN = 2 * STOP_CHECK_EVERY  # ranks a step or two apart all see the last step before they get there
STOP_KEY = "workload_stop_at"       # TCPStore key of the agreed last step
CALIBRATE_S = 0.05        # --compute-work: CPU seconds of matmuls to measure this core's speed
SPIN_DIM = 64             # spin()'s matrix: 64x64 float matmuls, ~20 us each, fine-grained enough for 1 ms
CKPT_STATE_DIM = 1024     # --ckpt-rank writes a 1024x1024 float tensor (4 MiB) again and again
READ_BYTES = 4096         # --io-path: one page


def say(line: str) -> None:
    """One write(2) per line: print() may split a line in two writes, interleaving ranks mid-line."""
    os.write(1, (line + "\n").encode())


def now() -> str:
    return f"{time.time():.3f}"


def sleep_forever() -> None:
    """time.sleep until the parent (torchrun's agent, or the DataLoader's rank) is gone, then exit:
    the process is asleep in hrtimer_nanosleep, and a launcher killed with SIGKILL leaves no orphan."""
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_S)
    os._exit(1)


def add_common_flags(ap: argparse.ArgumentParser) -> None:
    """The flags every workload takes (names as in gloo_job.py where it has them)."""
    g = ap.add_argument_group("run")
    g.add_argument("--steps", type=int, default=23)
    g.add_argument("--seconds", type=float, default=0, help="run for this long instead of --steps")
    g.add_argument("--elems", type=int, default=1024, help="floats per tensor")
    g.add_argument("--compute-ms", type=float, default=2.0)
    g.add_argument("--compute-work", action="store_true",
                   help="--compute-ms and --slow-ms are an amount of work (what the core does in that "
                        "time unloaded), not wall time: CPU contention stretches it")
    g.add_argument("--wait-file", default="", help="block after init until this file exists")
    g.add_argument("--progress-every", type=int, default=0, help="print 'rank R step N t T' every N steps")
    g.add_argument("--timeout-s", type=float, default=1800, help="process group timeout")
    g.add_argument("--loader", action="store_true",
                   help="inputs come from a torch DataLoader with one worker (implied by --loader-rank)")
    f = ap.add_argument_group("faults")
    f.add_argument("--hang-rank", type=int, default=-1)
    f.add_argument("--hang-step", type=int, default=-1)
    f.add_argument("--slow-rank", type=int, default=-1)
    f.add_argument("--slow-ms", type=float, default=0.0)
    f.add_argument("--slow-step", type=int, default=0)
    f.add_argument("--io-rank", type=int, default=-1)
    f.add_argument("--io-step", type=int, default=-1)
    f.add_argument("--io-path", default="")
    f.add_argument("--loader-rank", type=int, default=-1)
    f.add_argument("--loader-step", type=int, default=-1)
    f.add_argument("--ckpt-rank", type=int, default=-1)
    f.add_argument("--ckpt-step", type=int, default=-1)
    f.add_argument("--ckpt-s", type=float, default=10.0)
    f.add_argument("--ckpt-dir", default="", help="where --ckpt-rank writes (default: a temporary dir)")
    f.add_argument("--pause-step", type=int, default=-1)
    f.add_argument("--pause-s", type=float, default=0.0)
    f.add_argument("--batch-change-step", type=int, default=-1)
    f.add_argument("--batch-factor", type=float, default=2.0)
    f.add_argument("--wrong-op-rank", type=int, default=-1)
    f.add_argument("--wrong-op-step", type=int, default=-1)
    f.add_argument("--wrong-op-group", default="", help="the group of the wrong collective (per workload)")
    f.add_argument("--fault-file", default="", help="the one-rank faults act at their step once this file exists")


class FaultGate:
    """When a one-rank fault placed at a step applies (gloo_job.py uses it too): in step K, or with
    --fault-file in the first step >= K (of those this rank asks about) that comes once the file
    exists. Then in that step only, as a fault at step K always did: it acts once."""

    def __init__(self, path: str = ""):
        self.path = path
        self.fired = {}   # fault -> the step it applied in

    def due(self, fault: str, step: int, at: int) -> bool:
        fired = self.fired.get(fault)
        if fired is not None:
            return fired == step
        if at < 0 or step < at or (self.path and not os.path.exists(self.path)):  # one stat a step, this rank
            return False
        self.fired[fault] = step
        return True


def check_common_flags(ap: argparse.ArgumentParser, a, wrong_op_groups) -> None:
    """Flag combinations that cannot work, named before any process group starts."""
    if a.io_rank >= 0 and not a.io_path:
        ap.error("--io-rank needs --io-path (the file that rank reads at --io-step)")
    if a.batch_factor <= 0:
        ap.error("--batch-factor must be > 0")
    if a.elems < 1:
        ap.error("--elems must be >= 1")
    if not a.wrong_op_group:
        a.wrong_op_group = wrong_op_groups[0]
    if a.wrong_op_group not in wrong_op_groups:
        ap.error(f"--wrong-op-group must be one of {', '.join(wrong_op_groups)} in this workload")


class Compute:
    """Busy compute standing in for forward/backward: matmuls on a small matrix, for wall-clock ms or
    (--compute-work) for a fixed amount of work measured once on this thread's CPU time."""

    def __init__(self, by_work: bool):
        self.w = torch.randn(SPIN_DIM, SPIN_DIM)
        self.work_per_ms = self.calibrate() if by_work else None

    def calibrate(self) -> float:
        """Matmuls per ms of thread CPU time (not wall time: on a loaded host the two differ)."""
        n, c0 = 0, time.thread_time()
        while time.thread_time() - c0 < CALIBRATE_S:
            self.w = (self.w @ self.w).clamp_(-1, 1)
            n += 1
        return n / ((time.thread_time() - c0) * 1e3)

    def spin(self, ms: float) -> None:
        if ms <= 0:
            return
        if self.work_per_ms:
            for _ in range(max(1, round(ms * self.work_per_ms))):
                self.w = (self.w @ self.w).clamp_(-1, 1)
            return
        end = time.perf_counter() + ms / 1e3
        while time.perf_counter() < end:
            self.w = (self.w @ self.w).clamp_(-1, 1)


def checkpoint(rank: int, seconds: float, state, directory: str) -> None:
    """Write `state` with torch.save + fsync, again and again, for `seconds` (a checkpoint that is
    busy on CPU and in I/O, not asleep)."""
    path = os.path.join(directory, f"ckpt-rank{rank}-{os.getpid()}.pt")
    t0 = time.time()
    n = 0
    say(f"rank {rank}: checkpointing for {seconds:g} s t {t0:.3f}")
    while time.time() - t0 < seconds:
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        n += 1
    os.unlink(path)
    say(f"rank {rank}: checkpoint done ({n} writes) t {now()}")


class Ops:
    """Exact per-rank counts of the calls made, keyed "op" (default group) or "op@group"."""

    def __init__(self):
        self.counts = {}

    def add(self, op: str, group: str = "", n: int = 1) -> None:
        key = f"{op}@{group}" if group else op
        self.counts[key] = self.counts.get(key, 0) + n


class _Inputs(tud.IterableDataset):
    """The DataLoader's dataset: an endless stream of input tensors, one per step. On the stalling
    rank, the worker sleeps forever at item `stall_at` (it runs ahead of the rank by the prefetch, so
    the rank itself starts to wait when it asks for that step's batch)."""

    def __init__(self, elems: int, stall_at: int, batch_change_step: int, factor: float):
        self.elems, self.stall_at = elems, stall_at
        self.batch_change_step, self.factor = batch_change_step, factor

    def __iter__(self):
        step = 0
        while True:
            if step == self.stall_at:
                sleep_forever()
            scaled = 0 <= self.batch_change_step <= step
            yield torch.ones(max(1, round(self.elems * self.factor)) if scaled else self.elems)
            step += 1


class Job:
    """One rank of a workload: init, the common faults, the step loop, the done line, destroy.

    A workload builds its groups and state after `Job(a)`, calls `ready()` (--wait-file, calibration,
    the data loader) and then `run(step_fn)`; step_fn(step) does one training step, calling
    `hang_point()`, `slow_ms()`, `wrong_op()`, `scale()` and `ops.add()` where it applies them."""

    def __init__(self, a):
        self.a = a
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.timeout_s))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.ops = Ops()
        self.compute = None
        self._loader = None
        self.gate = FaultGate(a.fault_file)
        self.state = {"w": torch.randn(CKPT_STATE_DIM, CKPT_STATE_DIM)}  # what --ckpt-rank writes
        self.batch = None  # this step's input from the data loader, with --loader

    def fail(self, message: str):
        """Exit on a command line that cannot work in this world (every rank sees the same flags, so
        every rank exits), destroying the process group first (see run())."""
        dist.destroy_process_group()
        raise SystemExit(message)

    def check_world(self, expected=None, shape: str = "") -> None:
        """The world must be the workload's shape (when it has one); fault ranks must be ranks of it."""
        if expected is not None and self.world != expected:
            self.fail(f"world size {self.world} != {shape}")
        for flag in ("hang_rank", "slow_rank", "io_rank", "loader_rank", "ckpt_rank", "wrong_op_rank"):
            r = getattr(self.a, flag)
            if r >= self.world:
                self.fail(f"--{flag.replace('_', '-')} {r}: the world has {self.world} ranks")

    def ready(self) -> None:
        a = self.a
        if a.wait_file:
            while not os.path.exists(a.wait_file):
                time.sleep(0.05)
        self.compute = Compute(a.compute_work)
        if a.loader or a.loader_rank >= 0:
            stall = a.loader_step if self.rank == a.loader_rank else -1
            ds = _Inputs(a.elems, stall, a.batch_change_step, a.batch_factor)
            self._loader = iter(tud.DataLoader(ds, batch_size=None, num_workers=1))

    # -- per-step helpers used by the workloads --

    def scale(self, step: int) -> float:
        """--batch-change-step: the factor on compute and tensor sizes at `step`."""
        return self.a.batch_factor if 0 <= self.a.batch_change_step <= step else 1.0

    def elems(self, step: int) -> int:
        return max(1, round(self.a.elems * self.scale(step)))

    def spin(self, ms: float, step: int) -> None:
        self.compute.spin(ms * self.scale(step))

    def hang_point(self, step: int, where: str) -> None:
        """--hang-rank/--hang-step: call where the fault belongs; sleeps forever when it applies."""
        if self.rank == self.a.hang_rank and self.gate.due("hang", step, self.a.hang_step):
            say(f"rank {self.rank}: hanging at step {step} {where} t {now()}")
            sleep_forever()

    def slow_ms(self, step: int) -> float:
        """Extra compute this rank does in `step` (--slow-*); the onset line at its first step."""
        a = self.a
        if self.rank != a.slow_rank or a.slow_ms <= 0:
            return 0.0
        if "slow" not in self.gate.fired:
            if not self.gate.due("slow", step, a.slow_step):
                return 0.0
            say(f"rank {self.rank}: slowed by {a.slow_ms:g} ms per step from step {step} t {now()}")
        return a.slow_ms

    def wrong_op(self, step: int, group: str, instead_of: str, calls: str = "all_gather") -> bool:
        """True when this rank calls `calls` instead of `instead_of` in `group` at `step`."""
        a = self.a
        if self.rank != a.wrong_op_rank or group != a.wrong_op_group or not self.gate.due("wrong_op", step,
                                                                                           a.wrong_op_step):
            return False
        say(f"rank {self.rank}: calling {calls} instead of {instead_of} in group {group} at step {step} "
            f"t {now()}")
        return True

    def _step_start(self, step: int) -> None:
        """The faults that act at the start of a step, before any of its compute or communication."""
        a, rank = self.a, self.rank
        if step == a.pause_step and a.pause_s > 0:
            say(f"rank {rank}: pausing {a.pause_s:g} s before step {step} t {now()}")
            time.sleep(a.pause_s)
        if rank == a.ckpt_rank and self.gate.due("ckpt", step, a.ckpt_step):
            checkpoint(rank, a.ckpt_s, self.state, a.ckpt_dir or tempfile.gettempdir())
        if step == a.batch_change_step:
            say(f"rank {rank}: batch x {a.batch_factor:g} from step {step} t {now()}")
        if rank == a.io_rank and self.gate.due("io", step, a.io_step):
            say(f"rank {rank}: reading {a.io_path} at step {step} t {now()}")
            try:
                with open(a.io_path, "rb") as f:
                    n = len(f.read(READ_BYTES))
                say(f"rank {rank}: read of {a.io_path} returned {n} bytes t {now()}")
            except OSError as e:
                say(f"rank {rank}: read of {a.io_path} failed: {e.strerror or e} t {now()}")
        if self._loader is not None:
            if step == a.loader_step and rank == a.loader_rank:
                say(f"rank {rank}: waiting on a stalled data loader worker at step {step} t {now()}")
            self.batch = next(self._loader)

    def _time_is_up(self, deadline, step: int, store, state: dict) -> bool:
        """--seconds: every rank stops at the same step. Rank 0 decides and publishes the last step in
        the job's TCPStore; the others read it every STOP_CHECK_EVERY steps (no collective is added,
        so the job's collective stream is exactly its steps')."""
        if "stop_at" not in state and step % STOP_CHECK_EVERY == 0:
            if self.rank == 0 and time.monotonic() >= deadline:
                state["stop_at"] = step + STOP_MARGIN
                store.set(STOP_KEY, str(state["stop_at"]))
            elif self.rank != 0 and store.check([STOP_KEY]):
                state["stop_at"] = int(store.get(STOP_KEY))
        return step >= state.get("stop_at", float("inf"))

    def run(self, step_fn) -> int:
        a = self.a
        deadline = time.monotonic() + a.seconds if a.seconds else None
        store = dist.distributed_c10d._get_default_store() if deadline else None
        stop = {}
        step = 0
        try:
            while step < a.steps if deadline is None else not self._time_is_up(deadline, step, store, stop):
                self._step_start(step)
                step_fn(step)
                step += 1
                if a.progress_every and step % a.progress_every == 0:
                    say(f"rank {self.rank} step {step} t {now()}")
            say(f"rank {self.rank} done: {step} steps, ops {self.ops.counts}")
        finally:
            # also after an error (a collective that failed): a gloo process that exits with its
            # process group alive sometimes aborts at exit (SIGABRT), on top of the error
            self._loader = None  # the loader's worker exits before the process group goes
            dist.destroy_process_group()
        return 0

