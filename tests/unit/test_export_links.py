"""`ccld export` of the network layer: link counters per directed rank pair (MiB/s from tx_bytes deltas,
RTT, retransmissions), runqueue wait per rank, and link findings on both ranks; parsed back with
Perfetto's shipped protos (and as Chrome JSON), with exact values from the synthetic deltas, and the
exporter's link state checked to stay within its bounds however long the store."""
import io
import json

import pytest

from ccld import wire as ev
from ccld.store import StoreWriter
from ccld.export import netcounters as nc
from ccld.export.chrome import export_chrome
from ccld.export.model import TraceModel
from ccld.export.perfetto import export_perfetto
from ccld.export.protobuf import ProtoSink

from ccld_synth import T0, SynthJob, SynthLinks, rank_ip
from test_export_perfetto import parse

pytestmark = pytest.mark.unit
MIB = 1 << 20
NS = 1_000_000_000
BASE = T0 + 1          # a bucket boundary (T0 is a whole second)
TICKS = 8              # ring reports, one every 0.5 s (the agent's drain period) ...
HALF = 0.5


def tick(k):
    return BASE + HALF * k + 0.25   # ... in the middle of a bucket: each report's 0.5 s straddles two


def bucket(k):
    """Unix ns of the start of bucket k (bucket 0 starts at BASE); integers: floats of Unix ns round."""
    return int(BASE) * NS + k * NS // 2


def tick_ns(k):
    return bucket(k) + NS // 4


def link_store(path):
    """4 ranks on 2 nodes; every rank sends 1 MiB to the next one every 0.5 s (2 MiB/s); rank 1's
    link to 2 retransmits 3 times in tick 4; rank 2's RTT to 3 is 4 ms from tick 6; rank 3 waits
    0.1 s for a CPU every 0.5 s (20%). A few collectives, so the ranks have their usual tracks."""
    job = SynthJob(world=4, nodes=2)
    job.announce(T0)
    links = SynthLinks(job)
    w = StoreWriter(str(path))

    def ship(t):
        for f in job.frames(t):
            w.append(f, t)
    ship(T0 + 0.5)
    job.steps(1, 5, T0 + 0.6)
    for k in range(TICKS):
        t = tick(k)
        links.ring(t, nbytes=MIB, retrans={(1, 2): 3} if k == 4 else None, srtt={(2, 3): 4000} if k >= 6 else None)
        for r in range(4):
            job._put(r, ev.SchedStats(pid=job.pid[r], rank=r, ts_ns=job.ts(r, t), runq_ns=10**8 * k * (r == 3),
                                      runq_waits=k))
        ship(t + 0.01)
    w.close()
    return path


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return link_store(tmp_path_factory.mktemp("links") / "s")


def counters(t):
    """{track name: [(ts, value)]} of every counter track of the ranks, with its rank."""
    out = {}
    for c in t.counters:
        name = t.track_name(c["track"])
        out.setdefault(name, []).append((c["ts"], c["value"]))
    return out


def test_link_counter_tracks_per_directed_pair(store, tmp_path):
    out = tmp_path / "t.pftrace"
    stats = export_perfetto(str(store), str(out), findings=[])
    t = parse(out)
    assert t.errors == [] and stats["anomalies"] == {} and stats["bad_events"] == 0
    links = {d.name: u for u, d in t.tracks.items() if d.name.startswith("link ")}
    ring = [(r, (r + 1) % 4) for r in range(4)]   # only the senders' directions carry bytes
    assert sorted(links) == sorted(f"link {a}->{b} {what}" for a, b in ring for what in ("MiB/s", "RTT ms", "retrans"))
    for name, u in links.items():
        d = t.tracks[u]  # a counter under the sending rank's process, with its unit
        assert d.HasField("counter") and t.rank_of(u) == int(name.split()[1].split("->")[0])
        assert d.counter.unit_name == {"MiB/s": "MiB/s", "ms": "ms", "retrans": ""}[name.split()[-1]]
    got = counters(t)
    # 1 MiB per 0.5 s, half of each report in each bucket it straddles: 2 MiB/s inside, 1 at both ends
    # (unchanged values are not written again), then 0 once the traffic stops
    for a, b in ring:
        assert got[f"link {a}->{b} MiB/s"] == [(bucket(-1), 1.0), (bucket(0), 2.0), (bucket(TICKS - 1), 1.0),
                                              (bucket(TICKS), 0.0)], (a, b)
    assert got["link 1->2 retrans"] == [(bucket(-1), 0), (bucket(4), 3), (bucket(5), 0)]
    assert got["link 0->1 retrans"] == [(bucket(-1), 0)]
    assert got["link 2->3 RTT ms"] == [(bucket(0), 0.05), (bucket(6), 4.0)]
    assert got["link 3->0 RTT ms"] == [(bucket(0), 0.05)]


