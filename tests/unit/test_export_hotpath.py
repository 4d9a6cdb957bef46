"""The export's C accelerator (ccld/export/_hotpath.c) writes the same trace as the Python loops it
mirrors, byte for byte, with the same counts: on healthy jobs, on odd ones (async collectives that
overlap, ranks that never end, duplicate and orphan events, failed collectives, several
communicators, numbers past 64 bits, clock steps), with a time window and a rank subset, for the
Perfetto and the Chrome JSON sinks; on random stores of every shape the row loops take or hand on; and
on error paths (what is done before an exception stays done, no exception left unset or set under a
value, no reference kept). And it is built wherever a C compiler is."""
from __future__ import annotations

import collections
import io
import os
import random
import shutil
import sys

import msgpack
import pytest

from ccld import wire as ev
from ccld.store import StoreWriter
from ccld.export import accel, export_trace

from ccld_synth import T0, FakeAgent, SynthJob

pytestmark = pytest.mark.unit

WORLD, NODES = 6, 2


def odd_job(path, seed: int, n_colls: int = 120) -> None:
    """A store of WORLD ranks on NODES nodes with every oddity the row loops branch on, each at random."""
    rnd = random.Random(seed)
    agents = [FakeAgent(f"agent-{n}", f"node{n}", boot_unix=T0 - 1000.0 * (n + 1)) for n in range(NODES)]
    node_of = {r: r % NODES for r in range(WORLD)}
    comms = ["job/nccl:0", "job/nccl:1"]
    pending = [[] for _ in range(NODES)]
    for r in range(WORLD):
        a = agents[node_of[r]]
        pending[node_of[r]] += [ev.RankInfo(pid=100 + r, rank=r, world_size=WORLD, local_rank=r // NODES,
                                            node=a.node, job="job", ts_ns=a.mono(T0))]
        pending[node_of[r]] += [ev.CommInit(pid=100 + r, rank=r, ts_ns=a.mono(T0), backend="nccl", comm=c,
                                            group_rank=r, group_size=WORLD) for c in comms]
    w = StoreWriter(str(path))
    t = T0 + 1
    seqs = {c: 0 for c in comms}
    batch = 0
    for i in range(n_colls):
        comm = comms[rnd.random() < 0.3]
        seqs[comm] += 1
        seq = seqs[comm]
        count = 1024 * (1 + (rnd.random() < 0.1))  # now and then a rank with another size
        for r in range(WORLD):
            a, n = agents[node_of[r]], node_of[r]
            b = t + rnd.random() * 0.002
            e = b + 0.001 + rnd.random() * (0.02 if rnd.random() < 0.1 else 0.001)  # some overlap the next
            if rnd.random() < 0.02:
                continue  # this rank never takes part
            mono_b = a.mono(b)
            if rnd.random() < 0.01:
                mono_b += 2 ** 63  # past int64: the C loops hand such rows to Python
            pending[n].append(ev.CollEnter(pid=100 + r, rank=r, ts_ns=mono_b, backend="nccl", comm=comm, seq=seq,
                                           op=rnd.choice(["allreduce", "allgather"]) if r == 0 else "allreduce",
                                           tid=100 + r, count=count if r == 1 else 1024, dtype="float32",
                                           nbytes=4 * (count if r == 1 else 1024)))
            if rnd.random() < 0.02:
                pending[n].append(ev.CollEnter(pid=100 + r, rank=r, ts_ns=mono_b, backend="nccl", comm=comm,
                                               seq=seq, op="allreduce"))  # a duplicate
            if rnd.random() < 0.9:
                pending[n].append(ev.WorkStart(pid=100 + r, rank=r, ts_ns=a.mono(b + rnd.random() * 0.003),
                                               comm=comm, seq=seq))
            if rnd.random() < 0.03:
                continue  # never ends: drawn to the end, unfinished
            end = a.mono(e) - (10**7 if rnd.random() < 0.02 else 0)  # a clock step: end before enter
            ok = rnd.random() > 0.03
            pending[n].append(ev.WorkEnd(pid=100 + r, rank=r, ts_ns=end, comm=comm, seq=seq, ok=ok,
                                         error="" if ok else "connection reset by peer"))
        if rnd.random() < 0.03:
            pending[0].append(ev.WorkEnd(pid=100, rank=0, ts_ns=agents[0].mono(t), comm=comm, seq=10**6))
        t += 0.004
        if i % 10 == 9 or i == n_colls - 1:
            for n in range(NODES):
                batch += 1
                evs = pending[n] + [agents[n].clock(t)]
                rnd.shuffle(evs) if rnd.random() < 0.1 else None  # rows out of order now and then
                w.append(ev.encode_batch(agents[n].agent, agents[n].node, batch, evs,
                                         columns=rnd.random() < 0.85), t)
                pending[n] = []
    w.close()


