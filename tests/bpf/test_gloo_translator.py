"""The gloo translator's size join, on hand-made records handed over as drains (no root, no job): the
enter of a sized op waits for its size (gloo's worker thread measures the buffers after the Python
thread's enter, and sends them with the start), and goes out without one when the work ends first,
HOLD_MS pass, or the process is forgotten; the events keep their order (enter, start, end) whatever
the records' order. The real probes on a real job: test_gloo_probes.py (sizes of every op, every
rank); the batch translator against the one-record-at-a-time reference: test_gloo_batch.py.
"""
import numpy as np
import pytest

from ccld.bpf import gloo_records as gr
from ccld.bpf.gloo import tag_offset
from ccld.bpf.gloo_comms import LOST_RE
from ccld.bpf.gloo_translator import HOLD_MS, GlooTranslator
from ccld.bpf.rows import Rows

pytestmark = pytest.mark.unit

PID, RANK, PG, WORK = 4242, 3, 0x1000, 0x2000
MS = 1_000_000


def rec(cls, kind, ts_ns, **fields):
    r = cls()
    r.hdr.kind, r.hdr.version, r.hdr.size = kind, 1, ctypes_size(cls)
    r.hdr.ts_ns, r.hdr.tgid, r.hdr.tid = ts_ns, PID, PID + 1
    for k, v in fields.items():
        setattr(r, k, v)
    return r


def ctypes_size(cls):
    import ctypes
    return ctypes.sizeof(cls)


def drain(t, *recs):
    """Hand the translator these records as one drain, as the ring buffer gives them."""
    raw = b"".join(bytes(r).ljust(gr.REC_SIZE, b"\0") for r in recs)
    rows = np.frombuffer(raw, np.uint8).reshape(len(recs), gr.REC_SIZE).copy()
    good, kinds = gr.KINDS.check(rows, {})
    assert len(good) == len(recs)
    t.records(good, kinds)


class Out(list):
    """What the translator emitted, Rows expanded into events."""

    def __call__(self, item):
        self.extend(item.events() if isinstance(item, Rows) else [item])


def init(ts, op=1, seq=7, work=WORK):  # op 1: allreduce (c10d::OpType); seq: the collective's, from the kernel
    return rec(gr.WorkInit, gr.WORK_INIT, ts, pg=PG, work=work, seq=seq, lib_seq=seq + 10, enter_ns=ts - 5,
               op=op, tag=seq - 1)  # c10d's seq counts p2p too: 10 more here


def enter_of(found, releases, op=1, enter_ns=0, lib_seq=17):
    """What the kernel copies from `works` into a start or an end: the enter's fields, whether it was
    found, and whether this is the first start (with sizes) or end since the enter."""
    e = gr.EnterOf()
    if found:
        e.enter_ns, e.lib_seq, e.tid, e.op, e.found, e.releases = enter_ns, lib_seq, PID + 1, op, 1, releases
    return e


def start(ts, nbytes=None, nbufs=1, work=WORK, seq=7, found=1, releases=1, op=1, enter_ns=None):
    """A start with the sizes of its buffers (nbytes None: no algorithm entry closed the window, and
    such a start never releases its enter)."""
    sized = int(nbytes is not None)
    return rec(gr.WorkStart, gr.WORK_START, ts + 3, pg=PG if found else 0, work=work, seq=seq if found else 0,
               start_ns=ts, min_bytes=nbytes or 0, total_bytes=(nbytes or 0) * nbufs,
               nbufs=nbufs if nbytes is not None else 0, sized=sized,
               e=enter_of(found, releases & sized, op, enter_ns if enter_ns is not None else 100 * MS - 5, seq + 10))


def end(ts, ok=1, work=WORK, seq=7, start_ns=0, found=1, releases=1, op=1, enter_ns=None):
    """An end (releases=0 when a sized start went before it)."""
    return rec(gr.WorkEnd, gr.WORK_END, ts, pg=PG if found else 0, work=work, seq=seq if found else 0, ok=ok,
               start_ns=start_ns, e=enter_of(found, releases, op,
                                             enter_ns if enter_ns is not None else 100 * MS - 5, seq + 10))


def pg_name(ts, name):
    """c10d's setGroupName on the group's ProcessGroup (another object than the gloo backend)."""
    return rec(gr.PgName, gr.PG_NAME, ts, pg=0x9000, len=len(name), name=name)


@pytest.fixture
def tr():
    out = Out()
    t = GlooTranslator(out)
    t.out = out
    t.add_process(PID, RANK, "job")
    drain(t, rec(gr.PgInit, gr.PG_INIT, 1, pg=PG, rank=RANK, size=4), pg_name(2, b"0"))
    out.clear()
    return t


def kinds(out):
    return [(e.KIND, getattr(e, "nbytes", None)) for e in out]


