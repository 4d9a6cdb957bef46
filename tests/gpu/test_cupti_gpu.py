"""CUPTI on a real GPU: the injected shim captures compute and NCCL kernels of a torch job, with the
launching thread and times that put each launch inside the call that made it; `ccld run` does the
same end to end. Run by bench/gpu_check.sh on a machine with a GPU; skipped, with the reason, elsewhere.

What these check that no fake can: that CUPTI delivers records through the callbacks as ccld expects
(`requested() -> (size, 0)`, `completed(list)`), that launch records come with selective enabling,
that CUPTI's thread ids are gettid() values after set_thread_id_type(SYSTEM), that the clock
conversion puts GPU times after the launch and before the job's synchronize, what one GPU's NCCL
launches for a one-rank all-reduce, and that two communicators use two streams. Each test writes
what it saw to $OUT (when set) so a device run brings the evidence back.
"""
import json
import os
import subprocess
import sys
import time

import pytest

from ccld import wire as ev
from ccld.cupti import inject
from ccld.tracer.cupti_sink import CuptiSink

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = os.path.join(ROOT, "tests", "workloads", "cupti_gpu_job.py")
N = 23


def _skip_reason():
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    try:
        import cupti.cupti  # noqa: F401
    except ImportError as e:
        return f"cupti-python is not importable ({e}); carry its wheel as bench/gpu_check.sh explains"
    return None


@pytest.fixture(autouse=True)
def _need_gpu():
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)


def save(name, data):
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, name), "w") as f:
            if isinstance(data, str):
                f.write(data)
            else:
                json.dump(data, f, indent=1, default=str)


def job_env(endpoint, mode):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CCLD_")}
    paths = [inject.SHIM_DIR] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p] + [ROOT]
    env.update(PYTHONPATH=os.pathsep.join(paths), CCLD_CUPTI_ENDPOINT=endpoint, CCLD_CUPTI=mode, RANK="0",
               WORLD_SIZE="1", LOCAL_RANK="0", PYTHONUNBUFFERED="1")
    return env


def run_injected(tmp_path, job_mode, cupti_mode):
    got = []
    sink = CuptiSink(got.append)
    trace = tmp_path / "trace.json"
    try:
        p = subprocess.run([sys.executable, JOB, "--mode", job_mode, "--iters", str(N), "--trace", str(trace)],
                           env=job_env(sink.endpoint, cupti_mode), capture_output=True, text=True, timeout=300)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and "bye" not in sink.ranks_on.values():  # the job's exit flush
            if not sink.poll():
                time.sleep(0.05)
        sink.poll(1 << 30)
    finally:
        sink.close()
    assert p.returncode == 0, p.stdout + p.stderr
    return p, json.loads(trace.read_text()), got


def activities(events):
    return [e for e in events if isinstance(e, (ev.GpuKernel, ev.GpuMemop))]


def launched_in(acts, t0, t1, tid):
    return [a for a in acts if t0 <= a.launch_ns <= t1 and a.launch_tid == tid]


def test_compute_kernels_are_captured_with_their_launch(tmp_path):
    p, trace, got = run_injected(tmp_path, "compute", "all")
    assert [line for line in p.stderr.splitlines() if line.startswith("ccld:")] == [], p.stderr
    status = [e for e in got if isinstance(e, ev.ProbeStatus)]
    kernels = [e for e in got if isinstance(e, ev.GpuKernel)]
    save("cupti_gpu_compute.json", {"status": [s.message for s in status], "kernels": len(kernels),
                                    "names": sorted({k.name for k in kernels})[:20],
                                    "loss": [e.counters for e in got if isinstance(e, ev.GpuLoss)][-1:]})
    assert status and status[0].ok and "tids system" in status[0].message, status
    for _, t0, t1 in trace["calls"]:
        mine = launched_in(kernels, t0, t1, trace["tid"])
        assert len(mine) == 1, f"window {t0}..{t1}: {mine}"
        k = mine[0]
        assert k.launch_ns <= k.ts_ns <= k.end_ns <= trace["synced"]  # one clock: launch, GPU start, end, sync
    loss = [e for e in got if isinstance(e, ev.GpuLoss)][-1].counters
    assert loss.get("cupti_dropped") == 0 and loss.get("queue_dropped") == 0
    # every kernel has its launch record, unless the shim had to widen the launch-API kinds first
    # (then only the warm-up kernels before that lack one)
    assert loss.get("no_launch") == 0 or loss.get("launch_api_widened") == 1, loss


