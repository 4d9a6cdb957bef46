"""NcclTranslator on synthetic records: communicator naming across ranks, per-communicator seq, splits.

Successful inits cannot happen without a GPU, so these paths are driven with hand-made records
(the BPF side of the same records is tested in tests/bpf/test_nccl_probes.py).
"""
import ctypes as ct

import numpy as np
import pytest

from ccld import wire as ev
from ccld.bpf import nccl
from ccld.bpf.rows import Rows

pytestmark = pytest.mark.unit

UID = bytes(range(128))
IDENT = nccl.unique_id_identity(UID)


def _hdr(rec, kind, pid, ts):
    rec.hdr.kind, rec.hdr.tgid, rec.hdr.tid, rec.hdr.ts_ns = kind, pid, pid, ts
    rec.hdr.version, rec.hdr.size = 1, ct.sizeof(rec)
    return rec


def init(pid, handle, idhash=IDENT, nranks=4, rank=0, ret=0, ts=1):
    r = nccl.NcclCommInit(comm=handle, idhash=idhash, fn=nccl.FN_INIT_RANK, ret=ret, nranks=nranks, rank=rank,
                          color=-1, key=-1, enter_ns=ts)
    return nccl.COMM_INIT, _hdr(r, nccl.COMM_INIT, pid, ts)


def split(pid, parent, child, color, key=0, ret=0, ts=1):
    r = nccl.NcclCommInit(comm=child, parent=parent, fn=nccl.FN_SPLIT, ret=ret, nranks=-1, rank=-1,
                          color=color, key=key, enter_ns=ts)
    return nccl.COMM_INIT, _hdr(r, nccl.COMM_INIT, pid, ts)


def coll(pid, handle, fn=nccl.FN_ALLREDUCE, count=10, dtype=7, root=-1, ts=2):
    r = nccl.NcclCall(comm=handle, count=count, fn=fn, datatype=dtype, redop=0, root=root)
    return nccl.COLL, _hdr(r, nccl.COLL, pid, ts)


def end(pid, handle, fn=nccl.FN_DESTROY, ts=3):
    return nccl.COMM_END, _hdr(nccl.NcclCommEnd(comm=handle, fn=fn), nccl.COMM_END, pid, ts)


class Out(list):
    def __call__(self, item):
        self.extend(item.events() if isinstance(item, Rows) else [item])


@pytest.fixture
def tr():
    out = Out()
    t = nccl.NcclTranslator(out)
    t.out = out
    t.add_process(100, rank=0, job="job")
    t.add_process(200, rank=1, job="job")
    return t


def feed(t, *recs):
    """The records as one drain, as the ring buffer hands them over."""
    size = nccl.NcclFamily.KINDS.rec_size
    raw = b"".join(bytes(rec).ljust(size, b"\0") for _, rec in recs)
    rows = np.frombuffer(raw, np.uint8).reshape(len(recs), size).copy()
    good, kinds = nccl.NcclFamily.KINDS.check(rows, {})
    assert len(good) == len(recs)
    t.records(good, kinds)


def of(t, cls):
    return [e for e in t.out if isinstance(e, cls)]


def test_identity_is_fnv1a_of_the_unique_id():
    assert nccl.fnv1a64(b"") == 0xCBF29CE484222325
    assert nccl.fnv1a64(b"a") == 0xAF63DC4C8601EC8C  # published FNV-1a 64 test vector
    assert IDENT == nccl.fnv1a64(UID)


def test_ranks_name_one_communicator_alike(tr):
    feed(tr, init(100, 0xA000, rank=0), init(200, 0xB000, rank=1))
    inits = of(tr, ev.CommInit)
    assert [(e.pid, e.comm, e.group_rank, e.group_size, e.handle, e.backend) for e in inits] == [
        (100, f"job/nccl:{IDENT:016x}", 0, 4, 0xA000, "nccl"),
        (200, f"job/nccl:{IDENT:016x}", 1, 4, 0xB000, "nccl")]
    assert {e.seq_source for e in inits} == {ev.SEQ_FROM_INIT}


def test_seq_counts_per_communicator_from_zero(tr):
    other = nccl.unique_id_identity(bytes(128))
    feed(tr, init(100, 0xA000), init(100, 0xC000, idhash=other),
         coll(100, 0xA000), coll(100, 0xC000), coll(100, 0xA000, fn=nccl.FN_BROADCAST, root=2),
         coll(100, 0xA000, fn=nccl.FN_ALLGATHER, dtype=9, count=3))
    colls = of(tr, ev.CollEnter)
    assert [(e.comm[-16:], e.seq, e.op) for e in colls] == [
        (f"{IDENT:016x}", 0, "allreduce"), (f"{other:016x}", 0, "allreduce"),
        (f"{IDENT:016x}", 1, "broadcast"), (f"{IDENT:016x}", 2, "allgather")]
    assert (colls[2].root, colls[3].dtype, colls[3].nbytes, colls[0].nbytes) == (2, "bfloat16", 6, 40)
    assert tr.counters["unknown_handles"] == 0


