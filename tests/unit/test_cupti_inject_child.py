"""The injected shim in REAL child Python processes (sitecustomize on PYTHONPATH, as `ccld run` sets it),
with the fake CUPTI named by CCLD_CUPTI_MODULE: the job's output and exit status never change, CUPTI
failures at start, flush or exit cost one stderr line, a hung exit flush does not hang the job, an
existing sitecustomize still runs, and a healthy rank's kernels reach a real CuptiSink."""
import os
import subprocess
import sys
import textwrap
import time

import pytest

from ccld import wire as ev
from ccld.cupti import inject, shim
from ccld.tracer.cupti_sink import CuptiSink

pytestmark = pytest.mark.unit

UNIT_DIR = os.path.dirname(os.path.abspath(__file__))
N = 23
JOB = textwrap.dedent(f"""
    import os, sys, threading, time
    import fake_cupti  # the same module object the shim loaded as its CUPTI
    for _ in range({N}):
        fake_cupti.launch("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)")
        fake_cupti.launch("_ZN2at6native6kernelEv")
    if len(sys.argv) > 2:
        time.sleep(float(sys.argv[2]))  # long enough for periodic flushes
    with open(sys.argv[1], "w") as f:
        f.write(f"{{os.getpid()}} {{threading.get_native_id()}} {{int('ccld.cupti.shim' in sys.modules)}} "
                f"{{os.environ.get('CCLD_CUPTI_OWNER', '')}}")
    print("job-out: step 1 loss 0.5")
    print("job-err: a warning of the job's own", file=sys.stderr)
    sys.exit(7)
""")


@pytest.fixture
def job(tmp_path):
    p = tmp_path / "job.py"
    p.write_text(JOB)
    return p


@pytest.fixture
def sink():
    got = []
    s = CuptiSink(got.append)
    s.got = got
    yield s
    s.close()


def child_env(endpoint, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CCLD_", "FAKE_CUPTI_"))}
    env.update(PYTHONPATH=os.pathsep.join([inject.SHIM_DIR, UNIT_DIR]), CCLD_CUPTI_ENDPOINT=endpoint,
               CCLD_CUPTI_MODULE="fake_cupti", CCLD_CUPTI_FORCE="1", RANK="0", WORLD_SIZE="1")
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}


def run(job, env, *args, timeout=60):
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, str(job), str(job) + ".info", *args], env=env, capture_output=True,
                       text=True, timeout=timeout)
    p.took = time.monotonic() - t0
    pid, tid, shim_loaded, owner = (open(str(job) + ".info").read().split(" ") + [""])[:4]
    p.pid, p.tid, p.shim_loaded, p.owner = int(pid), int(tid), shim_loaded == "1", owner
    return p