def export_both(store, tmp_path, fmt, **kw):
    """The trace's bytes and the export's counts, with the accelerator and without."""
    got = {}
    hot = accel.hot
    try:
        for name, h in (("c", hot), ("python", None)):
            accel.hot = h
            out = tmp_path / f"{name}.{fmt}"
            stats = export_trace(str(store), str(out), fmt, findings=[], **kw)
            for k in ("seconds", "events_per_s", "write_s", "replay_s", "out"):
                stats.pop(k, None)
            got[name] = (out.read_bytes(), stats)
    finally:
        accel.hot = hot
    return got


needs_hot = pytest.mark.skipif(accel.hot is None, reason="the C accelerator is not built here "
                               "(no C compiler at install, or CCLD_PURE_PYTHON=1)")


def test_the_accelerator_is_built_where_a_compiler_is():
    if os.environ.get("CCLD_PURE_PYTHON", "") not in ("", "0"):
        pytest.skip("CCLD_PURE_PYTHON=1: the Python loops on purpose")
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler here: the export runs in Python")
    assert accel.hot is not None, "ccld/export/_hotpath.c was not built: run `make setup` (pip install -e .)"


@needs_hot
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
@pytest.mark.parametrize("fmt", ["perfetto", "json"])
def test_c_and_python_write_the_same_trace(tmp_path, seed, fmt):
    odd_job(tmp_path / "s", seed)
    got = export_both(tmp_path / "s", tmp_path, fmt)
    (c, c_stats), (py, py_stats) = got["c"], got["python"]
    assert c_stats == py_stats
    assert c == py
    # the job's oddities were there to take: partial and failed collectives, extra lanes, dropped rows
    assert py_stats["slices"] > 1000 and py_stats["flows"] > 100
    assert py_stats["anomalies"].get("end-without-enter", 0) > 0


@needs_hot
@pytest.mark.parametrize("kw", [dict(ranks=[0, 3, 4]), dict(t_from=T0 + 1.1,
                                                              t_to=T0 + 1.3)],
                         ids=["ranks", "window"])
def test_c_and_python_agree_with_filters(tmp_path, kw):
    odd_job(tmp_path / "s", 7)
    got = export_both(tmp_path / "s", tmp_path, "perfetto", **kw)
    assert got["c"] == got["python"] and got["c"][1]["slices"] > 50


@needs_hot
def test_hostile_blocks_are_counted_alike(tmp_path):
    """Blocks whose columns hold floats, strings, bools or huge ints: dropped or handed to Python alike."""
    a = FakeAgent("agent-0", "node0", boot_unix=T0 - 1000.0)
    t = a.mono(T0 + 1)
    base = {"k": "coll", "n": 2, "at": 0, "same": {"backend": "gloo", "comm": "c", "op": "allreduce"}}
    cols = {"seq": [1, 1], "pid": [1, 2], "rank": [0, 1], "ts_ns": [t, t + 5]}
    blocks = [dict(base, cols=dict(cols, ts_ns=[t, 1.5])),
              dict(base, cols=dict(cols, seq=[True, True])),
              dict(base, cols=dict(cols, seq=[2, 2], ts_ns=[t, 2 ** 64 - 1])),
              dict(base, cols=dict(cols, seq=[3, 3], pid=[2 ** 64 - 5, 1])),
              {"k": "end", "n": 2, "at": 0, "same": {"comm": "c"},
               "cols": {"seq": [1, 3], "pid": [1, 2 ** 64 - 5], "rank": [0, 0], "ts_ns": [t + 9, t + 9]}},
              {"k": "start", "n": 2, "at": 0, "same": {"comm": "c"},
               "cols": {"seq": [1, 2], "pid": [2, 1], "rank": [1, 0], "ts_ns": [t + 2, "x"]}}]
    w = StoreWriter(str(tmp_path / "s"))
    w.append(msgpack.packb({"v": [1, 4], "agent": a.agent, "node": a.node, "batch": 1,
                            "events": [a.clock(T0 + 1).to_wire()], "blocks": blocks}), T0 + 1)
    w.close()
    got = export_both(tmp_path / "s", tmp_path, "perfetto")
    assert got["c"] == got["python"] and got["c"][1]["bad_events"] >= 2


