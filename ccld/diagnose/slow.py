"""Compute-slow detection: ranks that arrive late at collectives, step after step (`comp-slow`).

For every collective that completed in the last WINDOW_S, each rank's arrival lag is its enter time
minus the median enter time of the collective's ranks (the earliest other rank's, for a pair): a
robust reference that one or a few late ranks cannot drag. The job's own arrival noise is learned
from the same window: sigma = 1.4826 x the median over collectives of their median absolute lag.
A rank is comp-slow on one op of a communicator when there is an *episode*, the newest run of that
op's collectives (at least MIN_COLLS of them, lasting at least MIN_EPISODE_S, up to the window), in
which:
  - its lag exceeds max(LAG_FLOOR_S, NOISE_Z x sigma) in at least LATE_FRACTION of them
    (so one-off lateness, a GC pause or a one-time checkpoint, is never a finding),
  - those late collectives span at least SPAN_FRACTION of the episode (not one burst), and
  - the others spent at least MIN_COST of the episode waiting for it (a 5 ms lag on a 10 s step is
    not worth a line).
The longest such episode is taken (a change point: the lateness began where it starts), so a rank
that turns slow is named MIN_EPISODE_S after it did, whatever came before. The rules, and the
summaries they read, are episodes.py's (compute.py judges compute durations by them too).
Ranks slowed together (a pipeline stage, a node): when as many ranks are late as are on time, the
median sits between them and nobody is late by it; each collective's late cluster is then judged
against the clusters' own noise (not in a job that passes work along a pipeline, where every stage
after a slow one arrives late with it, nor where a subgroup holds some of the ranks: they may be late
together from its collectives, nor where links are measured: the ranks after a slow link are late
together, and the link localisers judge that), and the ranks named are one finding that says they were slow
together. A window with someone late in most collectives, costing the others MIN_COST of the time,
but no rank late in most of them, is `spread`: an informational finding (kind "info", no ranks).
Evidence: the lag numbers, the noise and threshold, and what the late rank's process did: runqueue
wait (SchedStats: CPU contention), disk I/O or CPU use (/proc), against the other ranks'.
Not judged: a subgroup of two ranks (a pair that is not the job's whole world). In a pair, the later
rank only says the other came first; in a job of several group kinds (tensor x pipeline x data
parallel, each group two ranks) one data-parallel replica's pipeline running behind the other's
makes each of its ranks "late" at its dp all-reduce, whoever held it up. busy.py names the rank whose
own work grew instead.
Findings carry seq -1 (a slowdown spans many collectives; its identity must not move with the
window) and `first_late_seq` in the evidence. Times: Unix seconds.
Cost: each collective is summarised once, when it completes (numpy over its ranks); a tick only
aggregates the summaries' few late ranks.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Optional, Tuple

import numpy as np

from ccld.timeline.records import Comm, CollView
from ccld.timeline.timeline import Timeline
from ccld.diagnose.episodes import (MIN_COLLS, MIN_LATE, CollSummary, bucket, judge, level_summary, notable,
                                    ranks_words, spread_finding, summarize_values)
from ccld.diagnose.evidence import EVIDENCE_RANKS, rank_evidence
from ccld.diagnose.findings import Finding, short_comm

WINDOW_S = 30.0          # lateness is judged over the collectives completed in the last 30 s
MAX_SCAN = 2048          # newest collectives of a communicator looked at per tick (bounds a fast job)
CONTENDED_RUNQ = 0.05    # runnable-but-waiting s per s that counts as CPU contention ...
CONTENDED_VS_OTHERS = 2.0  # ... and this many times the other ranks' median (a label on a rank already late)
SLOWER_CPU = 1.5         # a late rank whose own link is slow, waiting this much more for a CPU: one cause
STARVED_RUNQ = 0.25      # to blame a slow collective on one rank's CPU instead of the network, more: a quarter
STARVED_VS_OTHERS = 2.5  # of a second per second, 2.5x the others', each over the slowdown so far (one report
SPAN_MIN_S = 5.0         # varies 2-3x between ranks on a busy host; over 5 s or more, far less)
BUSY_CPU = 0.5           # CPU s per s that counts as compute-bound ...
MORE_CPU = 0.15          # ... when it is this much more than the other ranks' median


def summarize(view: CollView) -> Optional[CollSummary]:
    """A completed collective's summary: its ranks' enter times (episodes.summarize_values)."""
    if view.completed_at is None:
        return None
    level = level_summary(view.seq, view.op, *view.enter_span(), view.completed_at)  # most: without the mapping
    return level if level is not None else summarize_values(view.seq, view.op, view.enter, view.completed_at)


def _median(xs: List[float]) -> Optional[float]:
    return float(np.median(xs)) if xs else None


def _cause(tl: Timeline, comm: Comm, rank: int, members: List[int]) -> Dict[str, Any]:
    """Why `rank` may be late, from its process against the other ranks': {cause, cause_text,
    others_runq_share, others_cpu_busy}. Relative on purpose: on a host where every rank waits for a
    CPU, waiting for a CPU does not single one out."""
    rec = tl.rank_record(comm.job, rank)
    if rec is None:
        return {"cause": "unknown", "cause_text": "no /proc or scheduler data for this rank"}
    others = [o for o in (tl.rank_record(comm.job, q) for q in members[:256] if q != rank) if o is not None]
    runq = getattr(rec, "runq_share", None)
    their_runq = _median([o.runq_share for o in others if getattr(o, "runq_share", None) is not None])
    their_cpu = _median([o.cpu_busy for o in others if o.cpu_busy is not None])
    out: Dict[str, Any] = {"others_runq_share": None if their_runq is None else round(their_runq, 3),
                           "others_cpu_busy": None if their_cpu is None else round(their_cpu, 3)}
    if runq is not None and runq >= CONTENDED_RUNQ and runq >= CONTENDED_VS_OTHERS * (their_runq or 0.0):
        return dict(out, cause="cpu-contended",
                    cause_text=f"its threads wait for a CPU {runq:.2f} s per s (other ranks {their_runq or 0:.2f}): "
                               "another process competes for its cores")
    if rec.state == "D":
        return dict(out, cause="io", cause_text="in disk I/O" + (f" ({rec.wchan})" if rec.wchan and rec.wchan != "0" else ""))
    if rec.cpu_busy is not None and rec.cpu_busy >= BUSY_CPU and rec.cpu_busy >= (their_cpu or 0.0) + MORE_CPU:
        return dict(out, cause="busy-compute",
                    cause_text=f"busy on CPU {100 * rec.cpu_busy:.0f}% (other ranks {100 * (their_cpu or 0):.0f}%): "
                               "more work, or a slower CPU, than the others")
    if runq is None:
        return dict(out, cause="unknown", cause_text="no scheduler data (sched probe off): CPU contention cannot be told")
    return dict(out, cause="unknown", cause_text="no CPU contention, disk I/O or extra CPU use that sets it apart")


@dataclass
class _Window:
    """One communicator's summaries, oldest first, and the bookkeeping that keeps a tick's work
    proportional to what changed since the previous one."""
    owner: int                     # id() of the Comm: a rebuilt group starts seqs over
    items: Deque[CollSummary] = field(default_factory=collections.deque)  # oldest first (~seq order)
    newest: int = -1               # highest seq looked at
    completed: int = -1            # comm.completed when last looked at: unchanged means nothing to add
    open: Dict[int, None] = field(default_factory=dict)  # seqs seen before they completed: looked at again
    late: int = 0                  # summaries in `items` with a lag above LAG_FLOOR_S (episodes.notable)


class LatenessDetector:
    """Keeps one summary per completed collective (per Timeline) and answers find() each tick."""

    def __init__(self) -> None:
        self._windows: Dict[str, _Window] = {}

    def _add(self, w: _Window, view: CollView) -> None:
        s = summarize(view)
        if s is not None:
            w.items.append(s)
            w.late += notable(s)

    def _window(self, comm: Comm, now: float) -> _Window:
        w = self._windows.get(comm.id)
        if w is None or w.owner != id(comm):
            w = self._windows[comm.id] = _Window(owner=id(comm))
        horizon = now - WINDOW_S
        fresh = []
        scan = comm.completed != w.completed  # nothing completed since the last tick: nothing to add
        w.completed = comm.completed
        for n, seq in enumerate(reversed(comm.colls) if scan else ()):  # collectives begun since the last tick
            if seq <= w.newest or n >= MAX_SCAN:
                break
            fresh.append(seq)
        if fresh:
            w.newest = fresh[0]
        for seq in list(w.open) if scan else ():  # and those that were still running then
            view = comm.colls.get(seq)
            if view is None:
                del w.open[seq]
            elif view.completed_at is not None:
                del w.open[seq]
                if view.completed_at >= horizon:
                    self._add(w, view)
        for seq in reversed(fresh):
            view = comm.colls[seq]
            if view.completed_at is None:
                if len(w.open) < MAX_SCAN:
                    w.open[seq] = None
            elif view.completed_at >= horizon:
                self._add(w, view)
        while w.items and (w.items[0].completed_at < horizon or seq_gone(comm, w.items[0].seq)):
            old = w.items.popleft()
            w.late -= notable(old)
        return w

    def find(self, tl: Timeline, now: float) -> List[Finding]:
        out = []
        for comm in list(tl.comms.values()):
            if comm.completed < MIN_COLLS or not _judged(tl, comm):
                continue
            w = self._window(comm, now)
            if w.late < MIN_LATE or len(w.items) < MIN_COLLS:
                continue  # nobody was late often enough to be comp-slow or spread: the common case
            window = sorted((v for v in w.items if v.completed_at <= now), key=lambda v: v.seq)
            f = self._check(tl, comm, window, now)
            if f is not None:
                out.append(f)
        if len(self._windows) > len(tl.comms):
            self._windows = {c: w for c, w in self._windows.items() if c in tl.comms}
        return out

    def _check(self, tl: Timeline, comm: Comm, window: List[CollSummary], now: float) -> Optional[Finding]:
        if len(window) < MIN_COLLS:
            return None
        members = sorted(tl.expected_members(comm.id))
        j = judge(window, len(members), clusters=not (pipelined(tl, comm.job) or split_by_subgroups(tl, comm)
                                                      or has_link_metrics(tl, comm.job)))
        if not j.slow:
            return None if j.spread is None else spread_finding(comm.job, comm.id, j.spread, now, "arriving",
                                                                "the collectives")
        slow = j.slow
        ranks = sorted(slow)
        details = []
        for r in ranks[:EVIDENCE_RANKS]:
            details.append(dict(rank_evidence(tl, comm, r, now), **slow[r], **_cause(tl, comm, r, members)))
        worst = max(ranks, key=lambda r: slow[r]["waited_fraction"])
        op = slow[worst]["op"]
        if j.together:
            lag = sorted(slow[r]["median_lag_s"] for r in ranks)[len(ranks) // 2]
            shown = f"{ranks_words(ranks)} slow together: {bucket(lag)} late at {op}"
        else:
            shown = "; ".join(f"rank {d['rank']} {bucket(d['median_lag_s'])} late at {d['op']} ({d['cause']})"
                              for d in details[:3]) + (f" (+{len(ranks) - 3})" if len(ranks) > 3 else "")
        evidence = {"reason": "late-arrival", "window_s": WINDOW_S, "collectives": len(window),
                    "noise_sigma_s": round(j.sigma, 6), "threshold_s": round(j.threshold, 6),
                    "first_late_seq": min(slow[r]["first_late_seq"] for r in ranks),
                    "ranks": details, "summary": shown,
                    "note": f"the other ranks of {short_comm(comm.id)} wait for "
                            f"{'these ranks' if len(ranks) > 1 else 'this rank'} at collectives, step after step"}
        if j.together or j.grouped:  # said only when so: a finding of one late rank reads as it always did
            evidence.update(together=j.together, grouped=j.grouped)
            evidence["note"] += (" (slow together, by about the same lag: one pipeline stage, node or shared "
                                 "resource)" if j.together else "")
        onset = min(slow[r]["first_late_at"] for r in ranks)
        return Finding(kind="slow", cls="comp-slow", ranks=ranks, comm=comm.id, seq=-1, op=op,
                       onset_at=onset, detected_at=now, evidence=evidence, job=comm.job)


def has_link_metrics(tl: Timeline, job: str) -> bool:
    """Whether the job's links are measured (TCP connections, NCCL proxy progress). Then ranks late
    together may be the ones downstream of a slow link (seen: a rate-limited link between two nodes
    made the three ranks after it late at every all-reduce), which the link localisers judge
    (comm-slow, mixed-slow); the cluster verdict is for sources without link metrics (tables, traces)."""
    return any(k[0] == job for k in list(tl.links.series)) or any(
        c.job == job and tl.progress.links_of(c.id) for c in list(tl.comms.values()))


def split_by_subgroups(tl: Timeline, comm: Comm) -> bool:
    """Whether another communicator of the job holds some of `comm`'s members and not the others: then
    those ranks may arrive late together because they ran that group's collectives in between (their
    communication, not their compute; seen: two ranks with subgroup all-reduces every step)."""
    members = tl.expected_members(comm.id)
    for c in list(tl.comms.values()):
        if c is comm or c.job != comm.job:
            continue
        inter = members & c.members
        if inter and inter != members:
            return True
    return False


def pipelined(tl: Timeline, job: str) -> bool:
    """Whether ranks of `job` send each other work (p2p): then a stage late at a collective may only be
    downstream of the slow one."""
    return any(c.job == job and c.p2p is not None and c.p2p.last_posted for c in list(tl.comms.values()))


def _judged(tl: Timeline, comm: Comm) -> bool:
    """Whether lateness at `comm` can point at a rank: three members or more, or the job's whole world."""
    members = tl.expected_members(comm.id)
    return len(members) >= 3 or len(members) == tl.jobs.get(comm.job, -1)


