"""Tables: a frame's collective rows of every communicator and kind in one block (schema 1.9), and the
reader of a frame's "blocks" list.

Since 1.4 a frame carries its hot rows (coll, start, end) as column blocks, one per set of shared
fields (blocks.py): a node whose ranks use two communicators sends six blocks a frame, and the
collector paid per block (a MessagePack map, its keys, its validation, its gathering) about what it
paid for its eight rows (bench/RESULTS.md, collector_scale). A table is one entry of the "blocks" list
holding all of them: their shared fields as a list of groups, their int columns packed once, the rows
of a group contiguous:

    {"k": "table", "n": 48,
     "groups": [["coll", 8, 1, {"comm": "job/gloo:0", "op": "allreduce", "backend": "gloo"}],
                ["start", 8, 1, {"comm": "job/gloo:0"}], ...],       # [kind, rows, at, shared fields]
     "cols": {"seq": b"...", "pid": b"...", "rank": b"...", "ts_ns": b"...", "tid": b"..."}}

Group i holds the rows after those of the groups before it; `at` is what a block's "at" is. Every
column is packed (blocks.py: n little-endian ints of 1, 2, 4 or 8 bytes, the width its length / n) and
spans all n rows; a group reads the columns that are fields of its kind and ignores the others (a
start row has no `tid`: its bytes there are filler). A group is thus a block. A table whose every group
passes _plain (known kind, shared fields of the exact types, no field both shared and a column,
every required field there) is kept as a Table, which the timeline gathers without a Block per group
(timeline/collrows.py); any other table is read group by group through blocks.read_block, which names
each problem, and becomes Blocks.
Compatibility: a reader of 1.8 or older sees a block of the unknown kind "table" and skips its n rows,
counted as events of a newer kind; upgrade collectors before agents.
Caveat: a table whose header is wrong (n, the groups' rows, a column's length) is dropped whole, its
rows counted as bad; a bad group drops its own rows only.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from ccld.wire.blocks import _FAST, Block, _fast_spec, in_order, packed_width, read_block
from ccld.wire.schema import EVENT_TYPES, SCHEMA_MINOR
from ccld.wire.validate import MAX_EVENTS_PER_FRAME, FrameError, Rejects, show

KIND = "table"
Group = Tuple[str, int, int, int, Dict[str, Any], Tuple[str, ...]]  # kind, first row, rows, at, same, its columns


class Table:
    """A checked table: `groups` (kind, first row, rows, at, shared fields, the columns its kind has),
    `cols` name -> (width, packed bytes of n rows); `at` its first group's place."""
    __slots__ = ("n", "at", "groups", "cols", "_blocks")
    kind = KIND

    def __init__(self, n: int, groups: List[Group], cols: Dict[str, Tuple[int, bytes]]):
        self.n, self.groups, self.cols = n, groups, cols
        self.at = min(g[3] for g in groups)
        self._blocks: Optional[List[Block]] = None

    def column(self, name: str, first: int, rows: int) -> bytes:
        """Rows first..first+rows of packed column `name`."""
        w, raw = self.cols[name]
        return raw[first * w:(first + rows) * w]

    def blocks(self) -> List[Block]:
        """The groups as Blocks (for readers of blocks: events, alignment, replay order), made once."""
        if self._blocks is None:
            self._blocks = [Block(kind, rows, at, dict(same), {},
                                  {c: self.column(c, first, rows) for c in names} or None)
                            for kind, first, rows, at, same, names in self.groups]
        return self._blocks


def table_width(raw: Any, n: int) -> int:
    """The width in bytes of a packed column of n rows (blocks.packed_width's rule); 0 when `raw` is not
    bytes of n times a width."""
    return packed_width(raw, n) if type(raw) is bytes else 0


