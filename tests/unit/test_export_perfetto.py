"""`ccld export`: a recorded job (with a hang) as a Perfetto trace and as Chrome JSON, parsed back and
checked for structure (tracks declared before use, slices balanced and ordered per track), content
(one flow per collective across all its ranks, the finding on the culprit's track, exact times after
clock conversion) and filters (time window, rank subset)."""
import collections
import json
import os
import subprocess
import sys

import pytest

from ccld import wire as ev
from ccld.store import StoreWriter
from ccld.export.chrome import export_chrome
from ccld.export.perfetto import export_perfetto

from ccld_synth import T0, SynthJob

pb = pytest.importorskip("perfetto.protos.perfetto.trace.perfetto_trace_pb2",
                         reason="the perfetto package is a dependency of ccld (pip install perfetto)")

pytestmark = pytest.mark.unit
N_OK = 23          # healthy collectives before the hang (prime: a lost or doubled one shows)
HANG_SEQ = N_OK + 1
PERIOD = 0.1
NS = 1_000_000_000


def ns(t):
    return int(round(t * NS))


def record(path):
    """A 4-rank job on 2 nodes (different monotonic epochs): 23 allreduces, p2p, losses, then rank 2
    never enters seq 24 while the others wait 10 s. Returns {(rank, seq): (enter, end)} in Unix s."""
    job = SynthJob(world=4, nodes=2)
    job.announce(T0)
    w = StoreWriter(str(path))
    times = {}
    t = T0 + 1
    for seq in range(1, N_OK + 1):
        t0 = t + PERIOD
        for r in range(4):  # the synth job's own timing: rank r enters at t0 + spread*r/3
            times[(r, seq)] = (t0 + 0.002 * r / 3,)
        t = job.collective(seq, t0, dur=0.003)
        for r in range(4):
            times[(r, seq)] += (t,)
        if seq == 7:
            for r in (0, 1):
                job._put(r, ev.P2P(pid=job.pid[r], rank=r, ts_ns=job.ts(r, t + 0.001), backend="gloo",
                                   comm=job.comm, op="send" if r == 0 else "recv", peer=1 - r, count=4,
                                   dtype="float32"))
        if seq % 5 == 0:
            job.agents[0].pending.append(ev.LossCounters(ts_ns=job.agents[0].mono(t), counters={"ringbuf_lost": seq}))
        for f in job.frames(t + 0.01):
            w.append(f, t + 0.01)
    onset = t + PERIOD
    for r in (0, 1, 3):
        job.enter(r, HANG_SEQ, onset)
    for i in range(1, 21):
        now = onset + 0.5 * i
        job.state(2, now - 0.01, "S", "hrtimer_nanosleep", cpu_ns=5 * 10**8)
        for f in job.frames(now):
            w.append(f, now)
    w.close()
    meta = json.loads((path / "store.json").read_text())
    meta["closed_at"] = onset + 10.2  # the writer stamps the real clock; this recording lives at T0
    (path / "store.json").write_text(json.dumps(meta))
    return times, onset


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    path = tmp_path_factory.mktemp("store") / "s"
    times, onset = record(path)
    return path, times, onset


# ---- reading a Perfetto trace back ---------------------------------------------------------------

class Parsed:
    def __init__(self):
        self.tracks = {}       # uuid -> TrackDescriptor
        self.slices = []       # dicts: track, begin, end, name, args, flows, terminating
        self.instants = []
        self.counters = []
        self.clock_snapshots = []
        self.errors = []

    def root(self, uuid):
        d = self.tracks[uuid]
        while d.HasField("parent_uuid"):
            d = self.tracks[d.parent_uuid]
        return d

    def rank_of(self, uuid):
        """The rank of the process track `uuid` belongs to (its name says "rank R (...)")."""
        d = self.root(uuid)
        name = d.process.process_name if d.HasField("process") else d.name
        return int(name.split()[1]) if name.startswith("rank ") else None

    def track_name(self, uuid):
        d = self.tracks[uuid]
        return d.thread.thread_name if d.HasField("thread") else d.name


