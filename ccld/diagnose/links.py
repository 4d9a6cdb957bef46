"""Link localisers: which rank pair's connection makes a collective crawl or hang.

Two questions, both asked of a Timeline (its `links` table joins every rank's TCP connections into
rank pairs, with per-second buckets of bytes, retransmissions, resets and RTT) at Unix time `now`:

find_link_faults: a hang (a collective nobody can finish) whose cause is a link: since the hang
  began, one rank pair's connection was reset or kept retransmitting while the others were quiet.
  Ranks of one collective stall together (each waits for the data of the one before it), so "bytes
  stopped moving" alone cannot tell the links apart; retransmissions and resets can.
find_comm_slow: collectives of one op take SLOW_FACTOR x their own baseline (all of them, or enough of
  them to weigh on the mean and 90th percentile: a lossy link's retransmission timeouts) while the ranks arrive
  together (the time is spent inside the collective, so it is communication); `localise` names the pair
  whose RTT or retransmissions left ITS OWN baseline (learned from the seconds before the slowdown
  began, frozen while it lasts) by far more than the job's other pairs left theirs; when every such
  pair starts at one rank, that rank is named instead (e.g. its NIC, or a rate limit on all its traffic).
  Nothing is judged against an absolute floor, so a link of a 20 us fabric that goes to 300 us is
  named as a 1 ms veth that goes to 4 ms is, and a pair that is always slower (a long cable) is not.
Thresholds are in the constants below, each with its reason; evidence carries the numbers.
"""
from __future__ import annotations

import collections
import statistics
import weakref
import zlib
from dataclasses import dataclass, field
from typing import AbstractSet, Deque, Dict, List, NamedTuple, Optional, Tuple

from ccld.diagnose import nccllinks, waits
from ccld.diagnose.findings import Finding
from ccld.timeline.links import PairBaseline, PairSummary
from ccld.timeline.timeline import CollView, Comm, Timeline

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
# Localising a slowdown: every pair against its own baseline, then against the other pairs.
MIN_BASELINE_S = 5         # seconds of a pair's own history before the slowdown needed to judge it: a
                           # median and a 90th percentile over fewer are noise. A pair without them is
                           # neither a suspect nor a reference for the others
RTT_FACTOR = 3.0           # a pair's RTT over the slow span / its own baseline median that makes it
                           # suspect: a link 3x slower than its normal is what makes a collective
                           # SLOW_FACTOR x slower. Relative to the pair itself, so it holds at 20 us
                           # (RoCE/IB-class TCP, datacenter Ethernet) as at 1 ms (veth on a loaded host)
RTT_OVER_SPREAD = 3.0      # ... and at least this x its healthy 90th percentile (or the job's typical spread,
                           # if wider): a pair whose RTT already wandered in its healthy seconds (veth on this
                           # 2-core box: 30-370 us from one second to the next, single seconds up to 9x its
                           # median) must leave that band by a margin, not just its median. Both are judged
                           # on the median of the span's seconds (PairSummary.srtt_median_us), so one odd
                           # second is not a fault
BASELINE_GUARD_S = RECENT_S  # a baseline ends this long before the slowdown was first seen: it may have begun
                           # up to one judging window earlier (a heavy tail of retransmission stalls builds
                           # for seconds before a test fires), and those seconds must not be "normal". A pair
                           # with under MIN_BASELINE_S seconds before that uses the seconds up to the start
MIN_RETRANS_EVENTS = 3     # retransmissions in the span below which no pair is a suspect, whatever its
                           # baseline: one loss event costs 1-2 (the segment, a tail-loss probe); three are
                           # a pattern. A count of evidence, not a rate tuned to any network
RETRANS_PRIOR = 1.0        # retransmissions added to a pair's count and to its noise level before they are
                           # divided: a pair that never retransmitted and now has 3 is 4x out of line,
                           # not infinitely, and two quiet pairs compare as 1x
RETRANS_FACTOR = 3.0       # (count + prior) / (noise + prior) that makes a pair suspect, its noise being the
                           # most it retransmitted in as many consecutive seconds of its baseline
                           # (PairBaseline.retrans_noise): a rate judged at the window's own time scale,
                           # so a box where every link bursts now and then (veth here: 0-3 a second on
                           # healthy links, 3-7 while queues drain after a fault) names none, whichever
                           # burst last, while a link that never retransmitted and now does 3/s is named
# STAND_OUT (above) also holds here: a suspect's departure from its baseline (RTT or retransmission
# ratio) is at least STAND_OUT x the typical departure of its reference pairs, so a job-wide slowdown,
# where every pair departs alike, names no link.
MAX_JUDGED_SHARE = 0.5     # more suspects than this share of the judged pairs is a job-wide change, not a
MAX_ALL_PAIRS = 8          # link, once there are more than MAX_ALL_PAIRS (a small job's one rank can touch
                           # most of its pairs): said at once, as judging each against the others would cost
                           # O(pairs^2) on every tick of a large slow job