def _header(raw: Dict[str, Any]) -> Tuple[int, List[Any], Dict[Any, Any]]:
    """(n, groups, cols) of a table, checked: n in range, the groups' rows summing to n, every column
    packed bytes of n rows. Raises FrameError("bad-table", ...) naming the first problem."""
    n, groups, cols = raw.get("n"), raw.get("groups"), raw.get("cols")
    if type(n) is not int or not 1 <= n <= MAX_EVENTS_PER_FRAME:
        raise FrameError("bad-table", f"table: 'n' should be an int in 1..{MAX_EVENTS_PER_FRAME}, got {show(n)}")
    if type(groups) is not list or not groups:
        raise FrameError("bad-table", f"table: 'groups' should be a non-empty list, got {show(groups)}")
    if type(cols) is not dict:
        raise FrameError("bad-table", f"table: 'cols' should be a map, got {show(cols)}")
    total = 0
    for i, g in enumerate(groups):
        if not (type(g) is list and len(g) == 4 and type(g[1]) is int and g[1] >= 1):
            raise FrameError("bad-table", f"table: group #{i} should be [kind, rows >= 1, at, shared fields], "
                                          f"got {show(g)}")
        total += g[1]
    if total != n:
        raise FrameError("bad-table", f"table: its groups hold {total} rows, its 'n' says {n}")
    for name, col in cols.items():
        if type(name) is not str:
            raise FrameError("bad-table", f"table: a column's name should be str, got {show(name)}")
        if not table_width(col, n):
            got = f"{len(col)} bytes" if type(col) is bytes else type(col).__name__
            raise FrameError("bad-table", f"table: column {name!r} should be {n}, {2 * n}, {4 * n} or {8 * n} "
                                          f"bytes ({n} packed little-endian ints), got {got}")
    return n, groups, cols


