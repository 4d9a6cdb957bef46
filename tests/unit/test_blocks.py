"""Column blocks (ccld/wire/blocks.py): the wire shape, its validation, and that the timeline leaves exactly
the same state whether a frame's collective events came as column blocks or as one map each, and whether
frames came one ingest at a time or several together, on random jobs with every oddity."""
from __future__ import annotations

import random

import msgpack
import pytest

from ccld import wire as ev
from ccld.wire import blocks, table
from ccld.timeline.ingest import IngestCounters, decode_frame
from ccld.timeline.timeline import Timeline

pytestmark = pytest.mark.unit

T0_NS = 5_000_000_000_000


def coll(r, seq, t, comm="j/gloo:0", op="allreduce", pid=None, backend="gloo", tid=0, count=-1):
    return ev.CollEnter(pid=pid or 100 + r, rank=r, ts_ns=t, backend=backend, comm=comm, seq=seq, op=op,
                        tid=tid, count=count)


def start(r, seq, t, comm="j/gloo:0", pid=None):
    return ev.WorkStart(pid=pid or 100 + r, rank=r, ts_ns=t, comm=comm, seq=seq)


def end(r, seq, t, comm="j/gloo:0", pid=None, ok=True):
    return ev.WorkEnd(pid=pid or 100 + r, rank=r, ts_ns=t, comm=comm, seq=seq, ok=ok, error="" if ok else "boom")


def env(events=(), blocks_=(), minor=ev.SCHEMA_MINOR, **over):
    d = {"v": [ev.SCHEMA_MAJOR, minor], "agent": "a1", "node": "n1", "batch": 1, "events": list(events),
         "blocks": list(blocks_)}
    d.update(over)
    return msgpack.packb(d, use_bin_type=True)


GOOD_BLOCK = {"k": "start", "n": 2, "at": 0, "same": {"comm": "j/gloo:0"},
              "cols": {"seq": [4, 4], "pid": [100, 101], "rank": [0, 1], "ts_ns": [10, 11]}}


# ---- wire shape ----------------------------------------------------------------------------------

def test_hot_kinds_travel_as_blocks_sorted_by_seq_and_everything_else_as_maps():
    evs = [ev.ClockSample(mono_ns=1, wall_ns=2, ts_ns=1), end(0, 2, 30), coll(0, 3, 40), coll(1, 3, 41),
           coll(0, 1, 5, op="broadcast"), end(1, 1, 9), ev.RankExit(pid=100, rank=0, ts_ns=50)]
    d = msgpack.unpackb(ev.encode_batch("a", "n", 1, evs), raw=False)
    assert [e["k"] for e in d["events"]] == ["clock", "rank_exit"]
    shapes = {(b["k"], b["same"].get("op")): b for b in d["blocks"]}
    assert set(shapes) == {("end", None), ("coll", "allreduce"), ("coll", "broadcast")}
    ends = shapes[("end", None)]
    assert ends["n"] == 2 and ends["at"] == 1 and ends["cols"]["seq"] == [1, 2] and ends["cols"]["rank"] == [1, 0]
    assert ends["same"] == {"comm": "j/gloo:0", "ok": True, "error": ""}
    assert shapes[("coll", "allreduce")]["cols"]["ts_ns"] == [40, 41]
    # and back: every event, each collective's enter before its end, the map events around them
    back = ev.decode_batch(ev.encode_batch("a", "n", 1, evs)).events
    assert sorted(map(repr, back)) == sorted(map(repr, evs))
    assert back[0] == evs[0] and back[-1] == evs[-1]
    assert back.index(coll(0, 1, 5, op="broadcast")) < back.index(end(1, 1, 9))


def test_any_field_may_be_shared_or_a_column():
    block = {"k": "coll", "n": 2, "at": 0, "same": {"seq": 7, "rank": 3, "backend": "gloo", "op": "allreduce"},
             "cols": {"comm": ["c1", "c2"], "pid": [5, 6], "ts_ns": [1, 2]}}
    batch = ev.decode_batch(env(blocks_=[block]))
    assert batch.events == [ev.CollEnter(pid=5, rank=3, ts_ns=1, backend="gloo", comm="c1", seq=7, op="allreduce"),
                            ev.CollEnter(pid=6, rank=3, ts_ns=2, backend="gloo", comm="c2", seq=7, op="allreduce")]
    assert len(batch) == 2 and batch.errors == []


