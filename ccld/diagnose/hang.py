"""Hang detection: which ranks keep a communicator's newest collective from finishing.

For each communicator, look at the highest seq S any member entered:
  (a) some expected members have not entered S while the others wait longer than the threshold
      -> "not-entered" naming exactly those ranks ("fault" when one of them is stopped or exited);
  (b) everyone entered S but some have not finished it for longer than the threshold
      -> "fault": the stopped/exited members if any, else the ranks that never started (or never
      finished) it. Which link is to blame is for a later localiser.
A collective every member entered and finished is never a finding, and neither is a pause where all
ranks are between collectives (nobody entered S+1).

Thresholds adapt to the job: max(floor_s, k x the largest arrival spread (last enter - first enter))
for (a), max(floor_s, k x the largest duration (last end - last enter)) for (b), over the
communicator's collectives completed in the last hour (Timeline.recent_peaks), so a rank that
regularly arrives late (checkpointing on rank 0) is not called hung. Times: Unix seconds.
A rank whose agent went silent (killed, partitioned) would look like a rank that has not entered,
so a communicator with such a member is not judged until its agent speaks again (AGENT_SILENT_S).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Set

from ccld.collector.timeline import Comm, CollView, Timeline
from ccld.diagnose.findings import STATE_NAMES, Finding

FLOOR_S = 5.0   # never call a hang before this: agents ship every 100 ms; 5 s is far above any jitter
K = 4.0         # x the job's own worst recent spread/duration
EVIDENCE_RANKS = 16   # ranks described in full in one finding; `ranks` itself always lists every culprit
AGENT_SILENT_S = 3.0  # agents send a frame every 100 ms; 3 s without one means we are blind there


def blind_members(tl: Timeline, comm: Comm, members: Set[int], now: float) -> List[int]:
    """Members whose agent has been silent for longer than AGENT_SILENT_S."""
    out = []
    for r in members:
        rec = tl.rank_record(comm.job, r)
        if rec is None or rec.exited():
            continue
        if tl.agent_is_silent(rec.agent, now, AGENT_SILENT_S):
            out.append(r)
    return sorted(out)


def _r(x: Optional[float], nd: int = 6) -> Optional[float]:
    return None if x is None else round(x, nd)


def rank_evidence(tl: Timeline, comm: Comm, rank: int, now: float) -> Dict[str, Any]:
    """What `rank` is doing, as far as the timeline knows (JSON-ready)."""
    out: Dict[str, Any] = {"rank": rank}
    last = comm.last_entered.get(rank)
    out["last_entered"] = None if last is None else {"seq": last[0], "op": last[1], "at": _r(last[2])}
    rec = tl.rank_record(comm.job, rank)
    if rec is None:
        out["seen"] = False
        return out
    out.update(seen=True, pid=rec.pid, node=rec.node, state=rec.state,
               state_name=STATE_NAMES.get(rec.state, "") if rec.state else "", wchan=rec.wchan,
               cpu_ns=rec.cpu_ns if rec.cpu_ns >= 0 else None, cpu_busy=_r(rec.cpu_busy, 3),
               state_age_s=_r(now - rec.state_at, 3) if rec.state_at is not None else None,
               stopped=rec.stopped(), exited_at=_r(rec.exited_at), exit_reason=rec.exit_reason or None,
               last_event_at=_r(rec.last_event_at), agent=rec.agent,
               agent_silent_s=_r(tl.agent_silent_s(rec.agent, now), 3))
    if rec.last_p2p is not None:
        op, peer, at = rec.last_p2p
        out["last_p2p"] = {"op": op, "peer": peer, "at": _r(at)}
    loss = {k: v for k, v in tl.agent_loss.get(rec.agent, {}).items() if v}
    if loss:
        out["agent_loss"] = loss  # events of this rank may have been lost: weigh the finding accordingly
    return out


def _dead(tl: Timeline, comm: Comm, ranks: Set[int]) -> List[int]:
    out = []
    for r in ranks:
        rec = tl.rank_record(comm.job, r)
        if rec is not None and (rec.stopped() or rec.exited()):
            out.append(r)
    return sorted(out)


def _why_dead(tl: Timeline, comm: Comm, ranks: List[int]) -> str:
    recs = [tl.rank_record(comm.job, r) for r in ranks]
    return "exited" if all(r is not None and r.exited() for r in recs) else "stopped"


def check_comm(tl: Timeline, comm: Comm, now: float, floor_s: float = FLOOR_S, k: float = K) -> Optional[Finding]:
    """The hang finding for one communicator at time `now`, or None."""
    seq = comm.max_seq
    view: Optional[CollView] = comm.colls.get(seq) if seq >= 0 else None
    expected = tl.expected_members(comm.id)
    if view is None or len(expected) < 2 or not view.enter:
        return None  # a group of one cannot wait on a peer
    if blind_members(tl, comm, expected, now):
        return None  # we cannot tell "has not entered" from "its events cannot reach us"
    spread_peak, dur_peak = tl.recent_peaks(comm.id, now)
    entered = expected & view.enter.keys()
    missing = expected - entered
    base = {"expected": len(expected), "failed": {str(r): e for r, e in sorted(view.failed.items())} or None}
    if missing:
        onset = min(view.enter[r] for r in entered) if entered else view.first_enter()
        threshold = max(floor_s, k * spread_peak)
        if now - onset <= threshold:
            return None
        dead = _dead(tl, comm, missing)
        blamed = dead or sorted(missing)
        evidence = dict(base, reason=_why_dead(tl, comm, dead) if dead else "not-entered",
                        waited_s=round(now - onset, 3), threshold_s=round(threshold, 3),
                        learned_spread_s=round(spread_peak, 6), waiting=sorted(entered),
                        also_missing=sorted(missing - set(blamed)) or None,
                        ranks=[rank_evidence(tl, comm, r, now) for r in blamed[:EVIDENCE_RANKS]])
        return Finding(kind="hang", cls="fault" if dead else "not-entered", ranks=blamed, comm=comm.id,
                       seq=seq, op=view.op, onset_at=onset, detected_at=now, evidence=evidence, job=comm.job)
    not_ended = expected - view.end.keys()
    if not not_ended:
        return None  # completed: everyone is between collectives
    onset = max(view.enter[r] for r in expected)
    threshold = max(floor_s, k * dur_peak)
    if now - onset <= threshold:
        return None
    dead = _dead(tl, comm, expected)
    started = expected & view.start.keys()
    if dead:
        blamed, reason = dead, _why_dead(tl, comm, dead)
    elif started and expected - started:
        blamed, reason = sorted(expected - started), "not-started"
    else:
        blamed, reason = sorted(not_ended), "not-finished"
    evidence = dict(base, reason=reason, waited_s=round(now - onset, 3), threshold_s=round(threshold, 3),
                    learned_duration_s=round(dur_peak, 6), finished=sorted(expected - not_ended),
                    not_finished=sorted(not_ended),
                    started=sorted(started) if view.start else None,
                    note="all ranks entered; which link is at fault is not localised yet",
                    ranks=[rank_evidence(tl, comm, r, now) for r in blamed[:EVIDENCE_RANKS]])
    return Finding(kind="hang", cls="fault", ranks=blamed, comm=comm.id, seq=seq, op=view.op,
                   onset_at=onset, detected_at=now, evidence=evidence, job=comm.job)


def find_hangs(tl: Timeline, now: float, floor_s: float = FLOOR_S, k: float = K) -> List[Finding]:
    out = []
    for comm in list(tl.comms.values()):
        f = check_comm(tl, comm, now, floor_s, k)
        if f is not None:
            out.append(f)
    return out
