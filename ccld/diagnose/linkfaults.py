"""Hangs pinned on a link: find_link_faults.

A hang (a collective nobody can finish, hang.py; or a send or receive, p2phang.py) whose cause is a
link: since the hang began, one rank pair's connection was reset or kept retransmitting while the
others were quiet. Ranks of one collective stall together (each waits for the data of the one before
it), so "bytes stopped moving" alone cannot tell the links apart; retransmissions and resets can. The
findings replace the hangs they explain. Asked of a Timeline (its `links` table: rank pairs with
per-second buckets, see links.py) at Unix time `now`; suspects are named with links.name_pairs.
A wait on a link that was lossy before it began (it kept retransmitting in the seconds before) is
held until it lasts LOSSY_HOLD_S (`held_on_lossy_links`, over ticks `LossyHold`): TCP backs off on
each lost retransmission, so such a link stalls a transfer for seconds now and then, and that is the
slow link comm-slow names, not a hang; a link cut on top of the loss still retransmits past the hold
and is named then. A hang once shown is never held after (LossyHold remembers it).
Aftermath: a rank at either end of a link fault that then exits (a cut link makes its calls fail)
is that fault's consequence, not a second root cause: the link finding stays in its place.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

from ccld.diagnose import waits
from ccld.diagnose.findings import Finding
from ccld.diagnose.links import STAND_OUT, name_pairs
from ccld.timeline.links import PairSummary
from ccld.timeline.timeline import Timeline

MIN_LINK_RETRANS = 2       # retransmissions since a hang began that make a link suspect (RTOs back off:
                           # 0.2, 0.4, 0.8 s ... so a dead link shows 3-5 within the 5 s hang floor)
HANG_SETTLE_S = 1.0        # retransmissions are counted from this long after a hang began: data in flight
                           # when it began is acked (or lost) by then, and on a busy 2-core box every link
                           # retransmits now and then; after it, only a link that lost its peer keeps trying
LOSSY_BEFORE_S = 10.0      # a link that retransmitted in the whole seconds of this long before a hang began ...
LOSSY_RETRANS_PER_S = 1.0  # ... this often on average (healthy links here: at most ~0.5/s; a 5 % loss: ~20/s),
                           # standing out from the others, was lossy before the wait: not cut at its onset ...
LOSSY_HOLD_S = 12.0        # ... so a wait on it is a hang only past this (a segment lost five times in a row
                           # has waited 0.2 + 0.4 + ... + 3.2 = 6.2 s, six times 12.6 s; and 12 s is under the
                           # 15 s in which a hang is to be named)
AFTERMATH_S = 60.0         # a link fault's rank that exits within this long of the fault's last sight ...
AFTERMATH_ONSET_S = 5.0    # ... in a hang that began at most this long before the fault's: its consequence


def _pair_evidence(s: Optional[PairSummary]) -> Optional[Dict[str, float]]:
    return None if s is None else s.as_dict()


Suspects = Dict[Tuple[str, float, float], Tuple[List[Tuple[int, int]], Dict]]  # one tick's _link_suspects


def _link_suspects(tl: Timeline, job: str, t_from: float, now: float,
                   memo: Optional[Suspects] = None) -> Tuple[List[Tuple[int, int]], Dict]:
    """Directed pairs with resets, or retransmissions that stand out, in [t_from, now]. memo: answers
    already worked out in this tick (the hold and the link faults ask the same of a hang)."""
    if memo is not None:
        got = memo.get((job, t_from, now))
        if got is None:
            got = memo[(job, t_from, now)] = _link_suspects(tl, job, t_from, now)
        return got
    win = tl.links.pair_window(job, t_from, now + 1.0)
    if not win:
        return [], win
    score = {p: s.retrans + 10 * s.resets for p, s in win.items()}
    best = max(score.values())
    if best < MIN_LINK_RETRANS and not any(s.resets for s in win.values()):
        return [], win
    suspects = [p for p, v in score.items() if v >= max(MIN_LINK_RETRANS, best / STAND_OUT) or win[p].resets]
    others = [v for p, v in score.items() if p not in suspects]
    if others and max(others) * STAND_OUT > min(score[p] for p in suspects):
        return [], win  # retransmissions everywhere: a congested host, not one link
    return suspects, win


def _on_a_link(tl: Timeline, h: Finding) -> bool:
    """Whether a link can be what holds hang `h`."""
    if h.kind != "hang" or h.evidence.get("reason") in ("exited", "stopped"):
        return False  # a dead or stopped process explains the hang by itself
    # a not-entered hang whose culprits are in no operation (asleep, computing): no link holds them
    return h.cls != "not-entered" or any(waits.blocked(tl, h.job, r) is not None for r in h.ranks)


def held_on_lossy_links(tl: Timeline, now: float, hangs: List[Finding],
                        memo: Optional[Suspects] = None) -> List[Finding]:
    """The `hangs` not yet LOSSY_HOLD_S long whose retransmitting link (since the hang began) was
    lossy before it began too: a lossy link's stall, which comm-slow names, not (yet) a hang."""
    out = []
    for h in hangs:
        if now - h.onset_at >= LOSSY_HOLD_S or not _on_a_link(tl, h):
            continue
        suspects, _ = _link_suspects(tl, h.job, h.onset_at + HANG_SETTLE_S, now, memo)
        if not suspects:
            continue
        # the whole seconds before the onset, none of them after it: a cut's first retransmissions are not
        # "before" (_link_suspects reads the per-second buckets that start in [from - 1, to + 1))
        before, win = _link_suspects(tl, h.job, h.onset_at - LOSSY_BEFORE_S, h.onset_at - 2.0)
        if any(p in before and win[p].retrans >= LOSSY_RETRANS_PER_S * LOSSY_BEFORE_S for p in suspects):
            out.append(h)
    return out


