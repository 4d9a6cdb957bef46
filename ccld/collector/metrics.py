"""Prometheus metrics of a live collector, and the HTTP endpoint that serves them (and /snapshot).

`CollectorMetrics` is a prometheus_client custom collector: every scrape computes the values from
the collector's timeline, tracker and counters under the collector's lock, so ingest pays nothing
per event. Histograms must only grow, while the timeline keeps just the newest collectives of each
communicator: each scrape folds in the collectives completed since the previous one (remembered by
seq while the timeline still holds them), so a collective is counted once. Caveat: a communicator
that completes more than comms.MAX_COLLS_PER_COMM collectives between two scrapes loses the
overflow from its histograms (counted in ccld_metrics_collectives_unfolded_total).
Times: seconds. Links are rates over the last snapshot.LINK_WINDOW_S; counters (`*_total`) are
cumulative since the collector started (link totals per live connection: they drop when an agent
restarts or a closed connection is forgotten, which Prometheus's rate() reads as a reset).
Labels: the training job is `train_job` (MASTER_ADDR:MASTER_PORT): `job` belongs to Prometheus.
Cardinality: arrival lag is one series per rank and communicator, links one per directed rank pair
that carried traffic in the window: a 4096-rank job makes thousands of series; histograms are per
communicator and op only.

`MetricsServer` serves GET /metrics (text exposition) and GET /snapshot (JSON for `ccld top`),
read-only, on a thread of its own.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from ccld import __version__
from ccld.collector import snapshot as snap
from ccld.errors import CcldError

log = logging.getLogger("ccld.metrics")

# Collective time after the last rank arrived, and arrival spread: from tens of microseconds (small
# gloo collectives on one node) to the minute a hang takes before it is a finding.
LATENCY_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                     1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
FINDING_CLASSES = (("hang", "not-entered"), ("hang", "inconsistent"), ("hang", "fault"),
                   ("slow", "comp-slow"), ("slow", "comm-slow"), ("slow", "mixed-slow"))
MAX_FOLDED_COMMS = 10_000  # = comms.MAX_COMMS: one histogram state per communicator


class MetricsError(CcldError):
    """The metrics endpoint cannot start (bad HOST:PORT, address in use)."""


class _Hist:
    """One histogram's cumulative state: per-bucket counts, sum, count."""

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS_S) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, v: float) -> None:
        for i, le in enumerate(LATENCY_BUCKETS_S):
            if v <= le:
                self.counts[i] += 1
                break
        else:
            self.counts[-1] += 1
        self.sum += v

    def buckets(self) -> List[Tuple[str, int]]:
        out, acc = [], 0
        for le, n in zip([repr(b) for b in LATENCY_BUCKETS_S] + ["+Inf"], self.counts):
            acc += n
            out.append((le, acc))
        return out


class _CommFold:
    """What one communicator's histograms already hold."""

    def __init__(self) -> None:
        self.comm_obj: Any = None          # the timeline's Comm: a new object means the group was rebuilt
        self.folded: set = set()           # seqs already counted that the timeline still holds
        self.seen_upto = -1                # the newest seq the previous scrape saw
        self.duration: Dict[str, _Hist] = {}   # op -> histogram
        self.spread: Dict[str, _Hist] = {}


