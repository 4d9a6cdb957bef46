"""How long a call waited between entering a collective and its work starting, as a hang's evidence.

Enter is the library call on the rank's own thread; start is when the work began: on NCCL, the first
of the collective's kernel channels the proxy saw start (the profiler plugin's WorkStart), so the gap
is the kernel's launch and its queueing behind earlier work on the stream; on gloo, when its worker
thread took the work. A rank that entered but never started is waiting for that (a stream blocked by
an earlier kernel, a launch that never came); a rank whose gap is far above the communicator's usual
one reached its kernel late. Both are host times (Unix seconds): GPU timestamps are another clock and
are not used here.

`queue_delays` gives, for one open collective: each started rank's gap (the largest first), how long
the unstarted ones have waited so far, and the communicator's usual gap, the median over the newest
HISTORY completed collectives (SAMPLE_RANKS ranks each). None where no start events come.
"""
from __future__ import annotations

import itertools
import statistics
from typing import Any, Dict, Iterable, List, Optional

from ccld.timeline.records import CollView, Comm

HISTORY = 32        # completed collectives the usual gap is taken from (the newest)
SAMPLE_RANKS = 64   # ... ranks of each (a 16k-rank collective need not be read whole)
SHOWN = 16          # ranks listed per field


def usual_gap(comm: Comm, skip_seq: int) -> Optional[float]:
    """The median enter -> start gap over the newest HISTORY completed collectives of `comm` but
    `skip_seq`, or None when none has start events."""
    gaps: List[float] = []
    used = 0
    for view in itertools.islice(reversed(comm.colls.values()), 4 * HISTORY):  # open ones skipped, a few
        if view.seq == skip_seq or view.completed_at is None or not view.start:
            continue
        enter = view.enter
        for r, t in itertools.islice(view.start.items(), SAMPLE_RANKS):
            e = enter.get(r)
            if e is not None and t >= e:
                gaps.append(t - e)
        used += 1
        if used >= HISTORY:
            break
    return statistics.median(gaps) if gaps else None


def queue_delays(comm: Comm, view: CollView, expected: Iterable[int], now: float) -> Optional[Dict[str, Any]]:
    """Enter -> start gaps of collective `view` on `comm` for the `expected` ranks that entered it
    (JSON-ready), or None when neither it nor the communicator's history has start events."""
    usual = usual_gap(comm, view.seq)
    if usual is None and not view.start:
        return None
    started, waiting = {}, {}
    for r in expected:
        e = view.enter.get(r)
        if e is None:
            continue
        s = view.start.get(r)
        if s is not None:
            started[r] = max(0.0, s - e)
        elif r not in view.end:  # over without a start event (no proxy step, say): not waiting to start
            waiting[r] = max(0.0, now - e)
    top = sorted(started.items(), key=lambda x: -x[1])[:SHOWN]
    out: Dict[str, Any] = {
        "started_after_s": {str(r): round(g, 6) for r, g in top},
        "not_started_for_s": {str(r): round(w, 3) for r, w in sorted(waiting.items(), key=lambda x: -x[1])[:SHOWN]},
        "n_started": len(started), "n_not_started": len(waiting),
        "usual_s": None if usual is None else round(usual, 6)}
    return out
