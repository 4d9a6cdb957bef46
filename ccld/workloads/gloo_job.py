"""A tiny CPU training-like job over gloo, for the demo, the tests and the benchmarks.

Run it under torchrun (RANK/WORLD_SIZE/MASTER_* come from the environment). Each step does the listed
collectives on small tensors plus a little compute (or, with --ddp, one step of a small model wrapped
in DistributedDataParallel). Faults are injected from the command line, so the job itself stands in
for a user's script that ccld knows nothing about:
  --hang-rank R --hang-step K    rank R sleeps forever before step K (a "not-entered" hang)
  --pause-step K --pause-s S     every rank sleeps S seconds before step K (a healthy long step)
  --ckpt-rank R --ckpt-step K --ckpt-s S
                                 rank R writes checkpoints for S seconds before step K while the
                                 others wait in the next collective (a checkpoint-style pause)
  --wrong-op-rank R --wrong-op-step K
                                 rank R calls all_gather at step K where the others all_reduce
  --wrong-size-rank R --wrong-size-step K [--wrong-size-elems N]
                                 rank R all_reduces N elements (default 2 x --elems) at step K
  --deadlock-step K              two subgroups of ranks 0 and 1 each all_reduce every step; at step K
                                 rank 1 takes them in the opposite order (a cross-communicator deadlock;
                                 ranks 2.. then wait in the default group)
  --slow-rank R --slow-ms M [--slow-step K]
                                 rank R computes M ms more than the others, every step (from step K)
  --fault-file F                 the one-rank faults above (hang, ckpt, wrong-op, wrong-size, deadlock,
                                 slow) also wait for F: each acts at the first of its steps >= K once F
                                 exists (jobkit.FaultGate), so a harness places the onset in time
  --compute-work                 --compute-ms (and --slow-ms) are a fixed amount of work (what the core
                                 does in that time unloaded), not wall time: CPU contention stretches it
  --ddp                          a small nn model in DistributedDataParallel (several buckets) instead
                                 of --ops; the fault flags above still apply
  --seconds S                    run for S seconds instead of --steps (the ranks agree on the last step)
  --wait-file F                  block after init until F exists (lets a tracer attach first)
  --progress-every N             print "rank R step N t UNIX" every N steps (tests watch these)
Prints one line per rank at the end: "rank R done: N steps, ops {op: count}"; each injected fault
prints one line with the Unix time it begins ("... t UNIX"), except --hang-rank (older format).
"""
import argparse
import os
import sys
import tempfile
import time


def say(line: str) -> None:
    """One write(2) per line: ranks share torchrun's stdout, and print() may split a line in two
    writes, interleaving ranks mid-line (tests and users read these lines)."""
    os.write(1, (line + "\n").encode())


WORK_PER_MS = None  # matmuls per ms on this core unloaded, when --compute-work (set by calibrate())


def calibrate(w) -> float:
    """Matmuls per ms of this thread's CPU time (not wall time: on a loaded host the two differ, and
    the work must be the same whatever the load when this runs)."""
    n, c0 = 0, time.thread_time()
    while time.thread_time() - c0 < 0.05:
        w = (w @ w).clamp_(-1, 1)
        n += 1
    return n / ((time.thread_time() - c0) * 1e3)


def spin(ms: float, w):
    """Busy compute for `ms` milliseconds (a stand-in for forward/backward): wall time, or with
    --compute-work that much work; returns the new `w`."""
    if WORK_PER_MS:
        for _ in range(max(1, round(ms * WORK_PER_MS))):
            w = (w @ w).clamp_(-1, 1)
        return w
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        w = (w @ w).clamp_(-1, 1)
    return w


def checkpoint(rank: int, seconds: float, state, directory: str) -> None:
    """Write `state` with torch.save + fsync, again and again, for `seconds` (a checkpoint that is
    busy on CPU and in I/O, not asleep)."""
    import torch
    path = os.path.join(directory, f"ckpt-rank{rank}.pt")
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
    say(f"rank {rank}: checkpoint done ({n} writes) t {time.time():.3f}")


