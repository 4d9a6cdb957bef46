"""Link localisers: which rank pair's connection makes a collective crawl or hang.

Two questions, both asked of a Timeline (its `links` table joins every rank's TCP connections into
rank pairs, with per-second buckets of bytes, retransmissions, resets and RTT) at Unix time `now`:

find_link_faults: a hang (a collective nobody can finish) whose cause is a link: since the hang
  began, one rank pair's connection was reset or kept retransmitting while the others were quiet.
  Ranks of one collective stall together (each waits for the data of the one before it), so "bytes
  stopped moving" alone cannot tell the links apart; retransmissions and resets can.
find_comm_slow: collectives of one op take SLOW_FACTOR x their own baseline (all of them, or enough of
  them to weigh on the mean and 90th percentile: a lossy link's retransmission timeouts) while the ranks arrive
  together (the time is spent inside the collective, so it is communication); the pair whose RTT or
  retransmissions are out of line with the job's other pairs is named; when every out-of-line pair
  starts at one rank, that rank is named instead (e.g. its NIC, or a rate limit on all its traffic).
Thresholds are in the constants below, each with its reason; evidence carries the numbers.
"""
from __future__ import annotations

import statistics
import weakref
import zlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from ccld.collector.links import PairSummary
from ccld.collector.timeline import CollView, Comm, Timeline
from ccld.diagnose.findings import Finding

MIN_LINK_RETRANS = 2       # retransmissions since a hang began that make a link suspect (RTOs back off:
                           # 0.2, 0.4, 0.8 s ... so a dead link shows 3-5 within the 5 s hang floor)
HANG_SETTLE_S = 1.0        # retransmissions are counted from this long after a hang began: data in flight
                           # when it began is acked (or lost) by then, and on a busy 2-core box every link
                           # retransmits now and then; after it, only a link that lost its peer keeps trying
STAND_OUT = 3.0            # the suspect pair has at least this many times what any other pair has
RECENT_S = 10.0            # the window a slowdown is judged over ...
RECENT_N = 10              # ... or its last RECENT_N collectives, if fewer: a 30x slower job completes a
                           # handful in 10 s, and a median over mostly pre-fault ones would hide it
MIN_RECENT = 5             # completed collectives of one op needed in that window
BASELINE_EVERY = 64        # completions of a communicator between two recomputations of its baselines, plus
                           # 0-63 more per communicator (from its id): thousands of node groups that complete
                           # in step must not all recompute in one tick
MIN_TAIL = 20              # ... and for judging its tail (mean and 90th percentile over RECENT_S)
BULK_SHARE = 0.1           # pairs carrying at least this share of the busiest pair's bytes are judged
                           # on RTT; a pair that only sends a few control bytes sees the receiver's
                           # delayed ACKs (up to 40 ms) in its RTT, which says nothing about the link
MIN_BASELINE = 20          # ... and before it, to know what normal is
SLOW_FACTOR = 3.0          # recent median duration / baseline duration that counts as slow
UNNAMED_FACTOR = 10.0      # ... and when no link or rank stands out, this much slower
MIN_EXTRA_S = 0.010        # and at least this much slower in absolute terms (sub-ms noise is not a finding)
RTT_OUTLIER = 4.0          # a pair's mean RTT over the window / the median of the job's pairs
MIN_RTT_US = 1000          # ... and at least 1 ms: loopback and veth RTTs of 20-60 us vary by 2-3x
MIN_SLOW_RETRANS = 20      # retransmissions in the window that mark a lossy pair: a busy 2-core box shows
                           # 5-10 per link per 10 s on healthy links; 5 % loss gives hundreds


def _pair_evidence(s: Optional[PairSummary]) -> Optional[Dict[str, float]]:
    return None if s is None else s.as_dict()


def _link_suspects(tl: Timeline, job: str, t_from: float, now: float) -> Tuple[List[Tuple[int, int]], Dict]:
    """Directed pairs with resets, or retransmissions that stand out, in [t_from, now]."""
    win = tl.links.pair_window(job, t_from, now + 1.0)
    if not win:
        return [], win
    score = {p: s.retrans + 10 * s.resets for p, s in win.items()}
    best = max(score.values())
    if best < MIN_LINK_RETRANS and not any(s.resets for s in win.values()):
        return [], win
    suspects = [p for p, v in score.items() if v >= max(MIN_LINK_RETRANS, best / STAND_OUT) or win[p].resets]
    others = [v for p, v in score.items() if p not in suspects]
    if others and max(others) * STAND_OUT > min(score[p] for p in suspects):
        return [], win  # retransmissions everywhere: a congested host, not one link
    return suspects, win


