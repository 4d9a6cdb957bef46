"""The gloo probe family through the whole pipeline: a real torchrun job (4 CPU ranks over gloo), the
real Agent with its eBPF uprobes, and an in-process Collector over ZeroMQ on a random 127.0.0.1 port.

What the job does is known exactly (ccld/workloads/gloo_job.py), so the tests count every event. Each
step of `--ops allreduce,broadcast,allgather,barrier,sendrecv` is 4 collectives, then a send to the next
rank and a recv from the previous one. c10d's own per-group seq counts both (6 a step); the collectives'
seq is c10d's collective tag + 1, which counts collectives only, so it is the same on every rank also
where p2p ops differ (pipelines) and when we attach mid-run. Seen on torch 2.13: the default group's
first collective is tag 0 and neither init_process_group (a store-based barrier) nor
destroy_process_group takes one, so the collective seqs of a job are exactly 1 + 4*step + {0, 1, 2, 3};
the n-th send of rank r (to r+1) pairs with the n-th recv of r+1 (from r), n = 1..steps.
Sizes: every rank's enter of an allreduce, broadcast or allgather carries the tensor's bytes (--elems
float32 elements; for allgather the input, the smallest of its buffers); a barrier carries none.
Every process started here is killed (its whole session) even when an assertion fails.
"""
import glob
import os
import re
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional

import pytest

from conftest import GLOO_JOB, ROOT, gloo_job_cmd
from recorder import Recorder

pytestmark = pytest.mark.bpf

WORLD = 4
OPS = "allreduce,broadcast,allgather,barrier,sendrecv"
COLL_OPS = ("allreduce", "broadcast", "allgather", "barrier")  # in the order a step calls them
SEQS_PER_STEP = 4          # the 4 collectives (send and recv are numbered apart, per peer)
STEPS = 23                 # prime: a lost or duplicated event cannot hide in a multiple
LONG_STEPS = 400           # the attach-mid-run job: ~10-30 s here, long enough to attach into
ATTACH_TIMEOUT_S = 120     # torchrun start + symbol scan of libtorch_cpu.so, on a loaded 2-core box
JOB_TIMEOUT_S = 180         # under pytest-timeout's 300 s, so our message (with the output) wins
SETTLE_TIMEOUT_S = 15      # agent stopped -> its last frame reaches the collector
RUNNING_WAIT_S = 1.0       # after gloo's mesh is up in every rank, the job is well into its steps
ELEMS = 4096               # gloo_job.py's default --elems (float32)


def expected_op(seq: int) -> Optional[str]:
    """The collective the workload calls at seq `seq`."""
    return COLL_OPS[(seq - 1) % SEQS_PER_STEP]


def job_colls(steps: int) -> Dict[int, str]:
    return {1 + SEQS_PER_STEP * s + j: op for s in range(steps) for j, op in enumerate(COLL_OPS)}


class Enters:
    """The CollEnters among the items a translator sent from item `start` on."""

    def __init__(self, items: list, start: int):
        self.items, self.start = items, start

    def _all(self) -> list:
        from ccld.bpf.rows import Rows
        return [e for item in self.items[self.start:] for e in (item.events() if isinstance(item, Rows) else [item])
                if e.KIND == "coll"]

    def __iter__(self):
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


