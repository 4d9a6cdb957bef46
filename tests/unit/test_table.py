"""Tables (schema 1.9, ccld/wire/table.py): the agent's frame encoder makes one table a frame; it reads
back as exactly the events it was made from; the timeline leaves the same state as from maps and from
1.8's blocks; a table the fast path does not take is read group by group to the same result; and a
hostile table loses its own rows only, each counted by reason."""
from __future__ import annotations

import random

import msgpack
import numpy as np
import pytest

from ccld import wire as ev
from ccld.bpf import rows as R
from ccld.tracer import frames
from ccld.tracer.nodeclock import NodeClock
from ccld.wire import blocks, table
from ccld.wire.validate import Rejects
from test_blocks import T0_NS, coll, end, env, feed, random_job, snapshot, start

pytestmark = pytest.mark.unit


def agent_frame(n, batch, evs, clock=None):
    """The frame the agent's shipper would send for `evs` (frames.encode: hot kinds as one table)."""
    return frames.encode(f"agent-{n}", f"n{n}", batch, evs, clock or NodeClock())


def feed_tables(frames_, slow_groups=False):
    from ccld.timeline.timeline import Timeline
    tl = Timeline()
    batch_no = {}
    for n, evs in frames_:
        batch_no[n] = batch_no.get(n, 0) + 1
        b = ev.decode_batch(agent_frame(n, batch_no[n], evs))
        assert not b.errors and all(type(p) is table.Table for p in b.parts)  # every table takes the fast path
        if slow_groups:  # the same rows as Blocks: the reading a table the fast path refuses gets
            b = ev.Batch(b.agent, b.node, b.batch, b.version, b.plain, blocks=b.blocks)
        tl.ingest(b, 1.0)
    return tl


@pytest.mark.parametrize("seed", range(25))
def test_tables_leave_the_same_timeline_as_maps_and_as_blocks(seed):
    frames_ = random_job(random.Random(seed))
    got = snapshot(feed_tables(frames_))
    assert got == snapshot(feed(frames_, False)) == snapshot(feed(frames_, True, pack=True))
    assert got == snapshot(feed_tables(frames_, slow_groups=True))


@pytest.mark.parametrize("seed", range(10))
def test_a_table_read_group_by_group_leaves_the_same_timeline(seed, monkeypatch):
    """The reading a table the fast path refuses gets (read_table: each group through read_block, as
    Blocks) leaves the timeline the fast path leaves."""
    frames_ = random_job(random.Random(seed))
    fast = snapshot(feed_tables(frames_))
    monkeypatch.setattr(table, "_plain", lambda *a: None)
    monkeypatch.setattr(table.Table, "__init__", None)  # a Table made now would be a test bug
    from ccld.timeline.timeline import Timeline
    tl = Timeline()
    batch_no = {}
    for n, evs in frames_:
        batch_no[n] = batch_no.get(n, 0) + 1
        b = ev.decode_batch(agent_frame(n, batch_no[n], evs))
        assert not b.errors and all(type(p) is blocks.Block for p in b.parts)
        tl.ingest(b, 1.0)
    assert snapshot(tl) == fast


def test_a_list_as_a_groups_kind_is_counted_by_the_export_not_fatal(tmp_path):
    from ccld.export.perfetto import export_perfetto
    from ccld.store import StoreWriter
    tab = good_table()
    tab["groups"][1][0] = ["x"]
    w = StoreWriter(str(tmp_path / "s"))
    w.append(env([ev.ClockSample(mono_ns=1, wall_ns=10 ** 18, ts_ns=1).to_wire()], [tab]), 1.0)
    w.close()
    stats = export_perfetto(str(tmp_path / "s"), str(tmp_path / "t.pftrace"), findings=[])
    assert stats["bad_events"] == 2 and stats["events"] == 7


