"""The batch gloo translator (ccld/bpf/gloo_translator.py, a drain at a time with array operations)
against the one-record-at-a-time translator it replaced (gloo_reference.py), on generated probe hits.

A small model of gloo.bpf.c turns a random run of probe hits (API entries, nextTag, works built,
executed, sized, finished, reused at the same address; groups created, connections broken, p2p
posted; works never entered) into the records the program writes; both translators read them, the
batch one in drains cut at random places with flushes in between (some long enough to release
enters waiting for a size), the reference record by record with the same flushes. For every
process: the same communicators announced in the same order, the same other events in the same
order with the same fields, and the same counters (unmatched, unsized). The same comparison on
records the kernel wrote for real jobs: test_gloo_probes.py (every test replays its drains).
No root.
"""
from __future__ import annotations

import ctypes as ct
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ccld import wire as ev
from ccld.bpf import gloo_records as gr
from ccld.bpf.gloo_translator import HOLD_MS, GlooTranslator
from ccld.bpf.rows import Rows
from gloo_reference import ReferenceTranslator

pytestmark = pytest.mark.unit

MS = 1_000_000
OPS = [1, 1, 1, 15, 4, 11, 0, 12]  # allreduce (x3), barrier, allgather, alltoall, broadcast, a send's work


class Kernel:
    """gloo.bpf.c's logic for the records it writes (not its probes' timing)."""

    def __init__(self, tags: bool):
        self.tags = tags
        self.t = 10 * MS
        self.recs = []
        self.counter = defaultdict(int)   # pg -> c10d's collectiveCounter_
        self.api = {}                     # tid -> {pg, ts, ctr, used}
        self.works = {}                   # (pid, work) -> (pg, seq)
        self.pg_seq = {}                  # (pid, pg) -> last seq
        self.exec = {}                    # tid -> state

    def tick(self, dt=1000):
        self.t += dt
        return self.t

    def _rec(self, cls, kind, pid, tid, **f):
        r = cls()
        r.hdr.kind, r.hdr.version, r.hdr.size = kind, 1, ct.sizeof(cls)
        r.hdr.ts_ns, r.hdr.tgid, r.hdr.tid = self.tick(), pid, tid
        for k, v in f.items():
            setattr(r, k, v)
        self.recs.append(r)

    def api_enter(self, tid, pg):
        self.api[tid] = {"pg": pg, "ts": self.tick(), "ctr": self.counter[pg] if self.tags else -1, "used": False}

    def next_tag(self, pg):
        self.counter[pg] += 1

    def work_init(self, pid, tid, work, op, lib_seq):
        now = self.tick()
        pg, enter_ns, tag = 0, now, -1
        e = self.api.get(tid)
        if e is not None:
            pg = e["pg"]
            ctr = self.counter[pg] if self.tags else -1
            if ctr >= 0 and e["ctr"] >= 0 and ctr != e["ctr"]:
                tag = ctr - 1
            e["ctr"] = ctr
            if not e["used"]:
                enter_ns, e["used"] = e["ts"], True
        if 12 <= op <= 14:
            return
        last = self.pg_seq.get((pid, pg))
        seq = tag + 1 if tag >= 0 else (last or 0) + 1
        self.pg_seq[(pid, pg)] = seq
        old = self.works.get((pid, work))
        reuse = int(old is not None and not old["covered"])
        self.works[(pid, work)] = {"pg": pg, "seq": seq, "enter_ns": enter_ns, "lib_seq": lib_seq, "tid": tid,
                                   "op": op, "covered": False}
        self._rec(gr.WorkInit, gr.WORK_INIT, pid, tid, pg=pg, work=work, seq=seq, lib_seq=lib_seq,
                  enter_ns=enter_ns, timeout_ms=1000, tag=tag, op=op, reuse=reuse)

    @staticmethod
    def _enter_of(wv):
        e = gr.EnterOf()
        if wv is not None:
            e.enter_ns, e.lib_seq, e.tid, e.op = wv["enter_ns"], wv["lib_seq"], wv["tid"], wv["op"]
            e.found, e.releases = 1, int(not wv["covered"])
        return e

    def _start(self, pid, tid, s, sized):
        wv = self.works.get((pid, s["work"]))
        e = self._enter_of(wv)
        if not sized:
            e.releases = 0
        elif wv is not None:
            wv["covered"] = True
        self._rec(gr.WorkStart, gr.WORK_START, pid, tid, pg=wv["pg"] if wv else 0, work=s["work"],
                  seq=wv["seq"] if wv else 0, start_ns=s["start"], min_bytes=s["min"] if s["n"] else 0,
                  total_bytes=s["total"], nbufs=s["n"], sized=sized, e=e)

    def work_exec(self, pid, tid, work):
        s = self.exec.get(tid)
        if s is not None and s["open"]:
            self._start(pid, tid, s, 0)
        self.exec[tid] = {"work": work, "start": self.tick(), "min": (1 << 64) - 1, "total": 0, "n": 0,
                          "open": True}

    def buf(self, tid, n):
        s = self.exec.get(tid)
        if s is not None and s["open"]:
            s["n"] += 1
            s["total"] += n
            s["min"] = min(s["min"], n)

    def algo(self, pid, tid):
        s = self.exec.get(tid)
        if s is not None and s["open"]:
            s["open"] = False
            self._start(pid, tid, s, 1)

    def finish(self, pid, tid, work, ok):
        start_ns = 0
        s = self.exec.get(tid)
        if s is not None and s["open"]:
            if s["work"] == work:
                start_ns = s["start"]
            else:
                self._start(pid, tid, s, 0)
            s["open"] = False
        wv = self.works.pop((pid, work), None)
        self._rec(gr.WorkEnd, gr.WORK_END, pid, tid, pg=wv["pg"] if wv else 0, work=work,
                  seq=wv["seq"] if wv else 0, start_ns=start_ns, ok=ok, e=self._enter_of(wv))

    def pg_init(self, pid, pg, rank, size):
        self._rec(gr.PgInit, gr.PG_INIT, pid, pid, pg=pg, rank=rank, size=size)

    def pg_name(self, pid, name):
        self._rec(gr.PgName, gr.PG_NAME, pid, pid, pg=0x9000, len=len(name), name=name)

    def pair_fail(self, pid, peer):
        self._rec(gr.PairFail, gr.PAIR_FAIL, pid, pid + 2, pair=0x77, peer=peer,
                  msg=b"[pair.cc:1] Read error [127.0.0.1]:4000: Connection reset by peer")


