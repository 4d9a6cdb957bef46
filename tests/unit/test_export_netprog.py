"""`ccld export` of NCCL's proxy progress (NetProgress, from ccld's profiler plugin): per rank,
communicator, peer and direction, counter tracks MiB/s, steps in flight and net wait %, parsed back
with Perfetto's shipped protos and as Chrome JSON, with exact values and bucket times from synthetic
reports sent as real frames (two nodes with their own monotonic epochs: the clock conversion is in
every timestamp); group ranks reversed against global ones, so a mix-up shows in the track names."""
import json

import pytest

from ccld import wire as ev
from ccld.export import netprog as npg
from ccld.export.chrome import export_chrome
from ccld.export.model import TraceModel
from ccld.export.perfetto import export_perfetto
from ccld.export.protobuf import ProtoSink
from ccld.store import StoreWriter

from ccld_synth import T0, SynthJob
from test_export_perfetto import parse

pytestmark = pytest.mark.unit
COMM = "job/nccl:00000000c0ffee00"
TAG = "nccl:00000000c0ffee00"   # the communicator as the track names give it
MIB = 1 << 20
NS = 1_000_000_000
MS = 1_000_000
BASE = T0 + 1                   # a bucket boundary (T0 is a whole second)
TICKS = 10                      # one report per link and channel every 100 ms, mid-bucket


def bucket(k):
    """Unix ns of the start of bucket k (bucket 0 starts at BASE)."""
    return int(BASE) * NS + k * npg.BUCKET_NS


def at(k):
    """ns after BASE of the k-th report: the middle of bucket k (integers: float Unix ns round)."""
    return k * 100 * MS + 50 * MS


class NcclJob(SynthJob):
    """4 ranks on 2 nodes with an NCCL communicator whose group ranks are the global ones reversed."""

    def __init__(self):
        super().__init__(world=4, nodes=2)
        self.group = {r: 3 - r for r in range(4)}

    def announce(self, t, group_size=None):
        super().announce(t)
        for r in range(4):
            self._put(r, ev.CommInit(pid=self.pid[r], rank=r, ts_ns=self.ts(r, t), backend="nccl", comm=COMM,
                                     group_rank=self.group[r], group_size=4, seq_source="library"))

    def progress(self, r, peer, send, k, channel=0, nbytes=0, net_ms=0, gpu_ms=0, in_flight=0, comm=COMM,
                 group_peer=None):
        """Rank r's report on its link with global rank `peer` for the interval ending at at(k)."""
        self._put(r, ev.NetProgress(pid=self.pid[r], rank=r, ts_ns=self.ts(r, BASE) + at(k), comm=comm,
                                    peer=self.group[peer] if group_peer is None else group_peer, send=send,
                                    channel=channel, nbytes=nbytes, steps=4 if nbytes else 0,
                                    net_wait_ns=net_ms * MS, gpu_wait_ns=gpu_ms * MS, in_flight=in_flight))


def progress_store(path):
    """Rank 0 sends 1 MiB per 100 ms to rank 1 on two channels (10 MiB/s), its steps waiting 3 ms on
    the network per 1 ms on the GPU, then from report 5 on 9 ms per 1 ms; one step in flight per
    channel until the last report. Rank 1 reports receiving it (one channel, no waits, 4 receives
    posted). Rank 2's send to rank 3 is stalled: 2 steps in flight, nothing moves."""
    job = NcclJob()
    job.announce(T0)
    w = StoreWriter(str(path))

    def ship(t):  # at whole half seconds: their float Unix ns are exact, so is every clock offset
        for f in job.frames(t):
            w.append(f, t)
    ship(T0 + 0.5)
    for k in range(TICKS):
        for ch in (0, 1):
            job.progress(0, 1, True, k, channel=ch, nbytes=MIB // 2, net_ms=3 if k < 5 else 9, gpu_ms=1,
                         in_flight=1 if k < TICKS - 1 else 0)
        job.progress(1, 0, False, k, nbytes=MIB, in_flight=4)
        job.progress(2, 3, True, k, in_flight=2)
        if k in (4, TICKS - 1):
            ship(BASE + 0.5 * (k + 1) / 5)
    w.close()
    return path


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return progress_store(tmp_path_factory.mktemp("netprog") / "s")