# ---- cases the C once took differently (each failed before its fix in _hotpath.c) ------------------

def _one_node_store(path, evs):
    """One frame of agent-0 on node0 (FakeAgent booted at T0 - 1000 s): its clock sample, then `evs`:
    events (collective ones as column blocks, as agents send them) or wire maps (all sent as maps)."""
    a = FakeAgent("agent-0", "node0", boot_unix=T0 - 1000.0)
    if all(isinstance(e, ev.Event) for e in evs):
        frame = ev.encode_batch(a.agent, a.node, 1, [a.clock(T0)] + list(evs))
    else:
        wire = [a.clock(T0).to_wire()] + [e if type(e) is dict else e.to_wire() for e in evs]
        frame = msgpack.packb({"v": [1, 4], "agent": a.agent, "node": a.node, "batch": 1, "events": wire})
    w = StoreWriter(str(path))
    w.append(frame, T0 + 3)
    w.close()


@needs_hot
@pytest.mark.parametrize("kw", [dict(t_to=1e10), dict(t_from=T0, t_to=1e10)], ids=["to", "from-to"])
def test_a_window_ending_past_int64_ns_is_taken_alike(tmp_path, kw):
    """--to 1e10 (year 2286) is 10^19 ns, past int64: ranks() took t_to as an int64 and raised TypeError."""
    odd_job(tmp_path / "s", 11, n_colls=30)
    got = export_both(tmp_path / "s", tmp_path, "perfetto", **kw)
    assert got["c"] == got["python"] and got["c"][1]["slices"] > 50


@needs_hot
def test_a_communicator_of_more_than_int64_ranks_is_taken_alike(tmp_path):
    """A CommInit whose group_size is 2^64-1 (a damaged store): each collective waits for that many
    ranks; ends() took the expected count as an int64 and raised TypeError."""
    a = FakeAgent("agent-0", "node0", boot_unix=T0 - 1000.0)
    evs = [ev.CommInit(pid=1, rank=0, ts_ns=a.mono(T0), backend="nccl", comm="c", group_rank=0,
                       group_size=2 ** 64 - 1)]
    for seq in (1, 2):
        evs += [ev.CollEnter(pid=1, rank=0, ts_ns=a.mono(T0 + seq), backend="nccl", comm="c", seq=seq, op="allreduce"),
                ev.WorkEnd(pid=1, rank=0, ts_ns=a.mono(T0 + seq + 0.5), comm="c", seq=seq)]
    _one_node_store(tmp_path / "s", evs)
    got = export_both(tmp_path / "s", tmp_path, "perfetto")
    assert got["c"] == got["python"] and got["c"][1]["slices"] >= 4


@needs_hot
def test_a_slice_ending_past_int64_takes_the_lane_python_takes(tmp_path):
    """A rank's slice that begins (in int64) before its calls lane is free and ends past 2^63: ranks()
    zeroed the begin before choosing the lane, so it found the lane free (last_ts <= 0) where Python
    opens a second one."""
    a = FakeAgent("agent-0", "node0", boot_unix=T0 - 1000.0)
    off = a.clock(T0).wall_ns - a.clock(T0).mono_ns
    evs = [ev.CommInit(pid=1, rank=0, ts_ns=a.mono(T0), backend="nccl", comm="c", group_rank=0, group_size=1)]
    for seq, b, e in ((1, -5, -3), (2, -10, 2 ** 63 + 1)):  # Unix ns; the lane's last_ts is -3 after seq 1
        evs += [ev.CollEnter(pid=1, rank=0, ts_ns=b - off, backend="nccl", comm="c", seq=seq, op="allreduce"),
                ev.WorkEnd(pid=1, rank=0, ts_ns=e - off, comm="c", seq=seq)]
    _one_node_store(tmp_path / "s", evs)
    got = export_both(tmp_path / "s", tmp_path, "perfetto")
    assert got["c"] == got["python"] and got["python"][1]["extra_lanes"] >= 1


