"""Prometheus /metrics of a real collector (ZeroMQ in, HTTP out) fed synthetic frames, parsed with
prometheus_client's own text parser; exact values."""
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ccld.timeline import comms
from ccld.collector.metrics import LATENCY_BUCKETS_S, MetricsError, MetricsServer, parse_hostport
from ccld.collector.server import Collector
from ccld_synth import SynthJob, SynthLinks
from test_collector_live import push, wait_for  # noqa: F401 (push is a fixture)

pytestmark = pytest.mark.unit


def scrape(url):
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=")
        text = r.read().decode()
    samples = {}
    families = {}
    for fam in text_string_to_metric_families(text):
        families[fam.name] = fam.type
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return families, samples


def value(samples, name, **labels):
    return samples[(name, tuple(sorted(labels.items())))]


def buckets(samples, name, **labels):
    """{le: cumulative count} of one histogram series."""
    out = {}
    for (n, lab), v in samples.items():
        d = dict(lab)
        le = d.pop("le", None)
        if n == name + "_bucket" and d == labels:
            out[le] = v
    return out


@pytest.fixture
def live(push):  # noqa: F811
    now = time.time()
    clock = {"now": now}
    col = Collector(listen="tcp://127.0.0.1:*", on_line=lambda line: None, floor_s=1.0, stacks=False)
    col.start()
    srv = MetricsServer(col, "127.0.0.1:0", clock=lambda: clock["now"]).start()
    try:
        yield col, srv, push(col.endpoint), now, clock
    finally:
        srv.stop()
        col.stop()


def test_metrics_exact_values_over_http(live):
    col, srv, sock, now, clock = live
    sock.send(b"\xc1garbage")
    job = SynthJob(t0=now - 60)
    job.announce(now - 30)
    # 7 allreduces: all start when the last rank (3, 0.3 s late) arrives and take 3 ms; then 3 broadcasts
    # with no spread that take 20 ms; then rank 2 never enters seq 11 (a hang, 1 s floor)
    job.steps(1, 7, now - 20, late={3: 0.3})
    job.steps(8, 3, now - 10, op="broadcast", spread=0.0, dur=0.02)
    links = SynthLinks(job)
    links.ring(now - 5, nbytes=1 << 20, srtt={(1, 2): 400}, retrans={(1, 2): 3})
    for r in (0, 1, 3):
        job.enter(r, 11, now - 3)
    for f in job.frames(now - 0.5):
        sock.send(f)
    assert wait_for(lambda: col.stats["frames_ok"] == 2 and col.tracker.active)
    families, s = scrape(srv.url)

    labels = dict(train_job="job", comm="job/gloo:0")
    ar = buckets(s, "ccld_collective_duration_seconds", op="allreduce", **labels)
    assert ar == {("%r" % le): (7.0 if le >= 0.005 else 0.0) for le in LATENCY_BUCKETS_S} | {"+Inf": 7.0}
    assert value(s, "ccld_collective_duration_seconds_count", op="allreduce", **labels) == 7
    assert value(s, "ccld_collective_duration_seconds_sum", op="allreduce", **labels) == pytest.approx(0.021, abs=1e-6)
    bc = buckets(s, "ccld_collective_duration_seconds", op="broadcast", **labels)
    assert bc["0.01"] == 0 and bc["0.025"] == 3 and bc["+Inf"] == 3
    spread = buckets(s, "ccld_collective_arrival_spread_seconds", op="allreduce", **labels)
    assert spread["0.25"] == 0 and spread["0.5"] == 7           # 0.302 s: rank 3 is 0.3 s late each time
    assert buckets(s, "ccld_collective_arrival_spread_seconds", op="broadcast", **labels)["0.0001"] == 3
    assert value(s, "ccld_comm_seq", **labels) == 11
    # lag over the last 20 completed (7 allreduces + 3 broadcasts): rank 3 was 0.302 s late 7 times
    assert value(s, "ccld_rank_arrival_lag_seconds", rank="3", **labels) == pytest.approx(0.302 * 7 / 10, abs=1e-6)
    assert value(s, "ccld_rank_arrival_lag_seconds", rank="0", **labels) == 0

    # links over the last 10 s: each ring pair sent 1 MiB once
    pair = dict(train_job="job")
    for src in range(4):
        dst = (src + 1) % 4
        assert value(s, "ccld_link_throughput_bytes_per_second", src=str(src), dst=str(dst), **pair) == (1 << 20) / 10
        assert value(s, "ccld_link_throughput_bytes_per_second", src=str(dst), dst=str(src), **pair) == 0
        assert value(s, "ccld_link_sent_bytes_total", src=str(src), dst=str(dst), **pair) == 1 << 20
        assert value(s, "ccld_link_rtt_seconds", src=str(src), dst=str(dst), **pair) == (4e-4 if src == 1 else 5e-5)
    assert value(s, "ccld_link_retransmits_per_second", src="1", dst="2", **pair) == 0.3
    assert value(s, "ccld_link_retransmits_total", src="1", dst="2", **pair) == 3
    assert value(s, "ccld_link_retransmits_total", src="0", dst="1", **pair) == 0

    # findings: one open not-entered, the other classes at 0 (present, so alerts can compare)
    assert value(s, "ccld_findings_open", kind="hang", **{"class": "not-entered"}) == 1
    assert value(s, "ccld_findings_open", kind="slow", **{"class": "comp-slow"}) == 0
    assert value(s, "ccld_findings_total", kind="hang", **{"class": "not-entered"}) == 1
    assert value(s, "ccld_recoveries_total", **{"class": "not-entered"}) == 0

    # ccld itself
    assert value(s, "ccld_frames_received_total") == 2
    assert value(s, "ccld_frames_rejected_total", reason="not-msgpack") == 1
    assert value(s, "ccld_events_received_total", kind="coll") == 10 * 4 + 3
    assert value(s, "ccld_events_received_total", kind="link") == 8
    assert value(s, "ccld_received_bytes_total") == col.stats["bytes_ok"]
    assert value(s, "ccld_agents") == 2
    assert value(s, "ccld_ranks", train_job="job") == 4
    assert value(s, "ccld_collector_errors_total", what="internal") == 0
    assert value(s, "ccld_build_info", version=__import__("ccld").__version__) == 1
    assert families["ccld_collective_duration_seconds"] == "histogram"
    assert families["ccld_frames_received"] == "counter"