def group_blocks(raw: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The table's groups as wire blocks (blocks.py's maps, every column a packed slice of the group's
    rows), unchecked beyond the header (the exporter's reader). Raises FrameError for a bad header."""
    return _group_blocks(*_header(raw))


def _group_blocks(n: int, groups: List[Any], cols: Dict[Any, Any]) -> List[Dict[str, Any]]:
    """group_blocks of a header already checked."""
    widths = {name: len(col) // n for name, col in cols.items()}
    out = []
    at = 0
    for kind, rows, where, same in groups:
        out.append({"k": kind, "n": rows, "at": where, "same": same,
                    "cols": {name: col[at * widths[name]:(at + rows) * widths[name]] for name, col in cols.items()}})
        at += rows
    return out


# (kind, the table's column names) -> (the names among them that are int fields of the kind, how many of
# the kind's required fields they are), or None when one is a field of another type (read_block names it)
_LAYOUT: Dict[Tuple[str, Tuple[str, ...]], Optional[Tuple[Tuple[str, ...], int]]] = {}


def _layout(kind: str, names: Tuple[str, ...]) -> Optional[Tuple[Tuple[str, ...], int]]:
    key = (kind, names)
    if key in _LAYOUT:
        return _LAYOUT[key]
    cls = EVENT_TYPES.get(kind)
    got: Optional[Tuple[Tuple[str, ...], int]] = None
    if cls is not None:
        exact = (_FAST.get(kind) or _fast_spec(kind, cls))[1]
        fields = set(cls.__dataclass_fields__)
        mine = tuple(c for c in names if c in fields)
        if all(exact.get(c, (None,))[0] is int for c in mine):
            got = (mine, sum(exact[c][1] for c in mine))
    if len(_LAYOUT) < 4096 and len(names) <= 16:  # agents send <= 6 columns; a hostile frame's many are not kept
        _LAYOUT[key] = got
    return got


def _plain(n: int, groups: List[Any], cols: Dict[str, bytes], n_events: int) -> Optional[Table]:
    """The table as a Table when every group is what agents send and read_block would keep as it is;
    None sends it group by group through read_block."""
    names = tuple(cols)
    out: List[Group] = []
    first = 0
    for kind, rows, at, same in groups:
        if type(kind) is not str or type(at) is not int or not 0 <= at <= n_events or type(same) is not dict:
            return None
        layout = _layout(kind, names)  # first: it fills _FAST for a kind first seen here
        spec = _FAST.get(kind)
        if spec is None or layout is None:
            return None
        mine, seen_req = layout
        if rows > 1 and not mine:
            return None
        exact = spec[1]
        for name, value in same.items():
            t = exact.get(name) if type(name) is str else None
            if t is None or type(value) is not t[0] or name in mine:
                return None
            seen_req += t[1]
        if seen_req != spec[2]:
            return None
        out.append((kind, first, rows, at, same, mine))
        first += rows
    return Table(n, out, {c: (len(v) // n, v) for c, v in cols.items()})


def read_table(raw: Dict[str, Any], n_events: int, rejects: Rejects, where: str) -> Tuple[List[Any], int]:
    """([the Table], 0) for a table agents send; else (its good groups as Blocks, rows skipped as of
    kinds newer than this reader), bad groups dropped and counted in `rejects`."""
    try:
        n, groups, cols = _header(raw)
    except FrameError as e:
        said = raw.get("n")
        return [], rejects.drop(e, where, said if type(said) is int and 0 < said <= MAX_EVENTS_PER_FRAME else 1)
    got = _plain(n, groups, cols, n_events)
    if got is not None:
        return [got], 0
    out, skipped = [], 0
    for i, b in enumerate(_group_blocks(n, groups, cols)):
        kind = b["k"]
        layout = _layout(kind, tuple(cols)) if type(kind) is str else None
        if layout is not None:  # else: an unknown kind, or a column of another type (read_block says which)
            b["cols"] = {c: b["cols"][c] for c in layout[0]}
        elif type(kind) is str and kind in EVENT_TYPES:
            fields = EVENT_TYPES[kind].__dataclass_fields__
            b["cols"] = {c: v for c, v in b["cols"].items() if c in fields}
        try:
            out.append(read_block(b, n_events))
        except FrameError as e:
            skipped += rejects.drop(e, f"{where} group #{i}", b["n"])
    return out, skipped


def read_blocks(raw: Any, n_events: int, rejects: Rejects) -> Tuple[List[Any], int]:
    """(good blocks and tables, events skipped as of unknown kinds) from a frame's "blocks" list. Bad
    blocks are dropped, each of their events counted in `rejects`."""
    if type(raw) is not list:
        raise FrameError("bad-envelope", f"frame envelope field 'blocks' is not a list (got {type(raw).__name__})")
    out: List[Any] = []
    skipped = total = 0
    for i, b in enumerate(raw):
        n = b.get("n") if type(b) is dict else None
        weight = n if type(n) is int and 0 < n <= MAX_EVENTS_PER_FRAME else 1
        total += weight
        if total > MAX_EVENTS_PER_FRAME:
            raise FrameError("too-many-items", f"frame's blocks hold more than {MAX_EVENTS_PER_FRAME} events "
                                               f"(the most a frame may carry)")
        if type(b) is dict and b.get("k") == KIND:
            got, more = read_table(b, n_events, rejects, f"block #{i} (table)")
            out.extend(got)
            skipped += more
            continue
        try:
            out.append(read_block(b, n_events))
        except FrameError as e:
            skipped += rejects.drop(e, f"block #{i}", weight)
    return out, skipped


def as_blocks(parts: List[Any]) -> List[Block]:
    """Blocks and tables as Blocks only (each table's groups)."""
    if all(type(p) is Block for p in parts):
        return parts
    out: List[Block] = []
    for p in parts:
        if type(p) is Table:
            out.extend(p.blocks())
        else:
            out.append(p)
    return out


def expand(env: Dict[str, Any]) -> List[Any]:
    """A decoded envelope's wire events with its blocks expanded back into wire maps, in order
    (for readers that walk raw maps). Blocks that are not well formed are left out."""
    evs = env.get("events")
    evs = evs if type(evs) is list else []
    raw = env.get("blocks")
    if type(raw) is not list or not raw:
        return evs
    try:
        good, _ = read_blocks(raw, len(evs), Rejects("", 0, SCHEMA_MINOR))  # bad blocks left out, as said
    except FrameError:
        return evs
    out: List[Any] = []
    for item in in_order(evs, as_blocks(good)):
        if type(item) is tuple:
            b, _, i, j = item
            out.extend(b.wire()[i:j])
        else:
            out.append(item)
    return out
