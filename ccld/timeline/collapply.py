"""The rows of a flush (collrows.py) applied to the CollStore (colltable.py) with array operations.

Per row what comms.py once did per event: the process's rank (the row's, else its RankInfo's), stale
processes dropped (a restarted rank's old pid), a rank new to the communicator registered, duplicates
and ends without an enter counted, then the arrays written, blocked time added, the clock refiner
given the successful ends, completion checked for each collective that may have completed. Anomalies
are counted per row. A row with an int no array can hold is dropped and counted (rowbounds.py). Times: Unix
s and the agents' base ns, converted here from each run's clock conversion (ClockTable.params, taken
when its rows were gathered).
Caveat: converted as gathered, a frame's ends use the clock correction of when they arrived; the
refiner may move it when they are applied, within the same ingest (it moves every 0.5 s at most).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import numpy as np

from ccld.timeline.colltable import SEQ_BITS, SEQ_SPAN, blocks, code_of
from ccld.timeline.comms import comm_for_rows, completed, done_at, expected_entries, new_views
from ccld.timeline.rowbounds import BOUNDS, bad_rows, drop

if TYPE_CHECKING:
    from ccld.timeline.collrows import _Acc
    from ccld.timeline.timeline import Timeline


def _batch(tl: Timeline, a: _Acc) -> Optional[_Batch]:
    """The rows as arrays, those that no array can hold (or that lie outside rowbounds.BOUNDS) left out,
    counted; None when none is left."""
    try:
        rows = _Batch(tl, a)
        if not rows.out_of_bounds():
            return rows
    except OverflowError:  # an int past int64
        pass
    drop(tl, a, bad_rows(a))
    return _Batch(tl, a) if a.n else None


def _codes(values: List[str], empty: Optional[int] = None) -> np.ndarray:
    """Each value's code (colltable.code_of); `empty`, when given, for ""."""
    table = {v: (empty if (empty is not None and not v) else code_of(v)) for v in set(values)}
    return np.array(list(map(table.__getitem__, values)), dtype=np.int64)


class _Batch:
    """One kind's rows of a flush as arrays. `comm` is each row's communicator code in the store
    (-1: none, over the bound); `comms` the Comm of each code; `base` each time in its agent's base
    timebase (ns, the clock refinement's), `t` in Unix s."""

    def __init__(self, tl: Timeline, a: _Acc):
        self.a = a
        self.n = a.n
        self.seq = a.seq.array()
        self.rank = a.rank.array()
        self.pid = a.pid.array()
        self.node = a.node.array()
        self.ts = ts = a.ts_ns.array()
        self.clk = np.array(a.clk, dtype=np.int64)
        ex = a.extra
        self.count = ex["count"].array() if "count" in ex else None
        self.nbytes = ex["nbytes"].array() if "nbytes" in ex else None
        add, ref, drift, corr = np.repeat(self.clk, a.counts, axis=0).T
        # base = mono + add + floor(drift x (mono - ref) / 1e9), as ClockTable converts one time
        self.base = ts + add + np.floor(drift * (ts - ref).astype(np.float64) / 1e9).astype(np.int64)
        self.t = (self.base + corr) / 1e9
        self.comms: Dict[int, Any] = {}
        code_of_id: Dict[str, int] = {}
        for cid in set(a.comm):
            comm = comm_for_rows(tl, cid)
            if comm is None:
                tl.anomalies["comms-over-bound"] += a.comm.count(cid)
                code_of_id[cid] = -1
            else:
                code = code_of_id[cid] = comm.attach(tl.store).code
                self.comms[code] = comm
        self.comm = np.array(list(map(code_of_id.__getitem__, a.comm)), dtype=np.int64)

    def out_of_bounds(self) -> bool:
        """Some row's value lies outside BOUNDS, or a run's clock conversion past +-2^61."""
        for name, (lo, hi) in BOUNDS.items():
            v = self.ts if name == "ts_ns" else getattr(self, name)
            if len(v) and (int(v.min()) < lo or int(v.max()) >= hi):
                return True
        return bool(len(self.clk)) and int(np.abs(self.clk).max()) >= 1 << 61


