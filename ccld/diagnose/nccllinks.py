"""NCCL's links judged from its own proxy progress (ccld's NCCL profiler plugin): stalls and slow links.

find_proxy_faults: a collective every rank entered and none can finish, pinned on the link whose
transfers stopped.

Asked of the hang findings (hang.py's case (b): everyone entered, someone has not finished) when the
communicator's ranks run ccld's NCCL profiler plugin, whose NetProgress reports say how each rank's
proxy moved data to each peer (timeline.netprog). When a link stops, every rank of a ring or tree
soon waits, so "nobody moves" cannot tell the links apart; what can: the SENDER of the broken link
still has steps posted on the network that never complete, while the other senders have nothing
posted (their GPUs wait for data that never comes, so they post no more). The link whose sender has
steps in flight and has not moved since the hang began is named (`fault`, the link as [src, dst]);
when several such links share one rank, that rank is named (its NIC, its host); when they share
none, nothing is said (a fabric-wide problem is not one link).

proxy_suspects: while collectives of a communicator are slow (commslow.find_comm_slow asks when TCP
shows nothing: NCCL over InfiniBand/RoCE bypasses the kernel), the link whose sender's steps wait on
the network far longer per step than they did before the slowdown, by far more than the other links
of the communicator departed from theirs. Steps of the links behind a slow one wait on their GPU
(data that comes late), not on the network, so the slow link stands out by itself.

Times: Unix seconds. Ranks in findings are global; progress is kept by group rank and mapped here.
"""
from __future__ import annotations

import statistics
from typing import Callable, Dict, List, Tuple

from ccld.diagnose import links as tcp  # its naming of suspect pairs
from ccld.diagnose.findings import Finding
from ccld.timeline.netprog import LinkProgress
from ccld.timeline.timeline import Timeline

SETTLE_S = 0.5        # steps in flight when the hang began complete (or not) within this: a link that
                      # moved after onset + SETTLE_S is alive
REASONS = ("not-finished", "not-started")  # hang.py reasons where every member is alive and entered
WAIT_FACTOR = 3.0     # a link's network wait per step over the slow span / its own before, that makes it suspect
STAND_OUT = 3.0       # ... and at least this x the typical departure of the communicator's other links
MIN_STEPS = 8         # steps in the span, and in the baseline, below which a link is not judged
BASELINE_S = 60.0     # the baseline: this long before the slowdown was first seen (minus GUARD_S)
GUARD_S = 10.0        # ... ending this long before it (the slowdown may have begun before it was seen)


def _stalled(links: Dict[Tuple[int, int], LinkProgress], since: float) -> List[LinkProgress]:
    return [lp for lp in links.values()
            if lp.tx_in_flight > 0 and (lp.last_moved is None or lp.last_moved <= since)]


def _moved_after(links: Dict[Tuple[int, int], LinkProgress], since: float) -> int:
    return sum(1 for lp in links.values() if lp.last_moved is not None and lp.last_moved > since)


def _global(tl: Timeline, comm_id: str) -> Callable[[int], int]:
    """Group rank -> global rank on `comm_id` (itself where the communicator does not say)."""
    comm = tl.comms.get(comm_id)

    def to_global(g: int) -> int:
        r = tl.global_of(comm, g) if comm is not None else None
        return g if r is None else r
    return to_global


def _link_evidence(lp: LinkProgress, to_global, onset: float) -> Dict[str, object]:
    return {"src": to_global(lp.src), "dst": to_global(lp.dst), "tx_in_flight": lp.tx_in_flight,
            "rx_in_flight": lp.rx_in_flight, "tx_bytes": lp.tx_bytes, "rx_bytes": lp.rx_bytes,
            "last_moved_before_onset_s": None if lp.last_moved is None else round(onset - lp.last_moved, 3),
            "net_wait_s": round(lp.net_wait_s, 6), "gpu_wait_s": round(lp.gpu_wait_s, 6)}


def find_proxy_faults(tl: Timeline, now: float, hangs: List[Finding]) -> List[Finding]:
    """Hang findings refined to the NCCL link that stopped moving; each replaces the hang it explains."""
    out = []
    for h in hangs:
        if h.kind != "hang" or h.cls != "fault" or h.evidence.get("reason") not in REASONS or h.comm is None:
            continue
        links = tl.progress.links_of(h.comm)
        if not links:
            continue
        since = h.onset_at + SETTLE_S
        stalled = _stalled(links, since)
        to_global = _global(tl, h.comm)
        named = tcp.name_pairs([(to_global(lp.src), to_global(lp.dst)) for lp in stalled]) if stalled else None
        if named is None:
            continue
        ranks, link = named
        worst = max(stalled, key=lambda lp: lp.tx_in_flight)
        what = (f"link {to_global(worst.src)}->{to_global(worst.dst)}" if link is not None
                else f"links of rank {ranks[0]}")
        summary = (f"{what}: NCCL's proxy has {worst.tx_in_flight} send step(s) posted on the network that "
                   f"have not completed since the hang began; of the other {len(links) - len(stalled)} link(s), "
                   f"{_moved_after(links, since)} moved after it and none has a send waiting")
        evidence = {"reason": "proxy-stalled", "summary": summary, "hang_reason": h.evidence.get("reason"),
                    "waited_s": h.evidence.get("waited_s"), "threshold_s": h.evidence.get("threshold_s"),
                    "stalled": [_link_evidence(lp, to_global, h.onset_at) for lp in stalled],
                    "links_reporting": len(links), "hang_ranks": h.ranks, "source": "nccl profiler plugin"}
        out.append(Finding(kind="hang", cls="fault", ranks=ranks, link=link, comm=h.comm, seq=h.seq, op=h.op,
                           onset_at=h.onset_at, detected_at=now, evidence=evidence, job=h.job))
    return out


def proxy_suspects(tl: Timeline, comm_id: str, since: float, now: float,
                   began: float) -> Tuple[List[Tuple[int, int]], Dict[Tuple[int, int], Dict[str, object]]]:
    """Directed links (global ranks) of `comm_id` whose network wait per step over [since, now] left
    their own baseline (before `began` - GUARD_S) by WAIT_FACTOR and STAND_OUT x the other links'
    departure; and the evidence of every link judged."""
    table = tl.progress
    if not table.links_of(comm_id):
        return [], {}
    win = table.window(comm_id, since, now + 1.0)
    base = table.window(comm_id, began - GUARD_S - BASELINE_S, began - GUARD_S)
    ratios: Dict[Tuple[int, int], float] = {}
    for key, w in win.items():
        b = base.get(key)
        if w.steps >= MIN_STEPS and b is not None and b.steps >= MIN_STEPS and b.net_wait_s > 0:
            ratios[key] = (w.net_wait_s / w.steps) / (b.net_wait_s / b.steps)
    g = _global(tl, comm_id)
    evidence = {(g(k[0]), g(k[1])): {"wait_per_step_us": round(win[k].net_wait_s / win[k].steps * 1e6, 1),
                                     "baseline_wait_per_step_us": round(base[k].net_wait_s / base[k].steps * 1e6, 1),
                                     "x": round(x, 2), "bytes": win[k].nbytes, "steps": win[k].steps}
                for k, x in ratios.items()}
    if len(ratios) < 2:
        return [], evidence
    out = []
    for k, x in ratios.items():
        others = [y for q, y in ratios.items() if q != k]
        if x >= WAIT_FACTOR and x >= STAND_OUT * max(1.0, statistics.median(others)):
            out.append((g(k[0]), g(k[1])))
    return sorted(out), evidence