def parse(path):
    """Parse with perfetto's own protos; check what trace_processor relies on, as it goes."""
    trace = pb.Trace()
    with open(path, "rb") as f:
        trace.ParseFromString(f.read())
    out = Parsed()
    names, keys, strs = {}, {}, {}
    open_ = collections.defaultdict(list)   # track -> stack of open slices
    last_ts = {}
    cleared = False
    for i, p in enumerate(trace.packet):
        if p.sequence_flags & pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED:
            names, keys, strs, cleared = {}, {}, {}, True
        if p.HasField("interned_data"):
            if not cleared:
                out.errors.append(f"packet {i}: interned data before the state was cleared")
            for x in p.interned_data.event_names:
                names[x.iid] = x.name
            for x in p.interned_data.debug_annotation_names:
                keys[x.iid] = x.name
            for x in p.interned_data.debug_annotation_string_values:
                strs[x.iid] = x.str.decode()
        if p.HasField("clock_snapshot"):
            out.clock_snapshots.append({c.clock_id: c.timestamp for c in p.clock_snapshot.clocks})
        if p.HasField("track_descriptor"):
            d = p.track_descriptor
            if d.uuid in out.tracks:
                out.errors.append(f"packet {i}: track {d.uuid} declared twice")
            if d.HasField("parent_uuid") and d.parent_uuid not in out.tracks:
                out.errors.append(f"packet {i}: track {d.uuid} declared before its parent {d.parent_uuid}")
            out.tracks[d.uuid] = d
        if not p.HasField("track_event"):
            continue
        te = p.track_event
        u = te.track_uuid
        if u not in out.tracks:
            out.errors.append(f"packet {i}: track {u} used before it was declared")
            continue
        if not out.clock_snapshots:
            out.errors.append(f"packet {i}: a timed event before the clock snapshot")
        if p.timestamp < last_ts.get(u, 0):
            out.errors.append(f"packet {i}: track {u} goes back in time {last_ts[u]} -> {p.timestamp}")
        last_ts[u] = p.timestamp
        if te.name_iid and (p.sequence_flags & pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE) == 0:
            out.errors.append(f"packet {i}: interned name without SEQ_NEEDS_INCREMENTAL_STATE")
        name = te.name or names.get(te.name_iid)
        args = {}
        for a in te.debug_annotations:
            k = a.name or keys.get(a.name_iid)
            which = a.WhichOneof("value")
            args[k] = strs[a.string_value_iid] if which == "string_value_iid" else getattr(a, which)
        if te.type == pb.TrackEvent.TYPE_SLICE_BEGIN:
            s = dict(track=u, begin=p.timestamp, end=None, name=name, args=args,
                     flows=list(te.flow_ids), terminating=list(te.terminating_flow_ids))
            open_[u].append(s)
            out.slices.append(s)
        elif te.type == pb.TrackEvent.TYPE_SLICE_END:
            if not open_[u]:
                out.errors.append(f"packet {i}: END on track {u} with no open slice")
            else:
                open_[u].pop()["end"] = p.timestamp
        elif te.type == pb.TrackEvent.TYPE_INSTANT:
            out.instants.append(dict(track=u, ts=p.timestamp, name=name, args=args))
        elif te.type == pb.TrackEvent.TYPE_COUNTER:
            out.counters.append(dict(track=u, ts=p.timestamp, value=te.counter_value or te.double_counter_value))
    for u, stack in open_.items():
        if stack:
            out.errors.append(f"track {u}: {len(stack)} slices never ended")
    return out


def calls(t):
    """Collective slices on the ranks' `calls` tracks, keyed by (rank, seq)."""
    got = {}
    for s in t.slices:
        if t.track_name(s["track"]).startswith("calls"):
            key = (t.rank_of(s["track"]), s["args"]["seq"])
            assert key not in got, f"two slices for rank/seq {key}"
            got[key] = s
    return got


# ---- tests ----------------------------------------------------------------------------------------

