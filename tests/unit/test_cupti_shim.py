"""The shim in this process with a fake CUPTI, into a real CuptiSink over ZeroMQ ipc: conversion to
CLOCK_MONOTONIC, launch correlation out of order, drops shipped, failures turned off with one line."""
import os
import threading
import time

import pytest

from ccld import wire as ev
from ccld.cupti import shim as shim_mod
from ccld.cupti.capture import CaptureConfig
from ccld.cupti.shim import Shim, parse_mode, should_start
from ccld.tracer.cupti_sink import CuptiSink
from fake_cupti import FakeCupti

pytestmark = pytest.mark.unit

NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
GEMM = "_ZN2at6native18elementwise_kernelILi128ELi4EEEviT1_"


@pytest.fixture
def sink():
    got = []
    s = CuptiSink(got.append, rank_of=lambda pid: 5 if pid == os.getpid() else None)
    s.got = got
    yield s
    s.close()


def drain(sink, until, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sink.poll()
        if until(sink.got):
            return sink.got
        time.sleep(0.01)
    raise AssertionError(f"not received in {timeout} s: {[type(e).__name__ for e in sink.got]}")


def kernels(events):
    return [e for e in events if isinstance(e, ev.GpuKernel)]


def run_shim(fake, sink, launches, config=CaptureConfig(), **kw):
    lines = []
    s = Shim(fake, sink.endpoint, config, rank=5, flush_interval_s=3600, say=lines.append, **kw).start()
    launches()
    s.tick()
    s.shutdown()
    return s, lines


def test_kernels_arrive_in_monotonic_time_with_their_launch_thread(sink):
    fake = FakeCupti(offset_ns=-9_000_000_000_000, drift_ppm=50.0)
    windows = []

    def launches():
        for _ in range(23):
            t0 = time.monotonic_ns()
            fake.launch(NCCL, gpu_delay_ns=30_000, duration_ns=70_000)
            windows.append((t0, time.monotonic_ns()))
            fake.launch(GEMM)
    s, lines = run_shim(fake, sink, launches)
    got = kernels(drain(sink, lambda g: len(kernels(g)) == 23))
    assert lines == [] and not s.disabled
    tid = threading.get_native_id()
    for k, (t0, t1) in zip(sorted(got, key=lambda k: k.ts_ns), windows):
        assert k.launch_tid == tid and k.rank == 5 and k.pid == os.getpid()
        assert t0 - 100_000 <= k.launch_ns <= t1 + 100_000  # CUPTI ns came back as this clock, drift and all
        assert abs(k.ts_ns - k.launch_ns - 30_000) < 50_000 and abs(k.end_ns - k.ts_ns - 70_000) < 50  # 50 ppm of it
        assert (k.nccl, k.op, k.dtype, k.algo, k.proto) == (True, "allreduce", "float32", "RING", "LL")
    status = [e for e in sink.got if isinstance(e, ev.ProbeStatus)]
    assert len(status) == 1 and status[0].ok and status[0].family == "cupti"


def test_out_of_order_and_late_launch_records_still_correlate(sink):
    fake = FakeCupti(order="shuffled", api_late=True)
    s = Shim(fake, sink.endpoint, CaptureConfig(), rank=5, flush_interval_s=3600).start()
    for _ in range(23):
        fake.launch(NCCL)
    s.tick()   # kernels now, their launch records one flush later
    s.tick()
    s.shutdown()
    got = kernels(drain(sink, lambda g: len(kernels(g)) == 23))
    assert {k.launch_tid for k in got} == {threading.get_native_id()}
    assert s.corr.counters["matched_late"] == 23


def test_drops_are_counted_and_shipped(sink):
    fake = FakeCupti(device_capacity=20)

    def launches():
        for _ in range(23):
            fake.launch(NCCL)  # 46 records; CUPTI has room for 20
    s, _ = run_shim(fake, sink, launches)
    losses = [e for e in drain(sink, lambda g: any(isinstance(e, ev.GpuLoss) and e.counters.get("cupti_dropped")
                                                     for e in g)) if isinstance(e, ev.GpuLoss)]
    assert losses[-1].counters["cupti_dropped"] == 26
    assert losses[-1].rank == 5


def test_no_agent_listening_drops_and_counts_without_waiting(tmp_path):
    fake = FakeCupti()
    s = Shim(fake, f"ipc://{tmp_path}/nobody", CaptureConfig(), flush_interval_s=3600).start()
    for _ in range(shim_mod.SNDHWM + 10):
        fake.launch(NCCL)
        s.tick()
    t0 = time.monotonic()
    s.shutdown()
    assert time.monotonic() - t0 < shim_mod.EXIT_TIMEOUT_S
    assert s.counters["msgs_dropped"] > 0 and s.counters["records_dropped_send"] > 0


def test_launch_api_widened_when_call_ids_alone_bring_nothing(sink):
    fake = FakeCupti(selective_effective=False)
    s = Shim(fake, sink.endpoint, CaptureConfig(), flush_interval_s=3600).start()
    for _ in range(shim_mod.FALLBACK_AFTER):
        fake.launch(NCCL)
    s.tick()
    s.corr.expire(time.monotonic_ns(), everything=True)
    s.tick()
    assert s.capture.api_mode == "all" and s.counters["launch_api_widened"] == 1
    fake.launch(NCCL)
    s.tick()
    s.shutdown()
    got = kernels(drain(sink, lambda g: len(kernels(g)) == shim_mod.FALLBACK_AFTER + 1))
    assert [k.launch_tid > 0 for k in sorted(got, key=lambda k: k.ts_ns)] == [False] * 16 + [True]


@pytest.mark.parametrize("fail_at, where", [("flush", "flush failed"), ("callback", "flush failed")])
def test_a_failing_flush_turns_capture_off_with_one_line(sink, fail_at, where):
    fake = FakeCupti(fail_at=fail_at)
    lines = []
    s = Shim(fake, sink.endpoint, CaptureConfig(), rank=5, flush_interval_s=0.05, say=lines.append).start()
    fake.launch(NCCL)
    off = drain(sink, lambda g: any(isinstance(e, ev.ProbeStatus) and not e.ok for e in g))
    s.shutdown()
    assert s.disabled and len(lines) == 1 and where in lines[0] and "rank 5" in lines[0]
    assert any(not e.ok and "CUPTI capture off" in e.message for e in off if isinstance(e, ev.ProbeStatus))
    assert fake.enabled == set()  # switched off as far as CUPTI let it


def test_start_failure_is_one_line_and_no_thread(sink):
    lines = []
    s = Shim(FakeCupti(no_gpu=True), sink.endpoint, CaptureConfig(), say=lines.append).start()
    assert s.disabled and s._thread is None
    assert len(lines) == 1 and "NotSupportedError" in lines[0]
    s.shutdown()


def test_exit_failure_is_one_line(sink):
    lines = []
    fake = FakeCupti(fail_at="exit")
    s = Shim(fake, sink.endpoint, CaptureConfig(), flush_interval_s=3600, say=lines.append).start()
    s.shutdown()
    assert len(lines) == 1 and "exit failed" in lines[0]


def test_exit_flush_that_hangs_is_abandoned(sink, monkeypatch):
    monkeypatch.setattr(shim_mod, "EXIT_TIMEOUT_S", 0.5)
    lines = []
    s = Shim(FakeCupti(fail_at="hang-exit"), sink.endpoint, CaptureConfig(), flush_interval_s=3600,
             say=lines.append).start()
    t0 = time.monotonic()
    s.shutdown()
    assert time.monotonic() - t0 < 2.0
    assert len(lines) == 1 and "did not finish" in lines[0]


def test_forked_child_neither_captures_nor_touches_the_socket(sink):
    s = Shim(FakeCupti(), sink.endpoint, CaptureConfig(), flush_interval_s=3600).start()
    pid = os.fork()
    if pid == 0:  # child: only flags are read; any exception makes the exit status non-zero
        code = 0 if (s.disabled and s.shutdown() is None and s._sock is not None) else 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    assert not s.disabled
    s.shutdown()


@pytest.mark.parametrize("text, want", [
    ("nccl", CaptureConfig()), ("", CaptureConfig()), ("all", CaptureConfig(kernels="all")),
    ("all+memcpy+memset", CaptureConfig(kernels="all", memcpy=True, memset=True)),
    ("nccl,memset", CaptureConfig(memset=True)), ("memcpy", CaptureConfig(memcpy=True)), ("off", None),
])
def test_parse_mode(text, want):
    assert parse_mode(text) == want


def test_parse_mode_rejects_unknown_parts():
    with pytest.raises(ValueError, match="'kernels'"):
        parse_mode("all+kernels")


@pytest.mark.parametrize("env, pid, want", [
    ({"CCLD_CUPTI_ENDPOINT": "ipc://x", "RANK": "0", "CCLD_CUPTI_FORCE": "1"}, 10, True),
    ({"CCLD_CUPTI_ENDPOINT": "ipc://x", "CCLD_CUPTI_FORCE": "1"}, 10, False),               # not a rank
    ({"RANK": "0", "CCLD_CUPTI_FORCE": "1"}, 10, False),                                     # not under ccld run
    ({"CCLD_CUPTI_ENDPOINT": "ipc://x", "RANK": "0", "CCLD_CUPTI_FORCE": "1", "CCLD_CUPTI_OWNER": "9"}, 10, False),
    ({"CCLD_CUPTI_ENDPOINT": "ipc://x", "RANK": "0", "CCLD_CUPTI_FORCE": "1", "CCLD_CUPTI_OWNER": "10"}, 10, True),
    ({"CCLD_CUPTI_ENDPOINT": "ipc://x", "RANK": "0", "CCLD_CUPTI_FORCE": "1", "CCLD_CUPTI": "off"}, 10, False),
    ({"CCLD_CUPTI_ENDPOINT": "ipc://x", "RANK": "0", "CUDA_VISIBLE_DEVICES": ""}, 10, False),
])
def test_should_start(env, pid, want):
    assert should_start(env, pid) is want


def test_gpu_present_follows_device_nodes():
    assert shim_mod.gpu_present({}) == (os.path.exists("/dev/nvidiactl") or
                                        any(n.startswith("nvidia") and n[6:].isdigit() for n in os.listdir("/dev")))
    assert not shim_mod.gpu_present({"CUDA_VISIBLE_DEVICES": "-1"})
