"""Clock conversion: the ONE place where a node's CLOCK_MONOTONIC nanoseconds become Unix seconds.

Every event carries `ts_ns` in the monotonic clock of the node that made it; each node's monotonic
clock has its own epoch (its boot). Agents send `ClockSample`s, a (CLOCK_MONOTONIC, CLOCK_REALTIME)
pair read back to back on their node; the offset wall - mono of the latest sample maps that agent's
monotonic times to Unix seconds.

Caveat: accuracy is that of the nodes' wall clocks (NTP/PTP, typically well under a millisecond),
and a wall-clock step on a node moves the offset at its next sample. Refining offsets from
collectives (ranks leave one collective within microseconds of each other) comes later.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

from ccld.errors import CcldError


class NoClockSample(CcldError):
    """An agent's monotonic time was asked for before that agent sent any ClockSample."""


@dataclass(frozen=True)
class ClockOffset:
    offset_ns: int      # wall_ns - mono_ns of the latest sample
    sampled_mono_ns: int
    samples: int        # how many samples this agent has sent


class ClockTable:
    """Latest clock offset per agent. Not thread-safe: the timeline's lock covers it."""

    def __init__(self) -> None:
        self._offsets: Dict[str, ClockOffset] = {}
        self.rejected = 0  # samples that cannot be right (negative or zero clocks)

    def update(self, agent: str, mono_ns: int, wall_ns: int) -> bool:
        """Record a sample; returns False (and counts it) when the sample is not plausible."""
        if mono_ns < 0 or wall_ns <= 0:
            self.rejected += 1
            return False
        prev = self._offsets.get(agent)
        self._offsets[agent] = ClockOffset(wall_ns - mono_ns, mono_ns, (prev.samples if prev else 0) + 1)
        return True

    def has(self, agent: str) -> bool:
        return agent in self._offsets

    def offset(self, agent: str) -> Optional[ClockOffset]:
        return self._offsets.get(agent)

    def to_unix(self, agent: str, mono_ns: int) -> float:
        """Unix seconds of `mono_ns` on `agent`'s node. Raises NoClockSample before its first sample."""
        off = self._offsets.get(agent)
        if off is None:
            raise NoClockSample(f"agent {agent!r} has sent no clock sample yet; "
                                f"its monotonic time {mono_ns} ns cannot be converted")
        return (mono_ns + off.offset_ns) / 1e9

    def agents(self) -> Dict[str, ClockOffset]:
        return dict(self._offsets)