def test_trace_structure_and_content(recorded, tmp_path):
    store, times, onset = recorded
    out = tmp_path / "t.pftrace"
    stats = export_perfetto(str(store), str(out))
    t = parse(out)
    assert t.errors == []
    assert stats["bytes"] == out.stat().st_size and stats["findings"] == 1
    # the clock relation is recorded: REALTIME (1) and BOOTTIME (6) are the same Unix ns
    assert t.clock_snapshots and t.clock_snapshots[0][1] == t.clock_snapshots[0][6]
    procs = sorted(d.process.process_name for d in t.tracks.values() if d.HasField("process"))
    assert procs == [f"rank {r} (node{r // 2}, pid {1000 + r})" for r in range(4)]

    c = calls(t)
    assert sorted(c) == sorted([(r, s) for r in range(4) for s in range(1, N_OK + 1)] +
                               [(r, HANG_SEQ) for r in (0, 1, 3)])
    for (r, seq), (enter, end) in times.items():  # Unix ns after conversion from two nodes' clocks
        s = c[(r, seq)]  # (within 1 us: the synthetic job's own times are floats of Unix seconds)
        assert abs(s["begin"] - ns(enter)) < 1000 and abs(s["end"] - ns(end)) < 1000, (r, seq)
        assert s["name"] == "allreduce" and s["args"]["op"] == "allreduce" and s["args"]["ok"] is True
        assert s["args"]["comm"] == "job/gloo:0"
    for r in (0, 1, 3):  # the hung collective: drawn to the end of the recording, marked unfinished
        s = c[(r, HANG_SEQ)]
        assert s["args"]["unfinished"] is True and s["end"] == ns(onset + 10.2)

    # one flow per collective, through every rank that took part; the last to arrive terminates it
    ids = {}
    for seq in range(1, HANG_SEQ + 1):
        ranks = range(4) if seq <= N_OK else (0, 1, 3)
        got = [c[(r, seq)] for r in ranks]
        fids = {f for s in got for f in s["flows"] + s["terminating"]}
        assert len(fids) == 1 and all(len(s["flows"] + s["terminating"]) == 1 for s in got), seq
        ids[seq] = fids.pop()
        term = [s for s in got if s["terminating"]]
        if seq <= N_OK:
            assert term == [max(got, key=lambda s: s["begin"])]
        else:
            assert term == []  # rank 2 never came: the flow stays open
    assert len(set(ids.values())) == HANG_SEQ and stats["flows"] == HANG_SEQ

    # the worker thread's slices (WorkStart -> WorkEnd) and one track per communicator
    work = [s for s in t.slices if t.track_name(s["track"]) == "worker"]
    assert len(work) == 4 * N_OK
    comm = [s for s in t.slices if t.track_name(s["track"]).startswith("job/gloo:0")]
    assert len(comm) == HANG_SEQ and all(s["args"]["ranks"] == 4 for s in comm[:N_OK])

    # the finding: a slice onset..detected and an instant, on the culprit rank's track
    fs = [s for s in t.slices if t.track_name(s["track"]) == "findings"]
    assert len(fs) == 1 and t.rank_of(fs[0]["track"]) == 2
    f = fs[0]
    assert f["name"] == "HANG not-entered" and f["begin"] == ns(onset) and f["end"] - f["begin"] >= 5 * NS
    assert "rank 2" in f["args"]["finding"] and f["args"]["seq"] == HANG_SEQ
    marks = [i for i in t.instants if i["track"] == f["track"]]
    assert len(marks) == 1 and marks[0]["ts"] == f["begin"]

    # p2p instants, and the agent's loss counter (cumulative values as sent)
    p2p = [i for i in t.instants if t.track_name(i["track"]) == "p2p"]
    assert sorted((t.rank_of(i["track"]), i["name"]) for i in p2p) == [(0, "send 1"), (1, "recv 0")]
    loss = [x["value"] for x in t.counters if t.track_name(x["track"]) == "agent-0 ringbuf_lost"]
    assert loss == [5, 10, 15, 20]


def test_time_window_and_rank_filter(recorded, tmp_path):
    store, times, onset = recorded
    lo, hi = times[(0, 5)][0], times[(3, 9)][1]
    out = tmp_path / "w.pftrace"
    stats = export_perfetto(str(store), str(out), t_from=lo, t_to=hi, ranks=[0, 2], findings=[])
    t = parse(out)
    assert t.errors == [] and stats["findings"] == 0
    procs = sorted(d.process.process_name for d in t.tracks.values() if d.HasField("process"))
    assert procs == ["rank 0 (node0, pid 1000)", "rank 2 (node1, pid 1002)"]
    c = calls(t)
    assert sorted(c) == [(r, s) for r in (0, 2) for s in range(5, 10)]
    for s in t.slices:
        assert s["end"] >= ns(lo) and s["begin"] <= ns(hi)
    for x in t.instants + t.counters:
        assert ns(lo) <= x["ts"] <= ns(hi)
    for seq in range(5, 10):  # flows join the selected ranks only, and still end on the last of them
        a, b = c[(0, seq)], c[(2, seq)]
        assert a["flows"] == b["terminating"] and len(a["flows"]) == 1 and not a["terminating"]