class Pipeline:
    """Collector + torchrun job + agent of one test; close() undoes all of it, in that order reversed."""

    def __init__(self, tmp_path, job_env):
        from ccld.collector.server import Collector
        self.tmp, self.env = tmp_path, job_env
        self.lines: List[str] = []   # what the agent and the collector said
        self.collector = Collector(listen="tcp://127.0.0.1:*", on_line=self.lines.append).start()
        self.proc: Optional[subprocess.Popen] = None
        self.agent = None
        self.out_path = str(tmp_path / "torchrun.out")
        self.port = None
        self.emitted: list = []   # every item the gloo translator sent
        self.recorder = None

    def start_job(self, *args, torchrun_args=()) -> subprocess.Popen:
        cmd = gloo_job_cmd(WORLD, *args)
        self.port = int(cmd[cmd.index("--master-port") + 1])
        at = cmd.index(GLOO_JOB)
        cmd[at:at] = list(torchrun_args)
        with open(self.out_path, "w") as out:  # torchrun relays the workers' stdout/stderr
            self.proc = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        return self.proc

    def make_agent(self, **kw):
        from ccld.tracer.agent import Agent
        # gloo only: this file tests the gloo family, and the job is already starting; compiling
        # every family first (~1.5 s each) would let init_process_group pass before the probes are on.
        kw.setdefault("probes", ("gloo",))
        self.agent = Agent(self.collector.endpoint, say=self.lines.append, **kw)
        self.agent.load()
        assert self.agent.bpf_problem is None, f"eBPF did not load: {self.agent.bpf_problem}"
        assert any(fam.NAME == "gloo" for fam, _ in self.agent.families), self.agent.sources
        # Keep every drain the family hands its translator (and what the translator sends), so that
        # check_batch() can replay the kernel's records into the record-by-record reference.
        for i, (fam, tr) in enumerate(self.agent.families):
            if fam.NAME == "gloo":
                self.translator, self.recorder = tr, Recorder(fam.KINDS, forward=tr)
                fam.on_record = self.recorder
                self.agent.families[i] = (fam, self.recorder)
                emit = tr.emit

                def keep(item, emit=emit):
                    self.emitted.append(item)
                    emit(item)
                tr.emit = keep
        return self.agent

    def capture_enters(self) -> List:
        """Every CollEnter the gloo translator sends from now on (the timeline keeps no nbytes)."""
        return Enters(self.emitted, len(self.emitted))

    def check_batch(self) -> None:
        """What the batch translator made of the kernel's records equals what the one-record-at-a-time
        reference makes of the same drains (replayed with the same flushes and process changes):
        every process's communicators in order, and all its other events, in order, field by field."""
        from gloo_reference import ReferenceTranslator
        from test_gloo_batch import compare
        ref_out: list = []
        ref = ReferenceTranslator(ref_out.append)
        self.recorder.replay(ref, feed=ref.feed)
        n = sum(len(a[0]) for w, a in self.recorder.drains if w == "records")
        assert n > 0, "no record was drained"
        compare(self.emitted, ref_out, self.translator, ref)

    def output(self, tail: int = 6000) -> str:
        try:
            with open(self.out_path, errors="replace") as f:
                text = f.read()
        except OSError:
            return "<no torchrun output>"
        return text[-tail:]

    def job_pids(self) -> List[int]:
        """The job's rank processes (RANK and WORLD_SIZE in their environment)."""
        from ccld.tracer import discover
        return sorted(p for p in discover.descendants(self.proc.pid, discover.all_pids())
                      if discover.identify(p) is not None)

    def wait_for(self, what: str, cond, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            if self.proc is not None and self.proc.poll() is not None:
                pytest.fail(f"the job exited (rc {self.proc.returncode}) while waiting for {what}\n"
                            f"{self.output()}\nagent: {self.lines}")
            if time.monotonic() > deadline:
                pytest.fail(f"no {what} within {timeout_s} s\n{self.output()}\nagent: {self.lines}")
            time.sleep(0.1)

    def meshed(self) -> bool:
        """Every rank has its gloo connections to the other ranks: init_process_group is done and,
        with no --wait-file, collectives are running. (libtorch is mapped seconds earlier, at
        `import torch`, and on a loaded machine rendezvous can take longer than any fixed sleep.)"""
        pids = self.job_pids()
        return len(pids) == WORLD and all(peer_sockets(p, self.port) >= WORLD - 1 for p in pids)

    def attached(self) -> List[int]:
        return [p for p, r in list(self.agent.ranks.items()) if "gloo" in r.attached]

    def wait_attached(self) -> None:
        self.wait_for(f"gloo probes on all {WORLD} ranks", lambda: len(self.attached()) == WORLD,
                      ATTACH_TIMEOUT_S)

    def wait_job(self) -> int:
        try:
            return self.proc.wait(JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job did not finish within {JOB_TIMEOUT_S} s\n{self.output()}")

    def finish_tracing(self):
        """Stop the agent (detach, final flush), wait until the collector has every frame it sent,
        stop the collector; return the timeline, now safe to read from this thread."""
        self.agent.stop()
        sent, aid, col = self.agent.shipper.sent_frames, self.agent.agent_id, self.collector
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        got = 0
        while time.monotonic() < deadline:
            with col._lock:  # the timeline belongs to the ingest thread while the collector runs
                got = col.timeline.agents.get(aid, {}).get("frames", 0)
            if got >= sent:
                break
            time.sleep(0.05)
        col.stop()
        assert got == sent, f"the collector got {got} of the agent's {sent} frames"
        assert col.counters.frames_rejected == {} and col.counters.bad_events == {}, col.counters.to_dict()
        return col.timeline

    def close(self) -> None:
        if self.proc is not None:
            # torchrun's workers run in sessions of their own: a SIGKILLed torchrun leaves them behind
            ranks = self.job_pids() if self.proc.poll() is None else []
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # torchrun and what stayed in its session
            except ProcessLookupError:
                pass
            for pid in ranks:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.wait()
        if self.agent is not None:
            self.agent.stop()
        self.collector.stop()


@pytest.fixture
def pipeline(need_bpf, tmp_path, job_env):
    p = Pipeline(tmp_path, job_env)
    try:
        yield p
    finally:
        p.close()


def peer_sockets(pid: int, master_port: int) -> int:
    """Established TCP connections of `pid` other than those to the rendezvous store (master_port)."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[len("socket:["):-1])
        n = 0
        for table in ("tcp", "tcp6"):
            with open(f"/proc/{pid}/net/{table}") as f:
                for line in f.readlines()[1:]:
                    fields = line.split()  # sl local rem st ... inode (10th)
                    ports = {int(fields[1].rsplit(":", 1)[1], 16), int(fields[2].rsplit(":", 1)[1], 16)}
                    if fields[9] in inodes and fields[3] == "01" and master_port not in ports:
                        n += 1
        return n
    except OSError:
        return 0  # the process is gone


def the_comm(tl, port: int):
    """The job's one gloo communicator: the default group, named <job>/gloo:0 (job = master addr:port)."""
    want = f"127.0.0.1:{port}/gloo:0"
    assert list(tl.comms) == [want], f"communicators: {list(tl.comms)}"
    return tl.comms[want]


def assert_no_loss(tl) -> None:
    """The agent's final loss report: present for the gloo family, and all zero."""
    assert len(tl.agent_loss) == 1, f"loss reports: {tl.agent_loss}"
    loss = next(iter(tl.agent_loss.values()))
    assert "gloo_ringbuf_lost" in loss, f"the final loss report lacks the ring-buffer counter: {loss}"
    bad = {k: v for k, v in loss.items() if v and k != "gloo_unmatched"}
    assert not bad, f"events were lost or malformed: {loss}"


def describe(view) -> str:
    return (f"seq {view.seq}: ops {dict(sorted(view.ops.items()))} enter {sorted(view.enter)} "
            f"start {sorted(view.start)} end {sorted(view.end)} failed {sorted(view.failed)}")


def test_exact_counts_and_matching(pipeline, tmp_path):
    """23 steps of every op, traced from before the first collective: every event exactly once."""
    go = tmp_path / "go"
    proc = pipeline.start_job("--steps", STEPS, "--ops", OPS, "--wait-file", go)
    agent = pipeline.make_agent(root_pid=proc.pid)
    enters = pipeline.capture_enters()
    agent.start()
    pipeline.wait_attached()
    go.touch()
    rc = pipeline.wait_job()
    assert rc == 0, f"job failed (rc {rc}):\n{pipeline.output()}"
    tl = pipeline.finish_tracing()

    sizes: Dict[str, set] = {}
    for e in enters:
        sizes.setdefault(e.op, set()).add((e.nbytes, e.count, e.dtype))
    want_size = {op: {(4 * ELEMS, -1, "")} for op in ("allreduce", "broadcast", "allgather")}
    assert sizes == dict(want_size, barrier={(-1, -1, "")}), f"sizes by op: {sizes}"
    assert len(enters) == WORLD * STEPS * len(COLL_OPS)
    (tr,) = [tr for fam, tr in pipeline.agent.families if fam.NAME == "gloo"]
    assert tr.unsized == 0, "an enter waited HOLD_MS for its size and went without it"

    want = {(r, op): STEPS for r in range(WORLD) for op in COLL_OPS}
    assert dict(tl.enter_counts) == want, f"CollEnter counts: {sorted(tl.enter_counts.items())}"
    assert dict(tl.end_counts) == want, f"WorkEnd counts: {sorted(tl.end_counts.items())}"
    want_p2p = {(r, op): STEPS for r in range(WORLD) for op in ("send", "recv")}
    assert dict(tl.p2p_counts) == want_p2p, f"P2P counts: {sorted(tl.p2p_counts.items())}"

    comm = the_comm(tl, pipeline.port)
    assert comm.group_size == WORLD and comm.members == set(range(WORLD))
    want_seqs = job_colls(STEPS)
    got_seqs = {s: v.op for s, v in comm.colls.items()}
    assert got_seqs == want_seqs, (f"collective seqs differ from the workload's: missing "
                                   f"{sorted(set(want_seqs) - set(got_seqs))}, extra "
                                   f"{sorted(set(got_seqs) - set(want_seqs))}, wrong op "
                                   f"{[(s, got_seqs[s], want_seqs[s]) for s in sorted(set(got_seqs) & set(want_seqs)) if got_seqs[s] != want_seqs[s]]}")
    everyone = set(range(WORLD))
    bad = [describe(v) for v in comm.colls.values()
           if not (set(v.enter) == set(v.start) == set(v.end) == everyone) or v.failed
           or set(v.ops.values()) != {want_seqs[v.seq]} or v.completed_at is None]
    assert not bad, "collectives not matched across all ranks:\n" + "\n".join(bad[:20])
    assert comm.completed == len(want_seqs)
    lib_seqs = sorted({e.lib_seq for e in enters})  # c10d's own numbering: 6 a step, with the p2p ops
    assert lib_seqs == sorted(1 + 6 * s + j for s in range(STEPS) for j in range(len(COLL_OPS))), lib_seqs[:12]
    # p2p: the n-th send r -> r+1 with the n-th recv of r+1 from r, every one over, sizes on both sides
    p2p = comm.p2p
    assert p2p is not None and p2p.exact == everyone, "p2p numbering should begin with the group"
    for r in range(WORLD):
        dst = (r + 1) % WORLD
        pairs = list(p2p.pairs(r, dst, r, dst))
        assert [s.seq for s, _ in pairs] == list(range(1, STEPS + 1)), f"stream {r}->{dst}: {len(pairs)} pairs"
        bad = [(s.seq, s.ended, v.ended, s.nbytes, v.nbytes) for s, v in pairs
               if s.ended is None or v.ended is None or not (s.ok and v.ok) or s.nbytes != 4 * ELEMS
               or v.nbytes != 4 * ELEMS or v.ended < s.posted]
        assert not bad, f"stream {r}->{dst}: transfers not over, failed, unsized or out of order: {bad[:5]}"
    assert not p2p.open, f"p2p ops never over: {p2p.open}"
    assert (p2p.posted, p2p.ended) == (2 * WORLD * STEPS, 2 * WORLD * STEPS)
    assert not tl.anomalies, f"timeline anomalies: {dict(tl.anomalies)}"
    assert_no_loss(tl)
    assert next(iter(tl.agent_loss.values())).get("gloo_unmatched") == 0
    pipeline.check_batch()


def test_attach_to_running_job(pipeline):
    """Attached mid-run, the ranks' own seqs still join them: same seq, same op, every rank there."""
    proc = pipeline.start_job("--steps", LONG_STEPS, "--step-sleep-ms", 20, "--ops", OPS)
    # Compile the programs while the job starts (1-2 s); attaching happens at start(), below.
    agent = pipeline.make_agent(pids=[proc.pid])
    pipeline.wait_for("gloo connections between all ranks", pipeline.meshed, ATTACH_TIMEOUT_S)
    time.sleep(RUNNING_WAIT_S)
    assert proc.poll() is None, f"the job ended before we attached:\n{pipeline.output()}"
    agent.start()
    pipeline.wait_attached()
    rc = pipeline.wait_job()
    assert rc == 0, f"job failed (rc {rc}):\n{pipeline.output()}"
    tl = pipeline.finish_tracing()

    comm = the_comm(tl, pipeline.port)
    everyone = set(range(WORLD))
    full = sorted(s for s, v in comm.colls.items() if set(v.enter) == everyone)
    assert full, f"no collective seen on all ranks; seqs {list(comm.colls)[:20]}"
    first = full[0]
    print(f"first collective seen on every rank: seq {first}; partial before it: "
          f"{[describe(v) for s, v in comm.colls.items() if s < first]}")
    assert first > 1, "the agent attached before the job's first collective: this test did not attach mid-run"
    # Before `first`, the ranks were being added one by one (a few ms apart): a collective may lack
    # the ranks not traced yet. The ops of those that did report it must still agree with the seq.
    wrong_op = [describe(v) for v in comm.colls.values()
                if any(op != expected_op(v.seq) for op in v.ops.values()) or v.op != expected_op(v.seq)]
    assert not wrong_op, "same seq, different op (off by one?):\n" + "\n".join(wrong_op[:20])
    want = {s: op for s, op in job_colls(LONG_STEPS).items() if s >= first}
    got = {s: v.op for s, v in comm.colls.items() if s >= first}
    assert got == want, (f"from seq {first} on: missing {sorted(set(want) - set(got))[:20]}, "
                         f"extra {sorted(set(got) - set(want))[:20]}")
    bad = [describe(comm.colls[s]) for s in want
           if not (set(comm.colls[s].enter) == set(comm.colls[s].end) == everyone) or comm.colls[s].failed]
    assert not bad, f"collectives from seq {first} on not matched across all ranks:\n" + "\n".join(bad[:20])
    no_enter = [describe(v) for v in comm.colls.values() if not set(v.end) <= set(v.enter)]
    assert not no_enter, "ended without entering:\n" + "\n".join(no_enter[:20])
    last = max(job_colls(LONG_STEPS))
    assert comm.max_seq == last, f"last seq {comm.max_seq}, the workload's last collective is {last}"
    assert not tl.anomalies, f"timeline anomalies: {dict(tl.anomalies)}"
    assert_no_loss(tl)
    pipeline.check_batch()


def test_hang_timeout_is_a_python_error(pipeline, tmp_path):
    """A gloo timeout under our probes stays the job's normal RuntimeError (entry-only probes: no
    uretprobe frame for the C++ exception to unwind through), and we see it as WorkEnd(ok=False)."""
    go, logs = tmp_path / "go", tmp_path / "logs"
    hang_rank, hang_step = 3, 5
    # --tee: each rank's stdout/stderr also in its own file under --log-dir. --monitor-interval 3:
    # torchrun SIGTERMs the others at its first look after a failure; the three timeouts fire within
    # milliseconds of each other, and this lets each rank print its error before being stopped.
    proc = pipeline.start_job("--steps", STEPS, "--ops", OPS, "--wait-file", go, "--timeout-s", 3,
                              "--hang-rank", hang_rank, "--hang-step", hang_step,
                              torchrun_args=["--log-dir", str(logs), "--tee", "3", "--monitor-interval", "3"])
    pipeline.make_agent(root_pid=proc.pid).start()
    pipeline.wait_attached()
    go.touch()
    rc = pipeline.wait_job()
    out = pipeline.output(tail=100_000)
    assert rc != 0, f"torchrun exited 0 although rank {hang_rank} hung:\n{out[-6000:]}"
    tl = pipeline.finish_tracing()

    assert "terminate called" not in out, f"a rank died in std::terminate:\n{out[-6000:]}"
    assert "SIGABRT" not in out and "Signal 6 " not in out, f"a rank died of SIGABRT:\n{out[-6000:]}"
    codes = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", out)]
    assert -signal.SIGABRT not in codes, f"exit codes {codes}:\n{out[-6000:]}"
    for r in range(WORLD):
        if r == hang_rank:
            continue
        found = glob.glob(str(logs / "*" / "attempt_0" / str(r) / "stderr.log"))
        assert len(found) == 1, f"rank {r}'s stderr log: {found} under {logs}"
        with open(found[0], errors="replace") as f:
            err = f.read()
        assert "RuntimeError" in err, f"rank {r} did not fail with gloo's RuntimeError:\n{err[-3000:]}"
        assert "terminate called" not in err, f"rank {r}:\n{err[-3000:]}"

    comm = the_comm(tl, pipeline.port)
    hung = 1 + SEQS_PER_STEP * hang_step  # the first collective of the step rank 3 never starts
    assert hung in comm.colls, f"no collective at seq {hung}; last seqs {list(comm.colls)[-8:]}"
    view = comm.colls[hung]
    others = set(range(WORLD)) - {hang_rank}
    assert set(view.enter) == set(view.end) == set(view.failed) == others, describe(view)
    assert set(view.ops.values()) == {expected_op(hung)}, describe(view)
    assert all("finishWorkGlooError" in why for why in view.failed.values()), view.failed
    assert comm.last_entered[hang_rank][0] == hung - 1, (  # its last: the barrier of step 4
        f"rank {hang_rank} last entered {comm.last_entered[hang_rank]}")
    before = [describe(v) for s, v in comm.colls.items()
              if s < hung and (set(v.end) != set(range(WORLD)) or v.failed)]
    assert not before, "collectives before the hang did not all complete:\n" + "\n".join(before)
    assert_no_loss(tl)
    pipeline.check_batch()


@pytest.mark.unit
def test_agent_ebpf_prints_programs():
    """`ccld agent --ebpf` prints each family's final program with its cflags; needs no root."""
    bpf_dir = os.path.join(ROOT, "ccld", "bpf")
    res = subprocess.run([sys.executable, "-m", "ccld.cli", "agent", "--ebpf"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, f"rc {res.returncode}\n{res.stderr[-3000:]}"
    parts = re.split(r"^(?=// cflags: )", res.stdout, flags=re.M)
    programs = [p for p in parts if p.strip()]
    from ccld.tracer.families import FAMILY_NAMES
    names = [f"{fam}.bpf.c" for fam in FAMILY_NAMES]
    assert len(programs) == len(names), f"expected {len(names)} programs, got {len(programs)}:\n{res.stdout[:2000]}"
    for text, name in zip(programs, names):
        header = f"/* {name}: "
        cflags, _, body = text.partition("\n")
        assert f"-I{bpf_dir}" in cflags.split(), f"{name}: cflags line {cflags!r}"
        assert body.startswith(header), f"{name}: program starts {body[:200]!r}"
        with open(os.path.join(bpf_dir, name)) as f:
            assert body.rstrip("\n") == f.read().rstrip("\n"), f"{name}: printed program differs from the file"