def test_runqueue_wait_per_rank(store, tmp_path):
    out = tmp_path / "t.pftrace"
    export_perfetto(str(store), str(out), findings=[])
    t = parse(out)
    got = counters(t)
    runq = {n: u for u, d in t.tracks.items() for n in [d.name] if n.endswith("runqueue wait %")}
    assert sorted(runq) == [f"rank {r} runqueue wait %" for r in range(4)]
    assert all(t.rank_of(u) == int(n.split()[1]) and t.tracks[u].counter.unit_name == "%" for n, u in runq.items())
    # share of wall time between two reports, written at the first: 0.1 s of 0.5 s = 20%
    assert got["rank 3 runqueue wait %"] == [(tick_ns(0), 20.0)]
    assert got["rank 0 runqueue wait %"] == [(tick_ns(0), 0.0)]


def test_rank_subset_and_window_keep_exact_link_values(store, tmp_path):
    out = tmp_path / "t.pftrace"
    export_perfetto(str(store), str(out), ranks=[2], t_from=BASE + 1.0, findings=[])
    t = parse(out)
    assert t.errors == []
    got = counters(t)  # rank 3 is not drawn, but its end of the connection still names the peer
    assert sorted(n for n in got if n.startswith(("link", "rank"))) == [
        "link 2->3 MiB/s", "link 2->3 RTT ms", "link 2->3 retrans", "rank 2 runqueue wait %"]
    assert got["link 2->3 MiB/s"] == [(bucket(2), 2.0), (bucket(TICKS - 1), 1.0), (bucket(TICKS), 0.0)]