def test_p2p_does_not_take_a_collective_seq(tr):
    send = nccl.NcclCall(comm=0xA000, count=5, fn=nccl.FN_SEND, datatype=2, redop=-1, root=3)
    feed(tr, init(100, 0xA000), (nccl.P2P_REC, _hdr(send, nccl.P2P_REC, 100, 5)), coll(100, 0xA000))
    (p2p,) = of(tr, ev.P2P)
    assert (p2p.op, p2p.peer, p2p.count, p2p.dtype, p2p.comm) == ("send", 3, 5, "int32", f"job/nccl:{IDENT:016x}")
    assert [e.seq for e in of(tr, ev.CollEnter)] == [0]


def test_unknown_handle_is_named_per_process_and_counted(tr):
    feed(tr, coll(100, 0xABC), coll(100, 0xABC))
    (ci,) = of(tr, ev.CommInit)
    assert (ci.comm, ci.group_rank, ci.group_size) == ("job/nccl:handle-r0-abc", -1, -1)
    assert ci.seq_source == ev.SEQ_FROM_ATTACH  # numbered from our first sight: the collector aligns it
    assert [e.seq for e in of(tr, ev.CollEnter)] == [0, 1]
    assert tr.counters["unknown_handles"] == 1


def test_split_identity_matches_across_ranks(tr):
    # Both ranks split the parent twice; colors differ per split but agree between the two ranks.
    feed(tr, init(100, 0xA000), init(200, 0xB000, rank=1),
         split(100, 0xA000, 0xA100, color=7), split(200, 0xB000, 0xB100, color=7, key=1),
         split(100, 0xA000, 0xA200, color=7), split(200, 0xB000, 0xB200, color=7, key=1))
    names = {(e.pid, e.handle): e.comm for e in of(tr, ev.CommInit)}
    first = f"job/nccl:{nccl.split_identity(IDENT, 7, 0):016x}"
    second = f"job/nccl:{nccl.split_identity(IDENT, 7, 1):016x}"
    assert names[(100, 0xA100)] == names[(200, 0xB100)] == first
    assert names[(100, 0xA200)] == names[(200, 0xB200)] == second != first
    assert nccl.split_identity(IDENT, 7, 0) != nccl.split_identity(IDENT, 8, 0)


def test_nocolor_split_makes_no_comm_but_counts(tr):
    feed(tr, init(100, 0xA000), init(200, 0xB000),
         split(100, 0xA000, 0, color=nccl.NCCL_SPLIT_NOCOLOR), split(200, 0xB000, 0xB100, color=3),
         split(100, 0xA000, 0xA200, color=4), split(200, 0xB000, 0xB200, color=4))
    names = {(e.pid, e.handle): e.comm for e in of(tr, ev.CommInit)}
    assert (100, 0) not in names
    assert names[(100, 0xA200)] == names[(200, 0xB200)]  # the NOCOLOR split still counted on rank 0
    assert tr.counters["init_failed"] == 0


def test_split_of_unknown_parent(tr):
    feed(tr, split(100, 0xDEAD, 0xA100, color=1))
    (ci,) = of(tr, ev.CommInit)
    assert ci.comm == "job/nccl:handle-r0-a100"
    assert tr.counters["unknown_parents"] == 1


def test_failed_init_names_nothing_and_nonblocking_init_counts(tr):
    feed(tr, init(100, 0xA000, ret=1), init(200, 0xB000, ret=nccl.NCCL_IN_PROGRESS))
    assert [(e.pid, e.handle) for e in of(tr, ev.CommInit)] == [(200, 0xB000)]
    assert tr.counters["init_failed"] == 1


def test_destroy_forgets_the_handle_and_its_seq(tr):
    other = nccl.unique_id_identity(b"\x01" * 128)
    feed(tr, init(100, 0xA000), coll(100, 0xA000), end(100, 0xA000),
         init(100, 0xA000, idhash=other), coll(100, 0xA000), end(100, 0xA000, fn=nccl.FN_ABORT))
    colls = of(tr, ev.CollEnter)
    assert [(e.comm[-16:], e.seq) for e in colls] == [(f"{IDENT:016x}", 0), (f"{other:016x}", 0)]
    assert (tr.counters["destroyed"], tr.counters["aborted"]) == (1, 1)
    assert not tr.procs[100].comms


def test_records_of_forgotten_or_unknown_processes_are_ignored(tr):
    tr.forget(100)
    feed(tr, init(100, 0xA000), coll(300, 0xA000))
    assert tr.out == []


def test_unknown_dtype_and_fn(tr):
    feed(tr, init(100, 0xA000), coll(100, 0xA000, dtype=42), coll(100, 0xA000, fn=99))
    (c,) = of(tr, ev.CollEnter)
    assert (c.dtype, c.nbytes) == ("nccl_dtype42", -1)
    assert tr.counters["unknown_fn"] == 1


def test_a_process_the_profiler_plugin_reports_is_left_to_it_from_then_on(tr):
    # Rank 0's plugin reports from ts 10 on: its records from then are dropped (counted); its earlier
    # ones and rank 1's are translated as before.
    tr.defer_to_plugin(100, 10)
    feed(tr, init(100, 0xA000, ts=1), init(200, 0xB000, rank=1, ts=1),
         coll(100, 0xA000, ts=9), coll(100, 0xA000, ts=10), coll(200, 0xB000, ts=11), coll(100, 0xA000, ts=12))
    assert [(e.pid, e.seq) for e in of(tr, ev.CollEnter)] == [(100, 0), (200, 0)]
    assert tr.counters["left_to_plugin"] == 2
    tr.forget(100)
    assert tr._plugin_since == {}
