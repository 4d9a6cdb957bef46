"""Mid-run attach on NCCL's uprobe path: per-process communicators joined across ranks (timeline/align.py).

Each node's agent runs the real NcclTranslator on hand-made call records of a communicator made before
the attach (its init was never seen, so every process names it after itself and numbers its calls
from its first sight), ships what it makes as real frames (column blocks, a clock sample each), and
the Timeline joins the streams. Rank r's first seen call is collective ATTACH[r] of the job's stream,
so the offsets the aligner finds must be exactly those.
"""
import ctypes as ct
import random

import numpy as np
import pytest

from ccld import wire as ev
from ccld.bpf import nccl
from ccld.bpf.rows import Rows
from ccld.diagnose import Diagnoser
from ccld.timeline import align
from ccld.timeline.timeline import Timeline
from ccld.wire.blocks import Block
from ccld_synth import T0, SynthJob

pytestmark = pytest.mark.unit

HANDLE, HANDLE_B = 0x7F3A0000, 0x7F3B0000  # one address in every process: the names differ by rank
ATTACH = {0: 0, 1: 3, 2: 7, 3: 12}
PERIOD_S = 0.05  # one collective every 50 ms; a frame every 2
F32, I64, BF16 = 7, 4, 9
KINDS = [(nccl.FN_ALLREDUCE, 1 << 20, F32), (nccl.FN_ALLREDUCE, 4096, F32), (nccl.FN_BROADCAST, 16, I64),
         (nccl.FN_ALLGATHER, 1 << 16, BF16), (nccl.FN_REDUCESCATTER, 1 << 18, BF16)]


def handle_name(r, handle=HANDLE):
    return f"job/nccl:handle-r{r}-{handle:x}"


class NcclJob:
    """`world` ranks on 2 nodes; each node's agent with its own NcclTranslator, fed call records."""

    def __init__(self, world=4):
        self.s = SynthJob(world, nodes=2)
        self.tl = Timeline()
        self.out = {a.agent: [] for a in self.s.agents}
        self.drain = {a.agent: [] for a in self.s.agents}
        self.tr = {a.agent: nccl.NcclTranslator(self._sink(a.agent)) for a in self.s.agents}
        for a in self.s.agents:
            a.pending.append(ev.AgentHello(agent=a.agent, node=a.node, pid=1, version="test", sources=["nccl"],
                                           ts_ns=a.mono(T0)))
        for r in range(world):
            a = self.s.agent_of[r]
            self.tr[a.agent].add_process(self.s.pid[r], r, "job")
            a.pending.append(ev.RankInfo(pid=self.s.pid[r], rank=r, world_size=world, local_rank=r, node=a.node,
                                         job="job", ts_ns=a.mono(T0)))

    def _sink(self, agent):
        out = self.out[agent]
        return lambda item: out.extend(item.events() if isinstance(item, Rows) else [item])

    def call(self, r, t, kind, handle=HANDLE):
        fn, count, dtype = kind
        rec = nccl.NcclCall(comm=handle, count=count, fn=fn, datatype=dtype, redop=0, root=-1)
        pid = self.s.pid[r]
        rec.hdr.kind, rec.hdr.tgid, rec.hdr.tid, rec.hdr.ts_ns = nccl.COLL, pid, pid, self.s.ts(r, t)
        rec.hdr.version, rec.hdr.size = 1, ct.sizeof(rec)
        self.drain[self.s.agent_of[r].agent].append(rec)

    def feed(self, t):
        """Each agent's drain through its translator, then every agent's frame, received at t."""
        size = nccl.NcclFamily.KINDS.rec_size
        for a in self.s.agents:
            recs = sorted(self.drain[a.agent], key=lambda rec: rec.hdr.ts_ns)  # the ring's order
            self.drain[a.agent] = []
            if recs:
                raw = b"".join(bytes(rec).ljust(size, b"\0") for rec in recs)
                rows = np.frombuffer(raw, np.uint8).reshape(len(recs), size).copy()
                good, kinds = nccl.NcclFamily.KINDS.check(rows, {})
                self.tr[a.agent].records(good, kinds)
            a.pending.extend(self.out[a.agent])
            self.out[a.agent].clear()
        self.s.feed(self.tl, t)

    def run(self, stream, first, last, t0, jitter, stopped=(), handle=HANDLE, attach=ATTACH, also=None):
        """Collectives first..last-1 of `stream`: rank r calls collective k (from attach[r] on) at
        t0 + k * PERIOD_S + jitter(r, k); `also(k, t)` adds calls of another communicator. A frame
        every 2 collectives. Returns the time of the last frame."""
        t = t0
        for k in range(first, last):
            t = t0 + k * PERIOD_S
            for r in range(self.s.world):
                if k >= attach[r] and r not in stopped:
                    self.call(r, t + jitter(r, k), stream[k], handle)
            if also is not None:
                also(k, t)
            if k % 2 == 1:
                self.feed(t + 0.01)
        t += 0.01
        self.feed(t)
        return t

    def idle(self, t, until):
        """Frames with nothing but clock samples (live agents) from t to until, every 0.5 s."""
        while t < until:
            t = min(until, t + 0.5)
            self.s.feed(self.tl, t)
        return t


