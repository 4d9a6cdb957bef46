"""Column blocks in the trace: a frame's "blocks" (schema 1.4: coll, start and end events as columns, see
ccld/wire/blocks.py; 1.9's tables as their groups' blocks) fed to the model without making a map per event.

A block's shared fields ("same") are read once; its columns are type-checked once each (one C-level
pass), so the row loops below do no per-row validation. The fast path takes the shape live agents
send: comm, op and the sizes shared, seq/pid/rank/ts_ns (and tid) shared or columns. Anything else
(another shape, an agent without a clock sample yet, a kind this module does not take) is expanded
to wire maps and goes through the model's general loop, which counts every oddity.
Order: enter blocks are placed among the frame's map events by their "at", start and end blocks after
them (feed_frame says why); rows in their order. Times: node CLOCK_MONOTONIC ns plus the agent's
offset, as in model.TraceModel.events.
Caveat: a block that is not well formed is dropped whole, its rows counted as bad events, as the wire
reader drops it (a bool in an int column too).
"""
from __future__ import annotations

from itertools import islice, repeat
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from ccld.export import accel
from ccld.wire import table
from ccld.wire.blocks import packed_width, unpack
from ccld.wire.validate import FrameError
from ccld.export.collectives import MAX_GROUPS, MAX_OPEN

if TYPE_CHECKING:
    from ccld.export.model import TraceModel

MAX_BLOCK_ROWS = 65_536   # events.MAX_EVENTS_PER_FRAME: the most a frame may carry
_MISSING = object()


class BadBlock(Exception):
    """A block that is not well formed: dropped, its rows counted as bad events."""


def feed_frame(m: "TraceModel", agent: str, node: str, evs: list, blocks: list) -> None:
    """A frame's map events and column blocks. Enter blocks are placed among the map events by their
    "at"; start and end blocks go after all of them (with the clock offset of their place), since "at"
    is where a block's first row was, and a later row of it may end a collective whose enter is in a
    block placed after it (frames are split into blocks by kind and shared fields)."""
    good = []
    for b in _groups(m, blocks):
        if type(b) is dict and type(b.get("at", 0)) is int and type(b.get("k")) is str:  # a list kind: unhashable
            u = _unpacked(b)
            if u is None:  # a packed column of the wrong length (or a bad n): the block's rows are bad
                m.stats["bad_events"] += rows_in([b])
            else:
                good.append(u)
        else:
            m.stats["bad_events"] += rows_in([b])  # its rows, as it says (1: not a map)
    good.sort(key=_at)
    later = []
    i = 0
    for b in good:
        at = b.get("at", 0)
        if at > i:
            m.events(agent, node, evs[i:at])
            i = at
        if b.get("k") == "coll":
            block(m, agent, node, b, m.offsets.get(agent))
        else:
            later.append((_KIND_ORDER.get(b.get("k"), 3), b, m.offsets.get(agent)))
    if i < len(evs):
        m.events(agent, node, evs[i:] if i else evs)
    later.sort(key=_first)
    for _, b, off in later:
        block(m, agent, node, b, off)


def _groups(m: "TraceModel", blocks: list) -> list:
    """The frame's blocks with each table (schema 1.9, ccld/wire/table.py) as its groups' blocks; a
    table whose header is wrong holds bad rows."""
    if not any(type(b) is dict and b.get("k") == table.KIND for b in blocks):
        return blocks
    out = []
    for b in blocks:
        if type(b) is dict and b.get("k") == table.KIND:
            try:
                out.extend(table.group_blocks(b))
            except FrameError:
                m.stats["bad_events"] += rows_in([b])
        else:
            out.append(b)
    return out


def _unpacked(b: dict) -> Any:
    """The block with its packed columns (schema 1.8: n little-endian ints as bytes) as lists of ints, as
    the rest of this module reads columns; None when a packed column's length is no width times n."""
    cols = b.get("cols")
    if type(cols) is not dict or not any(type(v) is bytes for v in cols.values()):
        return b
    n = b.get("n")
    if type(n) is not int or not 0 < n <= MAX_BLOCK_ROWS:
        return None
    out = {}
    for k, v in cols.items():
        if type(v) is bytes:
            if not packed_width(v, n):
                return None
            v = unpack(v, n)
        out[k] = v
    return dict(b, cols=out)


def _at(b: dict) -> int:
    return b.get("at", 0)


def _first(x: tuple) -> int:
    return x[0]


_KIND_ORDER = {"start": 1, "end": 2}


