"""Blocked time: how much of each second every rank spent waiting in communication.

A rank is blocked from when it entered a collective to when the collective ended on it, and from
when it began waiting on a p2p op (its wait's start, else its post) to when the op was over. Those
intervals, as they end, are added to a running total per rank (JobBlocked: snapshots of the totals
per BUCKET_S bucket, a ring of SERIES_BUCKETS, give any window's share); overlapping intervals of one
rank count once: each rank's newest KEPT_INTERVALS counted intervals are kept and a new one counts
only what they do not cover (ends come in any order: a frame carries collectives in column blocks
and p2p ops as maps).
Beside the totals, a count of the operations that ended per rank, snapshotted the same way (`ends`):
a bucket in which none of a rank's operations ended is one in which it did not communicate at all (a
checkpoint, an evaluation: a pause), not one of a step after step.
1 - blocked share is the rank's own work (compute, data loading, waiting for a CPU): the slowdown
detector (diagnose/busy.py) compares it with the rank's own past, so a stage that always waits (the
last stage of a pipeline during warm-up) is normal, and one whose own work grew is the one others
wait for. Times: Unix seconds. Bounds: MAX_RANKS_PER_JOB rows per job, MAX_JOBS jobs.
Caveat: a collective that runs in the background while its rank computes (DDP's bucket all-reduces)
counts as blocked; that is the same on every rank of such a job, so comparisons across ranks and
with the past still hold.
"""
from __future__ import annotations

import collections
from typing import Dict, Optional, Tuple

import numpy as np

BUCKET_S = 2.0            # resolution: a tick judges windows of several seconds
SERIES_BUCKETS = 300      # 10 minutes per rank: the baseline's reach
MAX_RANKS_PER_JOB = 1 << 17
MAX_JOBS = 1024
MAX_INTERVAL_S = 3600.0   # a longer "wait" is a clock or bookkeeping error, not a wait
KEPT_INTERVALS = 16       # per rank: a batch of p2p ops and the collectives around it overlap within a few


