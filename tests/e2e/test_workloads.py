"""The parallelism workloads (ccld/workloads/pipeline_job.py, fsdp_job.py, hybrid_job.py) run for real,
without ccld, and every rank's done line has exactly the op counts their flags imply; the D-state
injector (tests/fusebed.py) blocks a reader in D and lets it go at close().

The counts are computed here from the flags, independently of the workloads' code: a lost or doubled
send, recv or collective changes them. Steps and micro-batches are odd primes where it costs nothing.
One fault rides along in each job where it leaves the counts alone (pause, slow, batch change,
checkpoint, the FUSE read), so its "... t UNIX" line is checked too. The 1F1B order is also checked
without processes: a simulation of rendezvous send/recv over many shapes must never deadlock.
Budget on 2 vCPUs: ~1-1.5 minutes (four torchrun jobs of 4-8 ranks, ~10-25 s each).
"""
import ast
import os
import re
import subprocess
import sys
import time

import pytest

import fault_scenarios as fs
from conftest import torch_skip_reason

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKLOADS = os.path.join(ROOT, "ccld", "workloads")
RUN_TIMEOUT_S = 150.0   # torchrun + import torch of 8 ranks on a loaded 2-core box, then a few steps
BLOCK_TIMEOUT_S = 20.0  # a read of the stuck file shows D within this (it takes milliseconds)
DONE = re.compile(r"^rank (\d+) done: (\d+) steps, ops (\{.*\})$", re.M)
STEPS = 3


@pytest.fixture
def session(tmp_path):
    reason = torch_skip_reason()
    if reason:
        pytest.skip(reason)
    s = fs.Session(tmp_path)
    yield s
    s.cleanup()


def torchrun(script: str, nproc: int, *args) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
            "127.0.0.1", "--master-port", str(fs.free_port()), os.path.join(WORKLOADS, script)] + [str(a) for a in args]


