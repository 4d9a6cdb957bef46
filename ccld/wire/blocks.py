"""Column blocks: the batched wire form of the three hot event kinds (coll, start, end).

A busy node sends thousands of collective events a second, and the collector cannot afford a Python
object and a map per event (bench/RESULTS.md: ~2.4 µs of decode alone per map-shaped event). Since
schema 1.4 a frame may carry, beside its "events" list, a "blocks" list. A block holds the events of
one kind that agree on every field but the per-rank ones, as columns:

    {"k": "coll", "n": 8, "at": 3,
     "same": {"comm": "job/gloo:0", "seq": 57, "op": "allreduce", "backend": "gloo", ...},
     "cols": {"pid": [...8], "rank": [...8], "ts_ns": [...8], "tid": [...8]}}

`at` is how many entries of the frame's "events" list came before the block's first event, so a
reader can replay the frame in (nearly) the order it was made: a block's rows are placed together at
its first row. Any field may be in `same` or in `cols`; a reader must accept both. Since 1.8 a column
of an int field may also be *packed*: a MessagePack bin of n little-endian signed ints of 1, 2, 4 or 8
bytes each, the width being its length / n (agents send 4 where every value fits, else 8). Block.bin
keeps those bytes (the timeline reads them with np.frombuffer); Block.cols unpacks them into lists on
first use. Since 1.9 an entry of the list may be a *table* (table.py, which reads the list): all of a
frame's blocks in one. Times: as in schema.py (the sender's CLOCK_MONOTONIC ns); nothing here
converts them. Values are checked by the same validator as maps' (validate.py): read_fields, field by
field. A block whose every field is known and of an exact type (int, str, bool), as agents send them,
is first tried by _fits, a few tight loops that accept only what read_fields accepts; anything else,
and every bad block, gets read_fields and its message.
Caveat: a block that fails validation is dropped whole and its rows counted as bad events by reason;
the frame's other blocks and events are kept.
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
import operator
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ccld.wire.schema import EVENT_TYPES, Event, field_types
from ccld.wire.validate import (EXACT_TYPES, MAX_EVENTS_PER_FRAME, FrameError, column_problem, read_spec, show,
                                type_problem)

# kind -> the fields that differ from event to event (columns); every other field is shared by a block.
# seq is a column so that one block holds a whole frame's worth of one communicator's collectives:
# per-block costs (a map, its validation) are then paid once per frame, not once per collective.
ROW_FIELDS: Dict[str, Tuple[str, ...]] = {
    "coll": ("seq", "pid", "rank", "ts_ns", "tid"),
    "start": ("seq", "pid", "rank", "ts_ns"),
    "end": ("seq", "pid", "rank", "ts_ns"),
}


WIDTHS: Dict[int, Any] = {1: np.dtype("<i1"), 2: np.dtype("<i2"), 4: np.dtype("<i4"), 8: np.dtype("<i8")}  # by bytes


def packed_width(raw: bytes, n: int) -> int:
    """The width in bytes of each of the n values of a packed column; 0 when its length fits none."""
    w, rest = divmod(len(raw), n)
    return w if not rest and w in WIDTHS else 0


def unpack(raw: bytes, n: int) -> List[int]:
    """A packed column's n values (its length must be a width times n: packed_width)."""
    values: List[int] = np.frombuffer(raw, WIDTHS[len(raw) // n]).tolist()
    return values


class Block:
    """One validated block: `n` events of `kind` sharing `same`, with per-event `cols` (lists of n);
    `bin`: the columns that came packed (name -> 8n bytes), None when none did."""
    __slots__ = ("kind", "n", "at", "same", "_cols", "bin")

    def __init__(self, kind: str, n: int, at: int, same: Dict[str, Any], cols: Dict[str, List[Any]],
                 bin: Optional[Dict[str, bytes]] = None):
        self.kind = kind  # one store a slot, not a tuple unpacked: read_block makes one Block a block
        self.n = n
        self.at = at
        self.same = same
        self._cols = cols
        self.bin = bin

    @property
    def lists(self) -> Dict[str, List[Any]]:
        """The columns that are lists now (those that came packed are in `bin` until `cols` unpacks them)."""
        return self._cols

    @property
    def cols(self) -> Dict[str, List[Any]]:
        """Every column as a list of values: packed ones are unpacked (once; `bin` is then None, since
        a reader may reorder or replace the lists: seq_runs, align)."""
        if self.bin:
            for name, raw in self.bin.items():
                self._cols[name] = unpack(raw, self.n)
            self.bin = None
        return self._cols

    def rows(self) -> List[Event]:
        """The block as event objects (the slow, general way to read it)."""
        cls, req, opt, defaults, factories = read_spec(EVENT_TYPES[self.kind])
        base = dict(defaults)
        base.update(self.same)
        names = list(self.cols)
        out = []
        for values in self._value_rows(names):
            args = dict(base)
            args.update(zip(names, values))
            for name, factory in factories:
                if name not in args:
                    args[name] = factory()
            e = object.__new__(cls)
            e.__dict__.update(args)
            out.append(e)
        return out

    def _value_rows(self, names: List[str]) -> Iterator[Tuple[Any, ...]]:
        """Each row's values of the columns `names`; n empty rows when every field is shared (n
        identical events: zip of no columns would give none)."""
        if not names:
            return itertools.repeat((), self.n)
        return zip(*(self.cols[c] for c in names))

    def wire(self) -> List[Dict[str, Any]]:
        """The block as wire maps, one per event, as they would be in a frame's "events" list."""
        names = list(self.cols)
        head = {"k": self.kind}
        head.update(self.same)
        out = []
        for values in self._value_rows(names):
            d = dict(head)
            d.update(zip(names, values))
            out.append(d)
        return out


# ---- writing -------------------------------------------------------------------------------------

_GETTERS: Dict[type, Tuple[Tuple[str, ...], Any, Any]] = {}  # class -> (shared names, their getter, row getter)


def _getters(cls: type, rowf: Tuple[str, ...]) -> Tuple[Tuple[str, ...], Any, Any]:
    got = _GETTERS.get(cls)
    if got is None:
        shared = tuple(f.name for f in dataclasses.fields(cls) if f.name not in rowf)
        # itemgetter of 2+ names returns a tuple, in C: the agent runs this once per event
        one = shared[0] if len(shared) == 1 else None
        get_same = operator.itemgetter(*shared) if one is None else (lambda d: (d[one],))  # always a tuple
        got = _GETTERS[cls] = (shared, get_same, operator.itemgetter(*rowf))
    return got


def split(events: Sequence[Event]) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """(wire maps of the events that stay maps, blocks) for one frame, in the shape described above.
    Rows of a block are sorted by seq (stable), so each collective's rows are one run: readers rely on
    that for speed, though they must accept any order."""
    plain: List[Dict[str, Any]] = []
    blocks: Dict[Tuple[Any, ...], Tuple[Dict[str, Any], List[Tuple[Any, ...]]]] = {}
    for e in events:
        rowf = ROW_FIELDS.get(e.KIND)
        if rowf is None:
            plain.append(e.to_wire())
            continue
        shared, get_same, get_row = _getters(type(e), rowf)
        d = e.__dict__
        key = (e.KIND, get_same(d))
        got = blocks.get(key)
        if got is None:
            got = blocks[key] = ({"k": e.KIND, "n": 0, "at": len(plain), "same": dict(zip(shared, key[1]))}, [])
        got[1].append(get_row(d))
    out = []
    for (kind, _), (b, rows) in blocks.items():
        rows.sort(key=_first)  # seq is the first row field
        b["n"] = len(rows)
        b["cols"] = {f: list(col) for f, col in zip(ROW_FIELDS[kind], zip(*rows))}
        out.append(b)
    return plain, out


_first = operator.itemgetter(0)  # a row's seq


# ---- reading -------------------------------------------------------------------------------------

# kind -> (its class, {field: (its exact type, 1 if required else 0)}, how many fields it requires), for
# read_block's fast path. Only fields of an exact type (int, str, bool) are in the map: a block with a List
# or Dict field (or one this reader does not know) gets the full check.
FastSpec = Tuple[type, Dict[str, Tuple[type, int]], int]
_FAST: Dict[str, FastSpec] = {}
SHORT_COLUMN = 12  # rows up to which a Python loop over a column beats [*map(type, col)].count (CPython 3.11)
_NO_FIELDS: Dict[str, Any] = {}  # a block's "same" when it has none (read, never written: Blocks get copies)


def _fast_spec(kind: str, cls: type) -> FastSpec:
    req, opt = field_types(cls)
    exact = {name: (EXACT_TYPES[t], 0) for name, t in opt.items() if t in EXACT_TYPES}
    exact.update({name: (EXACT_TYPES[t], 1) for name, t in req.items() if t in EXACT_TYPES})
    got = _FAST[kind] = (cls, exact, len(req))
    return got


def read_block(raw: Any, n_events: int) -> Block:
    """Validate one wire block (a frame with `n_events` plain events). Raises FrameError naming the field."""
    if type(raw) is not dict:
        raise FrameError("bad-block", f"block is a {type(raw).__name__}, not a map")
    kind = raw.get("k")
    if type(kind) is not str:
        raise FrameError("bad-block", f"block kind (field 'k') should be str, got {type(kind).__name__}")
    fast = _FAST.get(kind)
    if fast is None:
        cls = EVENT_TYPES.get(kind)
        if cls is None:
            raise FrameError("unknown-kind", f"unknown event kind {show(kind)} in a block")
        fast = _fast_spec(kind, cls)
    cls, exact, n_req = fast
    n, at, same, cols = raw.get("n"), raw.get("at", 0), raw.get("same", _NO_FIELDS), raw.get("cols")
    if type(n) is not int or n < 1 or n > MAX_EVENTS_PER_FRAME:
        raise FrameError("bad-block", f"block of {kind!r}: 'n' should be an int in 1..{MAX_EVENTS_PER_FRAME}, "
                                      f"got {show(n)}")
    if type(at) is not int or not 0 <= at <= n_events:
        raise FrameError("bad-block", f"block of {kind!r}: 'at' should be an int in 0..{n_events}, got {show(at)}")
    if type(same) is not dict or type(cols) is not dict:
        raise FrameError("bad-block", f"block of {kind!r}: 'same' and 'cols' should be maps")
    got = _fits(exact, n_req, n, same, cols)
    if got is True:
        return Block(kind, n, at, same.copy(), cols.copy())  # copies: seq_runs reorders b.cols in place
    if got:  # some columns packed
        return Block(kind, n, at, same.copy(), {k: v for k, v in cols.items() if type(v) is list},
                     {k: v for k, v in cols.items() if type(v) is bytes})
    return read_fields(kind, cls, n, at, same, cols)


def _fits(exact: Dict[str, Tuple[type, int]], n_req: int, n: int, same: Dict[Any, Any], cols: Dict[Any, Any]) -> Any:
    """True (or "packed", when some columns are) only when read_fields would accept the block and keep
    every field (so the Block is the same): every name a str naming a field of an exact type, every
    value of that very type, every column a list of n (or, for an int field, 8n packed bytes), none both
    shared and a column, every required field there (counted: the names are distinct), at least one
    column. False sends a block to read_fields (a bad value, an unknown field, a List field, ...), which
    names the first problem. Python loops, not set(map(type, col)): for a block's few fields and rows
    they are the cheaper (and a hit is the common case)."""
    seen_req = 0
    packed = False
    try:
        for name, value in same.items():
            if type(name) is not str:
                return False
            t, req = exact[name]  # KeyError: not a field of an exact type
            if type(value) is not t:
                return False
            seen_req += req
        for name, col in cols.items():
            if type(name) is not str:
                return False
            t, req = exact[name]
            if type(col) is bytes and t is int and packed_width(col, n) and name not in same:
                packed = True
                seen_req += req
                continue
            if type(col) is not list or len(col) != n or name in same:
                return False
            if n <= SHORT_COLUMN:
                for x in col:
                    if type(x) is not t:
                        return False
            elif [*map(type, col)].count(t) != n:
                return False
            seen_req += req
    except KeyError:
        return False
    if seen_req != n_req or not cols:
        return False
    return "packed" if packed else True


def read_fields(kind: str, cls: type, n: int, at: int, same: Dict[Any, Any], cols: Dict[Any, Any]) -> Block:
    """The full check of a block's fields, one by one: the first problem is the one named."""
    req, opt = field_types(cls)
    known_same: Dict[str, Any] = {}
    known_cols: Dict[str, List[Any]] = {}
    known_bin: Dict[str, bytes] = {}
    for name, value in same.items():
        declared = req.get(name) or opt.get(name) if type(name) is str else None
        if declared is None:
            continue  # an unknown field: a newer minor version may add some
        got = type_problem(declared, value)
        if got is not None:
            raise FrameError("bad-field", f"block of {kind!r}: field {name!r} should be {declared}, got {got}")
        known_same[name] = value
    for name, col in cols.items():
        declared = req.get(name) or opt.get(name) if type(name) is str else None
        if declared is None:
            continue
        if type(col) is bytes:  # packed (1.8): n little-endian int64, for int fields only
            if declared != "int":
                raise FrameError("bad-field", f"block of {kind!r}: column {name!r} is packed bytes, but only int "
                                              f"fields may be; it should be a list of {n} {declared}")
            if not packed_width(col, n):
                raise FrameError("bad-block", f"block of {kind!r}: packed column {name!r} has {len(col)} bytes, "
                                              f"should have {n}, {2 * n}, {4 * n} or {8 * n} ({n} little-endian "
                                              f"ints of 1, 2, 4 or 8 bytes)")
        elif type(col) is not list or len(col) != n:
            raise FrameError("bad-block", f"block of {kind!r}: column {name!r} should be a list of {n}, got "
                                          f"{type(col).__name__}{' of ' + str(len(col)) if type(col) is list else ''}")
        else:
            got = column_problem(declared, col)
            if got is not None:
                raise FrameError("bad-field", f"block of {kind!r}: column {name!r} should hold {declared}, has {got}")
        if name in known_same:
            raise FrameError("bad-block", f"block of {kind!r}: field {name!r} is both shared and a column")
        (known_bin if type(col) is bytes else known_cols)[name] = col
    for name in req:
        if name not in known_same and name not in known_cols and name not in known_bin:
            raise FrameError("missing-field", f"block of {kind!r}: missing field {name!r}")
    if n > 1 and not known_cols and not known_bin:
        # n identical events (not even ts_ns differs): nothing makes them, and a few bytes would cost
        # the collector n events' work (a column costs the sender a byte a row at least)
        raise FrameError("bad-block", f"block of {kind!r}: {n} rows but no column")
    return Block(kind, n, at, known_same, known_cols, known_bin or None)


KIND_ORDER = {"coll": 0, "start": 1, "end": 2}  # within one collective a rank enters, starts, then ends
# Map events that say who is who (a rank announced, a communicator built): the rows after one in the
# frame may need it, so one that comes after the first block is applied before the blocks' rows.
ANNOUNCE_KINDS = frozenset({"rank", "comm"})


def seq_runs(b: Block) -> List[Tuple[int, int, int]]:
    """[(seq, i, j)]: rows i:j of block `b` are collective seq. Writers sort rows by seq; a block that
    is not sorted is sorted here (its columns are reordered in place)."""
    if "seq" in b.same:
        return [(b.same["seq"], 0, b.n)]
    seqs = b.cols.get("seq")
    if type(seqs) is not list:
        return [(-1, 0, b.n)]  # no seq at all: the event-by-event reader reports it
    if seqs[0] == seqs[-1] and len(set(seqs)) == 1:
        return [(seqs[0], 0, b.n)]
    if seqs != sorted(seqs):
        order = sorted(range(b.n), key=seqs.__getitem__)
        for c, v in b.cols.items():
            b.cols[c] = [v[k] for k in order]
        seqs = b.cols["seq"]
    out, i = [], 0
    for s in sorted(set(seqs)):  # one bisect per collective instead of a Python step per row
        j = bisect.bisect_right(seqs, s, i)
        out.append((s, i, j))
        i = j
    return out


def _kind(e: Any) -> Any:
    """The kind of a plain event: an Event, or a wire map (expand() reads those unvalidated)."""
    k = e.get("k") if type(e) is dict else getattr(e, "KIND", None)
    return k if type(k) is str else None


def frame_order(plain: List[Any], blocks: List[Block]) -> Iterator[Any]:
    """The frame's plain events and whole blocks in the order a reader should apply them: the plain
    events before the first block, then the announcements among the rest (a RankInfo, a CommInit:
    ANNOUNCE_KINDS), then the blocks (yielded as Block), then the remaining plain events. Without the
    announcements first, a subgroup built in the middle of a frame would get its first collective
    before its CommInit (its size unknown, so that collective would never be complete). A reader that
    applies a block's rows in the frame's order must order them itself (in_order does)."""
    if not blocks:
        yield from plain
        return
    at = min(b.at for b in blocks)
    yield from plain[:at]
    later = []
    for e in plain[at:]:
        if _kind(e) in ANNOUNCE_KINDS:
            yield e
        else:
            later.append(e)
    yield from blocks
    yield from later


def in_order(plain: List[Any], blocks: List[Block]) -> Iterator[Any]:
    """The frame's events in the order a reader should apply them one at a time: frame_order, with the
    blocks as runs (block, seq, i, j), rows i:j of a block, all of collective seq, ordered by (seq,
    enter before start before end). A block gathers a whole frame's rows, so without that merge a frame
    holding an allreduce then a broadcast would replay the broadcast's ends (in the one "end" block)
    before its enters (in the broadcast's "coll" block)."""
    runs: List[Tuple[int, int, int, int, int, Block]] = []
    for item in frame_order(plain, blocks):
        if type(item) is not Block:
            if runs:
                runs.sort(key=lambda r: r[:5])
                for seq, _, _, i, j, b in runs:
                    yield (b, seq, i, j)
                runs = []
            yield item
            continue
        k = len(runs)
        order = KIND_ORDER.get(item.kind, 3)
        runs.extend((seq, order, k, i, j, item) for seq, i, j in seq_runs(item))
    runs.sort(key=lambda r: r[:5])
    for seq, _, _, i, j, b in runs:
        yield (b, seq, i, j)


def run_rows(b: Block, seq: int, i: int, j: int) -> List[Event]:
    """Rows i:j of block `b` as event objects."""
    if i == 0 and j == b.n:
        return b.rows()
    return Block(b.kind, j - i, b.at, b.same, {c: v[i:j] for c, v in b.cols.items()}).rows()
