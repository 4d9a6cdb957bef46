"""ccld/timeline/gpujoin.py: the one rule that joins an NCCL kernel to the calls that launched it, used by the
collector's live join (timeline/gpu.py) and by the trace export (export/gpu.py). Before it, each kept a
copy of the rule; the last test checks that both now take it from here and decide alike."""
import collections

import pytest

from ccld.timeline import gpujoin
from ccld.export import gpu as export_gpu

from test_gpu_join import COMM_A, COMM_B, LAUNCH_AFTER, T0, GpuJob

pytestmark = pytest.mark.unit

STREAM, OTHER = (0, 1), (0, 2)


def call(ts, comm, op="allreduce", claimed=False):
    c = export_gpu.KEnter(ts, comm, ts, op)  # seq = ts: tells calls apart in failure messages
    c.claimed = claimed
    return c


def test_the_stream_decides_then_the_op_then_the_first_call():
    streams = {}
    a, b = call(10, COMM_A, "allgather"), call(20, COMM_B)
    assert gpujoin.choose([a, b], streams, STREAM, "allreduce") == ([b], False)  # the op narrows
    assert streams == {STREAM: COMM_B}  # the candidates left were all of one communicator
    a2, b2 = call(30, COMM_A), call(40, COMM_B)
    assert gpujoin.choose([a2, b2], streams, STREAM, "allreduce") == ([b2], False)  # the stream decides
    g1, g2 = call(50, COMM_A, "allgather"), call(60, COMM_A, "allgather")
    assert gpujoin.choose([g1, g2], streams, OTHER, "allreduce") == ([g1, g2], False)  # no op match: all; a group
    assert streams[OTHER] == COMM_A
    x, y = call(70, COMM_A), call(80, COMM_B)
    assert gpujoin.choose([x, y], streams, (1, 1), "") == ([x], False)  # the first call's communicator
    assert (1, 1) not in streams  # two communicators among the candidates: nothing learned
    assert gpujoin.choose([], streams, (1, 1), "allreduce") == ([], False)


def test_is_open_applies_after_the_op_narrowed():
    """The collector passes its whole launch window and `is_open`: an op whose calls are all claimed
    leaves nothing (the kernel waits for its call). The export passes open calls only: another op's."""
    claimed, other_op = call(10, COMM_A, claimed=True), call(20, COMM_A, "allgather")
    assert gpujoin.choose([claimed, other_op], {}, STREAM, "allreduce", lambda c: not c.claimed) == ([], False)
    assert gpujoin.choose([other_op], {}, STREAM, "allreduce") == ([other_op], False)


def test_a_stream_seen_serving_two_communicators_is_ambiguous_and_not_used():
    streams = {}
    assert gpujoin.learn(streams, STREAM, COMM_A) is False and streams[STREAM] == COMM_A
    assert gpujoin.learn(streams, STREAM, COMM_A) is False
    assert gpujoin.learn(streams, STREAM, COMM_B) is True and streams[STREAM] == gpujoin.AMBIGUOUS
    assert gpujoin.learn(streams, STREAM, COMM_A) is False and streams[STREAM] == gpujoin.AMBIGUOUS
    a, b = call(10, COMM_A), call(20, COMM_B)
    assert gpujoin.choose([a, b], streams, STREAM, "") == ([a], False)  # as if unknown


def test_stream_order_takes_the_oldest_unclaimed_call_entered_by_the_gpu_start():
    done, first, second = call(5, COMM_A, claimed=True), call(10, COMM_A), call(20, COMM_A)
    by_comm = {COMM_A: collections.deque([done, first, second])}
    assert gpujoin.by_stream_order(by_comm, COMM_A, 8) is None  # entered after the kernel started
    assert list(by_comm[COMM_A]) == [first, second]  # the claimed one was dropped on the way
    assert gpujoin.by_stream_order(by_comm, COMM_A, 25) is first
    assert gpujoin.by_stream_order(by_comm, COMM_A, 25) is second
    assert gpujoin.by_stream_order(by_comm, COMM_A, 25) is None
    for unknown in (None, gpujoin.AMBIGUOUS, COMM_B):
        assert gpujoin.by_stream_order(by_comm, unknown, 25) is None


def test_the_collector_and_the_export_join_through_this_rule(monkeypatch):
    """One scenario through both: two communicators, the op choosing before the stream is learned, a
    group, and a kernel without a launch record. Both call the rule here, and join the same calls."""
    used = collections.Counter()
    for name in ("choose", "by_stream_order"):
        real = getattr(gpujoin, name)
        monkeypatch.setattr(gpujoin, name, lambda *a, _real=real, _name=name: used.update([_name]) or _real(*a))
    t = T0 + 10
    enters = [(COMM_A, 0, t, "allgather"), (COMM_B, 0, t + 1e-4, "allreduce"),      # kernel 1: B0 by op
              (COMM_B, 1, t + 1.0, "allreduce"), (COMM_B, 2, t + 1.0001, "allreduce"),  # kernel 2: both, a group
              (COMM_B, 3, t + 2.0, "allreduce")]                                      # kernel 3: stream order
    kernels = [(t + 2e-4, True), (t + 1.0002, True), (t + 2.0 + LAUNCH_AFTER, False)]

    job = GpuJob(world=1, comms=(COMM_A, COMM_B))
    job.send([job.enter(0, comm, seq, ts, op=op) for comm, seq, ts, op in enters])
    job.send([job.kernel(0, launch, stream=STREAM[1], launched=launched) for launch, launched in kernels])
    collector = {(comm, seq) for comm, seq, _, _ in enters if job.span(comm, seq, 0)[1] is not None}
    assert used == {"choose": 2, "by_stream_order": 1}

    g, tid = export_gpu.GpuProc(), 500
    for comm, seq, ts, op in enters:
        g.enter(job.ns(ts), comm, seq, op, tid)
    exported = set()
    for launch, launched in kernels:
        lns = job.ns(launch)
        got = export_gpu._join(None, g, STREAM, lns + 50_000, tid if launched else 0, lns if launched else 0,
                               "allreduce")
        exported |= {(c.comm, c.seq) for c in got or ()}
    assert used == {"choose": 4, "by_stream_order": 2}
    assert collector == exported == {(COMM_B, 0), (COMM_B, 1), (COMM_B, 2), (COMM_B, 3)}
