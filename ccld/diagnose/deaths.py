"""Ranks that stopped or died, and which of several stopped ranks started a fault.

`_dead` (stopped or exited), `crashed` (died of a signal not from its launcher: named at once),
`stopped_by_launcher` and `job_stopped` (its launcher stopped it: a victim, or the whole job was
stopped or restarted). When several members stopped without finishing (the launcher stops the others
right after the first death), `died_first` keeps the one the failed ranks' errors say they lost the
connection to (`_first_error`, LOST_RE), else drops those seen alive after the fault, else orders their
exits (EXIT_TIE_S, EXACT_TIE_S). hang.py and p2phang.py name their faults with these. Times: Unix seconds.
"""
from __future__ import annotations

import collections
import re
from typing import Any, Dict, List, Optional, Set, Tuple

from ccld.timeline.records import Comm
from ccld.timeline.timeline import Timeline
from ccld.diagnose.evidence import listed

EXIT_TIE_S = 0.1      # exits seen this close together are one /proc scan of the agent's: not ordered
EXACT_TIE_S = 0.002   # ... and, timed by the kernel (RankExit.exact), this close: killed together. A
                      # launcher stops the survivors of a death after noticing it (torchrun polls its
                      # workers every 0.1 s), so they exit milliseconds to a tenth of a second later
RECENT_FAILED = 4     # newest collectives of a communicator searched for the first error of a fault


def _dead(tl: Timeline, comm: Comm, ranks: Set[int]) -> List[int]:
    out = []
    for r in ranks:
        rec = tl.rank_record(comm.job, r)
        if rec is not None and (rec.stopped() or rec.exited()):
            out.append(r)
    return sorted(out)


def _by_launcher(tl: Timeline, comm: Comm, rank: int) -> bool:
    """`rank` exited of a signal from its own launcher (RankExit.by_launcher)."""
    rec = tl.rank_record(comm.job, rank)
    return rec is not None and rec.exited() and rec.stopped_by_launcher


def stopped_by_launcher(tl: Timeline, comm: Comm, ranks) -> List[int]:
    """Those of `ranks` that exited of a signal from their own launcher (RankExit.by_launcher)."""
    return sorted(r for r in ranks if _by_launcher(tl, comm, r))


def crashed(tl: Timeline, comm: Comm, ranks) -> List[int]:
    """Those of `ranks` that died of a signal not from their launcher (killed, out of memory, a
    segfault or abort): such a peer will not come, whatever the threshold, and when the launcher then
    stops the others at once (torchrun within ~0.1 s) there is no later moment to say it. (A rank that
    exits by itself is left to the thresholds: at a job's end ranks exit with ops still open.)"""
    out = []
    for r in ranks:
        rec = tl.rank_record(comm.job, r)
        if rec is not None and rec.exited() and rec.exit_signal and not rec.stopped_by_launcher:
            out.append(r)
    return sorted(out)


def job_stopped(tl: Timeline, comm: Comm, expected) -> bool:
    """Every member of `comm` exited of its launcher's signal: the job was stopped or restarted (an
    elastic restart, a cancelled job), which leaves its last collective open on no one's account."""
    # all() stops at the first member still there: collecting every one cost a tick with a hang open
    # at 4,096 ranks ~3 ms
    return bool(expected) and all(_by_launcher(tl, comm, r) for r in expected)


def _why_dead(tl: Timeline, comm: Comm, ranks: List[int]) -> str:
    recs = [tl.rank_record(comm.job, r) for r in ranks]
    return "exited" if all(r is not None and r.exited() for r in recs) else "stopped"


def _active_since(tl: Timeline, comm: Comm, rank: int) -> float:
    """When `rank` last did anything the probes saw: on `comm`'s collectives, or any p2p op of its."""
    rec = tl.rank_record(comm.job, rank)
    p2p = rec.last_p2p[2] if rec is not None and rec.last_p2p is not None else None
    return max(x for x in (_last_activity(comm, rank), p2p, float("-inf")) if x is not None)


