"""Whether a rank that keeps its peers waiting is working: busy on CPU, or in disk I/O that moves.

A missing rank that is working (e.g. writing a checkpoint) while the others wait is an informational
`comp-slow` "pause" (hang.py, p2phang.py) until BUSY_FLOOR_S (thresholds.py), not a hang. `Activity`
keeps each waited-for rank's /proc samples (state, CPU time, wait channel) so that "working" is judged
over the whole wait and not flipped by one sample; a rank in D in one wait channel that used next to no
CPU all along is stuck in I/O (a dead NFS or FUSE server), not working (`stuck_in_io`). CPU shares are
CPU s per s; sample times are the agent's /proc sampling times (RankRecord.state_at), Unix seconds.
"""
from __future__ import annotations

import collections
from typing import Dict, Optional, Set, Tuple

from ccld.timeline.records import Comm, RankRecord
from ccld.timeline.timeline import Timeline

BUSY_CPU = 0.5        # CPU s per s between /proc samples: a rank this busy is computing, not blocked
WORKING_CPU = 0.3     # CPU s per s over a wait that makes a missing rank "working", whatever one sample says
STUCK_IO_CPU = 0.01   # CPU s per s below which a rank in D in one wait channel all along is stuck, not writing
MAX_SAMPLES = 600     # /proc samples kept per waited-for rank: 10 minutes at one a second
MAX_TRACKED = 4096    # ranks with samples before old ones are dropped ...
SAMPLES_KEPT_S = 600.0  # ... those not sampled for 10 minutes


def _active_now(rec: RankRecord) -> bool:
    return rec.state in ("R", "D") or (rec.cpu_busy is not None and rec.cpu_busy >= BUSY_CPU)


class Activity:
    """The /proc samples (state, CPU time, wait channel) of ranks that keep their peers waiting, noted
    each tick, so "is it working?" is judged over the whole wait and not flipped by one sample (a
    checkpoint alternates between CPU, disk waits and short sleeps). One per Timeline (the Diagnoser's)."""

    def __init__(self) -> None:
        self._samples: Dict[Tuple[str, int], "collections.deque"] = {}

    def note(self, rec: RankRecord) -> "collections.deque":
        key = (rec.node, rec.pid)
        d = self._samples.get(key)
        if d is None:
            d = self._samples[key] = collections.deque(maxlen=MAX_SAMPLES)
        if rec.state_at is not None and (not d or d[-1][0] != rec.state_at):
            d.append((rec.state_at, rec.state, rec.cpu_ns, rec.wchan))
        return d

    def working(self, rec: RankRecord, since: float) -> bool:
        """True when, since `since`, the rank was running or in disk I/O in at least half of the
        samples, or used WORKING_CPU of a CPU; with fewer than 2 samples, from the latest one. Disk
        waits count only while the I/O moves: a rank in D that used no CPU (below STUCK_IO_CPU) in
        one wait channel all along is stuck in I/O (a dead NFS or FUSE server), not working."""
        got = [x for x in self.note(rec) if x[0] >= since]
        if len(got) < 2:
            return _active_now(rec) or (rec.cpu_busy is not None and rec.cpu_busy >= WORKING_CPU)
        span = got[-1][0] - got[0][0]
        share = (got[-1][2] - got[0][2]) / 1e9 / span if span > 0 and got[0][2] >= 0 else 0.0
        if stuck_in_io(got, share):
            return False
        active = sum(1 for _, st, _, _ in got if st in ("R", "D")) / len(got)
        return active >= 0.5 or share >= WORKING_CPU

    def prune(self, now: float) -> None:
        if len(self._samples) > MAX_TRACKED:
            self._samples = {k: d for k, d in self._samples.items() if d and d[-1][0] >= now - SAMPLES_KEPT_S}


def stuck_in_io(samples, cpu_share: float) -> bool:
    """(state_at, state, cpu_ns, wchan) samples over a wait: every one in D, in one wait channel, with
    next to no CPU used: the I/O is not moving."""
    return (len(samples) >= 2 and all(st == "D" for _, st, _, _ in samples)
            and len({w for _, _, _, w in samples}) == 1 and cpu_share < STUCK_IO_CPU)


def _working(tl: Timeline, comm: Comm, ranks: Set[int], since: float, activity: Optional[Activity]) -> bool:
    """True when every one of `ranks` is alive and working (busy on CPU, or in disk I/O)."""
    for r in ranks:
        rec = tl.rank_record(comm.job, r)
        if rec is None or rec.exited() or rec.stopped():
            return False
        if not (activity.working(rec, since) if activity is not None else _active_now(rec)):
            return False
    return bool(ranks)
