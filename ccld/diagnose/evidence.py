"""What a rank is doing, as a finding's evidence: shared by every detector that names ranks.

`doing`: a label and words (exited, stopped, in a p2p op, inside a collective, in I/O, busy, asleep
...); `rank_evidence`: that, with its /proc state, its last collective and its agent, JSON-ready;
`wait_chain`: the collectives a missing rank waits in, and whom those wait for (a chain that comes
back on itself is a cross-communicator deadlock). hang, p2phang, slow, busy, inconsistent and compute
describe their ranks with these: at most EVIDENCE_RANKS in full per finding, and at most MAX_LISTED
in one listed field, so a finding at 16,384 ranks stays a readable line. Times: Unix seconds.
"""
from __future__ import annotations

import heapq
from typing import Any, Dict, List, Optional, Tuple

from ccld.timeline.records import Comm, CollView, RankRecord
from ccld.timeline.timeline import Timeline
from ccld.diagnose import waits
from ccld.diagnose.activity import BUSY_CPU
from ccld.diagnose.findings import STATE_NAMES, short_comm

EVIDENCE_RANKS = 16   # ranks described in full in one finding; `ranks` itself always lists every culprit
STARVED_RUNQ = 0.5    # runqueue s per s (SchedStats) of a running rank that is waiting for a CPU more than using one
MAX_CHAIN = 8         # hops followed from a missing rank to the collective it waits in, and on
MAX_LISTED = 256      # ranks listed in one evidence field (waiting, finished, ...); its count is given too


def listed(ranks) -> List[int]:
    """At most MAX_LISTED of `ranks`, sorted: a finding at 16,384 ranks must stay a readable line."""
    ranks = ranks if isinstance(ranks, (set, frozenset, list, tuple, dict)) else list(ranks)
    return heapq.nsmallest(MAX_LISTED, ranks) if len(ranks) > 4 * MAX_LISTED else sorted(ranks)[:MAX_LISTED]


def _r(x: Optional[float], nd: int = 6) -> Optional[float]:
    return None if x is None else round(x, nd)


def open_collective(tl: Timeline, job: str, rank: int, skip: Optional[str] = None) -> Optional[Tuple[Comm, CollView]]:
    """The collective `rank` is inside right now (entered, not finished) on any communicator of
    `job` but `skip`: the newest one, or None."""
    best = None
    for c in waits.comms_of(tl, job, rank):
        if c.id == skip:
            continue
        last = c.last_entered_of(rank)
        if last is None:
            continue
        view = c.colls.get(last[0])
        if view is None or rank in view.end:
            continue
        if best is None or last[2] > best[2]:
            best = (c, view, last[2])
    return None if best is None else best[:2]


def _waits_for(tl: Timeline, comm: Comm, view: CollView) -> List[int]:
    """Whom an open collective waits for: the members that have not entered it, or, when all have,
    those that have not finished it."""
    expected = tl.expected_members(comm.id)
    missing = expected - view.enter.keys()
    return sorted(missing if missing else expected - view.end.keys())


def wait_chain(tl: Timeline, comm: Comm, view: CollView, rank: int) -> Tuple[List[Dict[str, Any]], bool]:
    """Follow `rank` (missing from `view`) to the collective it is in, whom that waits for, where
    that rank is, and so on: (hops, True when the chain comes back to a collective already on it,
    i.e. a cross-communicator deadlock)."""
    hops: List[Dict[str, Any]] = []
    seen = {(comm.id, view.seq)}
    r = rank
    for _ in range(MAX_CHAIN):
        got = open_collective(tl, comm.job, r)
        if got is None:
            return hops, False
        c, v = got
        waits = _waits_for(tl, c, v)
        hops.append({"rank": r, "comm": c.id, "seq": v.seq, "op": v.ops.get(r) or v.op,
                     "entered_at": _r(v.enter.get(r)), "waits_for": waits[:EVIDENCE_RANKS]})
        if (c.id, v.seq) in seen:
            return hops, True
        seen.add((c.id, v.seq))
        nxt = [q for q in waits if q != r]
        if not nxt:
            return hops, False
        r = nxt[0]
    return hops, False