@needs_hot
def test_a_sink_whose_started_fails_is_counted_alike(tmp_path, monkeypatch):
    """ProtoSink.started raising (an error path): ranks() kept the failure (-1) as if it were a value and
    at the next rank returned NULL with no exception set (SystemError); each rank is a bad event instead,
    as in Python."""
    from ccld.export.protobuf import ProtoSink

    def started(self):
        raise AttributeError("started")

    monkeypatch.setattr(ProtoSink, "started", property(started, lambda self, v: None), raising=False)
    odd_job(tmp_path / "s", 12, n_colls=10)
    got = export_both(tmp_path / "s", tmp_path, "perfetto")
    assert got["c"] == got["python"] and got["c"][1]["bad_events"] > 20


@needs_hot
def test_what_a_collective_wrote_before_an_error_is_kept_alike(tmp_path):
    """A collective whose last rank (by begin) fails in the model (a process without a pid: proc_track
    raises TypeError, which the input loop counts as a bad event): what its earlier ranks wrote stays in
    the trace, and their bad events stay counted. ranks() dropped both: the fast-path packets it held
    for the sink and its count of bad events."""
    a = FakeAgent("agent-0", "node0", boot_unix=T0 - 1000.0)
    off = a.clock(T0).wall_ns - a.clock(T0).mono_ns
    t = a.mono(T0 + 1)
    evs = [ev.CommInit(pid=100, rank=0, ts_ns=t, backend="nccl", comm="warm", group_rank=0, group_size=1),
           ev.CollEnter(pid=100, rank=0, ts_ns=t, backend="nccl", comm="warm", seq=1, op="barrier"),
           ev.WorkEnd(pid=100, rank=0, ts_ns=t + 5, comm="warm", seq=1),  # the sink has started: fast path
           ev.CommInit(pid=100, rank=0, ts_ns=t, backend="nccl", comm="c", group_rank=0, group_size=3)]
    for pid, b in ((101, -10 - off), (100, t + 10), (None, t + 20)):  # 101 before the epoch: a bad event
        evs.append({"k": "coll", "pid": pid, "rank": 1, "ts_ns": b, "comm": "c", "seq": 1, "op": "allreduce"})
    for pid in (101, 100, None):
        evs.append({"k": "end", "pid": pid, "rank": 1, "ts_ns": t + 30, "comm": "c", "seq": 1})
    _one_node_store(tmp_path / "s", evs)
    got = export_both(tmp_path / "s", tmp_path, "perfetto")
    assert got["c"][1] == got["python"][1] and got["python"][1]["bad_events"] == 2
    assert got["c"][0] == got["python"][0]


@needs_hot
def test_a_run_of_one_seq_stays_one_group_across_the_handover(tmp_path):
    """An end block whose second row's time is past int64: the C loop takes the first row and hands the
    second to Python, which goes on with the same group. (This once found a seq column True then 1
    keyed as two groups; a bool in an int column now drops the block, as the wire reader does:
    test_export_perfetto's bool test.)"""
    a = FakeAgent("agent-0", "node0", boot_unix=T0 - 1000.0)
    clock = a.clock(T0)
    t = a.mono(T0 + 1)
    late = 2 ** 63 - (clock.wall_ns - clock.mono_ns) + 5  # int64 on the node, past int64 in Unix ns
    blocks = [{"k": "coll", "n": 2, "at": 3, "same": {"backend": "nccl", "comm": "c", "op": "allreduce"},
               "cols": {"seq": [1, 1], "pid": [1, 2], "rank": [0, 1], "ts_ns": [t, t]}},
              {"k": "end", "n": 2, "at": 3, "same": {"comm": "c"},  # after the clock sample and CommInits
               "cols": {"seq": [1, 1], "pid": [1, 2], "rank": [0, 1], "ts_ns": [t + 9, late]}}]
    comms = [ev.CommInit(pid=pid, rank=pid - 1, ts_ns=t, backend="nccl", comm="c", group_rank=pid - 1,
                         group_size=2).to_wire() for pid in (1, 2)]
    w = StoreWriter(str(tmp_path / "s"))
    w.append(msgpack.packb({"v": [1, 4], "agent": a.agent, "node": a.node, "batch": 1,
                            "events": [clock.to_wire()] + comms, "blocks": blocks}), T0 + 1)
    w.close()
    got = export_both(tmp_path / "s", tmp_path, "json")
    assert b'"seq": 1' in got["python"][0]
    assert got["c"] == got["python"]


