"""Every communicator's collectives as arrays, in one store: so that a batch of rows of many
communicators is applied with a fixed number of array operations (collrows.py).

Three index spaces:
- a *cell* per (communicator, member rank): the reporting process (node code, pid), its newest row's
  time (seen_at), its newest entered collective (last_seq, last_op, last_t), and per op code how many
  collectives it entered and ended (n_enter, n_end);
- a *slot* per collective held: its communicator's code, seq, a version bumped by every write
  (CollView's cache), and `base`, where its entries start;
- an *entry* per (slot, member column): enter, start and end (Unix s, NaN: not reported), the op the
  rank called (a code of CODES, -1: none), element count, dtype code and bytes where a probe said them.
  A slot's entries are contiguous: base + the member's column in its communicator (CommCols.col_of),
  a block of the communicator's `cap` entries (a power of two; a communicator that outgrows it moves
  its slots to blocks twice as wide).
Comm.cols (CommCols) holds a communicator's columns; CollView (collview.py) shows one slot as the
mappings (global rank -> value) the analyses read.

Bounds: every array grows by doubling; slots are freed as comms.py evicts collectives (at the end of
the flush that evicts them: rows of that flush may still write them) and entry blocks are reused by
size. CODES holds at most MAX_OPS names of ops and dtypes; a name past it is stored as OVERFLOW_OP.
Caveat: a CollView kept after its collective was evicted (by an analysis between two ticks) keeps a
copy of what it held, made at the eviction.
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np

MAX_OPS = 4096
OVERFLOW_OP = "(other)"
CODES: Dict[str, int] = {}  # op and dtype names -> codes (one table for both)
NAMES: List[str] = []
RANK_BITS = 20              # cell key = communicator code << RANK_BITS | global rank (ranks < 2**17)
SEQ_BITS = 41               # slot key = communicator code << SEQ_BITS + seq + SEQ_SPAN ...
SEQ_SPAN = 1 << 39          # ... for seqs in [-SEQ_SPAN, SEQ_SPAN) (collrows.py drops others, counted)
SMALL_ROW = 32              # columns read as Python values below this (see row())


def code_of(name: str) -> int:
    """The code of op or dtype `name`."""
    code = CODES.get(name)
    if code is None:
        if len(NAMES) >= MAX_OPS:
            return CODES[OVERFLOW_OP]
        code = CODES[name] = len(NAMES)
        NAMES.append(name)
    return code


code_of(OVERFLOW_OP)


def _grow(a: np.ndarray, n: int, fill: Any) -> np.ndarray:
    """`a` with its first axis grown to n (new rows = fill)."""
    out = np.full((n,) + a.shape[1:], fill, dtype=a.dtype)
    out[:a.shape[0]] = a
    return out


def blocks(bases: np.ndarray, width: np.ndarray) -> np.ndarray:
    """The entry indices of blocks [base, base + width) for each pair, concatenated."""
    if not len(bases):
        return np.zeros(0, dtype=np.int64)
    total = int(width.sum())
    starts = np.repeat(bases - np.concatenate([[0], np.cumsum(width)[:-1]]), width)
    return starts + np.arange(total)


class CommCols:
    """One communicator's member columns: global rank -> column -> cell, and its slots' block width."""
    __slots__ = ("code", "col_of", "ranks", "cells", "cap", "slots", "nodes", "_ranks_np")

    def __init__(self, code: int):
        self.code = code
        self.col_of: Dict[int, int] = {}
        self.ranks: List[int] = []       # column -> global rank
        self.cells: List[int] = []       # column -> cell
        self.cap = 8                     # entries per slot block (>= columns)
        self.slots: set = set()          # its slots (live or waiting to be freed)
        self.nodes: set = set()          # node codes of the processes that reported it
        self._ranks_np: Optional[np.ndarray] = None

    @property
    def ncols(self) -> int:
        return len(self.ranks)

    def cell_of(self, rank: int) -> Optional[int]:
        """The cell of global rank `rank`, None when it has no column."""
        col = self.col_of.get(rank)
        return None if col is None else self.cells[col]

    def ranks_np(self) -> np.ndarray:
        if self._ranks_np is None or len(self._ranks_np) != len(self.ranks):
            self._ranks_np = np.array(self.ranks, dtype=np.int64)
        return self._ranks_np


class CollStore:
    """The arrays of every communicator of one Timeline (see the module docstring)."""

    def __init__(self) -> None:
        self.comms: List[Optional[CommCols]] = []
        # cells
        self.ncells = 0
        self.cell_comm = np.zeros(64, dtype=np.int64)
        self.cell_rank = np.zeros(64, dtype=np.int64)
        self.cell_col = np.zeros(64, dtype=np.int64)
        self.cell_node = np.full(64, -1, dtype=np.int64)
        self.cell_pid = np.full(64, -1, dtype=np.int64)
        self.has_rec = np.zeros(64, dtype=bool)
        self.member = np.zeros(64, dtype=bool)       # the rank was added to Comm.members by an enter
        self.seen_at = np.full(64, -np.inf)
        self.last_seq = np.full(64, -1, dtype=np.int64)
        self.last_op = np.full(64, -1, dtype=np.int64)
        self.last_t = np.zeros(64)
        self.n_enter = np.zeros((8, 64), dtype=np.int64)  # [op code, cell]
        self.n_end = np.zeros((8, 64), dtype=np.int64)
        self.recs: List[Any] = []
        self.keys = np.zeros(0, dtype=np.int64)          # sorted cell keys, and their cells ...
        self.key_cells = np.zeros(0, dtype=np.int64)
        self.new_keys: List[int] = []                     # ... but for cells made since, merged by lookup
        self.last_version = 0                             # bumped when any last_* changes
        # slots
        self.slot_cap = 0
        self.base = np.zeros(0, dtype=np.int64)
        self.width = np.zeros(0, dtype=np.int64)          # entries in the slot's block
        self.slot_comm = np.zeros(0, dtype=np.int64)
        self.version = np.zeros(0, dtype=np.int64)
        self.n_entered = np.zeros(0, dtype=np.int64)      # entries with an enter / an end
        self.n_ended = np.zeros(0, dtype=np.int64)
        self.free_slots: List[int] = []
        self.freed: List[int] = []
        # entries
        self.entry_cap = 0
        self.entry_top = 0
        self.free_blocks: Dict[int, List[int]] = {}
        self.enter = np.zeros(0)
        self.start = np.zeros(0)
        self.end = np.zeros(0)
        self.op = np.zeros(0, dtype=np.int32)
        self.count = np.zeros(0, dtype=np.int64)
        self.nbytes = np.zeros(0, dtype=np.int64)
        self.dtype = np.zeros(0, dtype=np.int32)

    # ---- communicators and cells ------------------------------------------------------------------

    def new_comm(self) -> CommCols:
        cols = CommCols(len(self.comms))
        self.comms.append(cols)
        return cols

    def drop_comm(self, cols: CommCols) -> None:
        """A communicator replaced (its ranks restarted): its slots are freed; its cells stay (counts)."""
        self.freed.extend(s for s in cols.slots if s not in self.freed)
        self.settle()
        self.comms[cols.code] = None

    def cell(self, cols: CommCols, rank: int, node: int, pid: int, rec: Any) -> int:
        """The cell of `rank` in communicator `cols`, made when it has none; (node, pid) reports it. -1
        for a rank or pid no array can hold (a corrupt event: its rows are dropped, counted, by collrows)."""
        if not (0 <= rank < 1 << RANK_BITS and -(1 << 62) <= pid < 1 << 62):
            return -1
        col = cols.col_of.get(rank)
        if col is None:
            cell = self.ncells
            self.ncells += 1
            if cell >= self.cell_comm.shape[0]:
                self._more_cells(2 * self.cell_comm.shape[0])
            col = cols.col_of[rank] = len(cols.ranks)
            cols.ranks.append(rank)
            cols.cells.append(cell)
            self.cell_comm[cell], self.cell_rank[cell], self.cell_col[cell] = cols.code, rank, col
            self.recs.append(None)
            self.new_keys.append((cols.code << RANK_BITS) | rank)
            if col >= cols.cap:
                self._widen(cols, 2 * cols.cap)
        else:
            cell = cols.cells[col]
        self.cell_node[cell], self.cell_pid[cell] = node, pid
        cols.nodes.add(node)
        if rec is not None:
            self.set_rec(cell, rec)
        return cell

    def set_rec(self, cell: int, rec: Any) -> None:
        """Cell `cell`'s process has RankRecord `rec` (whose last_event_at then reads seen_at)."""
        if self.recs[cell] is not rec:
            self.recs[cell] = rec
            self.has_rec[cell] = True
            rec.watch(self, cell)

    def _more_cells(self, n: int) -> None:
        for name, fill in (("cell_comm", 0), ("cell_rank", 0), ("cell_col", 0), ("cell_node", -1),
                           ("cell_pid", -1), ("has_rec", False), ("member", False), ("seen_at", -np.inf),
                           ("last_seq", -1), ("last_op", -1), ("last_t", 0.0)):
            setattr(self, name, _grow(getattr(self, name), n, fill))
        self.n_enter = np.concatenate([self.n_enter, np.zeros((self.n_enter.shape[0], n - self.n_enter.shape[1]),
                                                               dtype=np.int64)], axis=1)
        self.n_end = np.concatenate([self.n_end, np.zeros((self.n_end.shape[0], n - self.n_end.shape[1]),
                                                           dtype=np.int64)], axis=1)

    def lookup(self, comm_codes: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        """The cell of each (communicator code, rank) row, -1 where there is none."""
        out = np.full(len(ranks), -1, dtype=np.int64)
        if self.new_keys:
            self._merge_keys()
        if not len(self.keys):
            return out
        ok = (ranks >= 0) & (ranks < (1 << RANK_BITS))
        keys = (comm_codes << RANK_BITS) | np.where(ok, ranks, 0)
        at = np.minimum(np.searchsorted(self.keys, keys), len(self.keys) - 1)
        hit = ok & (self.keys[at] == keys)
        out[hit] = self.key_cells[at[hit]]
        return out

    def _merge_keys(self) -> None:
        """The cells made since the last lookup into the sorted index (one sort, not an insert each:
        a job's first frames make a cell per rank and communicator)."""
        n = len(self.new_keys)
        keys = np.concatenate([self.keys, np.array(self.new_keys, dtype=np.int64)])
        cells = np.concatenate([self.key_cells, np.arange(self.ncells - n, self.ncells, dtype=np.int64)])
        order = np.argsort(keys, kind="stable")
        self.keys, self.key_cells = keys[order], cells[order]
        self.new_keys = []

    def count_ops(self, which: str, codes: np.ndarray, cells: np.ndarray) -> None:
        """One collective entered (which="enter") or ended per (op code, cell) pair given."""
        table = self.n_enter if which == "enter" else self.n_end
        top = int(codes.max()) + 1 if len(codes) else 0
        if top > table.shape[0]:
            table = np.concatenate([table, np.zeros((max(top, 2 * table.shape[0]) - table.shape[0], table.shape[1]),
                                                    dtype=np.int64)])
            if which == "enter":
                self.n_enter = table
            else:
                self.n_end = table
        np.add.at(table, (codes, cells), 1)

    def op_counts(self, which: str) -> Iterator[Tuple[Tuple[int, str], int]]:
        """((global rank, op), collectives) of every cell, communicators replaced included."""
        table = self.n_enter if which == "enter" else self.n_end
        codes, cells = np.nonzero(table[:, :self.ncells])
        for code, cell, n in zip(codes.tolist(), cells.tolist(), table[codes, cells].tolist()):
            yield (int(self.cell_rank[cell]), NAMES[code]), n

    # ---- slots and their entries -------------------------------------------------------------------

    def take_slots(self, owners: List[CommCols]) -> List[int]:
        """A slot (entries cleared) for a new collective of each communicator in `owners`."""
        n = len(owners)
        if not n:  # free_slots[-0:] is every free slot
            return []
        while len(self.free_slots) < n:
            self._more_slots(max(64, 2 * self.slot_cap, self.slot_cap + n))
        got = self.free_slots[-n:][::-1]
        del self.free_slots[-n:]
        widths = [c.cap for c in owners]
        bases = [self._block(w) for w in widths]
        at = np.array(got, dtype=np.int64)
        self.base[at], self.width[at], self.slot_comm[at] = bases, widths, [c.code for c in owners]
        self.n_entered[at] = 0
        self.n_ended[at] = 0
        self.version[at] += 1
        for c, slot in zip(owners, got):
            c.slots.add(slot)
        self._clear(blocks(np.array(bases, dtype=np.int64), np.array(widths, dtype=np.int64)))
        return got

    def release(self, cols: CommCols, slot: int) -> None:
        """The slot's collective was evicted: free after this flush (settle), until then still one of
        the communicator's (rows of this flush may write it; a widening moves it)."""
        self.freed.append(slot)

    def settle(self) -> None:
        """The end of a flush: slots evicted during it are free, their entry blocks too."""
        for slot in self.freed:
            cols = self.comms[int(self.slot_comm[slot])]
            if cols is not None:
                cols.slots.discard(slot)
            self.free_blocks.setdefault(int(self.width[slot]), []).append(int(self.base[slot]))
            self.base[slot] = -1
            self.free_slots.append(slot)
        self.freed.clear()

    def _more_slots(self, n: int) -> None:
        old = self.slot_cap
        self.base, self.slot_comm = _grow(self.base, n, -1), _grow(self.slot_comm, n, -1)
        self.width = _grow(self.width, n, 0)
        self.version, self.n_entered, self.n_ended = _grow(self.version, n, 0), _grow(self.n_entered, n, 0), \
            _grow(self.n_ended, n, 0)
        self.free_slots.extend(range(n - 1, old - 1, -1))  # pop() takes the lowest first
        self.slot_cap = n

    def _block(self, width: int) -> int:
        got = self.free_blocks.get(width)
        if got:
            return got.pop()
        if self.entry_top + width > self.entry_cap:
            n = max(self.entry_top + width, 2 * self.entry_cap, 1024)
            self.enter, self.start, self.end = _grow(self.enter, n, np.nan), _grow(self.start, n, np.nan), \
                _grow(self.end, n, np.nan)
            self.op, self.dtype = _grow(self.op, n, -1), _grow(self.dtype, n, -1)
            self.count, self.nbytes = _grow(self.count, n, -1), _grow(self.nbytes, n, -1)
            self.entry_cap = n
        base = self.entry_top
        self.entry_top += width
        return base

    def _clear(self, z: Any) -> None:
        """Entries `z` (a slice or an index array) hold nothing."""
        self.enter[z] = np.nan
        self.start[z] = np.nan
        self.end[z] = np.nan
        self.op[z] = -1
        self.dtype[z] = -1
        self.count[z] = -1
        self.nbytes[z] = -1

    def _widen(self, cols: CommCols, cap: int) -> None:
        """Communicator `cols` outgrew its blocks: each of its slots moves to a block `cap` wide."""
        old = cols.cap
        cols.cap = cap
        for slot in sorted(cols.slots):
            was = int(self.base[slot])
            base = self._block(cap)
            self._clear(slice(base, base + cap))
            for arr in (self.enter, self.start, self.end, self.op, self.dtype, self.count, self.nbytes):
                arr[base:base + old] = arr[was:was + old]
            self.free_blocks.setdefault(old, []).append(was)
            self.base[slot], self.width[slot] = base, cap
            self.version[slot] += 1

    def touch(self, slots: np.ndarray) -> None:
        """Slots written: their views' mappings are made again when next read."""
        self.version[np.unique(slots)] += 1

    # ---- reading ----------------------------------------------------------------------------------

    # Below SMALL_ROW columns a row is read as Python values: numpy's per-call cost (a mask, its
    # indices, two gathers) was most of a small group's read, and most groups are small.

    def row(self, arr: np.ndarray, slot: int, cols: CommCols) -> Dict[int, float]:
        base = int(self.base[slot])
        n = cols.ncols
        if n <= SMALL_ROW:
            return {r: x for r, x in zip(cols.ranks, arr[base:base + n].tolist()) if x == x}  # x == x: not NaN
        r = arr[base:base + n]
        idx = np.flatnonzero(~np.isnan(r))
        return dict(zip(cols.ranks_np()[idx].tolist(), r[idx].tolist()))

    def span(self, arr: np.ndarray, slot: int, cols: CommCols) -> Tuple[int, float, float]:
        """(how many, smallest, largest) of the slot's reported values in `arr` (NaN: not reported);
        (0, nan, nan) when none is."""
        base = int(self.base[slot])
        n = cols.ncols
        if n <= SMALL_ROW:
            xs = [x for x in arr[base:base + n].tolist() if x == x]
            return (len(xs), min(xs), max(xs)) if xs else (0, np.nan, np.nan)
        r = arr[base:base + n]
        r = r[~np.isnan(r)]
        return (len(r), float(r.min()), float(r.max())) if len(r) else (0, np.nan, np.nan)

    def ops_row(self, slot: int, cols: CommCols) -> Dict[int, str]:
        base = int(self.base[slot])
        n = cols.ncols
        names = NAMES
        if n <= SMALL_ROW:
            return {r: names[c] for r, c in zip(cols.ranks, self.op[base:base + n].tolist()) if c >= 0}
        r = self.op[base:base + n]
        idx = np.flatnonzero(r >= 0)
        return dict(zip(cols.ranks_np()[idx].tolist(), [names[c] for c in r[idx].tolist()]))

    def sizes_row(self, slot: int, cols: CommCols) -> Dict[int, Tuple[int, str, int]]:
        base = int(self.base[slot])
        z = slice(base, base + cols.ncols)
        c, d, b = self.count[z], self.dtype[z], self.nbytes[z]
        names = NAMES
        if cols.ncols <= SMALL_ROW:
            return {r: (cc, names[dd] if dd >= 0 else "", bb) for r, cc, dd, bb in
                    zip(cols.ranks, c.tolist(), d.tolist(), b.tolist()) if cc >= 0 or dd >= 0 or bb >= 0}
        idx = np.flatnonzero((c >= 0) | (d >= 0) | (b >= 0))
        return {r: (cc, names[dd] if dd >= 0 else "", bb) for r, cc, dd, bb in
                zip(cols.ranks_np()[idx].tolist(), c[idx].tolist(), d[idx].tolist(), b[idx].tolist())}

    def uniform(self, slot: int, cols: CommCols) -> bool:
        """Whether every member that reported an op for the slot's collective reported the same op and
        the same size (count, dtype, bytes): len(set(ops_row)) <= 1 and len(set(sizes_row)) <= 1,
        without building either."""
        base = int(self.base[slot])
        n = cols.ncols
        z = slice(base, base + n)
        if n <= SMALL_ROW:
            ops = {o for o in self.op[z].tolist() if o >= 0}
            if len(ops) > 1:
                return False
            sizes = {s for s in zip(self.count[z].tolist(), self.dtype[z].tolist(), self.nbytes[z].tolist())
                     if s[0] >= 0 or s[1] >= 0 or s[2] >= 0}
            return len(sizes) <= 1
        o = self.op[z]
        o = o[o >= 0]
        if len(o) and (o != o[0]).any():
            return False
        c, d, b = self.count[z], self.dtype[z], self.nbytes[z]
        has = (c >= 0) | (d >= 0) | (b >= 0)
        if not has.any():
            return True
        c, d, b = c[has], d[has], b[has]
        return not ((c != c[0]).any() or (d != d[0]).any() or (b != b[0]).any())

    def last_entered_cell(self, cell: int) -> Optional[Tuple[int, str, float]]:
        """(seq, op, at) of the newest collective cell `cell`'s rank entered, None when none."""
        seq = int(self.last_seq[cell])
        if seq < 0:
            return None
        op = int(self.last_op[cell])
        return seq, NAMES[op] if op >= 0 else "", float(self.last_t[cell])

    def last_entered(self, cols: CommCols) -> Dict[int, Tuple[int, str, float]]:
        cells = np.array(cols.cells, dtype=np.int64)
        seqs = self.last_seq[cells]
        idx = np.flatnonzero(seqs >= 0)
        names = NAMES
        c = cells[idx]
        return {r: (s, names[o] if o >= 0 else "", t) for r, s, o, t in
                zip(self.cell_rank[c].tolist(), seqs[idx].tolist(), self.last_op[c].tolist(), self.last_t[c].tolist())}