@pytest.mark.parametrize("seed", range(25))
def test_a_table_reads_back_as_the_events_it_was_made_from(seed):
    """Random rows of every hot kind, several communicators and sizes, values of every width, a node
    clock that shifts times: decoded, the frame holds the same events, each group's rows in seq order."""
    rnd = random.Random(seed)
    evs = []
    for _ in range(rnd.randrange(1, 120)):
        comm, seq, r = rnd.choice(["j/gloo:0", "j/gloo:1", "j/nccl:7"]), rnd.randrange(-3, 1 << 40), rnd.randrange(64)
        t = rnd.randrange(1, 1 << 62)
        kind = rnd.randrange(3)
        if kind == 0:
            evs.append(ev.CollEnter(pid=rnd.randrange(1 << 22), rank=r, ts_ns=t, backend="gloo", comm=comm, seq=seq,
                                    op=rnd.choice(["allreduce", "broadcast"]), tid=rnd.randrange(1 << 20),
                                    count=rnd.choice([-1, 7, 1 << 33]), lib_seq=rnd.choice([-1, 5])))
        elif kind == 1:
            evs.append(ev.WorkStart(pid=rnd.randrange(1 << 22), rank=r, ts_ns=t, comm=comm, seq=seq))
        else:
            ok = rnd.random() < 0.8
            evs.append(ev.WorkEnd(pid=rnd.randrange(1 << 22), rank=r, ts_ns=t, comm=comm, seq=seq, ok=ok,
                                  error="" if ok else "peer gone"))
    clock = NodeClock(rnd.randrange(-10 ** 9, 10 ** 9), rnd.choice([0, 30_000]))
    b = ev.decode_batch(agent_frame(0, 1, evs, clock))
    assert not b.errors and b.skipped == 0 and [type(p) for p in b.parts] == [table.Table]
    want = [clock.event(e) if not clock.identity else e for e in evs]
    assert sorted(map(repr, b.events)) == sorted(map(repr, want))
    for blk in b.blocks:  # kind by kind, and within a group by seq
        assert blk.cols["seq"] == sorted(blk.cols["seq"])
    kinds = [g[0] for g in b.parts[0].groups]
    assert kinds == sorted(kinds, key=("coll", "start", "end").index)


def test_the_agent_sends_one_table_whatever_the_communicators():
    evs = [coll(r, 1, T0_NS + r, comm=c) for c in ("j/gloo:0", "j/gloo:1") for r in range(3)]
    evs += [ev.ClockSample(mono_ns=1, wall_ns=2, ts_ns=1)] + [end(r, 1, T0_NS + 9, comm="j/gloo:1") for r in range(3)]
    d = msgpack.unpackb(agent_frame(0, 1, evs), raw=False)
    assert [b["k"] for b in d["blocks"]] == ["table"] and d["blocks"][0]["n"] == 9
    assert [(g[0], g[1], g[2], g[3]["comm"]) for g in d["blocks"][0]["groups"]] == [
        ("coll", 3, 0, "j/gloo:0"), ("coll", 3, 0, "j/gloo:1"), ("end", 3, 1, "j/gloo:1")]
    assert d["events"] == [{"k": "clock", "mono_ns": 1, "wall_ns": 2, "ts_ns": 1}]


# ---- hostile tables -------------------------------------------------------------------------------

def good_table():
    evs = [coll(r, 4, T0_NS + r) for r in range(2)] + [start(r, 4, T0_NS + 5) for r in range(2)] + \
          [end(r, 4, T0_NS + 9) for r in range(2)]
    return msgpack.unpackb(agent_frame(0, 1, evs), raw=False)["blocks"][0]


def read(tab, extra_events=1, minor=ev.SCHEMA_MINOR):
    b = ev.decode_batch(env([ev.ClockSample(mono_ns=1, wall_ns=2, ts_ns=1).to_wire()] * extra_events, [tab],
                            minor=minor))
    return b, sorted((blk.kind, blk.n) for blk in b.blocks)


def test_a_good_table_is_taken_whole():
    b, got = read(good_table())
    assert got == [("coll", 2), ("end", 2), ("start", 2)] and not b.errors and len(b) == 7


@pytest.mark.parametrize("name, change", [
    ("n says more", lambda t: t.update(n=7)),
    ("n not an int", lambda t: t.update(n="6")),
    ("no groups", lambda t: t.update(groups=[])),
    ("a group not a list", lambda t: t["groups"].__setitem__(0, {"k": "coll"})),
    ("a group of 0 rows", lambda t: t["groups"][0].__setitem__(1, 0)),
    ("a column a byte short", lambda t: t["cols"].__setitem__("seq", t["cols"]["seq"][:-1])),
    ("a column as a list", lambda t: t["cols"].__setitem__("seq", [4] * 6)),
    ("cols not a map", lambda t: t.update(cols=[1, 2])),
])
def test_a_table_with_a_bad_header_is_dropped_whole_and_counted(name, change):
    tab = good_table()
    change(tab)
    b, got = read(tab)
    assert got == [] and len(b.plain) == 1  # the frame's other events are kept
    said = tab["n"] if type(tab["n"]) is int else 1  # the rows it said it held, as a block's are counted
    assert b.bad_counts == {"bad-table": said}
    assert "(table)" in str(b.errors[0]) and "table:" in str(b.errors[0])