class JobBlocked:
    """One job's blocked time: a running total per rank (arrays indexed by global rank, grown by
    doubling), and snapshots of those totals taken by the detector each tick (`snapshot`), one column per
    BUCKET_S bucket in a ring of SERIES_BUCKETS; a window's share is the difference of two snapshots.
    An operation counts in the bucket its end was seen in (a long wait all at once): windows of
    several buckets smooth that out. Each rank's newest KEPT_INTERVALS intervals are a ring (`kept`)."""

    def __init__(self) -> None:
        self.n = 0                                      # ranks 0..n-1 have had an operation end
        self.total = np.zeros(8)                        # rank -> blocked seconds so far
        self.newest_end = np.full(8, -np.inf)           # rank -> the latest end among its counted intervals
        self.ended = np.zeros(8, dtype=np.int64)        # rank -> operations ended so far
        self.kept = np.empty((8, KEPT_INTERVALS, 2))    # rank -> its newest counted intervals (start, end)
        self.kept[:, :, 0], self.kept[:, :, 1] = np.inf, -np.inf  # (an unused entry overlaps nothing)
        self.kpos = np.zeros(8, dtype=np.int64)         # rank -> where its next interval goes in `kept`
        self.rows = np.zeros((0, SERIES_BUCKETS), dtype=np.float64)  # cumulative totals at each bucket's end
        self.end_rows = np.zeros((0, SERIES_BUCKETS), dtype=np.uint32)  # cumulative `ended`, mod 2**32
        self.stamp = np.full(SERIES_BUCKETS, -1, dtype=np.int64)  # the absolute bucket each column holds
        self.first_bucket: Optional[int] = None                   # the first snapshot's
        self.last_bucket = -1

    def _room(self, top: int) -> None:
        """Arrays for ranks up to `top`."""
        if top >= self.n:
            self.n = top + 1
        size = self.total.shape[0]
        if top < size:
            return
        grow = max(top + 1, 2 * size)

        def one(a: np.ndarray, fill: float) -> np.ndarray:
            out = np.full((grow,) + a.shape[1:], fill, dtype=a.dtype)
            out[:size] = a
            return out
        self.total, self.newest_end, self.ended = one(self.total, 0.0), one(self.newest_end, -np.inf), one(self.ended, 0)
        self.kpos = one(self.kpos, 0)
        kept = np.empty((grow, KEPT_INTERVALS, 2))
        kept[:, :, 0], kept[:, :, 1] = np.inf, -np.inf
        kept[:size] = self.kept
        self.kept = kept

    def add(self, rank: int, start: float, end: float) -> None:
        self._room(rank)
        self.ended[rank] += 1
        newest = float(self.newest_end[rank])
        secs = end - start
        if start < newest:  # it may overlap what this rank already counted
            if end <= start:
                return  # an empty wait adds nothing, and is not kept
            # what of [start, end] the kept intervals cover: those that overlap it, clipped to it, merged
            inside = sorted((a if a > start else start, b if b < end else end)
                            for a, b in self.kept[rank].tolist() if a < end and b > start)
            if inside:
                covered, (lo, hi) = 0.0, inside[0]
                for a, b in inside:
                    if a > hi:
                        covered += hi - lo
                        lo, hi = a, b
                    elif b > hi:
                        hi = b
                if lo == start and hi == end and not covered:
                    return  # all of it counted already
                secs -= covered + (hi - lo)
        k = self.kpos[rank] % KEPT_INTERVALS
        self.kept[rank, k, 0], self.kept[rank, k, 1] = start, end
        self.kpos[rank] += 1
        if end > newest:
            self.newest_end[rank] = end
        self.total[rank] += secs

    def add_many(self, ranks: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> None:
        """add() for each row, with array operations: a rank whose rows overlap nothing it counted (each
        starts after its newest counted end and after its previous row) adds their lengths; the others
        add what their rows add to the union of their kept intervals (_union_gain)."""
        if not len(ranks):
            return
        self._room(int(ranks.max()))
        order = np.lexsort((starts, ranks))
        r, a, b = ranks[order], starts[order], ends[order]
        first = np.ones(len(r), dtype=bool)
        first[1:] = r[1:] != r[:-1]
        prev_end = np.empty(len(r))
        prev_end[1:] = b[:-1]
        prev_end[first] = self.newest_end[r[first]]
        clash = a < prev_end  # overlaps the rank's previous row, or what it counted already
        if clash.any():
            slow = np.isin(r, r[clash])
            fast = ~slow
        else:
            slow, fast = None, slice(None)
        fr, fa, fb = r[fast], a[fast], b[fast]
        np.add.at(self.total, fr, fb - fa)
        if slow is not None:
            sr, sa, sb = r[slow], a[slow], b[slow]
            gained = _union_gain(self.kept, sr, sa, sb)
            np.add.at(self.total, gained[0], gained[1])
        np.add.at(self.ended, r, 1)
        np.maximum.at(self.newest_end, r, b)
        starts_at = np.flatnonzero(first)
        nth = np.arange(len(r)) - np.repeat(starts_at, np.diff(np.append(starts_at, len(r))))
        pos = (self.kpos[r] + nth) % KEPT_INTERVALS
        self.kept[r, pos, 0], self.kept[r, pos, 1] = a, b
        np.add.at(self.kpos, r, 1)

    def snapshot(self, now: float) -> None:
        """Record every rank's total as of `now` in its bucket (the detector calls it every tick)."""
        b = int(now // BUCKET_S)
        if b < self.last_bucket:
            return  # time went back (a replay's first tick after a gap): keep what is recorded
        n = self.n
        if n > len(self.rows):
            size = max(n, 2 * len(self.rows), 8)
            grown = np.zeros((size, SERIES_BUCKETS))
            grown[:len(self.rows)] = self.rows
            grown_ends = np.zeros((size, SERIES_BUCKETS), dtype=np.uint32)
            grown_ends[:len(self.end_rows)] = self.end_rows
            self.rows, self.end_rows = grown, grown_ends
        cur = np.zeros(len(self.rows))
        cur_ends = np.zeros(len(self.rows), dtype=np.uint32)
        cur[:n] = self.total[:n]
        cur_ends[:n] = (self.ended[:n] & 0xFFFFFFFF).astype(np.uint32)
        if self.first_bucket is None:
            self.first_bucket = b
        elif b > self.last_bucket + 1:  # buckets without a tick: nothing was seen to end in them
            prev = self.rows[:, self.last_bucket % SERIES_BUCKETS].copy()
            prev_ends = self.end_rows[:, self.last_bucket % SERIES_BUCKETS].copy()
            for gap in range(max(self.last_bucket + 1, b - SERIES_BUCKETS + 1), b):
                self.rows[:, gap % SERIES_BUCKETS] = prev
                self.end_rows[:, gap % SERIES_BUCKETS] = prev_ends
                self.stamp[gap % SERIES_BUCKETS] = gap
        self.rows[:, b % SERIES_BUCKETS] = cur
        self.end_rows[:, b % SERIES_BUCKETS] = cur_ends
        self.stamp[b % SERIES_BUCKETS] = b
        self.last_bucket = b

    def window(self, first: int, last: int) -> Optional[np.ndarray]:
        """Blocked share per rank over buckets first..last (absolute, inclusive), or None when the
        snapshots do not reach that far."""
        if self.first_bucket is None or last < first or last - first + 2 > SERIES_BUCKETS \
                or first - 1 < self.first_bucket or last > self.last_bucket:
            return None
        a, z = (first - 1) % SERIES_BUCKETS, last % SERIES_BUCKETS
        if self.stamp[a] != first - 1 or self.stamp[z] != last:
            return None
        return (self.rows[:, z] - self.rows[:, a]) / ((last - first + 1) * BUCKET_S)

    def ends(self, bucket: int) -> Optional[np.ndarray]:
        """Operations that ended per rank in one bucket (absolute), or None when not snapshotted (the
        difference is taken mod 2**32, as the totals are kept: right while a bucket sees fewer ends)."""
        if self.window(bucket, bucket) is None:
            return None
        return self.end_rows[:, bucket % SERIES_BUCKETS] - self.end_rows[:, (bucket - 1) % SERIES_BUCKETS]


def _union_gain(kept: np.ndarray, r: np.ndarray, a: np.ndarray, b: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(ranks, seconds): how much rows [a, b) of ranks r (sorted by rank) add to the union of each
    rank's kept intervals: |union(kept, rows)| - |union(kept)|, measured from the rows' earliest start
    on (what lies before it is in both). Groups of one rank are laid end to end on one axis (rank k at
    k x span) so that one sort and one running maximum measure every union."""
    ranks, at = np.unique(r, return_inverse=True)
    lo = float(a.min())
    old = kept[ranks]                                     # [m, KEPT, 2]
    ka = np.maximum(old[:, :, 0], lo).ravel()
    kb = old[:, :, 1].ravel()
    kg = np.repeat(np.arange(len(ranks)), KEPT_INTERVALS)
    live = kb > ka
    ka, kb, kg = ka[live], kb[live], kg[live]
    na, nb = np.maximum(a, lo), b
    span = max(float(nb.max()), float(kb.max()) if len(kb) else lo) - lo + 1.0

    def union(g: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        out = np.zeros(len(ranks))
        if not len(g):
            return out
        xs, ys = x - lo + g * span, y - lo + g * span
        order = np.argsort(xs, kind="stable")
        xs, ys, gs = xs[order], ys[order], g[order]
        reach = np.maximum.accumulate(ys)
        before = np.empty(len(xs))
        before[0] = -np.inf
        before[1:] = reach[:-1]
        np.add.at(out, gs, np.maximum(0.0, ys - np.maximum(xs, before)))
        return out
    with_rows = union(np.concatenate([kg, at]), np.concatenate([ka, na]), np.concatenate([kb, nb]))
    return ranks, with_rows - union(kg, ka, kb)


class BlockedTable:
    def __init__(self, anomalies: collections.Counter):
        self.anomalies = anomalies
        self.jobs: Dict[str, JobBlocked] = {}

    def add(self, job: str, rank: int, start: Optional[float], end: Optional[float]) -> None:
        if start is None or end is None or rank < 0:
            return
        if not 0 <= end - start <= MAX_INTERVAL_S or rank >= MAX_RANKS_PER_JOB:
            self.anomalies["blocked-interval-dropped"] += 1
            return
        got = self._job(job)
        if got is not None:
            got.add(rank, start, end)

    def _job(self, job: str) -> Optional[JobBlocked]:
        got = self.jobs.get(job)
        if got is None:
            if len(self.jobs) >= MAX_JOBS:
                self.anomalies["blocked-jobs-over-bound"] += 1
                return None
            got = self.jobs[job] = JobBlocked()
        return got

    def add_many(self, job: str, ranks: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> None:
        """add() for each row (starts NaN where the rank's enter is not known: skipped, as add skips None)."""
        ok = ~np.isnan(starts) & (ranks >= 0)
        if not ok.all():
            ranks, starts, ends = ranks[ok], starts[ok], ends[ok]
        span = ends - starts
        good = (span >= 0) & (span <= MAX_INTERVAL_S) & (ranks < MAX_RANKS_PER_JOB)
        if not good.all():
            self.anomalies["blocked-interval-dropped"] += int((~good).sum())
            ranks, starts, ends = ranks[good], starts[good], ends[good]
        got = self._job(job) if len(ranks) else None
        if got is not None:
            got.add_many(ranks, starts, ends)

    def bucket(self, t: float) -> int:
        return int(t // BUCKET_S)

    def job(self, job: str) -> Optional[JobBlocked]:
        return self.jobs.get(job)

    def span(self, job: str) -> Tuple[Optional[int], int]:
        got = self.jobs.get(job)
        return (None, -1) if got is None else (got.first_bucket, got.last_bucket)