def rows_in(blocks: list) -> int:
    """Events the frame's blocks say they hold (for the model's event count)."""
    n = 0
    for b in blocks:
        x = b.get("n") if type(b) is dict else None
        n += x if type(x) is int and 0 < x <= MAX_BLOCK_ROWS else 1
    return n


def _column(same: dict, cols: dict, name: str, n: int, typ: type, default: Any = _MISSING):
    """Field `name` as n values of exact type `typ`: a column (a list), or the one shared value (_rows
    repeats it for a loop; accel.hot takes either)."""
    c = cols.get(name, _MISSING)
    if c is not _MISSING:
        if type(c) is not list or len(c) != n:
            raise BadBlock(name)
        if typ is int and accel.hot is not None:
            if not accel.hot.all_ints(c):
                raise BadBlock(name)
        elif not set(map(type, c)) <= {typ}:  # exact types: a bool is no int, as to the wire reader
            raise BadBlock(name)
        return c
    v = same.get(name, default)
    if v is _MISSING or type(v) is not typ:
        raise BadBlock(name)
    return v


def _rows(n: int, start: int, *columns):
    """Rows start.. of columns from _column, as tuples."""
    rows = zip(*(c if type(c) is list else repeat(c, n) for c in columns))
    return islice(rows, start, None) if start else rows


def _shared(same: dict, cols: dict, name: str, default: Any) -> Any:
    """A field the fast path needs shared; _MISSING when it is a column (the general path takes it)."""
    if name in cols:
        return _MISSING
    return same.get(name, default)


def _expand(k: str, n: int, same: dict, cols: dict) -> List[Dict[str, Any]]:
    """The block as wire maps (the general path)."""
    names = list(cols)
    head = {"k": k}
    head.update(same)
    out = []
    for values in zip(*(cols[c] for c in names)):
        d = dict(head)
        d.update(zip(names, values))
        out.append(d)
    return out


def block(m: "TraceModel", agent: str, node: str, b: dict, off: Optional[int]) -> None:
    """One block; `off`: its agent's clock offset where the block stands in its frame (None: none yet)."""
    k, n, same, cols = b.get("k"), b.get("n"), b.get("same", {}), b.get("cols", {})
    if type(n) is not int or not 0 < n <= MAX_BLOCK_ROWS or type(same) is not dict or type(cols) is not dict \
            or not all(type(c) is list and len(c) == n for c in cols.values()):
        m.stats["bad_events"] += n if type(n) is int and 0 < n <= MAX_BLOCK_ROWS else 1
        return
    try:
        if off is not None and k in _FAST and _FAST[k](m, agent, node, n, same, cols, off):
            return
    except BadBlock:
        m.stats["bad_events"] += n
        return
    m.events(agent, node, _expand(k, n, same, cols))


def _procs(m: "TraceModel", node: str) -> dict:
    procs = m.procs.get(node)
    if procs is None:
        procs = m.procs[node] = {}
    return procs


def _colls(m: "TraceModel", agent: str, node: str, n: int, same: dict, cols: dict, off: int) -> bool:
    comm, op = _shared(same, cols, "comm", _MISSING), _shared(same, cols, "op", _MISSING)
    count, dtype = _shared(same, cols, "count", -1), _shared(same, cols, "dtype", "")
    nbytes = _shared(same, cols, "nbytes", -1)
    if type(comm) is not str or type(op) is not str or _MISSING in (count, dtype, nbytes):
        return False
    seqs, pids = _column(same, cols, "seq", n, int), _column(same, cols, "pid", n, int)
    ranks, tss = _column(same, cols, "rank", n, int), _column(same, cols, "ts_ns", n, int)
    tids = _column(same, cols, "tid", n, int, 0)
    procs = _procs(m, node)
    colls = m.colls
    open_ = colls.open
    setdefault = open_.setdefault
    args = (op, count, dtype, nbytes)  # shared by the block's rows: flush_group compares it by identity
    start = 0
    hot = accel.hot
    if hot is not None:
        start, dups, max_ts = hot.colls(m, colls, procs, open_, node, seqs, pids, ranks, tss, tids, args, comm,
                                        op, off, (0, n, MAX_OPEN, m.max_ts))
        if dups:
            m.anomalies["duplicate-enter"] += dups
        if max_ts is not None:
            m.max_ts = max_ts
        if start == n:
            return True
    max_ts = m.max_ts
    last_pid, p = None, None
    for seq, pid, rank, ts, tid in _rows(n, start, seqs, pids, ranks, tss, tids):
        if pid != last_pid:
            p = procs.get(pid)
            if p is None:
                p = m.new_proc(node, pid, rank)
            last_pid = pid
        if p.skip:
            continue
        t = ts + off  # node CLOCK_MONOTONIC -> collector Unix ns
        o = [t, args, 0, None]
        if setdefault((p, comm, seq), o) is not o:
            m.anomalies["duplicate-enter"] += 1
            continue
        if p.gpu is not None:
            o[3] = p.gpu.enter(ts, comm, seq, op, tid)
        if t > max_ts:
            max_ts = t
        if len(open_) > MAX_OPEN:
            m.max_ts = max_ts
            colls.evict_open(max_ts)
    m.max_ts = max_ts
    return True


