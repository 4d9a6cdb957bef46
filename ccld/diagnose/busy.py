"""Compute-slow from blocked time: the rank whose own work grew while the others wait for it.

Every rank's time splits into waiting in communication (timeline/blocked.py: collectives entered
and not ended, p2p ops waited on) and its own work (1 - blocked share). When one rank's work grows
(a slower stage, more compute, a CPU hog next to it), it waits less and everyone downstream of it
waits more: in a pipeline the stages after it wait in recv and the ones before it in send, however
far along the chain, so arrival order at one collective does not point at it, but its own work does.
Per job, each tick:
  recent    every rank's blocked share over the RECENT_S before SETTLE_S ago
  baseline  its median (and robust spread) over RECENT_S windows of the BASELINE_S before GAP_S
            earlier; frozen while a finding holds, so a long slowdown does not become its own normal
  culprit   a rank whose own work grew by >= MIN_DELTA and >= NOISE_Z spreads of its own variation,
            in most of the window's buckets (SPREAD_FRACTION: step after step, not one long stretch
            such as a checkpoint, which is hang.py's pause), buckets in which operations of its ended
            (one without any is a pause too, however long: its neighbours' one long wait ends in a
            single bucket, and a window across it would otherwise see them wait more),
            while the other ranks' own work did not grow (<= OTHERS_FACTOR of the culprit's: a bigger
            batch grows everyone's, which is no culprit) and became a smaller share of their time by
            >= OTHERS_REL_DROP (the steps are longer: the job is slower for it; a rank that only used
            its slack slows nobody); at most MAX_SHARE of the ranks (a group slowed together is named
            together)
  starved   else, a rank whose threads wait for a CPU (runqueue share over the window, SchedStats) at
            least STARVED_RUNQ s per s and STARVED_VS_OTHERS times the others' median, ending operations
            in most buckets, while the others' blocked share is up OTHERS_WAIT_MORE on their baseline: a
            CPU hog on its core makes it wait inside its sends and receives too, so its blocked share
            grows with everyone's and its own work does not show it (reason "cpu-starved")
  finding   `comp-slow` (reason "own-work" or "cpu-starved") once that held for PERSIST_S of ticks
            (misses shorter than PERSIST_GRACE_S do not restart the count).
Caveat: a rank that ends its operations in one burst per step (DDP-style: the step's all-reduces
together) ends some in fewer than SPREAD_FRACTION of the buckets once its steps, slowed, are longer
than BUCKET_S / SPREAD_FRACTION (3.3 s), so this rule names nobody there; arrival lateness
(slow.py) and compute durations (compute.py) still judge it. Pipelines end p2p ops all through a
step. Ends on any communicator count: a paused rank that still talks on a side group is not paused
to this rule.
Findings carry seq -1 and the communicator the culprits' p2p or collectives run on. Times: Unix
seconds. Cost: numpy over the job's rows per tick (ranks x BASELINE_S / BUCKET_S values).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np

from ccld.diagnose.evidence import EVIDENCE_RANKS, rank_evidence
from ccld.diagnose.findings import Finding
from ccld.diagnose.slow import _cause
from ccld.timeline.blocked import BUCKET_S, JobBlocked
from ccld.timeline.records import Comm
from ccld.timeline.timeline import Timeline

RECENT_S = 10.0        # the window judged: several pipeline steps even on a slow job
SETTLE_S = 2.0         # ... ending this long ago: a wait is counted when it ends, and ends take a drain to arrive
GAP_S = 10.0           # the baseline ends this long before the recent window: a slowdown's first seconds ...
BASELINE_S = 120.0     # ... are not its own normal; two minutes of windows give the rank's usual and its spread
MIN_BASELINE_S = 30.0  # history needed before anything is judged (a job's first minute is warm-up anyway)
MIN_DELTA = 0.10       # the culprit's own work grew by 100 ms per second at least
NOISE_Z = 4.0          # ... and by this many robust spreads of its own window-to-window variation
OTHERS_FACTOR = 0.25   # the others' own work grew by at most this share of the culprit's growth
OTHERS_REL_DROP = 0.05  # ... and their own work is a smaller share of their time by 5 % (of its own size): the
                        #     job's steps are longer because of the culprit (ranks that wait 80 % of the time
                        #     anyway wait only a little more, but their own share shrinks as much)
MIN_OWN = 0.02          # a rank's own-work share below this is taken as this (no division by ~0)
MAX_SHARE = 0.25       # culprits: at most a quarter of the ranks, else nothing stands out
MIN_RANKS = 2
SPREAD_FRACTION = 0.6  # its work grew (by half of MIN_DELTA at least) in this share of the window's buckets: a
                       # checkpoint or a one-off eval is one long stretch of own work (a pause, hang.py's)
PERSIST_S = 4.0        # it held this long (ticks) before it is a finding: not one odd window ...
PERSIST_GRACE_S = 2.0  # ... where a miss shorter than this does not restart the count
RELEASE_S = 20.0       # a held finding's baseline is released after this long without a culprit
STARVED_RUNQ = 0.25    # a rank starved of CPU waits for one this many s per s over the window ...
STARVED_VS_OTHERS = 2.0  # ... this many times the other ranks' median (on a busy box all of them wait some)
MIN_RUNQ = 0.02        # the others' median taken as at least this (no division by ~0)
OTHERS_WAIT_MORE = 0.05  # ... while the others' blocked share is up this much on their baseline


@dataclass
class _JobState:
    since: Optional[float] = None                 # when the culprit set first held
    culprits: tuple = ()
    frozen: Optional[tuple] = None                # (median, spread) per rank while a finding holds
    clear_since: Optional[float] = None
    missed_since: Optional[float] = None          # the culprits stopped holding at this tick (grace)


class BusyDetector:
    """One per Timeline (the Diagnoser's): remembers per job when a culprit began to hold."""

    def __init__(self) -> None:
        self._jobs: Dict[str, _JobState] = {}

    def find(self, tl: Timeline, now: float) -> List[Finding]:
        out = []
        for job, rows in list(tl.blocked.jobs.items()):
            f = self._job(tl, job, rows, now)
            if f is not None:
                out.append(f)
        return out

    def _job(self, tl: Timeline, job: str, rows: JobBlocked, now: float) -> Optional[Finding]:
        st = self._jobs.setdefault(job, _JobState())
        rows.snapshot(now)
        per = max(1, int(round(RECENT_S / BUCKET_S)))
        last = int((now - SETTLE_S) // BUCKET_S) - 1          # the newest complete, settled bucket
        first = last - per + 1
        recent = rows.window(first, last)
        if recent is None or rows.first_bucket is None:
            return None
        ranks = self._ranks(tl, job, len(recent))
        if len(ranks) < MIN_RANKS:
            return None
        if st.frozen is not None:
            med, spread = st.frozen
        else:
            base_last = first - 1 - int(round(GAP_S / BUCKET_S))
            n_win = int(BASELINE_S // RECENT_S)
            base_first = max(rows.first_bucket + 2, base_last - n_win * per + 1)  # its first bucket may be partial
            n_win = (base_last - base_first + 1) // per
            if n_win * RECENT_S < MIN_BASELINE_S:
                return None
            wins = [rows.window(base_last - (i + 1) * per + 1, base_last - i * per) for i in range(n_win)]
            if any(w is None for w in wins):
                return None
            stack = np.stack(wins, axis=1)                    # ranks x windows
            med = np.median(stack, axis=1)
            spread = 1.4826 * np.median(np.abs(stack - med[:, None]), axis=1)
        idx = np.array(ranks)
        grew = med[idx] - recent[idx]                         # own work grew = blocked share fell
        noise = np.maximum(spread[idx], 1e-3)
        cand = [r for r, g, s in zip(ranks, grew, noise) if g >= MIN_DELTA and g >= NOISE_Z * s]
        if cand:  # step after step: the growth is in most of the window's buckets, not one long stretch,
            # and in buckets where the rank communicated: one with none of its operations ending is a pause
            per_bucket = [rows.window(b, b) for b in range(first, last + 1)]
            talked = _talked(rows, first, last)
            if any(w is None for w in per_bucket) or talked is None:
                return None
            sel = np.array(cand)
            each = np.stack([w[sel] for w in per_bucket])           # buckets x candidates
            spread_ok = (((med[sel] - each) >= MIN_DELTA / 2) & talked[:, sel]).mean(axis=0) >= SPREAD_FRACTION
            cand = [r for r, ok in zip(cand, spread_ok) if ok]
        culprits: List[int] = []
        if cand and len(cand) <= max(1, int(MAX_SHARE * len(ranks))):
            others = [i for i, r in enumerate(ranks) if r not in cand]
            their_growth = float(np.median(grew[others])) if others else 0.0
            own_before = np.maximum(1.0 - med[idx[others]], MIN_OWN) if others else np.ones(1)
            their_drop = -float(np.median(grew[others] / own_before)) if others else 0.0
            least = min(g for r, g in zip(ranks, grew) if r in cand)
            if their_growth <= OTHERS_FACTOR * least and their_drop >= OTHERS_REL_DROP:
                culprits = sorted(cand)
        starved: Dict[int, float] = {}
        if not culprits:
            starved = self._starved(tl, job, rows, ranks, recent, med, first, last, now)
            culprits = sorted(starved)
        if not culprits:
            if st.since is not None and st.missed_since is None:
                st.missed_since = now
            if st.since is not None and now - st.missed_since <= PERSIST_GRACE_S:
                return None  # one window that misses (the others' share jitters): the run goes on
            st.since = st.missed_since = None
            if st.frozen is not None:
                st.clear_since = st.clear_since or now
                if now - st.clear_since >= RELEASE_S:
                    st.frozen, st.clear_since, st.culprits = None, None, ()
            return None
        st.clear_since = st.missed_since = None
        if tuple(culprits) != st.culprits or st.since is None:
            st.since, st.culprits = now, tuple(culprits)
        if st.frozen is None:
            st.frozen = (med.copy(), spread.copy())
        if now - st.since < PERSIST_S:
            return None
        return self._finding(tl, job, culprits, ranks, recent, med, grew, now, st.since, starved)

    def _starved(self, tl: Timeline, job: str, rows: JobBlocked, ranks: List[int], recent, med, first: int,
                 last: int, now: float) -> Dict[int, float]:
        """Ranks starved of CPU while the others wait more: rank -> its runqueue share. A rank whose
        threads wait for a CPU (a hog on its core) waits for it inside its sends and receives too, so
        its blocked share grows with everyone's and its own work does not show it; its runqueue share
        over the window does: STARVED_RUNQ s per s at least, STARVED_VS_OTHERS times the others'
        median, ends of its operations in most buckets (not paused), and the others' blocked share up
        by OTHERS_WAIT_MORE on their baseline (the job is slower for it)."""
        shares = {}
        for r in ranks:
            rec = tl.rank_record(job, r)
            v = rec.runq_since(now - RECENT_S) if rec is not None else None
            if v is not None:
                shares[r] = v
        if len(shares) <= MIN_RANKS:
            return {}
        vals = np.fromiter(shares.values(), dtype=np.float64, count=len(shares))
        theirs = _median_without_each(vals)
        out = {r: v for r, v, m in zip(shares, vals.tolist(), theirs.tolist())
               if v >= STARVED_RUNQ and v >= STARVED_VS_OTHERS * max(m, MIN_RUNQ)}
        if not out or len(out) > max(1, int(MAX_SHARE * len(ranks))):
            return {}
        talked = _talked(rows, first, last)
        if talked is None:
            return {}
        out = {r: v for r, v in out.items() if talked[:, r].mean() >= SPREAD_FRACTION}
        rest = np.array([r for r in ranks if r not in out])
        if not out or not len(rest) or float(np.median(recent[rest] - med[rest])) < OTHERS_WAIT_MORE:
            return {}
        return out

    def _ranks(self, tl: Timeline, job: str, n: int) -> List[int]:
        """The job's ranks that have a row and are alive (an exited rank's blocked time stops)."""
        out = []
        for r in range(n):
            rec = tl.rank_record(job, r)
            if rec is not None and not rec.exited():
                out.append(r)
        return out

    def _finding(self, tl: Timeline, job: str, culprits: List[int], ranks: List[int], recent, med, grew,
                 now: float, since: float, starved: Optional[Dict[int, float]] = None) -> Finding:
        comm = home_comm(tl, job, culprits)
        gi = {r: float(g) for r, g in zip(ranks, grew)}
        others = [gi[r] for r in ranks if r not in culprits]
        members = sorted(ranks)
        details = []
        for r in culprits[:EVIDENCE_RANKS]:
            d = rank_evidence(tl, comm, r, now) if comm is not None else {"rank": r}
            d.update(own_work_now=round(1 - float(recent[r]), 3), own_work_before=round(1 - float(med[r]), 3),
                     own_work_grew=round(gi[r], 3))
            if comm is not None:
                d.update(_cause(tl, comm, r, members))
            details.append(d)
        shown = "; ".join(f"rank {d['rank']} works {1e3 * d['own_work_grew']:+.0f} ms/s more" for d in details[:3])
        note = ("the named rank's own work (time outside communication) grew while every other "
                "rank's did not and they wait longer: it holds the job back")
        if starved:
            theirs = [v for r, v in ((r, getattr(tl.rank_record(job, r), "runq_share", None)) for r in ranks)
                      if r not in starved and v is not None]
            for d in details:
                d["runq_s_per_s"] = round(starved[d["rank"]], 3)
            shown = "; ".join(f"rank {d['rank']} waits for a CPU {d['runq_s_per_s']:.2f} s per s" for d in details[:3]) \
                + (f" (the others {float(np.median(theirs)):.2f})" if theirs else "")
            note = ("the named rank's threads wait for a CPU far more than the other ranks' (another process "
                    "competes for its cores), inside its communication too, and the others wait longer: it "
                    "holds the job back")
        wait = -float(np.median(others)) if others else 0.0
        evidence = {"reason": "cpu-starved" if starved else "own-work", "window_s": RECENT_S, "baseline_s": BASELINE_S, "ranks": details,
                    "others_wait_more_s_per_s": round(wait, 3),
                    "summary": shown + (f" (+{len(culprits) - 3})" if len(culprits) > 3 else "")
                    + "; the others wait for it",
                    "note": note + (" (a group slowed together)" if len(culprits) > 1 else "")}
        return Finding(kind="slow", cls="comp-slow", ranks=culprits, comm=comm.id if comm else job, seq=-1,
                       op=_op(tl, comm, culprits), onset_at=since - RECENT_S / 2 - SETTLE_S, detected_at=now,
                       evidence=evidence, job=job)


def _talked(rows: JobBlocked, first: int, last: int) -> Optional[np.ndarray]:
    """buckets x ranks: whether operations of the rank ended in each bucket first..last (one without
    any is a pause, not a step of a slowdown), or None when the snapshots do not reach that far."""
    ends = [rows.ends(b) for b in range(first, last + 1)]
    if any(e is None for e in ends):
        return None
    return np.stack(ends) > 0


def _median_without_each(vals: np.ndarray) -> np.ndarray:
    """For each value, the median of all the others (n >= 2), from one sort: O(n log n), not O(n^2)."""
    n = len(vals)
    order = np.argsort(vals, kind="stable")
    s = vals[order]
    m = n - 1
    pos = np.empty(n, dtype=np.int64)
    pos[order] = np.arange(n)  # each value's place in the sorted array

    def kth(k: int) -> np.ndarray:  # the k-th smallest of the others, for each value
        return np.where(k < pos, s[k], s[min(k + 1, n - 1)])

    if m % 2:
        return kth(m // 2)
    return (kth(m // 2 - 1) + kth(m // 2)) / 2


def home_comm(tl: Timeline, job: str, ranks: List[int]) -> Optional[Comm]:
    """The communicator the culprits communicate on most: the one with p2p ops of theirs, else the
    one with the most members (the default group)."""
    comms = [c for c in tl.comms.values() if c.job == job]
    with_p2p = [c for c in comms if c.p2p is not None and any(r in c.p2p.last_posted for r in ranks)]
    pool = with_p2p or comms
    return max(pool, key=lambda c: (len(c.members), c.id)) if pool else None


def _op(tl: Timeline, comm: Optional[Comm], ranks: List[int]) -> str:
    """"p2p" when the culprits' neighbours wait on them in sends/recvs, else the newest collective's op."""
    if comm is None:
        return ""
    if comm.p2p is not None and any(r in comm.p2p.last_posted for r in ranks):
        return "p2p"
    return comm.colls[next(reversed(comm.colls))].op if comm.colls else ""


def explained_by(f: Finding, late: List[Finding]) -> bool:
    """A lateness finding of the same job names these ranks already: one finding is enough."""
    return any(g.job == f.job and set(f.ranks) <= set(g.ranks) for g in late)