def mixed(n, seed=5):
    rng = random.Random(seed)
    return [rng.choice(KINDS) for _ in range(n)]


def small_jitter(r, k):
    return 0.0002 * r + 0.0001 * (k % 3)  # ranks enter a collective within a millisecond


def test_mid_run_attach_aligns_exactly_and_a_hang_is_named_on_it():
    job = NcclJob()
    stream = mixed(200)
    t = job.run(stream, 0, 120, T0 + 1, small_jitter)
    tl = job.tl
    aligned = "job/nccl:aligned-r0-7f3a0000"  # after the stream seen longest: rank 0's
    assert {n: v[:2] for n, v in tl.align.rewrites.items()} == {handle_name(r): (aligned, ATTACH[r]) for r in range(4)}
    assert {c.seq_sources.get(r) for r in range(4) for c in [tl.comms[handle_name(r)]]} == {ev.SEQ_FROM_ATTACH}
    g = tl.comms[aligned]
    assert g.members == {0, 1, 2, 3} and tl.expected_members(aligned) == {0, 1, 2, 3}
    # collective k is seq k on the aligned communicator for every rank, op and size alike
    start = max(v[2] for v in tl.align.rewrites.values())
    for k in range(start, 120):
        view = g.colls[k]
        assert set(view.enter) == {0, 1, 2, 3}
        assert {view.ops[r] for r in range(4)} == {nccl.OP_NAMES[stream[k][0]]}
        assert len({view.sizes[r] for r in range(4)}) == 1
    assert tl.counters()["nccl_alignment"] == {"aligned_comms": 1, "aligned_streams": 4, "waiting": {}}
    d = Diagnoser(tl)
    assert d.diagnose(t + 0.01) == []

    # rank 2 stops calling at collective 120; the others enter it and wait
    t = job.run(stream, 120, 121, T0 + 1, small_jitter, stopped={2})
    now = job.idle(t, t + 30)
    found = d.diagnose(now)
    assert [(f.kind, f.cls, f.ranks, f.comm, f.seq, f.op) for f in found] == [
        ("hang", "not-entered", [2], aligned, 120, nccl.OP_NAMES[stream[120][0]])]
    al = found[0].evidence["alignment"]
    assert al["how"] == "op stream and enter times" and al["n_members"] == 4
    assert al["matched_calls"] >= align.MIN_MATCH
    assert {m["rank"]: (m["from"], m["seq_offset"]) for m in al["members"]} == {
        r: (handle_name(r), ATTACH[r]) for r in range(4)}
    assert found[0].evidence["waiting"] == [0, 1, 3]


def test_a_rank_that_left_an_aligned_communicator_is_a_member_again_at_its_next_enter():
    job = NcclJob()
    stream = mixed(200)
    t = job.run(stream, 0, 120, T0 + 1, small_jitter)
    g = job.tl.comms["job/nccl:aligned-r0-7f3a0000"]
    g.drop_member(2)  # as align.watch does when rank 2's handle is announced again
    assert g.members == {0, 1, 3}
    job.run(stream, 120, 124, T0 + 1, small_jitter)
    assert g.members == {0, 1, 2, 3} and set(g.colls[123].enter) == {0, 1, 2, 3}