def apply(tl: Timeline, kind: str, acc: _Acc, touched: Dict[str, Any]) -> None:
    """Apply one kind's rows gathered (acc); the communicators they name are put in `touched`."""
    got = _batch(tl, acc)
    if got is None:
        return
    rows = got
    for comm in rows.comms.values():
        touched[comm.id] = comm
    keep, cells = _resolve(tl, rows)
    if kind == "end":
        _refine(tl, rows, keep)
    idx = np.flatnonzero(keep)
    if not len(idx):
        return
    st = tl.store
    cells = cells[idx]
    if kind == "coll":
        _enters(tl, rows, idx, cells)
    elif kind == "start":
        _starts(tl, rows, idx, cells)
    else:
        _ends(tl, rows, idx, cells)
    np.fmax.at(st.seen_at, cells, rows.t[idx])


def _resolve(tl: Timeline, rows: _Batch) -> Tuple[np.ndarray, np.ndarray]:
    """(rows kept, their cells): what comms.py's rank_event and _comm_of decided per event, for every
    row; a rank new to its communicator gets its cell here."""
    st = tl.store
    cells = st.lookup(rows.comm, rows.rank)
    hit = cells >= 0
    safe = np.where(hit, cells, 0)
    known = hit & (st.cell_pid[safe] == rows.pid) & (st.cell_node[safe] == rows.node) & (rows.comm >= 0)
    keep = known.copy()
    norec = known & ~st.has_rec[safe]
    if norec.any():  # rows whose process has no RankRecord (yet): counted as comms.py did, and applied
        for c in np.unique(cells[norec]).tolist():
            rec = tl.ranks.get((tl.node_name(int(st.cell_node[c])), int(st.cell_pid[c])))
            if rec is not None:
                st.set_rec(c, rec)
        tl.anomalies["unknown-pid"] += int((norec & ~st.has_rec[safe]).sum())
    rest = ~known & (rows.comm >= 0)
    if rest.any():
        _careful(tl, rows, np.flatnonzero(rest), keep, cells)
    return keep, cells


def _careful(tl: Timeline, rows: _Batch, which: np.ndarray, keep: np.ndarray, cells: np.ndarray) -> None:
    """Rows of a rank without a cell, or from another process than its cell's: one at a time."""
    st = tl.store
    for i in which.tolist():
        comm = rows.comms[int(rows.comm[i])]
        node_code, pid = int(rows.node[i]), int(rows.pid[i])
        node = tl.node_name(node_code)
        rec = tl.ranks.get((node, pid))
        if rec is None:
            tl.anomalies["unknown-pid"] += 1
        else:
            rec.saw(float(rows.t[i]))
        rank = int(rows.rank[i])
        if rank < 0:
            rank = rec.rank if rec is not None else -1
            if rank < 0:
                tl.anomalies["no-rank"] += 1
                continue
            rows.rank[i] = rank
        if not comm.job and rec is not None and rec.job:
            comm.job = rec.job
        prev = comm.pids.get(rank)
        if (node, pid) in comm.retired or (prev is not None and prev != (node, pid)):
            tl.anomalies["stale-pid"] += 1  # an old incarnation of a restarted rank; ignore it
            continue
        comm.pids[rank] = (node, pid)
        cells[i] = st.cell(comm.attach(st), rank, node_code, pid, rec)
        keep[i] = cells[i] >= 0


