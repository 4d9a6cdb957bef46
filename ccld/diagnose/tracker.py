"""Finding lifecycle: report each hang once, and say when it is over.

The detectors are stateless: every tick they return whatever holds at that moment. The tracker
turns that into events: a finding whose key (class, comm, seq, ranks) was not active is new; an
active key that no longer comes back (ranks entered, the collective completed) is recovered.
Times: `now` is Unix seconds. Caveat: a finding whose blamed ranks change (rank 1 of [1, 2]
arrives) is a recovery of the old key and a new finding for the new one; that is on purpose, the
line the user read is no longer true. But when the same collective is still stuck and only the
class changes (the hung rank was then stopped or died: not-entered -> fault), the new finding
supersedes the old one silently: nothing recovered.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

from ccld.diagnose.findings import Finding, recovery_record


class FindingTracker:
    def __init__(self) -> None:
        self.active: Dict[Tuple, Finding] = {}  # bounded by the detectors: at most one per comm and class

    def update(self, findings: List[Finding], now: float) -> Tuple[List[Finding], List[Dict[str, Any]]]:
        """(new findings, recovery records) since the previous update."""
        seen = {}
        new = []
        for f in findings:
            k = f.key()
            if k in seen:
                continue
            seen[k] = f
            if k not in self.active:
                self.active[k] = f
                new.append(f)
        still_stuck = {(f.comm, f.seq, tuple(f.ranks)) for f in seen.values()}
        gone = [k for k in self.active if k not in seen]
        recovered = [recovery_record(self.active[k], now) for k in gone
                     if (k[1], k[2], k[3]) not in still_stuck]
        for k in gone:
            del self.active[k]
        return new, recovered