def _last_activity(comm: Comm, rank: int) -> Optional[float]:
    """When `rank` last did anything on `comm` that the probes saw: entered, started or ended one of
    its two newest collectives there (the newer may be waiting while the older ends)."""
    last = comm.last_entered_of(rank)
    if last is None:
        return None
    best = last[2]
    for s in (last[0], last[0] - 1):
        v = comm.colls.get(s)
        if v is not None:
            for got in (v.start.get(rank), v.end.get(rank)):
                if got is not None and got > best:
                    best = got
    return best


LOST_RE = re.compile(r"connection to group rank (\d+) broke")  # ccld/bpf/gloo_comms.py writes it in WorkEnd.error


def _first_error(tl: Timeline, comm: Comm) -> Tuple[Optional[float], Set[int], Dict[int, int]]:
    """Over the newest RECENT_FAILED collectives: (earliest error end, ranks that reported an error,
    global rank -> how many of them say their connection to it broke). The first sign of a fault,
    who saw it, and whom they lost (a rank can fail the collective before the newest)."""
    first, who, named = None, set(), collections.Counter()
    order: Optional[List[int]] = None
    for s in range(comm.max_seq - RECENT_FAILED + 1, comm.max_seq + 1):
        v = comm.colls.get(s)
        if v is None or not v.failed:
            continue
        for r, err in v.failed.items():
            t = v.end.get(r)
            if t is not None and (first is None or t < first):
                first = t
            m = LOST_RE.search(err or "")
            if m is not None and r not in who:  # a rank's first error names the peer it lost first
                if order is None:
                    order = sorted(tl.expected_members(comm.id))  # group rank g is the g-th smallest member
                g = int(m.group(1))
                if 0 <= g < len(order):
                    named[order[g]] += 1
            who.add(r)
    return first, who, dict(named)


def died_first(tl: Timeline, comm: Comm, dead: List[int], since: Optional[float],
               erred: Set[int], named: Optional[Dict[int, int]] = None) -> Tuple[List[int], Dict[str, Any]]:
    """Of ranks that all stopped without finishing, those whose death started it: (ranks, how).

    A rank killed inside a collective is gone before its peers notice; the launcher then stops the
    others (torchrun: SIGTERM, ~0.1 s later), often before they notice too. So: ranks whose exit
    came from their launcher's signal are victims; of the rest, the rank(s) the
    failed ranks' errors say they lost the connection to (`named`, votes per rank); else a rank that
    reported an error, or did anything on `comm` after the fault's first error (`since`), outlived the
    fault and is a victim; of the rest, the one whose exit the agent saw first (not within one scan of
    another's) is the first to die. Each rule applies only when it leaves someone."""
    how: Dict[str, Any] = {}
    out = list(dead)
    stopped = stopped_by_launcher(tl, comm, out)
    if stopped and len(stopped) < len(out):  # the launcher stopped them after the others died
        out = [r for r in out if r not in stopped]
        how["stopped_by_launcher"] = listed(stopped)
        if len(out) == 1:
            return out, how
    votes = {r: n for r, n in (named or {}).items() if r in out}
    if votes:
        top = max(votes.values())
        lost = [r for r in out if votes.get(r) == top]
        if len(lost) < len(out):
            how["peers_lost_connection_to"] = {str(r): n for r, n in sorted(votes.items())}
            return sorted(lost), how
    if since is not None:
        alive_after = [r for r in out if r in erred or _active_since(tl, comm, r) >= since]
        if alive_after and len(alive_after) < len(out):
            out = [r for r in out if r not in alive_after]
            how["active_after_fault"] = listed(alive_after)
    if len(out) > 1:
        exits, exact = {}, True
        for r in out:
            rec = tl.rank_record(comm.job, r)
            if rec is not None and rec.exited_at is not None:
                exits[r] = rec.exited_at
                exact &= rec.exit_exact
        if len(exits) == len(out):
            t0 = min(exits.values())
            tie = EXACT_TIE_S if exact else EXIT_TIE_S
            early = [r for r in out if exits[r] - t0 < tie]
            if len(early) < len(out):
                how["exited_later"] = listed(r for r in out if r not in early)
                how["exit_times"] = "kernel" if exact else "agent scans"
                out = early
    return sorted(out), how
