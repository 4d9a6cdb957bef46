"""The gloo translator's size join, on hand-made records (no root, no job): the enter of a sized op
waits for its size record (gloo's worker thread measures the buffers after the Python thread's
enter), and goes out without one when the work ends first, HOLD_MS pass, or the process is
forgotten; the events keep their order (enter, start, end) whatever the records' order.
The real probes on a real job: test_gloo_probes.py (sizes of every op, every rank).
"""
import pytest

from ccld.bpf import gloo

pytestmark = pytest.mark.unit

PID, RANK, PG, WORK = 4242, 3, 0x1000, 0x2000
MS = 1_000_000


def rec(cls, kind, ts_ns, **fields):
    r = cls()
    r.hdr.kind, r.hdr.ts_ns, r.hdr.tgid, r.hdr.tid = kind, ts_ns, PID, PID + 1
    for k, v in fields.items():
        setattr(r, k, v)
    return r


def init(ts, op=1, seq=7, work=WORK):  # op 1: allreduce (c10d::OpType)
    return rec(gloo.WorkInit, gloo.WORK_INIT, ts, pg=PG, work=work, seq=seq, enter_ns=ts - 5, op=op)


def start(ts, work=WORK):
    return rec(gloo.WorkEv, gloo.WORK_START, ts, work=work, ok=1)


def end(ts, ok=1, work=WORK):
    return rec(gloo.WorkEv, gloo.WORK_END, ts, work=work, ok=ok)


def size(ts, nbytes, nbufs=1, work=WORK):
    return rec(gloo.WorkSize, gloo.WORK_SIZE, ts, work=work, min_bytes=nbytes, total_bytes=nbytes * nbufs,
               nbufs=nbufs)


@pytest.fixture
def tr():
    out = []
    t = gloo.GlooTranslator(out.append)
    t.out = out
    t.add_process(PID, RANK, "job")
    t(gloo.PG_INIT, rec(gloo.PgInit, gloo.PG_INIT, 1, pg=PG, rank=RANK, size=4))
    out.clear()
    return t


def kinds(out):
    return [(e.KIND, getattr(e, "nbytes", None)) for e in out]


def test_the_enter_waits_for_its_size_and_the_start_follows_it(tr):
    tr(gloo.WORK_INIT, init(100 * MS))
    tr(gloo.WORK_START, start(100 * MS + 10))
    assert tr.out == []
    tr(gloo.WORK_SIZE, size(100 * MS + 20, 16384))
    assert kinds(tr.out) == [("coll", 16384), ("start", None)]
    e, s = tr.out
    assert (e.comm, e.seq, e.op, e.ts_ns, e.count, e.dtype) == ("job/gloo:0", 7, "allreduce", 100 * MS - 5, -1, "")
    assert s.ts_ns == 100 * MS + 10
    tr(gloo.WORK_END, end(100 * MS + 30))
    assert kinds(tr.out)[-1] == ("end", None) and tr.unsized == 0 and tr.unmatched == 0


def test_ops_without_a_size_to_compare_go_out_at_once(tr):
    tr(gloo.WORK_INIT, init(100 * MS, op=15))  # barrier
    assert kinds(tr.out) == [("coll", -1)]
    tr(gloo.WORK_INIT, init(101 * MS, op=11, seq=8, work=WORK + 8))  # alltoall: uneven splits are legal
    assert kinds(tr.out) == [("coll", -1), ("coll", -1)]


def test_a_work_that_ends_before_its_size_keeps_enter_start_end_order(tr):
    tr(gloo.WORK_INIT, init(100 * MS))
    tr(gloo.WORK_START, start(100 * MS + 10))
    tr(gloo.WORK_END, end(100 * MS + 30, ok=0))
    assert kinds(tr.out) == [("coll", -1), ("start", None), ("end", None)]
    assert tr.out[2].ok is False and tr.unsized == 1
    tr(gloo.WORK_SIZE, size(100 * MS + 40, 16384))  # too late, and for a work already gone: ignored
    assert len(tr.out) == 3