def test_histograms_count_each_collective_once_across_scrapes(live):
    col, srv, sock, now, clock = live
    job = SynthJob(t0=now - 60)
    job.announce(now - 30)
    job.steps(1, 5, now - 20)
    for f in job.frames(now - 19):
        sock.send(f)
    assert wait_for(lambda: col.stats["frames_ok"] == 2)
    series = dict(train_job="job", comm="job/gloo:0", op="allreduce")
    for _ in range(3):  # scraping again does not count the same collectives again
        _, s = scrape(srv.url)
        assert value(s, "ccld_collective_duration_seconds_count", **series) == 5
    job.collective(6, now - 18, finish=False)   # entered by everyone, not finished: not counted yet
    job.steps(7, 6, now - 17)
    for f in job.frames(now - 16):
        sock.send(f)
    assert wait_for(lambda: col.stats["frames_ok"] == 4)
    _, s = scrape(srv.url)
    assert value(s, "ccld_collective_duration_seconds_count", **series) == 11
    for r in range(4):
        job.start(r, 6, now - 15)
        job.end(r, 6, now - 15)
    for f in job.frames(now - 15):
        sock.send(f)
    assert wait_for(lambda: col.stats["frames_ok"] == 6)
    _, s = scrape(srv.url)
    assert value(s, "ccld_collective_duration_seconds_count", **series) == 12   # seq 6, late, counted once


