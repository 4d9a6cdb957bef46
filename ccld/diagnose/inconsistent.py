"""Inconsistent collectives: ranks of one communicator that called different things at one seq.

c10d numbers every collective of a process group on each rank independently, so (comm, seq) is the
same call on every rank only if every rank makes the same calls in the same order. For the newest
WINDOW collectives of each communicator:
  - ranks at one (comm, seq) with different ops -> "inconsistent", naming the ranks whose op is not
    the majority's; a tie of every member (the two ranks of a pair group) is broken by the group's own
    pattern (the op its collectives repeat there), else it names every rank: no majority, no culprit;
  - same op but different sizes (count, dtype, and bytes where the timeline keeps them: NCCL's probes
    report count and dtype, gloo's the tensor's bytes) -> "inconsistent" the same way; where some
    ranks' sizes are unknown, only when a strict majority of the ranks that entered agree;
  - the evidence says whether the odd rank's sequence diverged: the communicator's ops repeat with a
    period (one training step); when the odd rank's ops equal the majority's pattern shifted by k
    seqs, it skipped (k > 0) or added (k < 0) k collectives.
A collective is judged once all expected members entered it, or GRACE_S after the first did (late
ranks cannot outvote the early ones). A completed, consistent collective is remembered as such and
not looked at again. Times: Unix seconds.
Caveat: a size mismatch is only seen where sizes reach the timeline; without them it usually makes
the library abort a rank, which hang.py reports as a fault of the rank that died.
"""
from __future__ import annotations

import collections
from typing import Any, Dict, List, Optional, Set, Tuple

from ccld.timeline.records import Comm, CollView
from ccld.timeline.timeline import Timeline
from ccld.diagnose.evidence import EVIDENCE_RANKS, rank_evidence
from ccld.diagnose.findings import Finding

WINDOW = 8            # newest collectives of a communicator checked every tick (older ones completed)
GRACE_S = 1.0         # judge a collective not everyone entered only after this long: agents ship every 0.5 s
HISTORY = 48          # collectives looked back at to learn the op pattern (a step's worth, several times)
MAX_PERIOD = 16       # longest op pattern (collectives per step) searched for
MAX_SHIFT = 3         # largest skip/addition of collectives reported


def _vote(values: Dict[int, Any]) -> Tuple[Optional[Any], List[int]]:
    """(majority value or None on a tie, ranks that differ from it; every rank on a tie)."""
    counts = collections.Counter(values.values())
    (top, n), *rest = counts.most_common()
    if rest and rest[0][1] == n:
        return None, sorted(values)
    return top, sorted(r for r, v in values.items() if v != top)


def size_text(size: Tuple) -> str:
    """(count, dtype[, nbytes]) as words: "4096 float32", "16384 B", "4096 float32, 16384 B"."""
    count, dtype, nbytes = (tuple(size) + (-1, "", -1)[len(size):])[:3]
    parts = []
    if isinstance(count, int) and count >= 0:
        parts.append(f"{count} {dtype or 'elements'}")
    elif dtype:
        parts.append(str(dtype))
    if isinstance(nbytes, int) and nbytes >= 0:
        parts.append(f"{nbytes} B")
    return ", ".join(parts) or "unknown size"


def _size_dict(size: Optional[Tuple]) -> Optional[Dict[str, Any]]:
    if size is None:
        return None
    names = ("count", "dtype", "nbytes")
    return {n: v for n, v in zip(names, size) if v not in (-1, "")}


def _majority_ops(comm: Comm, first: int, last: int) -> Dict[int, str]:
    out = {}
    for s in range(first, last + 1):
        v = comm.colls.get(s)
        if v is not None and v.ops:
            top, _ = _vote(v.ops)
            if top is not None:
                out[s] = top
    return out


def _period(maj: Dict[int, str], upto: int) -> Optional[int]:
    """Smallest P such that the majority's ops before `upto` repeat every P collectives (seen at
    least 3 times over), else None."""
    seqs = sorted(s for s in maj if s < upto)
    for p in range(1, MAX_PERIOD + 1):
        pairs = [(s, s - p) for s in seqs if s - p in maj]
        if len(pairs) >= 2 * p and all(maj[a] == maj[b] for a, b in pairs):
            return p
    return None