def test_nccl_all_reduces_on_two_communicators(tmp_path):
    p, trace, got = run_injected(tmp_path, "nccl", "all+memcpy+memset")
    acts = activities(got)
    per_call = {"default": [], "second": []}
    for group, t0, t1 in trace["calls"]:
        per_call[group].append(launched_in(acts, t0, t1, trace["tid"]))
    seen = {g: sorted({(type(a).__name__, getattr(a, "name", "") or getattr(a, "op", "")) for c in calls
                       for a in c}) for g, calls in per_call.items()}
    streams = {g: sorted({a.stream for c in calls for a in c}) for g, calls in per_call.items()}
    save("cupti_gpu_nccl.json", {"seen_per_group": seen, "streams": streams,
                                 "nccl_kernels": sorted({(k.name, k.op, k.algo, k.proto, k.dtype) for k in got
                                                         if isinstance(k, ev.GpuKernel) and k.nccl}),
                                 "loss": [e.counters for e in got if isinstance(e, ev.GpuLoss)][-1:],
                                 "stderr": p.stderr[-2000:]})
    for group, calls in per_call.items():
        empty = sum(1 for c in calls if not c)
        assert empty == 0, f"{group}: {empty} of {len(calls)} all-reduces launched no GPU work in the call; saw {seen}"
    assert not set(streams["default"]) & set(streams["second"]), f"two communicators share a stream: {streams}"
    for k in (a for a in acts if isinstance(a, ev.GpuKernel) and a.nccl):
        assert k.op in ("allreduce", ""), k.name


def test_ccld_run_injects_and_stores_gpu_activity(tmp_path):
    from ccld.diagnose.replay import replay
    from ccld.store import read_store
    store, trace = tmp_path / "store", tmp_path / "trace.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CCLD_")}
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", CCLD_CUPTI="all+memcpy", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p] + [ROOT]))
    p = subprocess.run([sys.executable, "-m", "ccld.cli", "run", "--store", str(store), "--", sys.executable, JOB,
                        "--mode", "nccl", "--iters", str(N), "--trace", str(trace)],
                       env=env, capture_output=True, text=True, timeout=400, cwd=ROOT)
    out = p.stdout + p.stderr
    save("cupti_gpu_ccld_run.txt", out[-6000:])
    assert p.returncode == 0, out
    assert out.count("ccld: CUPTI: on (all kernels, memcpy)") == 1, out
    assert "CUPTI capture is off" not in out, out
    events = [e for _, frame in read_store(str(store)) for e in ev.decode_batch(frame).events]
    acts = activities(events)
    assert acts and {a.rank for a in acts} == {0}, out
    tl, _, _, _ = replay(str(store))
    gpu = tl.counters()["gpu"]
    nccl_enters = sum(n for (rank, op), n in tl.enter_counts.items())
    save("cupti_gpu_ccld_run.json", {"gpu": gpu, "enters": nccl_enters, "events_by_kind": dict(tl.events_by_kind)})
    assert [v["ok"] for (node, pid, fam), v in tl.probes.items() if fam == "cupti"] == [True]
    if nccl_enters and any(isinstance(a, ev.GpuKernel) and a.nccl for a in acts):
        # eBPF saw the NCCL calls: the kernels joined them, per rank enter -> GPU start -> GPU end
        assert gpu["join"].get("joins", 0) > 0, gpu
