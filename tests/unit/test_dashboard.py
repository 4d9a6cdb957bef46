"""deploy/grafana/ccld.json asks only for what the collector exports: every ccld_* metric name in
its queries is one a real collector serves, and every label it filters, groups or titles by is one
that metric carries."""
import json
import os
import re
import time
import urllib.request

import msgpack
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ccld import wire as ev
from ccld.collector.metrics import MetricsServer
from ccld.collector.server import Collector
from ccld_synth import SynthJob, SynthLinks
from conftest import ROOT

pytestmark = pytest.mark.unit

DASHBOARD = os.path.join(ROOT, "deploy", "grafana", "ccld.json")
SUFFIXES = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""], "info": ["_info"]}
SELECTOR = re.compile(r"\b(ccld_[a-z0-9_]+)\s*(\{[^}]*\})?")
BY = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
LEGEND = re.compile(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}")


def exported():
    """{sample name: label names} of a real collector's /metrics, with data in every family."""
    col = Collector(listen="tcp://127.0.0.1:*", on_line=lambda line: None, floor_s=1.0, stacks=False)
    srv = MetricsServer(col, "127.0.0.1:0").start()
    try:
        now = time.time()
        job = SynthJob(t0=now - 60)
        job.announce(now - 30)
        job.steps(1, 5, now - 20)
        SynthLinks(job).ring(now - 3, retrans={(0, 1): 2})
        for r in (0, 1, 3):
            job.enter(r, 6, now - 3)
        job.agents[0].pending.append(ev.LossCounters(ts_ns=job.agents[0].mono(now - 1), counters={"queue_dropped": 3}))
        for f in job.frames(now - 0.5):
            col.handle_frame(f, now - 0.5)
        col.handle_frame(b"\xc1junk", now)                                   # a rejected frame
        col.handle_frame(msgpack.packb({"v": [ev.SCHEMA_MAJOR, ev.SCHEMA_MINOR], "agent": "agent-0", "node": "node0",
                                        "batch": 99, "events": [[1, 2]]}), now)  # a bad event
        job.end(0, 77, now - 0.4)                                           # an anomaly: end without enter
        for f in job.frames(now - 0.3):
            col.handle_frame(f, now - 0.3)
        col.tick(now)
        assert col.tracker.active
        with urllib.request.urlopen(srv.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    finally:
        srv.stop()
    out = {}
    for fam in text_string_to_metric_families(text):
        for suffix in SUFFIXES.get(fam.type, [""]):
            out.setdefault(fam.name + suffix, set())
        for s in fam.samples:
            out.setdefault(s.name, set()).update(k for k in s.labels if k != "le")
            if fam.type == "histogram":
                out[fam.name + "_bucket"].add("le")
    return out


def queries(dash):
    """(where, PromQL, legendFormat) of every target and templating query."""
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            out.append((f"panel {p['title']!r} {t['refId']}", t["expr"], t.get("legendFormat", "")))
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            out.append((f"variable {v['name']}", v["definition"], ""))
    return out


def test_dashboard_queries_use_only_exported_metrics_and_labels():
    with open(DASHBOARD) as f:
        dash = json.load(f)
    have = exported()
    qs = queries(dash)
    assert len(qs) >= 25
    used = set()
    for where, expr, legend in qs:
        names = [m.group(1) for m in SELECTOR.finditer(expr)]
        assert names, f"{where}: no ccld metric in {expr!r}"
        labels = set().union(*(have.get(n, set()) for n in names))
        for m in SELECTOR.finditer(expr):
            name, matchers = m.group(1), m.group(2) or ""
            assert name in have, f"{where}: {name} is not exported by the collector"
            used.add(name)
            for lab in re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", matchers):
                assert lab in have[name], f"{where}: {name} has no label {lab!r} (it has {sorted(have[name])})"
        for group in BY.findall(expr):
            for lab in (x.strip() for x in group.split(",") if x.strip()):
                assert lab in labels, f"{where}: no metric in {expr!r} has the label {lab!r} it groups by"
        for lab in LEGEND.findall(legend):
            assert lab in labels, f"{where}: legend {legend!r} names {lab!r}, which {names} do not carry"
    # the list: latency histograms, arrival lag, links, findings, ingest and drops
    for must in ("ccld_collective_duration_seconds_bucket", "ccld_rank_arrival_lag_seconds",
                 "ccld_link_throughput_bytes_per_second", "ccld_link_rtt_seconds", "ccld_link_retransmits_per_second",
                 "ccld_findings_open", "ccld_frames_received_total", "ccld_agent_dropped_total",
                 "ccld_frames_rejected_total"):
        assert must in used, f"the dashboard does not show {must}"


def test_dashboard_is_a_grafana_dashboard_with_a_datasource_variable():
    with open(DASHBOARD) as f:
        dash = json.load(f)
    assert dash["uid"] == "ccld-overview" and isinstance(dash["schemaVersion"], int)
    names = [v["name"] for v in dash["templating"]["list"]]
    assert names == ["datasource", "job", "comm"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