def _views(tl: Timeline, rows: _Batch, idx: np.ndarray, first_op: Any) -> Tuple[np.ndarray, List[Any], np.ndarray]:
    """(each row's slot, -1 where its collective fell out of the bound; the views, one per collective
    (comm, seq) of these rows, those not held yet made in seq order (eviction takes the first made; a
    frame's blocks go op by op); each row's index into them). An evicted collective's rows are late."""
    keys = (rows.comm[idx] << SEQ_BITS) + (rows.seq[idx] + SEQ_SPAN)
    ukeys, first, inv = np.unique(keys, return_index=True, return_inverse=True)
    views: List[Any] = [None] * len(ukeys)
    missing: List[int] = []
    heads = idx[first]
    codes, seqs = rows.comm[heads].tolist(), rows.seq[heads].tolist()
    comms = rows.comms
    for k in range(len(ukeys)):  # np.unique sorted the keys: by communicator, then seq
        v = comms[codes[k]].colls.get(seqs[k])
        if v is None:
            missing.append(k)
        else:
            views[k] = v
    if missing:
        made = new_views(tl, [(comms[codes[k]], seqs[k], first_op(int(heads[k]))) for k in missing])
        late = 0
        for k, v in zip(missing, made):
            views[k] = v
            if v is None:
                late += int(np.count_nonzero(inv == k)) - 1  # new_views counted one
        if late:
            tl.anomalies["late-event"] += late
    slots = np.array([-1 if v is None else v._slot for v in views], dtype=np.int64)
    return slots[inv], views, inv


def _located(tl: Timeline, rows: _Batch, idx: np.ndarray, cells: np.ndarray, first_op: Any) -> Optional[Tuple[Any, ...]]:
    """(rows, cells, slots, each row's view index, views, entries) of the rows `idx` whose collective is
    held (made where new: _views), or None when none is."""
    slots, views, inv = _views(tl, rows, idx, first_op)
    live = slots >= 0
    if not live.all():
        idx, cells, slots, inv = idx[live], cells[live], slots[live], inv[live]
        if not len(idx):
            return None
    return idx, cells, slots, inv, views, tl.store.base[slots] + tl.store.cell_col[cells]


def _firsts(flat: np.ndarray) -> np.ndarray:
    """True for each row that is the first of its entry among these rows."""
    _, first = np.unique(flat, return_index=True)
    out = np.zeros(len(flat), dtype=bool)
    out[first] = True
    return out


def _enters(tl: Timeline, rows: _Batch, idx: np.ndarray, cells: np.ndarray) -> None:
    st = tl.store
    ops = rows.a.extra["op"]
    new = ~st.member[cells]
    if new.any():  # ranks entering a communicator's collective for the first time: members
        for c in np.unique(cells[new]).tolist():
            rows.comms[int(st.cell_comm[c])].members.add(int(st.cell_rank[c]))
        st.member[cells[new]] = True
    for code, comm in rows.comms.items():
        if not comm.backend:
            at = np.flatnonzero(rows.comm[idx] == code)
            if len(at):
                comm.backend = rows.a.extra["backend"][int(idx[at[0]])]
    got = _located(tl, rows, idx, cells, lambda i: ops[i])
    if got is None:
        return
    idx, cells, slots, inv, views, flat = got
    dup = ~_firsts(flat) | ~np.isnan(st.enter[flat])
    if dup.any():
        tl.anomalies["duplicate-enter"] += int(dup.sum())
        keep = ~dup
        idx, cells, slots, inv, flat = idx[keep], cells[keep], slots[keep], inv[keep], flat[keep]
        if not len(idx):
            return
    codes = _codes(ops)[idx]
    _, first = np.unique(inv, return_index=True)
    for k, i in zip(inv[first].tolist(), idx[first].tolist()):  # each collective's op: its first enter's
        v = views[k]
        if not v.op:
            v.op = ops[i]
    t = rows.t[idx]
    st.enter[flat] = t
    st.op[flat] = codes
    np.add.at(st.n_entered, slots, 1)
    ex = rows.a.extra
    count = rows.count if rows.count is not None else np.full(rows.n, -1, dtype=np.int64)
    nbytes = rows.nbytes if rows.nbytes is not None else np.full(rows.n, -1, dtype=np.int64)
    if count.max() >= 0 or nbytes.max() >= 0 or any(ex["dtype"]):
        c, b = count[idx], nbytes[idx]
        d = _codes(ex["dtype"], empty=-1)[idx]
        sized = (c >= 0) | (b >= 0) | (d >= 0)
        f = flat[sized]
        st.count[f], st.nbytes[f], st.dtype[f] = c[sized], b[sized], d[sized]
    st.count_ops("enter", codes, cells)
    seqs = rows.seq[idx]
    order = np.lexsort((np.arange(len(idx)), seqs))[::-1]  # newest seq first, then the later row
    _, last = np.unique(cells[order], return_index=True)
    sel = order[last]
    sel = sel[seqs[sel] >= st.last_seq[cells[sel]]]
    c = cells[sel]
    st.last_seq[c], st.last_op[c], st.last_t[c] = seqs[sel], codes[sel], t[sel]
    st.last_version += 1
    top = np.full(len(st.comms), -1, dtype=np.int64)
    np.maximum.at(top, rows.comm[idx], seqs)
    for code, comm in rows.comms.items():
        if top[code] > comm.max_seq:
            comm.max_seq = int(top[code])
    st.touch(slots)
    for node, e in rows.a.events:
        tl.gpu.on_enter(node, e)


