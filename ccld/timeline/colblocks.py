"""The Timeline's fast path for column blocks (ccld/wire/blocks.py): a run of a block's rows, all of one
collective, applied in one pass instead of event by event.

Functions of the Timeline (`tl`), which calls run_of for each run `in_order` yields and saw_rows for each
block once the batch is in. A run takes the fast path when it is what a live agent sends (run_of says
what that is); the rest goes through the Timeline's event-by-event path (its _rows, then _apply and
comms.py), which counts every oddity. Both write the same records, through comms.py's coll_view and
maybe_completed. Times: each run's rows converted together (ClockTable.to_unix_many), between runs as
_apply converts each event; NOT_APPLIED marks a row the fast path did not apply.
Caveat: this is the collector's hot loop (bench/collector_scale.py): what can be done once per run, or
at C speed (zip, dict.update, map), is; a Python call or attribute lookup added to a per-row loop shows.
"""
from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any, Dict, Optional

from ccld.timeline.comms import coll_view, maybe_completed
from ccld.timeline.records import Comm, RankRecord
from ccld.wire.blocks import Block, run_rows

if TYPE_CHECKING:
    from ccld.timeline.timeline import Timeline

NOT_APPLIED = float("-inf")   # a column block row's time when the fast path left it to _apply
# kind -> the fields the fast path reads once per block, from its shared fields: a block that has any of
# them as a column takes the event-by-event path
_FAST_SHARED = {"coll": frozenset({"op", "backend", "count", "dtype", "nbytes"}),
                "end": frozenset({"ok", "error"})}


class _FastBlock:
    """A column block on the fast path, during one ingest: its communicator, pid -> RankRecord, and the
    Unix time each row was applied with (NOT_APPLIED until then, and for rows left to _apply)."""
    __slots__ = ("comm", "recs", "times")

    def __init__(self, comm: Comm, recs: Dict[int, RankRecord], n: int):
        self.comm, self.recs, self.times = comm, recs, [NOT_APPLIED] * n


def run_of(tl: Timeline, agent: str, node: str, prepared: Dict[Block, Any], b: Block, seq: int, i: int,
           j: int) -> None:
    """Rows i:j of column block `b` (ccld/wire/blocks.py), all of collective `seq`: in one pass when they are
    what a live agent sends, else event by event.

    The fast path needs: comm shared (and every other field it reads: _FAST_SHARED), every row's
    rank known and already a member of the communicator from this node and pid, nothing seen
    twice. Whatever else (a first sight, a restarted rank, duplicates, NCCL enters that GPU records
    join, an agent without a clock yet) goes through the Timeline's _apply one event at a time, which
    counts every oddity as it always has."""
    prep = prepared.get(b)
    if prep is None:
        prep = prepared[b] = _prepare(tl, agent, node, b)
    if prep is False:
        tl._rows(agent, node, run_rows(b, seq, i, j))
    elif not _run(tl, agent, prep, b, seq, i, j):
        prep.times[i:j] = [NOT_APPLIED] * (j - i)  # _apply marks these processes as seen itself
        tl._rows(agent, node, run_rows(b, seq, i, j), count=False)  # counted by _prepare


def _prepare(tl: Timeline, agent: str, node: str, b: Block) -> Any:
    """A _FastBlock when block `b` can take the fast path, else False. Counts the block's events
    when it can."""
    same, cols = b.same, b.cols
    if not (tl.clock.has(agent) and "comm" in same and "seq" in cols
            and "pid" in cols and "rank" in cols and "ts_ns" in cols):
        return False
    if not _FAST_SHARED.get(b.kind, frozenset()).isdisjoint(cols):
        return False  # a field the fast path reads once per block differs from row to row
    recs = _block_ranks(tl, node, b)
    if recs is None:
        return False
    return _FastBlock(tl.comms[same["comm"]], recs, b.n)


def saw_rows(b: Block, prep: _FastBlock) -> None:
    """RankRecord.saw for the rows of block `b` the fast path applied, after its last run (nothing
    reads last_event_at during an ingest): each process's newest time, found at C speed. Rows are
    in seq order, so a process's last row is its newest, checked; else rows sorted by time go into
    the dict, which keeps each process's last."""
    times, recs, pids = prep.times, prep.recs, b.cols["pid"]
    newest = dict(zip(pids, times))
    if not all(map(operator.le, times, map(newest.__getitem__, pids))):
        order = sorted(range(b.n), key=times.__getitem__)
        newest = dict(zip(map(pids.__getitem__, order), map(times.__getitem__, order)))
    for pid, t in newest.items():
        rec = recs[pid]
        if t != NOT_APPLIED and (rec.last_event_at is None or t > rec.last_event_at):
            rec.last_event_at = t


