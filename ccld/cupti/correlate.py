"""Tie each GPU activity record to the host call that launched it, by CUPTI correlation id.

A kernel (or memcpy/memset) record and the runtime/driver API record of its launch share a
correlation id; the API record says which thread launched it and when (CUPTI ns). They arrive in
either order, in different buffers. Launch records wait in a bounded map (oldest evicted first);
an activity whose launch record has not arrived waits up to PENDING_NS, then goes out without one
(`launch_tid` 0) and is counted in `no_launch`. One launch can own several activities (a graph
launch), so a launch record is not consumed by its first match. Single-threaded (the shim's sender).
"""
from __future__ import annotations

import collections
from typing import Deque, Dict, List, Optional, Tuple

from ccld.cupti.capture import REC_API

MAX_LAUNCHES = 65_536      # launch records kept for late activities: ~6 s of a busy job's launches
MAX_PENDING = 16_384       # activities waiting for their launch record; beyond: sent without one
PENDING_NS = 2_000_000_000  # launch records come within a flush or two of their activity (0.5 s each)

Launch = Tuple[int, int]   # (thread id, CUPTI ns of the API call's start)


class LaunchCorrelator:
    def __init__(self, max_launches: int = MAX_LAUNCHES, max_pending: int = MAX_PENDING,
                 pending_ns: int = PENDING_NS):
        self.max_launches, self.max_pending, self.pending_ns = max_launches, max_pending, pending_ns
        self._launch: Dict[int, Launch] = {}          # correlation id -> launch, insertion ordered
        self._pending: Dict[int, List[tuple]] = {}    # correlation id -> activities waiting for it
        self._pending_since: Deque[Tuple[int, int]] = collections.deque()  # (arrival ns, corr), in order
        self._n_pending = 0
        self._ready: List[Tuple[tuple, Optional[Launch]]] = []
        self.counters: Dict[str, int] = collections.Counter(  # type: ignore[assignment]
            {"matched": 0, "matched_late": 0, "no_launch": 0})

    def add(self, rec: tuple, now_ns: int) -> None:
        """One record tuple from the capture queue (any tag)."""
        if rec[0] == REC_API:
            self._add_launch(rec[1], (rec[2], rec[3]))
        else:
            self._add_activity(rec, rec[5], now_ns)

    def _add_launch(self, corr: int, launch: Launch) -> None:
        self._launch[corr] = launch
        if len(self._launch) > self.max_launches:
            del self._launch[next(iter(self._launch))]
        waiting = self._pending.pop(corr, None)
        if waiting:
            self._n_pending -= len(waiting)
            self.counters["matched_late"] += len(waiting)
            self._ready.extend((r, launch) for r in waiting)

    def _add_activity(self, rec: tuple, corr: int, now_ns: int) -> None:
        launch = self._launch.get(corr)
        if launch is not None:
            self.counters["matched"] += 1
            self._ready.append((rec, launch))
            return
        if self._n_pending >= self.max_pending:
            self.counters["no_launch"] += 1  # no room to wait: out now, without its launch
            self._ready.append((rec, None))
            return
        self._pending.setdefault(corr, []).append(rec)
        self._pending_since.append((now_ns, corr))
        self._n_pending += 1

    def expire(self, now_ns: int, everything: bool = False) -> None:
        """Send on, without a launch, what waited longer than pending_ns (or everything, at the end)."""
        q = self._pending_since
        while q and (everything or now_ns - q[0][0] >= self.pending_ns):
            _, corr = q.popleft()
            waiting = self._pending.pop(corr, None)
            if waiting:
                self._n_pending -= len(waiting)
                self.counters["no_launch"] += len(waiting)
                self._ready.extend((r, None) for r in waiting)

    def take(self) -> List[Tuple[tuple, Optional[Launch]]]:
        out, self._ready = self._ready, []
        return out

    def pending(self) -> int:
        return self._n_pending
