"""Detectors and localisers: questions asked of a Timeline, answered with Findings (values).

`Diagnoser` is the facade: one question-shaped method per question, each delegating to one module
and combining what they say:
  find_hangs         hang.py (not-entered, fault, stuck inside), with inconsistent.py's findings in
                     front of the hangs they explain, and links.find_link_faults replacing a hang
                     it pins on a link;
  find_inconsistent  inconsistent.py (different ops/sizes at one (comm, seq), diverged sequences);
  find_slow          slow.py (comp-slow: late arrivals) and links.find_comm_slow (comm-slow); a
                     comm-slow whose cause is one rank's CPU (its runqueue wait stands out) is a
                     comp-slow of that rank; comp- and comm-slow on one communicator are one
                     `mixed-slow` finding naming both, unless the late rank is CPU-contended and the
                     slow link is its own (one cause); plus hang.py's informational pauses (a rank
                     busy outside collectives while the others wait);
  add_stacks         stack.py (py-spy), live only, outside the caller's lock.
Printing is `findings.format_line`'s job; the lifecycle over time (open, update, resolve) is
`tracker.FindingTracker`'s; offline analysis of a store is `replay.replay`.
Callers hold the timeline's lock (if any) for find_*; the Diagnoser keeps small caches per timeline
(collectives already summarised), so use one Diagnoser per Timeline.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

from ccld.diagnose import hang, inconsistent, links, slow
from ccld.diagnose.findings import Finding


def _with_comm_slow(c: Finding, evidence, link) -> Finding:
    c.evidence = dict(c.evidence, comm_slow=evidence, comm_slow_link=link,
                      note=c.evidence.get("note", "") + "; its transfers are slow too (starved communication "
                           "threads), so the collectives through it take longer")
    return c


def mix(comp: List[Finding], comm: List[Finding]) -> List[Finding]:
    """comp-slow and comm-slow findings, with the pairs on one communicator made one mixed-slow."""
    by_comm = {f.comm: f for f in comm}
    out: List[Finding] = []
    for c in comp:
        m = by_comm.pop(c.comm, None)
        if m is None:
            out.append(c)
            continue
        if slow.explains_comm_slow(c, m):  # one cause: the late rank's CPU also starves its transfers
            out.append(_with_comm_slow(c, m.evidence, m.link))
            continue
        evidence = {"reason": "comp-and-comm", "comp_ranks": c.ranks, "comm_ranks": m.ranks, "link": m.link,
                    "comp": {k: v for k, v in c.evidence.items() if k != "ranks"}, "comm": m.evidence,
                    "ranks": c.evidence.get("ranks"),
                    "summary": f"{c.evidence.get('summary', '')}; and the collectives themselves are slow"}
        out.append(Finding(kind="slow", cls="mixed-slow", ranks=sorted(set(c.ranks) | set(m.ranks)), link=m.link,
                           comm=c.comm, seq=-1, op=m.op, onset_at=min(c.onset_at, m.onset_at),
                           detected_at=max(c.detected_at, m.detected_at), evidence=evidence, job=c.job))
    return out + list(by_comm.values())


class Diagnoser:
    def __init__(self, timeline, floor_s: float = hang.FLOOR_S, k: float = hang.K, stacks=None):
        self.timeline = timeline
        self.floor_s = floor_s
        self.k = k
        self.stacks = stacks  # a stack.StackTaker (live collector), or None (replay, tests)
        self._inconsistent = inconsistent.InconsistencyChecker()
        self._late = slow.LatenessDetector()
        self._activity = hang.Activity()
        self._pass: Optional[Tuple[float, List[Finding]]] = None  # hang.check_all of the latest `now`

    def _hang_pass(self, now: float) -> List[Finding]:
        if self._pass is None or self._pass[0] != now:
            self._pass = (now, hang.check_all(self.timeline, now, self.floor_s, self.k, self._activity))
        return self._pass[1]

    def find_inconsistent(self, now: float) -> List[Finding]:
        return self._inconsistent.find(self.timeline, now)

    def find_hangs(self, now: float) -> List[Finding]:
        """Hangs that hold at Unix time `now`: inconsistent collectives first, then the hangs they
        do not explain (a link fault in place of the hang it localises)."""
        incs = self.find_inconsistent(now)
        hangs = [h for h in self._hang_pass(now)
                 if h.kind == "hang" and not any(inconsistent.explains(i, h) for i in incs)]
        refined = links.find_link_faults(self.timeline, now, hangs)
        replaced = {(f.comm, f.seq) for f in refined}
        return incs + [h for h in hangs if (h.comm, h.seq) not in replaced] + refined

    def find_slow(self, now: float) -> List[Finding]:
        """Slowdowns that hold at `now`: comp-slow, comm-slow, mixed-slow, and informational pauses."""
        pauses = [f for f in self._hang_pass(now) if f.kind == "slow"]
        late = self._late.find(self.timeline, now)
        starved, comm = slow.contended_inside(self.timeline, links.find_comm_slow(self.timeline, now), now)
        by_comm = {f.comm: f for f in late}
        for f in starved:  # one comp-slow per comm: the lateness one, with the slow link as more evidence
            if f.comm in by_comm:
                _with_comm_slow(by_comm[f.comm], f.evidence["comm_slow"], f.evidence["link"])
            else:
                late.append(f)
        return pauses + mix(late, comm)

    def diagnose(self, now: float) -> List[Finding]:
        """Everything that holds at `now` (what the collector's tick and replay ask)."""
        return self.find_hangs(now) + self.find_slow(now)

    def add_stacks(self, findings: List[Finding]) -> None:
        """Python stacks of the findings' culprits (no-op without a StackTaker). Slow (subprocesses):
        call it without holding the timeline's lock."""
        if self.stacks is not None and findings:
            self.stacks.add_stacks(findings)

