"""Lateness step after step, judged once for every detector that has ranks which should be level.

An *instance* is one occasion where the ranks should be level: a collective (each rank's value is
when it entered: slow.py) or the n-th run of one compute op (each rank's value is how long it took:
compute.py). `summarize_values` reduces one to what lateness needs: the reference is the median
value, a rank's lag its value minus that, the noise the median absolute lag (MAD); ranks well above
it are kept (`late`). Two more readings, for what one median misses:
  together  with MIN_SPLIT ranks or more, the largest gap in the upper half of the sorted values, when
            it splits off a cluster of two ranks or more (a pipeline stage, a node) far above both
            clusters' own noise: those ranks and their lag from the early cluster's median. With half
            the ranks late, the median sits between the clusters and nobody is "late" by it.
  worst     the last rank and its lag: what the others waited for, whoever it was.
`judge` applies the rules of slow.py's docstring to a window of summaries: an *episode* per rank and
op, the longest newest run of at least MIN_COLLS instances over MIN_EPISODE_S in which its lag
exceeds max(LAG_FLOOR_S, NOISE_Z x sigma) in LATE_FRACTION of them, spread over SPAN_FRACTION of the
run, costing the others MIN_COST of its time. Ranks come from `late` first; when none qualifies, from
`together`, against the clusters' own noise: two ranks or more (one late rank is the median's to
name), at most half of them (when most are late, the early ones are simply fast), and not where the
ranks pass work along a pipeline (the caller says so: there every stage after a slow one arrives
late with it; busy.py and compute.py name the stage). Ranks named are *together* when their late
instances coincide and their lags are alike (TOGETHER_SHARE, TOGETHER_LAG). When nobody is named,
the waiting is *spread* if in most instances the last rank is SPREAD_LAG_S behind the median, that
costs SPREAD_COST of the time, and no rank is the last in LATE_FRACTION of them: a job slowed by
whoever is slow this step, with no culprit to name. (The job's own noise is no threshold here:
noise that costs 10 % of the time is the news.)
Times: seconds (Unix for enter times; durations for compute). Cost: summaries are made once per
instance (small groups in plain Python, larger ones with numpy); a judgement is linear in the window.
"""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import numpy as np

from ccld.diagnose.findings import Finding

MIN_COLLS = 20           # instances of one op in the window before that op is judged
LATE_FRACTION = 0.5      # late in at least half of them: "step after step"
MIN_LATE = 10            # ... and at least this many times
MIN_EPISODE_S = 5.0      # ... over at least 5 s: "step after step", not a one-second burst
SPAN_FRACTION = 0.5      # the late instances cover at least half of the episode: not one burst
LAG_FLOOR_S = 0.005      # 5 ms: below this, arrival order on a busy host is scheduling noise
NOISE_Z = 4.0            # ... or this many robust sigmas of the job's own noise
MIN_COST = 0.05          # the others waited for it at least 5 % of the episode's time
PRE_LAG_S = 0.001        # lags kept per summary: above 1 ms and 3 MADs of that instance
MAX_LATE_PER_COLL = 32   # "one or a few ranks": more late ranks than this in one instance are not kept
SMALL_GROUP = 64         # instances of up to this many ranks are summarised without numpy
MIN_SPLIT = 4            # ranks an instance needs before a late cluster is split off (two of four)
MAX_TOGETHER_SHARE = 0.5  # a late cluster is at most half the ranks
TOGETHER_SHARE = 0.8     # named ranks are late together: each shares 80 % of the late instances of the first
TOGETHER_LAG = 0.2       # ... and its median lag is within 20 % of the first's (or LAG_FLOOR_S)
SPREAD_LAG_S = 0.010     # spread: in most instances the last rank is 10 ms behind the median at least ...
SPREAD_COST = 0.10       # ... and the others wait for whoever it is 10 % of the time (twice MIN_COST)
MAD_SIGMA = 1.4826       # a normal distribution's sigma per MAD


@dataclass(frozen=True)
class CollSummary:
    """One instance (a collective, a compute op's n-th run), reduced to what lateness needs."""
    seq: int                             # the collective's seq; the compute op's run number
    op: str
    first_enter: float                   # its earliest start, s
    completed_at: float                  # its end, s
    mad: float                           # median absolute lag of its ranks, s
    late: Tuple[Tuple[int, float], ...]  # (rank, lag s) of ranks well above the median
    split_mad: float = 0.0               # the noise without the late cluster (the clusters' larger MAD); else mad
    together: Tuple[Tuple[int, float], ...] = ()  # a late cluster: (rank, lag s from the early cluster's median)
    worst: Tuple[int, float] = (-1, 0.0)  # the last rank and its lag (rank -1: within PRE_LAG_S, not told)