def test_identical_calls_are_aligned_by_enter_times():
    job = NcclJob()
    stream = [(nccl.FN_ALLREDUCE, 1 << 20, F32)] * 200
    t = job.run(stream, 0, 100, T0 + 1, small_jitter)
    aligned = "job/nccl:aligned-r0-7f3a0000"
    assert {n: v[:2] for n, v in job.tl.align.rewrites.items()} == {
        handle_name(r): (aligned, ATTACH[r]) for r in range(4)}
    members = job.tl.comms[aligned].alignment["members"]
    for m in members[1:]:  # a call off, they are a whole period apart
        assert m["median_dt_s"] < 0.002 and m["next_best_dt_s"] > 0.04
    assert Diagnoser(job.tl).diagnose(job.idle(t, t + 1)) == []


def test_noisy_times_on_identical_calls_are_not_aligned_and_nothing_is_judged():
    job = NcclJob()
    stream = [(nccl.FN_ALLREDUCE, 1 << 20, F32)] * 200
    rng = random.Random(11)
    noise = {(r, k): rng.uniform(-0.04, 0.04) for r in range(4) for k in range(200)}  # +-40 ms at a 50 ms period
    t = job.run(stream, 0, 100, T0 + 1, lambda r, k: noise[(r, k)])
    tl = job.tl
    assert tl.align.rewrites == {} and not any("aligned" in c for c in tl.comms)
    assert tl.anomalies["nccl-align-ambiguous"] >= 1
    assert tl.counters()["nccl_alignment"]["waiting"].get("ambiguous", 0) >= 1
    # rank 2 stops: the others' per-process streams go on alone; nothing rests on an unaligned stream
    t = job.run(stream, 100, 101, T0 + 1, lambda r, k: noise[(r, k)], stopped={2})
    assert Diagnoser(tl).diagnose(job.idle(t, t + 30)) == []
    assert all(tl.expected_members(handle_name(r)) == {r} for r in range(4))


def test_two_communicators_per_process_are_aligned_apart():
    job = NcclJob()
    a_stream = mixed(200, seed=1)
    b_stream = [KINDS[3] if k % 3 else KINDS[4] for k in range(200)]
    attach_b = {0: 2, 1: 0, 2: 5, 3: 9}

    def b_calls(k, t):  # the second communicator: one call per step, 10 ms after the first's
        for r in range(4):
            if k >= attach_b[r]:
                job.call(r, t + 0.01 + small_jitter(r, k), b_stream[k], HANDLE_B)

    job.run(a_stream, 0, 120, T0 + 1, small_jitter, also=b_calls)
    rw = job.tl.align.rewrites
    a_name, b_name = "job/nccl:aligned-r0-7f3a0000", "job/nccl:aligned-r1-7f3b0000"
    assert {n: v[:2] for n, v in rw.items() if v[0] == a_name} == {
        handle_name(r): (a_name, ATTACH[r]) for r in range(4)}
    assert {n: v[:2] for n, v in rw.items() if v[0] == b_name} == {
        handle_name(r, HANDLE_B): (b_name, attach_b[r] - attach_b[1]) for r in range(4)}


def test_gloo_and_named_nccl_communicators_are_untouched():
    s = SynthJob(world=4, nodes=2)  # gloo, with a hang at the end
    tl = Timeline()
    s.announce(T0)
    t = s.steps(1, 40, T0 + 1)
    s.collective(41, t + 0.1, ranks=[0, 1, 3], finish=False)
    s.feed(tl, t + 0.2)
    job = NcclJob()  # and an NCCL communicator whose init was seen: named alike on every rank
    for r in range(4):
        init = nccl.NcclCommInit(comm=HANDLE, idhash=0x1234, fn=nccl.FN_INIT_RANK, ret=0, nranks=4, rank=r)
        init.hdr.kind, init.hdr.tgid, init.hdr.ts_ns = nccl.COMM_INIT, job.s.pid[r], job.s.ts(r, T0 + 0.5)
        init.hdr.version, init.hdr.size = 1, ct.sizeof(init)
        job.drain[job.s.agent_of[r].agent].append(init)
    job.run(mixed(100), 0, 60, T0 + 1, small_jitter, attach={r: 0 for r in range(4)})
    for tl_ in (tl, job.tl):
        assert not tl_.align.waiting and not tl_.align.rewrites and not tl_.align.nodes
        assert not any(c.members_only for c in tl_.comms.values())
    assert job.tl.comms["job/nccl:0000000000001234"].seq_sources == {r: ev.SEQ_FROM_INIT for r in range(4)}
    found = Diagnoser(tl).diagnose(t + 30)
    assert [(f.cls, f.ranks, f.comm) for f in found] == [("not-entered", [2], "job/gloo:0")]
    assert "alignment" not in found[0].evidence