def _starts(tl: Timeline, rows: _Batch, idx: np.ndarray, cells: np.ndarray) -> None:
    st = tl.store
    got = _located(tl, rows, idx, cells, lambda i: "")
    if got is None:
        return
    idx, cells, slots, _, _, flat = got
    no_enter = np.isnan(st.enter[flat])
    if no_enter.any():
        tl.anomalies["start-without-enter"] += int(no_enter.sum())
    new = _firsts(flat) & np.isnan(st.start[flat])
    st.start[flat[new]] = rows.t[idx[new]]
    st.touch(slots)


def _ends(tl: Timeline, rows: _Batch, idx: np.ndarray, cells: np.ndarray) -> None:
    st = tl.store
    got = _located(tl, rows, idx, cells, lambda i: "")
    if got is None:
        return
    idx, cells, slots, inv, views, flat = got
    enter = st.enter[flat]
    no_enter = np.isnan(enter)
    if no_enter.any():
        tl.anomalies["end-without-enter"] += int(no_enter.sum())
    dup = ~_firsts(flat) | ~np.isnan(st.end[flat])
    if dup.any():
        tl.anomalies["duplicate-end"] += int(dup.sum())
        keep = ~dup
        idx, cells, slots, inv, enter, flat = idx[keep], cells[keep], slots[keep], inv[keep], enter[keep], flat[keep]
        if not len(idx):
            return
    t = rows.t[idx]
    st.end[flat] = t
    np.add.at(st.n_ended, slots, 1)
    ranks = rows.rank[idx]
    jobs: Dict[str, int] = {}
    job_of = np.zeros(len(st.comms), dtype=np.int64)
    for code, comm in rows.comms.items():  # blocked time is per job
        job_of[code] = jobs.setdefault(comm.job, len(jobs))
    if len(jobs) == 1:
        tl.blocked.add_many(next(iter(jobs)), ranks, enter, t)
    else:
        row_job = job_of[rows.comm[idx]]
        for job, j in jobs.items():
            at = row_job == j
            tl.blocked.add_many(job, ranks[at], enter[at], t[at])
    oks = rows.a.extra["ok"]
    if not all(oks):
        errors = rows.a.extra["error"]
        for k, i in zip(inv.tolist(), idx.tolist()):
            if not oks[i]:
                views[k].failed[int(rows.rank[i])] = errors[i] or "failed"
    codes = st.op[flat].astype(np.int64)
    unset = codes < 0
    if unset.any():
        default = np.array([code_of((v.op if v is not None else "") or "unknown") for v in views], dtype=np.int64)
        codes[unset] = default[inv[unset]]
    st.count_ops("end", codes, cells)
    st.touch(slots)
    _completions(tl, rows, views, np.unique(inv))