@dataclass
class Judged:
    """What `judge` concluded over a window: the ranks late step after step (rank -> episode numbers
    and op), the noise and threshold that judged them, whether they were late together, and when
    nobody was named, the spread of the waiting (or None)."""
    slow: Dict[int, Dict[str, Any]]
    sigma: float
    threshold: float
    grouped: bool = False                # named from late clusters (the median sat between them)
    together: bool = False
    spread: Optional[Dict[str, Any]] = None


def level_summary(seq: int, op: str, n: int, lo: float, hi: float, completed_at: float,
                  first: Optional[float] = None) -> Optional[CollSummary]:
    """The summary of a small instance (2..SMALL_GROUP values, lo..hi) whose values all lie within
    PRE_LAG_S (most collectives), from those three numbers alone; None for any other. Nobody is late,
    and half the spread bounds the MAD (its noise weight is below LAG_FLOOR_S anyway)."""
    if not (2 <= n <= SMALL_GROUP and hi - lo <= PRE_LAG_S):
        return None
    return CollSummary(seq, op, lo if first is None else first, completed_at, (hi - lo) / 2, (), (hi - lo) / 2, (),
                       (-1, hi - lo))


def summarize_values(seq: int, op: str, values: Dict[int, float], completed_at: float,
              first: Optional[float] = None) -> Optional[CollSummary]:
    """The summary of one instance: `values` rank -> enter time or duration (s); `first` its earliest
    start (default: the smallest value, as for enter times)."""
    n = len(values)
    if n < 2:
        return None
    if n <= SMALL_GROUP:  # numpy's per-call overhead dominates below a few dozen values
        level = level_summary(seq, op, n, min(values.values()), max(values.values()), completed_at, first)
        if level is not None:
            return level
        order = sorted(values.items(), key=lambda p: p[1])
        times = [x for _, x in order]
        ref = times[0] if n == 2 else _mid(times)
        mad = 0.0 if n == 2 else _mid(sorted(abs(x - ref) for x in times))
        cut = max(PRE_LAG_S, 3 * MAD_SIGMA * mad)
        late = tuple(sorted(((r, x - ref) for r, x in values.items() if x - ref > cut),
                            key=lambda p: p[1])[-MAX_LATE_PER_COLL:])
        split_mad, together = _split(order, mad)
        return CollSummary(seq, op, times[0] if first is None else first, completed_at, mad, late, split_mad,
                           together, (order[-1][0], times[-1] - ref))
    ranks = list(values)
    arr = np.fromiter(values.values(), dtype=float, count=n)
    ref = float(np.median(arr))
    lag = arr - ref
    mad = float(np.median(np.abs(lag)))
    cut = max(PRE_LAG_S, 3 * MAD_SIGMA * mad)
    idx = np.flatnonzero(lag > cut)
    if len(idx) > MAX_LATE_PER_COLL:
        idx = idx[np.argsort(lag[idx])[-MAX_LATE_PER_COLL:]]
    late = tuple((ranks[i], float(lag[i])) for i in idx)
    top = int(np.argmax(lag))  # a cluster of up to MAX_LATE_PER_COLL in a large group does not move its median
    return CollSummary(seq, op, float(arr.min()) if first is None else first, completed_at, mad, late, mad, (),
                       (ranks[top], float(lag[top])))