EPISODE_GAP_S = RECENT_S   # a communicator's slowdown has ended once none of its ops was slow for this
                           # long (its judging window holds no slow collective any more); until then its
                           # links are judged against baselines cut where the slowdown began
MAX_PAST_EPISODES = 8      # ended slowdowns whose seconds stay out of later baselines: a fault must not
                           # become normal by recurring; older ones have mostly left the link series


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


def name_pairs(pairs: List[Tuple[int, int]]) -> Optional[Tuple[List[int], Optional[List[int]]]]:
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


def chain_head(pairs: List[Tuple[int, int]]) -> Optional[Tuple[int, int]]:
    """The last link of suspects that form one chain a->b, b->c, c->d (each one's receiver is the
    next one's sender): the one whose receiver no suspect waits on. Queues back up behind a slow
    link: when b->c crawls, b reads a's data late, a's sends sit in b's full receive buffer, and
    a's RTT grows too (seen on a ring of 6 ranks with one shaped link: it went to 80x its baseline
    and the two links feeding it to 14x and 20x). None unless every suspect leads to one head."""
    following = {p[0]: p for p in pairs}
    if len(following) != len(pairs):
        return None  # a sender with two suspect links: a fan-out, not a chain
    heads = [p for p in pairs if p[1] not in following]
    if len(heads) != 1:
        return None
    for p in pairs:
        for _ in range(len(pairs)):
            if p == heads[0]:
                break
            p = following[p[1]]
        else:
            return None
    return heads[0]


def find_link_faults(tl: Timeline, now: float, hangs: List[Finding]) -> List[Finding]:
    """Hang findings refined to a link: a connection reset, or one that kept retransmitting while a
    collective that needs it is open. Returns findings that replace the `hangs` they explain."""
    out = []
    for h in hangs:
        if h.kind != "hang" or h.evidence.get("reason") in ("exited", "stopped"):
            continue  # a dead or stopped process explains the hang by itself
        if h.cls == "not-entered" and all(waits.blocked(tl, h.job, r) is None for r in h.ranks):
            continue  # its culprits are in no operation (asleep, computing): no link holds them
        suspects, win = _link_suspects(tl, h.job, h.onset_at + HANG_SETTLE_S, now)
        named = name_pairs(suspects) if suspects else None
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
    episode: Optional[float] = None                            # when the slowdown being judged began (links since)
    slow_at: float = 0.0                                       # the latest tick that found an op slow
    past: Deque[Tuple[float, float]] = field(default_factory=lambda: collections.deque(maxlen=MAX_PAST_EPISODES))
    link_base: Optional[Tuple[object, Dict[Tuple[int, int], PairBaseline]]] = None  # (key, baselines) of the episode


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


Pair = Tuple[int, int]


def _reference(p: Pair, ratios: Dict[Pair, float]) -> Optional[float]:
    """The typical departure from their own baselines of the pairs that `p` is compared with: those
    that share no rank with it (a fault at one rank's NIC slows every pair through that rank, so those
    are no witnesses of the job's normal), or, when there are none (2-3 ranks), every other pair.
    None when there is no other pair: a lone link cannot be told from a job-wide slowdown."""
    disjoint = [x for q, x in ratios.items() if p[0] not in q and p[1] not in q]
    pool = disjoint or [x for q, x in ratios.items() if q != p]
    return statistics.median(pool) if pool else None


def _stand_out(cands: List[Pair], ratios: Dict[Pair, float]) -> List[Pair]:
    """The candidates whose departure is STAND_OUT x their reference pairs' (see _reference); none
    when every judged pair is a candidate, or most of a large job's pairs are (job-wide)."""
    if len(cands) >= len(ratios) or (len(ratios) > MAX_ALL_PAIRS and len(cands) > MAX_JUDGED_SHARE * len(ratios)):
        return []
    out = []
    for p in cands:
        ref = _reference(p, ratios)
        if ref is not None and ratios[p] >= STAND_OUT * max(1.0, ref):
            out.append(p)
    return out