def _completions(tl: Timeline, rows: _Batch, views: List[Any], touched: np.ndarray) -> None:
    """Mark the collectives among views[touched] that completed: every expected member entered and
    ended. A slot's counts of enters and ends (n_entered, n_ended) rule out most at once; where every
    column of the communicator is an expected member those counts decide, else comms.completed looks."""
    st = tl.store
    vs = [views[k] for k in touched.tolist()]
    slots = np.array([v._slot for v in vs], dtype=np.int64)
    codes = st.slot_comm[slots]
    need_of = np.zeros(len(st.comms) + 1, dtype=np.int64)  # per communicator: its expected members' count ...
    exact_of = np.zeros(len(st.comms) + 1, dtype=bool)     # ... and whether they are all its columns
    for code, comm in rows.comms.items():
        cols = expected_entries(tl, comm)
        if cols is not None:
            need_of[code], exact_of[code] = len(cols), len(cols) == comm.cols.ncols
    open_ = np.array([v.completed_at is None for v in vs], dtype=bool)
    need, exact = need_of[codes], exact_of[codes]
    maybe = open_ & (need > 0) & (st.n_ended[slots] >= need) & (st.n_entered[slots] >= need)
    for i in np.flatnonzero(maybe & ~exact).tolist():
        v = vs[i]
        completed(tl, rows.comms[int(st.slot_comm[v._slot])], v)
    done = np.flatnonzero(maybe & exact)
    if not len(done):
        return
    bases, widths = st.base[slots[done]], np.array([vs[i]._cols.ncols for i in done.tolist()], dtype=np.int64)
    at = blocks(bases, widths)
    offsets = np.concatenate([[0], np.cumsum(widths)[:-1]])
    last_end = np.fmax.reduceat(st.end[at], offsets)
    first_in = np.fmin.reduceat(st.enter[at], offsets)
    last_in = np.fmax.reduceat(st.enter[at], offsets)
    comms = rows.comms
    for i, c, end, lo, hi in zip(done.tolist(), codes[done].tolist(), last_end.tolist(), first_in.tolist(),
                                 last_in.tolist()):
        done_at(comms[c], vs[i], end, lo, hi)


def _refine(tl: Timeline, rows: _Batch, keep: np.ndarray) -> None:
    """The successful ends, per (agent, collective), to the clock refinement (clockrefine.py), in the
    agent's base timebase, collectives in the order their first end came. Communicators whose members
    are all on one node are left out: they hold nothing to align."""
    refiner = tl.clock.refiner
    if refiner is None:
        return
    st = tl.store
    lone = np.zeros(len(st.comms) + 1, dtype=bool)
    for code in rows.comms:
        lone[code] = len(st.comms[code].nodes) < 2
    use = keep & ~lone[rows.comm] & np.array(rows.a.extra["ok"], dtype=bool)
    at = np.flatnonzero(use)
    if not len(at):
        return
    names = rows.a.agent
    agents = {x: i for i, x in enumerate(set(names))}
    agent = np.array(list(map(agents.__getitem__, names)), dtype=np.int64)[at]
    comm, seq = rows.comm[at], rows.seq[at]
    order = np.lexsort((seq, comm, agent))  # stable: a group's rows stay in the order they came
    a_, c_, s_ = agent[order], comm[order], seq[order]
    change = (a_[1:] != a_[:-1]) | (c_[1:] != c_[:-1]) | (s_[1:] != s_[:-1])
    starts = np.concatenate([[0], np.flatnonzero(change) + 1])
    rows_in = at[order]
    first = rows_in[starts]  # each group's first row (the lowest: stable order)
    bounds = np.concatenate([starts, [len(rows_in)]]).tolist()
    ends = rows.base[rows_in].tolist()
    comm_ids = {code: c.id for code, c in rows.comms.items()}
    row_comm, row_seq, first_l = rows.comm[first].tolist(), rows.seq[first].tolist(), first.tolist()
    refiner.observe_groups([(names[first_l[g]], comm_ids[row_comm[g]], row_seq[g], ends[bounds[g]:bounds[g + 1]])
                            for g in np.argsort(first).tolist()])  # collectives in the order their first end came
