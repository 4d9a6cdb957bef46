"""Capture with a fake CUPTI: kinds switched on, NCCL filter, buffers, drops, callback errors, stop."""
import math

import pytest

from ccld.cupti.capture import REC_API, REC_KERNEL, REC_MEMCPY, REC_MEMSET, Capture, CaptureConfig
from fake_cupti import ActivityKind, FakeCupti

pytestmark = pytest.mark.unit

NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
GEMM = "_ZN7cutlass6KernelI59cutlass_80_tensorop_s1688gemm_128x128_32x3_nn_align4EEvNT_6ParamsE"


def started(fake, **cfg):
    cap = Capture(fake, CaptureConfig(**cfg))
    cap.start()
    return cap


def test_start_switches_on_kernels_and_launch_call_ids_only():
    fake = FakeCupti()
    cap = started(fake)
    assert fake.enabled == {int(ActivityKind.CONCURRENT_KERNEL)}  # not the whole RUNTIME/DRIVER kinds
    assert {211, 214, 430, 13, 311} <= fake.runtime_ids           # kernel, _ptsz, ExC, legacy, graph launches
    assert 131 not in fake.runtime_ids and 284 not in fake.runtime_ids  # a sync, a host function: not launches
    assert {307, 442, 652} <= fake.driver_ids
    assert (cap.api_mode, cap.thread_ids) == ("selective", "system")


def test_without_per_call_enabling_the_whole_api_kinds_go_on():
    fake = FakeCupti(selective_api=False)
    cap = started(fake)
    assert cap.api_mode == "all"
    assert {int(ActivityKind.RUNTIME), int(ActivityKind.DRIVER)} <= fake.enabled


def test_nccl_filter_keeps_nccl_kernels_and_every_launch_record():
    fake = FakeCupti()
    cap = started(fake)
    for _ in range(23):
        fake.launch(NCCL)
        fake.launch(GEMM)
    cap.flush()
    recs = cap.queue.drain()
    kernels = [r for r in recs if r[0] == REC_KERNEL]
    assert len(kernels) == 23 and {r[6] for r in kernels} == {NCCL}
    assert len([r for r in recs if r[0] == REC_API]) == 46  # which launch is NCCL's is known only later
    snap = cap.snapshot()
    assert (snap["kernels"], snap["kernels_filtered"], snap["records"]) == (23, 23, 92)


def test_all_kernels_mode_and_memops():
    fake = FakeCupti()
    cap = started(fake, kernels="all", memcpy=True, memset=True)
    assert {int(ActivityKind.MEMCPY), int(ActivityKind.MEMSET)} <= fake.enabled
    fake.launch(GEMM)
    fake.launch("", memop="memcpy", api="memcpy", nbytes=4096)
    fake.launch("", memop="memset", api="memset", nbytes=128)
    cap.flush()
    recs = cap.queue.drain()
    tags = sorted(r[0] for r in recs)
    assert tags == sorted([REC_KERNEL, REC_MEMCPY, REC_MEMSET, REC_API, REC_API, REC_API])
    memcpy = next(r for r in recs if r[0] == REC_MEMCPY)
    assert (memcpy[6], memcpy[7]) == (4096, 8)


def test_api_records_of_other_calls_are_ignored_when_whole_kinds_are_on():
    fake = FakeCupti(selective_api=False)
    cap = started(fake)
    fake.completed([fake.ActivityAPI(kind=int(ActivityKind.RUNTIME), cbid=131, correlation_id=5)])  # a sync
    assert cap.queue.drain() == [] and cap.snapshot()["api_ignored"] == 1


def test_many_small_buffers_lose_nothing():
    fake = FakeCupti(buffer_records=3)
    cap = started(fake, kernels="all")
    for i in range(20):
        fake.launch(f"k{i}")
    cap.flush()
    assert len(cap.queue.drain()) == 40
    assert cap.snapshot()["buffers"] == math.ceil(40 / 3)


def test_records_cupti_dropped_are_counted_cumulatively():
    fake = FakeCupti(device_capacity=10)
    cap = started(fake)
    for _ in range(8):
        fake.launch(NCCL)      # 16 records; room for 10
    assert cap.cupti_dropped() == 6
    cap.flush()
    for _ in range(6):
        fake.launch(NCCL)      # 12 more; room for 10
    assert cap.cupti_dropped() == 8
    assert cap.cupti_dropped() == 8  # asking again adds nothing


def test_a_full_queue_drops_and_counts():
    fake = FakeCupti()
    cap = started(fake, max_queued=5)
    for _ in range(4):
        fake.launch(NCCL)      # 8 records
    cap.flush()
    assert len(cap.queue.drain()) == 5
    assert cap.snapshot()["queue_dropped"] == 3


def test_a_bad_record_does_not_raise_into_cupti():
    fake = FakeCupti(fail_at="callback")
    cap = started(fake)
    fake.launch(NCCL)
    cap.flush()  # the callback got a record without fields; it must swallow, keep the error
    assert isinstance(cap.error, AttributeError)
    assert cap.snapshot()["callback_errors"] == 1


def test_stop_disables_everything_and_detaches():
    fake = FakeCupti(selective_api=False)
    cap = started(fake)
    cap.stop()
    assert fake.enabled == set() and fake.finalized
    assert fake.calls[-2:] == ["activity_flush_all", "finalize"]


def test_stop_tries_every_step_and_raises_the_first_failure():
    fake = FakeCupti(fail_at="exit")
    cap = started(fake)
    with pytest.raises(RuntimeError, match="disable"):
        cap.stop()
    assert "activity_flush_all" in fake.calls and fake.calls[-1] == "finalize"


def test_no_gpu_start_raises_not_supported():
    fake = FakeCupti(no_gpu=True)
    with pytest.raises(RuntimeError) as e:
        Capture(fake, CaptureConfig()).start()
    assert type(e.value).__name__ == "NotSupportedError"


def test_unknown_kernel_mode_is_refused():
    with pytest.raises(ValueError, match="nccl"):
        Capture(FakeCupti(), CaptureConfig(kernels="some"))


def test_pause_and_resume_switch_everything_and_change_the_filter():
    fake = FakeCupti()
    cap = started(fake)
    cap.pause()
    assert fake.enabled == set() and fake.runtime_ids == set() and fake.driver_ids == set()
    fake.launch(NCCL)
    cap.resume(kernels="all")
    assert fake.enabled == {int(ActivityKind.CONCURRENT_KERNEL)} and 211 in fake.runtime_ids
    fake.launch(GEMM)
    cap.flush()
    assert [r[6] for r in cap.queue.drain() if r[0] == REC_KERNEL] == [GEMM]  # nothing while paused; all now


def test_a_failing_drop_query_is_counted_once_and_never_stops_capture():
    fake = FakeCupti()
    cap = started(fake)

    def refuse(*_):
        raise TypeError("unexpected signature")
    fake.activity_get_num_dropped_records = refuse
    assert cap.cupti_dropped() == 0 and cap.cupti_dropped() == 0
    assert cap.snapshot()["dropped_query_errors"] == 1
    fake.launch(NCCL)
    cap.flush()
    assert len(cap.queue.drain()) == 2