def contended_inside(tl: Timeline, comm_slow: List[Finding], now: float) -> Tuple[List[Finding], List[Finding]]:
    """comm-slow findings whose cause is one rank's CPU, not the network: arrivals line up, but one
    rank of the communicator (of the named link or rank, when there is one) waits for a CPU far more
    than the others, so its communication threads lag and every transfer through it is slow. Those
    become comp-slow findings naming that rank (reason "cpu-contended-inside", the link evidence
    kept); returns (those, the comm-slow findings left as they were)."""
    moved, kept = [], []
    for f in comm_slow:
        comm = tl.comms.get(f.comm)
        if comm is None:
            kept.append(f)
            continue
        members = sorted(tl.expected_members(f.comm))
        suspects = f.ranks or members
        shares = {}
        since = min(f.onset_at, now - SPAN_MIN_S)
        for r in members[:4096]:
            rec = tl.rank_record(comm.job, r)
            if rec is None:
                continue
            share = rec.runq_since(since) if hasattr(rec, "runq_since") else None
            if share is None:
                share = getattr(rec, "runq_share", None)
            if share is not None:
                shares[r] = share
        top = [r for r in suspects if r in shares]
        hit = None
        if len(shares) >= 2 and top:
            r = max(top, key=lambda q: shares[q])
            rest = _median([v for q, v in shares.items() if q != r]) or 0.0
            if shares[r] >= STARVED_RUNQ and shares[r] >= STARVED_VS_OTHERS * rest:
                hit = (r, rest)
        if hit is None:
            kept.append(f)
            continue
        r, rest = hit
        d = dict(rank_evidence(tl, comm, r, now), **_cause(tl, comm, r, members))
        evidence = {"reason": "cpu-contended-inside", "ranks": [d], "comm_slow": f.evidence, "link": f.link,
                    "summary": f"rank {r} starved of CPU: its collectives lag",
                    "note": f"arrivals line up but {f.op} is slow, and rank {r}'s threads wait for a CPU "
                            f"{shares[r]:.2f} s per s (other ranks {rest:.2f}): its communication threads "
                            "are starved; the network is not the cause"}
        moved.append(Finding(kind="slow", cls="comp-slow", ranks=[r], link=None, comm=f.comm, seq=-1, op=f.op,
                             onset_at=f.onset_at, detected_at=now, evidence=evidence, job=f.job))
    return moved, kept


def explains_comm_slow(comp: Finding, comm_slow: Finding) -> bool:
    """True when the slow collectives of `comm_slow` (same communicator) are most simply the late
    ranks of `comp` again: its starved communication threads slow every transfer through it. So:
    the slow link touches a late rank whose runqueue wait is above the others' (SLOWER_CPU x), or
    no link stands out and a late rank is CPU-contended. Else it is a mixed slowdown."""
    def more_runq(d) -> bool:
        mine, theirs = d.get("runq_share"), d.get("others_runq_share")
        return mine is not None and theirs is not None and mine >= CONTENDED_RUNQ and mine >= SLOWER_CPU * theirs

    late = [d for d in comp.evidence.get("ranks") or [] if isinstance(d, dict)]
    if comm_slow.ranks:
        return any(d["rank"] in comm_slow.ranks and more_runq(d) for d in late)
    return any(d.get("cause") == "cpu-contended" for d in late)


def seq_gone(comm: Comm, seq: int) -> bool:
    return seq <= comm.evicted_upto