def run_program(draw):
    """A random run: (kernel records, cut points with flush times, pids, tags readable). Works come
    from a pool of three addresses per process: freed ones are reused, and now and then one still in
    flight is built again (the kernel flags that enter `reuse`)."""
    tags = draw(st.booleans())
    k = Kernel(tags)
    pids = [100, 200][:draw(st.integers(1, 2))]
    pgs = {p: [0x1000 * (i + 1) for i in range(draw(st.integers(1, 2)))] for p in pids}
    for p in pids:
        for i, pg in enumerate(pgs[p]):
            if draw(st.integers(0, 4)):  # mostly seen at creation
                k.pg_init(p, pg, 0, 2)
                if draw(st.integers(0, 3)):  # and named (c10d's setGroupName), mostly
                    k.pg_name(p, str(i).encode())
    queue = {p: [] for p in pids}      # entered works not executed yet
    running = {p: None for p in pids}  # the work the worker runs
    free = {p: [0xA0, 0xB0, 0xC0] for p in pids}
    lib = defaultdict(int)
    cuts = []
    for _ in range(draw(st.integers(5, 70))):
        p = draw(st.sampled_from(pids))
        act = draw(st.sampled_from(["enter"] * 4 + ["exec"] * 3 + ["algo"] * 3 + ["finish"] * 3 +
                                   ["cut", "cut", "stray", "pgnew", "fail", "noapi", "name"]))
        if act in ("enter", "noapi") and free[p]:
            w = free[p].pop(0) if draw(st.integers(0, 9)) else free[p][0]  # sometimes reused while in flight
            pg = draw(st.sampled_from(pgs[p]))
            op = draw(st.sampled_from(OPS))
            if act == "enter":
                k.api_enter(p, pg)
            else:
                k.api.pop(p, None)
            if draw(st.integers(0, 6)):
                k.next_tag(pg)
            lib[p] += 1
            k.work_init(p, p, w, op, lib[p])
            if 12 <= op <= 14:
                free[p].append(w)
            else:
                queue[p].append(w)
        elif act == "exec" and queue[p] and running[p] is None:
            running[p] = queue[p].pop(0)
            k.work_exec(p, p + 1, running[p])
            for _ in range(draw(st.integers(0, 3))):
                k.buf(p + 1, draw(st.sampled_from([64, 4096, 16384])))
        elif act == "algo":
            k.algo(p, p + 1)
        elif act == "finish" and running[p] is not None:
            ok = draw(st.integers(0, 9)) > 0
            k.finish(p, p + 1, running[p], int(ok))
            free[p].append(running[p])
            running[p] = None
        elif act == "stray":
            k.finish(p, p + 1, 0xF00, 1)
        elif act == "pgnew":
            pg = 0x1000 * (len(pgs[p]) + 1)
            pgs[p].append(pg)
            k.pg_init(p, pg, 1, 2)
        elif act == "name":  # a name with nothing (or a group already used) pending, or a helper's second
            k.pg_name(p, draw(st.sampled_from([b"7", b"", b"a" * 63])))
        elif act == "fail":
            k.pair_fail(p, draw(st.integers(-1, 1)))
        elif act == "cut":
            cuts.append((len(k.recs), k.t + draw(st.sampled_from([0, 1000, HOLD_MS * MS]))))
    cuts.append((len(k.recs), k.t + draw(st.sampled_from([0, HOLD_MS * MS]))))
    return k.recs, cuts, pids, tags


