"""Finding lifecycle: report each finding once, say when its story changes, and when it is over.

The detectors are stateless: every tick they return whatever holds at that moment. The tracker
turns that into changes (`step`): a finding whose key (class, comm, seq, ranks) was not active is
new; an active one whose evidence["summary"] changed is updated (the detectors put in the summary
only what deserves a new line, never a number that moves every tick; at most one update line per
finding per MIN_UPDATE_GAP_S); an active key that no longer comes back is recovered.
Slowdowns (slow findings with seq -1: their identity does not move with the detector's window) must
be absent for SLOW_CLEAR_S before they are recovered, so a slowdown hovering at a threshold is one
finding, not a flapping series.
Times: `now` is Unix seconds. Caveat: a hang whose blamed ranks change (rank 1 of [1, 2] arrives)
is a recovery of the old key and a new finding for the new one; that is on purpose, the line the
user read is no longer true. But when the same collective is still stuck and only the class changes
(the hung rank was then stopped or died: not-entered -> fault; a busy rank's pause became a hang),
the new finding supersedes the old one silently: nothing recovered. A slowdown of a communicator
that is now reported as another class (comm-slow -> comp-slow once the late rank is known,
comp-slow -> mixed-slow) is superseded the same way, as is a pause that became a hang, and a `spread`
verdict (kind "info", held like a slowdown) once a culprit of that communicator is named.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

from ccld.diagnose.findings import Finding, recovery_record

SLOW_CLEAR_S = 10.0      # a slowdown must be gone this long before it is called over
MIN_UPDATE_GAP_S = 5.0   # at most one "updated" line per finding this often (changes in between coalesce)


@dataclass
class Changes:
    new: List[Finding] = field(default_factory=list)
    updated: List[Dict[str, Any]] = field(default_factory=list)
    recovered: List[Dict[str, Any]] = field(default_factory=list)


def track_key(f: Finding) -> Tuple:
    """What makes two detector answers the same finding: for a hang, its class, job and culprits (the
    operation the detectors report it at may move: the collective the others wait in first, then a
    send/recv that waits on the same rank directly; waits.resolve picks one per tick); Finding.key()
    for pauses; for a slowdown (seq -1) its class and communicator only, since whom it names may
    sharpen or shift while it lasts (a link localiser that sees the link only some of the time):
    that is an update."""
    if f.kind == "hang":
        return ("hang", f.cls, f.job, tuple(f.ranks))
    return f.key() if f.seq >= 0 else (f.cls, f.comm, -1, ())


def update_record(f: Finding, now: float) -> Dict[str, Any]:
    return {"kind": "updated", "id": f.id, "class": f.cls, "ranks": list(f.ranks), "comm": f.comm, "seq": f.seq,
            "updated_at": now, "summary": (f.evidence or {}).get("summary"), "evidence": f.evidence}


class FindingTracker:
    def __init__(self, slow_clear_s: float = SLOW_CLEAR_S, min_update_gap_s: float = MIN_UPDATE_GAP_S) -> None:
        self.active: Dict[Tuple, Finding] = {}  # bounded by the detectors: a few per comm
        self.slow_clear_s = slow_clear_s
        self.min_update_gap_s = min_update_gap_s
        self._absent_since: Dict[Tuple, float] = {}
        self._said: Dict[Tuple, Tuple[Any, float]] = {}  # key -> (summary last printed, when)

    def update(self, findings: List[Finding], now: float) -> Tuple[List[Finding], List[Dict[str, Any]]]:
        """(new findings, recovery records) since the previous update (updates are in `step`)."""
        c = self.step(findings, now)
        return c.new, c.recovered

    def step(self, findings: List[Finding], now: float) -> Changes:
        out = Changes()
        seen: Dict[Tuple, Finding] = {}
        for f in findings:
            seen.setdefault(track_key(f), f)
        for k, f in seen.items():
            self._absent_since.pop(k, None)
            cur = self.active.get(k)
            story = ((f.evidence or {}).get("summary"), tuple(f.ranks), tuple(f.link or ()))
            if cur is None:
                self.active[k] = f
                self._said[k] = (story, now)
                out.new.append(f)
                continue
            if f.ranks != cur.ranks or f.link != cur.link:
                cur.ranks, cur.link = list(f.ranks), f.link   # a slowdown's culprits sharpened or moved
            if f.evidence is not cur.evidence:
                stack = (cur.evidence or {}).get("stack")
                cur.evidence = dict(f.evidence or {})   # the latest numbers; id, onset and stack stay
                if stack is not None:
                    cur.evidence["stack"] = stack
            said, at = self._said.get(k, (None, now))
            if story != said and now - at >= self.min_update_gap_s:
                self._said[k] = (story, now)
                out.updated.append(update_record(cur, now))
        still = {(f.comm, f.seq, tuple(f.ranks)) for f in seen.values()} | \
            {(f.job, tuple(f.ranks)) for f in seen.values() if f.kind == "hang"}
        for k in [k for k in self.active if k not in seen]:
            f = self.active[k]
            superseded = (f.comm, f.seq, tuple(f.ranks)) in still or (
                f.kind == "hang" and (f.job, tuple(f.ranks)) in still) or (f.kind in ("slow", "info") and any(
                g.kind == "slow" and g.comm == f.comm and g.seq == f.seq and (f.seq < 0 or set(f.ranks) <= set(g.ranks))
                for g in seen.values()))
            if f.kind in ("slow", "info") and f.seq < 0 and not superseded:
                since = self._absent_since.setdefault(k, now)
                if now - since < self.slow_clear_s:
                    continue
            del self.active[k]
            self._absent_since.pop(k, None)
            self._said.pop(k, None)
            if not superseded:
                out.recovered.append(recovery_record(f, now))
        return out
