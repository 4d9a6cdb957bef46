"""Rows of a flush (collrows.py) that no int64 array can hold, or that lie outside what the CollStore
keys (colltable.py) can hold: found after a check on the arrays failed (collapply._batch), dropped, and
counted per field as the anomaly "<field>-out-of-range". The slow path: a Python pass over the rows.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List

from ccld.timeline.colltable import RANK_BITS, SEQ_SPAN
from ccld.timeline.intcol import IntColumn

if TYPE_CHECKING:
    from ccld.timeline.collrows import _Acc
    from ccld.timeline.timeline import Timeline


# field -> [lo, hi): what a row may carry and still be kept in int64 arrays and their keys; a row outside
# is dropped and counted (the schema's ints are unbounded; real ones are far inside)
BOUNDS = {"seq": (-SEQ_SPAN, SEQ_SPAN), "rank": (-(1 << 31), 1 << RANK_BITS), "pid": (-(1 << 62), 1 << 62),
           "ts_ns": (0, 1 << 61)}


def bad_rows(a: _Acc) -> Dict[str, List[int]]:
    """field -> the rows whose value lies outside BOUNDS (or past int64: count, nbytes; a run's clock
    conversion past +-2^61): the slow look, after a check on the arrays found one."""
    out: Dict[str, List[int]] = {}
    for name, (lo, hi) in BOUNDS.items():
        got = [i for i, v in enumerate(getattr(a, name)) if not lo <= v < hi]
        if got:
            out[name] = got
    for name in ("count", "nbytes"):
        got = [i for i, v in enumerate(a.extra.get(name, ())) if not -(1 << 62) <= v < 1 << 62]
        if got:
            out[name] = got
    lim, at, got = 1 << 61, 0, []
    for n, clk in zip(a.counts, a.clk):
        if not all(-lim < x < lim for x in clk):
            got.extend(range(at, at + n))
        at += n
    if got:
        out["clock"] = got
    return out


def drop(tl: Timeline, a: _Acc, bad: Dict[str, List[int]]) -> None:
    """Leave out rows `bad` (field -> rows), each counted once as "<field>-out-of-range"."""
    gone: set = set()
    for name, rows in bad.items():
        tl.anomalies[f"{name}-out-of-range"] += len(set(rows) - gone)
        gone.update(rows)
    keep = [i not in gone for i in range(a.n)]
    for name in ("comm", "seq", "rank", "pid", "ts_ns", "node", "agent"):
        setattr(a, name, _kept(getattr(a, name), keep))
    for name in list(a.extra):
        a.extra[name] = _kept(a.extra[name], keep)
    runs, at = [], 0
    for n in a.counts:  # each run of rows keeps its clock, less its dropped rows
        runs.append(sum(keep[at:at + n]))
        at += n
    a.clk = [c for c, n in zip(a.clk, runs) if n]
    a.counts = [n for n in runs if n]
    a.events = [x for x in a.events if -SEQ_SPAN <= x[1].seq < SEQ_SPAN]
    a.n = len(a.seq)


def _kept(values: Any, keep: List[bool]) -> Any:
    """The values whose `keep` is True, of the same kind (an IntColumn stays one)."""
    got = [v for v, k in zip(values, keep) if k]
    if isinstance(values, IntColumn):
        col = IntColumn()
        col.values(got)
        return col
    return got