def _model_with_group():
    """A model on a ProtoSink with one open collective (pid 1 of node "n", comm "c", seq 1)."""
    from ccld.export.model import TraceModel
    from ccld.export.protobuf import ProtoSink
    m = TraceModel(ProtoSink(io.BytesIO()))
    p = m.new_proc("n", 1, 0)
    m.colls.open[(p, "c", 1)] = [int(T0 * 1e9), ("allreduce", -1, "", -1), 0, None]
    return m


@needs_hot
def test_ends_takes_a_waiting_group_as_python_unpacks_it():
    """ends() over MAX_GROUPS pops the oldest group; Python unpacks popitem()'s pair as any 2-sequence.
    ends() read it as a tuple only, and on anything else returned NULL with no exception (SystemError)."""
    class Groups(collections.OrderedDict):
        def popitem(self, last=True):
            return list(super().popitem(last))

    m = _model_with_group()
    m.colls.groups = Groups()
    c = m.colls
    stop, missing, _, gk = accel.hot.ends(m, c, m.procs["n"], c.open, c.groups, c.expected, c.comm_job, "n", [1],
                                          [1], [0], [int(T0 * 1e9) + 5], "c", True, "", 0, (0, 1, 0, m.max_ts))
    assert (stop, missing, gk, len(c.groups), m.stats["slices"]) == (1, 0, None, 0, 2)


@needs_hot
def test_ranks_raises_what_a_sink_raises_at_its_flush():
    """ranks() asks len(sink.buf) to decide on a flush; an error there was left set under a returned value
    (SystemError). A ProtoSink's buf is a list: a sink whose buf is not."""
    m = _model_with_group()
    m.sink.buf = object()
    with pytest.raises(TypeError):
        accel.hot.ranks(m, m.sink, True, [], (), 1, "c", 0, 1 << 62, (ValueError,), m.colls.new_flow, None)


@needs_hot
def test_the_row_loops_keep_no_reference():
    """colls/starts/ends over rows that find their collective, duplicate it or miss it, 100 times: the
    process, communicator and seq they look up (ends and starts through one reused key tuple) end with
    the references they started with."""
    m = _model_with_group()
    c = m.colls
    p, comm, seq, other = m.procs["n"][1], "".join(("c", "omm")), 2 ** 40 + 1, 2 ** 40 + 2  # objects of their own
    c.open[(p, comm, seq)] = [int(T0 * 1e9), ("allreduce", -1, "", -1), 0, None]
    ts = int(T0 * 1e9) + 5
    before = [sys.getrefcount(x) for x in (p, comm, seq, other)]
    for _ in range(100):
        assert accel.hot.colls(m, c, m.procs["n"], c.open, "n", [seq, seq], [1, 1], [0, 0], [ts, ts], [0, 0],
                               c.open[(p, comm, seq)][1], comm, "allreduce", 0, (0, 2, 10, m.max_ts))[:2] == (2, 2)
        assert accel.hot.starts(m.procs["n"], c.open, [seq, other, seq], [1, 1, 1], [ts] * 3, comm, 0, 0, 3) == (3, 1)
        assert accel.hot.ends(m, c, m.procs["n"], c.open, c.groups, c.expected, c.comm_job, "n", [other, other],
                              [1, 1], [0, 0], [ts, ts], comm, True, "", 0, (0, 2, 10, m.max_ts))[:2] == (2, 2)
    assert [sys.getrefcount(x) for x in (p, comm, seq, other)] == before