def _shift(comm: Comm, rank: int, seq: int, maj: Dict[int, str]) -> Optional[Dict[str, Any]]:
    """How `rank`'s ops from `seq` on line up with the majority's pattern: {'shift': k, 'period': P}
    when the shifts k in [-MAX_SHIFT, MAX_SHIFT] \\ {0} that explain them are one shift modulo the
    period (the smallest is given), else None."""
    p = _period(maj, seq)
    if p is None or p == 1:
        return None  # one op over and over: a skipped call leaves no trace in the ops

    def expected(s: int) -> Optional[str]:
        if s in maj and s < seq:
            return maj[s]
        base = [b for b in maj if b < seq and (s - b) % p == 0]
        return maj[max(base)] if base else None

    mine = {}
    for s in range(seq, comm.max_seq + 1):
        v = comm.colls.get(s)
        if v is not None and rank in v.ops:
            mine[s] = v.ops[rank]
    fits = [k for k in range(-MAX_SHIFT, MAX_SHIFT + 1)
            if k and mine and all(expected(s + k) == op for s, op in mine.items())]
    if not fits or len({k % p for k in fits}) != 1 or fits[0] % p == 0:
        return None  # nothing fits, or shifts that are not the same modulo the period: no story
    k = min(fits, key=lambda k: (abs(k), -k))  # skipping 1 and adding p-1 look alike: the smaller is likelier
    return {"shift": k, "period": p, "compared": len(mine)}


def _expected_op(comm: Comm, seq: int) -> Optional[str]:
    """The op the communicator's own repeating pattern (its majority's ops before `seq`) puts at
    `seq`, or None when it has no pattern yet."""
    maj = _majority_ops(comm, max(0, seq - HISTORY), seq - 1)
    p = _period(maj, seq)
    if p is None:
        return None
    base = [b for b in maj if (seq - b) % p == 0]
    return maj[max(base)] if base else None


def _sizes_differ(ops: Dict[int, str], sizes: Dict[int, Tuple]) -> bool:
    """True when the ranks with a known size disagree, and either every rank that entered has one
    (a vote, as for ops) or a strict majority of them share one size (else a rank whose size is
    unknown could be the odd one)."""
    if len(sizes) < 2 or len(set(sizes.values())) < 2:
        return False
    if len(sizes) == len(ops):
        return True
    top = collections.Counter(sizes.values()).most_common(1)[0][1]
    return 2 * top > len(ops)


