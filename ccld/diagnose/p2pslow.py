"""Communication-slow from p2p transfers: the stream between two ranks whose transfers take far longer
than they used to (a slow or lossy link between two pipeline stages).

A transfer of stream a -> b (the n-th send of a to b with the n-th recv of b from a, timeline/p2p.py)
takes from when both sides had posted it to when the receiver's side was over. Each stream's
transfers, as they complete, go into BUCKET_S buckets of their median time (a ring of BUCKETS); each
tick, a stream is slow when its median over the RECENT_S before SETTLE_S ago is >= SLOW_FACTOR x its
baseline (the median of its buckets over the BASELINE_S before GAP_S earlier; frozen while it is slow)
and >= MIN_EXTRA_S more. The slow streams of one job are named when they are one link (a -> b, b -> a
or both: `comm-slow` with that link) or all touch one rank (its NIC: that rank); several unrelated
slow streams, or most of the job's links slow at once (a loaded host; among three or more), name
nothing. The link
localiser (links.localise: TCP retransmissions and RTT against each pair's own baseline) is asked
too and its verdict goes into the evidence. A stream with a rank attached mid-run is judged once
its two sides are aligned (CommP2P.offset). Times: Unix seconds.
"""
from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Optional, Tuple

from ccld.diagnose import links
from ccld.diagnose.findings import Finding
from ccld.timeline.records import Comm
from ccld.timeline.timeline import Timeline

BUCKET_S = 2.0         # transfers summarised per 2 s: a pipeline moves many per second
BUCKETS = 300          # 10 minutes of a stream's history
RECENT_S = 10.0        # the window judged
SETTLE_S = 1.0         # ... ending this long ago: the last transfers' ends are still arriving
GAP_S = 10.0           # the baseline ends this long before the window (a slowdown's start is not normal)
BASELINE_S = 120.0
MIN_BASELINE_S = 20.0  # history a stream needs before it is judged
MIN_RECENT = 5         # transfers in the window
SLOW_FACTOR = 3.0      # as commslow.SLOW_FACTOR for collectives
MIN_EXTRA_S = 0.005    # and 5 ms slower: sub-ms jitter on a loaded host is not a finding
MAX_SLOW_SHARE = 0.5   # more of the job's links (rank pairs with streams) slow than this: the host, not a link
MIN_PAIRS_FOR_SHARE = 3  # ... judged so only among three or more links: with one or two, the slow one is named
RELEASE_S = 20.0       # a slow stream's baseline is released after it was fine this long
MAX_STREAMS = 65536


@dataclass
class _Stream:
    last_n: int = 0                     # transfers up to this n are summarised
    cur: int = -1                       # the bucket being filled
    cur_times: List[float] = field(default_factory=list)
    buckets: Deque[Tuple[int, float, int]] = field(default_factory=lambda: collections.deque(maxlen=BUCKETS))
    frozen: Optional[float] = None      # baseline kept while slow
    fine_since: Optional[float] = None
    slow_since: Optional[float] = None