def run_job(s, name: str, script: str, nproc: int, *args):
    """Run a workload to its end: (exit status, log text, {rank: (steps, ops)})."""
    p, log = s.start(name, torchrun(script, nproc, *args))
    try:
        rc = p.wait(RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        rc = None
    text = open(log, errors="replace").read()
    done = {int(m.group(1)): (int(m.group(2)), ast.literal_eval(m.group(3))) for m in DONE.finditer(text)}
    return rc, text, done


def expect_done(rc, text, done, expected: dict):
    assert rc == 0, text[-3000:]
    assert sorted(done) == sorted(expected), text[-3000:]
    for rank, ops in expected.items():
        assert done[rank] == (STEPS, ops), f"rank {rank}: {done[rank]} != {(STEPS, ops)}"


def fault_lines(text: str, what: str) -> dict:
    """{rank: onset} of the lines 'rank R: <what> ... t UNIX'."""
    return {int(m.group(1)): float(m.group(2))
            for m in re.finditer(rf"^rank (\d+): {what}.* t (\d+\.\d+)$", text, re.M)}


def pipeline_ops(rank: int, stages: int, dp: int, microbatches: int, group: str) -> dict:
    """A stage sends and receives one tensor per micro-batch per neighbouring stage (activations
    forward, gradients back); with dp > 1 a gradient all_reduce in its dp group; the loss all_reduce."""
    stage = rank // dp
    links = (stage > 0) + (stage < stages - 1)
    suffix = f"@{group}" if group else ""
    ops = {"send" + suffix: microbatches * links * STEPS, "recv" + suffix: microbatches * links * STEPS,
           "all_reduce": STEPS}
    if dp > 1:
        ops["all_reduce@dp"] = STEPS
    return ops


@pytest.mark.e2e
def test_pipeline_gpipe_blocking_on_the_default_group(session):
    m = 5
    rc, text, done = run_job(session, "gpipe", "pipeline_job.py", 4, "--steps", STEPS, "--microbatches", m,
                             "--schedule", "gpipe", "--p2p", "blocking", "--pp-group", "default",
                             "--compute-ms", 0.5, "--pause-step", 1, "--pause-s", 0.2,
                             "--slow-rank", 2, "--slow-ms", 5, "--slow-step", 1,
                             "--batch-change-step", 2, "--batch-factor", 1.5)
    expect_done(rc, text, done, {r: pipeline_ops(r, 4, 1, m, "") for r in range(4)})
    assert sorted(fault_lines(text, "pausing 0.2 s before step 1")) == [0, 1, 2, 3]
    assert sorted(fault_lines(text, "batch x 1.5 from step 2")) == [0, 1, 2, 3]
    assert list(fault_lines(text, "slowed by 5 ms per step from step 1")) == [2]


@pytest.mark.e2e
def test_pipeline_1f1b_batched_p2p_on_its_own_group(session):
    m = 7  # > stages - 1: warm-up, steady and cool-down phases on every stage
    rc, text, done = run_job(session, "1f1b", "pipeline_job.py", 4, "--steps", STEPS, "--microbatches", m,
                             "--schedule", "1f1b", "--p2p", "batch", "--pp-group", "own", "--compute-ms", 0.5)
    expect_done(rc, text, done, {r: pipeline_ops(r, 4, 1, m, "pp") for r in range(4)})


@pytest.mark.e2e
def test_fsdp_counts_and_a_rank_stuck_in_io_until_the_filesystem_lets_go(session, tmp_path):
    fusebed = pytest.importorskip("fusebed")
    layers = 3
    try:
        stuck = fusebed.StuckFuse(str(tmp_path / "mnt"))
    except OSError as e:
        pytest.skip(f"cannot mount the FUSE injector: {e}")
    with stuck:
        p, log = session.start("fsdp", torchrun("fsdp_job.py", 4, "--steps", STEPS, "--layers", layers,
                                                "--compute-ms", 0.5, "--io-rank", 1, "--io-step", 1,
                                                "--io-path", stuck.path, "--ckpt-rank", 0, "--ckpt-step", 2,
                                                "--ckpt-s", 0.3, "--ckpt-dir", str(tmp_path)))
        fs.wait_for(log, r"^rank 1: reading .*stuck at step 1 t ", RUN_TIMEOUT_S, p)
        pid = session.rank_pid(1)
        assert pid is not None
        assert wait_state(pid, "D"), f"rank 1 (pid {pid}) is {fusebed.proc_state(pid)!r}, not in D"
        time.sleep(1.0)
        assert fusebed.proc_state(pid) == "D" and p.poll() is None  # still stuck, and so is the job
    fs.wait_for(log, r"^rank 1: read of .*stuck failed: ", 30, p)
    try:
        rc = p.wait(RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        rc = None
    text = open(log, errors="replace").read()
    done = {int(m.group(1)): (int(m.group(2)), ast.literal_eval(m.group(3))) for m in DONE.finditer(text)}
    ops = {"all_gather_into_tensor": 2 * layers * STEPS, "reduce_scatter_tensor": layers * STEPS}
    expect_done(rc, text, done, {r: ops for r in range(4)})
    assert list(fault_lines(text, "checkpointing for 0.3 s")) == [0]


@pytest.mark.e2e
def test_hybrid_tp_pp_dp_over_8_ranks(session):
    layers, m = 2, 3
    rc, text, done = run_job(session, "hybrid", "hybrid_job.py", 8, "--steps", STEPS, "--layers", layers,
                             "--microbatches", m, "--compute-ms", 0.3)
    # tp fastest: ranks 0-3 are stage 0, 4-7 stage 1; every rank has exactly one pp neighbour
    ops = {"all_reduce@tp": 2 * layers * m * STEPS, "send@pp": m * STEPS, "recv@pp": m * STEPS,
           "all_reduce@dp": STEPS}
    expect_done(rc, text, done, {r: ops for r in range(8)})


def wait_state(pid: int, state: str, timeout: float = BLOCK_TIMEOUT_S) -> bool:
    import fusebed
    deadline = time.time() + timeout
    while time.time() < deadline:
        if fusebed.proc_state(pid) == state:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.e2e
def test_stuck_fuse_holds_a_reader_in_d_until_close(tmp_path):
    fusebed = pytest.importorskip("fusebed")
    mnt = tmp_path / "mnt"
    try:
        stuck = fusebed.StuckFuse(str(mnt))
    except OSError as e:
        pytest.skip(f"cannot mount the FUSE injector: {e}")
    reader = "import sys\ntry:\n    open(sys.argv[1], 'rb').read(100)\nexcept OSError as e:\n    print('failed', e.errno)\n"
    with stuck:
        assert os.stat(stuck.path).st_size > 0
        p = subprocess.Popen([sys.executable, "-c", reader, stuck.path], stdout=subprocess.PIPE, text=True)
        try:
            assert wait_state(p.pid, "D"), fusebed.proc_state(p.pid)
            time.sleep(1.0)
            assert fusebed.proc_state(p.pid) == "D" and stuck.pending_reads() >= 1
        except BaseException:
            p.kill()
            raise
    out, _ = p.communicate(timeout=10)
    assert p.returncode == 0 and out.startswith("failed "), out
    assert "stuckfuse" not in open("/proc/mounts").read()
    assert not mnt.exists()  # it made the mountpoint, and removed it
    stuck.close()  # twice is harmless


def simulate(units_by_stage) -> bool:
    """Rendezvous p2p: an op completes once its peer has posted the matching op; a unit (one op, or
    a batch) completes when all its ops have. True when every stage gets to its end."""
    from ccld.workloads import pipeline_job as pj
    stages = len(units_by_stage)
    pos, posted = [0] * stages, [set() for _ in range(stages)]

    def peer(stage, op, phase):
        return stage + (1 if (op == pj.SEND) == (phase == pj.FORWARD) else -1)
    moved = True
    while moved:
        moved = False
        for s in range(stages):
            while pos[s] < len(units_by_stage[s]):
                unit = [a for a in units_by_stage[s][pos[s]] if a[0] != "compute"]
                posted[s].update(unit)
                if not all(((pj.RECV if op == pj.SEND else pj.SEND), ph, mb) in posted[peer(s, op, ph)]
                           for op, ph, mb in unit):
                    break
                pos[s] += 1
                moved = True
    return all(pos[s] == len(units_by_stage[s]) for s in range(stages))


def test_pipeline_schedules_cannot_deadlock():
    if torch_skip_reason():
        pytest.skip(torch_skip_reason())
    from ccld.workloads import pipeline_job as pj
    for stages in range(2, 9):
        for m in range(1, 11):
            for kind in ("gpipe", "1f1b"):
                plans = [pj.schedule(s, stages, m, kind) for s in range(stages)]
                for s, plan in enumerate(plans):  # every micro-batch forward and backward, once
                    assert sorted(a[1:] for a in plan if a[0] == "compute") == \
                        sorted((ph, i) for ph in (pj.FORWARD, pj.BACKWARD) for i in range(m))
                assert simulate([[[a] for a in plan] for plan in plans]), (stages, m, kind, "blocking")
                assert simulate([pj.batches(plan) for plan in plans]), (stages, m, kind, "batch")
    # the textbook 1F1B order (send the next forward, then receive a backward) deadlocks here
    naive = []
    for s in range(4):
        plan = pj.schedule(s, 4, 4, "1f1b")
        for i in range(len(plan) - 1):
            if plan[i][:2] == (pj.RECV, pj.BACKWARD) and plan[i + 1][:2] == (pj.SEND, pj.FORWARD):
                plan[i], plan[i + 1] = plan[i + 1], plan[i]
        naive.append([[a] for a in plan])
    assert not simulate(naive)
