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
from typing import Deque, Dict, Optional, Tuple

import numpy as np

BUCKET_S = 2.0            # resolution: a tick judges windows of several seconds
SERIES_BUCKETS = 300      # 10 minutes per rank: the baseline's reach
MAX_RANKS_PER_JOB = 1 << 17
MAX_JOBS = 1024
MAX_INTERVAL_S = 3600.0   # a longer "wait" is a clock or bookkeeping error, not a wait
KEPT_INTERVALS = 16       # per rank: a batch of p2p ops and the collectives around it overlap within a few


class JobBlocked:
    """One job's blocked time: a running total per rank (Python floats, one add per operation that
    ends), and snapshots of those totals taken by the detector each tick (`snapshot`), one column per
    BUCKET_S bucket in a ring of SERIES_BUCKETS; a window's share is the difference of two snapshots.
    An operation counts in the bucket its end was seen in (a long wait all at once): windows of
    several buckets smooth that out."""

    def __init__(self) -> None:
        self.total: Dict[int, float] = {}                         # rank -> blocked seconds so far
        self.counted: Dict[int, Deque[Tuple[float, float]]] = {}  # rank -> its newest counted intervals
        self.newest_end: Dict[int, float] = {}                    # rank -> the latest end among them
        self.ended: Dict[int, int] = {}                           # rank -> operations ended so far
        self.rows = np.zeros((0, SERIES_BUCKETS), dtype=np.float64)  # cumulative totals at each bucket's end
        self.end_rows = np.zeros((0, SERIES_BUCKETS), dtype=np.uint32)  # cumulative `ended`, mod 2**32
        self.stamp = np.full(SERIES_BUCKETS, -1, dtype=np.int64)  # the absolute bucket each column holds
        self.first_bucket: Optional[int] = None                   # the first snapshot's
        self.last_bucket = -1

    def add(self, rank: int, start: float, end: float) -> None:
        self.ended[rank] = self.ended.get(rank, 0) + 1
        kept = self.counted.get(rank)
        if kept is None:
            kept = self.counted[rank] = collections.deque(maxlen=KEPT_INTERVALS)
        newest = self.newest_end.get(rank)
        secs = end - start
        if newest is not None and start < newest:  # it may overlap what this rank already counted
            if end <= start:
                return  # an empty wait adds nothing, and is not kept
            # what of [start, end] the kept intervals cover: those that overlap it, clipped to it, merged
            inside = sorted((a if a > start else start, b if b < end else end) for a, b in kept if a < end and b > start)
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
        kept.append((start, end))
        if newest is None or end > newest:
            self.newest_end[rank] = end
        self.total[rank] = self.total.get(rank, 0.0) + secs

    def snapshot(self, now: float) -> None:
        """Record every rank's total as of `now` in its bucket (the detector calls it every tick)."""
        b = int(now // BUCKET_S)
        if b < self.last_bucket:
            return  # time went back (a replay's first tick after a gap): keep what is recorded
        n = max(self.total, default=-1) + 1
        if n > len(self.rows):
            size = max(n, 2 * len(self.rows), 8)
            grown = np.zeros((size, SERIES_BUCKETS))
            grown[:len(self.rows)] = self.rows
            grown_ends = np.zeros((size, SERIES_BUCKETS), dtype=np.uint32)
            grown_ends[:len(self.end_rows)] = self.end_rows
            self.rows, self.end_rows = grown, grown_ends
        cur = np.zeros(len(self.rows))
        cur_ends = np.zeros(len(self.rows), dtype=np.uint32)
        if self.total:
            cur[np.fromiter(self.total.keys(), dtype=np.int64, count=len(self.total))] = \
                np.fromiter(self.total.values(), dtype=np.float64, count=len(self.total))
        if self.ended:
            cur_ends[np.fromiter(self.ended.keys(), dtype=np.int64, count=len(self.ended))] = \
                np.fromiter((n & 0xFFFFFFFF for n in self.ended.values()), dtype=np.uint32, count=len(self.ended))
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
        got = self.jobs.get(job)
        if got is None:
            if len(self.jobs) >= MAX_JOBS:
                self.anomalies["blocked-jobs-over-bound"] += 1
                return
            got = self.jobs[job] = JobBlocked()
        got.add(rank, start, end)

    def bucket(self, t: float) -> int:
        return int(t // BUCKET_S)

    def job(self, job: str) -> Optional[JobBlocked]:
        return self.jobs.get(job)

    def span(self, job: str) -> Tuple[Optional[int], int]:
        got = self.jobs.get(job)
        return (None, -1) if got is None else (got.first_bucket, got.last_bucket)