def test_expand_gives_the_wire_maps_a_row_reader_would_have_seen():
    evs = [coll(0, 1, 5), start(0, 1, 6), end(0, 1, 7), ev.ClockSample(mono_ns=1, wall_ns=2, ts_ns=1)]
    d = msgpack.unpackb(ev.encode_batch("a", "n", 1, evs), raw=False)
    assert table.expand(d) == [e.to_wire() for e in evs]


BAD_BLOCKS = [
    ("not a map", [1, 2], "bad-block", 1),
    ("kind not a str", dict(GOOD_BLOCK, k=3), "bad-block", 2),
    ("unknown kind", dict(GOOD_BLOCK, k="warp"), "unknown-kind", 2),
    ("n not an int", dict(GOOD_BLOCK, n="2"), "bad-block", 1),
    ("n zero", dict(GOOD_BLOCK, n=0), "bad-block", 1),
    ("at past the events", dict(GOOD_BLOCK, at=5), "bad-block", 2),
    ("column too short", dict(GOOD_BLOCK, cols=dict(GOOD_BLOCK["cols"], pid=[100])), "bad-block", 2),
    ("column not a list", dict(GOOD_BLOCK, cols=dict(GOOD_BLOCK["cols"], pid=7)), "bad-block", 2),
    ("bool in an int column", dict(GOOD_BLOCK, cols=dict(GOOD_BLOCK["cols"], seq=[4, True])), "bad-field", 2),
    ("str in an int column", dict(GOOD_BLOCK, cols=dict(GOOD_BLOCK["cols"], ts_ns=[1, "2"])), "bad-field", 2),
    ("shared field of the wrong type", dict(GOOD_BLOCK, same={"comm": 5}), "bad-field", 2),
    ("missing field", dict(GOOD_BLOCK, same={}), "missing-field", 2),
    ("both shared and a column", dict(GOOD_BLOCK, same={"comm": "c", "seq": 4}), "bad-block", 2),
    ("packed column short", dict(GOOD_BLOCK, cols=dict(GOOD_BLOCK["cols"], pid=b"\0" * 15)), "bad-block", 2),
    ("packed column of 3-byte ints", dict(GOOD_BLOCK, cols=dict(GOOD_BLOCK["cols"], pid=b"\0" * 6)), "bad-block", 2),
    ("packed column of a str field", dict(GOOD_BLOCK, cols=dict(GOOD_BLOCK["cols"], comm=b"\0" * 16),
                                          same={}), "bad-field", 2),
]


@pytest.mark.parametrize("name,bad,reason,weight", BAD_BLOCKS, ids=[b[0] for b in BAD_BLOCKS])
def test_a_bad_block_is_dropped_counted_by_its_rows_and_the_rest_kept(name, bad, reason, weight):
    c = IngestCounters()
    batch, err = decode_frame(env([GOOD_BLOCK["cols"] and start(0, 4, 9).to_wire()], [GOOD_BLOCK, bad, GOOD_BLOCK]), c)
    assert err is None and len(batch) == 5
    assert [e.reason for e in batch.errors] == [reason]
    assert "block #1" in str(batch.errors[0]) and "'a1'" in str(batch.errors[0])
    assert c.bad_events == {reason: weight}


def test_unknown_kind_in_a_newer_minor_is_skipped_and_counted_by_rows():
    batch = ev.decode_batch(env(blocks_=[dict(GOOD_BLOCK, k="warp"), GOOD_BLOCK], minor=ev.SCHEMA_MINOR + 1))
    assert batch.skipped == 2 and batch.errors == [] and len(batch) == 2


def test_blocks_not_a_list_rejects_the_frame():
    with pytest.raises(ev.FrameError) as ei:
        ev.decode_batch(env(blocks_=(), **{"blocks": {"k": "coll"}}))
    assert ei.value.reason == "bad-envelope" and "'blocks'" in str(ei.value)


def test_more_rows_than_a_frame_may_carry_rejects_the_frame():
    big = dict(GOOD_BLOCK, n=ev.MAX_EVENTS_PER_FRAME)
    with pytest.raises(ev.FrameError) as ei:
        ev.decode_batch(env(blocks_=[big, big]))
    assert ei.value.reason == "too-many-items"


