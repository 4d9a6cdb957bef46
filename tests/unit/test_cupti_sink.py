"""The agent's CUPTI sink: shim messages -> wire events; ranks from the agent; bad input counted, not fatal."""
import os

import msgpack
import pytest
import zmq

from ccld import wire as ev
from ccld.tracer.cupti_sink import LOSS_EVERY_S, CuptiSink

pytestmark = pytest.mark.unit

NAME = "_Z40ncclDevKernel_AllReduce_Sum_bf16_RING_LL24ncclDevKernelArgsStorageILm4096EE"


class Now:
    def __init__(self):
        self.ns = 10**12

    def __call__(self):
        return self.ns


@pytest.fixture
def sink():
    got, now = [], Now()
    s = CuptiSink(got.append, rank_of=lambda pid: {100: 3}.get(pid), mono_ns=now)
    s.got, s.now = got, now
    yield s
    s.close()


def msg(n=1, pid=100, rank=7, kernels=(), memops=(), counters=None, status=None):
    m = {"v": 1, "pid": pid, "rank": rank, "n": n, "kernels": list(kernels), "memops": list(memops),
         "counters": counters if counters is not None else {"cupti_dropped": 0}}
    if status is not None:
        m["status"] = status
    return msgpack.packb(m, use_bin_type=True)


def krow(start=1000, corr=1, name=NAME, tid=55, launch=900):
    return [start, start + 500, 0, 13, corr, name, tid, launch]


def test_kernels_become_events_with_parsed_names_and_the_agents_rank(sink):
    sink.handle(msg(kernels=[krow(corr=i) for i in range(23)],
                    memops=[["memcpy", 2000, 2100, 0, 13, 99, 4096, 8, 55, 1900]]))
    ks = [e for e in sink.got if isinstance(e, ev.GpuKernel)]
    assert len(ks) == 23 and [k.corr for k in ks] == list(range(23))
    k = ks[0]
    assert (k.pid, k.rank, k.ts_ns, k.end_ns, k.stream, k.launch_tid, k.launch_ns) == (100, 3, 1000, 1500, 13, 55, 900)
    assert (k.nccl, k.op, k.redop, k.dtype, k.algo, k.proto) == (True, "allreduce", "sum", "bfloat16", "RING", "LL")
    mo = [e for e in sink.got if isinstance(e, ev.GpuMemop)]
    assert len(mo) == 1 and (mo[0].op, mo[0].nbytes, mo[0].copy_kind) == ("memcpy", 4096, 8)


def test_unknown_pid_takes_the_rank_the_shim_read(sink):
    sink.handle(msg(pid=200, rank=7, kernels=[krow()]))
    assert sink.got[0].rank == 7 and sink.counters["rank_from_shim"] == 1


def test_status_on_and_off_become_probe_status(sink):
    sink.handle(msg(n=1, status={"state": "on", "kernels": "nccl", "api": "selective", "tids": "system"}))
    sink.handle(msg(n=2, status={"state": "off", "message": "flush: RuntimeError: boom"}))
    st = [e for e in sink.got if isinstance(e, ev.ProbeStatus)]
    assert [(s.family, s.ok) for s in st] == [("cupti", True), ("cupti", False)]
    assert "selective" in st[0].message and "boom" in st[1].message
    assert sink.ranks_on[100].startswith("off")


def test_loss_counters_are_rate_limited_but_the_last_one_always_goes(sink):
    sink.handle(msg(n=1, counters={"cupti_dropped": 1}))
    sink.handle(msg(n=2, counters={"cupti_dropped": 2}))   # too soon: held back
    sink.now.ns += int(LOSS_EVERY_S * 1e9)
    sink.handle(msg(n=3, counters={"cupti_dropped": 3}))
    sink.handle(msg(n=4, counters={"cupti_dropped": 4}, status={"state": "bye"}))  # final: at once
    sink.handle(msg(n=5, counters={"cupti_dropped": 4}))   # unchanged: nothing
    assert [e.counters["cupti_dropped"] for e in sink.got if isinstance(e, ev.GpuLoss)] == [1, 3, 4]


def test_gaps_in_message_numbers_are_counted(sink):
    for n in (1, 2, 5, 6):
        sink.handle(msg(n=n))
    assert sink.counters["msgs_lost"] == 2
    sink.handle(msg(n=1))  # the pid was reused by a new process: numbering starts over, nothing lost
    assert sink.counters["msgs_lost"] == 2


@pytest.mark.parametrize("raw, reason", [
    (b"\xc1\xc1 not msgpack", "bad_msg_decode"),
    (msgpack.packb([1, 2, 3]), "bad_msg_version"),
    (msgpack.packb({"v": 2, "pid": 1, "n": 1}), "bad_msg_version"),
    (msgpack.packb({"v": 1, "pid": "x", "n": 1}), "bad_msg_header"),
    (msgpack.packb({"v": 1, "pid": 0, "n": 1}), "bad_msg_header"),
])
def test_bad_messages_are_counted(sink, raw, reason):
    sink.handle(raw)
    assert sink.got == [] and sink.counters[reason] == 1


def test_bad_rows_are_counted_and_the_rest_kept(sink):
    bad = [krow()[:7], krow()[:5] + [b"bytes", 1, 2], [True] + krow()[1:], "row"]
    sink.handle(msg(kernels=bad + [krow(corr=42)], memops=[["memmove", 1, 2, 0, 0, 0, 0, 0, 0, 0]],
                    counters={"ok": 1, "bad": "x"}))
    assert [e.corr for e in sink.got if isinstance(e, ev.GpuKernel)] == [42]
    c = sink.counters
    assert (c["bad_kernel_rows"], c["bad_memop_rows"], c["bad_counters"]) == (4, 1, 1)
    assert [e.counters for e in sink.got if isinstance(e, ev.GpuLoss)] == [{"ok": 1}]


def test_receives_over_its_ipc_socket_and_cleans_up():
    got = []
    s = CuptiSink(got.append)
    path = s.endpoint[len("ipc://"):]
    assert oct(os.stat(os.path.dirname(path)).st_mode & 0o777) == "0o700"
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(s.endpoint)
    push.send(msg(kernels=[krow()]))
    for _ in range(500):
        if s.poll():
            break
        __import__("time").sleep(0.01)
    push.close()
    ctx.term()
    s.close()
    assert [type(e).__name__ for e in got] == ["GpuKernel", "GpuLoss"]
    assert not os.path.exists(os.path.dirname(path))
    assert s.loss()["cupti_sink_msgs"] == 1


def test_bye_marks_the_rank_done(sink):
    sink.handle(msg(n=1, status={"state": "on"}))
    sink.handle(msg(n=2, status={"state": "bye"}))
    assert sink.ranks_on[100] == "bye"
    assert [e.ok for e in sink.got if isinstance(e, ev.ProbeStatus)] == [True]  # bye is no probe status


def test_ranks_with_capture_on_are_announced_again(sink):
    """The agent says every 10 s what a restarted collector must relearn: which ranks capture (the shim
    says it once, at start; without it a collector keeps none of the rank's NCCL enters for kernels)."""
    sink.handle(msg(n=1, pid=100, status={"state": "on"}))
    sink.handle(msg(n=1, pid=101, status={"state": "off", "message": "no CUPTI"}))
    sink.handle(msg(n=1, pid=102, status={"state": "on"}))
    sink.handle(msg(n=2, pid=102, status={"state": "bye"}))
    again = sink.announce()
    assert [(e.pid, e.family, e.ok) for e in again] == [(100, "cupti", True)]
