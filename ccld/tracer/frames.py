"""One frame from what the agent queued: Events and rows.Rows, in the order they were made.

The envelope is ccld/wire/codec.py's: plain events as maps in "events", the hot collective kinds
(coll, start, end) as one table in "blocks" (ccld/wire/table.py's form, schema 1.9: a group per set of
shared fields, each placed `at` the number of plain events made before its first row, so a reader
replays the frame in (nearly) the order it was made). Rows become the table with array operations
(rows.table); an Event of a hot kind (a failed end, or one made event by event elsewhere) becomes a
one-row Rows first, so every row of a frame is made one way. Times: every monotonic field goes through the node clock here (tests'
CCLD_TEST_CLOCK), the one place it is applied.
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

import msgpack
import numpy as np

from ccld import wire as ev
from ccld.bpf import rows as R
from ccld.tracer.nodeclock import NodeClock

_HOT = {"coll": R.KIND_COLL, "start": R.KIND_START, "end": R.KIND_END}


def _as_rows(e: ev.Event, groups: R.Groups) -> R.Rows:
    kind = _HOT[e.KIND]
    d = dict(e.__dict__)
    cols = {c: d.pop(c, 0 if c == "tid" else -1) for c in R.COLUMNS}
    if kind != R.KIND_COLL:
        cols["tid"], cols["lib_seq"] = 0, -1
    return R.Rows(np.array([kind], np.uint8), np.array([groups.id(kind, d)], np.int32),
                  {c: np.array([v], np.int64) for c, v in cols.items()}, groups.table)


def encode(agent: str, node: str, batch: int, items: Sequence[Any], clock: NodeClock) -> bytes:
    """The frame for `items` (Events and Rows), marked as one the sender may send again."""
    plain: List[Dict[str, Any]] = []
    parts = []
    groups = None
    for item in items:
        if isinstance(item, R.Rows):
            parts.append((len(plain), item))
        elif item.KIND in _HOT:
            if groups is None:
                groups = R.Groups()
            parts.append((len(plain), _as_rows(item, groups)))
        else:
            plain.append((item if clock.identity else clock.event(item)).to_wire())
    shift = None if clock.identity else (lambda ts: [clock.apply(t) for t in ts])
    env = {"v": [ev.SCHEMA_MAJOR, ev.SCHEMA_MINOR], "agent": agent, "node": node, "batch": batch, "resend": True,
           "events": plain}
    table = R.table(parts, shift)
    if table is not None:
        env["blocks"] = [table]
    return msgpack.packb(env, use_bin_type=True)


def count(item: Any) -> int:
    """Events an item stands for."""
    return len(item) if isinstance(item, R.Rows) else 1