def _starts(m: "TraceModel", agent: str, node: str, n: int, same: dict, cols: dict, off: int) -> bool:
    comm = _shared(same, cols, "comm", _MISSING)
    if type(comm) is not str:
        return False
    seqs, pids = _column(same, cols, "seq", n, int), _column(same, cols, "pid", n, int)
    tss = _column(same, cols, "ts_ns", n, int)
    procs = _procs(m, node)
    open_ = m.colls.open
    start = missing = 0
    if accel.hot is not None:
        start, missing = accel.hot.starts(procs, open_, seqs, pids, tss, comm, off, 0, n)
    last_pid, p = None, None
    for seq, pid, ts in _rows(n, start, seqs, pids, tss):
        if pid != last_pid:
            p = procs.get(pid)
            last_pid = pid
        if p is None or p.skip:
            continue
        o = open_.get((p, comm, seq))
        if o is None:
            missing += 1
        else:
            o[2] = ts + off
    if missing:
        m.anomalies["start-without-enter"] += missing
    return True


def _ends(m: "TraceModel", agent: str, node: str, n: int, same: dict, cols: dict, off: int) -> bool:
    comm = _shared(same, cols, "comm", _MISSING)
    ok, error = _shared(same, cols, "ok", True), _shared(same, cols, "error", "")
    if type(comm) is not str or ok is _MISSING or error is _MISSING:
        return False
    seqs, pids = _column(same, cols, "seq", n, int), _column(same, cols, "pid", n, int)
    ranks, tss = _column(same, cols, "rank", n, int), _column(same, cols, "ts_ns", n, int)
    procs = _procs(m, node)
    colls = m.colls
    open_, groups, expected = colls.open, colls.groups, colls.expected
    start = missing = 0
    gk = None
    if accel.hot is not None:
        start, missing, max_ts, gk = accel.hot.ends(m, colls, procs, open_, groups, expected, colls.comm_job, node,
                                                    seqs, pids, ranks, tss, comm, ok, error, off,
                                                    (0, n, MAX_GROUPS, m.max_ts))
        if max_ts is not None:
            m.max_ts = max_ts
    max_ts = m.max_ts
    last_pid, p = None, None
    cur = None  # the seq of the group `items` belongs to (rows come sorted by seq: one lookup per run)
    items: list = []
    want = 0
    g = groups.get(gk) if gk is not None else None
    if g is not None:  # the C stopped inside a run: it goes on in the same group, under the same key
        cur, items = gk[1], g[1]
        want = colls.want(comm)
    for seq, pid, rank, ts in _rows(n, start, seqs, pids, ranks, tss):
        if pid != last_pid:
            p = procs.get(pid)
            if p is None:
                p = m.new_proc(node, pid, rank)
            last_pid = pid
        if p.skip:
            continue
        ts += off
        if ts > max_ts:
            max_ts = m.max_ts = ts
        o = open_.pop((p, comm, seq), None)
        if o is None:
            missing += 1
            continue
        # Collectives.ended, inline
        b = o[0]
        if ts < b:
            ts = b  # a wall-clock step between enter and end; never draw a negative slice
        if seq != cur:
            gk = (comm, seq)
            g = groups.get(gk)
            if g is None:
                g = groups[gk] = [max_ts, []]
                if comm not in colls.comm_job and p.job:
                    colls.comm_job[comm] = p.job
            items = g[1]
            want = colls.want(comm)
            cur = seq
        items.append((b, ts, p, o, ok, error, False))
        if want and len(items) >= want:
            del groups[gk]
            colls.flush_group(gk, items, True)
            cur = None
        elif len(groups) > MAX_GROUPS:
            k, old = groups.popitem(last=False)
            colls.flush_group(k, old[1], False)
            cur = None
    m.max_ts = max_ts
    if missing:
        m.anomalies["end-without-enter"] += missing
    return True


_FAST = {"coll": _colls, "start": _starts, "end": _ends}