def rows_of(recs):
    raw = b"".join(bytes(r).ljust(gr.REC_SIZE, b"\0") for r in recs)
    rows = np.frombuffer(raw, np.uint8).reshape(len(recs), gr.REC_SIZE).copy()
    good, kinds = gr.KINDS.check(rows, {})
    assert len(good) == len(recs)
    return good, kinds


def by_process(items):
    """pid -> (its CommInits, everything else it sent), in order (Rows expanded)."""
    out = defaultdict(lambda: ([], []))
    for item in items:
        for e in (item.events() if isinstance(item, Rows) else [item]):
            out[e.pid][0 if isinstance(e, ev.CommInit) else 1].append(e)
    return dict(out)


def compare(batch_items, ref_events, bt, rt):
    got, want = by_process(batch_items), by_process(ref_events)
    assert set(got) == set(want)
    for pid in want:
        assert got[pid][0] == want[pid][0], f"pid {pid}: communicators announced differ"
        assert got[pid][1] == want[pid][1], f"pid {pid}: events differ"
    assert (bt.unmatched, bt.unsized) == (rt.unmatched, rt.unsized)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_batch_equals_record_by_record_on_generated_runs(data):
    recs, cuts, pids, tags = run_program(data.draw)
    batch_out, ref_out = [], []
    bt, rt = GlooTranslator(batch_out.append), ReferenceTranslator(ref_out.append)
    for t in (bt, rt):
        for p in pids:
            t.add_process(p, p // 100, "job")
            t.tags_readable(p, tags)
    a = 0
    for b, now in cuts:
        if b > a:
            rows, kinds = rows_of(recs[a:b])
            bt.records(rows, kinds)
            for r in recs[a:b]:
                rt.feed(r.hdr.kind, r)
        bt.flush(now)
        rt.flush(now)
        a = b
    if data.draw(st.booleans()):
        for t in (bt, rt):
            t.forget(pids[0])
    compare(batch_out, ref_out, bt, rt)


def test_a_whole_drain_of_collectives_is_one_rows():
    k = Kernel(True)
    for i in range(50):
        k.api_enter(100, 0x1000)
        k.next_tag(0x1000)
        k.work_init(100, 100, 0xA0, 1, i)
        k.work_exec(100, 101, 0xA0)
        k.buf(101, 4096)
        k.algo(100, 101)
        k.finish(100, 101, 0xA0, 1)
    out = []
    t = GlooTranslator(out.append)
    t.add_process(100, 0, "job")
    t.records(*rows_of(k.recs))
    assert [type(x).__name__ for x in out] == ["CommInit", "Rows"]
    events = out[1].events()
    assert len(events) == 150 and [e.seq for e in events if e.KIND == "coll"] == list(range(1, 51))
    assert {e.nbytes for e in events if e.KIND == "coll"} == {4096}