class CollectorMetrics:
    """prometheus_client collector over a live `Collector` (register it in a CollectorRegistry)."""

    def __init__(self, collector, clock: Callable[[], float] = time.time):
        self.collector = collector
        self.clock = clock
        self._folds: Dict[str, _CommFold] = {}
        self._fold_lock = threading.Lock()  # two scrapes at once must not fold the same collective twice
        self.unfolded = 0

    def describe(self) -> List[Metric]:
        return []  # computed at scrape time: nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        c = self.collector
        stats = c.stats  # takes the collector's lock itself
        now = self.clock()
        with self._fold_lock, c.lock:
            tl = c.timeline
            self._fold(tl)
            families = self._timeline_families(tl, now) + self._link_families(tl, now)
            open_by_class: Dict[Tuple[str, str], int] = {k: 0 for k in FINDING_CLASSES}
            for f in c.tracker.active.values():
                if not (f.evidence or {}).get("informational"):
                    open_by_class[(f.kind, f.cls)] = open_by_class.get((f.kind, f.cls), 0) + 1
            ranks_by_job: Dict[str, int] = {}
            for rec in tl.ranks.values():
                if not rec.exited():
                    ranks_by_job[rec.job] = ranks_by_job.get(rec.job, 0) + 1
            silent = [(a, str(i.get("node") or ""), tl.agent_silent_s(a, now)) for a, i in sorted(tl.agents.items())]
            agent_loss = {a: dict(cnt) for a, cnt in tl.agent_loss.items()}
        yield from families
        yield from self._finding_families(open_by_class)
        yield from self._ingest_families(stats, agent_loss)
        g = GaugeMetricFamily("ccld_ranks", "Training processes the agents report, not exited", labels=["train_job"])
        for job, n in sorted(ranks_by_job.items()):
            g.add_metric([job], n)
        yield g
        g = GaugeMetricFamily("ccld_agent_silent_seconds", "Seconds since each agent's last frame",
                              labels=["agent", "node"])
        for a, node, s in silent:
            if s is not None:
                g.add_metric([a, node], s)
        yield g

    # ---- collectives ----------------------------------------------------------------------------

    def _fold(self, tl) -> None:
        """Count the collectives completed since the previous scrape into the histograms."""
        for cid, comm in tl.comms.items():
            fold = self._folds.get(cid)
            if fold is None:
                if len(self._folds) >= MAX_FOLDED_COMMS:
                    continue
                fold = self._folds[cid] = _CommFold()
            if fold.comm_obj is not comm:  # first sight, or rebuilt after a restart: seqs start over
                fold.comm_obj, fold.folded, fold.seen_upto = comm, set(), -1
            if comm.evicted_upto > fold.seen_upto >= 0:  # fell out of the timeline between two scrapes
                self.unfolded += comm.evicted_upto - fold.seen_upto
            fold.folded &= comm.colls.keys()
            for seq, v in comm.colls.items():
                fold.seen_upto = max(fold.seen_upto, seq)
                if v.completed_at is None or seq in fold.folded or not v.entered():
                    continue
                fold.folded.add(seq)
                _, first, last = v.enter_span()
                fold.duration.setdefault(v.op, _Hist()).observe(max(0.0, v.completed_at - last))
                fold.spread.setdefault(v.op, _Hist()).observe(last - first)

    def _timeline_families(self, tl, now: float) -> List[Metric]:
        dur = HistogramMetricFamily("ccld_collective_duration_seconds",
                                    "Collective time from the last rank's arrival to the last rank's completion",
                                    labels=["train_job", "comm", "op"])
        spread = HistogramMetricFamily("ccld_collective_arrival_spread_seconds",
                                       "Seconds between the first and the last rank entering a collective",
                                       labels=["train_job", "comm", "op"])
        for cid, fold in sorted(self._folds.items()):
            job = fold.comm_obj.job if fold.comm_obj is not None else ""
            for op, h in sorted(fold.duration.items()):
                dur.add_metric([job, cid, op], h.buckets(), h.sum)
            for op, h in sorted(fold.spread.items()):
                spread.add_metric([job, cid, op], h.buckets(), h.sum)
        seq = GaugeMetricFamily("ccld_comm_seq", "Newest collective sequence number any member entered "
                                "(flat while a job hangs)", labels=["train_job", "comm"])
        lag = GaugeMetricFamily("ccld_rank_arrival_lag_seconds",
                                f"Mean seconds a rank entered after the first rank, over the last "
                                f"{snap.LAG_WINDOW} completed collectives", labels=["train_job", "comm", "rank"])
        for cid, comm in sorted(tl.comms.items()):
            seq.add_metric([comm.job, cid], comm.max_seq)
            for r, s in sorted(snap.rank_lags(comm).items()):
                lag.add_metric([comm.job, cid, str(r)], s)
        unfolded = CounterMetricFamily("ccld_metrics_collectives_unfolded",
                                       "Collectives that fell out of the timeline before a scrape counted them")
        unfolded.add_metric([], self.unfolded)
        return [dur, spread, seq, lag, unfolded]

    # ---- links ----------------------------------------------------------------------------------

    def _link_families(self, tl, now: float) -> List[Metric]:
        labels = ["train_job", "src", "dst"]
        w = snap.LINK_WINDOW_S
        rate = GaugeMetricFamily("ccld_link_throughput_bytes_per_second",
                                 f"Bytes per second src sent to dst over the last {w:g} s", labels=labels)
        rtt = GaugeMetricFamily("ccld_link_rtt_seconds", f"Sender's mean smoothed RTT over the last {w:g} s "
                                "(pairs that carried bulk data)", labels=labels)
        retr = GaugeMetricFamily("ccld_link_retransmits_per_second",
                                 f"Retransmissions per second src->dst over the last {w:g} s", labels=labels)
        sent = CounterMetricFamily("ccld_link_sent_bytes", "Bytes src sent to dst on its live connections",
                                   labels=labels)
        rtot = CounterMetricFamily("ccld_link_retransmits", "Retransmissions src->dst on its live connections",
                                   labels=labels)
        for job in tl.links.jobs():
            for (src, dst), s in sorted(tl.links.pair_window(job, now - w, now).items()):
                key = [job, str(src), str(dst)]
                rate.add_metric(key, s.tx_bytes / w)
                retr.add_metric(key, s.retrans / w)
                if s.srtt_mean_us > 0:
                    rtt.add_metric(key, s.srtt_mean_us / 1e6)
        totals: Dict[Tuple[str, int, int], List[int]] = {}
        for row in tl.links.table():
            if row["peer"] is None:
                continue  # store and external connections are not rank pairs
            t = totals.setdefault((str(row["job"]), int(row["rank"]), int(row["peer"])), [0, 0])
            t[0] += int(row["tx_bytes"])
            t[1] += int(row["retrans"])
        for (job, src, dst), (b, r) in sorted(totals.items()):
            sent.add_metric([job, str(src), str(dst)], b)
            rtot.add_metric([job, str(src), str(dst)], r)
        return [rate, rtt, retr, sent, rtot]

    # ---- findings and ccld itself ---------------------------------------------------------------

    def _finding_families(self, open_by_class: Dict[Tuple[str, str], int]) -> Iterator[Metric]:
        c = self.collector
        g = GaugeMetricFamily("ccld_findings_open", "Findings that hold now (informational pauses excluded)",
                              labels=["kind", "class"])
        for (kind, cls), n in sorted(open_by_class.items()):
            g.add_metric([kind, cls], n)
        yield g
        made: Dict[Tuple[str, str], int] = {k: 0 for k in FINDING_CLASSES}
        recovered: Dict[str, int] = {cls: 0 for _, cls in FINDING_CLASSES}
        with c.out_lock:
            for f in c.findings:
                made[(f.kind, f.cls)] = made.get((f.kind, f.cls), 0) + 1
            for r in c.recoveries:
                recovered[str(r.get("class"))] = recovered.get(str(r.get("class")), 0) + 1
        t = CounterMetricFamily("ccld_findings", "Findings reported since the collector started",
                                labels=["kind", "class"])
        for (kind, cls), n in sorted(made.items()):
            t.add_metric([kind, cls], n)
        yield t
        t = CounterMetricFamily("ccld_recoveries", "Findings that stopped holding", labels=["class"])
        for cls, n in sorted(recovered.items()):
            t.add_metric([cls], n)
        yield t

    def _ingest_families(self, stats: Dict[str, Any], agent_loss: Dict[str, Dict[str, int]]) -> Iterator[Metric]:
        g = GaugeMetricFamily("ccld_build_info", "ccld version", labels=["version"])
        g.add_metric([__version__], 1)
        yield g
        if stats.get("started_at"):
            yield GaugeMetricFamily("ccld_collector_start_time_seconds", "Unix time the collector started",
                                    value=stats["started_at"])
        yield CounterMetricFamily("ccld_frames_received", "Frames decoded and ingested", value=stats["frames_ok"])
        yield CounterMetricFamily("ccld_received_bytes", "Bytes of the frames ingested", value=stats["bytes_ok"])
        yield _labelled_counter("ccld_frames_rejected", "Frames dropped whole, by reason", "reason",
                                stats.get("frames_rejected", {}))
        yield _labelled_counter("ccld_events_received", "Events ingested, by kind", "kind",
                                stats.get("events_by_kind", {}))
        yield _labelled_counter("ccld_events_bad", "Events dropped from good frames, by reason", "reason",
                                stats.get("bad_events", {}))
        yield CounterMetricFamily("ccld_events_skipped", "Events of kinds newer than this collector",
                                  value=stats.get("skipped_events", 0))
        yield _labelled_counter("ccld_timeline_anomalies", "Events the timeline could not place, by reason",
                                "reason", stats.get("anomalies", {}))
        loss = CounterMetricFamily("ccld_agent_dropped", "What agents report they lost, by counter",
                                   labels=["agent", "counter"])
        for a, cnt in sorted(agent_loss.items()):
            for name, n in sorted(cnt.items()):
                loss.add_metric([a, name], n)
        yield loss
        errs = CounterMetricFamily("ccld_collector_errors", "The collector's own losses and errors",
                                   labels=["what"])
        for what, key in (("internal", "internal_errors"), ("store", "store_errors"),
                          ("dropped-at-stop", "frames_dropped_at_stop"), ("findings-not-kept", "findings_not_kept")):
            errs.add_metric([what], stats.get(key) or 0)
        yield errs
        yield GaugeMetricFamily("ccld_agents", "Agents that ever sent a frame", value=stats.get("agents", 0))