def _block_ranks(tl: Timeline, node: str, b: Block) -> Optional[Dict[int, RankRecord]]:
    """pid -> RankRecord for the block's rows when all are known members of its communicator, else None."""
    same, cols = b.same, b.cols
    comm = tl.comms.get(same["comm"])
    if comm is None:
        return None
    cpids, get = comm.pids, tl.ranks.get
    recs = {}
    for rank, pid in set(zip(cols["rank"], cols["pid"])):  # a handful of processes, many rows each
        rec = get((node, pid))
        if rank < 0 or rec is None or cpids.get(rank) != (node, pid):
            return None  # a rank new to this communicator, a restart, no rank: the careful path
        recs[pid] = rec
    if len(recs) != len(set(cols["rank"])):
        return None  # one pid under two ranks
    if b.kind == "coll" and same.get("backend") == "nccl" and tl.gpu.capturing(node, recs):
        return None  # NCCL enters of a rank with CUPTI capture: kept one by one for the kernel join
    if not comm.job:
        comm.job = next(iter(recs.values())).job
    tl.events_by_kind[b.kind] += b.n
    return recs


def _run(tl: Timeline, agent: str, prep: _FastBlock, b: Block, seq: int, i: int, j: int) -> bool:
    """Apply rows i:j of block `b`, all of collective `seq`; False (having changed nothing) when
    they need the event-by-event path."""
    comm = prep.comm
    kind, same, cols = b.kind, b.same, b.cols
    ranks = cols["rank"][i:j]
    if len(set(ranks)) != len(ranks):
        return False
    view = comm.colls.get(seq)
    if kind == "coll":
        if view is not None and not view.enter.keys().isdisjoint(ranks):
            return False
    elif view is None or not view.enter.keys() >= set(ranks) or (
            not (view.start if kind == "start" else view.end).keys().isdisjoint(ranks)):
        return False
    # Converted run by run, as _apply converts each event when it applies it: the clock refiner
    # moves an agent's correction every few collectives, in the middle of a block.
    clock = tl.clock
    times = clock.to_unix_many(agent, cols["ts_ns"][i:j])
    ok = kind != "end" or same.get("ok", True)
    if kind == "end" and ok:
        # The first of these ends may complete a collective the refiner reads, and move this
        # agent's clock: _apply would convert the later ones after that, with the new correction.
        revision = clock.revision
        clock.observe_ends(agent, comm.id, seq, cols["ts_ns"][i:j])
        if clock.revision != revision:
            times[1:] = clock.to_unix_many(agent, cols["ts_ns"][i + 1:j])
    prep.times[i:j] = times
    if kind == "coll":
        _enter_run(tl, comm, seq, same, ranks, times)
        return True
    if kind == "start":
        view.start.update(zip(ranks, times))
        return True
    view.end.update(zip(ranks, times))
    enter, add = view.enter.get, tl.blocked.add
    for r, t in zip(ranks, times):
        add(comm.job, r, enter(r), t)
    if not ok:
        view.failed.update(dict.fromkeys(ranks, same.get("error") or "failed"))
    ops, vop = view.ops, view.op or "unknown"
    counts = tl.end_counts  # not Counter.update: its Python-level checks cost more than 8 additions
    for r in ranks:
        counts[(r, ops.get(r) or vop)] += 1
    maybe_completed(tl, comm, view)
    return True


def _enter_run(tl: Timeline, comm: Comm, seq: int, same: Dict[str, Any], ranks: list, times: list) -> None:
    op = same.get("op", "")
    # As comms.py's _enter does one event at a time: the first rank is a member before the collective is made
    # (how many are kept depends on the group's size), the others after.
    comm.members.add(ranks[0])
    if not comm.backend:
        comm.backend = same.get("backend", "")
    view = coll_view(tl, comm, seq, op, create=True)
    comm.members.update(ranks)
    if view is None:
        tl.anomalies["late-event"] += len(ranks) - 1  # coll_view counted one
        return
    if not view.op:
        view.op = op
    view.enter.update(zip(ranks, times))
    view.ops.update(dict.fromkeys(ranks, op))
    count, dtype, nbytes = same.get("count", -1), same.get("dtype", ""), same.get("nbytes", -1)
    if count >= 0 or dtype or nbytes >= 0:
        view.sizes.update(dict.fromkeys(ranks, (count, dtype, nbytes)))
    counts = tl.enter_counts
    for r in ranks:
        counts[(r, op)] += 1
    if seq >= comm.max_seq:  # no rank has entered a later one: each rank's latest is this
        comm.last_entered.update(zip(ranks, [(seq, op, t) for t in times]))
    else:
        last = comm.last_entered
        for r, t in zip(ranks, times):
            prev = last.get(r)
            if prev is None or seq >= prev[0]:
                last[r] = (seq, op, t)
    comm.max_seq = max(comm.max_seq, seq)