def test_unsorted_rows_are_read_in_seq_order():
    b = blocks.read_block({"k": "end", "n": 3, "at": 0, "same": {"comm": "c"},
                           "cols": {"seq": [9, 3, 9], "pid": [1, 2, 3], "rank": [0, 1, 2], "ts_ns": [7, 8, 9]}}, 0)
    assert blocks.seq_runs(b) == [(3, 0, 1), (9, 1, 3)]
    assert b.cols["pid"] == [2, 1, 3]


# ---- the timeline: blocks == maps, frames together == one at a time ---------------------------

def snapshot(tl: Timeline):
    comms = {}
    for cid, c in tl.comms.items():
        views = {s: (v.op, v.enter, v.start, v.end, v.ops, v.failed, v.sizes, v.completed_at, v.gpu_start)
                 for s, v in c.colls.items()}
        comms[cid] = (c.backend, c.group_size, c.job, sorted(c.members), c.pids, c.retired, c.max_seq,
                      c.evicted_upto, c.last_entered, c.peaks, c.completed, c.resets, views)
    ranks = {k: (r.rank, r.last_event_at, r.exited_at, r.state) for k, r in tl.ranks.items()}
    return (comms, ranks, dict(tl.enter_counts), dict(tl.end_counts), dict(tl.anomalies),
            dict(tl.events_by_kind), dict(tl.gpu.status))


