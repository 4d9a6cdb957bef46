"""The ProcessGroupNCCL family without root: its probe names against torch's, and its translator (and the
NCCL API translator's hand-over of collectives) on hand-made records. The same records from the kernel,
on a library with torch's symbols: tests/bpf/test_pgnccl_probes.py."""
import ctypes as ct
import os
import subprocess

import numpy as np
import pytest

from ccld import wire as ev
from ccld.bpf import nccl, pgnccl
from ccld.bpf.rows import Rows

pytestmark = pytest.mark.unit

HERE = os.path.dirname(os.path.abspath(__file__))
SYMBOLS = os.path.join(HERE, "..", "data", "libtorch_cuda_symbols.txt")
SOURCE = os.path.join(HERE, "..", "workloads", "fake_torch_cuda.cpp")


def torch_names():
    with open(SYMBOLS) as f:
        return sorted(ln.strip() for ln in f if ln.strip() and not ln.startswith("#"))


def test_every_probe_matches_torchs_own_symbol_and_the_fake_exports_exactly_torchs():
    names = torch_names()
    for probe in pgnccl.PgncclFamily.PROBES:
        hits = [n for n in names if n.startswith(probe.prefix)]
        assert len(hits) == 1, (probe.fn, hits)  # the C1 constructor only (C2 is its alias)
    out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"ccld-fake-torch-{os.getpid()}.so")
    try:
        subprocess.run(["g++", "-shared", "-fPIC", "-O1", "-o", out, SOURCE], check=True, capture_output=True)
        nm = subprocess.run(["nm", "-D", "--defined-only", out], check=True, capture_output=True, text=True)
    finally:
        if os.path.exists(out):
            os.unlink(out)
    exported = sorted(ln.split()[-1] for ln in nm.stdout.splitlines() if "c10d" in ln)
    assert exported == names


class Out(list):
    def __call__(self, item):
        self.extend(item.events() if isinstance(item, Rows) else [item])


def _rows(kinds_of, recs):
    size = kinds_of.rec_size
    raw = b"".join(bytes(rec).ljust(size, b"\0") for rec in recs)
    rows = np.frombuffer(raw, np.uint8).reshape(len(recs), size).copy()
    good, kinds = kinds_of.check(rows, {})
    assert len(good) == len(recs)
    return good, kinds


def _hdr(rec, kind, pid, ts):
    rec.hdr.kind, rec.hdr.tgid, rec.hdr.tid, rec.hdr.ts_ns = kind, pid, pid + 1, ts
    rec.hdr.version, rec.hdr.size = 1, ct.sizeof(rec)
    return rec


def pg(pid, obj, rank, size, ts=1):
    return _hdr(pgnccl.PgnPg(pg=obj, rank=rank, size=size), pgnccl.PG, pid, ts)


def work(pid, uid, seq, op=1, p2p=0, obj=0, rank=0, ts=2):
    raw = uid.encode()
    return _hdr(pgnccl.PgnWork(pg=obj, seq=seq, rank=rank, op=op, p2p=p2p, uid_len=len(raw), uid=raw[:48]),
                pgnccl.WORK, pid, ts)


@pytest.fixture
def tr():
    out = Out()
    t = pgnccl.PgncclTranslator(out)
    t.out = out
    t.add_process(100, 4, "job")
    t.add_process(200, 5, "job")
    return t


def feed(t, *recs):
    t.records(*_rows(pgnccl.PgncclFamily.KINDS, recs))


def test_works_become_enters_numbered_by_c10d_and_groups_announced_once(tr):
    feed(tr, pg(100, 0xA0, 1, 8), work(100, "7", 41, op=1, obj=0xA0, rank=1, ts=5),
         work(200, "0", 9, op=15, rank=3, ts=6), work(100, "7", 42, op=0, obj=0xA0, rank=1, ts=7),
         work(100, "7", 3, op=12, p2p=1, obj=0xA0, rank=1, ts=8))
    inits = [e for e in tr.out if isinstance(e, ev.CommInit)]
    assert [(e.pid, e.rank, e.comm, e.group_rank, e.group_size, e.handle, e.seq_source) for e in inits] == [
        (100, 4, "job/nccl-pg:7", 1, 8, 0xA0, ev.SEQ_LIBRARY),   # its constructor was seen: its size
        (200, 5, "job/nccl-pg:0", 3, -1, 0, ev.SEQ_LIBRARY)]     # built before the attach: unknown
    colls = [e for e in tr.out if isinstance(e, ev.CollEnter)]
    assert [(e.pid, e.rank, e.comm, e.seq, e.lib_seq, e.op, e.ts_ns, e.tid, e.backend) for e in colls] == [
        (100, 4, "job/nccl-pg:7", 41, 41, "allreduce", 5, 101, "nccl"),
        (200, 5, "job/nccl-pg:0", 9, 9, "barrier", 6, 201, "nccl"),
        (100, 4, "job/nccl-pg:7", 42, 42, "broadcast", 7, 101, "nccl")]
    assert tr.counters["p2p_left_to_api"] == 1 and tr.counters["no_group"] == 1
    assert tr.out.index(inits[0]) < tr.out.index(colls[0])  # announced before its first collective
    assert not any(e.subgroup for e in inits)  # "7" has its size; "0" is the default group: the world


