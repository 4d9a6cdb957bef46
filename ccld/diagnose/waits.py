"""Who waits for whom: each rank's blocking operation, across the collectives and p2p ops of all of
its job's communicators, and the chains of waits followed to the ranks at their heads.

A rank is *blocked* in its newest operation (the last it entered or posted, on any communicator of
its job) while that operation is not over on it: a collective it entered and did not end, or a p2p
op it posted whose wait has not returned. What it waits for:
  - a collective: the members that have not entered it; when every member has, nobody (the transfer
    itself is stuck: a link, or a rank stopped inside; hang.py judges that collective);
  - a send to / recv from P: P when P has not posted the matching recv / send toward it; when P has
    (both sides posted, neither over) nobody (the transfer is stuck).
A chain follows the ranks waited for, their blocking operations and whom those wait for; its *head*
is a rank that waits for nobody: it is computing, asleep, in I/O, stopped, dead, or stuck inside a
transfer. The heads are the culprits of a hang; everyone on the way is a victim. A chain that comes
back to a rank already on it is a deadlock (a cycle of waits), which has no head.
The detectors blame the heads (hang.py for collectives, p2phang.py for p2p ops); `resolve` then makes
one finding of a job's hang findings that name the same ranks (a stage that never sends blocks its
neighbours in send and recv, and the ranks behind them in the loss all-reduce: one problem, one line).
Times: Unix seconds.
"""
from __future__ import annotations

import collections
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

from ccld.timeline.p2p import COMPLEMENT, P2POp
from ccld.timeline.records import Comm, CollView
from ccld.timeline.timeline import Timeline
from ccld.diagnose.findings import Finding, short_comm

MAX_HOPS = 8          # depth of a chain followed from one waited-for rank
MAX_VISITED = 256     # ranks looked at while following the chains of one finding
ALSO_KEPT = 8         # merged findings described in the kept one's evidence


@dataclass
class Blocked:
    """What one rank is blocked in right now."""
    rank: int
    comm: Comm
    since: float                      # when it began waiting (entered / began its wait)
    waits_for: List[int]              # global ranks; empty: the operation itself is stuck
    view: Optional[CollView] = None   # a collective ...
    op: Optional[P2POp] = None        # ... or a p2p op
    peer: Optional[int] = None        # p2p: the peer's global rank
    peer_posted: bool = False         # p2p: the peer posted the matching op (the transfer is stuck)

    def label(self) -> str:
        if self.op is not None:
            words = "send to" if self.op.op == "send" else "recv from"
            return f"{words} rank {self.peer} ({short_comm(self.comm.id)} #{self.op.seq})"
        v = self.view
        return f"{v.ops.get(self.rank) or v.op} seq {v.seq} ({short_comm(self.comm.id)})"

    def hop(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"rank": self.rank, "in": self.label(), "comm": self.comm.id,
                               "since": round(self.since, 6), "waits_for": self.waits_for[:16]}
        if self.op is not None:
            out.update(op=self.op.op, peer=self.peer, p2p_seq=self.op.seq, peer_posted=self.peer_posted)
        else:
            out.update(op=self.view.ops.get(self.rank) or self.view.op, seq=self.view.seq)
        return out


# Timeline -> (epoch, key, (job, rank) -> the communicators it is a member of, in tl.comms' order)
_MEMBERSHIP: "weakref.WeakKeyDictionary[Timeline, Tuple[Any, Any, Dict[Tuple[str, int], List[Comm]]]]" = \
    weakref.WeakKeyDictionary()


def comms_of(tl: Timeline, job: str, rank: int) -> List[Comm]:
    """The communicators of `job` that `rank` is a member of: the only ones that can hold its
    collectives or p2p ops (entering or posting makes it one), in the timeline's order. The questions
    here are asked for every rank a finding names; scanning every communicator for each was
    O(ranks x communicators) a tick (seen: 1.2 s at 4,096 ranks and 513 communicators). The index is
    checked once per ingested event count and rebuilt when a communicator (the object: a reset makes
    a new one), its job or its number of members changed."""
    epoch = (len(tl.comms), sum(tl.events_by_kind.values()))
    got = _MEMBERSHIP.get(tl)
    if got is not None and got[0] == epoch:
        return got[2].get((job, rank), [])
    # the objects themselves (a reset replaces a communicator by a new one of the same size; the index
    # holds the old ones, so their ids cannot be reused while it is compared), their jobs and sizes
    key = tuple((id(c), c.job, len(c.members)) for c in tl.comms.values())
    if got is not None and got[1] == key:
        index = got[2]
    else:
        index = {}
        for c in tl.comms.values():
            for r in c.members:
                index.setdefault((c.job, r), []).append(c)
    _MEMBERSHIP[tl] = (epoch, key, index)
    return index.get((job, rank), [])


def _newest_enter(tl: Timeline, job: str, rank: int) -> Tuple[float, Optional[Tuple[Comm, CollView]]]:
    """(when `rank` last entered a collective on any communicator of `job`, that collective if it is
    still open on it)."""
    best, got = float("-inf"), None
    for c in comms_of(tl, job, rank):
        last = c.last_entered_of(rank)
        if last is None or last[2] <= best:
            continue
        best = last[2]
        view = c.colls.get(last[0])
        got = (c, view) if view is not None and rank not in view.end else None
    return best, got