def test_chrome_json_has_the_counters(store, tmp_path):
    out = tmp_path / "t.json"
    export_chrome(str(store), str(out), findings=[])
    evs = json.loads(out.read_text())["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in evs if e["ph"] == "M" and e["name"] == "process_name"}
    c = {}
    for e in evs:
        if e["ph"] == "C":
            c.setdefault((procs[e["pid"]].split(" (")[0], e["name"]), []).append((e["ts"], e["args"]["value"]))
    us = [round(bucket(k) / 1000) for k in (-1, 0, TICKS - 1, TICKS)]
    assert [(round(ts), v) for ts, v in c[("rank 2", "link 2->3 MiB/s")]] == list(zip(us, [1.0, 2.0, 1.0, 0.0]))
    assert [v for _, v in c[("rank 1", "link 1->2 retrans")]] == [0, 3, 0]
    assert [v for _, v in c[("rank 2", "link 2->3 RTT ms")]] == [0.05, 4.0]
    assert [v for _, v in c[("rank 3", "rank 3 runqueue wait %")]] == [20.0]


def hung_link_store(path):
    """60 healthy collectives, then seq 61 that every rank entered and none finishes, while rank 1's
    connection to rank 2 retransmits every second: the detectors name link 1-2 (a hang fault)."""
    job = SynthJob(world=4, nodes=2)
    job.announce(T0)
    links = SynthLinks(job)
    w = StoreWriter(str(path))

    def ship(t):
        for f in job.frames(t):
            w.append(f, t)
    ship(T0)
    end = job.steps(1, 60, T0 + 1, period=0.05)
    ship(end + 0.005)
    job.collective(61, end + 0.01, finish=False)
    for i in range(10):
        links.ring(end + 0.5 + i, nbytes=0 if i else 16384, retrans={(1, 2): 1})
        ship(end + 0.5 + i + 0.01)
    w.close()
    return path


def test_a_link_finding_is_on_both_ranks(tmp_path):
    store = hung_link_store(tmp_path / "s")
    out = tmp_path / "t.pftrace"
    stats = export_perfetto(str(store), str(out))  # findings replayed from the store
    t = parse(out)
    assert t.errors == [] and stats["findings"] == 1
    fs = [s for s in t.slices if t.track_name(s["track"]) == "findings"]
    assert sorted(t.rank_of(s["track"]) for s in fs) == [1, 2]
    assert {(s["name"], s["args"]["link"], s["args"]["ranks"]) for s in fs} == {("HANG fault", "1->2", "1,2")}
    assert all("link 1->2" in s["args"]["finding"] for s in fs)
    retrans = counters(t)["link 1->2 retrans"]
    assert sum(v for _, v in retrans) == 10 and max(v for _, v in retrans) == 1
    # a finding that blames one rank but names its link is drawn on both ends of the link
    f = {"kind": "slow", "class": "comm-slow", "ranks": [2], "link": [2, 3], "comm": "job/gloo:0", "seq": -1,
         "op": "allreduce", "onset_at": T0 + 2, "detected_at": T0 + 3, "evidence": {}, "job": "job"}
    export_perfetto(str(store), str(out), findings=[f])
    t = parse(out)
    fs = [s for s in t.slices if t.track_name(s["track"]) == "findings"]
    assert sorted(t.rank_of(s["track"]) for s in fs) == [2, 3] and fs[0]["args"]["link"] == "2->3"


class Recorder(ProtoSink):
    """The protobuf sink, also keeping every counter sample: {track name: [(ts, value)]}."""

    def __init__(self):
        super().__init__(io.BytesIO())
        self.samples = {}

    def counter(self, t, ts, value):
        self.samples.setdefault(t.name, []).append((ts, value))
        super().counter(t, ts, value)


def model():
    return TraceModel(Recorder())


def drawn_mib(samples):
    """MiB that MiB/s samples add up to: each value holds until the next sample."""
    return sum(v * (b - a) / NS for (a, v), (b, _) in zip(samples, samples[1:]))


def test_held_deltas_wait_for_the_far_end_and_nothing_is_lost():
    """Rank 0 reports its side for 1.5 s before rank 1 reports anything: its bytes are held, then
    drawn where they were sent."""
    job = SynthJob(world=2, nodes=2)
    job.announce(T0)
    m = model()
    for f in job.frames(T0 + 0.5):
        m.feed(f)
    side = dict(pid=job.pid[0], rank=0, saddr=rank_ip(0), sport=5000, daddr=rank_ip(1), dport=6000)
    for k in range(4):
        job._put(0, ev.LinkStats(ts_ns=job.ts(0, tick(k)), tx_bytes=MIB * (k + 1), **side))
        for f in job.frames(tick(k) + 0.01):
            m.feed(f)
    assert len(m.net.conns[("node0", 1000, rank_ip(0), 5000, rank_ip(1), 6000)].held) == 4 and not m.net.pairs
    job._put(1, ev.LinkStats(pid=job.pid[1], rank=1, ts_ns=job.ts(1, tick(3) + 0.1), saddr=rank_ip(1), sport=6000,
                             daddr=rank_ip(0), dport=5000, rx_bytes=4 * MIB))
    for f in job.frames(tick(4)):
        m.feed(f)
    m.finish(None, [])
    (pair,) = m.net.pairs.values()
    assert pair.buckets == {} and m.net.waiting == {}
    assert m.net.conns[("node0", 1000, rank_ip(0), 5000, rank_ip(1), 6000)].held == []
    got = m.sink.samples["link 0->1 MiB/s"]  # where a steady sender's would be: 1, 2 (twice, written once), 1, 0
    assert got == [(bucket(-1), 1.0), (bucket(0), 2.0), (bucket(3), 1.0), (bucket(4), 0.0)]
    assert drawn_mib(got) == pytest.approx(4.0) and m.sink.samples["link 0->1 retrans"] == [(bucket(-1), 0)]


def test_a_listeners_shared_local_end_still_names_the_peer():
    """A listening rank's accepted sockets all have the listener's address and port as their local end
    (gloo: one listener per rank). Rank 0's connection waits for that end; it is known when any of
    rank 3's accepted sockets reports, here the one to rank 1, and nothing rank 0 sent is lost."""
    job = SynthJob(world=4, nodes=2)
    job.announce(T0)
    m = model()
    for f in job.frames(T0 + 0.5):
        m.feed(f)
    listen = (rank_ip(3), 35629)

    def report(r, t, sport, peer, dport, **kw):
        job._put(r, ev.LinkStats(pid=job.pid[r], rank=r, ts_ns=job.ts(r, t), saddr=rank_ip(r), sport=sport,
                                 daddr=rank_ip(peer), dport=dport, **kw))
    report(0, tick(0), 34850, 3, listen[1], tx_bytes=MIB)           # rank 0 -> rank 3's listener: held
    for f in job.frames(tick(0) + 0.01):
        m.feed(f)
    assert not m.net.pairs and list(m.net.waiting) == [("",) + listen]
    report(3, tick(0) + 0.1, listen[1], 1, 34826, tx_bytes=100)    # rank 3's socket accepted from rank 1
    report(0, tick(1), 34850, 3, listen[1], tx_bytes=2 * MIB)
    for f in job.frames(tick(1) + 0.01):
        m.feed(f)
    m.finish(None, [])
    assert drawn_mib(m.sink.samples["link 0->3 MiB/s"]) == pytest.approx(2.0)
    assert m.sink.samples["link 0->3 MiB/s"][-1][1] == 0.0 and m.anomalies == {}
    assert list(m.net.waiting) == [("", rank_ip(1), 34826)]  # rank 3's socket to rank 1: rank 1 never reported


def test_loopback_ends_join_on_one_node_only():
    job = SynthJob(world=4, nodes=2)   # ranks 0, 1 on node0; 2, 3 on node1
    job.announce(T0)
    m = model()
    for f in job.frames(T0 + 0.5):
        m.feed(f)
    t = T0 + 1
    for r, peer, sport, dport in ((0, 1, 5000, 6000), (1, 0, 6000, 5000), (2, 1, 7000, 8000), (1, 2, 8000, 7000)):
        job._put(r, ev.LinkStats(pid=job.pid[r], rank=r, ts_ns=job.ts(r, t), saddr="127.0.0.1", sport=sport,
                                 daddr="127.0.0.1", dport=dport, tx_bytes=100))
    for f in job.frames(t + 0.01):
        m.feed(f)
    # 0 <-> 1 share node0's loopback; 2 (node1) and 1 (node0) only look alike
    assert sorted((p.proc.rank, p.dst) for p in m.net.pairs.values()) == [(0, 1), (1, 0)]


def test_link_state_is_bounded_however_long_the_store(monkeypatch):
    """New connections every tick (reconnecting ranks), some to peers that never report: the
    exporter's connections, held deltas, pairs and open buckets stay within their bounds, and hold
    as much after 4x more data."""
    monkeypatch.setattr(nc, "MAX_CONNS", 64)
    monkeypatch.setattr(nc, "MAX_PAIRS", 3)
    job = SynthJob(world=4, nodes=2)
    job.announce(T0)
    m = model()
    for f in job.frames(T0 + 0.5):
        m.feed(f)
    links = SynthLinks(job)
    sizes = []
    for k in range(400):
        t = tick(k)
        links.ring(t, nbytes=1000)
        for r in range(4):  # a fresh connection to the next rank, and one to an address nobody reports
            port = 30000 + k
            job._put(r, ev.LinkStats(pid=job.pid[r], rank=r, ts_ns=job.ts(r, t), saddr=rank_ip(r), sport=port,
                                     daddr=rank_ip((r + 1) % 4), dport=40000 + k, tx_bytes=10))
            job._put(r, ev.LinkStats(pid=job.pid[r], rank=r, ts_ns=job.ts(r, t), saddr=rank_ip(r), sport=1000 + r,
                                     daddr="192.0.2.1", dport=443, tx_bytes=10 * (k + 1)))
            q = (r + 1) % 4
            job._put(q, ev.LinkStats(pid=job.pid[q], rank=q, ts_ns=job.ts(q, t), saddr=rank_ip(q), sport=40000 + k,
                                     daddr=rank_ip(r), dport=port, rx_bytes=10))
        for f in job.frames(t + 0.01):
            m.feed(f)
        net = m.net
        assert len(net.conns) <= 64 and len(net.endpoints) <= 64 and len(net.pairs) <= 3
        assert all(len(c.held) <= nc.MAX_HELD for c in net.conns.values())
        waiting, live = [c for v in net.waiting.values() for c in v], set(map(id, net.conns.values()))
        assert len(waiting) == len(set(map(id, waiting))) and all(c.held and id(c) in live for c in waiting)
        open_buckets = sum(len(p.buckets) for p in net.pairs.values())
        assert len(net.closing.heap) == open_buckets <= 3 * (nc.CLOSE_AFTER_NS // nc.BUCKET_NS + 4)
        if k in (99, 399):
            sizes.append((len(net.conns), len(net.endpoints), len(net.pairs), open_buckets, len(m.heap)))
    assert sizes[0] == sizes[1]
    assert m.anomalies["link-conns-evicted"] > 0 and m.anomalies["link-pairs-over-bound"] > 0
    m.finish(None, [])
    assert all(not p.buckets for p in m.net.pairs.values()) and m.net.closing.heap == []