def baseline(job):
    """The job as it runs without ccld (its PYTHONPATH has the fake only because the job imports it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CCLD_", "FAKE_CUPTI_"))}
    return run(job, dict(env, PYTHONPATH=UNIT_DIR))


def received(sink, until, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sink.poll()
        if until(sink.got):
            break
        time.sleep(0.02)
    return sink.got


def ccld_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("ccld:")]


def assert_job_unchanged(p, base):
    assert p.returncode == base.returncode == 7
    assert p.stdout == base.stdout == "job-out: step 1 loss 0.5\n"
    assert "job-err: a warning of the job's own" in p.stderr


def test_healthy_rank_ships_its_nccl_kernels(job, sink):
    base = baseline(job)
    p = run(job, child_env(sink.endpoint), "1.2")
    assert_job_unchanged(p, base)
    assert ccld_lines(p.stderr) == [] and p.shim_loaded and p.owner == str(p.pid)
    got = received(sink, lambda g: any(isinstance(e, ev.GpuLoss) and e.counters.get("kernels_out") == N for e in g))
    ks = [e for e in got if isinstance(e, ev.GpuKernel)]
    assert len(ks) == N and {(k.pid, k.rank, k.launch_tid, k.op) for k in ks} == {(p.pid, 0, p.tid, "allreduce")}
    loss = [e for e in got if isinstance(e, ev.GpuLoss)][-1].counters
    assert (loss["kernels_filtered"], loss["cupti_dropped"], loss["queue_dropped"]) == (N, 0, 0)
    assert loss["msgs_sent"] >= 2  # periodic flushes ran, then the exit flush
    assert [e.ok for e in got if isinstance(e, ev.ProbeStatus)] == [True]


@pytest.mark.parametrize("fail, words", [
    ("start", "start failed: RuntimeError: fake CUPTI: CUPTI_ERROR_NOT_INITIALIZED"),
    ("flush", "flush failed: RuntimeError: fake CUPTI: CUPTI_ERROR_UNKNOWN in flush"),
    ("exit", "exit failed: RuntimeError: fake CUPTI: CUPTI_ERROR_UNKNOWN at disable"),
])
def test_cupti_failure_costs_one_line_and_nothing_else(job, sink, fail, words):
    base = baseline(job)
    p = run(job, child_env(sink.endpoint, FAKE_CUPTI_FAIL=fail), "0.8")
    assert_job_unchanged(p, base)
    lines = ccld_lines(p.stderr)
    assert len(lines) == 1 and words in lines[0] and f"pid {p.pid}, rank 0" in lines[0], p.stderr
    got = received(sink, lambda g: any(isinstance(e, ev.ProbeStatus) and not e.ok for e in g))
    assert any(isinstance(e, ev.ProbeStatus) and not e.ok and fail in e.message for e in got)


def test_no_gpu_costs_one_line(job, sink):
    p = run(job, child_env(sink.endpoint, FAKE_CUPTI_NO_GPU="1"))
    assert_job_unchanged(p, baseline(job))
    lines = ccld_lines(p.stderr)
    assert len(lines) == 1 and "NotSupportedError" in lines[0]


def test_a_hung_exit_flush_does_not_hang_the_job(job, sink):
    p = run(job, child_env(sink.endpoint, FAKE_CUPTI_FAIL="hang-exit"), timeout=shim.EXIT_TIMEOUT_S + 30)
    assert_job_unchanged(p, baseline(job))
    lines = ccld_lines(p.stderr)
    assert len(lines) == 1 and "did not finish" in lines[0]
    assert p.took < shim.EXIT_TIMEOUT_S + 10  # python start-up + the bounded wait, not forever


def test_no_agent_listening_changes_nothing(job, tmp_path):
    p = run(job, child_env(f"ipc://{tmp_path}/nobody-listens"))
    assert_job_unchanged(p, baseline(job))
    assert ccld_lines(p.stderr) == []


def test_a_missing_cupti_module_costs_one_line(job, sink):
    p = run(job, child_env(sink.endpoint, CCLD_CUPTI_MODULE="no_such_cupti_module"))
    assert_job_unchanged(p, baseline(job))
    lines = ccld_lines(p.stderr)
    assert len(lines) == 1 and "ModuleNotFoundError" in lines[0]


def test_not_a_rank_loads_nothing(job, sink):
    p = run(job, child_env(sink.endpoint, RANK=None))
    assert_job_unchanged(p, baseline(job))
    assert not p.shim_loaded and ccld_lines(p.stderr) == []


def test_the_jobs_own_sitecustomize_still_runs(job, sink, tmp_path):
    own = tmp_path / "own"
    own.mkdir()
    (own / "sitecustomize.py").write_text("import os\nos.environ['OWN_SITECUSTOMIZE'] = 'ran'\n"
                                          "print('own sitecustomize ran', flush=True)\n")
    env = child_env(sink.endpoint)
    env["PYTHONPATH"] += os.pathsep + str(own)
    p = run(job, env, "0.6")
    assert p.returncode == 7 and p.stdout == "own sitecustomize ran\njob-out: step 1 loss 0.5\n"
    assert ccld_lines(p.stderr) == [] and p.shim_loaded
    assert received(sink, lambda g: sum(isinstance(e, ev.GpuKernel) for e in g) == N)


def test_a_failing_own_sitecustomize_is_reported_as_python_would(job, sink, tmp_path):
    own = tmp_path / "own"
    own.mkdir()
    (own / "sitecustomize.py").write_text("raise ValueError('broken site')\n")
    env = child_env(sink.endpoint)
    env["PYTHONPATH"] += os.pathsep + str(own)
    p = run(job, env)
    assert p.returncode == 7 and "Error in sitecustomize" in p.stderr and "broken site" in p.stderr
    assert ccld_lines(p.stderr) == [] and p.shim_loaded


def test_processes_a_rank_starts_are_not_captured_again(sink, tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent("""
        import subprocess, sys
        child = "import os; print(os.environ.get('CCLD_CUPTI_OWNER'))"
        print(subprocess.run([sys.executable, "-c", child], capture_output=True, text=True).stdout.strip())
        import os; print(os.getpid())
    """))
    p = subprocess.run([sys.executable, str(script)], env=child_env(sink.endpoint), capture_output=True, text=True,
                       timeout=60)
    owner_seen_by_child, parent_pid = p.stdout.split()
    assert owner_seen_by_child == parent_pid
    got = received(sink, lambda g: any(isinstance(e, ev.ProbeStatus) for e in g))
    time.sleep(0.3)
    sink.poll()
    assert {e.pid for e in got if isinstance(e, ev.ProbeStatus)} == {int(parent_pid)}