class Bare:
    """A step of bare collectives (--ops) on a tensor of --elems."""

    def __init__(self, a, rank, world, gate):
        import torch
        self.a, self.rank, self.world, self.gate = a, rank, world, gate
        self.ops = [o for o in a.ops.split(",") if o]
        self.counts = {o: 0 for o in self.ops}
        self.t = torch.ones(a.elems)
        self.state = {"w": torch.randn(1024, 1024)}  # 4 MiB: what --ckpt-rank writes

    def step(self, step: int) -> None:
        import torch
        import torch.distributed as dist
        a, rank, world, t, due = self.a, self.rank, self.world, self.t, self.gate.due
        for i, o in enumerate(self.ops):
            first = i == 0
            if first and rank == a.wrong_op_rank and due("wrong_op", step, a.wrong_op_step):
                say(f"rank {rank}: calling all_gather instead of {o} at step {step} t {time.time():.3f}")
                dist.all_gather([torch.empty(a.elems) for _ in range(world)], t)
            elif o == "allreduce":
                if rank == a.wrong_size_rank and due("wrong_size", step, a.wrong_size_step):
                    n = a.wrong_size_elems or 2 * a.elems
                    say(f"rank {rank}: all_reduce of {n} elements instead of {a.elems} at step {step} "
                        f"t {time.time():.3f}")
                    dist.all_reduce(torch.ones(n))
                else:
                    dist.all_reduce(t)
                t.fill_(1.0)
            elif o == "broadcast":
                dist.broadcast(t, src=step % world)
            elif o == "allgather":
                out = [torch.empty(a.elems) for _ in range(world)]
                dist.all_gather(out, t)
            elif o == "reduce_scatter":
                out = torch.empty(a.elems // world)
                dist.reduce_scatter_tensor(out, t[: (a.elems // world) * world])
            elif o == "barrier":
                dist.barrier()
            elif o == "sendrecv":
                peer_to, peer_from = (rank + 1) % world, (rank - 1) % world
                buf = torch.empty(a.elems)
                if rank % 2 == 0:
                    dist.send(t, peer_to)
                    dist.recv(buf, peer_from)
                else:
                    dist.recv(buf, peer_from)
                    dist.send(t, peer_to)
            else:
                raise SystemExit(f"unknown op {o!r}")
            self.counts[o] += 1


class Ddp:
    """A step of a small MLP in DistributedDataParallel: forward, backward (gradient buckets
    all-reduced by DDP's reducer, several per step), SGD."""
    BUCKET_CAP_MB = 0.25  # the model has ~0.6 MB of gradients: a few buckets, as in a real job

    def __init__(self, a, rank, world):
        import torch
        from torch import nn
        from torch.nn.parallel import DistributedDataParallel
        self.a, self.rank = a, rank
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                              nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
        self.model = DistributedDataParallel(model, bucket_cap_mb=self.BUCKET_CAP_MB)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.x, self.y = torch.randn(32, 64), torch.randint(0, 10, (32,))
        self.counts = {"ddp_step": 0}
        self.state = self.model.state_dict

    def step(self, step: int) -> None:
        import torch
        self.opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(self.model(self.x), self.y)
        loss.backward()
        self.opt.step()
        self.counts["ddp_step"] += 1


STOP_CHECK_EVERY = 10  # --seconds: steps between looks at the agreed last step (a store read)
STOP_MARGIN = 2 * STOP_CHECK_EVERY  # ranks in lockstep are a step apart: all see it before they get there


def time_is_up(deadline: float, step: int, rank: int, store, state: dict) -> bool:
    """--seconds: every rank stops at the same step (each deciding alone on its own clock would leave
    one rank a step short and the others waiting for it). Rank 0 decides and publishes the last step
    in the job's TCPStore; the others read it every STOP_CHECK_EVERY steps: no collective is added,
    so the traced collective stream is exactly the job's."""
    if "stop_at" not in state and step % STOP_CHECK_EVERY == 0:
        if rank == 0 and time.monotonic() >= deadline:
            state["stop_at"] = step + STOP_MARGIN
            store.set("ccld_gloo_job_stop_at", str(state["stop_at"]))
        elif rank != 0 and store.check(["ccld_gloo_job_stop_at"]):
            state["stop_at"] = int(store.get("ccld_gloo_job_stop_at"))
    return step >= state.get("stop_at", float("inf"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=23)
    ap.add_argument("--seconds", type=float, default=0, help="run for this long instead of --steps")
    ap.add_argument("--ops", default="allreduce", help="comma list: allreduce,broadcast,allgather,"
                                                       "reduce_scatter,barrier,sendrecv")
    ap.add_argument("--elems", type=int, default=4096)
    ap.add_argument("--compute-ms", type=float, default=2.0)
    ap.add_argument("--step-sleep-ms", type=float, default=0.0)
    ap.add_argument("--hang-rank", type=int, default=-1)
    ap.add_argument("--hang-step", type=int, default=-1)
    ap.add_argument("--pause-step", type=int, default=-1)
    ap.add_argument("--pause-s", type=float, default=0)
    ap.add_argument("--ckpt-rank", type=int, default=-1)
    ap.add_argument("--ckpt-step", type=int, default=-1)
    ap.add_argument("--ckpt-s", type=float, default=10.0)
    ap.add_argument("--ckpt-dir", default="", help="where --ckpt-rank writes (default: a temporary dir)")
    ap.add_argument("--wrong-op-rank", type=int, default=-1)
    ap.add_argument("--wrong-op-step", type=int, default=-1)
    ap.add_argument("--wrong-size-rank", type=int, default=-1)
    ap.add_argument("--wrong-size-step", type=int, default=-1)
    ap.add_argument("--wrong-size-elems", type=int, default=0)
    ap.add_argument("--deadlock-step", type=int, default=-1)
    ap.add_argument("--slow-rank", type=int, default=-1)
    ap.add_argument("--slow-ms", type=float, default=0.0)
    ap.add_argument("--slow-step", type=int, default=0)
    ap.add_argument("--fault-file", default="", help="the one-rank faults act at their step once this file exists")
    ap.add_argument("--ddp", action="store_true")
    ap.add_argument("--compute-work", action="store_true")
    ap.add_argument("--wait-file", default="")
    ap.add_argument("--progress-every", type=int, default=0, help="print 'rank R step N t T' every N steps")
    ap.add_argument("--timeout-s", type=float, default=1800)
    a = ap.parse_args()

    import datetime
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = []
    if a.deadlock_step >= 0:
        # Every rank takes part in new_group; only 0 and 1 build these groups (gloo:1 and gloo:2).
        groups = [dist.new_group([0, 1]), dist.new_group([0, 1])]
    if a.wait_file:
        while not os.path.exists(a.wait_file):
            time.sleep(0.05)
    if __package__:
        from .jobkit import FaultGate
    else:
        from jobkit import FaultGate
    gate = FaultGate(a.fault_file)
    work = Ddp(a, rank, world) if a.ddp else Bare(a, rank, world, gate)
    gt = torch.ones(16)
    w = torch.randn(64, 64)
    if a.compute_work:
        global WORK_PER_MS
        WORK_PER_MS = calibrate(w)
    deadline = time.monotonic() + a.seconds if a.seconds else None
    store, stop = (dist.distributed_c10d._get_default_store() if deadline else None), {}
    step = 0
    while step < a.steps if deadline is None else not time_is_up(deadline, step, rank, store, stop):
        if rank == a.hang_rank and gate.due("hang", step, a.hang_step):
            say(f"rank {rank}: hanging before step {step}")
            while True:
                time.sleep(3600)
        if step == a.pause_step:
            time.sleep(a.pause_s)
        if rank == a.ckpt_rank and gate.due("ckpt", step, a.ckpt_step):
            state = work.state() if callable(work.state) else work.state
            checkpoint(rank, a.ckpt_s, state, a.ckpt_dir or tempfile.gettempdir())
        w = spin(a.compute_ms, w)
        if rank == a.slow_rank and a.slow_ms and ("slow" in gate.fired or gate.due("slow", step, a.slow_step)):
            if gate.fired["slow"] == step:
                say(f"rank {rank}: slowed by {a.slow_ms:g} ms per step from step {step} t {time.time():.3f}")
            w = spin(a.slow_ms, w)
        if groups and rank in (0, 1):
            order = groups[::-1] if (rank == 1 and gate.due("deadlock", step, a.deadlock_step)) else groups
            if order is not groups:
                say(f"rank {rank}: taking the subgroups in the opposite order at step {step} t {time.time():.3f}")
            for g in order:
                dist.all_reduce(gt, group=g)
        work.step(step)
        if a.step_sleep_ms:
            time.sleep(a.step_sleep_ms / 1e3)
        step += 1
        if a.progress_every and step % a.progress_every == 0:
            say(f"rank {rank} step {step} t {time.time():.3f}")
    say(f"rank {rank} done: {step} steps, ops {work.counts}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