def _current_p2p(tl: Timeline, job: str, rank: int, after: float) -> List[Tuple[Comm, P2POp]]:
    """`rank`'s open p2p ops posted at or after `after` and after the newest of its ops that are
    over: the batch it is waiting on (an op posted before one that is over was never waited for)."""
    mine = [c for c in comms_of(tl, job, rank) if c.p2p is not None]
    done = float("-inf")
    for c in mine:
        done = max(done, c.p2p.last_done.get(rank, float("-inf")))
    cut = max(after, done)
    return [(c, op) for c in mine for op in c.p2p.open_ops(rank) if op.posted >= cut]


def blocked(tl: Timeline, job: str, rank: int) -> Optional[Blocked]:
    """What `rank` is blocked in, or None (it is between operations: computing, asleep, ...)."""
    entered, coll = _newest_enter(tl, job, rank)
    ops = _current_p2p(tl, job, rank, entered)
    if ops:
        waiting, stuck = [], []
        for comm, op in ops:
            peer = tl.global_of(comm, op.peer)
            mine = tl.group_of(comm, rank)
            posted = bool(peer is not None and mine is not None
                          and comm.p2p.open_toward(peer, COMPLEMENT[op.op], mine))
            (stuck if posted or peer is None else waiting).append((op.blocked_from(), op.seq, comm, op, peer, posted))
        if waiting:  # the batch waits on the peers that have not posted their side
            waiting.sort(key=lambda x: (x[0], x[1]))
            since, _, comm, op, peer, _ = waiting[0]
            return Blocked(rank, comm, since, sorted({w[4] for w in waiting}), op=op, peer=peer)
        stuck.sort(key=lambda x: (x[0], x[1]))
        since, _, comm, op, peer, _ = stuck[0]
        return Blocked(rank, comm, since, [], op=op, peer=peer, peer_posted=True)
    if coll is not None:
        comm, view = coll
        missing = tl.expected_members(comm.id) - view.enter.keys()
        return Blocked(rank, comm, entered, sorted(missing), view=view)
    return None


@dataclass
class Heads:
    heads: List[int]                                          # the culprits; the cycle's ranks for a deadlock
    hops: List[Dict[str, Any]] = field(default_factory=list)  # every blocked rank met, in order
    cycle: bool = False                                       # a deadlock: the chains only go round, no head


def follow(tl: Timeline, job: str, ranks: List[int]) -> Heads:
    """The heads of the chains that start at `ranks` (the ranks a detector found missing). When the
    chains only go round (a deadlock), the ranks on the cycle are the answer, with cycle=True."""
    if len(ranks) > MAX_VISITED:
        return Heads(sorted(ranks))  # a crowd is missing: following each would be the tick's whole cost
    heads: List[int] = []
    hops: List[Dict[str, Any]] = []
    on_cycle: Set[int] = set()
    seen: Set[int] = set()
    todo = collections.deque((r, 0, ()) for r in ranks)
    while todo and len(seen) < MAX_VISITED:
        r, depth, path = todo.popleft()
        if r in path:
            on_cycle.update(path[path.index(r):])
            continue
        if r in seen:
            continue
        seen.add(r)
        rec = tl.rank_record(job, r)
        dead = rec is not None and (rec.exited() or rec.stopped())
        b = None if dead else blocked(tl, job, r)  # a dead or stopped rank waits for nobody: it is a head
        nxt = [q for q in b.waits_for if q != r] if b is not None else []
        if not nxt or depth >= MAX_HOPS:
            heads.append(r)
            continue
        hops.append(b.hop())
        todo.extend((q, depth + 1, path + (r,)) for q in nxt)
    if heads:  # victims may wait on each other on the way (a tp pair in its all-reduce): no deadlock
        return Heads(sorted(set(heads)), hops, False)
    return Heads(sorted(on_cycle or set(ranks)), hops, True)


def resolve(findings: List[Finding]) -> List[Finding]:
    """One finding for the hang findings of one job that name the same ranks with the same class
    (the detectors have put them on the heads of their chains already), and one for the informational
    pauses of the same ranks: the one that waits on them directly, longest waiting, with the others in
    its evidence (`also_waiting`)."""
    out: List[Finding] = []
    groups: Dict[Tuple[str, str, Tuple[int, ...]], List[Finding]] = {}
    for f in findings:
        if f.kind == "hang":
            groups.setdefault((f.job, f.cls, tuple(f.ranks)), []).append(f)
        elif f.evidence.get("reason") == "pause":  # informational: the same ranks' pause seen from two ops
            groups.setdefault((f.job, "pause", tuple(f.ranks)), []).append(f)
        else:
            out.append(f)
    for group in groups.values():
        group.sort(key=lambda f: ("blamed_through" in f.evidence, f.onset_at, f.comm, f.seq))
        kept, rest = group[0], group[1:]
        if rest:
            kept.evidence = dict(kept.evidence, also_waiting=[
                {"comm": g.comm, "seq": g.seq, "op": g.op, "onset_at": g.onset_at,
                 "waiting": g.evidence.get("waiting"), "p2p": g.evidence.get("p2p")} for g in rest[:ALSO_KEPT]])
        out.append(kept)
    return out
