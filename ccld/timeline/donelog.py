"""A communicator's completed collectives as arrays (DoneLog): what the slowdown detectors judge,
read with array operations instead of a walk over every CollView of the communicator each tick.

Each completion (comms.done_at) appends one entry: the collective's place in the order its views were
made (`made`: comm.colls is that order, and eviction takes the oldest made first, so the collectives
still held are exactly those with made >= comm.gone), its seq, op (a code of this log's own table),
completion time, and its first and last enter (Unix s). Entries stay in the order they completed;
`window` gives those still held, ordered newest made first, as comm.colls reversed would.
Appends go to a Python list (a completion costs a tuple), turned into arrays when next read, or
after MAX_PENDING appends without a read (a store loaded for `ccld links`, which runs no detector).
Bounds: entries of evicted collectives are dropped at a merge once they outnumber the held ones (at
most ~2x the communicator's collective bound plus MAX_PENDING); at most MAX_OPS op names a log (more
are logged as colltable.OVERFLOW_OP).
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Tuple

import numpy as np

from ccld.timeline.colltable import MAX_OPS, OVERFLOW_OP

MAX_PENDING = 4096  # completions appended between two reads, at most: then merged (and trimmed) by add


class Done(NamedTuple):
    """Completed collectives still held, newest made first: parallel arrays, and `appended`, each
    entry's position in the order of completion (counted from the log's first entry ever)."""
    seq: np.ndarray
    op: np.ndarray        # codes of DoneLog.names
    done: np.ndarray      # completed_at
    first: np.ndarray     # first enter
    last: np.ndarray      # last enter
    appended: np.ndarray

    @property
    def duration(self) -> np.ndarray:
        """Last enter to completion, s (at least 0): the time spent inside the collective."""
        return np.maximum(0.0, self.done - self.last)

    @property
    def spread(self) -> np.ndarray:
        """First to last enter, s."""
        return self.last - self.first


# an entry: its place in the making order, seq, op code, completion, first and last enter, and its
# position in the order of completion (Done.appended)
_ENTRY = np.dtype([("made", np.int64), ("seq", np.int64), ("op", np.int64), ("done", np.float64),
                   ("first", np.float64), ("last", np.float64), ("appended", np.int64)])


class DoneLog:
    __slots__ = ("names", "_codes", "_pending", "_rows", "total")

    def __init__(self) -> None:
        self.names: List[str] = []
        self._codes: Dict[str, int] = {}
        self._pending: List[Tuple[int, int, int, float, float, float, int]] = []  # _ENTRY's fields
        self._rows = np.zeros(0, dtype=_ENTRY)  # the entries merged, in the order of completion
        self.total = 0  # entries ever appended

    def add(self, made: int, seq: int, op: str, done: float, first: float, last: float, gone: int) -> None:
        """One completion; `gone`: the communicator's evicted count now (Comm.gone), for the bound."""
        code = self._codes.get(op)
        if code is None:
            if len(self.names) >= MAX_OPS:
                op = OVERFLOW_OP
            code = self._codes.get(op)
            if code is None:
                code = self._codes[op] = len(self.names)
                self.names.append(op)
        self._pending.append((made, seq, code, done, first, last, self.total))
        self.total += 1
        if len(self._pending) >= MAX_PENDING:  # nobody has read it for a while (a store loaded without ticks)
            self._merge(gone)

    def fresh(self, since: int) -> Tuple[List[int], List[float]]:
        """(op codes, durations) of the entries still logged that were appended at or after position
        `since` (Done.appended's count), read without merging or sorting: a screen of what completed
        since the last look (entries of collectives evicted meanwhile may be gone)."""
        p = self._pending
        n_old = self.total - len(p)
        ops = [x[2] for x in p[max(0, since - n_old):]]
        durs = [max(0.0, x[3] - x[5]) for x in p[max(0, since - n_old):]]
        if since < n_old:
            r = self._rows[int(np.searchsorted(self._rows["appended"], since)):]
            ops = r["op"].tolist() + ops
            durs = np.maximum(0.0, r["done"] - r["last"]).tolist() + durs
        return ops, durs

    def _merge(self, gone: int) -> np.ndarray:
        """The pending entries into the arrays; entries of evicted collectives (made < gone) dropped once
        they are most of them. Returns which entries are held."""
        if self._pending:
            self._rows = np.concatenate([self._rows, np.array(self._pending, dtype=_ENTRY)])
            self._pending = []
        held = self._rows["made"] >= gone
        if len(held) > 64 and 2 * int(held.sum()) < len(held):  # mostly evicted: drop them for good
            self._rows = self._rows[held]
            held = np.ones(len(self._rows), dtype=bool)
        return held

    def window(self, gone: int) -> Done:
        """The entries of collectives still held (made >= gone), newest made first."""
        held = self._merge(gone)  # first: it replaces _rows
        r = self._rows[held]
        r = r[np.argsort(-r["made"], kind="stable")]
        return Done(r["seq"], r["op"], r["done"], r["first"], r["last"], r["appended"])