def _labelled_counter(name: str, doc: str, label: str, values: Dict[str, int]) -> CounterMetricFamily:
    m = CounterMetricFamily(name, doc, labels=[label])
    for k, v in sorted(values.items()):
        m.add_metric([str(k)], v)
    return m


def parse_hostport(text: str) -> Tuple[str, int]:
    """'HOST:PORT' (HOST may be '[::1]' or empty for every address) -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise MetricsError(f"--metrics wants HOST:PORT (e.g. 127.0.0.1:9464), not {text!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


class _Handler(BaseHTTPRequestHandler):
    server_version = f"ccld/{__version__}"

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        owner: MetricsServer = self.server.owner  # type: ignore[attr-defined]
        path = self.path.split("?", 1)[0]
        try:
            if path == "/metrics":
                body, ctype = generate_latest(owner.registry), CONTENT_TYPE_LATEST
            elif path == "/snapshot":
                body, ctype = json.dumps(owner.snapshot(), default=str).encode(), "application/json"
            elif path == "/":
                body, ctype = b"ccld collector: /metrics (Prometheus), /snapshot (JSON for ccld top)\n", "text/plain"
            else:
                self.send_error(404, "ccld serves /metrics and /snapshot")
                return
        except Exception:  # a bug in one scrape must not take the endpoint down
            log.exception("metrics request %s failed", path)
            self.send_error(500, "ccld could not build the response (see the collector's log)")
            return
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("metrics %s " + fmt, self.client_address[0], *args)  # scrapes every 15 s: not for stderr


class MetricsServer:
    """GET /metrics and /snapshot for one collector, on HOST:PORT (port 0: any free port)."""

    def __init__(self, collector, address: str, clock: Callable[[], float] = time.time):
        self.collector = collector
        self.clock = clock
        self.host, self.port = parse_hostport(address)
        self.registry = CollectorRegistry(auto_describe=False)
        self.metrics = CollectorMetrics(collector, clock)
        self.registry.register(self.metrics)
        self._http: Optional[ThreadingHTTPServer] = None
        self._thread: Optional[threading.Thread] = None

    def snapshot(self) -> Dict[str, Any]:
        c = self.collector
        stats = c.stats
        now = self.clock()
        with c.lock:
            return snap.snapshot(c.timeline, list(c.tracker.active.values()), now, stats)

    def start(self) -> "MetricsServer":
        cls = ThreadingHTTPServer
        if ":" in self.host:  # IPv6 literal
            import socket

            class _V6(ThreadingHTTPServer):
                address_family = socket.AF_INET6
            cls = _V6
        try:
            self._http = cls((self.host, self.port), _Handler)
        except OSError as e:
            raise MetricsError(f"cannot serve metrics on {self.host}:{self.port}: {e.strerror or e}") from None
        self._http.daemon_threads = True
        self._http.owner = self  # type: ignore[attr-defined]
        self.port = self._http.server_address[1]
        self._thread = threading.Thread(target=self._http.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="ccld-metrics", daemon=True)
        self._thread.start()
        return self

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None