def nccl_counters(t):
    """{track name: [(ts, value)]} of the NCCL progress counter tracks."""
    out = {}
    for c in t.counters:
        name = t.track_name(c["track"])
        if name.startswith(TAG):
            out.setdefault(name, []).append((c["ts"], c["value"]))
    return out


# the spread: each report's 100 ms is half in its own bucket, half in the one before
RATE_0_1 = [(bucket(-1), 5.0), (bucket(0), 10.0), (bucket(TICKS - 1), 5.0), (bucket(TICKS), 0.0)]
# 3:1, then bucket 4 holds half of report 4 (3:1) and half of report 5 (9:1): 6:1; then 9:1
WAIT_0_1 = [(bucket(-1), 75.0), (bucket(4), 85.714), (bucket(5), 90.0)]


def test_progress_counter_tracks_per_link_and_direction(store, tmp_path):
    out = tmp_path / "t.pftrace"
    stats = export_perfetto(str(store), str(out), findings=[])
    t = parse(out)
    assert t.errors == [] and stats["anomalies"] == {} and stats["bad_events"] == 0
    tracks = {t.track_name(u): u for u, d in t.tracks.items() if t.track_name(u).startswith(TAG)}
    assert sorted(tracks) == sorted([f"{TAG} 0->1 MiB/s", f"{TAG} 0->1 steps in flight", f"{TAG} 0->1 net wait %",
                                     f"{TAG} 1<-0 MiB/s", f"{TAG} 1<-0 steps in flight",
                                     f"{TAG} 2->3 MiB/s", f"{TAG} 2->3 steps in flight"])
    for name, u in tracks.items():  # a counter under the reporting rank's process, with its unit
        d = t.tracks[u]
        assert d.HasField("counter") and t.rank_of(u) == int(name.split()[1][0])
        assert d.counter.unit_name == {"MiB/s": "MiB/s", "flight": "", "%": "%"}[name.split()[-1]]
        assert COMM in d.description
    got = nccl_counters(t)
    assert got[f"{TAG} 0->1 MiB/s"] == RATE_0_1
    assert got[f"{TAG} 0->1 steps in flight"] == [(bucket(0), 2), (bucket(TICKS - 1), 0)]  # both channels'
    assert got[f"{TAG} 0->1 net wait %"] == WAIT_0_1
    assert got[f"{TAG} 1<-0 MiB/s"] == RATE_0_1  # the receiver's view of the same bytes
    assert got[f"{TAG} 1<-0 steps in flight"] == [(bucket(0), 4)]
    assert got[f"{TAG} 2->3 MiB/s"] == [(bucket(0), 0.0)]  # the stalled link: steps in flight, no bytes
    assert got[f"{TAG} 2->3 steps in flight"] == [(bucket(0), 2)]
    assert stats["counters"] == sum(len(v) for v in got.values())  # nothing else counts in this store


