"""Hangs in point-to-point transfers: a rank blocked in a send or recv that does not complete.

For each rank whose blocking operation (waits.blocked) is a p2p op and has lasted longer than
max(floor, k x the longest wait of a p2p op completed on that communicator in the last hour), the
floor as thresholds.floor_for says (FLOOR_S, lowered once the stream has LEARN_S of history):
  - the peer has not posted its side -> `not-entered`, naming the heads of the chain the peer starts
    (the peer itself when it is not waiting on anyone; the stage at the front of a pipeline whose
    stages wait on each other), `fault` when those are stopped or dead, and an informational pause
    (`comp-slow`, as hang.py's) while they are working (CPU or disk) and the wait is under
    max(BUSY_FLOOR_S, k x the learned peak);
  - the peer has posted its side too, and neither is over -> `fault` of the pair: the transfer itself
    is stuck (a link, a stopped side); `link` is the pair (linkfaults.find_link_faults may sharpen it).
A rank that is stopped or has exited waits for nothing (its open ops are not waits). Ops that ended in
an error (gloo: the peer's connection broke) in the last FAILED_WINDOW_S make a `fault` once
FAILED_GRACE_S passed after the first: the peers they were with that are dead or stopped, else the
peer the most failures name (a rank killed in a pipeline fails its neighbours' sends and recvs).
One finding per waiting rank; waits.resolve makes one of those naming the same ranks. Findings carry
the communicator and the waiting op's p2p seq (its n on that stream) and `evidence.p2p`, so they are
never read as collectives (inconsistent.explains). Times: Unix seconds.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from ccld.timeline.records import Comm
from ccld.timeline.timeline import Timeline
from ccld.diagnose import waits
from ccld.diagnose.findings import Finding
from ccld.diagnose.activity import Activity, _working
from ccld.diagnose.deaths import _dead, _why_dead, crashed, died_first, job_stopped
from ccld.diagnose.evidence import EVIDENCE_RANKS, _summary, rank_evidence
from ccld.diagnose.hang import FAILED_GRACE_S
from ccld.diagnose.thresholds import BUSY_FLOOR_S, K, Blindness, floor_for

FAILED_WINDOW_S = 60.0  # failed ops this recent make a fault (a restarted job's old failures fall out)


def _waiters(tl: Timeline, comm: Comm) -> List[int]:
    return sorted(comm.p2p.open) if comm.p2p is not None else []


def check_comm(tl: Timeline, comm: Comm, now: float, floor_s: Optional[float] = None, k: float = K,
               activity: Optional[Activity] = None, blind: Optional[Blindness] = None) -> List[Finding]:
    out: List[Finding] = []
    ranks = _waiters(tl, comm)
    if not ranks and not comm.p2p.failed:
        return out
    if job_stopped(tl, comm, tl.expected_members(comm.id)):
        return out  # its launcher stopped every member (a restart): the failed ops are its doing
    peak = comm.p2p.recent_peak(now)
    threshold = max(floor_for(floor_s, comm.p2p.first_done_at, now), k * peak)
    failed = _failed(tl, comm, now)
    if failed is not None:
        out.append(failed)
    elif ranks:
        gone = _crashed_peers(tl, comm, now)
        if gone is not None:
            return out + [gone]
    opened = comm.p2p.open
    for r in ranks:
        ops = opened.get(r)
        if not ops or now - min(o.posted for o in ops.values()) <= min(threshold, 1.0):
            continue  # in flight for less than a second (most transfers, most ticks): nothing to weigh
        rec = tl.rank_record(comm.job, r)
        if rec is not None and (rec.exited() or rec.stopped()):
            continue  # a dead or stopped rank waits for nothing: its peers wait for it
        b = waits.blocked(tl, comm.job, r)
        if b is None or b.op is None or b.comm is not comm:
            continue  # not blocked in a p2p op of this communicator
        if blind is not None and blind.members(comm, {r} | set(b.waits_for) | ({b.peer} if b.peer is not None else set())):
            continue  # whom it waits for may only be out of our sight
        waited = now - b.since
        if activity is not None and waited > 1.0 and b.waits_for:
            for q in b.waits_for:
                rec = tl.rank_record(comm.job, q)
                if rec is not None:
                    activity.note(rec)
        if waited <= threshold:
            continue
        f = _finding(tl, comm, b, now, threshold, peak, k, activity)
        if f is not None:
            out.append(f)
    return out


def _crashed_peers(tl: Timeline, comm: Comm, now: float) -> Optional[Finding]:
    """A rank killed (deaths.crashed) while others had sends or receives open with it: named at once (the
    launcher stops the others within ~0.1 s, before the library reports an error or any threshold)."""
    gone = set(crashed(tl, comm, tl.expected_members(comm.id)))
    if not gone:
        return None
    waiting: Dict[int, Any] = {}
    for r, ops in comm.p2p.open.items():
        if r in gone:
            continue
        for o in ops.values():
            peer = tl.global_of(comm, o.peer)
            if peer in gone and (r not in waiting or o.posted < waiting[r].posted):
                waiting[r] = o
    if not waiting:
        return None
    first = min(waiting.values(), key=lambda o: o.posted)
    blamed = sorted({tl.global_of(comm, o.peer) for o in waiting.values()} & gone)
    details = [rank_evidence(tl, comm, r, now) for r in blamed[:EVIDENCE_RANKS]]
    evidence = {"reason": "exited", "waiting": sorted(waiting), "n_waiting": len(waiting), "ranks": details,
                "summary": _summary(details, "exited"),
                "p2p": {"waiter": first.rank, "op": first.op, "peer": tl.global_of(comm, first.peer),
                        "p2p_seq": first.seq, "posted_at": round(first.posted, 6)},
                "note": "killed while its peers waited in sends or receives with it"}
    return Finding(kind="hang", cls="fault", ranks=blamed, comm=comm.id, seq=first.seq, op=first.op,
                   onset_at=first.posted, detected_at=now, evidence=evidence, job=comm.job)


def _failed(tl: Timeline, comm: Comm, now: float) -> Optional[Finding]:
    recent = [o for o in comm.p2p.failed if o.ended is not None and now - o.ended <= FAILED_WINDOW_S]
    if not recent:
        return None
    first = min(o.ended for o in recent)
    if now - first < FAILED_GRACE_S:
        return None  # the other ranks' errors are still arriving
    votes: Dict[int, int] = {}
    for o in recent:
        peer = tl.global_of(comm, o.peer)
        if peer is not None:
            votes[peer] = votes.get(peer, 0) + 1
    if not votes:
        return None
    failers = sorted({o.rank for o in recent})
    dead = _dead(tl, comm, set(votes))
    how: Dict[str, Any] = {}
    if len(dead) > 1:  # the launcher stops the others right after the first death: which one was it
        dead, how = died_first(tl, comm, dead, first, set(failers), votes)
    if dead:
        blamed, reason = dead, _why_dead(tl, comm, dead)
    else:
        top = max(votes.values())
        blamed, reason = sorted(p for p, n in votes.items() if n == top), "peers-failed"
    blamed = [r for r in blamed if r not in failers] or blamed
    details = [rank_evidence(tl, comm, r, now) for r in blamed[:EVIDENCE_RANKS]]
    newest = max(recent, key=lambda o: o.ended)
    evidence = {"reason": reason, "failed_at": round(first, 6), "failed_ranks": failers, "n_failed": len(recent),
                "peers_failed_with": {str(p): n for p, n in sorted(votes.items())}, "ranks": details,
                "outlived_fault": how or None,
                "summary": _summary(details, reason),
                "p2p": {"waiter": newest.rank, "op": newest.op, "peer": tl.global_of(comm, newest.peer),
                        "p2p_seq": newest.seq, "error": newest.error},
                "note": "sends and receives with these ranks failed (the library lost its connection to them): "
                        "a rank that died, was stopped, or whose link broke"}
    return Finding(kind="hang", cls="fault", ranks=blamed, comm=comm.id, seq=newest.seq, op=newest.op,
                   onset_at=first, detected_at=now, evidence=evidence, job=comm.job)


def _finding(tl: Timeline, comm: Comm, b: waits.Blocked, now: float, threshold: float, peak: float, k: float,
             activity: Optional[Activity]) -> Optional[Finding]:
    op = b.op
    p2p: Dict[str, Any] = {"waiter": b.rank, "op": op.op, "peer": b.peer, "peer_group_rank": op.peer,
                           "p2p_seq": op.seq, "nbytes": op.nbytes if op.nbytes >= 0 else None,
                           "posted_at": round(op.posted, 6), "peer_posted": b.peer_posted}
    base: Dict[str, Any] = {"waited_s": round(now - b.since, 3), "threshold_s": round(threshold, 3),
                            "learned_wait_s": round(peak, 6), "waiting": [b.rank], "n_waiting": 1, "p2p": p2p}
    if not b.waits_for:  # both sides posted, neither is over: the transfer is stuck
        pair = sorted({b.rank, b.peer}) if b.peer is not None else [b.rank]
        dead = _dead(tl, comm, set(pair))
        blamed = dead or pair
        details = [rank_evidence(tl, comm, r, now) for r in blamed]
        reason = _why_dead(tl, comm, dead) if dead else "transfer-stuck"
        evidence = dict(base, reason=reason, ranks=details, summary=_summary(details, reason),
                        note="both sides posted this transfer and neither finished it: the link between them, "
                             "or a side stopped inside it")
        return Finding(kind="hang", cls="fault", ranks=blamed, link=None if dead or len(pair) != 2 else pair,
                       comm=comm.id, seq=op.seq, op=op.op, onset_at=b.since, detected_at=now, evidence=evidence,
                       job=comm.job)
    chain = waits.follow(tl, comm.job, b.waits_for)
    culprits = set(chain.heads)
    dead = _dead(tl, comm, culprits)
    busy_threshold = max(BUSY_FLOOR_S, k * peak)
    pause = not dead and now - b.since <= busy_threshold and _working(tl, comm, culprits, b.since, activity)
    blamed = dead or sorted(culprits)
    details = [rank_evidence(tl, comm, r, now) for r in blamed[:EVIDENCE_RANKS]]
    reason = _why_dead(tl, comm, dead) if dead else "pause" if pause else "not-entered"
    words = "recv from" if op.op == "recv" else "send to"
    evidence = dict(base, reason=reason, ranks=details, summary=_summary(details, reason),
                    note=f"rank {b.rank} waits in {words} rank {b.peer}, which has not posted its side")
    if culprits != set(b.waits_for) and not chain.cycle:
        evidence["blamed_through"] = {"missing": list(b.waits_for), "chain": chain.hops[:EVIDENCE_RANKS]}
        evidence["summary"] += "; the others wait for it through a chain"
    if chain.cycle:
        evidence["deadlock"] = True
    if pause:
        evidence.update(informational=True, hang_after_s=round(busy_threshold, 3),
                        summary=f"pause: rank{'s' if len(blamed) > 1 else ''} {', '.join(map(str, blamed))} "
                                "working outside communication",
                        note=f"rank {b.rank} waits in {words} rank {b.peer} while the ranks it waits for are "
                             "busy (on CPU or in disk I/O): a checkpoint-like pause, not a hang unless it lasts "
                             f"{busy_threshold:.0f} s")
        return Finding(kind="slow", cls="comp-slow", ranks=blamed, comm=comm.id, seq=op.seq, op=op.op,
                       onset_at=b.since, detected_at=now, evidence=evidence, job=comm.job)
    return Finding(kind="hang", cls="fault" if dead else "not-entered", ranks=blamed, comm=comm.id, seq=op.seq,
                   op=op.op, onset_at=b.since, detected_at=now, evidence=evidence, job=comm.job)


def check_all(tl: Timeline, now: float, floor_s: Optional[float] = None, k: float = K,
              activity: Optional[Activity] = None) -> List[Finding]:
    out: List[Finding] = []
    blind: Optional[Blindness] = None
    for comm in list(tl.comms.values()):
        if comm.p2p is None or not (comm.p2p.open or comm.p2p.failed):
            continue
        if blind is None:
            blind = Blindness(tl, now)
        out.extend(check_comm(tl, comm, now, floor_s, k, activity, blind))
    return out