def test_rewrite_moves_calls_from_start_on_and_leaves_p2p():
    tl = Timeline()
    tl.align.rewrites["j/nccl:handle-r1-a"] = ("j/nccl:aligned-r0-a", 5, 12)
    coll = Block("coll", 4, 0, {"comm": "j/nccl:handle-r1-a", "op": "allreduce", "backend": "nccl"},
                 {"seq": [5, 6, 7, 8], "pid": [1] * 4, "rank": [1] * 4, "ts_ns": [10, 11, 12, 13], "tid": [1] * 4})
    end = Block("end", 1, 0, {"comm": "j/nccl:handle-r1-a", "seq": 9}, {"pid": [1], "rank": [1], "ts_ns": [14]})
    other = Block("coll", 1, 0, {"comm": "j/gloo:0", "op": "allreduce", "backend": "gloo"},
                  {"seq": [3], "pid": [2], "rank": [0], "ts_ns": [1], "tid": [2]})
    p2p = ev.P2P(pid=1, rank=1, ts_ns=15, backend="nccl", comm="j/nccl:handle-r1-a", op="send", peer=0)
    start = ev.WorkStart(pid=1, rank=1, ts_ns=16, comm="j/nccl:handle-r1-a", seq=10)
    plain, blocks = tl.align.rewrite([p2p, start], [coll, end, other])
    assert plain[0] is p2p and (plain[1].comm, plain[1].seq) == ("j/nccl:aligned-r0-a", 15)
    assert [(b.kind, b.same["comm"], b.same.get("seq"), b.cols.get("seq")) for b in blocks] == [
        ("coll", "j/nccl:handle-r1-a", None, [5, 6]),       # before the alignment: where they were
        ("coll", "j/nccl:aligned-r0-a", None, [12, 13]),
        ("end", "j/nccl:aligned-r0-a", 14, None),
        ("coll", "j/gloo:0", None, [3])]
    assert blocks[1].cols["ts_ns"] == [12, 13] and blocks[3] is other


def _stream(keys, times, first=0):
    return np.arange(first, first + len(keys), dtype=np.int64), list(keys), np.array(times, float)


def test_match_decides_by_ops_then_times():
    n = 80
    ops = [("allreduce", k % 5, "float32") for k in range(n)]  # a period of 5 calls
    times = [k * 0.05 for k in range(n)]
    a = _stream(ops, times)
    b = _stream(ops[30:], [x + 0.001 for x in times[30:]], first=0)
    m = align.match(a, b)
    assert (m.offset, m.reason) == (30, "aligned") and m.next_dt_s > 0.2  # the next agreeing offset: 5 calls off
    assert align.match(a, _stream(ops[30:40], times[30:40])).reason == "few-calls"
    assert align.match(a, _stream([("allgather", 1, "bf16")] * 40, times[:40])).reason == "no-match"
    halfway = _stream(ops[30:], [x + 0.05 * 2.5 for x in times[30:]])  # 2.5 calls late: 5 off is as near
    assert align.match(a, halfway).reason == "ambiguous"


def test_expected_members_follow_a_rank_swapped_for_another_at_the_same_count():
    job = NcclJob()
    job.run(mixed(200), 0, 120, T0 + 1, small_jitter)
    tl = job.tl
    name = "job/nccl:aligned-r0-7f3a0000"
    g = tl.comms[name]
    assert tl.expected_members(name) == {0, 1, 2, 3}
    g.drop_member(2)
    g.members.add(9)  # as many members as before, one of them another
    assert tl.expected_members(name) == {0, 1, 3, 9}