def test_the_enter_waits_for_its_size_and_the_start_follows_it(tr):
    drain(tr, init(100 * MS))
    assert tr.out == []
    drain(tr, start(100 * MS + 10, 16384))
    assert kinds(tr.out) == [("coll", 16384), ("start", None)]
    e, s = tr.out
    assert (e.comm, e.seq, e.op, e.ts_ns, e.count, e.dtype, e.lib_seq) == ("job/gloo:0", 7, "allreduce", 100 * MS - 5,
                                                                            -1, "", 17)
    assert s.ts_ns == 100 * MS + 10 and s.seq == 7
    drain(tr, end(100 * MS + 30, releases=0))
    assert kinds(tr.out)[-1] == ("end", None) and tr.unsized == 0 and tr.unmatched == 0


def test_one_drain_of_a_whole_collective_is_the_same(tr):
    drain(tr, init(100 * MS), start(100 * MS + 10, 16384), end(100 * MS + 30, releases=0))
    assert kinds(tr.out) == [("coll", 16384), ("start", None), ("end", None)]


def test_ops_without_a_size_to_compare_go_out_at_once(tr):
    drain(tr, init(100 * MS, op=15))  # barrier
    assert kinds(tr.out) == [("coll", -1)]
    drain(tr, init(101 * MS, op=11, seq=8, work=WORK + 8))  # alltoall: uneven splits are legal
    assert kinds(tr.out) == [("coll", -1), ("coll", -1)]


def test_a_work_that_ends_before_its_size_keeps_enter_start_end_order(tr):
    drain(tr, init(100 * MS))
    drain(tr, end(100 * MS + 30, ok=0, start_ns=100 * MS + 10))  # no algorithm entry: the start comes with the end
    assert kinds(tr.out) == [("coll", -1), ("start", None), ("end", None)]
    assert tr.out[1].ts_ns == 100 * MS + 10
    assert tr.out[2].ok is False and tr.unsized == 1
    drain(tr, start(100 * MS + 40, 16384, found=0))  # a start of a work already gone: counted only
    assert len(tr.out) == 3 and tr.unmatched == 1


def test_a_busy_worker_costs_the_size_after_hold_ms_not_the_enter(tr):
    drain(tr, init(100 * MS))
    tr.flush(100 * MS + HOLD_MS * MS - 1)
    assert tr.out == []
    tr.flush(100 * MS + HOLD_MS * MS)
    assert kinds(tr.out) == [("coll", -1)] and tr.unsized == 1
    drain(tr, start(400 * MS, 16384), end(400 * MS + 20, releases=0))  # the enter went already: not again
    assert kinds(tr.out) == [("coll", -1), ("start", None), ("end", None)]


def test_no_buffer_is_no_size(tr):
    drain(tr, init(100 * MS), start(100 * MS + 20, 0, nbufs=0))
    assert kinds(tr.out) == [("coll", -1), ("start", None)]


def test_a_start_without_sizes_waits_with_its_enter(tr):
    drain(tr, init(100 * MS))
    drain(tr, start(100 * MS + 10, None))  # the window never closed: the enter still waits for a size
    assert tr.out == []
    drain(tr, end(100 * MS + 30))
    assert kinds(tr.out) == [("coll", -1), ("start", None), ("end", None)]
    assert tr.out[1].ts_ns == 100 * MS + 10


def test_forgetting_a_process_sends_its_held_enters_first(tr):
    drain(tr, init(100 * MS), init(100 * MS + 1, seq=8, work=WORK + 8))
    tr.forget(PID)
    assert [(e.KIND, e.seq) for e in tr.out] == [("coll", 7), ("coll", 8)]
    tr.flush(10**12)  # nothing left to send
    assert len(tr.out) == 2 and not tr.held


def test_sizes_of_two_workers_do_not_mix(tr):
    drain(tr, init(100 * MS), init(100 * MS + 1, seq=8, work=WORK + 8),
          start(100 * MS + 20, 800, work=WORK + 8, seq=8, enter_ns=100 * MS - 4), start(100 * MS + 21, 400))
    assert [(e.KIND, e.seq, getattr(e, "nbytes", None)) for e in tr.out] == [
        ("coll", 8, 800), ("start", 8, None), ("coll", 7, 400), ("start", 7, None)]


def test_a_reused_work_object_sends_the_older_enter_first(tr):
    again = init(100 * MS + 1, seq=8)
    again.reuse = 1  # the kernel's flag: the work object's last enter had no start or end yet
    drain(tr, init(100 * MS), again, start(100 * MS + 20, 800, seq=8, enter_ns=100 * MS - 4))
    assert [(e.KIND, e.seq, getattr(e, "nbytes", None)) for e in tr.out] == [
        ("coll", 7, -1), ("coll", 8, 800), ("start", 8, None)]


