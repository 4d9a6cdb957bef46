"""Rows: a drain's collective events (the hot wire kinds coll, start, end) as numpy columns.

Translators emit these instead of one Event object per record; the shipper turns them into the
frame's column blocks (ccld/wire/blocks.py's wire form) with array operations. A Rows holds events in
the order the translator made them (so any prefix of it is a valid cut: an enter never comes after
its collective's start or end), one row each: its kind (KIND_*), its group (an index into `groups`,
the fields shared by a block: for coll the communicator, op, backend and sizes; for start and end
the communicator, and ok/error), and the per-event columns seq, pid, rank, ts_ns, tid, lib_seq (tid
and lib_seq are only sent for coll). Times are CLOCK_MONOTONIC ns of this node, as in ccld/wire/schema.py.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ccld import wire as ev

KIND_COLL, KIND_START, KIND_END = 0, 1, 2
WIRE_KINDS = ("coll", "start", "end")
COLUMNS = ("seq", "pid", "rank", "ts_ns", "tid", "lib_seq")
# Per wire kind, the columns a block carries (the others stay out of the frame).
BLOCK_COLUMNS = {KIND_COLL: ("seq", "pid", "rank", "ts_ns", "tid", "lib_seq"),
                 KIND_START: ("seq", "pid", "rank", "ts_ns"),
                 KIND_END: ("seq", "pid", "rank", "ts_ns")}
_CLASSES = {KIND_COLL: ev.CollEnter, KIND_START: ev.WorkStart, KIND_END: ev.WorkEnd}
OPTIONAL = {"tid": 0, "lib_seq": -1}  # columns with a default in the schema (CollEnter's): a table may leave them out
_I4, _I8 = np.dtype("<i4"), np.dtype("<i8")  # made once: a dtype from its string costs more than a small copy
_I4_MIN, _I4_MAX = -(1 << 31), (1 << 31) - 1
MAX_GROUPS = 65536  # distinct shared-field sets one translator keeps numbered before starting afresh


def group_keys(*cols: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(first, inverse) for rows keyed by the int columns `cols` together: first[g] is the index of
    group g's first row, inverse[i] the group of row i; groups are numbered in order of first
    appearance. (np.unique(axis=0) does the same through a structured view, ~20x slower here.)"""
    n = len(cols[0])
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    order = np.lexsort(cols[::-1])  # stable: within a group, rows stay in index order
    new = np.zeros(n, bool)
    new[0] = True
    for c in cols:
        sc = c[order]
        new[1:] |= sc[1:] != sc[:-1]
    gid = np.cumsum(new) - 1
    first = order[new]
    by_first = np.argsort(first, kind="stable")
    rank = np.empty(len(first), np.int64)
    rank[by_first] = np.arange(len(first))
    inverse = np.empty(n, np.int64)
    inverse[order] = rank[gid]
    return first[by_first], inverse


class Groups:
    """Numbering of shared-field sets: (wire kind, sorted (field, value) pairs) -> a small int. Append
    only, so a Rows made earlier keeps reading its own numbers; `fresh()` starts a new table when
    too many sizes have been seen (each Rows holds the table it was made with)."""

    def __init__(self):
        self.table: List[Tuple[int, Tuple[Tuple[str, Any], ...]]] = []
        self._ids: Dict[Tuple[int, Tuple], int] = {}

    def id(self, kind: int, same: Dict[str, Any]) -> int:
        key = (kind, tuple(sorted(same.items())))
        got = self._ids.get(key)
        if got is None:
            if len(self.table) >= MAX_GROUPS:
                self.table, self._ids = [], {}
            got = self._ids[key] = len(self.table)
            self.table.append(key)
        return got


class Rows:
    """n events as columns (see the module's text). Columns are int64 arrays of length n."""
    __slots__ = ("kind", "group", "cols", "groups")

    def __init__(self, kind: np.ndarray, group: np.ndarray, cols: Dict[str, np.ndarray], groups: list):
        self.kind, self.group, self.cols, self.groups = kind, group, cols, groups

    def __len__(self) -> int:
        return int(self.kind.shape[0])

    def split(self, n: int) -> Tuple["Rows", "Rows"]:
        """The first n rows and the rest (a prefix is a valid cut: rows are in emission order)."""
        return (Rows(self.kind[:n], self.group[:n], {c: v[:n] for c, v in self.cols.items()}, self.groups),
                Rows(self.kind[n:], self.group[n:], {c: v[n:] for c, v in self.cols.items()}, self.groups))

    def events(self) -> List[ev.Event]:
        """The rows as Event objects, in order (tests, and readers that want objects)."""
        out = []
        cols = {c: v.tolist() for c, v in self.cols.items()}
        for i, (k, g) in enumerate(zip(self.kind.tolist(), self.group.tolist())):
            cls = _CLASSES[k]
            fields = dict(self.groups[g][1])
            for c in BLOCK_COLUMNS[k]:
                fields[c] = cols[c][i]
            out.append(cls(**fields))
        return out