class LossyHold:
    """held_on_lossy_links over ticks (one per Diagnoser). Whether a hang is held depends on the
    retransmissions counted since it began, which come after it: a hang shown at the floor, before its
    link's first RTO fired, and held a tick later would read as recovered while it still waits. So a
    hang shown once is never held after."""

    def __init__(self) -> None:
        self._shown: Dict[Tuple[str, str, int], float] = {}  # (job, comm, seq) -> when last shown

    def hangs(self, tl: Timeline, now: float, hangs: List[Finding], memo: Optional[Suspects] = None) -> List[Finding]:
        """`hangs` less those held at `now`; the others are remembered as shown."""
        self._shown = {k: t for k, t in self._shown.items() if now - t <= AFTERMATH_S}
        fresh = [h for h in hangs if (h.job, h.comm, h.seq) not in self._shown]
        held = {id(h) for h in held_on_lossy_links(tl, now, fresh, memo)}
        out = [h for h in hangs if id(h) not in held]
        for h in out:
            self._shown[(h.job, h.comm, h.seq)] = now
        return out


def find_link_faults(tl: Timeline, now: float, hangs: List[Finding], memo: Optional[Suspects] = None) -> List[Finding]:
    """Hang findings refined to a link: a connection reset, or one that kept retransmitting while a
    collective that needs it is open. Returns findings that replace the `hangs` they explain."""
    out = []
    for h in hangs:
        if not _on_a_link(tl, h):
            continue
        suspects, win = _link_suspects(tl, h.job, h.onset_at + HANG_SETTLE_S, now, memo)
        named = name_pairs(suspects) if suspects else None
        if named is None:
            continue
        ranks, link = named
        worst = max(suspects, key=lambda p: (win[p].resets, win[p].retrans))
        w = win[worst]
        what = (f"was reset {w.resets} time(s)" if w.resets else f"retransmitted {w.retrans} times")
        summary = (f"link {worst[0]}->{worst[1]} {what} since the hang began; other links: at most "
                   f"{max((s.retrans for p, s in win.items() if p not in suspects), default=0)}")
        evidence = {"reason": "link", "summary": summary, "hang_reason": h.evidence.get("reason"),
                    "waited_s": h.evidence.get("waited_s"), "threshold_s": h.evidence.get("threshold_s"),
                    "pairs": [_pair_evidence(win[p]) for p in sorted(suspects)],
                    "others_max_retrans": max((s.retrans for p, s in win.items() if p not in suspects), default=0),
                    "connections": _conn_evidence(tl, h.job, ranks),
                    "hang_ranks": h.ranks}
        out.append(Finding(kind="hang", cls="fault", ranks=ranks, link=link, comm=h.comm, seq=h.seq, op=h.op,
                           onset_at=h.onset_at, detected_at=now, evidence=evidence, job=h.job))
    return out


def _conn_evidence(tl: Timeline, job: str, ranks: List[int]) -> List[Dict[str, object]]:
    if len(ranks) != 2:
        return []
    return [{"rank": c.rank, "local": f"{c.saddr}:{c.sport}", "remote": f"{c.daddr}:{c.dport}",
             "retrans": c.retrans, "resets": c.resets, "srtt_us": c.srtt_us, "state": c.state,
             "last_progress_at": c.progress_at} for c in tl.links.conns_between(job, ranks[0], ranks[1])]


class Aftermath:
    """The link faults of recent ticks (one per Diagnoser), and what their ranks' exits become."""

    def __init__(self) -> None:
        self._seen: Dict[Tuple[str, Tuple[int, ...]], Tuple[Finding, float]] = {}  # (job, link) -> (finding, last seen)

    def keep(self, found: List[Finding], now: float) -> List[Finding]:
        """`found` with each exit of a recent link fault's rank replaced by that link finding (once,
        its evidence naming who exited since)."""
        for f in found:
            if f.link:
                self._seen[(f.job, tuple(f.link))] = (f, now)
        self._seen = {k: v for k, v in self._seen.items() if now - v[1] <= AFTERMATH_S}
        if not self._seen:
            return found
        out: List[Finding] = []
        shown = {(f.job, tuple(f.link)) for f in found if f.link}
        for f in found:
            cause = None
            if f.kind == "hang" and f.cls == "fault" and not f.link and f.evidence.get("reason") == "exited":
                cause = next((k for k, (g, _) in self._seen.items() if k[0] == f.job and set(f.ranks) <= set(k[1])
                              and f.onset_at >= g.onset_at - AFTERMATH_ONSET_S), None)
            if cause is None:
                out.append(f)
            elif cause not in shown:
                g = self._seen[cause][0]
                out.append(dataclasses.replace(g, detected_at=now, evidence=dict(g.evidence, then_exited=f.ranks)))
                shown.add(cause)
        return out
