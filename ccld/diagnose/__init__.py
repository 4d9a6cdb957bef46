"""Detectors and localisers: questions asked of a Timeline, answered with Findings (values).

`Diagnoser` is the facade: one question-shaped method per detector, each delegating to one module
(`hang.find_hangs`). Printing is `findings.format_line`'s job; deduplication over time is
`tracker.FindingTracker`'s; offline analysis of a store is `replay.replay`.
"""
from __future__ import annotations

from typing import List

from ccld.diagnose import hang
from ccld.diagnose.findings import Finding


class Diagnoser:
    def __init__(self, timeline, floor_s: float = hang.FLOOR_S, k: float = hang.K):
        self.timeline = timeline
        self.floor_s = floor_s
        self.k = k

    def find_hangs(self, now: float) -> List[Finding]:
        """Hangs that hold at Unix time `now` (the caller holds the timeline's lock, if any)."""
        return hang.find_hangs(self.timeline, now, self.floor_s, self.k)
