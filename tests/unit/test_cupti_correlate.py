"""Kernel <-> launch record by correlation id, in any arrival order, bounded, with counted misses."""
import pytest

from ccld.cupti.capture import REC_API, REC_KERNEL, REC_MEMCPY
from ccld.cupti.correlate import LaunchCorrelator

pytestmark = pytest.mark.unit


def kernel(corr, start=1000):
    return (REC_KERNEL, start, start + 10, 0, 7, corr, f"ncclDevKernel_AllReduce_{corr}")


def api(corr, tid=42, start=900):
    return (REC_API, corr, tid, start, start + 5, 211)


def test_launch_first_then_kernel():
    c = LaunchCorrelator()
    c.add(api(1, tid=5, start=100), now_ns=0)
    c.add(kernel(1), now_ns=0)
    assert c.take() == [(kernel(1), (5, 100))]
    assert c.counters["matched"] == 1


def test_kernel_first_waits_for_its_launch():
    c = LaunchCorrelator()
    for corr in range(1, 24):
        c.add(kernel(corr), now_ns=0)
    assert c.take() == [] and c.pending() == 23
    for corr in reversed(range(1, 24)):
        c.add(api(corr, tid=corr), now_ns=10)
    got = c.take()
    assert sorted((r[5], launch[0]) for r, launch in got) == [(i, i) for i in range(1, 24)]
    assert c.counters["matched_late"] == 23 and c.pending() == 0


def test_a_kernel_whose_launch_never_comes_goes_out_without_one():
    c = LaunchCorrelator(pending_ns=1000)
    c.add(kernel(9), now_ns=0)
    c.expire(now_ns=999)
    assert c.take() == []
    c.expire(now_ns=1000)
    assert c.take() == [(kernel(9), None)]
    assert c.counters["no_launch"] == 1


def test_expire_everything_at_the_end():
    c = LaunchCorrelator()
    c.add(kernel(1), now_ns=0)
    c.add((REC_MEMCPY, 5, 6, 0, 7, 2, 4096, 8), now_ns=0)
    c.expire(now_ns=1, everything=True)
    assert len(c.take()) == 2 and c.pending() == 0


def test_one_launch_owns_several_kernels():
    c = LaunchCorrelator()
    c.add(api(3, tid=8), now_ns=0)
    c.add(kernel(3, start=1), now_ns=0)
    c.add(kernel(3, start=2), now_ns=0)  # a graph launch: same correlation id
    assert [launch for _, launch in c.take()] == [(8, 900), (8, 900)]


def test_launch_records_are_bounded_oldest_first():
    c = LaunchCorrelator(max_launches=4)
    for corr in range(10):
        c.add(api(corr), now_ns=0)
    c.add(kernel(0), now_ns=0)  # evicted long ago: waits
    c.add(kernel(9), now_ns=0)  # still there
    assert [r[5] for r, _ in c.take()] == [9]
    assert c.pending() == 1


def test_pending_is_bounded():
    c = LaunchCorrelator(max_pending=2)
    for corr in range(5):
        c.add(kernel(corr), now_ns=0)
    assert c.pending() == 2
    assert [launch for _, launch in c.take()] == [None, None, None]
    assert c.counters["no_launch"] == 3