def _name(pairs: List[Tuple[int, int]]) -> Optional[Tuple[List[int], Optional[List[int]]]]:
    """(ranks, link) for a set of suspect directed pairs: one unordered pair -> that link; several
    pairs sharing one rank -> that rank; None when they share none (a host-wide problem, no culprit)."""
    unordered = {tuple(sorted(p)) for p in pairs}
    if len(unordered) == 1:
        a, b = next(iter(unordered))
        src, dst = pairs[0]
        return [a, b], [src, dst]
    common = set(pairs[0]).intersection(*[set(p) for p in pairs[1:]])
    if len(common) == 1:
        return sorted(common), None
    return None


def find_link_faults(tl: Timeline, now: float, hangs: List[Finding]) -> List[Finding]:
    """Hang findings refined to a link: a connection reset, or one that kept retransmitting while a
    collective that needs it is open. Returns findings that replace the `hangs` they explain."""
    out = []
    for h in hangs:
        if h.kind != "hang" or h.evidence.get("reason") in ("exited", "stopped"):
            continue  # a dead or stopped process explains the hang by itself
        suspects, win = _link_suspects(tl, h.job, h.onset_at + HANG_SETTLE_S, now)
        named = _name(suspects) if suspects else None
        if named is None:
            continue
        ranks, link = named
        worst = max(suspects, key=lambda p: (win[p].resets, win[p].retrans))
        w = win[worst]
        what = (f"was reset {w.resets} time(s)" if w.resets else f"retransmitted {w.retrans} times")
        summary = (f"link {worst[0]}->{worst[1]} {what} since the hang began; other links: at most "
                   f"{max((s.retrans for p, s in win.items() if p not in suspects), default=0)}")
        evidence = {"reason": "link", "summary": summary, "hang_reason": h.evidence.get("reason"),
                    "waited_s": h.evidence.get("waited_s"), "threshold_s": h.evidence.get("threshold_s"),
                    "pairs": [_pair_evidence(win[p]) for p in sorted(suspects)],
                    "others_max_retrans": max((s.retrans for p, s in win.items() if p not in suspects), default=0),
                    "connections": _conn_evidence(tl, h.job, ranks),
                    "hang_ranks": h.ranks}
        out.append(Finding(kind="hang", cls="fault", ranks=ranks, link=link, comm=h.comm, seq=h.seq, op=h.op,
                           onset_at=h.onset_at, detected_at=now, evidence=evidence, job=h.job))
    return out


def _conn_evidence(tl: Timeline, job: str, ranks: List[int]) -> List[Dict[str, object]]:
    if len(ranks) != 2:
        return []
    return [{"rank": c.rank, "local": f"{c.saddr}:{c.sport}", "remote": f"{c.daddr}:{c.dport}",
             "retrans": c.retrans, "resets": c.resets, "srtt_us": c.srtt_us, "state": c.state,
             "last_progress_at": c.progress_at} for c in tl.links.conns_between(job, ranks[0], ranks[1])]


MAX_SCREEN = 64           # collectives screened per communicator per tick (a burst is caught over ticks)


@dataclass
class _CommState:
    """What find_comm_slow remembers about one communicator between ticks (a tick must stay cheap at
    thousands of communicators: one that completed nothing new and was fine is not looked at again,
    and a collective's duration is worked out once, not once per tick)."""
    completed_seen: int = -1
    slow: bool = False
    base_at: int = -(1 << 30)                                  # comm.completed when baselines were made
    base: Dict[str, Tuple[float, int]] = field(default_factory=dict)  # op -> (baseline s, collectives behind it)
    screened: int = -1                                         # every completed seq up to this was screened
    every: int = BASELINE_EVERY                                # this communicator's recomputation period
    spans: Dict[int, Tuple[float, float, float]] = field(default_factory=dict)  # seq -> (completed_at, first, last enter)


_STATE: "weakref.WeakKeyDictionary[Timeline, Dict[str, _CommState]]" = weakref.WeakKeyDictionary()


def _span(st: _CommState, v: CollView) -> Tuple[float, float, float]:
    """(completed_at, first enter, last enter) of a completed collective, cached: O(ranks) once."""
    got = st.spans.get(v.seq)
    if got is None or got[0] != v.completed_at:  # not seen, or a rebuilt group reused the seq
        enters = v.enter.values()
        got = st.spans[v.seq] = (v.completed_at, min(enters), max(enters))
    return got


def _duration(st: _CommState, v: CollView) -> float:
    done, _, last = _span(st, v)
    return max(0.0, done - last)