def random_job(rnd: random.Random):
    """Frames of a few agents: a world comm and a subgroup, ops that change, and now and then a
    duplicate, a failure, a missing rank field, a rank restart, an NCCL enter, an unknown pid, a gap."""
    world, nodes = 8, 2
    frames = []  # (agent index, events)
    t = T0_NS
    pids = {r: 100 + r for r in range(world)}
    node_of = {r: r * nodes // world for r in range(world)}
    pending = {n: [] for n in range(nodes)}

    def put(r, e):
        pending[node_of[r]].append(e)

    for r in range(world):
        put(r, ev.RankInfo(pid=pids[r], rank=r, world_size=world, local_rank=r % 4, node=f"n{node_of[r]}",
                           job="j", ts_ns=t))
        put(r, ev.CommInit(pid=pids[r], rank=r, ts_ns=t, backend="gloo", comm="j/gloo:0", group_rank=r,
                           group_size=world))
        if r % 2 == 0:
            put(r, ev.CommInit(pid=pids[r], rank=r, ts_ns=t, backend="gloo", comm="j/gloo:1", group_rank=r // 2,
                               group_size=world // 2))
    seqs = {"j/gloo:0": 0, "j/gloo:1": 0}
    for step in range(60):
        comm = "j/gloo:1" if rnd.random() < 0.3 else "j/gloo:0"
        members = [r for r in range(world) if comm == "j/gloo:0" or r % 2 == 0]
        seqs[comm] += 1
        seq = seqs[comm]
        op = rnd.choice(["allreduce", "allreduce", "broadcast", "allgather"])
        for r in members:
            if rnd.random() < 0.03:
                continue  # this rank's events of this collective are lost
            t += rnd.randrange(1, 1_000_000)
            rank = -1 if rnd.random() < 0.05 else r
            backend = "nccl" if rnd.random() < 0.03 else "gloo"
            put(r, ev.CollEnter(pid=pids[r], rank=rank, ts_ns=t, backend=backend, comm=comm, seq=seq,
                                op=op if rnd.random() > 0.03 else "barrier", tid=7,
                                count=rnd.choice([-1, 1024])))
            if rnd.random() < 0.03:
                put(r, ev.CollEnter(pid=pids[r], rank=r, ts_ns=t, backend="gloo", comm=comm, seq=seq, op=op))
            put(r, ev.WorkStart(pid=pids[r], rank=r, ts_ns=t + 10, comm=comm, seq=seq))
            ok = rnd.random() > 0.03
            put(r, ev.WorkEnd(pid=pids[r], rank=r, ts_ns=t + 20, comm=comm, seq=seq, ok=ok,
                              error="" if ok else "peer gone"))
            if rnd.random() < 0.02:
                put(r, ev.WorkEnd(pid=pids[r], rank=r, ts_ns=t + 30, comm=comm, seq=seq))
            if rnd.random() < 0.01:
                put(r, ev.WorkStart(pid=999, rank=r, ts_ns=t, comm=comm, seq=seq))  # a pid never announced
        if rnd.random() < 0.02:  # rank 3 restarts: a new pid announces itself and rebuilds the world comm
            r = 3
            pids[r] += 1000
            put(r, ev.RankInfo(pid=pids[r], rank=r, world_size=world, local_rank=3, node=f"n{node_of[r]}",
                               job="j", ts_ns=t))
            put(r, ev.CommInit(pid=pids[r], rank=r, ts_ns=t, backend="gloo", comm="j/gloo:0", group_rank=r,
                               group_size=world))
        if rnd.random() < 0.3 or step == 59:
            for n in range(nodes):
                frames.append((n, pending[n] + [ev.ClockSample(mono_ns=t, wall_ns=t + 10 ** 18, ts_ns=t)]))
                pending[n] = []
    rnd.shuffle(frames[len(frames) // 2:])  # frames of different agents arrive out of order
    return frames


def packed(frame: bytes) -> bytes:
    """The frame with every int column of its blocks packed (schema 1.8: n little-endian ints as bytes),
    4 bytes each where every value fits, else 8, as agents send them."""
    import numpy as np
    from ccld.bpf.rows import pack_column
    env = msgpack.unpackb(frame, raw=False)
    for b in env.get("blocks", ()):
        b["cols"] = {k: pack_column(np.array(v, np.int64)) if all(type(x) is int for x in v) else v
                     for k, v in b["cols"].items()}
    return msgpack.packb(env, use_bin_type=True)


def feed(frames, fast: bool, pack: bool = False) -> Timeline:
    """The frames into a timeline, one ingest each: as column blocks (fast; their int columns packed
    with `pack`), or their events materialized in the same order (Batch.events) as one map each."""
    tl = Timeline()
    batch_no = {}
    for n, evs in frames:
        batch_no[n] = batch_no.get(n, 0) + 1
        frame = ev.encode_batch(f"agent-{n}", f"n{n}", batch_no[n], evs)
        b = ev.decode_batch(packed(frame) if pack else frame)
        assert not pack or all(x.bin for x in b.blocks)  # the packed path is the one taken
        if not fast:
            b = ev.Batch(b.agent, b.node, b.batch, b.version, b.events)
        tl.ingest(b, 1.0)
    return tl


@pytest.mark.parametrize("seed", range(40))
def test_blocks_leave_the_same_timeline_as_maps(seed):
    frames = random_job(random.Random(seed))
    fast, slow = feed(frames, True), feed(frames, False)
    assert snapshot(fast) == snapshot(slow)
    assert sum(fast.events_by_kind.values()) == sum(len(evs) for _, evs in frames)


@pytest.mark.parametrize("seed", range(40))
def test_packed_columns_leave_the_same_timeline_as_lists_and_as_maps(seed):
    frames = random_job(random.Random(seed))
    assert snapshot(feed(frames, True, pack=True)) == snapshot(feed(frames, False))


def test_packed_columns_read_as_the_values_they_pack():
    evs = [coll(r, 9 + r % 2, T0_NS + r, count=2 ** 40 + r) for r in range(5)] + [end(r, 9, T0_NS + 50 + r)
                                                                                    for r in range(3)]
    frame = ev.encode_batch("a1", "n1", 1, evs)
    b = ev.decode_batch(packed(frame))
    assert sorted(b.blocks[0].bin) == ["pid", "rank", "seq", "tid", "ts_ns"]
    assert [e.to_wire() for e in b.events] == [e.to_wire() for e in ev.decode_batch(frame).events]
    assert b.blocks[0].bin is None  # unpacked for the event reader, once


@pytest.mark.parametrize("seed", range(20))
def test_frames_ingested_together_leave_the_timeline_one_at_a_time_leaves(seed):
    """The collector applies the frames it took in one wake together (Timeline.ingest_many): their rows
    in one pass. Frames in the order they were made (the shuffled tail of random_job left out: frames
    out of order may end a collective before it is entered, which one pass sees in order)."""
    rnd = random.Random(seed)
    frames = random_job(rnd)
    frames = frames[:len(frames) // 2]
    one = feed(frames, True)
    together, batch_no, group = Timeline(), {}, []
    for k, (n, evs) in enumerate(frames):
        batch_no[n] = batch_no.get(n, 0) + 1
        group.append((ev.decode_batch(ev.encode_batch(f"agent-{n}", f"n{n}", batch_no[n], evs)), 1.0))
        if rnd.random() < 0.3 or k == len(frames) - 1:
            together.ingest_many(group)
            group = []
    assert snapshot(together) == snapshot(one)


def test_a_healthy_job_reads_the_same_as_blocks_or_as_maps():
    rnd = random.Random(5)
    frames, t = [], T0_NS
    head = [ev.RankInfo(pid=100 + r, rank=r, world_size=4, local_rank=r, node="n0", job="j", ts_ns=t) for r in range(4)]
    head += [ev.CommInit(pid=100 + r, rank=r, ts_ns=t, backend="gloo", comm="j/gloo:0", group_rank=r, group_size=4)
             for r in range(4)]
    evs = list(head)
    for seq in range(1, 200):
        op = rnd.choice(["allreduce", "broadcast"])
        for r in range(4):
            evs.append(coll(r, seq, t + r, op=op))
        for r in range(4):
            evs += [start(r, seq, t + 10), end(r, seq, t + 20 + r)]
        t += 1_000_000
        if seq % 7 == 0:
            frames.append((0, [ev.ClockSample(mono_ns=t, wall_ns=t + 10 ** 18, ts_ns=t)] + evs))
            evs = []
    states = []
    for columns in (False, True):
        tl = Timeline()
        for k, (n, f) in enumerate(frames):
            tl.ingest(ev.decode_batch(ev.encode_batch("a", "n0", k + 1, f, columns=columns)), 1.0)
        states.append(snapshot(tl))
        assert tl.comms["j/gloo:0"].completed == 196 and not tl.anomalies
    assert states[0] == states[1]


# ---- column blocks on what the random jobs above never make ------------------------------------

def job_head(world=4, node="n0", comm="j/gloo:0"):
    t = T0_NS
    out = [ev.ClockSample(mono_ns=t, wall_ns=t + 10 ** 18, ts_ns=t)]
    for r in range(world):
        out.append(ev.RankInfo(pid=100 + r, rank=r, world_size=world, local_rank=r, node=node, job="j", ts_ns=t))
        out.append(ev.CommInit(pid=100 + r, rank=r, ts_ns=t, backend="gloo", comm=comm, group_rank=r,
                               group_size=world))
    return out


def both_ways(frames):
    """[fast, event by event] timelines of (agent, node, wire frame) triples."""
    out = []
    for fast in (True, False):
        tl = Timeline()
        for agent, node, f in frames:
            b = ev.decode_batch(f)
            assert b.errors == []
            if not fast:
                b = ev.Batch(b.agent, b.node, b.batch, b.version, b.events)
            tl.ingest(b, 1.0)
        out.append(tl)
    return out


def test_fields_the_fast_path_reads_once_may_be_columns():
    """Any field may be a column: op, backend, count and dtype of enters, ok and error of ends too. Read
    once per block from its shared fields they would be lost (ops "", failures taken for successes)."""
    t = T0_NS + 1000
    cols = {"seq": [1] * 4, "pid": [100, 101, 102, 103], "rank": [0, 1, 2, 3]}
    enters = {"k": "coll", "n": 4, "at": 0, "same": {"comm": "j/gloo:0", "backend": "gloo"},
              "cols": dict(cols, ts_ns=[t, t + 1, t + 2, t + 3], op=["allreduce", "broadcast"] * 2,
                           count=[1024] * 4, dtype=["float"] * 4)}
    ends = {"k": "end", "n": 4, "at": 0, "same": {"comm": "j/gloo:0"},
            "cols": dict(cols, ts_ns=[t + 10] * 4, ok=[True, False, True, True], error=["", "peer gone", "", ""])}
    # one process whose later collective has the earlier time: its newest time is still the latest seen
    odd = {"k": "start", "n": 2, "at": 0, "same": {"comm": "j/gloo:0"},
           "cols": {"seq": [1, 2], "pid": [100, 100], "rank": [0, 0], "ts_ns": [t + 5_000_000, t + 5]}}
    fast, slow = both_ways([("a", "n0", ev.encode_batch("a", "n0", 1, job_head())),
                            ("a", "n0", env((), [enters, ends, odd], agent="a", node="n0", batch=2))])
    assert snapshot(fast) == snapshot(slow)
    view = fast.comms["j/gloo:0"].colls[1]
    assert view.ops == {0: "allreduce", 1: "broadcast", 2: "allreduce", 3: "broadcast"}
    assert view.failed == {1: "peer gone"} and view.sizes[3][:2] == (1024, "float")


def test_the_fast_path_converts_with_the_clock_of_the_moment():
    """The job's collectives refine the nodes' clocks every few collectives, in the middle of a frame:
    each run of rows (and each end after one that moved the clock) converts with the correction of the
    moment it is applied, as event by event does. Two nodes, node 1's wall clock 3 ms ahead."""
    rnd = random.Random(3)
    frames, t, seq = [], T0_NS, 0
    heads = {0: [], 1: []}
    for e in job_head():
        if isinstance(e, (ev.RankInfo, ev.CommInit)):
            heads[e.pid // 2 - 50].append(e)  # ranks 0, 1 on node 0; 2, 3 on node 1
    for k in range(6):
        evs = {n: list(heads[n]) if k == 0 else [] for n in (0, 1)}
        for _ in range(30):
            seq += 1
            t += 1_000_000
            for r in range(4):
                e = dict(pid=100 + r, rank=r, comm="j/gloo:0", seq=seq)
                evs[r // 2] += [ev.CollEnter(ts_ns=t + r * 1000, backend="gloo", op="allreduce", **e),
                                ev.WorkStart(ts_ns=t + 5000, **e),
                                ev.WorkEnd(ts_ns=t + 100_000 + int(rnd.gauss(0, 50_000)), **e)]
        for n in ((0, 1) if k % 2 else (1, 0)):  # each node's frames now first, now second
            cs = ev.ClockSample(mono_ns=t, wall_ns=t + 10 ** 18 + 3_000_000 * n, ts_ns=t)
            frames.append((f"a{n}", f"n{n}", ev.encode_batch(f"a{n}", f"n{n}", k + 1, [cs] + evs[n])))
    fast, slow = both_ways(frames)
    assert fast.clock.refiner.used > 20 and fast.clock._c["a1"].corr != 0  # the refinement did move it
    assert snapshot(fast) == snapshot(slow)


def test_ranks_new_to_a_big_group_enter_as_they_would_one_at_a_time():
    """How many collectives a communicator keeps depends on its size (MAX_RANK_ENTRIES_PER_COMM). Ranks it
    knows by pid but not as members yet (their first event in it was a start) join it one by one."""
    world, t = 300, T0_NS
    head = [ev.ClockSample(mono_ns=t, wall_ns=t + 10 ** 18, ts_ns=t)]
    for r in range(world):
        head.append(ev.RankInfo(pid=1000 + r, rank=r, world_size=world, local_rank=r % 8, node="n0", job="j",
                                ts_ns=t))
        if r < world - 2:
            head.append(ev.CommInit(pid=1000 + r, rank=r, ts_ns=t, backend="gloo", comm="c", group_rank=r,
                                    group_size=world))
    many = [ev.CollEnter(pid=1000, rank=0, ts_ns=t + s, backend="gloo", comm="c", seq=s, op="allreduce")
            for s in range(1, 3601)]
    many += [ev.WorkStart(pid=1000 + r, rank=r, ts_ns=t + 3600, comm="c", seq=3600) for r in (world - 2, world - 1)]
    late = [ev.CollEnter(pid=1000 + r, rank=r, ts_ns=t + 4000, backend="gloo", comm="c", seq=3601, op="allreduce")
            for r in (world - 2, world - 1)]
    frames = [("a", "n0", ev.encode_batch("a", "n0", k + 1, f)) for k, f in enumerate([head, many, late])]
    fast, slow = both_ways(frames)
    assert fast.comms["c"].evicted_upto == slow.comms["c"].evicted_upto > 0
    assert snapshot(fast) == snapshot(slow)


def test_a_subgroup_built_in_the_middle_of_a_frame_reads_as_it_would_from_maps():
    """World allreduce 1, then a subgroup's CommInit, then the subgroup's allreduce 1, in one frame. Its
    CommInit (a map event after the first block) is applied before the blocks' rows, so the subgroup's
    first collective is not read with its size unknown (taken as the world's, it never completes)."""
    t = T0_NS
    f = [coll(r, 1, t + 10 + r) for r in range(4)] + [end(r, 1, t + 20 + r) for r in range(4)]
    f += [ev.CommInit(pid=100 + r, rank=r, ts_ns=t + 30, backend="gloo", comm="j/gloo:1", group_rank=r // 2,
                      group_size=2) for r in (0, 2)]
    f += [coll(r, 1, t + 40 + r, comm="j/gloo:1") for r in (0, 2)] + [end(r, 1, t + 50 + r, comm="j/gloo:1")
                                                                        for r in (0, 2)]
    states = []
    for columns in (False, True):
        tl = Timeline()
        for k, evs in enumerate([job_head(comm="j/gloo:0"), f]):
            tl.ingest(ev.decode_batch(ev.encode_batch("a", "n0", k + 1, evs, columns=columns)), 1.0)
        assert tl.comms["j/gloo:1"].completed == 1 and tl.comms["j/gloo:0"].completed == 1
        states.append(snapshot(tl))
    assert states[0] == states[1]


def test_a_block_with_every_field_shared_is_one_event_and_more_rows_are_refused():
    one = {"k": "start", "n": 1, "at": 0, "same": {"comm": "c", "seq": 4, "pid": 100, "rank": 0, "ts_ns": 10},
           "cols": {}}
    batch = ev.decode_batch(env(blocks_=[one]))
    assert len(batch) == 1 and batch.events == [start(0, 4, 10, comm="c")]  # zip of no columns gave none
    assert table.expand(msgpack.unpackb(env(blocks_=[one]), raw=False)) == [start(0, 4, 10, comm="c").to_wire()]
    tl = Timeline()
    tl.ingest(batch, 1.0)
    assert tl.events_by_kind["start"] == 1
    # n identical events: no writer makes them, and ~100 bytes must not cost the collector 60,000 events
    c = IngestCounters()
    batch, err = decode_frame(env(blocks_=[dict(one, n=60_000), GOOD_BLOCK]), c)
    assert err is None and len(batch) == 2 and c.bad_events == {"bad-block": 60_000}
    assert "no column" in str(batch.errors[0])


def test_an_int_past_int64_among_packed_rows_is_dropped_and_counted_alone():
    """The rows of an ingest are read as one array per field: packed columns joined, list columns (older
    senders) converted. A list value no int64 holds drops its row (counted), not the packed rows."""
    head = [ev.RankInfo(pid=100 + r, rank=r, world_size=2, local_rank=r, node="n1", job="j", ts_ns=T0_NS)
            for r in range(2)]
    head += [ev.CommInit(pid=100 + r, rank=r, ts_ns=T0_NS, backend="gloo", comm="j/gloo:0", group_rank=r,
                         group_size=2) for r in range(2)]
    clock = ev.ClockSample(mono_ns=T0_NS, wall_ns=T0_NS + 10 ** 18, ts_ns=T0_NS)
    good = ev.encode_batch("a1", "n1", 1, head + [coll(r, 1, T0_NS + r) for r in range(2)] + [clock])
    odd = msgpack.unpackb(ev.encode_batch("a1", "n1", 2, [coll(r, 2, T0_NS + 9) for r in range(2)]), raw=False)
    odd["blocks"][0]["cols"]["seq"] = [2, 2 ** 63]  # a list column (an older sender's), one value past int64
    tl = Timeline()
    tl.ingest_many([(ev.decode_batch(packed(good)), 1.0), (ev.decode_batch(msgpack.packb(odd)), 1.0)])
    g = tl.comms["j/gloo:0"]
    assert set(g.colls[1].enter) == {0, 1} and set(g.colls[2].enter) == {0}
    assert tl.anomalies["seq-out-of-range"] == 1


def test_an_int_column_reads_its_chunks_in_order_whatever_their_widths():
    import numpy as np
    from ccld.timeline.intcol import IntColumn
    c = IntColumn()
    c.packed(np.array([1, -2], "<i4").tobytes(), 2)
    c.packed(np.array([3], "<i4").tobytes(), 1)
    c.packed(np.array([2 ** 40, 5], "<i8").tobytes(), 2)
    c.one(6)
    c.one(7)
    c.values([8, 9])
    c.same(10, 2)
    c.packed(np.array([-11], "<i1").tobytes(), 1)
    want = [1, -2, 3, 2 ** 40, 5, 6, 7, 8, 9, 10, 10, -11]
    got = c.array()
    assert got.dtype == np.int64 and got.tolist() == want and list(c) == want and len(c) == len(want)
    got[0] = 99  # writable: the apply sets ranks it learns in place