def test_starts_and_ends_of_works_never_entered_are_counted_not_sent(tr):
    drain(tr, start(100 * MS, 64, found=0), end(100 * MS + 5, found=0, start_ns=1))
    assert tr.out == [] and tr.unmatched == 3


def pair_fail(ts, peer, msg):
    return rec(gr.PairFail, gr.PAIR_FAIL, ts, pair=0x3000, peer=peer, msg=msg[:gr.ERR_LEN - 1])  # as BPF cuts it


GLOO_MSG = (b"[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
            b"[127.0.0.1]:65238: Connection reset by peer. This is typically caused by a remote worker hanging")


def test_a_failed_collective_names_the_first_connection_that_broke(tr):
    drain(tr, init(100 * MS, op=15),   # barrier: no size to wait for
          pair_fail(100 * MS + 5, 2, GLOO_MSG),
          pair_fail(100 * MS + 6, 0, b"Connection closed by peer [127.0.0.1]:41361"),  # follows from the first
          end(100 * MS + 9, ok=0, op=15))
    e = tr.out[-1]
    assert e.ok is False and e.error == ("gloo reported an error (finishWorkGlooError); connection to group rank 2 "
                                         "broke: Read error [127.0.0.1]:65238: Connection reset by peer")
    assert LOST_RE.search(e.error).group(1) == "2"


def test_a_good_end_forgets_an_old_broken_connection(tr):
    drain(tr, pair_fail(90 * MS, -1, b"Connection closed by peer [127.0.0.1]:41361"))
    drain(tr, init(100 * MS, op=15), end(100 * MS + 9, ok=1, op=15), init(101 * MS, op=15, seq=8),
          end(101 * MS + 9, ok=0, seq=8, op=15))
    assert tr.out[-1].error == "gloo reported an error (finishWorkGlooError)"
    drain(tr, pair_fail(102 * MS, -1, b"Connection closed by peer [127.0.0.1]:41361"))
    drain(tr, init(103 * MS, op=15, seq=9), end(103 * MS + 9, ok=0, seq=9, op=15))
    assert tr.out[-1].error.endswith("; a connection broke: Connection closed by peer [127.0.0.1]:41361")


# ---- numbering: collectives by c10d's tag (in the kernel), p2p ops per direction and peer ------

def p2p(ts, op=12, peer=1, work=0x3000, seq=1, nbytes=64):  # op 12 send, 13 recv (c10d::OpType)
    return rec(gr.P2pRec, gr.P2P_REC, ts, pg=PG, work=work, seq=seq, enter_ns=ts - 3, nbytes=nbytes, op=op,
               peer=peer, tag=0)


def p2p_end(ts, work=0x3000, ok=1, wait_ns=0):
    return rec(gr.P2pEnd, gr.P2P_END, ts, work=work, ok=ok, wait_ns=wait_ns)


def test_collectives_carry_the_kernels_seq_and_c10ds_as_lib_seq(tr):
    # c10d's seq jumps by the p2p ops in between (11, 15); the kernel's seq counts collectives only
    drain(tr, rec(gr.WorkInit, gr.WORK_INIT, 1 * MS, pg=PG, work=WORK, seq=1, lib_seq=11, tag=0, op=15, enter_ns=1),
          rec(gr.WorkInit, gr.WORK_INIT, 2 * MS, pg=PG, work=WORK + 8, seq=2, lib_seq=15, tag=1, op=15, enter_ns=2))
    assert [(e.seq, e.lib_seq) for e in tr.out] == [(1, 11), (2, 15)]


def test_p2p_ops_are_numbered_per_direction_and_peer_and_their_ends_follow():
    out = Out()
    t = GlooTranslator(out)
    t.add_process(PID, RANK, "job")
    t.tags_readable(PID, True)
    drain(t, rec(gr.PgInit, gr.PG_INIT, 1, pg=PG, rank=RANK, size=4), pg_name(2, b"0"))
    (init_ev,) = out
    assert init_ev.seq_source == "library"
    out.clear()
    drain(t, p2p(10, op=13, peer=2, work=0x10, seq=1),   # recv from 2 (#1)
          p2p(20, op=12, peer=4, work=0x20, seq=2),      # send to 4 (#1)
          p2p_end(30, work=0x10, wait_ns=12),
          p2p(40, op=13, peer=2, work=0x10, seq=3),      # recv from 2 (#2): the address is reused
          p2p_end(50, work=0x10, ok=0),
          p2p_end(60, work=0x20))
    got = [(e.KIND, e.op, e.peer, e.seq) for e in out]
    assert got == [("p2p", "recv", 2, 1), ("p2p", "send", 4, 1), ("p2p_end", "recv", 2, 1), ("p2p", "recv", 2, 2),
                   ("p2p_end", "recv", 2, 2), ("p2p_end", "send", 4, 1)]
    assert (out[0].ts_ns, out[0].nbytes, out[0].lib_seq) == (7, 64, 1)  # posted when the API was entered
    assert out[2].wait_ns == 12 and out[4].ok is False and out[4].error
    assert t.abandoned == 0 and t.unmatched == 0
    drain(t, p2p_end(70, work=0x99))  # an op posted before we attached
    assert t.unmatched == 1


