"""`comm-slow` of collectives: find_comm_slow.

Collectives of one op take SLOW_FACTOR x their own baseline (all of them, or enough of them to weigh on
the mean and 90th percentile: a lossy link's retransmission timeouts) while the ranks arrive together
(the time is spent inside the collective, so it is communication). The pair to blame is links.localise's
answer, asked over the span of the slow collectives against link baselines cut where the slowdown began
(frozen while it lasts; earlier slowdowns kept out of them); when no TCP link stands out (or there is
none: NCCL over IB), NCCL's own proxy progress is asked (nccllinks.proxy_suspects). What it remembers
per communicator between ticks keeps a tick cheap at thousands of communicators. Times: Unix seconds.
Thresholds are in the constants below, each with its reason; evidence carries the numbers.
"""
from __future__ import annotations

import collections
import math
import statistics
import weakref
import zlib
from dataclasses import dataclass, field
from typing import AbstractSet, Deque, Dict, List, Optional, Tuple

import numpy as np

from ccld.diagnose import nccllinks
from ccld.diagnose.findings import Finding
from ccld.diagnose.links import BASELINE_GUARD_S, Pair, localise, name_pairs, pair_baselines
from ccld.timeline.links import PairBaseline, PairSummary
from ccld.timeline.donelog import Done, DoneLog
from ccld.timeline.records import Comm
from ccld.timeline.timeline import Timeline

RECENT_S = 10.0            # the window a slowdown is judged over ...
RECENT_N = 10              # ... or its last RECENT_N collectives, if fewer: a 30x slower job completes a
                           # handful in 10 s, and a median over mostly pre-fault ones would hide it
MIN_RECENT = 5             # completed collectives of one op needed in that window
BASELINE_EVERY = 64        # completions of a communicator between two recomputations of its baselines, plus
                           # 0-63 more per communicator (from its id): thousands of node groups that complete
                           # in step must not all recompute in one tick
MIN_TAIL = 20              # ... and for judging its tail (mean and 90th percentile over RECENT_S)
MIN_BASELINE = 20          # ... and before it, to know what normal is
SLOW_FACTOR = 3.0          # recent median duration / baseline duration that counts as slow
UNNAMED_FACTOR = 10.0      # ... and when no link or rank stands out, this much slower
MIN_EXTRA_S = 0.010        # and at least this much slower in absolute terms (sub-ms noise is not a finding)
EPISODE_GAP_S = RECENT_S   # a communicator's slowdown has ended once none of its ops was slow for this
                           # long (its judging window holds no slow collective any more); until then its
                           # links are judged against baselines cut where the slowdown began
MAX_PAST_EPISODES = 8      # ended slowdowns whose seconds stay out of later baselines: a fault must not
                           # become normal by recurring; older ones have mostly left the link series


@dataclass
class _CommState:
    """What find_comm_slow remembers about one communicator between ticks (a tick must stay cheap at
    thousands of communicators: one that completed nothing new and was fine is not looked at again)."""
    completed_seen: int = -1
    slow: bool = False
    base_at: int = -(1 << 30)                                  # comm.completed when baselines were made
    base: Dict[str, Tuple[float, int]] = field(default_factory=dict)  # op -> (baseline s, collectives behind it)
    log: Optional[DoneLog] = None                              # the log screened (a rebuilt group has a new one)
    screened: int = 0                                          # its completions before this were screened
    every: int = BASELINE_EVERY                                # this communicator's recomputation period
    episode: Optional[float] = None                            # when the slowdown being judged began (links since)
    slow_at: float = 0.0                                       # the latest tick that found an op slow
    past: Deque[Tuple[float, float]] = field(default_factory=lambda: collections.deque(maxlen=MAX_PAST_EPISODES))
    link_base: Optional[Tuple[object, Dict[Tuple[int, int], PairBaseline]]] = None  # (key, baselines) of the episode


_STATE: "weakref.WeakKeyDictionary[Timeline, Dict[str, _CommState]]" = weakref.WeakKeyDictionary()