@needs_hot
def test_a_wide_collective_grows_the_c_buffer_alike(tmp_path):
    """64 ranks of healthy collectives: one ranks() call encodes ~14 KiB, past the first 4 KiB of its
    buffer (out_room's growth, which the jobs above never reach: they spill at every group change)."""
    job = SynthJob(world=64, nodes=2)
    job.announce(T0)
    job.steps(1, 5, T0 + 0.1)
    w = StoreWriter(str(tmp_path / "s"))
    for f in job.frames(T0 + 1):
        w.append(f, T0 + 1)
    w.close()
    got = export_both(tmp_path / "s", tmp_path, "perfetto")
    assert got["c"] == got["python"] and got["c"][1]["slices"] == 5 * (2 * 64 + 1)


# ---- random stores: every shape the row loops take or hand on, C and Python alike -----------------

ROW_FIELDS = {"coll": ("seq", "pid", "rank", "ts_ns", "tid"), "start": ("seq", "pid", "rank", "ts_ns"),
              "end": ("seq", "pid", "rank", "ts_ns")}  # ccld/wire/blocks.py's columns
# ints past int64 (msgpack's range is -2^63..2^64-1), negatives, bools (an int column lets them through)
ODD_INTS = (0, -1, True, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1, -2 ** 63)
# clock offsets (Unix ns - node ns): Unix time (9-byte varints: the C encodes them); an early one (shorter
# varints: Python encodes them); one that crosses 2^63 a moment in; a negative one (wall below monotonic)
OFFSETS = (int(T0 * 1e9) - 10 ** 12, 10 ** 15, 2 ** 63 - 10 ** 12 - 10 ** 8, -10 ** 11)