def test_a_group_of_unknown_size_other_than_the_default_one_is_a_subgroup_whose_members_are_those_seen(tr):
    from ccld.timeline.timeline import Timeline
    feed(tr, work(100, "3", 1, rank=0), work(200, "3", 1, rank=1), work(100, "0", 1, rank=4),
         work(200, "0", 1, rank=5))
    inits = {(e.pid, e.comm): e for e in tr.out if isinstance(e, ev.CommInit)}
    assert [inits[(p, "job/nccl-pg:3")].subgroup for p in (100, 200)] == [True, True]
    assert [inits[(p, "job/nccl-pg:0")].subgroup for p in (100, 200)] == [False, False]
    tl = Timeline()
    head = [ev.RankInfo(pid=pid, rank=rank, world_size=8, local_rank=rank, node="n", job="job", ts_ns=0)
            for pid, rank in ((100, 4), (200, 5))]
    frame = ev.encode_batch("a", "n", 1, head + [e for e in tr.out if isinstance(e, ev.CommInit)]
                            + [ev.ClockSample(mono_ns=0, wall_ns=10**18, ts_ns=0)])
    tl.ingest(ev.decode_batch(frame), 1e9)
    assert tl.expected_members("job/nccl-pg:3") == {4, 5}          # the ranks seen in it
    assert tl.expected_members("job/nccl-pg:0") == set(range(8))   # the world, though only 2 ranks told


def test_a_names_room_after_its_nul_is_not_read():
    """The ring's slots are not zeroed, so bytes of an earlier record may follow the name's NUL (the
    program clears the room; the translator reads up to the NUL anyway)."""
    out = Out()
    t = pgnccl.PgncclTranslator(out)
    t.add_process(100, 0, "job")
    rec = work(100, "0", 7)
    stale = b"0\0\x11stale bytes"  # written as the kernel would leave it (ctypes' setter stops at a NUL)
    ct.memmove(ct.addressof(rec) + pgnccl.PgnWork.uid.offset, stale, len(stale))
    t.records(*_rows(pgnccl.PgncclFamily.KINDS, [rec]))
    init = next(e for e in out if isinstance(e, ev.CommInit))
    assert (init.comm, init.subgroup) == ("job/nccl-pg:0", False)  # the default group, not a subgroup


def test_a_long_group_name_is_cut_and_counted(tr):
    feed(tr, work(100, "x" * 60, 1))
    assert [e.comm for e in tr.out if isinstance(e, ev.CollEnter)] == ["job/nccl-pg:" + "x" * 48]  # as written
    assert tr.counters["cut_names"] == 1


def test_processes_forgotten_or_left_to_the_plugin_are_dropped(tr):
    tr.defer_to_plugin(200, 10)
    feed(tr, work(200, "0", 1, ts=9), work(200, "0", 2, ts=10), work(300, "0", 1))
    assert [e.seq for e in tr.out if isinstance(e, ev.CollEnter)] == [1]  # the plugin's from ns 10; 300 unknown
    assert tr.counters["left_to_plugin"] == 1
    tr.forget(100)
    feed(tr, work(100, "0", 1))
    assert len([e for e in tr.out if isinstance(e, ev.CollEnter)]) == 1


def test_the_nccl_api_translator_leaves_a_c10d_traced_processs_collectives_but_keeps_its_p2p_and_comms():
    out = Out()
    t = nccl.NcclTranslator(out)
    t.add_process(100, 0, "job")
    t.add_process(200, 1, "job")
    t.leave_collectives(100)

    def rec(cls, kind, pid, ts, **kw):
        return _hdr(cls(**kw), kind, pid, ts)

    recs = [rec(nccl.NcclCommInit, nccl.COMM_INIT, pid, 1, comm=0xA0, idhash=7, fn=nccl.FN_INIT_RANK, nranks=2,
                rank=r, color=-1, key=-1) for r, pid in enumerate((100, 200))]
    recs += [rec(nccl.NcclCall, nccl.COLL, pid, 2, comm=0xA0, count=4, fn=nccl.FN_ALLREDUCE, datatype=7, root=-1)
             for pid in (100, 200)]
    recs += [rec(nccl.NcclCall, nccl.P2P_REC, 100, 3, comm=0xA0, count=4, fn=nccl.FN_SEND, datatype=7, root=1)]
    t.records(*_rows(nccl.NcclFamily.KINDS, recs))
    assert [e.pid for e in out if isinstance(e, ev.CommInit)] == [100, 200]
    assert [e.pid for e in out if isinstance(e, ev.CollEnter)] == [200]
    assert [(e.pid, e.peer) for e in out if isinstance(e, ev.P2P)] == [(100, 1)]
    assert t.counters["left_to_c10d"] == 1


def test_the_agent_hands_a_rank_s_collectives_to_c10d_once_the_processgroupnccl_probes_are_on_it():
    from ccld.bpf.loader import Attachment
    from ccld.tracer import discover
    from ccld.tracer.agent import Agent, Rank

    class Fam:  # a library family that finds its library and attaches (no kernel involved)
        def __init__(self, name):
            self.NAME = name

        def find_lib(self, pid, maps=None):
            return f"/x/lib{self.NAME}.so"

        def attach(self, pid, lib):
            return Attachment(pid, lib)

        def close(self):
            pass

    api = nccl.NcclTranslator(Out())
    agent = Agent("tcp://127.0.0.1:9", pids=[os.getpid()], use_bpf=False, say=lambda s: None, time_service="off")
    try:
        agent.families = [(Fam("nccl"), api)]
        ident = discover.RankIdentity(pid=4242, rank=0, world_size=2, local_rank=0, master_addr="", master_port=0,
                                       job="j", cmdline="")
        r = Rank(ident)
        agent._try_attach(r, vsize=1)
        assert r.attached == {"nccl": "/x/libnccl.so"} and not api._c10d  # the API probes alone: theirs
        agent.families.append((Fam("pgnccl"), pgnccl.PgncclTranslator(Out())))
        agent._try_attach(r, vsize=2)
        assert set(r.attached) == {"nccl", "pgnccl"} and api._c10d == {4242}
    finally:
        agent.stop()