def concat(parts: Sequence[Rows]) -> Rows:
    if len(parts) == 1:
        return parts[0]
    groups = parts[-1].groups
    if any(p.groups is not groups for p in parts):  # tables of several translators: renumber
        fresh = Groups()
        regrouped = []
        for p in parts:
            used, inv = np.unique(p.group, return_inverse=True)
            ids = np.array([fresh.id(p.groups[g][0], dict(p.groups[g][1])) for g in used.tolist()], np.int32)
            regrouped.append(Rows(p.kind, ids[inv.reshape(-1)] if len(p) else p.group, p.cols, fresh.table))
        parts, groups = regrouped, fresh.table
    return Rows(np.concatenate([p.kind for p in parts]), np.concatenate([p.group for p in parts]),
                {c: np.concatenate([p.cols[c] for p in parts]) for c in COLUMNS}, groups)


def pack_column(col: np.ndarray) -> bytes:
    """A packed column (schema 1.8): 4-byte ints where every value fits (seq, pid, rank: half the bytes of
    int64, about what MessagePack's varying ints took), else 8-byte (times). The one place the width is
    chosen (benches and tests that write agents' frames call it too)."""
    if len(col) and _I4_MIN <= int(col.min()) and int(col.max()) <= _I4_MAX:
        return col.astype(_I4).tobytes()
    return (col if col.dtype == _I8 else col.astype(_I8)).tobytes()


def table(parts: Sequence[Tuple[int, Rows]], shift=None) -> Optional[Dict[str, Any]]:
    """The wire table (ccld/wire/table.py's form, schema 1.9) of the rows of one frame, None when there
    are none: `parts` are (at, rows), `at` being the number of the frame's plain events made before
    those rows. One group per shared-field set, placed `at` the first of its rows; groups in order of
    kind (the collector gathers a run of one kind at once), then of that place, then of their numbers;
    a group's rows contiguous and sorted by seq (stable: readers rely on it for speed). A column is
    sent when some kind present has it (tid and lib_seq: coll rows) and, for an OPTIONAL one, some row
    of such a kind holds other than its default; a row of a kind without the field carries filler
    there. `shift` maps a list of times to this node's reported clock (NodeClock)."""
    if not sum(len(r) for _, r in parts):
        return None
    ats = np.concatenate([np.full(len(r), at, np.int64) for at, r in parts])
    rows = concat([r for _, r in parts])
    # the group numbers include the kind; parts come in order, so a group's first row has its least at
    used, first, inv = np.unique(rows.group, return_index=True, return_inverse=True)
    inv = inv.reshape(-1)
    first_at = ats[first]
    kind_of = np.array([rows.groups[int(g)][0] for g in used.tolist()], np.int64)
    by_place = np.lexsort((used, first_at, kind_of))
    place = np.empty(len(used), np.int64)
    place[by_place] = np.arange(len(used))
    row_place = place[inv]
    order = np.lexsort((rows.cols["seq"], row_place))
    sizes = np.bincount(row_place, minlength=len(used)).tolist()
    groups, kinds = [], set()
    for p, g in enumerate(by_place.tolist()):
        kind, same = rows.groups[int(used[g])]
        kinds.add(kind)
        groups.append([WIRE_KINDS[kind], sizes[p], int(first_at[g]), dict(same)])
    cols = {}
    for c in COLUMNS:
        having = [k for k in kinds if c in BLOCK_COLUMNS[k]]
        if not having:
            continue
        if c in OPTIONAL:  # left out when every row that has the field holds its default (gloo: lib_seq)
            other = rows.cols[c] != OPTIONAL[c]
            if not other.any() or not any((other & (rows.kind == k)).any() for k in having):
                continue
        col = rows.cols[c][order]
        if shift is not None and c == "ts_ns":
            col = np.array(shift(col.tolist()), np.int64)
        cols[c] = pack_column(col)
    return {"k": "table", "n": len(order), "groups": groups, "cols": cols}


class Builder:
    """Collects a translator's output for one drain, in order: Events as they come, rows appended as
    arrays (or one by one, for the rare paths), cut into a Rows wherever an Event comes between them.
    `items()` hands the lot to emit."""

    def __init__(self, groups: Groups):
        self.groups = groups
        self.items: List[Any] = []
        self._parts: List[Rows] = []
        self._one: List[Tuple] = []  # rows added one by one: (kind, group, seq, pid, rank, ts, tid, lib_seq)

    def event(self, e: ev.Event) -> None:
        self._cut()
        self.items.append(e)

    def add(self, kind: np.ndarray, group: np.ndarray, cols: Dict[str, np.ndarray]) -> None:
        if len(kind):
            self._flush_one()
            self._parts.append(Rows(kind, group, cols, self.groups.table))

    def one(self, kind: int, group: int, seq: int, pid: int, rank: int, ts_ns: int, tid: int = 0,
            lib_seq: int = -1) -> None:
        """One row; `group` from self.groups.id()."""
        self._one.append((kind, group, seq, pid, rank, ts_ns, tid, lib_seq))

    def _flush_one(self) -> None:
        if self._one:
            a = np.array(self._one, np.int64)
            self._one = []
            self._parts.append(Rows(a[:, 0].astype(np.uint8), a[:, 1].astype(np.int32),
                                    {c: a[:, 2 + i] for i, c in enumerate(COLUMNS)}, self.groups.table))

    def _cut(self) -> None:
        self._flush_one()
        if self._parts:
            self.items.append(concat(self._parts))
            self._parts = []

    def done(self) -> List[Any]:
        self._cut()
        items, self.items = self.items, []
        return items