def _take(d: Done, idx: np.ndarray) -> Done:
    return Done(*(a[idx] for a in d))


def _newest(d: Done, now: float) -> Dict[int, np.ndarray]:
    """Per op code, the positions in `d` (newest made first) of its completed collectives of the last
    RECENT_S, or of its last RECENT_N if more; ops in the order their newest came. As a walk from
    the newest would: it stops at the first collective older than RECENT_S once every op it has seen
    has RECENT_N, and keeps, per op, the first RECENT_N it met and any of the last RECENT_S."""
    n = len(d.seq)
    if not n:
        return {}
    cut = now - RECENT_S
    ops = d.op
    order = np.argsort(ops, kind="stable")  # each op's positions, ascending
    starts = np.flatnonzero(np.r_[True, ops[order][1:] != ops[order][:-1]])
    counts = np.diff(np.r_[starts, n])
    k = np.empty(n, dtype=np.int64)  # each collective's place among its op's, 0: the newest
    k[order] = np.arange(n) - np.repeat(starts, counts)
    nth = np.where(counts >= RECENT_N, order[np.minimum(starts + RECENT_N - 1, n - 1)], n)  # its RECENT_N-th
    need = np.full(n, -1, dtype=np.int64)
    need[order[starts]] = nth
    need = np.maximum.accumulate(need)  # need[p]: the latest RECENT_N-th of the ops first met at or before p
    stop = np.flatnonzero((d.done[1:] < cut) & (need[:-1] < np.arange(1, n)))
    end = int(stop[0]) + 1 if len(stop) else n
    idx = np.flatnonzero((k[:end] < RECENT_N) | (d.done[:end] >= cut))
    codes, first = np.unique(ops[idx], return_index=True)
    return {c: idx[ops[idx] == c] for c in codes[np.argsort(first)].tolist()}


