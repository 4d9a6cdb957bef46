"""Link and scheduler counters in the trace, from the agents' LinkStats and SchedStats as they stream by.

Links: each rank's TCP connections are joined into directed rank pairs (src -> dst) the way the
collector's LinkTable does it, but incrementally: an index of every connection's local end (scope,
addr, port) -> connection names the rank at the far end of another (loopback addresses are scoped by
node). Three counter tracks per pair, under the src rank's process: `link S->D MiB/s` (bytes S sent
to D, all their connections together), `link S->D RTT ms` (the sender's smoothed RTT, mean of its
reports) and `link S->D retrans` (retransmissions counted by S). Values are per BUCKET_NS of recorded
time, written at the bucket's start (a counter holds its value until the next sample; an unchanged
value is not written again; after a burst a 0 follows).
Deltas: LinkStats counters are cumulative; a report's bytes are spread over the time since the same
connection's previous report (at most MAX_SPAN_NS: the agent skips idle connections, so after a
longer gap they were sent just before), retransmissions and RTT go to the report's own bucket. A
connection's first report counts from zero, as in LinkTable (the agent counts from when it first saw
the connection, within one drain period). Far end unknown yet: the deltas are held (MAX_HELD, then
merged) until a connection with that local end reports, which both ends do within one drain period
(~0.5 s), and are then drawn where they were sent: nothing is skipped. Held deltas of a connection
whose far end never reports (outside the job) stay held until the connection is forgotten.
Scheduler: `rank R runqueue wait %`: runqueue ns gained / wall ns between two SchedStats, written at
the first one's time. It sums the process's threads, so it can pass 100 (4 threads waiting = 400).
Bounds: MAX_CONNS connections (least recently reported forgotten first), MAX_PAIRS pairs, and open
buckets only within CLOSE_AFTER_NS of the newest event; what does not fit is counted in anomalies.
"""
from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

from ccld.export.buckets import Closing
from ccld.export.tracks import Proc, Track
from ccld.timeline.links import LOOPBACK_PREFIXES

if TYPE_CHECKING:
    from ccld.export.model import TraceModel

BUCKET_NS = 500_000_000        # one agent drain period (KernelFamily.DRAIN_MS): each report fills about one
MAX_SPAN_NS = 1_000_000_000    # a report's bytes cover at most the last 1 s before it (two drain periods)
FIRST_SPAN_NS = 500_000_000    # a connection's first report covers one drain period
CLOSE_AFTER_NS = 2_000_000_000  # a bucket is written once recorded time is 2 s past its end: reports that
                                # can still add to it (spread back MAX_SPAN_NS, or held ~0.5 s for their
                                # far end) have come by then; a later one goes to the next open bucket
MAX_CONNS = 65_536             # connections known at once (one agent's map holds as many); the least
                               # recently reported is forgotten first, counted (link-conns-evicted)
MAX_HELD = 8                   # deltas held per connection while its far end is unknown
MAX_PAIRS = 65_536             # directed rank pairs drawn (a 256-rank full mesh)
LINK_ORDER = 1000              # link tracks sort after calls, worker, p2p, state (100..499)
MIB = float(1 << 20)


def _scope(node: str, addr: str) -> str:
    return node if addr.startswith(LOOPBACK_PREFIXES) else ""


class Conn:
    """One connection as its own side reports it: latest cumulative counters, and its rank pair."""
    __slots__ = ("proc", "local", "far", "ts", "tx", "retrans", "held", "pair")

    def __init__(self, proc: Proc, local: tuple, far: tuple):
        self.proc, self.local, self.far = proc, local, far
        self.ts = -1
        self.tx = self.retrans = 0
        self.held: List[tuple] = []   # (ts, span_ns, bytes, retrans, srtt_us) waiting for the far end
        self.pair: Optional["Pair"] = None


class Pair:
    """One directed rank pair (src process -> dst rank): open buckets and its three counter tracks.
    A bucket is [bytes, retrans, srtt_us sum, srtt reports]."""
    __slots__ = ("proc", "dst", "buckets", "closed", "rate", "rtt", "retrans")

    def __init__(self, proc: Proc, dst: int):
        self.proc, self.dst = proc, dst
        self.buckets: Dict[int, list] = {}
        self.closed = -(1 << 62)   # the highest bucket written
        self.rate = self.rtt = self.retrans = None