def random_store(path, seed: int, huge_world: bool = True) -> None:
    """A store of 1-2 agents' frames: map events and column blocks of random shapes (values shared or
    columns, rows sorted or not, blocks placed anywhere), with duplicates, orphans, missing ranks, failures,
    overlapping and wide collectives, GPU flows, clock steps and the odd ints above in every int field.
    Not here, as the Python reference fails on them too: bool or out-of-int32 pids and ranks (the sink's
    track descriptors reject them), and world_size 2^64-1 with a rank filter (huge_world=False)."""
    rnd = random.Random(seed)
    nodes = rnd.choice((1, 2))
    offs = [rnd.choice(OFFSETS) if rnd.random() < 0.3 else OFFSETS[0] for _ in range(nodes)]
    pids = [100 + r for r in range(rnd.choice((4, 4, 4, 40)))] + rnd.sample([0, -1, 2 ** 64 - 5, 7], 2)
    rank_of = {pid: pid - 100 if 100 <= pid < 1000 else rnd.choice((-1, 50)) for pid in pids}
    node_of = {pid: rnd.randrange(nodes) for pid in pids}
    comms = [("c%d" % i) * rnd.choice((1, 1, 300)) for i in range(rnd.choice((1, 2, 3)))]
    pending = [[] for _ in range(nodes)]
    mono = 10 ** 12  # node CLOCK_MONOTONIC ns, alike on every node

    def put(pid, e):
        pending[node_of[pid]].append(e)

    for pid in pids:
        if rnd.random() < 0.8:
            put(pid, {"k": "rank", "pid": pid, "rank": rank_of[pid], "ts_ns": mono, "node": "n", "job": "job",
                      "local_rank": 0, "world_size": rnd.choice((len(pids) - 2,) * 3 + (2, 0) +
                                                                (2 ** 64 - 1,) * huge_world)})
        for c in comms:
            if rnd.random() < 0.8:
                put(pid, {"k": "comm", "pid": pid, "rank": rank_of[pid], "ts_ns": mono, "backend": "nccl",
                          "comm": c, "group_rank": 0,
                          "group_size": rnd.choice((len(pids) - 2,) * 3 + (2, 1, 0, -1, 2 ** 64 - 1))})
        if rnd.random() < 0.3:  # a rank with CUPTI capture: its collectives carry a flow to their kernel
            put(pid, {"k": "gpu_loss", "pid": pid, "rank": rank_of[pid], "ts_ns": mono, "counters": {}})
    seqs = dict.fromkeys(comms, 0)
    frames = []
    n_colls = rnd.randrange(10, 60)
    for i in range(n_colls):
        comm = rnd.choice(comms)
        seqs[comm] += 1
        seq = seqs[comm] if rnd.random() < 0.9 else rnd.choice(ODD_INTS + (seqs[comm] - 1,))
        op = rnd.choice(("allreduce", "broadcast"))
        sizes = rnd.choice(((1024, "float32", 4096), (-1, "", -1), (2 ** 64 - 1, "bf16", -2 ** 63)))
        for pid in rnd.sample(pids, rnd.randrange(1, len(pids) + 1)):
            rank = rank_of[pid] if rnd.random() < 0.95 else rnd.choice((0, -1, 9))
            b = mono + rnd.randrange(0, 3_000_000)
            e = b + rnd.randrange(0, 5_000_000) if rnd.random() < 0.9 else b - rnd.randrange(1, 10 ** 7)
            if rnd.random() < 0.05:
                b = rnd.choice(ODD_INTS + (2 ** 63 - offs[node_of[pid]] - 10,))
            if rnd.random() < 0.05:
                e = rnd.choice(ODD_INTS + (2 ** 63 - offs[node_of[pid]] + 10,))
            s = min(max(rnd.choice((b + rnd.randrange(0, 3_000_000), b - 10, e + 10, 0)), -2 ** 63), 2 ** 64 - 1)
            count, dtype, nbytes = sizes if rnd.random() < 0.9 else (2048, "float16", 4096)  # inconsistent
            tid = rnd.choice((pid if pid > 0 else 1, 0, 2 ** 64 - 1, True))
            enter = {"k": "coll", "pid": pid, "rank": rank, "ts_ns": b, "backend": "nccl", "comm": comm, "seq": seq,
                     "op": op, "tid": tid, "count": count, "dtype": dtype, "nbytes": nbytes}
            if rnd.random() < 0.97:
                put(pid, enter)
            if rnd.random() < 0.03:
                put(pid, dict(enter))  # a duplicate
            if rnd.random() < 0.05 and 0 < tid < 2 ** 62 and 0 < b < e < 2 ** 62:  # its NCCL kernel
                put(pid, {"k": "gpu_kernel", "pid": pid, "rank": rank, "ts_ns": b + 10, "end_ns": e, "device": 0,
                          "stream": 7, "corr": i, "name": "ncclKernel", "nccl": True, "op": op,
                          "launch_tid": tid, "launch_ns": b + 5})
            if rnd.random() < 0.8:
                put(pid, {"k": "start", "pid": pid, "rank": rank, "ts_ns": s, "comm": comm, "seq": seq})
            if rnd.random() < 0.9:
                ok = rnd.random() < 0.9
                put(pid, {"k": "end", "pid": pid, "rank": rank, "ts_ns": e, "comm": comm, "seq": seq,
                          "ok": ok if rnd.random() < 0.95 else 1, "error": "" if ok else rnd.choice(("boom", 0))})
        if rnd.random() < 0.05:  # an end without an enter
            put(pids[0], {"k": "end", "pid": pids[0], "rank": 0, "ts_ns": mono, "comm": comm, "seq": 10 ** 6})
        mono += rnd.choice((1_000_000, 4_000_000, 10 ** 9))
        if i % 7 == 6 or i == n_colls - 1:
            for n in range(nodes):
                if rnd.random() < 0.1:
                    offs[n] += rnd.choice((-10 ** 7, 10 ** 7))  # a clock step
                clock = {"k": "clock", "mono_ns": mono, "wall_ns": mono + offs[n], "ts_ns": mono}
                evs, pending[n] = pending[n], []
                if rnd.random() < 0.2:
                    rnd.shuffle(evs)
                frames.append((n, [clock] + evs if rnd.random() < 0.8 else evs + [clock]))  # else: held for it
    w = StoreWriter(str(path))
    for batch, (n, evs) in enumerate(frames, 1):
        plain, blocks = _random_blocks(rnd, evs) if rnd.random() < 0.85 else (evs, [])
        env = {"v": [1, 4], "agent": f"agent-{n}", "node": f"node{n}", "batch": batch, "events": plain}
        if blocks:
            env["blocks"] = blocks
        w.append(msgpack.packb(env, use_bin_type=True), T0 + batch)
    w.close()