@pytest.mark.parametrize("name, change, reason", [
    ("a shared field of the wrong type", lambda g: g[3].update(comm=5), "bad-field"),
    ("a bool where an int goes", lambda g: g[3].update(count=True), "bad-field"),
    ("a required field missing", lambda g: g[3].pop("op"), "missing-field"),
    ("at past the frame's events", lambda g: g.__setitem__(2, 99), "bad-block"),
])
def test_a_bad_group_loses_its_own_rows_only(name, change, reason):
    tab = good_table()
    change(tab["groups"][0])  # the coll group
    b, got = read(tab)
    assert got == [("end", 2), ("start", 2)] and b.bad_counts == {reason: 2}
    assert "group #0" in str(b.errors[0])


def test_a_str_field_sent_as_a_column_is_named_and_an_unknown_column_ignored():
    tab = good_table()
    tab["cols"]["op"] = np.zeros(6, "<i4").tobytes()
    b, got = read(tab)
    assert got == [("end", 2), ("start", 2)] and b.bad_counts == {"bad-field": 2}
    assert "column 'op' is packed bytes" in str(b.errors[0])
    tab = good_table()
    tab["cols"]["from_the_future"] = np.zeros(6, "<i4").tobytes()
    b, got = read(tab)
    assert got == [("coll", 2), ("end", 2), ("start", 2)] and not b.errors


def test_a_group_of_a_newer_kind_is_skipped_and_counted_by_its_rows():
    tab = good_table()
    tab["groups"][1][0] = "from-the-future"
    b, got = read(tab, minor=ev.SCHEMA_MINOR + 1)
    assert got == [("coll", 2), ("end", 2)] and b.skipped == 2 and not b.errors


def test_a_reader_before_tables_sees_an_unknown_kind_of_n_rows():
    """What a 1.8 collector does with a table: read_block knows no kind "table"; its read_blocks weighs
    the block by its n, so all its rows are counted as skipped (a newer minor)."""
    tab = good_table()
    with pytest.raises(ev.FrameError) as e:
        blocks.read_block(tab, 1)
    assert e.value.reason == "unknown-kind" and tab["n"] == 6
    assert Rejects("a", 1, ev.SCHEMA_MINOR + 1).drop(e.value, "block #0", tab["n"]) == 6


def test_the_export_reads_a_tables_groups_as_blocks():
    tab = good_table()
    got = table.group_blocks(tab)
    assert [(b["k"], b["n"], b["at"]) for b in got] == [("coll", 2, 0), ("start", 2, 0), ("end", 2, 0)]
    for b in got:
        assert all(len(v) in (2 * 4, 2 * 8) for v in b["cols"].values())
    assert R.table([]) is None
    none = R.Rows(np.zeros(0, np.uint8), np.zeros(0, np.int32), {c: np.zeros(0, np.int64) for c in R.COLUMNS}, [])
    assert R.table([(0, none)]) is None  # no rows: no table (it would read as a bad one)


def test_a_block_of_a_kind_not_gathered_as_rows_is_applied_as_its_events():
    """Any kind may travel as a block (or a table's group); the timeline gathers coll/start/end as rows
    and applies the others event by event (a RankState block once raised KeyError in the gatherer)."""
    from ccld.timeline.timeline import Timeline
    tl = Timeline()
    proc = {"k": "proc", "n": 2, "at": 1, "same": {"pid": 5, "rank": 0, "ts_ns": 3}, "cols": {"state": ["R", "D"]}}
    b = ev.decode_batch(env([ev.ClockSample(mono_ns=1, wall_ns=10 ** 18, ts_ns=1).to_wire()], [proc]))
    assert not b.errors and [blk.kind for blk in b.blocks] == ["proc"]
    tl.ingest(b, 1.0)
    assert tl.events_by_kind["proc"] == 2