def _baselines(d: Done, names: List[str], newest: Dict[int, np.ndarray]) -> Dict[str, Tuple[float, int]]:
    """Per op, the fast quartile of the durations before its newest collectives: a slowdown that has
    lasted a while must not become "normal" while most of the history is still healthy."""
    behind = np.ones(len(d.seq), dtype=bool)
    for idx in newest.values():
        behind[idx] = False
    dur, ops = d.duration[behind], d.op[behind]
    out = {}
    for code in np.unique(ops).tolist():
        x = np.sort(dur[ops == code])
        out[names[code]] = (float(x[len(x) // 4]), len(x))
    return out


def _any_slow(log: DoneLog, st: _CommState) -> bool:
    """Whether a collective that completed since the last screen took SLOW_FACTOR x its op's
    baseline (or has an op without one): a cheap screen that spares most communicators the full test
    on most ticks (what completed since the last look, read from the log's newest entries alone)."""
    ops, durs = log.fresh(st.screened)
    st.screened = log.total
    names, base = log.names, st.base
    for code, dur in zip(ops, durs):
        b = base.get(names[code])
        if b is None or dur >= SLOW_FACTOR * b[0]:
            return True
    return False


def _slow_ops(comm: Comm, now: float, st: _CommState) -> List[Tuple[str, Done, float, str, float]]:
    """(op, its recent collectives, its baseline duration, test, level) for every op of `comm` that got slow.

    Two shapes of slow: a crawl (every collective slower: the median of the last RECENT_N is
    SLOW_FACTOR x the baseline), and a heavy tail (most collectives fine, but enough of them stall
    on retransmission timeouts that the mean and the 90th percentile over RECENT_S are)."""
    log = comm.done
    if st.log is not log:  # first look, or the group was rebuilt (its ranks restarted): its counts start
        # over; the old baselines hold until the new group has completed enough to make its own
        st.log, st.screened, st.completed_seen, st.base_at = log, 0, -1, min(st.base_at, 0)
    if comm.completed == st.completed_seen and not st.slow:
        return []
    st.completed_seen = comm.completed
    if st.base and not st.slow and comm.completed - st.base_at < st.every and not _any_slow(log, st):
        return []  # what completed since the last tick ran at its baseline: nothing to judge this tick
    d = log.window(comm.gone)
    newest = _newest(d, now)
    if comm.completed - st.base_at >= st.every or not st.base:
        st.base, st.base_at = _baselines(d, log.names, newest), comm.completed
        st.every = BASELINE_EVERY + zlib.crc32(comm.id.encode()) % BASELINE_EVERY
        _any_slow(log, st)  # what this full look saw need not be screened again
    out = []
    dur = d.duration
    for code, idx in newest.items():
        op = log.names[code]
        base, behind = st.base.get(op, (0.0, 0))
        idx = idx[::-1]
        last = idx[-RECENT_N:]
        window = idx[d.done[idx] >= now - RECENT_S]
        if len(last) < MIN_RECENT or behind < MIN_BASELINE:
            continue
        for recent, stat in ((last, "median"), (window, "tail")):
            if stat == "median":
                level = float(np.median(dur[recent]))
            elif len(recent) >= MIN_TAIL:
                x = np.sort(dur[recent])
                level = min(math.fsum(x.tolist()) / len(x), float(x[int(len(x) * 0.9)]))
            else:
                continue
            r = _take(d, recent)
            if level >= SLOW_FACTOR * base and level - base >= MIN_EXTRA_S and float(np.median(r.spread)) < level:
                out.append((op, r, base, stat, level))
    st.slow = bool(out)
    return out


def _us(x: float) -> str:
    return f"{x:.0f} us" if x < 1000 else f"{x / 1e3:.1f} ms"


def _judged_evidence(p: Pair, s: PairSummary, b: Optional[PairBaseline]) -> Dict[str, object]:
    d: Dict[str, object] = dict(s.as_dict())
    if b is not None:
        d.update(baseline=b.as_dict(), retrans_noise=b.retrans_noise(s.seconds),
                 rtt_x=round(s.srtt_median_us / b.rtt_median_us, 2) if b.rtt_median_us and s.srtt_median_us else None)
    return d


def _episode_baselines(tl: Timeline, comm: Comm, st: _CommState, members: AbstractSet[int],
                       slow: List[Tuple[str, Done, float, str, float]]) -> Dict[Pair, PairBaseline]:
    """The link baselines this slowdown of `comm` is judged against: cut where it began (the first
    enter of the earliest collective judged slow on its first slow tick), without earlier slowdowns,
    computed once per slowdown (frozen while it lasts: the fault must not become its own baseline)."""
    if st.episode is None:
        st.episode = min(float(recent.first.min()) for _, recent, _, _, _ in slow)
    key = (st.episode, members)
    if st.link_base is None or st.link_base[0] != key:
        st.link_base = (key, pair_baselines(tl, comm.job, st.episode, tuple(st.past), members))
    return st.link_base[1]


def _end_episode(st: _CommState, now: float) -> None:
    """A slowdown that has not been seen for EPISODE_GAP_S is over: its span stays out of later baselines."""
    if st.episode is not None and now - st.slow_at >= EPISODE_GAP_S:
        st.past.append((st.episode, now))
        st.episode, st.link_base = None, None


def find_comm_slow(tl: Timeline, now: float) -> List[Finding]:
    """`comm-slow` findings: arrivals line up but collectives take longer than their baseline; the
    rank pair whose transfers lag (RTT or retransmissions out of line with its own baseline and the
    other pairs', see `localise`) is named."""
    out = []
    states = _STATE.setdefault(tl, {})
    for comm in list(tl.comms.values()):
        st = states.get(comm.id)
        if st is None:
            st = states[comm.id] = _CommState()
        slow = _slow_ops(comm, now, st)
        if not slow:
            _end_episode(st, now)
            continue
        st.slow_at = now
        members = tl.expected_members(comm.id)
        baselines = _episode_baselines(tl, comm, st, members, slow)
        for op, recent, base, stat, level in sorted(slow, key=lambda s: -s[4] / max(s[2], 1e-9)):
            # Links are judged over the same span as the slow collectives, not over a fixed window
            # that would mix in the healthy seconds before the slowdown.
            since = float(recent.first.min())
            suspects, named, localised_by, win = localise(tl, comm.job, members, since, now, reference=members,
                                                          baseline_before=st.episode, exclude=tuple(st.past),
                                                          baselines=baselines)
            proxy: Dict[Pair, Dict[str, object]] = {}
            if named is None:  # no TCP link stands out (or there is none: NCCL over IB): NCCL's own progress
                psus, proxy = nccllinks.proxy_suspects(tl, comm.id, since, now, st.episode or since)
                pnamed = name_pairs(psus) if psus else None
                if pnamed is not None:
                    suspects, named, localised_by = psus, pnamed, "nccl-proxy"
            # Without a culprit, only a large slowdown that fills the whole window (the tail test)
            # counts: the last few collectives after a link recovers are slow too, and a loaded host
            # makes every collective 2-4x slower now and then, which names nothing and helps no one.
            if named is not None or (stat == "tail" and level >= UNNAMED_FACTOR * base):
                break
        else:
            continue
        ranks, link = named if named is not None else ([], None)
        first = int(np.argmin(recent.seq))
        active = [s.srtt_mean_us for s in win.values() if s.tx_bytes > 0 and s.srtt_mean_us > 0]
        summary = f"{level / base:.0f}x slower ({level * 1e3:.1f} vs {base * 1e3:.1f} ms)" if base > 0 else "slower"
        if localised_by == "nccl-proxy":
            top = tuple(link) if link is not None else suspects[0]
            pe = proxy[top]
            summary += (f", NCCL's sends {top[0]}->{top[1]} wait {pe['wait_per_step_us']} us a step on the network "
                        f"vs {pe['baseline_wait_per_step_us']} us before")
        elif named is not None:
            top = (tuple(link) if link is not None and tuple(link) in win
                   else max(suspects, key=lambda p: (win[p].retrans, win[p].srtt_mean_us)))
            t, b = win[top], baselines.get(top)
            if localised_by == "retransmissions":
                summary += f", {t.retrans} retransmissions in {t.seconds} s"
                if b is not None:
                    summary += f" (healthy: at most {b.retrans_noise(t.seconds)})"
            elif b is not None:
                summary += (f", RTT {_us(t.srtt_median_us)} vs {_us(b.rtt_median_us)} its baseline"
                            + (f", {_us(statistics.median(active))} job median" if active else ""))
        else:
            summary += "; no link stands out"
        evidence = {
            "op": op, "judged_by": stat, "summary": summary, "recent_s": round(level, 6), "baseline_s": round(base, 6),
            "slowdown": round(level / base, 2) if base > 0 else None, "recent_collectives": len(recent.seq),
            "arrival_spread_median_s": round(float(np.median(recent.spread)), 6),
            "first_slow_seq": int(recent.seq[first]), "links_since": round(since, 6),
            "links_slow_since": round(st.episode, 6) if st.episode is not None else None,
            "links_baseline_before": round(st.episode - BASELINE_GUARD_S, 6) if st.episode is not None else None,
            "localised_by": localised_by,
            "pairs": [_judged_evidence(p, win[p], baselines.get(p)) for p in suspects if p in win],
            "job_median_rtt_us": round(statistics.median(active), 1) if active else None,
            "note": None if named else ("no link stands out: no link metrics for this job, or every pair "
                                        "departed from its own baseline alike" if not suspects
                                        else "several links out of line with no rank in common"),
        }
        if proxy:
            evidence["nccl_links"] = {f"{a}->{b}": v for (a, b), v in sorted(proxy.items())}
        # seq -1: a slowdown spans many collectives; the finding's identity must not move with the window.
        out.append(Finding(kind="slow", cls="comm-slow", ranks=ranks, link=link, comm=comm.id, seq=-1, op=op,
                           onset_at=float(recent.last[first]), detected_at=now, evidence=evidence, job=comm.job))
    return out
