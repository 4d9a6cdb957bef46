"""A stand-in translator for the probe tests: keeps every drain a family hands over (its rows and
kinds, as the ring buffer gave them) and each record decoded one by one with ctypes (what the agent
did before its batch path; the decode the batch path's arrays are checked against). Optionally
forwards each drain to a real translator, keeping the flush times too, so a drain sequence can be
replayed into another translator exactly."""
from __future__ import annotations

from typing import List, Optional, Tuple  # noqa: F401

import numpy as np


class Recs(list):
    """(kind, ctypes record) in ring order; `.drains` the drains they came in."""
    drains: list


class Recorder:
    def __init__(self, kinds, forward=None):
        self.kinds = kinds                 # the family's records.Kinds
        self.forward = forward             # a translator to hand each drain to, or None
        self.drains: List[Tuple[str, object]] = []  # ("records", (rows, kinds)) and ("flush", now_ns), in order
        self.recs = Recs()                          # (kind, ctypes record), in ring order
        self.recs.drains = self.drains

    def records(self, rows: np.ndarray, kinds: np.ndarray) -> None:
        self.drains.append(("records", (rows.copy(), kinds.copy())))
        for row in rows:
            rec = self.kinds.record(row)
            self.recs.append((rec.hdr.kind, rec))
        if self.forward is not None:
            self.forward.records(rows, kinds)

    def flush(self, now_ns: int) -> None:
        if self.forward is not None and hasattr(self.forward, "flush"):
            self.drains.append(("flush", now_ns))
            self.forward.flush(now_ns)

    def _call(self, name, *args):
        self.drains.append(("call", (name, args)))
        if self.forward is not None:
            getattr(self.forward, name)(*args)

    def add_process(self, *args):
        self._call("add_process", *args)

    def tags_readable(self, *args):
        self._call("tags_readable", *args)

    def forget(self, *args):
        self._call("forget", *args)

    def __getattr__(self, name):  # counters (unmatched, unsized...) are the real translator's
        if name == "forward" or self.forward is None:
            raise AttributeError(name)
        return getattr(self.forward, name)

    def replay(self, translator, feed=None) -> None:
        """Hand the recorded drains, flushes and process changes to another translator, in order;
        `feed(kind, rec)` instead of records() reads the drains record by record."""
        for what, arg in self.drains:
            if what == "records":
                if feed is None:
                    translator.records(*arg)
                else:
                    for row in arg[0]:
                        rec = self.kinds.record(row)
                        feed(rec.hdr.kind, rec)
            elif what == "flush":
                translator.flush(arg)
            else:
                name, args = arg
                getattr(translator, name)(*args)


def rows_of(out: Optional[list] = None):
    """An emit that expands rows.Rows into Events (for assertions on what a translator sent)."""
    from ccld.bpf.rows import Rows
    got = [] if out is None else out

    def emit(item):
        got.extend(item.events() if isinstance(item, Rows) else [item])
    emit.out = got
    return emit