def test_chrome_json_has_the_progress_counters(store, tmp_path):
    out = tmp_path / "t.json"
    export_chrome(str(store), str(out), findings=[])
    evs = json.loads(out.read_text())["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in evs if e["ph"] == "M" and e["name"] == "process_name"}
    c = {}
    for e in evs:
        if e["ph"] == "C":
            c.setdefault((procs[e["pid"]].split(" (")[0], e["name"]), []).append((e["ts"], e["args"]["value"]))

    def us(samples):
        return [(round(ts * 1000), v) for ts, v in samples]  # ns from the microseconds written
    assert sorted(n for _, n in c) == sorted([f"{TAG} 0->1 MiB/s", f"{TAG} 0->1 steps in flight",
                                              f"{TAG} 0->1 net wait %", f"{TAG} 1<-0 MiB/s",
                                              f"{TAG} 1<-0 steps in flight", f"{TAG} 2->3 MiB/s",
                                              f"{TAG} 2->3 steps in flight"])
    assert [(round(ts), v) for ts, v in c[("rank 0", f"{TAG} 0->1 MiB/s")]] == \
        [(round(ts / 1000), v) for ts, v in RATE_0_1]
    assert [v for _, v in c[("rank 0", f"{TAG} 0->1 net wait %")]] == [v for _, v in WAIT_0_1]
    assert [v for _, v in c[("rank 0", f"{TAG} 0->1 steps in flight")]] == [2, 0]
    assert [v for _, v in c[("rank 1", f"{TAG} 1<-0 MiB/s")]] == [5.0, 10.0, 5.0, 0.0]
    assert [v for _, v in c[("rank 2", f"{TAG} 2->3 steps in flight")]] == [2]
    assert us(c[("rank 2", f"{TAG} 2->3 MiB/s")])[0][0] == pytest.approx(bucket(0), abs=1)


def test_rank_subset_and_window(store, tmp_path):
    out = tmp_path / "t.pftrace"
    export_perfetto(str(store), str(out), ranks=[1], t_from=BASE + 0.5, findings=[])
    t = parse(out)
    assert t.errors == []
    got = nccl_counters(t)  # rank 0's reports are not drawn; rank 1's from the window on
    assert sorted(got) == [f"{TAG} 1<-0 MiB/s", f"{TAG} 1<-0 steps in flight"]
    assert got[f"{TAG} 1<-0 MiB/s"] == [(bucket(5), 10.0), (bucket(TICKS - 1), 5.0), (bucket(TICKS), 0.0)]
    assert got[f"{TAG} 1<-0 steps in flight"] == [(bucket(5), 4)]  # the value it holds, from the window's start


class Recorder(ProtoSink):
    """The protobuf sink, also keeping every counter sample: {track name: [(ts, value)]}."""

    def __init__(self):
        import io
        super().__init__(io.BytesIO())
        self.samples = {}

    def counter(self, t, ts, value):
        self.samples.setdefault(t.name, []).append((ts, value))
        super().counter(t, ts, value)


def started():
    job = NcclJob()
    job.announce(T0)
    m = TraceModel(Recorder())
    for f in job.frames(T0 + 0.5):
        m.feed(f)
    return job, m


def feed(job, m, t):
    for f in job.frames(t):
        m.feed(f)


def test_in_flight_is_each_channels_latest_and_idle_links_drop_to_zero():
    """In flight: the sum of each channel's latest report, not of reports. A report after an idle
    gap covers one flush interval, not the gap: its bytes are drawn just before it."""
    job, m = started()
    job.progress(0, 1, True, 0, channel=0, nbytes=MIB, in_flight=3)
    job.progress(0, 1, True, 0, channel=1, in_flight=2)
    job.progress(0, 1, True, 1, channel=0, in_flight=1)   # channel 0 now 1, channel 1 still 2
    feed(job, m, BASE + 0.5)
    job.progress(0, 1, True, 20, channel=0, nbytes=MIB, in_flight=0)
    job.progress(0, 1, True, 20, channel=1, in_flight=0)
    feed(job, m, BASE + 2.5)
    m.finish(None, [])
    s = m.sink.samples
    assert s[f"{TAG} 0->1 steps in flight"] == [(bucket(0), 5), (bucket(1), 3), (bucket(20), 0)]
    assert s[f"{TAG} 0->1 MiB/s"] == [(bucket(-1), 5.0), (bucket(1), 0.0), (bucket(19), 5.0), (bucket(21), 0.0)]
    assert f"{TAG} 0->1 net wait %" not in s and m.anomalies == {}


def test_unknown_peers_bad_reports_and_late_ones_are_counted():
    job, m = started()
    other = "job/nccl:00000000deadbeef"           # no CommInit: the peer keeps its group rank, as gG
    job.progress(0, 1, True, 0, comm=other, group_peer=2, nbytes=MIB)
    job.progress(0, 1, True, 0, group_peer=3, nbytes=MIB)      # group rank 3 is rank 0 itself
    job.progress(0, 1, True, 0, group_peer=-1, nbytes=MIB)
    job.progress(0, 1, True, 0, channel=npg.MAX_CHANNELS, nbytes=MIB)
    job.progress(0, 1, True, 0, nbytes=MIB)
    job.progress(0, 1, True, 0, nbytes=MIB)                    # the same channel at the same time again
    feed(job, m, BASE + 0.5)
    job.progress(0, 1, True, 1, nbytes="lots")                 # malformed: counted as a bad event
    job.progress(2, 3, True, 0, nbytes=MIB)
    job.progress(2, 3, True, 40, nbytes=MIB)
    job.progress(2, 3, True, 70, nbytes=MIB)   # recorded time 7.05 s: buckets up to 49 are written
    feed(job, m, BASE + 7.5)
    job.progress(2, 3, True, 30, channel=1, nbytes=MIB)        # buckets 29 and 30 were closed: to 42
    feed(job, m, BASE + 8.0)
    m.finish(None, [])
    s = m.sink.samples
    assert s["nccl:00000000deadbeef 0->g2 MiB/s"] == [(bucket(-1), 5.0), (bucket(1), 0.0)]
    assert s[f"{TAG} 0->1 MiB/s"] == [(bucket(-1), 5.0), (bucket(1), 0.0)]
    assert dict(m.anomalies) == {"nccl-progress-bad-peer": 2, "nccl-progress-bad-channel": 1,
                                 "nccl-progress-out-of-order": 1, "nccl-progress-late": 1}
    assert m.stats["bad_events"] == 1
    # a report after an idle gap covers one interval, not the gap; the late one lands whole in 42
    assert s[f"{TAG} 2->3 MiB/s"] == [(bucket(-1), 5.0), (bucket(1), 0.0), (bucket(39), 5.0), (bucket(41), 0.0),
                                     (bucket(42), 10.0), (bucket(43), 0.0), (bucket(69), 5.0), (bucket(71), 0.0)]


def test_progress_state_is_bounded_however_long_the_store(monkeypatch):
    """Every rank reports both directions with every other rank on 2 channels, for 40 s: the links
    kept, their open buckets and the due heap stay within bounds, and hold as much after 4x more."""
    monkeypatch.setattr(npg, "MAX_LINKS", 5)
    job, m = started()
    sizes = []
    for k in range(400):
        for r in range(4):
            for peer in range(4):
                for ch in (0, 1):
                    if peer != r:
                        job.progress(r, peer, k % 2 == 0, k, channel=ch, nbytes=1000, net_ms=1, in_flight=k % 3)
        if k % 5 == 4:
            feed(job, m, BASE + (k + 1) / 10)  # (k + 1) / 10 s: a multiple of 0.5 s
        nc = m.nccl
        open_buckets = sum(len(link.buckets) for link in nc.links.values())
        assert len(nc.links) <= 5 and all(len(link.channels) <= 2 for link in nc.links.values())
        assert len(nc.closing.heap) == open_buckets <= 5 * (npg.CLOSE_AFTER_NS // npg.BUCKET_NS + 4)
        if k in (99, 399):
            sizes.append((len(nc.links), open_buckets, len(m.heap)))
    assert sizes[0] == sizes[1]
    assert m.anomalies["nccl-progress-links-over-bound"] > 0
    m.finish(None, [])
    assert all(not link.buckets for link in m.nccl.links.values()) and m.nccl.closing.heap == []
