"""`ccld run -- python job.py` and CUPTI, end to end, on a machine without a GPU.

1. As a user runs it (eBPF on, needs root): ccld says once "CUPTI: no GPU, host-side timing only", the
   job runs with exactly the environment it was given (no shim on its path), its output and exit
   status are its own.
2. The whole GPU path with the fake CUPTI standing in for the driver (CCLD_CUPTI_FORCE=1,
   CCLD_CUPTI_MODULE=fake_cupti): ccld run probes, injects the shim, the agent's sink receives the
   rank's kernels, and the collector's store holds exactly the 23 NCCL kernels with the rank's number.
"""
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import bpf_skip_reason
from ccld import wire as ev
from ccld.store import read_store
from ccld.diagnose.replay import replay

pytestmark = pytest.mark.e2e

CCLD = [sys.executable, "-m", "ccld.cli"]
UNIT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "unit")
NO_GPU_LINE = "ccld: CUPTI: no GPU, host-side timing only"


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CCLD_", "FAKE_CUPTI_", "RANK", "WORLD_SIZE"))}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


def test_ccld_run_says_cupti_is_inactive_and_leaves_the_job_alone(tmp_path):
    reason = bpf_skip_reason()
    if reason:
        pytest.skip(reason)
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("this machine has a GPU: the no-GPU path cannot be checked here")
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent("""
        import os, sys
        print("job: PYTHONPATH=" + os.environ.get("PYTHONPATH", "<unset>"))
        print("job: ccld env " + (",".join(sorted(k for k in os.environ if k.startswith("CCLD_"))) or "none"))
        print("job: ccld modules " + str(sorted(m for m in sys.modules if m.startswith("ccld"))))
        sys.exit(3)
    """))
    env = clean_env(PYTHONPATH="/opt/user-libs")
    p = subprocess.run(CCLD + ["run", "--store", str(tmp_path / "store"), "--", sys.executable, str(job)],
                       env=env, capture_output=True, text=True, timeout=240, cwd=str(tmp_path))
    out = p.stdout + p.stderr
    assert p.returncode == 3, out
    assert out.count(NO_GPU_LINE) == 1, out
    assert "job: PYTHONPATH=/opt/user-libs\n" in p.stdout       # not the shim's directory
    assert "job: ccld env none\n" in p.stdout
    assert "job: ccld modules []\n" in p.stdout
    tracing = [line for line in out.splitlines() if line.startswith("ccld: tracing")]
    assert len(tracing) == 1 and "cupti" not in tracing[0]  # the sources it lists have no CUPTI


def test_ccld_run_carries_the_ranks_kernels_to_the_store(tmp_path):
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent("""
        import sys, time
        import fake_cupti
        time.sleep(1.5)  # the agent finds the rank (every 200 ms) before the kernels come
        for _ in range(23):
            fake_cupti.launch("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)")
            fake_cupti.launch("_ZN2at6native6kernelEv")
        time.sleep(1.0)
        print("job: done")
    """))
    store = tmp_path / "store"
    env = clean_env(PYTHONPATH=UNIT_DIR, CCLD_CUPTI_FORCE="1", CCLD_CUPTI_MODULE="fake_cupti", RANK="0",
                    WORLD_SIZE="1", CCLD_JOB="fakejob")
    p = subprocess.run(CCLD + ["run", "--no-bpf", "--store", str(store), "--", sys.executable, str(job)],
                       env=env, capture_output=True, text=True, timeout=240, cwd=str(tmp_path))
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert out.count("ccld: CUPTI: on (NCCL kernels), injected into the job's Python ranks") == 1, out
    assert "job: done" in p.stdout and "cupti (shim)" in out
    assert not [line for line in out.splitlines() if "CUPTI capture is off" in line], out
    kernels = [e for _, frame in read_store(str(store)) for e in ev.decode_batch(frame).events
               if isinstance(e, ev.GpuKernel)]
    assert len(kernels) == 23 and {(k.rank, k.op, k.launch_tid > 0) for k in kernels} == {(0, "allreduce", True)}
    tl, _findings, _rec, _report = replay(str(store))
    assert tl.events_by_kind["gpu_kernel"] == 23
    cupti_status = [v for (node, pid, fam), v in tl.probes.items() if fam == "cupti"]
    assert len(cupti_status) == 1 and cupti_status[0]["ok"]
    gpu = tl.counters()["gpu"]
    assert gpu["ranks_reporting"] == 1 and gpu["shim_loss"]["cupti_dropped"] == 0
    assert gpu["kernels_waiting_for_enter"] == 23  # --no-bpf: no CollEnter to join them to
