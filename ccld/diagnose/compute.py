"""Compute-slow from compute durations: a rank whose runs of an op take longer than the same runs on its
peers, step after step (`comp-slow`, reason "compute-duration").

Source: the timeline's compute spans (timeline/compute.py: a per-op table's compute rows, the
record_function ranges of Kineto traces). Per job and op, the n-th run on every rank is one instance
and each rank's value its duration; episodes.py summarises each instance once (when every rank of the
op has run it, or SETTLE_S after the newest of its spans ended, for a rank that stopped running it)
and judges the window by slow.py's rules: the reference is the median duration, a rank is longer by
more than max(LAG_FLOOR_S, NOISE_Z x the runs' noise) in most of the runs of an episode of MIN_EPISODE_S
or more, and the extra time is MIN_COST of it at least, so one long run (a GC pause, a first-step
compile) is never a finding. Ranks slowed together (one pipeline stage) are one finding that says so;
a job whose longest run moves from rank to rank gets no culprit but an informational `spread`.
Evidence per rank: its median duration of the op and the other ranks', in how many runs it was longer
and by how much. The Diagnoser puts this evidence beside a late-arrival comp-slow (slow.py) that names
the same ranks, instead of a second finding.
Caveat: an op is compared across the ranks that run it under that name. A pipeline stage that always
does more (the last one's forward, with the loss) is named, since the others wait for it; give such
ops a name per stage when that is by design. Ops run by fewer than MIN_RANKS ranks are not judged:
of two, the longer one only says the other is quicker.
Findings carry seq -1 (`first_longer_run`, the op's run number, is in the evidence) and the
communicator the ranks communicate on most (busy.home_comm), else the job. Times: Unix seconds.
"""
from __future__ import annotations

import collections
import itertools
import statistics
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Optional, Tuple

from ccld.diagnose.busy import home_comm
from ccld.diagnose.episodes import (MIN_COLLS, MIN_LATE, CollSummary, bucket, judge, notable, ranks_words,
                                    spread_finding, summarize_values)
from ccld.diagnose.evidence import EVIDENCE_RANKS
from ccld.diagnose.findings import Finding
from ccld.diagnose.slow import WINDOW_S
from ccld.timeline.compute import ComputeOp
from ccld.timeline.timeline import Timeline

SETTLE_S = 2.0     # a run some rank has not done this long after the others ended it is judged without it
MIN_RANKS = 3      # ranks that run an op before it is judged
# the episode's numbers (episodes.episode) under the names they have for durations
WORDS = {"late_in": "longer_in", "median_lag_s": "median_extra_s", "p90_lag_s": "p90_extra_s",
         "max_lag_s": "max_extra_s", "first_late_seq": "first_longer_run", "first_late_at": "first_longer_at"}


@dataclass
class _OpWindow:
    """One (job, op)'s summaries, oldest first, and how far its runs have been summarised."""
    done: int = 0                  # runs 1..done summarised (or skipped: no rank has them any more)
    added: int = -1                # ComputeOp.added when last looked at
    items: Deque[CollSummary] = field(default_factory=collections.deque)
    notable: int = 0               # of them, with someone longer by LAG_FLOOR_S (episodes.notable)


