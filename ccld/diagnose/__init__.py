"""Detectors and localisers: questions asked of a Timeline, answered with Findings (values).

`Diagnoser` is the facade: one question-shaped method per question, each delegating to one module
and combining what they say:
  find_hangs         hang.py (collectives: not-entered, fault, stuck inside) and p2phang.py (a send
                     or recv whose peer never posts its side, or that is stuck), each blaming the
                     heads of the chains of waits (waits.py), one finding per job and culprits;
                     inconsistent.py's findings in front of the hangs they explain, and
                     linkfaults.find_link_faults replacing a hang it pins on a link (TCP), and
                     nccllinks.py one it pins on an NCCL link (the profiler plugin's progress);
  find_inconsistent  inconsistent.py (different ops/sizes at one (comm, seq), diverged sequences);
  find_slow          slow.py (comp-slow: late arrivals, ranks slow together named as one), compute.py
                     (comp-slow: compute durations longer than the peers', put beside a late-arrival
                     finding of the same ranks), busy.py (comp-slow: a rank whose own work
                     grew while the others wait longer, e.g. a pipeline stage), commslow.find_comm_slow
                     and p2pslow.py (comm-slow: collectives, or one stream's p2p transfers); a
                     comm-slow whose cause is one rank's CPU (its runqueue wait stands out) is a
                     comp-slow of that rank; comp- and comm-slow on one communicator are one
                     `mixed-slow` finding naming both, unless the late rank is CPU-contended and the
                     slow link is its own (one cause); plus hang.py's informational pauses (a rank
                     busy outside collectives while the others wait), and one `spread` verdict (kind
                     "info", from slow.py or compute.py) per job that has no culprit: the waiting
                     moves from rank to rank;
  add_stacks         stack.py (py-spy), live only, outside the caller's lock.
A finding on a communicator joined from per-process NCCL streams (timeline/align.py) says how, in
evidence["alignment"] (`with_alignment`). Printing is `findings.format_line`'s job; the lifecycle
over time (open, update, resolve) is `tracker.FindingTracker`'s; offline analysis of a store is
`replay.replay`.
Callers hold the timeline's lock (if any) for find_*; the Diagnoser keeps small caches per timeline
(collectives already summarised), so use one Diagnoser per Timeline.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from ccld.diagnose import (activity, busy, commslow, compute, hang, inconsistent, linkfaults, p2phang, p2pslow,
                           nccllinks, slow, thresholds, waits)
from ccld.diagnose.findings import Finding

COMM_SLOW_HOLD_S = 5.0  # a comm-slow finding must hold this long (see Diagnoser._held); slowdowns have 60 s


def _with_comm_slow(c: Finding, evidence, link) -> Finding:
    c.evidence = dict(c.evidence, comm_slow=evidence, comm_slow_link=link,
                      note=c.evidence.get("note", "") + "; its transfers are slow too (starved communication "
                           "threads), so the collectives through it take longer")
    return c


def with_alignment(tl, found: List[Finding]) -> List[Finding]:
    """`found`, each finding on a communicator that timeline/align.py joined from per-process NCCL
    streams saying so (evidence["alignment"]): a finding never rests on an alignment it does not state."""
    for f in found:
        c = tl.comms.get(f.comm)
        if c is not None and c.alignment is not None and "alignment" not in f.evidence:
            f.evidence["alignment"] = dict(c.alignment, members=list(c.alignment["members"]))
    return found


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
    def __init__(self, timeline, floor_s: Optional[float] = None, k: float = thresholds.K, stacks=None):
        """floor_s: the shortest wait called a hang, fixed; None (the default) lets it follow the job
        (thresholds.floor_for)."""
        self.timeline = timeline
        self.floor_s = floor_s
        self.k = k
        self.stacks = stacks  # a stack.StackTaker (live collector), or None (replay, tests)
        self._inconsistent = inconsistent.InconsistencyChecker()
        self._late = slow.LatenessDetector()
        self._compute = compute.ComputeDetector()
        self._busy = busy.BusyDetector()
        self._p2p_slow = p2pslow.P2PSlowDetector()
        self._comm_slow_since: Dict[Tuple, float] = {}  # comm-slow findings being held: since when
        self._activity = activity.Activity()
        self._aftermath = linkfaults.Aftermath()  # a link fault's rank that then exits: that fault's consequence
        self._lossy = linkfaults.LossyHold()  # a wait on a link lossy before it: held, unless shown already
        self._pass: Optional[Tuple[float, List[Finding]]] = None  # hang.check_all of the latest `now`

    def _hang_pass(self, now: float) -> List[Finding]:
        """Collective and p2p hangs and pauses at `now`, each on the heads of its chain of waits, one
        finding per (job, class, culprits)."""
        if self._pass is None or self._pass[0] != now:
            tl = self.timeline
            found = hang.check_all(tl, now, self.floor_s, self.k, self._activity) + \
                p2phang.check_all(tl, now, self.floor_s, self.k, self._activity)
            self._pass = (now, waits.resolve(found))
        return self._pass[1]

    def find_inconsistent(self, now: float) -> List[Finding]:
        return with_alignment(self.timeline, self._inconsistent.find(self.timeline, now))

    def find_hangs(self, now: float) -> List[Finding]:
        """Hangs that hold at Unix time `now`: inconsistent collectives first, then the hangs they
        do not explain (a link fault in place of the hang it localises)."""
        incs = self.find_inconsistent(now)
        hangs = [h for h in self._hang_pass(now)
                 if h.kind == "hang" and not any(inconsistent.explains(i, h) or self._stuck_in(i, h) for i in incs)]
        memo: linkfaults.Suspects = {}  # the hold and the link faults ask the same of a hang: once a tick
        hangs = self._lossy.hangs(self.timeline, now, hangs, memo)  # a lossy link's stall: comm-slow's, not yet a hang
        refined = linkfaults.find_link_faults(self.timeline, now, hangs, memo)
        replaced = {(f.comm, f.seq) for f in refined}
        refined += nccllinks.find_proxy_faults(self.timeline, now, [h for h in hangs if (h.comm, h.seq) not in replaced])
        replaced = {(f.comm, f.seq) for f in refined}
        found = incs + [h for h in hangs if (h.comm, h.seq) not in replaced] + refined
        return with_alignment(self.timeline, self._aftermath.keep(found, now))

    def _held(self, found: List[Finding], now: float) -> List[Finding]:
        """comm-slow findings that have held for COMM_SLOW_HOLD_S: a link that slows because one rank's
        CPU is starved (a CPU hog) shows in the link metrics within a second, before that rank's late
        arrivals or lost CPU do; held, the comp-slow comes first and mix() folds the link into it."""
        seen = {}
        for f in found:
            key = (f.job, f.comm, tuple(f.ranks), tuple(f.link or ()))
            seen[key] = self._comm_slow_since.get(key, now)
        self._comm_slow_since = seen
        return [f for f in found
                if now - seen[(f.job, f.comm, tuple(f.ranks), tuple(f.link or ()))] >= COMM_SLOW_HOLD_S]

    def _stuck_in(self, inc: Finding, h: Finding) -> bool:
        """Hang `h` (of any communicator) blames ranks that are themselves held in the inconsistent
        collective `inc` (its comm, at or after its seq): the mismatch is the one problem."""
        if h.job != inc.job or not h.ranks:
            return False
        for r in h.ranks:
            b = waits.blocked(self.timeline, h.job, r)
            if b is None or b.view is None or b.comm.id != inc.comm or b.view.seq < inc.seq:
                return False
        return True

    def find_slow(self, now: float) -> List[Finding]:
        """Slowdowns that hold at `now`: comp-slow, comm-slow, mixed-slow, informational pauses, and the
        spread verdicts of jobs with no culprit."""
        pauses = [f for f in self._hang_pass(now) if f.kind == "slow"]
        late = self._late.find(self.timeline, now)
        spread = [f for f in late if f.kind == "info"]
        late = [f for f in late if f.kind != "info"]
        for f in self._compute.find(self.timeline, now):
            if f.kind == "info":
                spread.append(f)
            else:
                late = compute.beside(f, late)
        coll_slow = commslow.find_comm_slow(self.timeline, now)
        said = {(f.job, tuple(f.ranks), tuple(f.link or ())) for f in coll_slow}
        coll_slow += [f for f in self._p2p_slow.find(self.timeline, now)
                      if (f.job, tuple(f.ranks), tuple(f.link or ())) not in said]
        starved, comm = slow.contended_inside(self.timeline, self._held(coll_slow, now), now)
        late += [f for f in self._busy.find(self.timeline, now) if not busy.explained_by(f, late)]
        by_comm = {f.comm: f for f in late}
        for f in starved:  # one comp-slow per comm: the lateness one, with the slow link as more evidence
            if f.comm in by_comm:
                _with_comm_slow(by_comm[f.comm], f.evidence["comm_slow"], f.evidence["link"])
            else:
                late.append(f)
        found = mix(late, comm)
        named = {f.job for f in found if f.ranks}
        for f in spread:  # one per job, and none where a culprit is named: the lateness's first
            if f.job not in named:
                named.add(f.job)
                found.append(f)
        return with_alignment(self.timeline, pauses + found)

    def diagnose(self, now: float) -> List[Finding]:
        """Everything that holds at `now` (what the collector's tick and replay ask)."""
        return self.find_hangs(now) + self.find_slow(now)

    def add_stacks(self, findings: List[Finding]) -> None:
        """Python stacks of the findings' culprits (no-op without a StackTaker). Slow (subprocesses):
        call it without holding the timeline's lock."""
        if self.stacks is not None and findings:
            self.stacks.add_stacks(findings)