class NetCounters:
    def __init__(self, model: "TraceModel"):
        self.m = model
        self.conns: "collections.OrderedDict[tuple, Conn]" = collections.OrderedDict()  # oldest report first
        self.endpoints: Dict[tuple, Conn] = {}   # (scope, addr, port) -> the connection with that local end
        # far end -> connections holding deltas until a connection with that local end reports. Keyed by
        # the far end, not found through `endpoints`: a listener's accepted sockets share one local end.
        self.waiting: Dict[tuple, List[Conn]] = {}
        self.pairs: Dict[Tuple[Proc, int], Pair] = {}
        self.closing = Closing(BUCKET_NS, CLOSE_AFTER_NS)

    # ---- links

    def on_link(self, node: str, p: Proc, e: dict, ts: int) -> None:
        saddr, daddr, sport, dport = e["saddr"], e["daddr"], e["sport"], e["dport"]
        tx, retrans, srtt = e.get("tx_bytes", 0), e.get("retrans", 0), e.get("srtt_us", 0)
        if not (type(saddr) is type(daddr) is str and type(sport) is type(dport) is type(tx) is
                type(retrans) is type(srtt) is int):
            raise TypeError("link event fields")
        key = (node, p.pid, saddr, sport, daddr, dport)
        c = self.conns.get(key)
        if c is None:
            if len(self.conns) >= MAX_CONNS:
                self._evict()
            c = self.conns[key] = Conn(p, (_scope(node, saddr), saddr, sport), (_scope(node, daddr), daddr, dport))
            self.endpoints[c.local] = c
        else:
            self.conns.move_to_end(key)
        if ts <= c.ts:
            self.m.anomalies["link-out-of-order"] += 1
            return
        d_tx, d_re = tx - c.tx, retrans - c.retrans
        span = FIRST_SPAN_NS if c.ts < 0 else min(ts - c.ts, MAX_SPAN_NS)
        if d_tx < 0 or d_re < 0:  # counters went down: the agent restarted and counts from zero again
            self.m.anomalies["link-counter-reset"] += 1
            d_tx, d_re, span = tx, retrans, FIRST_SPAN_NS
        c.ts, c.tx, c.retrans = ts, tx, retrans
        if c.pair is None and (d_tx or d_re or c.held) and self._resolve(c):
            self._release(c)
        if d_tx or d_re:
            delta = (ts, span, d_tx, d_re, srtt if d_tx else 0)
            if c.pair is None:
                self._hold(c, delta)
            elif c.pair:
                self._add(c.pair, *delta)
        for other in self.waiting.pop(c.local, ()):  # connections whose far end is this one's local end
            if other.pair is None and self._resolve(other):
                self._release(other)
            # else: not a rank pair after all (another job, itself); its own next report tries again

    def _hold(self, c: Conn, delta: tuple) -> None:
        """Keep a delta until c's far end reports (MAX_HELD; beyond, the oldest two are merged)."""
        if not c.held:
            self.waiting.setdefault(c.far, []).append(c)
        elif len(c.held) >= MAX_HELD:  # bytes kept, their spans joined
            a, b = c.held.pop(0), c.held[0]
            c.held[0] = (b[0], b[0] - a[0] + a[1], a[2] + b[2], a[3] + b[3], b[4])
        c.held.append(delta)

    def _release(self, c: Conn) -> None:
        """c's pair is known now: what it held goes to the pair's buckets (unless not drawn)."""
        for d in c.held if c.pair else ():
            self._add(c.pair, *d)
        if c.held:
            c.held = []
            self._unwait(c)

    def _unwait(self, c: Conn) -> None:
        waiting = self.waiting.get(c.far)
        if waiting is not None and c in waiting:
            waiting.remove(c)
            if not waiting:
                del self.waiting[c.far]

    def _evict(self) -> None:
        """Forget the connection reported least recently (and what it held: counted, not drawn)."""
        _, old = self.conns.popitem(last=False)
        if self.endpoints.get(old.local) is old:
            del self.endpoints[old.local]
        if old.held:
            self.m.anomalies["link-held-dropped"] += 1
            self._unwait(old)
        self.m.anomalies["link-conns-evicted"] += 1

    def _resolve(self, c: Conn) -> bool:
        """Find c's rank pair; True once known. c.pair is False for a pair that is not drawn."""
        far = self.endpoints.get(c.far)
        if far is None or far.proc is c.proc or far.proc.rank < 0 or far.proc.job != c.proc.job:
            return False
        if c.proc.skip:
            c.pair = False
            return True
        key = (c.proc, far.proc.rank)
        pair = self.pairs.get(key)
        if pair is None:
            if len(self.pairs) >= MAX_PAIRS:
                self.m.anomalies["link-pairs-over-bound"] += 1
                c.pair = False
                return True
            pair = self.pairs[key] = Pair(c.proc, far.proc.rank)
        c.pair = pair
        return True

    def _bucket(self, pair: Pair, i: int) -> list:
        if i <= pair.closed:
            self.m.anomalies["link-late"] += 1  # later than CLOSE_AFTER_NS: drawn in the next bucket
            i = pair.closed + 1
        return self.closing.open(pair, i, lambda: [0, 0, 0, 0])

    def _add(self, pair: Pair, ts: int, span: int, nbytes: int, retrans: int, srtt: int) -> None:
        lo = ts - span
        first, last = lo // BUCKET_NS, (ts - 1) // BUCKET_NS
        if nbytes:
            if first == last:
                self._bucket(pair, last)[0] += nbytes
            else:  # spread over the buckets the span covers, in proportion to the time in each
                for i in range(first, last + 1):
                    part = min(ts, (i + 1) * BUCKET_NS) - max(lo, i * BUCKET_NS)
                    self._bucket(pair, i)[0] += nbytes * part / span
        if retrans or srtt:
            b = self._bucket(pair, last)
            b[1] += retrans
            if srtt > 0:
                b[2] += srtt
                b[3] += 1

    def due(self, now: int) -> None:
        """Write every bucket that closed by `now` (recorded time)."""
        for pair, i, b in self.closing.due(now):
            self._write(pair, i, b)

    def _write(self, pair: Pair, i: int, b: list) -> None:
        m = self.m
        pair.closed = max(pair.closed, i)
        nbytes, retrans, srtt_sum, srtt_n = b
        ts = i * BUCKET_NS
        if pair.rate is None:
            if not (nbytes or retrans):
                return
            self._tracks(pair)
        m.sample(pair.rate, ts, round(nbytes * 1e9 / BUCKET_NS / MIB, 6))
        m.sample(pair.retrans, ts, retrans)
        if srtt_n:
            if pair.rtt is None:
                pair.rtt = self._track(pair, "RTT ms", "ms", 1, "the sender's smoothed RTT (srtt), mean "
                                       "of its connections' reports")
            m.sample(pair.rtt, ts, round(srtt_sum / srtt_n / 1000.0, 3))
        if (nbytes or retrans) and i + 1 not in pair.buckets:
            self._bucket(pair, i + 1)  # an empty next bucket: the counters drop to 0 after a burst

    def _tracks(self, pair: Pair) -> None:
        pair.rate = self._track(pair, "MiB/s", "MiB/s", 0, "bytes sent over TCP, all connections of "
                                "the pair together")
        pair.retrans = self._track(pair, "retrans", "", 2, "TCP retransmissions counted by the sender")

    def _track(self, pair: Pair, what: str, unit: str, k: int, desc: str) -> Track:
        p = pair.proc
        m = self.m
        name = f"link {p.rank}->{pair.dst} {what}"
        return m.new_track(m.proc_track(p), name, "counter", order=LINK_ORDER + 3 * pair.dst + k, unit=unit,
                           description=f"rank {p.rank} -> rank {pair.dst}: {desc}, per "
                                       f"{BUCKET_NS / 1e9:g} s")

    # ---- scheduler

    def on_sched(self, p: Proc, e: dict, ts: int) -> None:
        runq = e["runq_ns"]
        if type(runq) is not int:
            raise TypeError("runq_ns")
        if ts <= p.sched_ts:
            self.m.anomalies["sched-out-of-order"] += 1
            return
        if p.sched_ts >= 0 and runq < p.sched_runq:
            self.m.anomalies["sched-counter-reset"] += 1  # the agent restarted: this report is a new base
        elif p.sched_ts >= 0:
            if p.runq is None:
                m = self.m
                p.runq = m.new_track(m.proc_track(p), f"rank {p.rank} runqueue wait %", "counter",
                                     order=LINK_ORDER - 1, unit="%", description="time this rank's threads were "
                                     "runnable but waiting for a CPU, per wall time (threads add up: can pass 100)")
            self.m.sample(p.runq, p.sched_ts, round(100.0 * (runq - p.sched_runq) / (ts - p.sched_ts), 3))
        p.sched_ts, p.sched_runq = ts, runq
