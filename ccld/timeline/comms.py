"""A rank's communicator events applied to the timeline: CommInit, P2P and P2PEnd (into each
communicator's point-to-point table), and the RankState and RankExit that come in the same family
(timeline.py's _RANK_EVENTS), one event at a time; and what collrows.py, which applies every
CollEnter, WorkStart and WorkEnd as rows, asks of a communicator: the collective (comm, seq) made or
found (coll_view), the communicator of a batch of rows (comm_for_rows), completion (completed).
Functions of the Timeline (`tl`), which dispatches each event here.

Times: Unix seconds, converted by the caller. Bounds: the last MAX_COLLS_PER_COMM collectives per
communicator (fewer for big groups, so that one communicator holds at most ~MAX_RANK_ENTRIES_PER_COMM
per-rank entries), MAX_COMMS communicators. A late event for an evicted collective, a stale pid, a
duplicate, is counted in `tl.anomalies`, never fatal.
Caveat: a rank seen under a new pid whose CommInit names a communicator it was in starts that
communicator over (a restarted job rebuilds its groups; seq counts from 1 again); other events of a
retired pid are dropped as stale.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import numpy as np

from ccld import wire as ev
from ccld.timeline.align import per_process
from ccld.timeline.p2p import CommP2P
from ccld.timeline.records import CollView, Comm, RankRecord

if TYPE_CHECKING:
    from ccld.timeline.timeline import Timeline

MAX_COLLS_PER_COMM = 4096     # hang detection looks at the newest; 4096 covers minutes of a fast job ...
MAX_RANK_ENTRIES_PER_COMM = 1 << 20  # ... but a collective holds ~3 entries per member, so a big group keeps
MIN_COLLS_PER_COMM = 64              # fewer: 1M / group size (>= 64): 256 at 4,096 ranks, ~250 MiB at most
MAX_COMMS = 10_000            # process groups per collector; real jobs have a handful per job
PEAK_BUCKET_S = 300.0         # arrival-spread/duration peaks are kept per 5-minute bucket ...
PEAK_BUCKETS = 12             # ... for an hour: a checkpoint every N minutes is still remembered


STATE_SCAN_GAP_S = 0.25  # RankStates further apart than this came from different scans of the agent


def horizon(info: Dict[str, Any], t: float) -> None:
    """An agent's data horizon (Timeline.agent_lag_s): its latest RankState time, and the typical
    period of its scans (EWMA over scans: one scan's RankStates are microseconds apart)."""
    prev = info.get("state_at")
    if prev is not None and t <= prev:
        return
    info["state_at"] = t
    scan = info.get("state_scan_at")
    if scan is None or t - scan >= STATE_SCAN_GAP_S:
        if scan is not None:
            gap = t - scan
            info["state_period_s"] = gap if "state_period_s" not in info else 0.8 * info["state_period_s"] + 0.2 * gap
        info["state_scan_at"] = t
        info["state_scans"] = info.get("state_scans", 0) + 1


def rank_event(tl: Timeline, agent: str, node: str, e: ev.Event, t: float) -> None:
    """One of _RANK_EVENTS (timeline.py) of process (node, e.pid), at Unix time `t`."""
    rec = tl.ranks.get((node, e.pid))
    if rec is None:
        tl.anomalies["unknown-pid"] += 1  # no RankInfo (yet) for this process
    else:
        rec.saw(t)
    rank = e.rank if e.rank >= 0 else (rec.rank if rec else -1)
    if isinstance(e, ev.RankState):
        info = tl.agents.get(agent)
        if info is not None:
            horizon(info, t)
        if rec is not None:
            if rec.state_at is not None and rec.cpu_ns >= 0 and e.cpu_ns >= rec.cpu_ns and t > rec.state_at:
                rec.cpu_busy = (e.cpu_ns - rec.cpu_ns) / 1e9 / (t - rec.state_at)
            rec.state, rec.wchan, rec.cpu_ns, rec.state_at = e.state, e.wchan, e.cpu_ns, t
        return
    if isinstance(e, ev.RankExit):
        if rec is not None:
            rec.exited_at, rec.exit_reason, rec.exit_exact = t, e.reason, e.exact
            rec.exit_signal, rec.stopped_by_launcher = e.signal, e.by_launcher
        return
    if rank < 0:
        tl.anomalies["no-rank"] += 1  # neither the event nor a RankInfo says which rank this is
        return
    if isinstance(e, ev.P2P):
        tl.p2p_counts[(rank, e.op)] += 1
        if rec is not None:
            rec.last_p2p = (e.op, e.peer, t)
    comm = _comm_of(tl, e.comm, rec, rank, node, e.pid, isinstance(e, ev.CommInit))
    if comm is None:
        return
    if isinstance(e, (ev.P2P, ev.P2PEnd)):
        _p2p(tl, agent, comm, rank, e, t)
    elif isinstance(e, ev.CommInit):
        comm.backend = e.backend or comm.backend
        if e.group_size >= 0:
            comm.group_size = e.group_size
        if e.subgroup:
            comm.subgroup = True
        comm.members.add(rank)
        if e.seq_source:
            comm.seq_sources[rank] = e.seq_source
        if per_process(e.backend, e.comm, e.seq_source):
            tl.align.watch(comm, rank)
        if e.group_rank >= 0:  # seen at its creation: this rank's p2p numbering began with the group
            comm.group_of[rank] = e.group_rank
            comm.global_by_group[e.group_rank] = rank
            _p2p_of(tl, comm).exact.add(rank)


def _p2p_of(tl: Timeline, comm: Comm) -> CommP2P:
    if comm.p2p is None:
        comm.p2p = CommP2P(tl.anomalies)
    return comm.p2p


def _p2p(tl: Timeline, agent: str, comm: Comm, rank: int, e, t: float) -> None:
    comm.members.add(rank)
    table = _p2p_of(tl, comm)
    if isinstance(e, ev.P2P):
        table.post(rank, e, t)
    else:
        wait_at = tl.clock.to_unix(agent, e.wait_ns) if e.wait_ns > 0 else None
        op = table.end(rank, e, t, wait_at)
        if op is not None:
            tl.blocked.add(comm.job, rank, op.blocked_from(), t)


def _comm_of(tl: Timeline, cid: str, rec: Optional[RankRecord], rank: int, node: str, pid: int,
             is_init: bool) -> Optional[Comm]:
    comm = tl.comms.get(cid)
    if comm is None:
        if len(tl.comms) >= MAX_COMMS:
            tl.anomalies["comms-over-bound"] += 1
            return None
        comm = tl.comms[cid] = Comm(id=cid)
    if not comm.job and rec is not None and rec.job:
        comm.job = rec.job
    prev = comm.pids.get(rank)
    if (node, pid) in comm.retired or (prev is not None and prev != (node, pid) and not is_init):
        tl.anomalies["stale-pid"] += 1  # an old incarnation of a restarted rank; ignore it
        return None
    if prev is not None and prev != (node, pid):
        # The rank was restarted and rebuilt this group: sequence numbers start over.
        tl.anomalies["comm-reset"] += 1
        if comm.cols is not None:
            _let_go(comm)
            tl.store.drop_comm(comm.cols)
        comm = tl.comms[cid] = Comm(id=cid, job=comm.job, backend=comm.backend, resets=comm.resets + 1,
                                    retired=comm.retired | set(comm.pids.values()))
    comm.pids[rank] = (node, pid)
    tl.store.cell(comm.attach(tl.store), rank, tl.node_code(node), pid, rec)
    return comm


def _pop_oldest(comm: Comm) -> Tuple[int, CollView]:
    """(seq, view) of the oldest collective made, taken out of comm.colls; a view an analysis still
    holds keeps a copy (freeze), since its slot is about to be freed."""
    seq, gone = comm.colls.popitem(last=False)
    comm.gone += 1
    if sys.getrefcount(gone) > 2:  # an analysis still holds it (this name and the call hold two)
        gone.freeze()
    return seq, gone


def _let_go(comm: Comm) -> None:
    """A replaced communicator's collectives leave it, as evicted ones do (its slots go to the store's
    free list with drop_comm)."""
    while comm.colls:
        _pop_oldest(comm)


def comm_for_rows(tl: Timeline, cid: str) -> Optional[Comm]:
    """Communicator `cid` of collective rows (made when new), or None when over the bound (the caller
    counts its rows)."""
    comm = tl.comms.get(cid)
    if comm is None:
        if len(tl.comms) >= MAX_COMMS:
            return None
        comm = tl.comms[cid] = Comm(id=cid)
    return comm


def coll_view(tl: Timeline, comm: Comm, seq: int, op: str, create: bool) -> Optional[CollView]:
    """Collective `seq` of `comm`; made when `create`, unless it was evicted already: then None, counted."""
    view = comm.colls.get(seq)
    if view is not None or not create:
        return view
    return new_views(tl, [(comm, seq, op)])[0]


def new_views(tl: Timeline, made: List[Tuple[Comm, int, str]]) -> List[Optional[CollView]]:
    """coll_view(create=True) for each (comm, seq, op) of `made` (collectives not held yet), their slots
    taken together: None for those evicted already (counted)."""
    out: List[Optional[CollView]] = [None] * len(made)
    fresh = [i for i, (c, seq, _) in enumerate(made) if seq > c.evicted_upto]
    if len(fresh) < len(made):
        tl.anomalies["late-event"] += len(made) - len(fresh)
    if not fresh:
        return out
    st = tl.store
    owners = [made[i][0].attach(st) for i in fresh]
    for i, cols, slot in zip(fresh, owners, st.take_slots(owners)):
        comm, seq, op = made[i]
        out[i] = comm.colls[seq] = CollView(comm.id, seq, op, st, cols, slot, comm.made)
        comm.made += 1
    return out


def evict(tl: Timeline, comm: Comm) -> None:
    """Past the bound, the oldest collectives made go (collrows.py asks at the end of each flush: rows
    of one flush all reach their collectives first, as they did applied one event at a time)."""
    keep = min(MAX_COLLS_PER_COMM, max(MIN_COLLS_PER_COMM, MAX_RANK_ENTRIES_PER_COMM // max(1, len(comm.members))))
    while len(comm.colls) > keep:
        old, gone = _pop_oldest(comm)
        tl.store.release(gone._cols, gone._slot)
        comm.evicted_upto = max(comm.evicted_upto, old)


def expected_entries(tl: Timeline, comm: Comm) -> Optional[np.ndarray]:
    """Columns of the communicator's expected members, or None while one of them has none (it never
    reported: nothing can be complete)."""
    expected = tl.expected_members(comm.id)
    cols = comm.attach(tl.store)
    if cols.ncols < len(expected):  # one of them has no column yet (a job's first frames: no list built)
        return None
    key, got = comm.expected_cols
    if key is None or key[0] is not expected or key[1] != cols.ncols:
        at = [cols.col_of.get(r, -1) for r in expected]
        comm.expected_cols = ((expected, cols.ncols), None if -1 in at else np.array(at, dtype=np.int64))
    return comm.expected_cols[1]


def completed(tl: Timeline, comm: Comm, view: Optional[CollView]) -> Optional[float]:
    """Marks `view` completed once every expected member has entered and ended it (its completion
    time, else None); keeps the peaks."""
    if view is None or view.completed_at is not None:
        return None
    if not tl.expected_members(comm.id):
        return None
    cols = expected_entries(tl, comm)
    if cols is None:
        return None
    st = tl.store
    base = int(st.base[view._slot])
    ends = st.end[base + cols]
    if np.isnan(ends).any() or np.isnan(st.enter[base + cols]).any():
        return None
    enters = st.enter[base:base + comm.attach(st).ncols]
    at = float(ends.max())
    done_at(comm, view, at, float(np.nanmin(enters)), float(np.nanmax(enters)))
    return at


def done_at(comm: Comm, view: CollView, at: float, first: float, last: float) -> None:
    """Collective `view` completed at `at`, its members' first enter at `first` and last at `last`:
    counted, logged (Comm.done) and its peaks kept (arrival spread, and duration from the last
    enter to the last end)."""
    view.completed_at = at
    comm.completed += 1
    comm.done.add(view.made, view.seq, view.op, at, first, last, comm.gone)
    spread, duration = last - first, max(0.0, at - last)
    if comm.first_done_at is None:
        comm.first_done_at = at
    bucket = int(at // PEAK_BUCKET_S)
    s, d = comm.peaks.get(bucket, (0.0, 0.0))
    comm.peaks[bucket] = (max(s, spread), max(d, duration))
    while len(comm.peaks) > PEAK_BUCKETS:
        del comm.peaks[min(comm.peaks)]
