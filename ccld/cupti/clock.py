"""CUPTI timestamps -> this node's CLOCK_MONOTONIC ns: the one place where that conversion happens.

CUPTI stamps activity records (GPU start/end, and the host API records) with its own ns clock,
readable as `cupti.get_timestamp()`. Its epoch is not CLOCK_MONOTONIC's, and the two may drift
(CUPTI's may be another host clock, slewed differently). So the shim reads them in pairs, bracketed
(monotonic, CUPTI, monotonic), once per flush, keeps the narrowest of a few tries, and converts with
the offset interpolated between the two samples around a timestamp (the nearest one outside them).
Everything downstream (agent, collector) sees node-monotonic ns, like BPF's bpf_ktime_get_ns.
"""
from __future__ import annotations

import bisect
import time
from typing import Callable, List, Optional, Tuple

MAX_SAMPLES = 256            # ~2 min of history at one sample per 500 ms flush; older records are rare
TRIES_PER_SAMPLE = 3         # keep the narrowest bracket of 3 back-to-back reads (a preemption widens one)
MAX_BRACKET_NS = 1_000_000   # a pair read across more than 1 ms is not trusted (the thread was descheduled)


class CuptiClock:
    """Pairs of (CUPTI ns, monotonic ns); `to_mono()` converts one CUPTI timestamp."""

    def __init__(self, cupti_ns: Callable[[], int], mono_ns: Callable[[], int] = time.monotonic_ns):
        self._cupti_ns, self._mono_ns = cupti_ns, mono_ns
        self._at: List[int] = []        # CUPTI ns of each sample, ascending
        self._offset: List[int] = []    # monotonic - CUPTI at that sample
        self.rejected = 0               # samples dropped: read across too wide a bracket
        self.steps = 0                  # times CUPTI's clock went backwards (history started over)

    def sample(self) -> bool:
        """Read one pair (the best of TRIES_PER_SAMPLE). False when none was good enough."""
        best: Optional[Tuple[int, int, int]] = None  # (bracket width, cupti, offset)
        for _ in range(TRIES_PER_SAMPLE):
            t0 = self._mono_ns()
            c = int(self._cupti_ns())
            t1 = self._mono_ns()
            width = t1 - t0
            if width >= 0 and (best is None or width < best[0]):
                best = (width, c, t0 + width // 2 - c)
        if best is None or best[0] > MAX_BRACKET_NS:
            self.rejected += 1
            return False
        _, c, offset = best
        if self._at and c <= self._at[-1]:  # CUPTI's clock stepped back: older pairs describe another epoch
            self.steps += 1
            del self._at[:], self._offset[:]
        self._at.append(c)
        self._offset.append(offset)
        if len(self._at) > MAX_SAMPLES:
            del self._at[0], self._offset[0]
        return True

    def ready(self) -> bool:
        return bool(self._at)

    def to_mono(self, cupti_ts: int) -> int:
        """CLOCK_MONOTONIC ns of a CUPTI timestamp. 0 stays 0 (CUPTI's "not collected")."""
        if cupti_ts == 0:
            return 0
        at, off = self._at, self._offset
        if not at:
            raise RuntimeError("CuptiClock.to_mono() before any sample()")
        i = bisect.bisect_right(at, cupti_ts)
        if i == 0:
            return cupti_ts + off[0]
        if i == len(at):
            return cupti_ts + off[-1]
        c0, c1, o0, o1 = at[i - 1], at[i], off[i - 1], off[i]
        return cupti_ts + o0 + (o1 - o0) * (cupti_ts - c0) // (c1 - c0)