def doing(tl: Timeline, comm: Comm, rank: int, rec: Optional[RankRecord]) -> Tuple[str, str]:
    """(label, words) for what `rank` is doing (for a rank absent from `comm`'s newest collective:
    instead): exited, stopped, in-p2p (blocked in a send or recv), inside (`comm`'s newest collective),
    in-collective (another one, on any communicator), io, cpu-starved, busy, sleeping, running,
    unknown, not-seen."""
    if rec is None:
        return "not-seen", "not reported by any agent"
    if rec.exited():
        return "exited", f"exited ({rec.exit_reason or 'exited'})"
    if rec.stopped():
        return "stopped", "stopped (SIGSTOP or a debugger)"
    b = waits.blocked(tl, comm.job, rank)
    if b is not None and b.op is not None:
        return "in-p2p", f"in {b.label()}" + (" (its peer posted too: stuck)" if b.peer_posted else "")
    got = open_collective(tl, comm.job, rank)
    if got is not None:
        c, v = got
        if c is comm and v.seq == comm.max_seq:
            return "inside", f"inside seq {v.seq} {v.ops.get(rank) or v.op} (the collective in question)"
        return "in-collective", f"in {short_comm(c.id)} seq {v.seq} {v.ops.get(rank) or v.op}"
    wchan = rec.wchan if rec.wchan and rec.wchan != "0" else ""
    if rec.state == "D":
        return "io", "blocked in I/O" + (f" ({wchan})" if wchan else "")
    runq = getattr(rec, "runq_share", None)
    if rec.state == "R" and runq is not None and runq >= STARVED_RUNQ:
        return "cpu-starved", f"runnable but waiting for a CPU ({runq:.2f} s per s) outside collectives"
    if rec.cpu_busy is not None and rec.cpu_busy >= BUSY_CPU:
        return "busy", f"busy on CPU ({100 * rec.cpu_busy:.0f}%) outside collectives"
    if rec.state in ("S", "I"):
        return "sleeping", "asleep outside collectives" + (f" ({wchan})" if wchan else "")
    if rec.state:
        return "running", f"state {rec.state} outside collectives"
    return "unknown", "no /proc state yet"


def rank_evidence(tl: Timeline, comm: Comm, rank: int, now: float) -> Dict[str, Any]:
    """What `rank` is doing, as far as the timeline knows (JSON-ready)."""
    out: Dict[str, Any] = {"rank": rank}
    last = comm.last_entered_of(rank)
    out["last_entered"] = None if last is None else {"seq": last[0], "op": last[1], "at": _r(last[2])}
    rec = tl.rank_record(comm.job, rank)
    out["doing"], out["doing_text"] = doing(tl, comm, rank, rec)
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
    if getattr(rec, "runq_share", None) is not None:
        out["runq_share"] = _r(rec.runq_share, 3)  # runnable but waiting for a CPU, s per s (SchedStats)
    if rec.last_p2p is not None:
        op, peer, at = rec.last_p2p
        out["last_p2p"] = {"op": op, "peer": peer, "at": _r(at)}
    loss = {k: v for k, v in tl.agent_loss.get(rec.agent, {}).items() if v}
    if loss:
        out["agent_loss"] = loss  # events of this rank may have been lost: weigh the finding accordingly
    return out


def _ranks_words(ranks: List[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"{len(ranks)} ranks"


def _summary(details: List[Dict[str, Any]], reason: str) -> str:
    """What a change of deserves a new line on the terminal (the tracker compares it): no numbers."""
    shown = "; ".join(f"rank {d['rank']} {d.get('doing', '?')}" for d in details[:4])
    return f"{reason}: {shown}" + (f" (+{len(details) - 4})" if len(details) > 4 else "")