def _check_view(tl: Timeline, comm: Comm, view: CollView, expected: Set[int], now: float) -> Optional[Finding]:
    ops = {r: op for r, op in view.ops.items() if r in expected}
    if len(ops) < 2:
        return None
    sizes = {r: sz for r, sz in view.sizes.items() if r in ops}
    differ_ops = len(set(ops.values())) > 1
    differ_sizes = not differ_ops and _sizes_differ(ops, sizes)
    if not (differ_ops or differ_sizes):
        return None
    if len(ops) < len(expected) and now - view.first_enter() < GRACE_S:
        return None  # the rest may still come and change the vote
    what = "op" if differ_ops else "size"
    votes = ops if differ_ops else {r: size_text(sz) for r, sz in sizes.items()}
    top, odd = _vote(votes)
    by_pattern = None
    if top is None and differ_ops and len(ops) == len(expected):
        # a tie among all the members (the two ranks of a pair group): what did the group call before?
        by_pattern = _expected_op(comm, view.seq)
        if by_pattern is not None and by_pattern in ops.values():
            top, odd = by_pattern, sorted(r for r, op in ops.items() if op != by_pattern)
        else:
            by_pattern = None
    detail_ranks = odd[:EVIDENCE_RANKS]
    by_value: Dict[str, List[int]] = collections.defaultdict(list)
    for r, v in votes.items():
        by_value[str(v)].append(r)
    evidence: Dict[str, Any] = {
        "reason": f"different-{what}", "majority": None if top is None else str(top), "tie": top is None,
        "tie_broken_by_pattern": by_pattern is not None,
        "calls": {k: sorted(v)[:EVIDENCE_RANKS] for k, v in sorted(by_value.items())},
        "entered": len(ops), "expected": len(expected), "missing": sorted(expected - ops.keys())[:EVIDENCE_RANKS],
        "sizes_known": bool(sizes), "completed": view.completed_at is not None,
        "ranks": [dict(rank_evidence(tl, comm, r, now), called=ops.get(r), size=_size_dict(sizes.get(r)))
                  for r in detail_ranks],
    }
    if differ_sizes:
        evidence["unknown_size"] = sorted(ops.keys() - sizes.keys())[:EVIDENCE_RANKS]
    if differ_ops and top is not None:
        maj = _majority_ops(comm, max(0, view.seq - HISTORY), comm.max_seq)
        shifts = {str(r): s for r in detail_ranks for s in [_shift(comm, r, view.seq, maj)] if s}
        if shifts:
            evidence["diverged"] = shifts
    if differ_ops:
        called = ", ".join(f"rank {r} {ops[r]}" for r in odd[:3])
        evidence["summary"] = (f"{called} where the others called {top}" if top is not None
                               else f"no majority: {'; '.join(f'{k} {v}' for k, v in sorted(by_value.items()))}")
    else:
        called = ", ".join(f"rank {r} {ops[r]} of {votes[r]}" for r in odd[:3])
        evidence["summary"] = (f"{called} where the others passed {top}" if top is not None
                               else f"no majority: {'; '.join(f'{k} {v}' for k, v in sorted(by_value.items()))}")
    onset = min(view.enter[r] for r in odd if r in view.enter) if odd else view.first_enter()
    return Finding(kind="hang", cls="inconsistent", ranks=odd, comm=comm.id, seq=view.seq,
                   op=str(top) if top is not None and differ_ops else view.op, onset_at=onset, detected_at=now,
                   evidence=evidence, job=comm.job)


class InconsistencyChecker:
    """Keeps which (comm, seq) were completed and consistent, so each collective is checked once
    after it completes; one per Timeline."""

    def __init__(self) -> None:
        self._ok: Dict[str, int] = {}   # comm id -> highest seq s such that every seq <= s in the window is settled

    def find(self, tl: Timeline, now: float) -> List[Finding]:
        out = []
        for comm in list(tl.comms.values()):
            if comm.max_seq < 0:
                continue
            settled = self._ok.get(comm.id, -1)
            first = max(comm.max_seq - WINDOW + 1, settled + 1, comm.evicted_upto + 1)
            expected: Optional[Set[int]] = None
            found = None
            ok_upto = settled
            contiguous = True
            for s in range(first, comm.max_seq + 1):
                view = comm.colls.get(s)
                if view is None:
                    continue
                if contiguous and view.completed_at is not None and view.uniform():
                    ok_upto = s  # completed and consistent: never looked at again
                    continue
                contiguous = False
                if expected is None:
                    expected = tl.expected_members(comm.id)
                    if len(expected) < 2:
                        break
                found = _check_view(tl, comm, view, expected, now)
                if found is not None:
                    break  # the earliest inconsistent collective is the root; later ones follow from it
            self._ok[comm.id] = ok_upto
            if found is not None:
                out.append(found)
        if len(self._ok) > 4 * len(tl.comms) + 64:  # communicators replaced or dropped
            self._ok = {c: s for c, s in self._ok.items() if c in tl.comms}
        return out


def explains(f: Finding, other: Finding) -> bool:
    """True when inconsistent finding `f` explains hang finding `other` (a collective of the same
    communicator, at or after the inconsistent one): the hang is a consequence, not a second problem.
    A p2p hang's seq numbers its stream's transfers, not collectives: never explained this way."""
    return other.comm == f.comm and other.seq >= f.seq and "p2p" not in other.evidence

