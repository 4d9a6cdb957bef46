"""Every collective enter, start and end reaches the timeline here, as rows applied with array operations.

A column block's rows and a single CollEnter, WorkStart or WorkEnd (a one-row segment) are gathered
(`Rows.block`, `Rows.event`) until the Timeline flushes (`Rows.flush`: at the end of an ingest, and
before any event that could change who is who: timeline.py's NEUTRAL lists the kinds that cannot).
A flush applies all enters, then all starts, then all ends, of every communicator at once: the order
a rank does them, whatever order the frames had, in a number of array operations that does not grow
with the number of communicators or frames (colltable.py's CollStore holds them all).

Here the gathering: per kind a list per field (_Acc); an int field as the chunks it came in (IntColumn,
intcol.py: a block's packed column is kept as its bytes, a shared value as its 8 bytes repeated), so a
flush reads each int field of every frame with a join and an np.frombuffer per run of one width;
collapply.py applies them. Bounds:
FLUSH_ROWS (timeline.py) rows at most between flushes, and each flush ends with the communicators it
touched brought back to their collective bound (comms.evict).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Tuple

from ccld import wire as ev
from ccld.timeline.collapply import apply
from ccld.timeline.intcol import IntColumn
from ccld.timeline.comms import evict

if TYPE_CHECKING:
    from ccld.timeline.timeline import Timeline

KINDS = ("coll", "start", "end")
# kind -> the fields beyond (comm, seq, rank, pid, ts_ns) a row keeps, with their defaults
_EXTRA = {"coll": (("op", ""), ("backend", ""), ("count", -1), ("dtype", ""), ("nbytes", -1)),
          "start": (), "end": (("ok", True), ("error", ""))}
_KEY = (("seq", -1), ("rank", -1), ("pid", -1), ("ts_ns", 0))
INT_EXTRA = frozenset({"count", "nbytes"})  # the int fields among _EXTRA's


class _Acc:
    """One kind's rows gathered: a list per field, a value per row; the agent's clock conversion
    (ClockTable.params) per run of rows that came together (`counts`)."""
    __slots__ = ("kind", "comm", "seq", "rank", "pid", "ts_ns", "node", "agent", "extra", "counts", "clk", "events", "n")

    def __init__(self, kind: str):
        self.kind = kind
        self.comm: List[str] = []
        self.seq, self.rank, self.pid, self.ts_ns, self.node = IntColumn(), IntColumn(), IntColumn(), IntColumn(), IntColumn()
        self.agent: List[str] = []
        self.extra: Dict[str, Any] = {name: IntColumn() if name in INT_EXTRA else [] for name, _ in _EXTRA[kind]}
        self.counts: List[int] = []
        self.clk: List[Tuple[int, int, int, int]] = []
        self.events: List[Tuple[str, ev.Event]] = []  # NCCL enters kept as events for the GPU join
        self.n = 0


_NONE: Dict[str, bytes] = {}  # a block's packed columns when it has none


class Rows:
    """The rows gathered since the last flush, per kind, in the order they came."""

    def __init__(self, tl: Timeline):
        self.tl = tl
        self.acc = {kind: _Acc(kind) for kind in KINDS}
        self.n = 0

    def block(self, agent: str, node: str, b: Any) -> None:
        """All rows of column block `b` (ccld/wire/blocks.py) of `agent`, whose clock is known."""
        tl = self.tl
        same, kind = b.same, b.kind
        comm = same.get("comm")
        if comm is None or (kind == "coll" and tl.gpu.capture and same.get("backend") == "nccl"
                            and tl.gpu.capturing(node, set(b.cols.get("pid", [same.get("pid", -1)])))):
            for e in b.rows():  # the communicator as a column; or NCCL enters the kernel join takes as events
                self.event(agent, node, e)
            return
        # lists: packed columns stay packed (b.bin)
        self._rows(self.acc[kind], agent, tl.node_code(node), tl.clock.params(agent), b.n, same, b.bin or _NONE,
                   b.lists)

    def table(self, agent: str, node: str, t: Any) -> None:
        """All rows of table `t` (ccld/wire/table.py) of `agent`, whose clock is known, none of them an
        NCCL enter the kernel join wants as an event (timeline.py sends those as blocks). Groups in a
        run of one kind and one set of columns (agents order them by kind) are gathered as one: a slice
        of each packed column; only their shared fields go group by group."""
        tl = self.tl
        code, clk = tl.node_code(node), tl.clock.params(agent)
        groups = t.groups
        i, end = 0, len(groups)
        while i < end:
            kind, first, _, _, _, names = groups[i]
            j, n = i, 0
            while j < end and groups[j][0] == kind and groups[j][5] == names:
                n += groups[j][2]
                j += 1
            run = groups[i:j]
            a = self.acc[kind]
            for name, default in _KEY:
                if name in names:
                    getattr(a, name).packed(t.column(name, first, n), n)
                else:
                    col = getattr(a, name)
                    for g in run:
                        col.same(g[4].get(name, default), g[2])
            for name, default in _EXTRA[kind]:
                acc = a.extra[name]
                if name in names:  # an int field sent as a column
                    acc.packed(t.column(name, first, n), n)
                elif name in INT_EXTRA:
                    for g in run:
                        acc.same(g[4].get(name, default), g[2])
                else:
                    for g in run:
                        acc.extend([g[4].get(name, default)] * g[2])
            for g in run:
                a.comm.extend([g[4]["comm"]] * g[2])
            self._took(a, agent, code, clk, n)
            i = j

    def _rows(self, a: _Acc, agent: str, node: int, clk: Tuple[int, int, int, int], n: int, same: Dict[str, Any],
              packed: Dict[str, bytes], cols: Dict[str, List[Any]]) -> None:
        """n rows of one kind sharing `same`, their other fields packed or as lists."""
        a.comm.extend([same["comm"]] * n)
        for name, default in _KEY:
            getattr(a, name).block(packed.get(name), cols.get(name), same.get(name, default), n)
        for name, default in _EXTRA[a.kind]:
            acc = a.extra[name]
            if name in INT_EXTRA:
                acc.block(packed.get(name), cols.get(name), same.get(name, default), n)
                continue
            v = cols.get(name)
            acc.extend(v if v is not None else [same.get(name, default)] * n)
        self._took(a, agent, node, clk, n)

    def _took(self, a: _Acc, agent: str, node: int, clk: Tuple[int, int, int, int], n: int) -> None:
        """What every row of a run of n shares: its node, agent and clock conversion; counted."""
        a.node.same(node, n)
        a.agent.extend([agent] * n)
        a.counts.append(n)
        a.clk.append(clk)
        a.n += n
        self.n += n

    def event(self, agent: str, node: str, e: Any) -> None:
        """One CollEnter, WorkStart or WorkEnd of `agent`, whose clock is known."""
        tl = self.tl
        kind = e.KIND
        a = self.acc[kind]
        a.comm.append(e.comm)
        a.seq.one(e.seq)
        a.rank.one(e.rank)
        a.pid.one(e.pid)
        a.ts_ns.one(e.ts_ns)
        for name, values in a.extra.items():
            if name in INT_EXTRA:
                values.one(getattr(e, name))
            else:
                values.append(getattr(e, name))
        a.node.one(tl.node_code(node))
        a.agent.append(agent)
        clk = tl.clock.params(agent)
        if a.clk and a.clk[-1] == clk:
            a.counts[-1] += 1
        else:
            a.counts.append(1)
            a.clk.append(clk)
        if kind == "coll" and e.backend == "nccl" and tl.gpu.capture:
            a.events.append((node, e))
        a.n += 1
        self.n += 1

    def flush(self) -> None:
        """Apply every row gathered: all enters, then all starts, then all ends."""
        if not self.n:
            return
        acc = self.acc
        self.acc, self.n = {kind: _Acc(kind) for kind in KINDS}, 0
        touched: Dict[str, Any] = {}
        for kind in KINDS:
            if acc[kind].n:
                apply(self.tl, kind, acc[kind], touched)
        for comm in touched.values():
            evict(self.tl, comm)
        self.tl.store.settle()
