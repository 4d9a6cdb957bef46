"""The link table: every rank's TCP connections joined across ranks into rank pairs, over time.

Each agent reports its own side of a connection (LinkStats: cumulative counters and the 4-tuple as
that side sees it). The far end of a connection is the local end of another rank's connection with
the same two endpoints reversed, so (daddr, dport) looked up among all known local endpoints names the
peer rank. Loopback addresses are only unique within one node, so they are scoped by node. A
connection whose far end is the job's rendezvous port (MASTER_ADDR:MASTER_PORT, the TCPStore) is
labelled "store"; one whose far end is no known rank is "external".

Over time: each connection's counter deltas go into per-(job, src rank, dst rank) one-second buckets
(a bounded ring, SERIES_BUCKETS long): bytes sent src->dst, retransmissions (counted by the sender),
resets, and the sender's smoothed RTT. Times are Unix seconds (converted by the Timeline's clock).
A pair's baseline (pair_baselines: its own median and spread of RTT, its retransmission rate and
burstiness) is made from those buckets in the BASELINE_SPAN_S before a cut-off the caller chooses,
so a fault after it is not "normal".
Bounds: MAX_CONNS connections, MAX_PAIRS pairs; the rest is counted in the timeline's anomalies.
"""
from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass, field
from typing import AbstractSet, Callable, Deque, Dict, List, Optional, Tuple

import numpy as np

from ccld import wire as ev

MAX_CONNS = 262_144     # 16,384 ranks x 16 connections each; a LinkStats for more is dropped and counted
MAX_PAIRS = 262_144
MAX_UNPLACED = 32       # deltas held per connection while its far end is unknown; older ones are merged
BUCKET_S = 1.0          # link series resolution: finer than any finding needs, coarse enough to stay small
SERIES_BUCKETS = 900    # 15 minutes of history per rank pair
BASELINE_SPAN_S = 300.0 # a pair's baseline is its last 5 minutes before the cut-off: long enough for a
                        # robust median and 90th percentile, short enough that a baseline of thousands of
                        # pairs costs well under a second (~0.1 ms per pair), once per slowdown
RETRANS_SPAN_S = 32     # a baseline's burstiness is kept for windows of 1, 2, 4 ... this many seconds (a
                        # slowdown is judged over ~10 s); longer windows are bounded from the longest
LOOPBACK_PREFIXES = ("127.", "::1", "0.0.0.0", "::")

ConnKey = Tuple[str, int, str, int, str, int]  # (node, pid, saddr, sport, daddr, dport)


@dataclass
class Conn:
    node: str
    pid: int
    rank: int
    job: str
    saddr: str
    sport: int
    daddr: str
    dport: int
    first_at: float
    updated_at: float = 0.0
    tx_bytes: int = 0
    rx_bytes: int = 0
    tx_errs: int = 0
    rx_errs: int = 0
    retrans: int = 0
    resets: int = 0
    srtt_us: int = 0
    cwnd: int = 0
    state: str = ""
    closed: bool = False
    last_tx_at: Optional[float] = None
    last_rx_at: Optional[float] = None
    progress_at: Optional[float] = None   # when tx or rx bytes last grew (report time)
    retrans_at: Optional[float] = None    # when retransmissions last grew
    reset_at: Optional[float] = None
    # Deltas reported before the far end was known (each side's first report usually arrives before
    # the other side's): (t, tx, retrans, resets, errs, srtt_us), added to the series once it is.
    unplaced: List[Tuple[float, int, int, int, int, int]] = field(default_factory=list)


@dataclass
class Bucket:
    t0: float
    tx_bytes: int = 0
    retrans: int = 0
    resets: int = 0
    errs: int = 0
    srtt_max_us: int = 0
    srtt_sum_us: int = 0
    srtt_n: int = 0