def _random_blocks(rnd, evs):
    """A frame's events as (map events, column blocks), blocks of one kind and shared fields as
    ccld/wire/blocks.py makes them, then shuffled about: a row field shared when all rows agree, a shared
    field made a column (the general path), a ts_ns damaged (the block dropped), rows unsorted, `at` moved."""
    plain, blocks = [], {}
    for e in evs:
        rowf = ROW_FIELDS.get(e["k"])
        if rowf is None or rnd.random() < 0.1:
            plain.append(e)
            continue
        same = tuple(sorted((k, v) for k, v in e.items() if k not in rowf and k != "k"))
        got = blocks.get((e["k"], repr(same)))
        if got is None:
            got = blocks[(e["k"], repr(same))] = ({"k": e["k"], "at": len(plain), "same": dict(same)}, [])
        got[1].append(e)
    out = []
    for b, rows in blocks.values():
        if rnd.random() < 0.7:
            rows.sort(key=lambda e: e["seq"] if type(e["seq"]) is int else 0)
        b["n"] = len(rows)
        cols = {}
        for f in ROW_FIELDS[b["k"]]:
            vals = [e.get(f, 0) for e in rows]
            if len(set(map(repr, vals))) == 1 and type(vals[0]) is int and rnd.random() < 0.5:
                b["same"][f] = vals[0]
            else:
                cols[f] = vals
        if rnd.random() < 0.05 and b["same"]:
            f = rnd.choice(sorted(b["same"]))
            cols[f] = [b["same"].pop(f)] * len(rows)
        if rnd.random() < 0.03 and "ts_ns" in cols:
            cols["ts_ns"][rnd.randrange(len(rows))] = rnd.choice((1.5, "x", None))
        b["cols"] = cols
        if rnd.random() < 0.1:
            b["at"] = rnd.randrange(len(plain) + 1)
        out.append(b)
    return plain, out


@needs_hot
@pytest.mark.parametrize("first", range(0, 160, 40))
def test_random_stores_export_alike(tmp_path, monkeypatch, first):
    """40 random stores per case, each exported both ways with one of: no filter, a rank subset, a time
    window, a window ending past int64 ns; now and then JSON, and now and then tiny MAX_OPEN/MAX_GROUPS
    (eviction and early flushes of waiting groups, in the C loops too)."""
    from ccld.export import colblocks, collectives, model
    for seed in range(first, first + 40):
        rnd = random.Random(seed)
        kw = rnd.choice([{}, {}, dict(ranks=[0, 2]), dict(t_from=T0 + 2, t_to=T0 + 5), dict(t_to=1e10)])
        fmt = "json" if rnd.random() < 0.2 else "perfetto"
        small = rnd.random() < 0.3
        with monkeypatch.context() as mp:
            if small:
                for mod in (colblocks, model):
                    mp.setattr(mod, "MAX_OPEN", 6)
                for mod in (colblocks, collectives):
                    mp.setattr(mod, "MAX_GROUPS", 3)
            d = tmp_path / str(seed)
            d.mkdir()
            random_store(d / "s", seed, huge_world="ranks" not in kw)
            got = export_both(d / "s", d, fmt, **kw)
        assert got["c"][1] == got["python"][1], (seed, kw, fmt, small)
        assert got["c"][0] == got["python"][0], (seed, kw, fmt, small)


def test_a_module_built_from_another_source_is_not_used():
    """accel refuses a _hotpath module whose built-in SHA-256 is not that of the _hotpath.c beside it
    (an edit or a pull without `make setup`): a stale module would export with yesterday's rules."""
    import hashlib
    import types
    src = os.path.join(os.path.dirname(accel.__file__), "_hotpath.c")
    with open(src, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    assert not accel._stale(types.SimpleNamespace(SOURCE_SHA256=sha))
    assert accel._stale(types.SimpleNamespace(SOURCE_SHA256="0" * 64))
    assert accel._stale(types.SimpleNamespace())  # built before the hash was built in
    if accel.hot is not None:
        assert accel.hot.SOURCE_SHA256 == sha