class P2PSlowDetector:
    """One per Timeline (the Diagnoser's)."""

    def __init__(self) -> None:
        self._streams: Dict[Tuple[str, int, int], _Stream] = {}
        self._owner: Dict[str, int] = {}

    def _feed(self, tl: Timeline, comm: Comm, src: int, g_dst: int) -> Optional[Tuple[int, _Stream]]:
        dst = tl.global_of(comm, g_dst)
        g_src = tl.group_of(comm, src)
        if dst is None or g_src is None:
            return None
        key = (comm.id, src, dst)
        st = self._streams.get(key)
        if st is None:
            if len(self._streams) >= MAX_STREAMS:
                return None
            st = self._streams[key] = _Stream()
        sends = comm.p2p.ops.get((src, "send", g_dst))
        recvs = comm.p2p.ops.get((dst, "recv", g_src))
        d = comm.p2p.offset(src, dst, g_src, g_dst) if sends and recvs else None
        if d is None:
            return dst, st
        n = max(st.last_n + 1, next(iter(sends)), next(iter(recvs)) - d)
        while True:
            s, r = sends.get(n), recvs.get(n + d)
            if s is None or r is None or r.ended is None:
                break
            began = max(s.posted, r.posted)
            self._add(st, r.ended, max(0.0, r.ended - began))
            st.last_n = n
            n += 1
        return dst, st

    def _add(self, st: _Stream, at: float, took: float) -> None:
        b = int(at // BUCKET_S)
        if b != st.cur:
            self._close(st)
            st.cur = b
        st.cur_times.append(took)

    def _close(self, st: _Stream) -> None:
        if st.cur_times:
            st.buckets.append((st.cur, statistics.median(st.cur_times), len(st.cur_times)))
            st.cur_times = []

    def _levels(self, st: _Stream, now: float) -> Optional[Tuple[float, float, int]]:
        """(recent median, baseline, transfers in the window) or None when it cannot be judged yet."""
        last = int((now - SETTLE_S) // BUCKET_S) - 1
        if st.cur <= last:
            self._close(st)
        first = last - int(RECENT_S // BUCKET_S) + 1
        recent = [(m, c) for b, m, c in st.buckets if first <= b <= last]
        n = sum(c for _, c in recent)
        if n < MIN_RECENT:
            return None
        level = statistics.median(m for m, _ in recent)
        if st.frozen is not None:
            return level, st.frozen, n
        base_last = first - 1 - int(GAP_S // BUCKET_S)
        base = [m for b, m, _ in st.buckets if base_last - int(BASELINE_S // BUCKET_S) < b <= base_last]
        if len(base) * BUCKET_S < MIN_BASELINE_S:
            return None
        return level, statistics.median(base), n

    def find(self, tl: Timeline, now: float) -> List[Finding]:
        by_job: Dict[str, List[Dict[str, Any]]] = collections.defaultdict(list)
        pairs_of: Dict[str, set] = collections.defaultdict(set)   # every rank pair with a stream, judged or not
        for comm in list(tl.comms.values()):
            if comm.p2p is None:
                continue
            if self._owner.get(comm.id) != id(comm):  # a rebuilt group numbers its ops again
                self._owner[comm.id] = id(comm)
                for k in [k for k in self._streams if k[0] == comm.id]:
                    del self._streams[k]
            for src, g_dst in comm.p2p.streams():
                got = self._feed(tl, comm, src, g_dst)
                if got is None:
                    continue
                dst, st = got
                pairs_of[comm.job].add((min(src, dst), max(src, dst)))
                lv = self._levels(st, now)
                if lv is None:
                    continue
                level, base, n = lv
                slow = level >= SLOW_FACTOR * base and level - base >= MIN_EXTRA_S
                if slow:
                    st.fine_since = None
                    if st.frozen is None:
                        st.frozen, st.slow_since = base, now
                    by_job[comm.job].append({"comm": comm, "src": src, "dst": dst, "recent_s": level,
                                             "baseline_s": base, "transfers": n, "since": st.slow_since})
                elif st.frozen is not None:
                    st.fine_since = st.fine_since or now
                    if now - st.fine_since >= RELEASE_S:
                        st.frozen = st.fine_since = st.slow_since = None
        out = []
        for job, slow in by_job.items():
            slow_pairs = {(min(s["src"], s["dst"]), max(s["src"], s["dst"])) for s in slow}
            if len(pairs_of[job]) >= MIN_PAIRS_FOR_SHARE and len(slow_pairs) > MAX_SLOW_SHARE * len(pairs_of[job]):
                continue  # most links at once: the host or the whole network, no link stands out
            f = self._finding(tl, job, slow, now)
            if f is not None:
                out.append(f)
        return out

    def _finding(self, tl: Timeline, job: str, slow: List[Dict[str, Any]], now: float) -> Optional[Finding]:
        pairs = {tuple(sorted((s["src"], s["dst"]))) for s in slow}
        if len(pairs) == 1:
            (a, b), = pairs
            ranks, link = [a, b], [a, b]
        else:
            common = set.intersection(*(set(p) for p in pairs))
            if len(common) != 1:
                return None  # unrelated streams: nothing one link or rank explains
            ranks, link = sorted(common), None
        worst = max(slow, key=lambda s: s["recent_s"] / max(s["baseline_s"], 1e-9))
        comm = worst["comm"]
        since = min(s["since"] for s in slow)
        try:
            tcp = links.localise(tl, job, frozenset(ranks if link else _ends(pairs)), since - RECENT_S, now,
                                 baseline_before=since - RECENT_S)
            tcp_view = {"named": tcp.named[0] if tcp.named else None, "how": tcp.how,
                        "pairs": [tcp.window[p].as_dict() for p in tcp.suspects if p in tcp.window]}
        except Exception:  # the TCP view is corroboration only; it must not hide what the transfers say
            tcp_view = None
        ratio = worst["recent_s"] / max(worst["baseline_s"], 1e-9)
        where = f"{worst['src']}->{worst['dst']}"
        summary = (f"transfers {where} {ratio:.0f}x slower ({1e3 * worst['recent_s']:.1f} vs "
                   f"{1e3 * worst['baseline_s']:.1f} ms)" + ("" if link else f"; every slow stream touches rank {ranks[0]}"))
        evidence = {"reason": "p2p-transfers", "summary": summary, "window_s": RECENT_S,
                    "streams": [{"src": s["src"], "dst": s["dst"], "comm": s["comm"].id, "recent_s": round(s["recent_s"], 6),
                                 "baseline_s": round(s["baseline_s"], 6), "transfers": s["transfers"]}
                                for s in sorted(slow, key=lambda s: (s["src"], s["dst"]))[:16]],
                    "tcp": tcp_view,
                    "note": "the transfers between these ranks take far longer than they did, while the other "
                            "streams of the job do not: the link between them (or one end's network)"}
        return Finding(kind="slow", cls="comm-slow", ranks=ranks, link=link, comm=comm.id, seq=-1, op="p2p",
                       onset_at=since - RECENT_S / 2, detected_at=now, evidence=evidence, job=job)


def _ends(pairs) -> List[int]:
    return sorted({r for p in pairs for r in p})