@dataclass
class PairSummary:
    """One direction of one rank pair over a window (JSON-ready through as_dict)."""
    src: int
    dst: int
    tx_bytes: int = 0
    retrans: int = 0
    resets: int = 0
    errs: int = 0
    srtt_max_us: int = 0
    srtt_mean_us: float = 0.0
    seconds: int = 0   # buckets in the window with any report
    srtt_median_us: float = 0.0  # median over the window's seconds of each one's mean srtt: one odd second
                                 # (a loaded host stalls a socket's ACKs now and then) moves it little

    def as_dict(self) -> Dict[str, float]:
        return {"src": self.src, "dst": self.dst, "tx_bytes": self.tx_bytes, "retrans": self.retrans,
                "resets": self.resets, "errs": self.errs, "srtt_max_us": self.srtt_max_us,
                "srtt_mean_us": round(self.srtt_mean_us, 1), "srtt_median_us": round(self.srtt_median_us, 1),
                "seconds": self.seconds}


@dataclass(frozen=True)
class PairBaseline:
    """One direction of one rank pair in its own normal: per-second figures over the buckets before a
    cut-off (JSON-ready through as_dict). RTT figures come from the seconds in which it sent data
    (the kernel's srtt says nothing about an idle socket); retransmissions from every reported second."""
    src: int
    dst: int
    rtt_seconds: int = 0          # buckets with RTT samples behind rtt_median_us / rtt_p90_us
    rtt_median_us: float = 0.0    # median over those buckets of each bucket's mean srtt
    rtt_p90_us: float = 0.0       # ... and their 90th percentile: how far the pair's RTT strays when healthy
    seconds: int = 0              # buckets with any report
    retrans_per_s: float = 0.0    # mean retransmissions per reported second
    retrans_most: Tuple[int, ...] = ()  # the most retransmissions in any 1, 2, 4, ... RETRANS_SPAN_S consecutive
                                  # reported seconds: how bursty the pair's healthy noise is, at each scale

    def retrans_noise(self, seconds: int) -> int:
        """The most retransmissions the pair showed in `seconds` consecutive healthy seconds (rounded
        up to the next power of two, past RETRANS_SPAN_S scaled by the number of such spans): an upper
        bound of its noise over a window that long."""
        if not self.retrans_most or seconds <= 0:
            return 0
        i = max(0, (seconds - 1).bit_length())
        if i < len(self.retrans_most):
            return self.retrans_most[i]
        longest = 1 << (len(self.retrans_most) - 1)
        return self.retrans_most[-1] * -(-seconds // longest)

    def as_dict(self) -> Dict[str, object]:
        return {"rtt_seconds": self.rtt_seconds, "rtt_median_us": round(self.rtt_median_us, 1),
                "rtt_p90_us": round(self.rtt_p90_us, 1), "seconds": self.seconds,
                "retrans_per_s": round(self.retrans_per_s, 3), "retrans_most": list(self.retrans_most)}


def _excluded(t0: float, spans: Tuple[Tuple[float, float], ...]) -> bool:
    return any(t0 + BUCKET_S > a and t0 < b for a, b in spans)


def baseline_of(src: int, dst: int, buckets: Deque[Bucket], before: float,
                exclude: Tuple[Tuple[float, float], ...] = ()) -> PairBaseline:
    """The baseline of one pair from its buckets of the BASELINE_SPAN_S that end by `before`, less
    those that overlap an `exclude` span. O(buckets in the span)."""
    rtts: List[float] = []
    rets: List[int] = []
    oldest = before - BASELINE_SPAN_S
    for b in reversed(buckets):
        t0 = b.t0
        if t0 + BUCKET_S > before:
            continue
        if t0 < oldest:
            break
        if exclude and _excluded(t0, exclude):
            continue
        rets.append(b.retrans)
        if b.srtt_n:
            rtts.append(b.srtt_sum_us / b.srtt_n)
    if not rets:
        return PairBaseline(src, dst)
    rets.reverse()  # oldest first: the runs of consecutive seconds below are in time order either way
    rtts.sort()
    run = np.concatenate(([0], np.cumsum(rets)))
    most = []
    span = 1
    while span <= RETRANS_SPAN_S:
        k = min(span, len(rets))
        most.append(int((run[k:] - run[:-k]).max()))
        span *= 2
    n = len(rtts)
    return PairBaseline(src, dst, rtt_seconds=n, rtt_median_us=statistics.median(rtts) if n else 0.0,
                        rtt_p90_us=rtts[min(n - 1, int(n * 0.9))] if n else 0.0,
                        seconds=len(rets), retrans_per_s=int(run[-1]) / len(rets), retrans_most=tuple(most))


def _scope(node: str, addr: str) -> str:
    return node if addr.startswith(LOOPBACK_PREFIXES) else ""


class LinkTable:
    def __init__(self, anomalies: "collections.Counter"):
        self.anomalies = anomalies
        self.conns: Dict[ConnKey, Conn] = {}
        self.endpoints: Dict[Tuple[str, str, int], ConnKey] = {}   # (scope, addr, port) -> conn with that local end
        self.series: Dict[Tuple[str, int, int], Deque[Bucket]] = {}
        self.job_store: Dict[str, Tuple[str, int]] = {}            # job -> (master addr, master port)

    # ---- ingest ---------------------------------------------------------------------------------

    def note_job(self, job: str, master_addr: str, master_port: int) -> None:
        if job and master_port > 0:
            self.job_store[job] = (master_addr, master_port)

    def update(self, node: str, job: str, e: ev.LinkStats, t: float, to_unix: Callable[[int], float]) -> None:
        key = (node, e.pid, e.saddr, e.sport, e.daddr, e.dport)
        c = self.conns.get(key)
        if c is None:
            if len(self.conns) >= MAX_CONNS:
                self._evict_closed()
            if len(self.conns) >= MAX_CONNS:
                self.anomalies["links-over-bound"] += 1
                return
            c = self.conns[key] = Conn(node=node, pid=e.pid, rank=e.rank, job=job, saddr=e.saddr, sport=e.sport,
                                       daddr=e.daddr, dport=e.dport, first_at=t)
            self.endpoints[(_scope(node, e.saddr), e.saddr, e.sport)] = key
        if t < c.updated_at:
            self.anomalies["link-out-of-order"] += 1  # an older report after a newer one: keep the newer
            return
        d_tx, d_rx = e.tx_bytes - c.tx_bytes, e.rx_bytes - c.rx_bytes
        d_re, d_rs = e.retrans - c.retrans, e.resets - c.resets
        d_err = (e.tx_errs - c.tx_errs) + (e.rx_errs - c.rx_errs)
        if min(d_tx, d_rx, d_re, d_rs) < 0:
            # Counters went down: the agent restarted (it counts from when it attached). Start over.
            self.anomalies["link-counter-reset"] += 1
            d_tx, d_rx, d_re, d_rs, d_err = e.tx_bytes, e.rx_bytes, e.retrans, e.resets, e.tx_errs + e.rx_errs
        if d_tx or d_rx:
            c.progress_at = t
        if d_re:
            c.retrans_at = t
        if d_rs:
            c.reset_at = t
        c.updated_at = t
        c.tx_bytes, c.rx_bytes, c.retrans, c.resets = e.tx_bytes, e.rx_bytes, e.retrans, e.resets
        c.tx_errs, c.rx_errs, c.srtt_us, c.cwnd = e.tx_errs, e.rx_errs, e.srtt_us, e.cwnd
        c.state, c.closed = e.state, e.closed
        c.last_tx_at = to_unix(e.last_tx_ns) if e.last_tx_ns else c.last_tx_at
        c.last_rx_at = to_unix(e.last_rx_ns) if e.last_rx_ns else c.last_rx_at
        delta = (t, d_tx, d_re, d_rs, d_err, e.srtt_us if d_tx else 0)
        peer = self.peer_rank(c)
        if peer is None:
            if len(c.unplaced) >= MAX_UNPLACED:
                old = c.unplaced.pop(0)
                nxt = c.unplaced[0]
                c.unplaced[0] = (nxt[0],) + tuple(a + b for a, b in zip(old[1:5], nxt[1:5])) + (nxt[5],)
            c.unplaced.append(delta)
        else:
            self._place(c, peer, [delta])
        far = self.endpoints.get((_scope(node, e.daddr), e.daddr, e.dport))
        other = self.conns.get(far) if far is not None else None
        if other is not None and other.unplaced:  # we are the far end it was waiting for
            back = self.peer_rank(other)
            if back is not None:
                self._place(other, back, other.unplaced)
                other.unplaced = []

    def _place(self, c: Conn, peer: int, deltas) -> None:
        for t, tx, re, rs, err, srtt in deltas:
            self._add_to_series(c.job, c.rank, peer, t, tx, re, rs, err, srtt)
        if deltas is c.unplaced:
            c.unplaced = []

    def _evict_closed(self) -> None:
        """Forget closed connections (their bytes are already in the series) to make room."""
        for key in [k for k, c in self.conns.items() if c.closed]:
            c = self.conns.pop(key)
            ep = (_scope(c.node, c.saddr), c.saddr, c.sport)
            if self.endpoints.get(ep) == key:
                del self.endpoints[ep]

    def _add_to_series(self, job: str, src: int, dst: int, t: float, tx: int, retrans: int, resets: int,
                       errs: int, srtt_us: int) -> None:
        key = (job, src, dst)
        q = self.series.get(key)
        if q is None:
            if len(self.series) >= MAX_PAIRS:
                self.anomalies["link-pairs-over-bound"] += 1
                return
            q = self.series[key] = collections.deque(maxlen=SERIES_BUCKETS)
        t0 = t - (t % BUCKET_S)
        if not q or q[-1].t0 < t0:
            q.append(Bucket(t0))
        b = q[-1] if q[-1].t0 <= t0 else next((x for x in reversed(q) if x.t0 <= t0), q[0])
        b.tx_bytes += tx
        b.retrans += retrans
        b.resets += resets
        b.errs += errs
        if srtt_us:
            b.srtt_max_us = max(b.srtt_max_us, srtt_us)
            b.srtt_sum_us += srtt_us
            b.srtt_n += 1

    # ---- questions ------------------------------------------------------------------------------

    def peer_of(self, c: Conn) -> Tuple[str, Optional[int]]:
        """("rank", r) | ("store", None) | ("external", None): who is at the far end of `c`. The store
        comes first: rank 0 hosts it, so both ends of a store connection are ranks of the job."""
        store = self.job_store.get(c.job)
        if store is not None and store[1] in (c.dport, c.sport):
            return "store", None
        far = self.endpoints.get((_scope(c.node, c.daddr), c.daddr, c.dport))
        if far is not None:
            other = self.conns.get(far)
            if other is not None and other.job == c.job and other.rank >= 0 and (other.node, other.pid) != (c.node, c.pid):
                return "rank", other.rank
        return "external", None

    def peer_rank(self, c: Conn) -> Optional[int]:
        kind, r = self.peer_of(c)
        return r if kind == "rank" else None

    def table(self, job: Optional[str] = None) -> List[Dict[str, object]]:
        """Every known connection with its label, JSON-ready, sorted by (job, rank, peer)."""
        rows = []
        for c in self.conns.values():
            if job is not None and c.job != job:
                continue
            kind, peer = self.peer_of(c)
            rows.append({"job": c.job, "rank": c.rank, "peer": peer, "label": kind if kind != "rank" else
                         f"rank {c.rank} -> rank {peer}", "node": c.node, "pid": c.pid,
                         "local": f"{c.saddr}:{c.sport}", "remote": f"{c.daddr}:{c.dport}",
                         "tx_bytes": c.tx_bytes, "rx_bytes": c.rx_bytes, "retrans": c.retrans, "resets": c.resets,
                         "srtt_us": c.srtt_us, "cwnd": c.cwnd, "state": c.state, "closed": c.closed})
        rows.sort(key=lambda r: (r["job"], r["rank"], r["peer"] if r["peer"] is not None else 1 << 30, r["local"]))
        return rows

    def pair_window(self, job: str, t_from: float, t_to: float) -> Dict[Tuple[int, int], PairSummary]:
        """Per directed rank pair of `job`: what the buckets in [t_from, t_to) add up to."""
        out: Dict[Tuple[int, int], PairSummary] = {}
        for (j, src, dst), q in self.series.items():
            if j != job:
                continue
            s = PairSummary(src, dst)
            n_srtt = 0
            per_s: List[float] = []
            for b in reversed(q):
                if b.t0 < t_from - BUCKET_S:
                    break
                if b.t0 >= t_to:
                    continue
                s.tx_bytes += b.tx_bytes
                s.retrans += b.retrans
                s.resets += b.resets
                s.errs += b.errs
                s.srtt_max_us = max(s.srtt_max_us, b.srtt_max_us)
                s.srtt_mean_us += b.srtt_sum_us
                n_srtt += b.srtt_n
                s.seconds += 1
                if b.srtt_n:
                    per_s.append(b.srtt_sum_us / b.srtt_n)
            s.srtt_mean_us = s.srtt_mean_us / n_srtt if n_srtt else 0.0
            s.srtt_median_us = statistics.median(per_s) if per_s else 0.0
            out[(src, dst)] = s
        return out

    def pair_baselines(self, job: str, before: float, exclude: Tuple[Tuple[float, float], ...] = (),
                       ranks: Optional[AbstractSet[int]] = None) -> Dict[Tuple[int, int], PairBaseline]:
        """Per directed rank pair of `job` (both ends in `ranks`, when given): its baseline from the
        buckets that end by `before` and overlap none of the `exclude` spans (Unix seconds: earlier
        slowdowns, so that a fault does not become the normal it is judged against). O(buckets)."""
        out: Dict[Tuple[int, int], PairBaseline] = {}
        for (j, src, dst), q in self.series.items():
            if j != job or (ranks is not None and (src not in ranks or dst not in ranks)):
                continue
            out[(src, dst)] = baseline_of(src, dst, q, before, exclude)
        return out

    def conns_between(self, job: str, a: int, b: int) -> List[Conn]:
        """Connections of rank a whose far end is rank b, and of b whose far end is a."""
        out = []
        for c in self.conns.values():
            if c.job == job and c.rank in (a, b):
                peer = self.peer_rank(c)
                if peer is not None and {c.rank, peer} == {a, b}:
                    out.append(c)
        return out

    def jobs(self) -> List[str]:
        return sorted({j for (j, _, _) in self.series} | {c.job for c in self.conns.values()})


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def format_table(rows: List[Dict[str, object]], table: "LinkTable") -> List[str]:
    """The link table for a terminal (100 columns): per job, one line per connection, then per rank pair."""
    if not rows:
        return ["no connections recorded (the net probes were off, or the job sent nothing over TCP)"]
    out: List[str] = []
    for job in sorted({str(r["job"]) for r in rows}):
        out.append(f"job {job or '(unknown)'}")
        out.append(f"  {'connection':<14} {'local':<21} {'remote':<21} {'MiB out':>8} {'MiB in':>8} "
                   f"{'retr':>5} {'rst':>3} {'srtt us':>7}")
        for r in rows:
            if str(r["job"]) != job:
                continue
            out.append(f"  {str(r['label']).replace('rank ', 'r')[:14]:<14} {str(r['local'])[:21]:<21} "
                       f"{str(r['remote'])[:21]:<21} {_mib(r['tx_bytes']):>8} {_mib(r['rx_bytes']):>8} "
                       f"{r['retrans']:>5} {r['resets']:>3} {r['srtt_us']:>7}")
        pairs = table.pair_window(job, float("-inf"), float("inf"))
        if pairs:
            out.append("  rank pairs (whole recording): src->dst MiB sent, retransmissions, mean srtt")
            cells = [f"{s.src}->{s.dst} {_mib(s.tx_bytes)} MiB {s.retrans} re {s.srtt_mean_us:.0f} us"
                     for _, s in sorted(pairs.items())]
            for i in range(0, len(cells), 3):
                out.append("    " + " | ".join(cells[i:i + 3]))
    return out
