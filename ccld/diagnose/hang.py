"""Hang detection: which ranks keep a communicator's newest collective from finishing.

For each communicator, look at the highest seq S any member entered:
  (f) some member's library reported an error for S -> "fault" at once (no threshold: an error is
      not a wait): the members that neither finished nor failed (a rank that died inside, or never
      came), else the failed ranks themselves. When several stopped unfinished (the launcher stops
      the others right after the first death), `died_first` keeps the one the failed ranks' errors
      say they lost the connection to, else drops those seen alive after the fault, else orders
      their exits (deaths.py);
  (a) some expected members have not entered S while the others wait longer than the threshold
      -> "not-entered" naming exactly those ranks ("fault" when one of them is stopped or exited),
      with what each is doing instead (`evidence.doing`): inside a collective of another
      communicator (and whom that one waits for, following the chain; a cycle is a
      cross-communicator deadlock), blocked in I/O, busy on CPU, asleep, stopped, exited;
  (b) everyone entered S but some have not finished it for longer than the threshold
      -> "fault": the stopped/exited members if any, else the ranks that never started (or never
      finished) it. Which link is to blame is `linkfaults.find_link_faults`'s question.
A collective every member entered and finished is never a finding, and neither is a pause where all
ranks are between collectives (nobody entered S+1).

How long "longer than the threshold" is (adapted to the job's own waits, and not judged at all while
a member's agent is silent) is thresholds.py's. A missing rank that is working (busy on CPU or in disk
I/O, e.g. writing a checkpoint: activity.py) while the others wait gets BUSY_FLOOR_S instead of the
floor: until then it is an informational `comp-slow` "pause" finding (find_pauses), not a hang. What
each named rank is doing is evidence.py's; in (b), how long each call waited for its work to start
(NCCL: the kernel's launch and queueing) against the communicator's usual, launch.py's. Times: Unix
seconds.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Set

from ccld.timeline.records import Comm, CollView
from ccld.timeline.timeline import Timeline
from ccld.diagnose import waits
from ccld.diagnose.activity import Activity, _working
from ccld.diagnose.deaths import _dead, _first_error, _why_dead, crashed, died_first, job_stopped
from ccld.diagnose.evidence import EVIDENCE_RANKS, _r, _ranks_words, _summary, listed, rank_evidence, wait_chain
from ccld.diagnose.findings import Finding
from ccld.diagnose.launch import queue_delays
from ccld.diagnose.thresholds import BUSY_FLOOR_S, K, Blindness, blind_members, floor_for

FAILED_GRACE_S = 1.0  # after the first error, wait this long for the other ranks' ends to arrive
ENDLESS_AFTER = 3     # a communicator with this many collectives entered by all and none ever ended has a
                      # source that reports no ends (NCCL's API probes without CUPTI or the profiler plugin)
NOTE_AFTER_S = 1.0    # waited-for ranks are sampled from this far into a wait (normal arrivals take ms) ...
NOTE_MAX_RANKS = 64   # ... when at most this many are missing (a few ranks hold the others: the pause case)


def _failed(tl: Timeline, comm: Comm, view: CollView, expected: Set[int], now: float,
            base: Dict[str, Any]) -> Optional[Finding]:
    first = min(view.end[r] for r in view.failed if r in view.end)
    if now - first < FAILED_GRACE_S:
        return None
    no_end = expected - view.end.keys()
    failed = set(view.failed)
    order = None
    how: Dict[str, Any] = {}
    if no_end:
        # Gloo reports an error on every rank that lost a peer; the one that neither finished nor
        # failed is where it started (it died, was stopped, or never came). The launcher stops the
        # other ranks within ~0.1 s of the first death, often before they notice a peer is gone, so
        # several may qualify: a rank that never entered is likelier the first than one waiting
        # inside, and died_first sorts out the rest where the events allow.
        dead = _dead(tl, comm, no_end)
        candidates = dead or sorted(no_end)
        outside = [r for r in candidates if r not in view.enter]
        blamed = outside if outside and len(outside) < len(candidates) else candidates
        if len(blamed) > 1:
            since, erred, named = _first_error(tl, comm)
            blamed, how = died_first(tl, comm, blamed, min(first, since) if since is not None else first,
                                     erred | failed, named)
        dead = [r for r in dead if r in blamed]
        if len(blamed) > 1:
            order = "unknown: these ranks all stopped without finishing, too close together to order"
        reason = _why_dead(tl, comm, dead) if dead else "peers-failed"
    else:
        dead = _dead(tl, comm, failed)
        blamed, reason = dead or sorted(failed), "failed"
    details = [rank_evidence(tl, comm, r, now) for r in blamed[:EVIDENCE_RANKS]]
    evidence = dict(base, reason=reason, failed_at=_r(first), failed_ranks=listed(failed), n_failed=len(failed),
                    never_ended=listed(no_end) or None, n_entered=len(view.enter.keys() & expected),
                    sizes_known=bool(view.sizes), death_order=order, ranks=details, summary=_summary(details, reason),
                    note="the library reported errors on the ranks that lost a peer during this collective; "
                         "a rank that died inside it (killed, out of memory, or aborted by the library, e.g. "
                         "on a message larger than expected: a tensor size mismatch) is named"
                         + ("; no tensor sizes were recorded for this collective, so a size mismatch cannot "
                            "be told apart" if not view.sizes else ""))
    if how:
        evidence["outlived_fault"] = how  # the other ranks that stopped unfinished, and why they are not named
    return Finding(kind="hang", cls="fault", ranks=blamed, comm=comm.id, seq=view.seq, op=view.op,
                   onset_at=first, detected_at=now, evidence=evidence, job=comm.job)

def check_comm(tl: Timeline, comm: Comm, now: float, floor_s: Optional[float] = None, k: float = K,
               activity: Optional[Activity] = None, blind: Optional[Blindness] = None) -> Optional[Finding]:
    """The hang (kind "hang") or pause (kind "slow", informational) finding for one communicator
    at time `now`, or None."""
    seq = comm.max_seq
    view: Optional[CollView] = comm.colls.get(seq) if seq >= 0 else None
    if view is None or (view.completed_at is not None and not view.failed) or not view.entered():
        return None  # the common case (completed), answered without looking at any rank
    expected = tl.expected_members(comm.id)
    if len(expected) < 2:
        return None  # a group of one cannot wait on a peer
    if job_stopped(tl, comm, expected):
        return None  # its launcher stopped every member (a restart): nobody waits on anybody
    base = {"expected": len(expected), "failed": {str(r): e for r, e in sorted(view.failed.items())} or None}
    if view.failed:
        return _failed(tl, comm, view, expected, now, base)
    if blind_members(tl, comm, expected, now, blind):
        return None  # we cannot tell "has not entered" from "its events cannot reach us"
    spread_peak, dur_peak = tl.recent_peaks(comm.id, now)
    entered = expected & view.enter.keys()
    missing = expected - entered
    if len(missing) > NOTE_MAX_RANKS:
        # A crowd of members no agent has ever reported (a frame announcing a huge world, or a job
        # traced on a few of its nodes): "not entered" cannot be told from "not traced" for them, and
        # naming each one every tick is the tick's whole cost. Judge the members that are seen.
        unseen = {r for r in missing if tl.rank_record(comm.job, r) is None}
        if len(unseen) > NOTE_MAX_RANKS:
            if not comm.unseen_noted:
                tl.anomalies["unseen-members-not-judged"] += 1
                comm.unseen_noted = True
            missing = missing - unseen
            if not missing:
                return None
    if missing:
        enter = view.enter
        if len(entered) == len(enter):  # every rank that entered is a member (the usual case): no Python per rank
            onset = view.first_enter()
        else:
            onset = min(enter[r] for r in entered) if entered else view.first_enter()
        threshold = max(floor_for(floor_s, comm.first_done_at, now, comm.completed), k * spread_peak)
        if activity is not None and now - onset > NOTE_AFTER_S and len(missing) <= NOTE_MAX_RANKS:
            for r in missing:  # from early in the wait, so "working" is judged over all of it
                rec = tl.rank_record(comm.job, r)
                if rec is not None:
                    activity.note(rec)
        gone = crashed(tl, comm, missing)
        if now - onset <= threshold and not gone:
            return None
        # The missing ranks may themselves wait for others (in a send/recv, or another communicator's
        # collective): the culprits are the heads of those chains, and whether they are dead or working
        # is what decides the class.
        chain = waits.follow(tl, comm.job, sorted(missing))
        culprits = set(chain.heads)
        if activity is not None and culprits != missing and len(culprits) <= NOTE_MAX_RANKS:
            for r in culprits:
                rec = tl.rank_record(comm.job, r)
                if rec is not None:
                    activity.note(rec)
        dead = gone or _dead(tl, comm, culprits)  # the launcher's stops after a crash are its consequences
        busy_threshold = max(BUSY_FLOOR_S, k * spread_peak)
        pause = not dead and now - onset <= busy_threshold and _working(tl, comm, culprits, onset, activity)
        blamed = dead or sorted(culprits)
        details = [rank_evidence(tl, comm, r, now) for r in blamed[:EVIDENCE_RANKS]]
        reason = _why_dead(tl, comm, dead) if dead else "pause" if pause else "not-entered"
        evidence = dict(base, reason=reason, waited_s=round(now - onset, 3), threshold_s=round(threshold, 3),
                        learned_spread_s=round(spread_peak, 6), waiting=listed(entered), n_waiting=len(entered),
                        also_missing=listed(missing - set(blamed)) or None, ranks=details,
                        summary=_summary(details, reason))
        if culprits != missing and not chain.cycle:
            evidence["blamed_through"] = {"missing": listed(missing), "chain": chain.hops[:EVIDENCE_RANKS]}
            evidence["summary"] += "; the others wait for it through a chain"
        if chain.cycle:
            evidence["deadlock"] = True
        if pause:
            # what it is busy with flips between CPU and disk from sample to sample: not news
            evidence.update(informational=True, hang_after_s=round(busy_threshold, 3),
                            summary=f"pause: {_ranks_words(blamed)} working outside collectives",
                            note=f"the missing rank{'s are' if len(blamed) > 1 else ' is'} busy outside "
                                 "collectives (on CPU or in disk I/O) while the others wait: a checkpoint-"
                                 f"like pause, not a hang unless it lasts {busy_threshold:.0f} s")
            return Finding(kind="slow", cls="comp-slow", ranks=blamed, comm=comm.id, seq=seq, op=view.op,
                           onset_at=onset, detected_at=now, evidence=evidence, job=comm.job)
        if not dead:
            chains = {}
            for r in blamed[:EVIDENCE_RANKS]:
                hops, cycle = wait_chain(tl, comm, view, r)
                if hops:
                    chains[str(r)] = {"hops": hops, "deadlock": cycle}
            if chains:
                evidence["wait_chains"] = chains
                evidence["deadlock"] = evidence.get("deadlock", False) or any(c["deadlock"] for c in chains.values())
        return Finding(kind="hang", cls="fault" if dead else "not-entered", ranks=blamed, comm=comm.id,
                       seq=seq, op=view.op, onset_at=onset, detected_at=now, evidence=evidence, job=comm.job)
    not_ended = expected - view.end.keys()
    if not not_ended:
        return None  # completed: everyone is between collectives
    if comm.first_done_at is None and seq >= ENDLESS_AFTER:
        return None  # its source reports no completions (NCCL's API probes alone): "inside" is "in flight"
    onset = max(view.enter[r] for r in expected)
    threshold = max(floor_for(floor_s, comm.first_done_at, now, comm.completed), k * dur_peak)
    if now - onset <= threshold:
        return None
    dead = _dead(tl, comm, expected)
    started = expected & view.start.keys()
    how: Dict[str, Any] = {}
    if len(dead) > 1:  # killed inside, then the launcher stopped the others before any error came
        since, erred, named = _first_error(tl, comm)
        dead, how = died_first(tl, comm, dead, since, erred, named)
    if dead:
        blamed, reason = dead, _why_dead(tl, comm, dead)
    elif started and expected - started:
        blamed, reason = sorted(expected - started), "not-started"
    else:
        blamed, reason = sorted(not_ended), "not-finished"
    details = [rank_evidence(tl, comm, r, now) for r in blamed[:EVIDENCE_RANKS]]
    evidence = dict(base, reason=reason, waited_s=round(now - onset, 3), threshold_s=round(threshold, 3),
                    learned_duration_s=round(dur_peak, 6), finished=listed(expected - not_ended),
                    not_finished=listed(not_ended), n_not_finished=len(not_ended),
                    started=listed(started) if view.start else None,
                    note="all ranks entered; which link is at fault is not localised yet",
                    ranks=details, summary=_summary(details, reason))
    if how:
        evidence["outlived_fault"] = how
    queued = queue_delays(comm, view, expected, now)
    if queued is not None:
        evidence["queued"] = queued  # enter -> start per rank, and the communicator's usual (launch.py)
    return Finding(kind="hang", cls="fault", ranks=blamed, comm=comm.id, seq=seq, op=view.op,
                   onset_at=onset, detected_at=now, evidence=evidence, job=comm.job)


def check_all(tl: Timeline, now: float, floor_s: Optional[float] = None, k: float = K,
              activity: Optional[Activity] = None) -> List[Finding]:
    """Every communicator's hang or pause finding (both kinds; the facade splits them). `activity`
    (the Diagnoser's) judges a waited-for rank over its whole wait; without it, from one sample."""
    out = []
    blind: Optional[Blindness] = None
    for comm in list(tl.comms.values()):
        seq = comm.max_seq
        view = comm.colls.get(seq) if seq >= 0 else None
        if view is None or (view.completed_at is not None and not view.failed) or not view.entered():
            continue  # check_comm's first test, without the call: most communicators, most ticks
        if blind is None:
            blind = Blindness(tl, now)
        f = check_comm(tl, comm, now, floor_s, k, activity, blind)
        if f is not None:
            out.append(f)
    if activity is not None:
        activity.prune(now)
    return out


def find_hangs(tl: Timeline, now: float, floor_s: Optional[float] = None, k: float = K) -> List[Finding]:
    return [f for f in check_all(tl, now, floor_s, k) if f.kind == "hang"]


def find_pauses(tl: Timeline, now: float, floor_s: Optional[float] = None, k: float = K) -> List[Finding]:
    """Informational: a rank busy outside collectives (checkpoint-like) while its peers wait."""
    return [f for f in check_all(tl, now, floor_s, k) if f.kind == "slow"]
