"""Link localisers: which rank pair's connection (or which rank's links) makes transfers slow.

`localise` names, among a job's rank pairs (the Timeline's `links` table joins every rank's TCP
connections into rank pairs, with per-second buckets of bytes, retransmissions, resets and RTT), the
pair whose RTT or retransmissions left ITS OWN baseline (`pair_baselines`: learned from the seconds
before the slowdown began, frozen while it lasts) by far more than the job's other pairs left theirs;
when every such pair starts at one rank, that rank is named instead (e.g. its NIC, or a rate limit on
all its traffic), and when they form one chain of links feeding each other, the chain's last link
(`chain_head`). Nothing is judged against an absolute floor, so a link of a 20 us fabric that goes to
300 us is named as a 1 ms veth that goes to 4 ms is, and a pair that is always slower (a long cable)
is not. `name_pairs` turns suspect directed pairs into (ranks, link) for every localiser: this one,
linkfaults.py (a hang's link) and nccllinks.py (NCCL's own progress). Asked by commslow.py (slow
collectives) and p2pslow.py (slow p2p streams). Times: Unix seconds.
Thresholds are in the constants below, each with its reason; evidence carries the numbers.
"""
from __future__ import annotations

import collections
import statistics
import weakref
from typing import AbstractSet, Dict, List, NamedTuple, Optional, Tuple

from ccld.timeline.links import PairBaseline, PairSummary
from ccld.timeline.timeline import Timeline

STAND_OUT = 3.0            # the suspect pair has at least this many times what any other pair has (a hang's
                           # retransmissions and resets, linkfaults.py; a slowdown's departures, below)
# Localising a slowdown: every pair against its own baseline, then against the other pairs.
BULK_SHARE = 0.1           # pairs carrying at least this share of the busiest pair's bytes are judged
                           # on RTT; a pair that only sends a few control bytes sees the receiver's
                           # delayed ACKs (up to 40 ms) in its RTT, which says nothing about the link
MIN_BASELINE_S = 5         # seconds of a pair's own history before the slowdown needed to judge it: a
                           # median and a 90th percentile over fewer are noise. A pair without them is
                           # neither a suspect nor a reference for the others
RTT_FACTOR = 3.0           # a pair's RTT over the slow span / its own baseline median that makes it
                           # suspect: a link 3x slower than its normal is what makes a collective
                           # SLOW_FACTOR x slower (commslow.py). Relative to the pair itself, so it holds at
                           # 20 us (RoCE/IB-class TCP, datacenter Ethernet) as at 1 ms (veth on a loaded host)
RTT_OVER_SPREAD = 3.0      # ... and at least this x its healthy 90th percentile (or the job's typical spread,
                           # if wider): a pair whose RTT already wandered in its healthy seconds (veth on this
                           # 2-core box: 30-370 us from one second to the next, single seconds up to 9x its
                           # median) must leave that band by a margin, not just its median. Both are judged
                           # on the median of the span's seconds (PairSummary.srtt_median_us), so one odd
                           # second is not a fault
BASELINE_GUARD_S = 10.0    # a baseline ends this long before the slowdown was first seen: it may have begun
                           # up to one judging window earlier (RECENT_S of commslow.py and p2pslow.py: 10 s;
                           # a heavy tail of retransmission stalls builds for seconds before a test fires),
                           # and those seconds must not be "normal". A pair with under MIN_BASELINE_S
                           # seconds before that uses the seconds up to the start
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
# STAND_OUT (above), for a slowdown: a suspect's departure from its baseline (RTT or retransmission
# ratio) is at least STAND_OUT x the typical departure of its reference pairs, so a job-wide slowdown,
# where every pair departs alike, names no link.
MAX_JUDGED_SHARE = 0.5     # more suspects than this share of the judged pairs is a job-wide change, not a
MAX_ALL_PAIRS = 8          # link, once there are more than MAX_ALL_PAIRS (a small job's one rank can touch
                           # most of its pairs): said at once, as judging each against the others would cost
                           # O(pairs^2) on every tick of a large slow job


Pair = Tuple[int, int]


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
                       job). commslow.find_comm_slow passes the communicator's members; a p2p comm-slow
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