def test_collectives_evicted_between_scrapes_are_counted_as_unfolded(monkeypatch):
    monkeypatch.setattr(comms, "MAX_COLLS_PER_COMM", 8)
    col = Collector(listen="tcp://127.0.0.1:*", on_line=lambda line: None, stacks=False)  # not started: fed directly
    srv = MetricsServer(col, "127.0.0.1:0").start()
    try:
        now = time.time()
        job = SynthJob(t0=now - 60)
        job.announce(now - 30)
        job.steps(1, 5, now - 20)
        for f in job.frames(now - 19):
            col.handle_frame(f, now - 19)
        _, s = scrape(srv.url)
        assert value(s, "ccld_collective_duration_seconds_count", train_job="job", comm="job/gloo:0", op="allreduce") == 5
        job.steps(6, 20, now - 18)   # seqs 6..25; the timeline keeps 18..25 only
        for f in job.frames(now - 10):
            col.handle_frame(f, now - 10)
        _, s = scrape(srv.url)
        assert value(s, "ccld_metrics_collectives_unfolded_total") == 17 - 5   # 6..17 never seen by a scrape
        assert value(s, "ccld_collective_duration_seconds_count", train_job="job", comm="job/gloo:0",
                     op="allreduce") == 5 + 8
    finally:
        srv.stop()


def test_snapshot_and_unknown_paths(live):
    col, srv, sock, now, clock = live
    import json
    with urllib.request.urlopen(srv.url + "/snapshot", timeout=10) as r:
        snap = json.loads(r.read())
    assert snap["version"] == 1 and snap["jobs"] == [] and snap["findings"] == []
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(srv.url + "/nope", timeout=10)
    assert e.value.code == 404


def test_bad_metrics_addresses_are_refused_with_a_clear_message():
    for bad in ("9464", "host:", "host:port", "h:70000"):
        with pytest.raises(MetricsError, match="HOST:PORT"):
            parse_hostport(bad)
    assert parse_hostport(":9464") == ("0.0.0.0", 9464)
    assert parse_hostport("[::1]:9464") == ("::1", 9464)
    col = Collector(listen="tcp://127.0.0.1:*", stacks=False)
    first = MetricsServer(col, "127.0.0.1:0").start()
    try:
        with pytest.raises(MetricsError, match="cannot serve metrics on 127.0.0.1:%d" % first.port):
            MetricsServer(col, f"127.0.0.1:{first.port}").start()
    finally:
        first.stop()


def test_snapshot_names_the_culprit_its_lag_and_the_links_out_of_line(live):
    import json
    col, srv, sock, now, clock = live
    job = SynthJob(t0=now - 60)
    job.announce(now - 30)
    job.steps(1, 4, now - 20, late={1: 0.2})
    SynthLinks(job).ring(now - 4, nbytes=4 << 20, srtt={(2, 3): 9000}, retrans={(0, 1): 5})
    for r in (0, 2, 3):
        job.enter(r, 5, now - 3)
    for f in job.frames(now - 0.5):
        sock.send(f)
    assert wait_for(lambda: col.tracker.active)
    with urllib.request.urlopen(srv.url + "/snapshot", timeout=10) as r:
        snap = json.loads(r.read())
    (j,) = snap["jobs"]
    assert (j["job"], j["world_size"], j["main_comm"]) == ("job", 4, "job/gloo:0")
    assert [r["rank"] for r in j["ranks"]] == [1, 0, 2, 3] and j["ranks"][0]["blamed"]
    r1, r0 = j["ranks"][0], j["ranks"][1]
    assert (r1["seq"], r1["inside"], r1["node"], r1["pid"]) == (4, False, "node0", 1001)
    assert (r0["seq"], r0["op"], r0["inside"]) == (5, "allreduce", True)
    assert r0["for_s"] == pytest.approx(3.0, abs=0.01)            # the snapshot's clock is the fixture's `now`
    assert r1["lag_s"] == pytest.approx(0.2 + 0.002 / 3, abs=1e-6)
    assert j["comms"] == [{"id": "job/gloo:0", "backend": "gloo", "members": 4, "seq": 5, "op": "allreduce",
                           "completed": False, "missing": [1], "first_enter_at": pytest.approx(now - 3, abs=1e-6)}]
    odd = {(x["src"], x["dst"]): x["why"] for x in j["links"] if x["out_of_line"]}
    assert odd == {(0, 1): "5 retransmissions", (2, 3): "rtt 9.0 ms vs median 50 us"}
    assert [x["out_of_line"] for x in j["links"]][:2] == [True, True]   # out-of-line pairs come first
    (f,) = snap["findings"]
    assert (f["class"], f["ranks"], f["seq"]) == ("not-entered", [1], 5) and "stack" not in f
    assert snap["agents"]["agent-0"]["node"] == "node0"