def test_chrome_json_has_the_same_content(recorded, tmp_path):
    store, times, onset = recorded
    out = tmp_path / "t.json"
    stats = export_chrome(str(store), str(out))
    doc = json.loads(out.read_text())
    assert doc["displayTimeUnit"] == "ns" and "Unix ns" in doc["otherData"]["timebase"]
    evs = doc["traceEvents"]
    assert {e["ph"] for e in evs} <= {"M", "X", "i", "C", "s", "t", "f"}  # complete slices: balanced
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in evs if e["ph"] == "M" and e["name"] == "thread_name"}
    procs = {e["pid"]: e["args"]["name"] for e in evs if e["ph"] == "M" and e["name"] == "process_name"}
    last = {}
    for e in evs:
        if e["ph"] in ("X", "i", "s", "t", "f"):
            key = (e["pid"], e["tid"])
            assert key in threads, "an event on a thread that was never named"
            assert e["ts"] >= last.get(key, 0), f"thread {key} goes back in time"
            last[key] = e["ts"]
        if e["ph"] == "X":
            assert e["dur"] >= 0
    coll = [e for e in evs if e["ph"] == "X" and threads[(e["pid"], e["tid"])].startswith("calls")]
    assert len(coll) == 4 * N_OK + 3
    by_seq = collections.defaultdict(list)
    for e in coll:
        by_seq[e["args"]["seq"]].append(e)
    x = by_seq[N_OK][0]
    assert abs(x["ts"] * 1000 - ns(times[(0, N_OK)][0])) < 2000  # us, Unix time
    flows = collections.defaultdict(list)
    for e in evs:
        if e["ph"] in ("s", "t", "f"):
            flows[e["id"]].append(e["ph"])
    assert len(flows) == HANG_SEQ == stats["flows"]
    assert sum(v == ["s", "t", "t", "f"] for v in flows.values()) == N_OK  # s first, f on the last rank
    assert sum(v == ["s", "t", "t"] for v in flows.values()) == 1           # the hung one: no f
    finding = [e for e in evs if e["ph"] == "X" and threads[(e["pid"], e["tid"])] == "findings"]
    assert len(finding) == 1 and procs[finding[0]["pid"]].startswith("rank 2 ")
    assert any(e["ph"] == "C" for e in evs)