def _split(order: List[Tuple[int, float]], mad: float) -> Tuple[float, Tuple[Tuple[int, float], ...]]:
    """(noise without it, the late cluster) of one instance's (rank, value) sorted by value: the
    largest gap that leaves 2..n/2 ranks above it, when it is far above both sides' MADs; else (mad, ())."""
    n = len(order)
    if n < MIN_SPLIT:
        return mad, ()
    k = max(range(2, min(n // 2, MAX_LATE_PER_COLL) + 1), key=lambda k: order[n - k][1] - order[n - k - 1][1])
    gap = order[n - k][1] - order[n - k - 1][1]
    early, late = [x for _, x in order[:n - k]], [x for _, x in order[n - k:]]
    ref, mid = _mid(early), _mid(late)
    noise = max(_mid(sorted(abs(x - ref) for x in early)), _mid(sorted(abs(x - mid) for x in late)))
    if gap <= max(PRE_LAG_S, 3 * MAD_SIGMA * noise):
        return mad, ()
    return noise, tuple((r, x - ref) for r, x in order[n - k:])


def _mid(xs: List[float]) -> float:
    """The median of a sorted list."""
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def bucket(x: float) -> str:
    """A lag on a 1-1.5-2-3-5-7 scale, for the summary line: it changes only when the lag really moves."""
    if x <= 0:
        return "0 ms"
    e = math.floor(math.log10(x))
    m = x / 10 ** e
    v = min((1, 1.5, 2, 3, 5, 7, 10), key=lambda c: abs(math.log(m / c))) * 10 ** e
    return f"~{v * 1000:g} ms" if v < 1 else f"~{v:g} s"


def notable(s: CollSummary) -> bool:
    """Someone in `s` lagged by more than LAG_FLOOR_S (by the median or by its cluster): worth a judgement."""
    return s.worst[1] > LAG_FLOOR_S or any(lag > LAG_FLOOR_S for _, lag in s.together)


def ranks_words(ranks: Iterable[int], most: int = 4) -> str:
    """"rank 2", "ranks 2, 3", "ranks 2, 3, 5, 7 (+4)": culprits in a summary line."""
    rs = list(ranks)
    shown = ", ".join(map(str, rs[:most])) + (f" (+{len(rs) - most})" if len(rs) > most else "")
    return f"rank{'s' * (len(rs) > 1)} {shown}"


def judge(window: List[CollSummary], members: int, clusters: bool = True) -> Judged:
    """The ranks of `members` late step after step in `window` (summaries in time order per op);
    clusters=False: not from late clusters (a pipeline's downstream stages arrive late together)."""
    sigma = MAD_SIGMA * float(np.median([s.mad for s in window]))
    threshold = max(LAG_FLOOR_S, NOISE_Z * sigma)
    by_op: Dict[str, List[CollSummary]] = collections.defaultdict(list)
    for s in window:
        by_op[s.op].append(s)
    slow, lags = _named(by_op, threshold, lambda s: s.late)
    out = Judged(slow, sigma, threshold)
    if not slow and clusters and members >= MIN_SPLIT:
        g_sigma = MAD_SIGMA * float(np.median([s.split_mad for s in window]))
        g_threshold = max(LAG_FLOOR_S, NOISE_Z * g_sigma)
        slow, lags = _named(by_op, g_threshold, lambda s: s.together)
        if 2 <= len(slow) <= int(MAX_TOGETHER_SHARE * members):  # a cluster: one late rank is the median's
            out = Judged(slow, g_sigma, g_threshold, grouped=True)
    if out.slow:
        out.together = _together(out.slow, lags)
    else:
        out.spread = _spread(window)
    return out


def _named(by_op: Dict[str, List[CollSummary]], threshold: float,
           pick: Callable[[CollSummary], Tuple[Tuple[int, float], ...]]
           ) -> Tuple[Dict[int, Dict[str, Any]], Dict[int, Dict[int, float]]]:
    """(rank -> its episode numbers and op, rank -> that op's late instances by index -> lag) of the
    ranks with an episode, lags read by `pick`; per rank, the op that cost the others most."""
    slow: Dict[int, Dict[str, Any]] = {}
    late_at: Dict[int, Dict[int, float]] = {}
    for op, colls in by_op.items():
        if len(colls) < MIN_COLLS:
            continue
        where = {s.seq: i for i, s in enumerate(colls)}
        lags: Dict[int, Dict[int, float]] = collections.defaultdict(dict)  # rank -> index -> lag
        for s in colls:
            for r, lag in pick(s):
                if lag > threshold:
                    lags[r][where[s.seq]] = lag
        for r, got in lags.items():
            found = episode(colls, got)
            if found is None or (r in slow and slow[r]["waited_fraction"] >= found["waited_fraction"]):
                continue
            slow[r] = dict(found, op=op)
            late_at[r] = got
    return slow, late_at


def episode(colls: List[CollSummary], late: Dict[int, float]) -> Optional[Dict[str, Any]]:
    """The longest newest run of `colls` in which a rank late at indexes `late` (-> lag s) is
    late step after step (see the module's rules), as evidence numbers; None when there is none."""
    if len(late) < MIN_LATE:
        return None
    n_all = len(colls)
    best = None
    count = 0
    for n in range(1, n_all + 1):  # suffixes of growing length, newest first
        if n_all - n in late:
            count += 1
        if n >= MIN_COLLS and count >= max(MIN_LATE, LATE_FRACTION * n):
            best = n
    if best is None:
        return None
    start = n_all - best
    span = colls[-1].completed_at - colls[start].first_enter
    if span < MIN_EPISODE_S:
        return None
    idx = sorted(i for i in late if i >= start)
    if colls[idx[-1]].first_enter - colls[idx[0]].first_enter < SPAN_FRACTION * span:
        return None
    values = sorted(late[i] for i in idx)
    cost = sum(values) / span
    if cost < MIN_COST:
        return None
    return {"late_in": len(idx), "of": best, "episode_s": round(span, 3), "waited_fraction": round(cost, 3),
            "median_lag_s": round(values[len(values) // 2], 6),
            "p90_lag_s": round(values[min(len(values) - 1, int(0.9 * len(values)))], 6),
            "max_lag_s": round(values[-1], 6), "first_late_seq": colls[idx[0]].seq,
            "first_late_at": colls[idx[0]].first_enter + late[idx[0]]}


def _together(slow: Dict[int, Dict[str, Any]], lags: Dict[int, Dict[int, float]]) -> bool:
    """Two ranks or more, late at the same instances of one op by about the same lag."""
    ranks = sorted(slow)
    if len(ranks) < 2:
        return False
    first = slow[ranks[0]]
    mine = set(lags[ranks[0]])
    for r in ranks[1:]:
        d = slow[r]
        theirs = set(lags[r])
        if d["op"] != first["op"] or len(mine & theirs) < TOGETHER_SHARE * min(len(mine), len(theirs)):
            return False
        a, b = first["median_lag_s"], d["median_lag_s"]
        if abs(a - b) > max(LAG_FLOOR_S, TOGETHER_LAG * max(a, b)):
            return False
    return True


def _spread(window: List[CollSummary]) -> Optional[Dict[str, Any]]:
    """Evidence numbers when the waiting in `window` is spread over the ranks (see the module's rules),
    else None."""
    if len(window) < MIN_COLLS:
        return None
    lags = sorted(s.worst[1] for s in window)
    if lags[len(lags) // 2] < SPREAD_LAG_S:
        return None
    span = max(s.completed_at for s in window) - min(s.first_enter for s in window)
    if span < MIN_EPISODE_S:
        return None
    late = [s for s in window if s.worst[1] >= LAG_FLOOR_S and s.worst[0] >= 0]
    cost = sum(s.worst[1] for s in late) / span
    last = collections.Counter(s.worst[0] for s in late)
    top = last.most_common(1)[0][1]
    if cost < SPREAD_COST or top >= LATE_FRACTION * len(window):
        return None
    ops = collections.Counter(s.op for s in late)
    return {"instances": len(window), "late_in": len(late), "window_s": round(span, 3),
            "waited_fraction": round(cost, 3), "median_lag_s": round(lags[len(lags) // 2], 6),
            "ranks_last": len(last), "most_last_share": round(top / len(late), 3),
            "last_counts": {str(r): c for r, c in sorted(last.most_common(8))}, "op": ops.most_common(1)[0][0]}


def spread_finding(job: str, comm: str, spread: Dict[str, Any], now: float, verb: str, where: str) -> Finding:
    """The informational `spread` finding (kind "info", no ranks) of `_spread`'s numbers: the ranks
    take turns `verb` last ("arriving", "finishing forward") at `where`."""
    lag = bucket(spread["median_lag_s"])
    evidence = dict(spread, reason="spread", informational=True,
                    summary=f"no culprit: {spread['ranks_last']} ranks take turns {verb} last, {lag} behind",
                    note=f"in {spread['late_in']} of {spread['instances']} of {where} someone is {lag} behind the "
                         f"others, costing {100 * spread['waited_fraction']:.0f} % of the time, but no rank is the "
                         f"last in more than {100 * spread['most_last_share']:.0f} % of them: the slowdown is spread "
                         "over the ranks (noise, shared load, input-dependent work), not one rank's")
    return Finding(kind="info", cls="spread", ranks=[], comm=comm, seq=-1, op=spread["op"],
                   onset_at=now - spread["window_s"], detected_at=now, evidence=evidence, job=job)