def rtt_suspects(win: Dict[Pair, PairSummary], base: Dict[Pair, PairBaseline],
                 judge: Optional[AbstractSet[Pair]] = None) -> List[Pair]:
    """Pairs (of `judge`, default all of `win`) whose RTT over the window (the median of its seconds)
    left their own baseline: RTT_FACTOR x its median, RTT_OVER_SPREAD x its healthy 90th
    percentile (or its median times the job's typical p90/median, when that is wider: a pair with
    a short or luckily quiet history has not shown its noise yet), at least the other pairs'
    current median (a link faster than the job's typical one is not what slows it), and STAND_OUT x
    the departure of the pairs they are compared with. Only pairs that carry bulk data now
    (BULK_SHARE) and have MIN_BASELINE_S seconds of RTT history are judged or compared with."""
    most = max((s.tx_bytes for s in win.values()), default=0)
    ratios: Dict[Pair, float] = {}
    for p, s in win.items():
        b = base.get(p)
        if (s.tx_bytes >= BULK_SHARE * most > 0 and s.srtt_median_us > 0 and b is not None
                and b.rtt_seconds >= MIN_BASELINE_S and b.rtt_median_us > 0):
            ratios[p] = s.srtt_median_us / b.rtt_median_us
    if len(ratios) < 2:
        return []
    spread = {p: base[p].rtt_p90_us / base[p].rtt_median_us for p in ratios}
    typical_spread = statistics.median(spread.values())
    cands = [p for p, x in ratios.items() if (judge is None or p in judge) and x >= RTT_FACTOR
             and x >= RTT_OVER_SPREAD * max(spread[p], typical_spread)]
    if not cands:
        return []
    typical = statistics.median(win[p].srtt_median_us for p in ratios)
    return _stand_out([p for p in cands if win[p].srtt_median_us >= typical], ratios)


def retrans_suspects(win: Dict[Pair, PairSummary], base: Dict[Pair, PairBaseline],
                     judge: Optional[AbstractSet[Pair]] = None) -> List[Pair]:
    """Pairs (of `judge`, default all of `win`) that retransmitted far above their own healthy noise
    over the window: at least MIN_RETRANS_EVENTS, RETRANS_FACTOR x the most they showed in as many
    seconds of their baseline (or the typical such figure of the pairs that retransmit at all, when
    that is higher: a pair with a short or luckily quiet history has not shown its noise yet; both
    plus RETRANS_PRIOR), and
    STAND_OUT x the other pairs' departure. A fabric whose links never retransmit names a link
    with a handful; a host where every link retransmits now and then names none."""
    noise: Dict[Pair, int] = {}
    noisy: List[int] = []  # of the pairs that retransmitted at all while healthy (not, e.g., the ACK-only sides)
    for p, s in win.items():
        b = base.get(p)
        if b is not None and b.seconds >= MIN_BASELINE_S and s.seconds > 0:
            noise[p] = b.retrans_noise(s.seconds)
            if b.retrans_per_s > 0:
                noisy.append(noise[p])
    if len(noise) < 2:
        return []
    typical = statistics.median(noisy) if noisy else 0
    ratios = {p: (win[p].retrans + RETRANS_PRIOR) / (max(n, typical) + RETRANS_PRIOR) for p, n in noise.items()}
    cands = [p for p, x in ratios.items() if (judge is None or p in judge) and win[p].retrans >= MIN_RETRANS_EVENTS
             and x >= RETRANS_FACTOR]
    return _stand_out(cands, ratios) if cands else []


MAX_MEMO = 32              # baselines remembered per timeline for direct localise() callers (a p2p detector
                           # asks each tick about each slow stage link with the same start): recomputing
                           # them would cost ~0.1 ms per pair of the job per call
_MEMO: "weakref.WeakKeyDictionary[Timeline, collections.OrderedDict]" = weakref.WeakKeyDictionary()


def pair_baselines(tl: Timeline, job: str, began: float, exclude: Tuple[Tuple[float, float], ...] = (),
                   ranks: Optional[AbstractSet[int]] = None) -> Dict[Pair, PairBaseline]:
    """Each pair's baseline (tl.links.pair_baselines) for a slowdown first seen at `began`: ending
    BASELINE_GUARD_S before it, or at `began` for a pair with too little history for that.
    Remembered (the last MAX_MEMO argument sets per timeline): what ends before `began` is settled."""
    memo = _MEMO.setdefault(tl, collections.OrderedDict())
    key = (job, began, tuple(exclude), None if ranks is None else frozenset(ranks))
    got = memo.get(key)
    if got is not None:
        memo.move_to_end(key)
        return got
    out = tl.links.pair_baselines(job, began - BASELINE_GUARD_S, exclude, ranks)
    short = [p for p, b in out.items() if b.seconds < MIN_BASELINE_S or b.rtt_seconds < MIN_BASELINE_S]
    if short:
        near = tl.links.pair_baselines(job, began, exclude, ranks)
        for p in short:
            if near[p].seconds > out[p].seconds:
                out[p] = near[p]
    memo[key] = out
    while len(memo) > MAX_MEMO:
        memo.popitem(last=False)
    return out


class Localised(NamedTuple):
    suspects: List[Pair]                                # directed pairs out of line (may name nothing)
    named: Optional[Tuple[List[int], Optional[List[int]]]]  # (ranks, link) as name_pairs gives it, or None
    how: Optional[str]                                  # "retransmissions" | "rtt" | None
    window: Dict[Pair, PairSummary]                     # the pairs judged and compared, over [since, now]