class ComputeDetector:
    """One per Timeline (the Diagnoser's): summaries of the runs seen, per (job, op)."""

    def __init__(self) -> None:
        self._ops: Dict[Tuple[str, str], _OpWindow] = {}

    def find(self, tl: Timeline, now: float) -> List[Finding]:
        out = []
        for job, ops in list(tl.compute.jobs.items()):
            window: List[CollSummary] = []
            members = 0
            for name, op in ops.items():
                if len(op.spans) < MIN_RANKS:
                    continue
                w = self._advance(self._ops.setdefault((job, name), _OpWindow()), name, op, now)
                if w.notable >= MIN_LATE and len(w.items) >= MIN_COLLS:  # else nobody was longer often enough
                    window += [s for s in w.items if s.completed_at <= now]
                    members = max(members, len(op.spans))
            f = self._check(tl, job, window, members, now) if window else None
            if f is not None:
                out.append(f)
        return out

    def _advance(self, w: _OpWindow, name: str, op: ComputeOp, now: float) -> _OpWindow:
        """Summarise the runs of `op` complete at `now`; forget those older than WINDOW_S."""
        if op.added != w.added:
            w.added = op.added
            last = max(op.count.values())
            while w.done < last:
                n = w.done + 1
                runs = {}
                for r, q in op.spans.items():
                    i = n - q[0][0]
                    if 0 <= i < len(q):
                        runs[r] = q[i]
                if len(runs) < len(op.spans) and runs and now - max(e for _, _, e in runs.values()) < SETTLE_S:
                    break  # a rank has yet to run it: looked at again when more spans come, or at a later tick
                w.done = n
                s = summarize_values(n, name, {r: e - b for r, (_, b, e) in runs.items()},
                                     max((e for _, _, e in runs.values()), default=0.0),
                                     first=min((b for _, b, _ in runs.values()), default=0.0))
                if s is not None:
                    w.items.append(s)
                    w.notable += notable(s)
            if w.done < last:
                w.added = -1  # not all summarised: look again next tick, when SETTLE_S may have passed
        while w.items and w.items[0].completed_at < now - WINDOW_S:
            w.notable -= notable(w.items.popleft())
        return w

    def _check(self, tl: Timeline, job: str, window: List[CollSummary], members: int,
               now: float) -> Optional[Finding]:
        j = judge(window, members)
        if not j.slow:
            if j.spread is None:
                return None
            comm = home_comm(tl, job, [])
            op = j.spread["op"]
            return spread_finding(job, comm.id if comm else job, j.spread, now, f"finishing {op}",
                                  f"the runs of {op}")
        slow = j.slow
        ranks = sorted(slow)
        comm = home_comm(tl, job, ranks)
        medians: Dict[str, Dict[int, float]] = {}
        details = [_detail(tl.compute.jobs[job], medians, r, slow[r], now) for r in ranks[:EVIDENCE_RANKS]]
        op = slow[max(ranks, key=lambda r: slow[r]["waited_fraction"])]["op"]
        if j.together:
            extra = sorted(slow[r]["median_lag_s"] for r in ranks)[len(ranks) // 2]
            shown = f"{ranks_words(ranks)} slow together: {bucket(extra)} longer than the others"
        else:
            shown = "; ".join(f"rank {d['rank']} {d['op']} {bucket(d['median_extra_s'])} longer" for d in details[:3]) \
                + (f" (+{len(ranks) - 3})" if len(ranks) > 3 else "") + " than the others"
        evidence = {"reason": "compute-duration", "window_s": WINDOW_S, "runs": len(window),
                    "noise_sigma_s": round(j.sigma, 6), "threshold_s": round(j.threshold, 6), "ranks": details,
                    "summary": shown,
                    "note": f"{'their' if len(ranks) > 1 else 'its'} runs of {op} take longer than the same runs on "
                            "the other ranks, step after step: the others wait for "
                            f"{'them' if len(ranks) > 1 else 'it'} at their next collective or recv"}
        if j.together or j.grouped:
            evidence.update(together=j.together, grouped=j.grouped)
        return Finding(kind="slow", cls="comp-slow", ranks=ranks, comm=comm.id if comm else job, seq=-1, op=op,
                       onset_at=min(slow[r]["first_late_at"] for r in ranks), detected_at=now, evidence=evidence,
                       job=job)


def _detail(ops: Dict[str, ComputeOp], medians: Dict[str, Dict[int, float]], rank: int, found: Dict[str, Any],
            now: float) -> Dict[str, Any]:
    """One named rank's evidence: its median duration of the op and the other ranks', over the window
    (`medians`: per op, each rank's, filled on first use)."""
    name = found["op"]
    if name not in medians:
        medians[name] = {}
        for r, q in ops[name].spans.items():
            durations = list(itertools.takewhile(lambda d: d is not None, (
                e - b if e >= now - WINDOW_S else None for _, b, e in reversed(q) if e <= now)))
            if durations:
                medians[name][r] = statistics.median(durations)
    mine = medians[name]
    others = [m for r, m in mine.items() if r != rank]
    out: Dict[str, Any] = {"rank": rank, "op": name, "median_s": round(mine[rank], 6) if rank in mine else None,
                           "others_median_s": round(statistics.median(others), 6) if others else None}
    out.update((WORDS.get(k, k), v) for k, v in found.items() if k != "op")
    return out


def beside(f: Finding, late: List[Finding]) -> List[Finding]:
    """`late` (the comp-slow findings so far) with compute finding `f` in its place: as evidence of a
    late-arrival finding of its job that names one of its ranks (one finding; its summary says the
    durations where it named no cause);
    in place of one of its communicator that names other ranks (the compute durations say who holds
    the others; the late ranks wait for it, e.g. downstream in a pipeline: kept as evidence); else
    beside them."""
    for g in late:
        if g.job == f.job and set(g.ranks) & set(f.ranks):
            g.evidence = dict(g.evidence, compute=f.evidence, summary=_with_cause(g.evidence.get("summary", ""), f))
            return late
    same = next((g for g in late if g.job == f.job and g.comm == f.comm), None)
    if same is None:
        return late + [f]
    f.evidence = dict(f.evidence, late_arrival={k: same.evidence.get(k) for k in ("summary", "note")},
                      late_ranks=same.ranks)
    return [g for g in late if g is not same] + [f]


def _with_cause(summary: str, f: Finding) -> str:
    """A late-arrival summary ("rank 2 ~30 ms late at allreduce (unknown)") with the compute durations
    as the cause where it had none to say ("... (forward ~30 ms longer)")."""
    longer = {d["rank"]: f"({d['op']} {bucket(d['median_extra_s'])} longer)" for d in f.evidence["ranks"]}
    parts = summary.split("; ")
    for i, part in enumerate(parts):
        r = part.split(" ", 2)[1] if part.startswith("rank ") else ""
        if r.isdigit() and int(r) in longer and part.endswith("(unknown)"):
            parts[i] = part[:-len("(unknown)")] + longer[int(r)]
    return "; ".join(parts)