def test_a_busy_worker_costs_the_size_after_hold_ms_not_the_enter(tr):
    tr(gloo.WORK_INIT, init(100 * MS))
    tr.flush(100 * MS + gloo.HOLD_MS * MS - 1)
    assert tr.out == []
    tr.flush(100 * MS + gloo.HOLD_MS * MS)
    assert kinds(tr.out) == [("coll", -1)] and tr.unsized == 1
    tr(gloo.WORK_START, start(400 * MS))
    tr(gloo.WORK_SIZE, size(400 * MS + 10, 16384))
    tr(gloo.WORK_END, end(400 * MS + 20))
    assert kinds(tr.out) == [("coll", -1), ("start", None), ("end", None)]


def test_no_buffer_is_no_size(tr):
    tr(gloo.WORK_INIT, init(100 * MS))
    tr(gloo.WORK_SIZE, size(100 * MS + 20, 0, nbufs=0))
    assert kinds(tr.out) == [("coll", -1)]


def test_forgetting_a_process_sends_its_held_enters_first(tr):
    tr(gloo.WORK_INIT, init(100 * MS))
    tr(gloo.WORK_INIT, init(100 * MS + 1, seq=8, work=WORK + 8))
    tr.forget(PID)
    assert [(e.KIND, e.seq) for e in tr.out] == [("coll", 7), ("coll", 8)]
    tr.flush(10**12)  # nothing left to send
    assert len(tr.out) == 2 and tr._holding == 0


def test_sizes_of_two_workers_do_not_mix(tr):
    tr(gloo.WORK_INIT, init(100 * MS))
    tr(gloo.WORK_INIT, init(100 * MS + 1, seq=8, work=WORK + 8))
    tr(gloo.WORK_SIZE, size(100 * MS + 20, 800, work=WORK + 8))
    tr(gloo.WORK_SIZE, size(100 * MS + 21, 400))
    assert [(e.seq, e.nbytes) for e in tr.out] == [(8, 800), (7, 400)]


def pair_fail(ts, peer, msg):
    return rec(gloo.PairFail, gloo.PAIR_FAIL, ts, pair=0x3000, peer=peer, msg=msg[:gloo.ERR_LEN - 1])  # as BPF cuts it


GLOO_MSG = (b"[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
            b"[127.0.0.1]:65238: Connection reset by peer. This is typically caused by a remote worker hanging")


def test_a_failed_collective_names_the_first_connection_that_broke(tr):
    tr(gloo.WORK_INIT, init(100 * MS, op=15))   # barrier: no size to wait for
    tr(gloo.PAIR_FAIL, pair_fail(100 * MS + 5, 2, GLOO_MSG))
    tr(gloo.PAIR_FAIL, pair_fail(100 * MS + 6, 0, b"Connection closed by peer [127.0.0.1]:41361"))  # follows
    tr(gloo.WORK_END, end(100 * MS + 9, ok=0))
    e = tr.out[-1]
    assert e.ok is False and e.error == ("gloo reported an error (finishWorkGlooError); connection to group rank 2 "
                                         "broke: Read error [127.0.0.1]:65238: Connection reset by peer")
    assert gloo.LOST_RE.search(e.error).group(1) == "2"


def test_a_good_end_forgets_an_old_broken_connection(tr):
    tr(gloo.PAIR_FAIL, pair_fail(90 * MS, -1, b"Connection closed by peer [127.0.0.1]:41361"))
    tr(gloo.WORK_INIT, init(100 * MS, op=15))
    tr(gloo.WORK_END, end(100 * MS + 9, ok=1))
    tr(gloo.WORK_INIT, init(101 * MS, op=15, seq=8))
    tr(gloo.WORK_END, end(101 * MS + 9, ok=0))
    assert tr.out[-1].error == "gloo reported an error (finishWorkGlooError)"
    tr(gloo.PAIR_FAIL, pair_fail(102 * MS, -1, b"Connection closed by peer [127.0.0.1]:41361"))
    tr(gloo.WORK_INIT, init(103 * MS, op=15, seq=9))
    tr(gloo.WORK_END, end(103 * MS + 9, ok=0))
    assert tr.out[-1].error.endswith("; a connection broke: Connection closed by peer [127.0.0.1]:41361")