def _spread(st: _CommState, v: CollView) -> float:
    _, first, last = _span(st, v)
    return last - first


def _prune(st: _CommState, comm: Comm) -> None:
    if len(st.spans) > 2 * len(comm.colls) + 64:
        st.spans = {s: x for s, x in st.spans.items() if s in comm.colls}


def _newest(comm: Comm, now: float) -> Dict[str, List[CollView]]:
    """Per op, the completed collectives of the last RECENT_S, or the last RECENT_N if more, newest first."""
    out: Dict[str, List[CollView]] = {}
    for v in reversed(comm.colls.values()):
        if v.completed_at is None or not v.enter:
            continue
        if v.completed_at < now - RECENT_S and out and all(len(x) >= RECENT_N for x in out.values()):
            break
        got = out.setdefault(v.op, [])
        if len(got) < RECENT_N or v.completed_at >= now - RECENT_S:
            got.append(v)
    return out


def _baselines(comm: Comm, newest: Dict[str, List[CollView]], st: _CommState) -> Dict[str, Tuple[float, int]]:
    """Per op, the fast quartile of the durations before its newest collectives: a slowdown that has
    lasted a while must not become "normal" while most of the history is still healthy."""
    skip = {id(v) for vs in newest.values() for v in vs}
    durs: Dict[str, List[float]] = {}
    for v in comm.colls.values():
        if v.completed_at is not None and v.enter and id(v) not in skip:
            durs.setdefault(v.op, []).append(_duration(st, v))
    out = {}
    for op, d in durs.items():
        d.sort()
        out[op] = (d[len(d) // 4], len(d))
    return out


def _any_slow(comm: Comm, st: _CommState) -> bool:
    """Whether a collective that completed since the last screen took SLOW_FACTOR x its op's
    baseline: a cheap screen that spares most communicators the full test on most ticks (each
    collective is screened once). A heavy tail whose stalls all fell before them is caught a tick or
    two later."""
    top, lowest_open, found, n = st.screened, None, False, 0
    for v in reversed(comm.colls.values()):
        if v.seq <= st.screened or n >= MAX_SCREEN:
            break
        n += 1
        top = max(top, v.seq)
        if v.completed_at is None or not v.enter:
            lowest_open = v.seq  # screened once it completes
            continue
        base = st.base.get(v.op)
        if base is None or _duration(st, v) >= SLOW_FACTOR * base[0]:
            found = True
    st.screened = top if lowest_open is None else max(st.screened, lowest_open - 1)
    return found


def _slow_ops(comm: Comm, now: float, st: _CommState) -> List[Tuple[str, List[CollView], float, str, float]]:
    """(op, its recent collectives, its baseline duration, test, level) for every op of `comm` that got slow.

    Two shapes of slow: a crawl (every collective slower: the median of the last RECENT_N is
    SLOW_FACTOR x the baseline), and a heavy tail (most collectives fine, but enough of them stall
    on retransmission timeouts that the mean and the 90th percentile over RECENT_S are)."""
    if comm.completed == st.completed_seen and not st.slow:
        return []
    st.completed_seen = comm.completed
    if st.base and not st.slow and comm.completed - st.base_at < st.every and not _any_slow(comm, st):
        return []  # what completed since the last tick ran at its baseline: nothing to judge this tick
    _prune(st, comm)
    newest = _newest(comm, now)
    if comm.completed - st.base_at >= st.every or not st.base:
        st.base, st.base_at = _baselines(comm, newest, st), comm.completed
        st.every = BASELINE_EVERY + zlib.crc32(comm.id.encode()) % BASELINE_EVERY
        _any_slow(comm, st)  # what this full look saw need not be screened again
    out = []
    for op, views in newest.items():
        base, behind = st.base.get(op, (0.0, 0))
        views = views[::-1]
        last = views[-RECENT_N:]
        window = [v for v in views if v.completed_at >= now - RECENT_S]
        if len(last) < MIN_RECENT or behind < MIN_BASELINE:
            continue
        for recent, stat in ((last, "median"), (window, "tail")):
            if stat == "median":
                level = statistics.median(_duration(st, v) for v in recent)
            elif len(recent) >= MIN_TAIL:
                d = sorted(_duration(st, v) for v in recent)
                level = min(statistics.mean(d), d[int(len(d) * 0.9)])
            else:
                continue
            spread = statistics.median(_spread(st, v) for v in recent)
            if level >= SLOW_FACTOR * base and level - base >= MIN_EXTRA_S and spread < level:
                out.append((op, recent, base, stat, level))
    st.slow = bool(out)
    return out


def _rtt_suspects(win: Dict[Tuple[int, int], PairSummary]) -> List[Tuple[int, int]]:
    most = max((s.tx_bytes for s in win.values()), default=0)
    active = {p: s for p, s in win.items() if s.tx_bytes >= BULK_SHARE * most > 0 and s.srtt_mean_us > 0}
    if len(active) < 2:
        return []
    med = statistics.median(s.srtt_mean_us for s in active.values())
    slow = [p for p, s in active.items() if s.srtt_mean_us >= max(RTT_OUTLIER * med, MIN_RTT_US)]
    return slow if len(slow) < len(active) else []


def _retrans_suspects(win: Dict[Tuple[int, int], PairSummary]) -> List[Tuple[int, int]]:
    if not win:
        return []
    best = max(s.retrans for s in win.values())
    if best < MIN_SLOW_RETRANS:
        return []
    sus = [p for p, s in win.items() if s.retrans * STAND_OUT >= best]
    rest = [s.retrans for p, s in win.items() if p not in sus]
    return sus if not rest or max(rest) * STAND_OUT <= best else []


def find_comm_slow(tl: Timeline, now: float) -> List[Finding]:
    """`comm-slow` findings: arrivals line up but collectives take longer than their baseline; the
    rank pair whose transfers lag (RTT or retransmissions out of line) is named."""
    out = []
    states = _STATE.setdefault(tl, {})
    for comm in list(tl.comms.values()):
        st = states.get(comm.id)
        if st is None:
            st = states[comm.id] = _CommState()
        slow = _slow_ops(comm, now, st)
        if not slow:
            continue
        for op, recent, base, stat, level in sorted(slow, key=lambda s: -s[4] / max(s[2], 1e-9)):
            # Links are judged over the same span as the slow collectives, not over a fixed window
            # that would mix in the healthy seconds before the slowdown.
            since = min(_span(st, v)[1] for v in recent)
            win = tl.links.pair_window(comm.job, since, now + 1.0)
            members = tl.expected_members(comm.id)
            win = {p: s for p, s in win.items() if p[0] in members and p[1] in members}
            by_rtt, by_loss = _rtt_suspects(win), _retrans_suspects(win)
            suspects, named, localised_by = by_loss or by_rtt, None, None
            for how, cand in (("retransmissions", by_loss), ("rtt", by_rtt)):
                got = _name(sorted(cand)) if cand else None
                if got is not None:
                    suspects, named, localised_by = cand, got, how
                    break
            # Without a culprit, only a large slowdown that fills the whole window (the tail test)
            # counts: the last few collectives after a link recovers are slow too, and a loaded host
            # makes every collective 2-4x slower now and then, which names nothing and helps no one.
            if named is not None or (stat == "tail" and level >= UNNAMED_FACTOR * base):
                break
        else:
            continue
        ranks, link = named if named is not None else ([], None)
        first = min(recent, key=lambda v: v.seq)
        active = [s.srtt_mean_us for s in win.values() if s.tx_bytes > 0 and s.srtt_mean_us > 0]
        summary = f"{level / base:.0f}x slower ({level * 1e3:.1f} vs {base * 1e3:.1f} ms)" if base > 0 else "slower"
        if named is not None:
            top = max(suspects, key=lambda p: (win[p].retrans, win[p].srtt_mean_us))
            t = win[top]
            summary += (f", {t.retrans} retransmissions" if localised_by == "retransmissions"
                        else f", RTT {t.srtt_mean_us / 1e3:.1f} vs {statistics.median(active) / 1e3:.1f} ms median"
                        if active else "")
        else:
            summary += "; no link stands out"
        evidence = {
            "op": op, "judged_by": stat, "summary": summary, "recent_s": round(level, 6), "baseline_s": round(base, 6),
            "slowdown": round(level / base, 2) if base > 0 else None, "recent_collectives": len(recent),
            "arrival_spread_median_s": round(statistics.median(_spread(st, v) for v in recent), 6),
            "first_slow_seq": first.seq, "links_since": round(since, 6),
            "localised_by": localised_by,
            "pairs": [win[p].as_dict() for p in sorted(suspects)],
            "job_median_rtt_us": round(statistics.median(active), 1) if active else None,
            "note": None if named else ("no link stands out: no link metrics for this job, or all pairs alike"
                                        if not suspects else "several links out of line with no rank in common"),
        }
        # seq -1: a slowdown spans many collectives; the finding's identity must not move with the window.
        out.append(Finding(kind="slow", cls="comm-slow", ranks=ranks, link=link, comm=comm.id, seq=-1, op=op,
                           onset_at=_span(st, first)[2], detected_at=now, evidence=evidence, job=comm.job))
    return out