def test_seq_source_says_whether_counting_began_with_the_group():
    out = Out()
    t = GlooTranslator(out)
    t.add_process(PID, RANK, "job")
    drain(t, rec(gr.PgInit, gr.PG_INIT, 1, pg=PG, rank=RANK, size=4),  # seen at creation
          rec(gr.WorkInit, gr.WORK_INIT, 2, pg=PG + 1, work=WORK, seq=3, tag=-1, op=15, enter_ns=1),
          rec(gr.WorkInit, gr.WORK_INIT, 3, pg=PG, work=WORK + 1, seq=1, tag=-1, op=15, enter_ns=3))
    assert [(e.KIND, e.comm, e.seq_source) for e in out if e.KIND == "comm"] == \
        [("comm", "job/gloo:1", "attach"), ("comm", "job/gloo:0", "counted")]


def test_subgroups_are_named_by_c10ds_group_name_not_by_the_order_they_were_built():
    # A 2 x 2 tensor-parallel job: ranks 0 and 1 share group "1", ranks 2 and 3 group "2"; each
    # rank builds the world first and its own tp group second. By order of building, rank 0's and
    # rank 2's second groups would both be "gloo:1".
    out = Out()
    t = GlooTranslator(out)
    for pid, rank in ((10, 0), (30, 2)):
        t.add_process(pid, rank, "job")
    recs = []
    for pid, rank, mine in ((10, 0, b"1"), (30, 2, b"2")):
        for pg, name, g_rank, size in ((PG, b"0", rank, 4), (PG + 0x100, mine, 0, 2)):
            r = rec(gr.PgInit, gr.PG_INIT, 1, pg=pg, rank=g_rank, size=size)
            n = pg_name(2, name)
            r.hdr.tgid = n.hdr.tgid = pid
            recs += [r, n]
    drain(t, *recs)
    assert [(e.pid, e.comm, e.group_rank, e.group_size, e.handle) for e in out if e.KIND == "comm"] == [
        (10, "job/gloo:0", 0, 4, PG), (10, "job/gloo:1", 0, 2, PG + 0x100),
        (30, "job/gloo:0", 2, 4, PG), (30, "job/gloo:2", 0, 2, PG + 0x100)]


def test_a_name_goes_to_the_first_group_built_since_the_last_one():
    # TORCH_DISTRIBUTED_DEBUG=DETAIL: c10d builds the group's gloo backend, then a helper gloo group,
    # then names the group. The helper keeps the order-of-building name; a name with nothing built
    # since the last one (an NCCL group's) names nothing.
    out = Out()
    t = GlooTranslator(out)
    t.add_process(PID, RANK, "job")
    drain(t, rec(gr.PgInit, gr.PG_INIT, 1, pg=PG, rank=RANK, size=4),
          rec(gr.PgInit, gr.PG_INIT, 2, pg=PG + 1, rank=RANK, size=4), pg_name(3, b"5"), pg_name(4, b"6"),
          rec(gr.WorkInit, gr.WORK_INIT, 5, pg=PG + 1, work=WORK, seq=3, tag=-1, op=15, enter_ns=5))
    assert [(e.comm, e.handle) for e in out if e.KIND == "comm"] == [("job/gloo:5", PG), ("job/gloo:1", PG + 1)]


def test_records_of_processes_not_traced_are_dropped(tr):
    other = init(100 * MS, op=15)
    other.hdr.tgid = PID + 100
    drain(tr, other)
    assert tr.out == [] and tr.unmatched == 0


def test_the_tag_offset_is_read_off_nexttags_code_and_nothing_else():
    body = b"\x8b\x87\xd4\x00\x00\x00" b"\x8d\x50\x01" b"\x89\x97\xd4\x00\x00\x00" b"\xc3"
    assert tag_offset(body + b"\x90" * 8) == 0xD4
    assert tag_offset(b"\xf3\x0f\x1e\xfa" + body) == 0xD4                        # endbr64 first
    assert tag_offset(b"\x8b\x47\x30\x8d\x50\x01\x89\x57\x30\xc3" + b"\x90" * 4) == 0x30  # disp8
    assert tag_offset(body.replace(b"\x89\x97\xd4", b"\x89\x97\xd8")) is None     # stores elsewhere
    assert tag_offset(b"\xf0\x0f\xc1\x07" + b"\x90" * 20) is None                 # an atomic: unknown
    assert tag_offset(b"") is None