def test_export_cli(recorded, tmp_path):
    store, _, _ = recorded
    for name, fmt in (("t.pftrace", []), ("t.json", ["--format", "json"])):
        out = tmp_path / name
        r = subprocess.run([sys.executable, "-m", "ccld.cli", "export", str(store), "--perfetto", str(out)] + fmt,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        line = r.stdout.strip().splitlines()[-1]
        assert line.startswith(f"ccld export: {out}") and "tracks" in line and "1 finding" in line, line
        assert out.stat().st_size > 0 and not os.path.exists(str(out) + ".tmp")
    r = subprocess.run([sys.executable, "-m", "ccld.cli", "export", str(tmp_path / "nope"), "--perfetto",
                        str(tmp_path / "x.pftrace")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "nope" in r.stderr


def test_collector_writes_a_trace_at_stop(tmp_path):
    """`ccld collector --perfetto FILE` without --store: a temporary store, exported, then removed."""
    import signal
    import socket
    import zmq
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "live.pftrace"
    env = dict(os.environ, TMPDIR=str(tmp_path))
    p = subprocess.Popen([sys.executable, "-m", "ccld.cli", "collector", "--listen", f"tcp://127.0.0.1:{port}",
                          "--perfetto", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    try:
        assert "listening on" in p.stdout.readline()
        job = SynthJob(world=4, nodes=2)
        job.announce(T0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        t = job.steps(1, 5, T0 + 1)
        for f in job.frames(t + 0.01):
            sock.send(f)
        sock.close()
        import time
        time.sleep(1.0)  # let the collector take the frames in before it is stopped
        p.send_signal(signal.SIGINT)
        stdout, stderr = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
        ctx.term()
    assert p.returncode == 0, stderr
    assert f"ccld export: {out}" in stdout and "0 findings" in stdout, stdout
    t = parse(out)
    assert t.errors == [] and sorted(calls(t)) == [(r, s) for r in range(4) for s in range(1, 6)]
    assert not [n for n in os.listdir(tmp_path) if n.startswith("ccld-store-")]  # the temporary store is gone


def test_run_writes_a_trace_at_exit(tmp_path):
    out = tmp_path / "run.pftrace"
    r = subprocess.run([sys.executable, "-m", "ccld.cli", "run", "--no-bpf", "--perfetto", str(out), "--",
                        sys.executable, "-c", "pass"], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert r.returncode == 0, r.stderr
    assert f"ccld export: {out}" in r.stdout and parse(out).errors == []
    assert not [n for n in os.listdir(tmp_path) if n.startswith("ccld-run-store-")]


def test_hostile_events_are_counted_not_fatal(tmp_path):
    """Bad values where the schema wants ints and strings, unknown kinds, frames that are not frames:
    each is counted, the rest of the store is exported, and the trace still parses."""
    import msgpack
    job = SynthJob(world=2, nodes=1)
    job.announce(T0)
    t = job.steps(1, 3, T0 + 1)
    good = job.frames(t + 0.01)
    a = job.agents[0]
    base = dict(pid=1000, rank=0, backend="gloo", comm=job.comm, op="allreduce")
    bad = [{"k": "coll", **base, "ts_ns": "soon", "seq": 9},
           {"k": "coll", **base, "ts_ns": a.mono(t + 0.1), "seq": [9]},
           {"k": "coll", **base, "ts_ns": 2 ** 64 - 1, "seq": 10},
           {"k": "end", "pid": 1000, "rank": 0, "ts_ns": 2 ** 64 - 1, "comm": job.comm, "seq": 10},
           {"k": "coll", **dict(base, op=7, comm={"x": 1}), "ts_ns": a.mono(t + 0.2), "seq": 11},
           {"k": "end", "pid": 1000, "rank": 0, "ts_ns": a.mono(t + 0.3), "comm": {"x": 1}, "seq": 11},
           {"k": "loss", "ts_ns": a.mono(t), "counters": {"x": "many", 3: 4}},
           {"k": "link", "pid": 1000, "rank": 0, "ts_ns": a.mono(t), "saddr": ["x"], "sport": 1, "daddr": "y",
            "dport": 2, "tx_bytes": 5},
           {"k": "link", "pid": 1000, "rank": 0, "ts_ns": a.mono(t), "saddr": "x", "sport": 1, "daddr": "y",
            "dport": 2, "tx_bytes": "lots"},
           {"k": "sched", "pid": 1000, "rank": 0, "ts_ns": a.mono(t), "runq_ns": None},
           {"k": "coll"}, {"k": None}, {"k": "from-the-future", "x": 1}, [1, 2], "str", None,
           a.clock(t + 0.4).to_wire()]
    frame = msgpack.packb({"v": [1, 0], "agent": a.agent, "node": a.node, "batch": 99, "events": bad})
    w = StoreWriter(str(tmp_path / "s"))
    for f in good:
        w.append(f, t + 0.01)
    w.append(frame, t + 0.5)
    w.append(b"\xc1 not msgpack", t + 0.6)
    w.append(msgpack.packb({"v": [9, 0], "agent": "a", "node": "n", "batch": 1, "events": []}), t + 0.7)
    w.close()
    for export, name in ((export_perfetto, "t.pftrace"), (export_chrome, "t.json")):
        out = tmp_path / name
        stats = export(str(tmp_path / "s"), str(out), findings=[])
        assert stats["frames_rejected"] == {"not-msgpack": 1, "version": 1}
        assert stats["bad_events"] >= 11 and stats["skipped_events"] == 1
        if name.endswith(".json"):
            json.loads(out.read_text())
        else:
            t_ = parse(out)
            assert t_.errors == [] and sorted(calls(t_)) == [(r, s) for r in range(2) for s in (1, 2, 3)]


def _as_maps(frame):
    """The same frame with its column blocks (schema 1.4) written back as one map per event, each
    block's rows where its `at` puts them: what an agent of schema 1.3 sends."""
    import msgpack
    env = msgpack.unpackb(frame, raw=False)
    blocks = env.pop("blocks", None)
    if not blocks:
        return frame
    plain, out, i = env["events"], [], 0
    for b in sorted(blocks, key=lambda b: b.get("at", 0)):
        out += plain[i:b.get("at", 0)]
        i = max(i, b.get("at", 0))
        names = list(b["cols"])
        for values in zip(*(b["cols"][c] for c in names)):
            out.append({"k": b["k"], **b.get("same", {}), **dict(zip(names, values))})
    env["events"] = out + plain[i:]
    env["v"] = [1, 3]
    return msgpack.packb(env, use_bin_type=True)


_ROW_FIELDS = {"coll": ("seq", "pid", "rank", "ts_ns", "tid"), "start": ("seq", "pid", "rank", "ts_ns"),
               "end": ("seq", "pid", "rank", "ts_ns")}


def _as_blocks(frame):
    """A frame of maps with its coll/start/end events as column blocks (schema 1.4's shape: one block
    per kind and shared fields, `at` = map events before its first row)."""
    import msgpack
    env = msgpack.unpackb(frame, raw=False)
    plain, blocks = [], {}
    for e in env["events"]:
        rowf = _ROW_FIELDS.get(e["k"])
        if rowf is None:
            plain.append(e)
            continue
        same = tuple((k, v) for k, v in e.items() if k not in rowf and k != "k")
        b = blocks.get((e["k"], same))
        if b is None:
            b = blocks[(e["k"], same)] = {"k": e["k"], "n": 0, "at": len(plain), "same": dict(same),
                                          "cols": {f: [] for f in rowf}}
        b["n"] += 1
        for f in rowf:
            b["cols"][f].append(e.get(f, 0))
    env.update(v=[1, 4], events=plain, blocks=list(blocks.values()))
    return msgpack.packb(env, use_bin_type=True)


def _packed(frame):
    """The frame with its blocks' int columns packed (schema 1.8), as agents send them."""
    import msgpack
    import numpy as np
    from ccld.bpf.rows import pack_column
    env = msgpack.unpackb(frame, raw=False)
    for b in env.get("blocks", ()):
        b["cols"] = {k: pack_column(np.array(v, np.int64)) for k, v in b["cols"].items()}
    env["v"] = [1, 8]
    return msgpack.packb(env, use_bin_type=True)


def _as_table(frame):
    """The frame with its packed blocks as one table (schema 1.9, ccld/wire/table.py): groups by kind,
    columns spanning every row (zeros where a kind has no such field: filler its reader ignores)."""
    import msgpack
    import numpy as np
    from ccld.bpf.rows import pack_column
    from ccld.wire.blocks import unpack
    env = msgpack.unpackb(frame, raw=False)
    blocks = sorted(env.pop("blocks", ()), key=lambda b: ("coll", "start", "end").index(b["k"]))
    if blocks:
        names = sorted({c for b in blocks for c in b["cols"]})
        cols = {c: pack_column(np.array([v for b in blocks for v in (
            unpack(b["cols"][c], b["n"]) if c in b["cols"] else [0] * b["n"])], np.int64)) for c in names}
        env["blocks"] = [{"k": "table", "n": sum(b["n"] for b in blocks), "cols": cols,
                          "groups": [[b["k"], b["n"], b["at"], b["same"]] for b in blocks]}]
    env["v"] = [1, 9]
    return msgpack.packb(env, use_bin_type=True)


def _content(t):
    """A trace's slices, instants and counters by (rank, track, name, times, args), flows as the
    (rank, track, seq) they join: comparable across traces whose uuids and flow ids differ."""
    def rank(x):
        r = t.rank_of(x["track"])
        return -1 if r is None else r
    flows = collections.defaultdict(list)
    for s in t.slices:
        for f in s["flows"] + s["terminating"]:
            flows[f].append((rank(s), t.track_name(s["track"]), s["args"].get("seq")))
    return (sorted((rank(s), t.track_name(s["track"]), s["name"], s["begin"], s["end"],
                    sorted(s["args"].items())) for s in t.slices),
            sorted((rank(i), t.track_name(i["track"]), i["name"], i["ts"]) for i in t.instants),
            sorted((t.track_name(c["track"]), c["ts"], c["value"]) for c in t.counters),
            sorted(sorted(v) for v in flows.values()))


def test_frames_as_maps_and_as_column_blocks_give_the_same_trace(recorded, tmp_path):
    """Stores from before schema 1.4 (every event a map), after (coll/start/end as column blocks) and
    after 1.8 (their columns packed) and 1.9 (one table a frame) are exported alike: the trace's content is the same, only the
    model's input path differs."""
    from ccld.store import read_store
    store, _, _ = recorded
    got = {}
    for shape, convert in (("maps", _as_maps), ("blocks", lambda f: _as_blocks(_as_maps(f))),
                           ("packed", lambda f: _packed(_as_blocks(_as_maps(f)))),
                           ("table", lambda f: _as_table(_packed(_as_blocks(_as_maps(f)))))):
        path = tmp_path / shape
        w = StoreWriter(str(path))
        for recv, frame in read_store(str(store)):
            w.append(convert(frame), recv)
        w.close()
        (path / "store.json").write_text((store / "store.json").read_text())
        out = tmp_path / f"{shape}.pftrace"
        stats = export_perfetto(str(path), str(out), findings=[])
        t = parse(out)
        assert t.errors == [] and stats["bad_events"] == 0 and stats["anomalies"] == {}
        got[shape] = _content(t)
    assert len(got["maps"][0]) > 4 * N_OK * 2 and got["maps"] == got["blocks"] == got["packed"] == got["table"]


def _blocks_job():
    """A 2-rank job's first 3 allreduces as column-block frames (good), with what a test needs to add
    blocks of its own: (job, its agent, the time after them, good frames, two ranks' ts_ns, a coll
    block's fields but its columns)."""
    job = SynthJob(world=2, nodes=1)
    job.announce(T0)
    t = job.steps(1, 3, T0 + 1)
    a = job.agents[0]
    good = [_as_blocks(_as_maps(f)) for f in job.frames(t + 0.01)]
    ts = [a.mono(t + 0.1), a.mono(t + 0.1)]
    base = {"k": "coll", "n": 2, "at": 0, "same": {"backend": "gloo", "comm": job.comm, "op": "allreduce"}}
    return job, a, t, good, ts, base


def _write_blocks(path, a, t, good, bad, after=None):
    """A store of the good frames, then one frame of agent a's holding the `bad` blocks (and a clock
    sample), then the frame `after` when given."""
    import msgpack
    w = StoreWriter(str(path))
    for f in good:
        w.append(f, t + 0.01)
    w.append(msgpack.packb({"v": [1, 4], "agent": a.agent, "node": a.node, "batch": 99,
                            "events": [a.clock(t + 0.2).to_wire()], "blocks": bad}), t + 0.5)
    if after is not None:
        w.append(after, t + 0.6)
    w.close()


def test_hostile_column_blocks_are_counted_not_fatal(tmp_path):
    """Blocks with wrong types, lengths or shapes: each is dropped and its rows counted; good blocks and
    map events of the same frame are still exported."""
    import msgpack
    job, a, t, good, ts, base = _blocks_job()
    cols = {"seq": [9, 9], "pid": [1000, 1001], "rank": [0, 1], "ts_ns": ts}
    bad = [dict(base, cols=dict(cols, ts_ns=["soon", "later"])),     # wrong type in a column
           dict(base, cols=dict(cols, seq=[9])),                      # column shorter than n
           dict(base, cols=dict(cols, ts_ns=[1.5, 2.5])),             # floats where ns are ints
           dict(base, n="2", cols=cols),                              # n not an int
           dict(base, same={"comm": job.comm}, cols=cols),            # no op: the general path counts it
           dict(base, k="from-the-future", cols=cols),                # a kind newer than this exporter
           dict(base, cols=dict(cols, seq=[10, 10], ts_ns=ts)),       # a good one: seq 10 entered
           dict(base, cols=dict(cols, seq=b"\0" * 15)),               # a packed column (1.8) a byte short
           [1, 2], "block", None]
    _write_blocks(tmp_path / "s", a, t, good, bad,
                  msgpack.packb({"v": [1, 4], "agent": a.agent, "node": a.node, "batch": 100, "events": [],
                                 "blocks": {"not": "a list"}}))
    for export, name in ((export_perfetto, "t.pftrace"), (export_chrome, "t.json")):
        out = tmp_path / name
        stats = export(str(tmp_path / "s"), str(out), findings=[])
        assert stats["frames_rejected"] == {"bad-envelope": 1}
        assert stats["bad_events"] >= 2 + 2 + 2 + 1 + 2 + 2 + 3 and stats["skipped_events"] == 2
        if name.endswith(".json"):
            json.loads(out.read_text())
        else:
            t_ = parse(out)
            c = calls(t_)
            assert t_.errors == [] and sorted(c) == [(r, s) for r in range(2) for s in (1, 2, 3, 10)]
            assert all(c[(r, 10)]["args"]["unfinished"] for r in range(2))


@pytest.mark.parametrize("accelerated", [True, False])
def test_a_bool_in_an_int_column_drops_its_block_as_the_timeline_does(tmp_path, monkeypatch, accelerated):
    """msgpack's True and False are not ints: the wire reader (and so the timeline and the findings)
    drops a block whose int column holds one, and so does the export, with or without its C loops."""
    from ccld.export import accel
    if accelerated and accel.hot is None:
        pytest.skip("the C accelerator is not built here")
    if not accelerated:
        monkeypatch.setattr(accel, "hot", None)
    job, a, t, good, ts, base = _blocks_job()
    bad = [dict(base, cols={"seq": [11, 11], "pid": [1000, 1001], "rank": [False, True], "ts_ns": ts}),
           dict(base, cols={"seq": [True, True], "pid": [1000, 1001], "rank": [0, 1], "ts_ns": ts})]
    _write_blocks(tmp_path / "s", a, t, good, bad)
    from ccld.diagnose.replay import replay
    report = replay(str(tmp_path / "s"))[3]
    assert sum(report["bad_events"].values()) == 4  # the wire reader's verdict, which the export must share
    stats = export_perfetto(str(tmp_path / "s"), str(tmp_path / "t.pftrace"), findings=[])
    assert stats["bad_events"] == 4
    assert sorted(calls(parse(tmp_path / "t.pftrace"))) == [(r, s) for r in range(2) for s in (1, 2, 3)]


def test_a_damaged_stores_odd_pids_ranks_and_world_size_are_drawn_not_fatal(tmp_path):
    """Map events whose pid is a bool or None, whose rank is past int32, and a world size of 2^64-1
    with --ranks: Perfetto's pids and orders are int32, and a world that size cannot be enumerated.
    Each such process gets a track of its own (a synthetic pid, the real one in its name)."""
    import msgpack
    job = SynthJob(world=2, nodes=1)
    job.announce(T0)
    t = job.steps(1, 2, T0 + 1)
    a = job.agents[0]
    base = dict(backend="gloo", comm=job.comm, op="allreduce")
    odd = [{"k": "rank", "pid": 7, "rank": 0, "world_size": 2 ** 64 - 1, "local_rank": 0, "node": a.node,
            "job": "job", "ts_ns": a.mono(t)},
           {"k": "coll", "pid": True, "rank": 0, "ts_ns": a.mono(t + 0.1), "seq": 50, **base},
           {"k": "end", "pid": True, "rank": 0, "ts_ns": a.mono(t + 0.2), "comm": job.comm, "seq": 50},
           {"k": "coll", "pid": None, "rank": 2 ** 40, "ts_ns": a.mono(t + 0.1), "seq": 51, **base},
           {"k": "end", "pid": None, "rank": 2 ** 40, "ts_ns": a.mono(t + 0.2), "comm": job.comm, "seq": 51},
           a.clock(t + 0.3).to_wire()]
    w = StoreWriter(str(tmp_path / "s"))
    for f in job.frames(t + 0.01):
        w.append(f, t + 0.01)
    w.append(msgpack.packb({"v": [1, 0], "agent": a.agent, "node": a.node, "batch": 99, "events": odd}), t + 0.5)
    w.close()
    for kw in ({}, {"ranks": [0]}):
        out = tmp_path / "t.pftrace"
        stats = export_perfetto(str(tmp_path / "s"), str(out), findings=[], **kw)
        tr = parse(out)
        assert tr.errors == [] and stats["bad_events"] == 0
        names = {tr.track_name(s["track"]) for s in tr.slices}
        assert "calls" in names
        if not kw:
            procs = [d.process for d in tr.tracks.values() if d.HasField("process")]
            assert {"pid True", "pid None"} <= {p.process_name.split(", ")[-1].rstrip(")") for p in procs}


def test_a_subgroup_of_unknown_size_waits_for_its_members_not_the_world():
    """CommInit.subgroup (pgnccl: a PyTorch group other than the default one, built before the attach):
    its collectives are complete when the ranks seen in it took part, as in the timeline."""
    from ccld.export.collectives import Collectives

    class Model:
        ranks = None
    c = Collectives(Model())
    for rank in (4, 5):
        c.note_rank("j", rank, 8)
        c.note_comm("j/nccl-pg:3", "nccl", -1, rank, "j", True)
        c.note_comm("j/nccl-pg:0", "nccl", -1, rank, "j", False)
    assert (c.want("j/nccl-pg:3"), c.want("j/nccl-pg:0")) == (2, 8)


def test_findings_are_found_in_the_trace_pass_reading_the_store_once(recorded, tmp_path, monkeypatch):
    """`ccld export` with findings (the default) feeds each frame to the detectors and the trace in one
    pass: the store is read once, and the trace is the one written with `ccld diagnose`'s findings."""
    from ccld.diagnose import replay as replay_mod
    import ccld.export.perfetto as perfetto_mod
    store, _, _ = recorded
    _, found, _, _ = replay_mod.replay(str(store))
    assert len(found) == 1
    given = tmp_path / "given.pftrace"
    export_perfetto(str(store), str(given), findings=found)
    reads = []
    real = perfetto_mod.read_store

    def counted(*a, **kw):
        reads.append(a[0])
        return real(*a, **kw)

    def refused(*a, **kw):
        raise AssertionError("the export read the store a second time for its findings")

    monkeypatch.setattr(perfetto_mod, "read_store", counted)
    monkeypatch.setattr(replay_mod, "read_store", refused)
    one = tmp_path / "one.pftrace"
    st = export_perfetto(str(store), str(one))
    assert reads == [str(store)]
    assert st["findings_total"] == 1 and st["findings"] == 1 and st["replay_s"] > 0
    assert one.read_bytes() == given.read_bytes()