def localise(tl: Timeline, job: str, members: AbstractSet[int], since: float, now: float, *,
             reference: Optional[AbstractSet[int]] = None, baseline_before: Optional[float] = None,
             exclude: Tuple[Tuple[float, float], ...] = (),
             baselines: Optional[Dict[Pair, PairBaseline]] = None) -> Localised:
    """Which link (or rank) of `job` makes transfers among `members` slow over [since, now] (Unix s).

    Returns Localised(suspects, named, how, window): the directed pairs (both ends in `members`)
    whose retransmissions or RTT left their own baseline by far more than the other pairs left
    theirs; named = (ranks, link) when they are one link (ranks = its two ends, link = [src, dst]),
    or all share one rank (ranks = [it], link None), or form one chain of links feeding each other
    (the chain's last link, listed first in suspects: see chain_head), else None; how = "retransmissions" (tried
    first: loss is the stronger sign) or "rtt"; window = PairSummary per directed pair judged or
    compared with, over the span.
      reference        ranks whose pairs the suspects are compared with (default every rank of the
                       job). find_comm_slow passes the communicator's members; a p2p comm-slow
                       detector passes members = the two stages' ranks and leaves this None, so the
                       stage link is compared with the job's other links.
      baseline_before  when the slowdown was first seen (default `since`); each pair's baseline ends
                       BASELINE_GUARD_S before it (see pair_baselines). A caller that judges one
                       slowdown over several ticks must pass the span it was FIRST seen with and keep
                       it while the slowdown lasts; else the slow seconds between that start and a
                       moving `since` seep into the baseline.
      exclude          (start, end) spans kept out of baselines: earlier slowdowns.
      baselines        precomputed pair_baselines(tl, job, baseline_before, exclude, ...) (a cache).
    Cost: O(buckets of the pairs) for the baselines (cache them across ticks), O(pairs) otherwise."""
    pool = None if reference is None else frozenset(members) | frozenset(reference)
    win = tl.links.pair_window(job, since, now + 1.0)
    if pool is not None:
        win = {p: s for p, s in win.items() if p[0] in pool and p[1] in pool}
    if baselines is None:
        baselines = pair_baselines(tl, job, since if baseline_before is None else baseline_before, exclude, pool)
    judge = {p for p in win if p[0] in members and p[1] in members}
    by_loss, by_rtt = retrans_suspects(win, baselines, judge), rtt_suspects(win, baselines, judge)
    for how, cand in (("retransmissions", by_loss), ("rtt", by_rtt)):
        got = name_pairs(sorted(cand)) if cand else None
        if got is None and len(cand) > 1:
            head = chain_head(cand)
            if head is not None:  # the others are backed up behind it: named alone, listed first
                return Localised([head] + sorted(p for p in cand if p != head), name_pairs([head]), how, win)
        if got is not None:
            return Localised(sorted(cand), got, how, win)
    return Localised(sorted(by_loss or by_rtt), None, None, win)


def _us(x: float) -> str:
    return f"{x:.0f} us" if x < 1000 else f"{x / 1e3:.1f} ms"


def _judged_evidence(p: Pair, s: PairSummary, b: Optional[PairBaseline]) -> Dict[str, object]:
    d: Dict[str, object] = dict(s.as_dict())
    if b is not None:
        d.update(baseline=b.as_dict(), retrans_noise=b.retrans_noise(s.seconds),
                 rtt_x=round(s.srtt_median_us / b.rtt_median_us, 2) if b.rtt_median_us and s.srtt_median_us else None)
    return d


def _episode_baselines(tl: Timeline, comm: Comm, st: _CommState, members: AbstractSet[int],
                       slow: List[Tuple[str, List[CollView], float, str, float]]) -> Dict[Pair, PairBaseline]:
    """The link baselines this slowdown of `comm` is judged against: cut where it began (the first
    enter of the earliest collective judged slow on its first slow tick), without earlier slowdowns,
    computed once per slowdown (frozen while it lasts: the fault must not become its own baseline)."""
    if st.episode is None:
        st.episode = min(_span(st, v)[1] for _, recent, _, _, _ in slow for v in recent)
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
            since = min(_span(st, v)[1] for v in recent)
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
        first = min(recent, key=lambda v: v.seq)
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
            "slowdown": round(level / base, 2) if base > 0 else None, "recent_collectives": len(recent),
            "arrival_spread_median_s": round(statistics.median(_spread(st, v) for v in recent), 6),
            "first_slow_seq": first.seq, "links_since": round(since, 6),
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
                           onset_at=_span(st, first)[2], detected_at=now, evidence=evidence, job=comm.job))
    return out
