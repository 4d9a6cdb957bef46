"""The timeline: events of all agents joined into ranks, communicators and collectives.

A collective is identified across ranks by (communicator, seq); for each one the timeline keeps
every rank's enter/start/end time. Times: every time here is Unix seconds (float), converted from
the event's node-monotonic `ts_ns` by `ClockTable.to_unix`, keyed by the batch's agent; `recv_unix`
is only used for how long an agent has been silent.

Bounds: the last MAX_COLLS_PER_COMM collectives per communicator (fewer for big groups, so that one
communicator holds at most ~MAX_RANK_ENTRIES_PER_COMM per-rank entries), MAX_COMMS communicators,
MAX_RANKS processes, MAX_PENDING_NO_CLOCK events waiting for their agent's first clock sample.
Whatever falls outside a bound, and every odd event (end without enter, unknown pid, duplicate),
is counted in `anomalies`, never fatal. Not thread-safe: the caller serialises ingest and reads.
Caveat: a communicator whose group size is unknown (attached after init) is assumed to span its
job's whole world, except an NCCL one named by one process's handle: align.py joins those across
ranks, by their op streams and enter times, and rewrites their events at ingest.
"""
from __future__ import annotations

import bisect
import collections
import operator
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, FrozenSet, List, Optional, Set, Tuple

from ccld import wire as ev
from ccld.timeline.align import Aligner, per_process
from ccld.timeline.blocked import BlockedTable
from ccld.timeline.clock import ClockTable
from ccld.timeline.compute import ComputeTable
from ccld.timeline.gpu import GPU_EVENTS, GpuJoin
from ccld.timeline.links import LinkTable
from ccld.timeline.netprog import ProgressTable
from ccld.timeline.p2p import CommP2P, P2POp
from ccld.timeline.rdma import RdmaTable
from ccld.wire.blocks import Block, in_order, run_rows

MAX_COLLS_PER_COMM = 4096     # hang detection looks at the newest; 4096 covers minutes of a fast job ...
MAX_RANK_ENTRIES_PER_COMM = 1 << 20  # ... but a collective holds ~3 entries per member, so a big group keeps
MIN_COLLS_PER_COMM = 64              # fewer: 1M / group size (>= 64): 256 at 4,096 ranks, ~250 MiB at most
MAX_COMMS = 10_000            # process groups per collector; real jobs have a handful per job
MAX_RANKS = 100_000           # processes per collector
MAX_WORLD_SIZE = 1 << 17      # 131,072 ranks: above the largest jobs run today; a bigger value is a corrupt event
SMALL_WORLD = 64              # a world this small is believed before its ranks are announced (tests, small jobs)
MAX_PENDING_NO_CLOCK = 100_000  # events held until their agent's first clock sample (sent every batch)
PEAK_BUCKET_S = 300.0         # arrival-spread/duration peaks are kept per 5-minute bucket ...
PEAK_BUCKETS = 12             # ... for an hour: a checkpoint every N minutes is still remembered
NOT_APPLIED = float("-inf")   # a column block row's time when the fast path left it to _apply
RUNQ_HISTORY = 128            # scheduler reports kept per rank (every 0.5 s: a minute)
RUNQ_MIN_SPAN_S = 2.0         # a runqueue share over a span needs at least this much of it


@dataclass
class RankRecord:
    """One training process, keyed by (node, pid)."""
    node: str
    pid: int
    agent: str
    rank: int = -1
    world_size: int = -1
    local_rank: int = -1
    job: str = ""
    state: str = ""           # /proc state letter of the latest RankState
    wchan: str = ""
    cpu_ns: int = -1
    state_at: Optional[float] = None
    cpu_busy: Optional[float] = None  # CPU seconds per second between the last two RankStates
    exited_at: Optional[float] = None
    exit_reason: str = ""
    exit_exact: bool = False  # exited_at is the kernel's time of the exit, not the agent's next scan
    exit_signal: int = 0      # the fatal signal it was sent (0: none seen)
    stopped_by_launcher: bool = False  # that signal came from its launcher (a restart, a cancelled job)
    last_event_at: Optional[float] = None
    last_p2p: Optional[Tuple[str, int, float]] = None  # (op, peer, at)
    # Scheduler (SchedStats, cumulative ns): waiting for a CPU while runnable, and off CPU while blocked.
    runq_ns: int = -1
    runq_waits: int = 0
    offcpu_ns: int = -1
    runq_max_ns: int = 0              # longest single wait in the latest report's interval
    runq_share: Optional[float] = None  # runqueue seconds per second between the last two reports
    sched_at: Optional[float] = None
    runq_hist: Deque[Tuple[float, int]] = field(default_factory=lambda: collections.deque(maxlen=RUNQ_HISTORY))

    def runq_since(self, since: float) -> Optional[float]:
        """Runqueue seconds per second from the first report at or after `since` to the latest (the
        share over a span, which one noisy report cannot tip), or None with under two reports."""
        h = self.runq_hist
        first = next((x for x in h if x[0] >= since), None)
        if first is None or h[-1][0] - first[0] < RUNQ_MIN_SPAN_S:
            return None
        return (h[-1][1] - first[1]) / 1e9 / (h[-1][0] - first[0])

    def saw(self, t: float) -> None:
        """An event of this process at `t`: keeps the newest (frames can arrive out of order)."""
        self.last_event_at = t if self.last_event_at is None else max(self.last_event_at, t)

    def stopped(self) -> bool:
        return self.state in ("T", "t")

    def exited(self) -> bool:
        return self.exited_at is not None or self.state in ("Z", "X")


@dataclass
class CollView:
    """One collective (comm, seq) as seen by every rank that reported it."""
    comm: str
    seq: int
    op: str
    enter: Dict[int, float] = field(default_factory=dict)   # global rank -> Unix s
    start: Dict[int, float] = field(default_factory=dict)
    end: Dict[int, float] = field(default_factory=dict)
    ops: Dict[int, str] = field(default_factory=dict)       # global rank -> op it called
    failed: Dict[int, str] = field(default_factory=dict)    # global rank -> library error
    sizes: Dict[int, Tuple[int, str, int]] = field(default_factory=dict)  # rank -> (count, dtype, nbytes) where known
    gpu_start: Dict[int, float] = field(default_factory=dict)  # rank -> Unix s its NCCL kernel began (gpu.py)
    gpu_end: Dict[int, float] = field(default_factory=dict)
    completed_at: Optional[float] = None

    def first_enter(self) -> Optional[float]:
        return min(self.enter.values()) if self.enter else None

    def last_enter(self) -> Optional[float]:
        return max(self.enter.values()) if self.enter else None


@dataclass
class Comm:
    """A communicator (process group) across ranks."""
    id: str
    backend: str = ""
    group_size: int = -1
    job: str = ""
    members: Set[int] = field(default_factory=set)          # global ranks seen via CommInit/CollEnter
    pids: Dict[int, Tuple[str, int]] = field(default_factory=dict)  # global rank -> (node, pid)
    retired: Set[Tuple[str, int]] = field(default_factory=set)      # (node, pid)s replaced by a restart
    colls: "collections.OrderedDict[int, CollView]" = field(default_factory=collections.OrderedDict)
    max_seq: int = -1
    evicted_upto: int = -1     # seqs at or below this fell out of the bound; late events for them are dropped
    last_entered: Dict[int, Tuple[int, str, float]] = field(default_factory=dict)  # rank -> (seq, op, at)
    # bucket index -> (max arrival spread s, max duration s) of collectives completed in that bucket
    peaks: Dict[int, Tuple[float, float]] = field(default_factory=dict)
    completed: int = 0
    resets: int = 0
    expected: FrozenSet[int] = frozenset()                 # expected_members' answer, while expected_key holds
    expected_key: Tuple[int, ...] = (-2, -2, -2, -2)
    group_of: Dict[int, int] = field(default_factory=dict)     # global rank -> group rank (CommInit)
    global_by_group: Dict[int, int] = field(default_factory=dict)  # its inverse
    ordered: Tuple[Any, List[int]] = ((), [])                  # (expected_key, sorted expected members): a cache
    seq_sources: Dict[int, str] = field(default_factory=dict)  # global rank -> CommInit.seq_source
    p2p: Optional[CommP2P] = None                              # its point-to-point ops, once it has any
    unseen_noted: bool = False  # hang.py counted (once) that a crowd of its members was never reported
    first_done_at: Optional[float] = None  # when its first collective completed (how long its normal is known)
    # Its expected members are the members seen, never the job's world: a per-process NCCL communicator
    # (named by its handle, seen after the attach) and one joined from such by align.py
    members_only: bool = False
    alignment: Optional[Dict[str, Any]] = None  # align.py's joined communicator: how (findings' evidence)


_RANK_EVENTS = (ev.RankState, ev.RankExit, ev.CommInit, ev.CollEnter, ev.WorkStart, ev.WorkEnd, ev.P2P,
                ev.P2PEnd)
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


class Timeline:
    def __init__(self) -> None:
        self.clock = ClockTable()
        self.ranks: Dict[Tuple[str, int], RankRecord] = {}
        self.by_rank: Dict[Tuple[str, int], Tuple[str, int]] = {}   # (job, global rank) -> (node, pid)
        self.job_ranks: collections.Counter = collections.Counter()  # job -> distinct ranks announced
        self.jobs: Dict[str, int] = {}                              # job -> world size
        self.comms: Dict[str, Comm] = {}
        self.agents: Dict[str, Dict[str, Any]] = {}                 # agent -> hello, node, last batch, recv
        self.probes: Dict[Tuple[str, int, str], Dict[str, Any]] = {}  # (node, pid, family) -> status
        self.agent_loss: Dict[str, Dict[str, int]] = {}
        self.events_by_kind: collections.Counter = collections.Counter()
        self.anomalies: collections.Counter = collections.Counter()
        self.gpu = GpuJoin(self)  # CUPTI kernels joined to collectives
        self.links = LinkTable(self.anomalies)
        self.rdma = RdmaTable(self.anomalies)
        self.progress = ProgressTable(self.anomalies)  # NCCL proxy progress per link (profiler plugin)
        self.blocked = BlockedTable(self.anomalies)  # per rank, time spent waiting in communication
        self.compute = ComputeTable(self.anomalies)  # per rank, each run of each compute op (tables, traces)
        self.align = Aligner(self, Comm, MAX_COMMS)  # NCCL communicators seen after the attach, joined across ranks
        # Exact per-(global rank, op) counts, for tests and sanity checks (all jobs together).
        self.enter_counts: collections.Counter = collections.Counter()
        self.end_counts: collections.Counter = collections.Counter()
        self.p2p_counts: collections.Counter = collections.Counter()
        self._pending: Dict[str, Deque[Tuple[str, ev.Event]]] = {}
        self.last_recv: Optional[float] = None
        self._recv_prev: Optional[float] = None  # the last frame's receive time, and the forward-only sum
        self._recv_s = 0.0                      # of the steps between them (clock.arrived)

    # ---- ingest ---------------------------------------------------------------------------------

    def ingest(self, batch: ev.Batch, recv_unix: float) -> None:
        agent = batch.agent
        info = self.agents.setdefault(agent, {"node": batch.node, "last_batch": 0, "frames": 0})
        prev = info.get("last_recv")
        if prev is not None and recv_unix >= prev:
            # Typical gap between this agent's frames (EWMA): a live agent sends every 100 ms, so it
            # is "silent" after a few seconds; a replayed or synthetic source with sparse frames is not.
            gap = recv_unix - prev
            info["gap_s"] = gap if "gap_s" not in info else 0.8 * info["gap_s"] + 0.2 * gap
        info["node"], info["last_recv"] = batch.node, recv_unix
        info["frames"] += 1
        if batch.batch == info["last_batch"] + 1 or info["frames"] == 1:
            pass
        elif batch.batch > info["last_batch"] + 1:
            self.anomalies["batch-gap"] += batch.batch - info["last_batch"] - 1  # frames lost in transit
        else:
            self.anomalies["agent-restart"] += 1  # numbering started over: a new agent process
        info["last_batch"] = batch.batch
        self.last_recv = recv_unix if self.last_recv is None else max(self.last_recv, recv_unix)
        # Receive time that only moves forward, even across a step back of the collector's wall clock
        # (max() would stand still that long): the clock refinement settles collectives by it.
        if self._recv_prev is not None and recv_unix > self._recv_prev:
            self._recv_s += recv_unix - self._recv_prev
        self._recv_prev = recv_unix
        self.clock.arrived(self._recv_s)
        prepared: Dict[Block, Any] = {}
        plain, blocks = batch.plain, batch.blocks
        if batch.node in self.align.nodes:  # its NCCL calls seen after the attach are aligned (align.py)
            plain, blocks = self.align.rewrite(plain, blocks)
        for e in in_order(plain, blocks):
            if type(e) is tuple:  # a run of a column block: rows i:j, all of one collective
                self._run_of(agent, batch.node, prepared, *e)
                continue
            self.events_by_kind[e.KIND] += 1
            if isinstance(e, (ev.ClockSample, ev.ClockSync)):
                if self.clock.update_event(agent, e):
                    self._drain_pending(agent)
                else:
                    self.anomalies["bad-clock-sample"] += 1
            elif self.clock.has(agent):
                self._apply(agent, batch.node, e)
            else:
                q = self._pending.setdefault(agent, collections.deque())
                if len(q) >= MAX_PENDING_NO_CLOCK:
                    self.anomalies["no-clock-dropped"] += 1
                else:
                    q.append((batch.node, e))
        for b, prep in prepared.items():
            if prep is not False:
                self._saw_rows(b, prep)
        if self.align.waiting:
            self.align.tick(self._recv_s)

    def _run_of(self, agent: str, node: str, prepared: Dict[Block, Any], b: Block, seq: int, i: int, j: int) -> None:
        """Rows i:j of column block `b` (ccld/wire/blocks.py), all of collective `seq`: in one pass when they are
        what a live agent sends, else event by event.

        The fast path needs: comm shared (and every other field it reads: _FAST_SHARED), every row's
        rank known and already a member of the communicator from this node and pid, nothing seen
        twice. Whatever else (a first sight, a restarted rank, duplicates, NCCL enters that GPU records
        join, an agent without a clock yet) goes through _apply one event at a time, which counts every
        oddity as it always has."""
        prep = prepared.get(b)
        if prep is None:
            prep = prepared[b] = self._prepare(agent, node, b)
        if prep is False:
            self._rows(agent, node, run_rows(b, seq, i, j))
        elif not self._run(agent, prep, b, seq, i, j):
            prep.times[i:j] = [NOT_APPLIED] * (j - i)  # _apply marks these processes as seen itself
            self._rows(agent, node, run_rows(b, seq, i, j), count=False)  # counted by _prepare

    def _prepare(self, agent: str, node: str, b: Block) -> Any:
        """A _FastBlock when block `b` can take the fast path, else False. Counts the block's events
        when it can."""
        same, cols = b.same, b.cols
        if not (self.clock.has(agent) and "comm" in same and "seq" in cols
                and "pid" in cols and "rank" in cols and "ts_ns" in cols):
            return False
        if not _FAST_SHARED.get(b.kind, frozenset()).isdisjoint(cols):
            return False  # a field the fast path reads once per block differs from row to row
        recs = self._block_ranks(node, b)
        if recs is None:
            return False
        return _FastBlock(self.comms[same["comm"]], recs, b.n)

    def _saw_rows(self, b: Block, prep: _FastBlock) -> None:
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

    def _rows(self, agent: str, node: str, rows: list, count: bool = True) -> None:
        for e in rows:
            if count:
                self.events_by_kind[e.KIND] += 1
            if self.clock.has(agent):
                self._apply(agent, node, e)
            else:
                q = self._pending.setdefault(agent, collections.deque())
                if len(q) >= MAX_PENDING_NO_CLOCK:
                    self.anomalies["no-clock-dropped"] += 1
                else:
                    q.append((node, e))

    def _block_ranks(self, node: str, b: Block) -> Optional[Dict[int, RankRecord]]:
        """pid -> RankRecord for the block's rows when all are known members of its communicator, else None."""
        same, cols = b.same, b.cols
        comm = self.comms.get(same["comm"])
        if comm is None:
            return None
        cpids, get = comm.pids, self.ranks.get
        recs = {}
        for rank, pid in set(zip(cols["rank"], cols["pid"])):  # a handful of processes, many rows each
            rec = get((node, pid))
            if rank < 0 or rec is None or cpids.get(rank) != (node, pid):
                return None  # a rank new to this communicator, a restart, no rank: the careful path
            recs[pid] = rec
        if len(recs) != len(set(cols["rank"])):
            return None  # one pid under two ranks
        if b.kind == "coll" and same.get("backend") == "nccl" and self.gpu.capturing(node, recs):
            return None  # NCCL enters of a rank with CUPTI capture: kept one by one for the kernel join
        if not comm.job:
            comm.job = next(iter(recs.values())).job
        self.events_by_kind[b.kind] += b.n
        return recs

    def _run(self, agent: str, prep: _FastBlock, b: Block, seq: int, i: int, j: int) -> bool:
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
        clock = self.clock
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
            self._enter_run(comm, seq, same, ranks, times)
            return True
        if kind == "start":
            view.start.update(zip(ranks, times))
            return True
        view.end.update(zip(ranks, times))
        enter, add = view.enter.get, self.blocked.add
        for r, t in zip(ranks, times):
            add(comm.job, r, enter(r), t)
        if not ok:
            view.failed.update(dict.fromkeys(ranks, same.get("error") or "failed"))
        ops, vop = view.ops, view.op or "unknown"
        counts = self.end_counts  # not Counter.update: its Python-level checks cost more than 8 additions
        for r in ranks:
            counts[(r, ops.get(r) or vop)] += 1
        self._maybe_completed(comm, view)
        return True

    def _enter_run(self, comm: Comm, seq: int, same: Dict[str, Any], ranks: list, times: list) -> None:
        op = same.get("op", "")
        # As _enter does one event at a time: the first rank is a member before the collective is made
        # (how many are kept depends on the group's size), the others after.
        comm.members.add(ranks[0])
        if not comm.backend:
            comm.backend = same.get("backend", "")
        view = self._view(comm, seq, op, create=True)
        comm.members.update(ranks)
        if view is None:
            self.anomalies["late-event"] += len(ranks) - 1  # _view counted one
            return
        if not view.op:
            view.op = op
        view.enter.update(zip(ranks, times))
        view.ops.update(dict.fromkeys(ranks, op))
        count, dtype, nbytes = same.get("count", -1), same.get("dtype", ""), same.get("nbytes", -1)
        if count >= 0 or dtype or nbytes >= 0:
            view.sizes.update(dict.fromkeys(ranks, (count, dtype, nbytes)))
        counts = self.enter_counts
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

    def _drain_pending(self, agent: str) -> None:
        q = self._pending.pop(agent, None)
        while q:
            node, e = q.popleft()
            self._apply(agent, node, e)

    def _apply(self, agent: str, node: str, e: ev.Event) -> None:
        t = self.clock.to_unix(agent, e.ts_ns) if isinstance(getattr(e, "ts_ns", None), int) else None
        if isinstance(e, ev.AgentHello):
            self.agents[agent].update(hello_at=t, agent_pid=e.pid, version=e.version, sources=list(e.sources))
        elif isinstance(e, ev.LossCounters):
            self.agent_loss[agent] = dict(e.counters)  # cumulative: the latest replaces the previous
        elif isinstance(e, ev.ProbeStatus):
            if e.family == "cupti" and e.ok:
                self.gpu.note_capture(node, e.pid)
            self.probes[(node, e.pid, e.family)] = {"ok": e.ok, "target": e.target, "attached": e.attached,
                                                    "message": e.message, "at": t}
        elif isinstance(e, ev.RankInfo):
            self._rank_info(agent, node, e, t)
        elif isinstance(e, ev.LinkStats):
            rec = self.ranks.get((node, e.pid))
            if rec is not None:
                rec.saw(t)
            self.links.update(node, rec.job if rec else "", e, t, lambda ns: self.clock.to_unix(agent, ns))
        elif isinstance(e, ev.SchedStats):
            self._sched(node, e, t)
        elif isinstance(e, (ev.QpInfo, ev.NicCounters)):
            rec = self.ranks.get((node, e.pid)) if isinstance(e, ev.QpInfo) else None
            self.rdma.update(node, rec.job if rec else "", e, t)
        elif isinstance(e, _RANK_EVENTS):
            self._rank_event(agent, node, e, t)
            if isinstance(e, ev.CollEnter):
                self.gpu.on_enter(node, e)
            elif isinstance(e, ev.WorkEnd):
                self.clock.observe_end(agent, e)  # ranks leave a collective together: aligns the nodes' clocks
        elif isinstance(e, ev.NetProgress):
            self._net_progress(agent, node, e)
        elif isinstance(e, ev.ComputeSpan):
            self._compute(agent, node, e, t)  # a compute span of a table or trace
        elif isinstance(e, GPU_EVENTS):
            self.gpu.note_capture(node, e.pid)
            self.gpu.apply(agent, node, e)
        else:
            self.anomalies[f"unhandled-kind:{e.KIND}"] += 1  # a kind the schema knows but the timeline does not use

    def _compute(self, agent: str, node: str, e: ev.ComputeSpan, t: float) -> None:
        rec = self.ranks.get((node, e.pid))
        if rec is None or rec.rank < 0:
            self.anomalies["compute-unknown-rank"] += 1
            return
        end = self.clock.to_unix(agent, e.end_ns)
        rec.saw(end)
        self.compute.add(rec.job, rec.rank, e.name, t, end)

    def _net_progress(self, agent: str, node: str, e: ev.NetProgress) -> None:
        rec = self.ranks.get((node, e.pid))
        comm = self.comms.get(e.comm)
        group_rank = comm.group_of.get(e.rank) if comm is not None else None
        self.progress.update(e, group_rank, lambda ns: self.clock.to_unix(agent, ns))
        if rec is not None:
            rec.saw(self.clock.to_unix(agent, e.ts_ns))

    def _rank_info(self, agent: str, node: str, e: ev.RankInfo, t: float) -> None:
        if e.world_size > MAX_WORLD_SIZE or e.rank >= MAX_WORLD_SIZE:
            self.anomalies["bad-world-size"] += 1  # cannot be real; would make expected_members huge
            return
        rec = self.ranks.get((node, e.pid))
        if rec is None:
            if len(self.ranks) >= MAX_RANKS:
                self.anomalies["ranks-over-bound"] += 1
                return
            rec = self.ranks[(node, e.pid)] = RankRecord(node=node, pid=e.pid, agent=agent)
        rec.rank, rec.world_size, rec.local_rank, rec.job = e.rank, e.world_size, e.local_rank, e.job
        rec.saw(t)
        if e.world_size > 0:
            self.jobs[e.job] = max(self.jobs.get(e.job, 0), e.world_size)
        else:
            self.jobs.setdefault(e.job, -1)
        if e.rank >= 0:
            if (e.job, e.rank) not in self.by_rank:
                self.job_ranks[e.job] += 1
            self.by_rank[(e.job, e.rank)] = (node, e.pid)  # a restarted rank (new pid) replaces the old
        self.links.note_job(e.job, e.master_addr, e.master_port)

    def _sched(self, node: str, e: ev.SchedStats, t: float) -> None:
        rec = self.ranks.get((node, e.pid))
        if rec is None:
            self.anomalies["unknown-pid"] += 1
            return
        if rec.sched_at is not None and rec.runq_ns >= 0 and e.runq_ns >= rec.runq_ns and t > rec.sched_at:
            rec.runq_share = (e.runq_ns - rec.runq_ns) / 1e9 / (t - rec.sched_at)
        if e.runq_ns >= 0 and (not rec.runq_hist or (t > rec.runq_hist[-1][0] and e.runq_ns >= rec.runq_hist[-1][1])):
            rec.runq_hist.append((t, e.runq_ns))
        rec.runq_ns, rec.runq_waits, rec.offcpu_ns = e.runq_ns, e.runq_waits, e.offcpu_ns
        rec.runq_max_ns, rec.sched_at = e.runq_max_ns, t
        rec.saw(t)

    def _rank_event(self, agent: str, node: str, e: ev.Event, t: float) -> None:
        rec = self.ranks.get((node, e.pid))
        if rec is None:
            self.anomalies["unknown-pid"] += 1  # no RankInfo (yet) for this process
        else:
            rec.saw(t)
        rank = e.rank if e.rank >= 0 else (rec.rank if rec else -1)
        if isinstance(e, ev.RankState):
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
            self.anomalies["no-rank"] += 1  # neither the event nor a RankInfo says which rank this is
            return
        if isinstance(e, ev.P2P):
            self.p2p_counts[(rank, e.op)] += 1
            if rec is not None:
                rec.last_p2p = (e.op, e.peer, t)
        comm = self._comm(e.comm, rec, rank, node, e.pid, isinstance(e, ev.CommInit))
        if comm is None:
            return
        if isinstance(e, (ev.P2P, ev.P2PEnd)):
            self._p2p(agent, comm, rank, e, t)
        elif isinstance(e, ev.CommInit):
            comm.backend = e.backend or comm.backend
            if e.group_size >= 0:
                comm.group_size = e.group_size
            comm.members.add(rank)
            if e.seq_source:
                comm.seq_sources[rank] = e.seq_source
            if per_process(e):
                self.align.watch(comm, rank)
            if e.group_rank >= 0:  # seen at its creation: this rank's p2p numbering began with the group
                comm.group_of[rank] = e.group_rank
                comm.global_by_group[e.group_rank] = rank
                self._p2p_of(comm).exact.add(rank)
        elif isinstance(e, ev.CollEnter):
            self._enter(comm, rank, e, t)
        elif isinstance(e, (ev.WorkStart, ev.WorkEnd)):
            view = self._view(comm, e.seq, "", create=True)
            if view is None:
                return
            if rank not in view.enter:
                self.anomalies["start-without-enter" if isinstance(e, ev.WorkStart) else "end-without-enter"] += 1
            if isinstance(e, ev.WorkStart):
                view.start.setdefault(rank, t)
            elif rank in view.end:
                self.anomalies["duplicate-end"] += 1
            else:
                view.end[rank] = t
                self.blocked.add(comm.job, rank, view.enter.get(rank), t)
                if not e.ok:
                    view.failed[rank] = e.error or "failed"
                self.end_counts[(rank, view.ops.get(rank) or view.op or "unknown")] += 1
                self._maybe_completed(comm, view)

    def _p2p_of(self, comm: Comm) -> CommP2P:
        if comm.p2p is None:
            comm.p2p = CommP2P(self.anomalies)
        return comm.p2p

    def _p2p(self, agent: str, comm: Comm, rank: int, e, t: float) -> None:
        comm.members.add(rank)
        table = self._p2p_of(comm)
        if isinstance(e, ev.P2P):
            table.post(rank, e, t)
        else:
            wait_at = self.clock.to_unix(agent, e.wait_ns) if e.wait_ns > 0 else None
            op = table.end(rank, e, t, wait_at)
            if op is not None:
                self.blocked.add(comm.job, rank, op.blocked_from(), t)

    def _comm(self, cid: str, rec: Optional[RankRecord], rank: int, node: str, pid: int,
              is_init: bool) -> Optional[Comm]:
        comm = self.comms.get(cid)
        if comm is None:
            if len(self.comms) >= MAX_COMMS:
                self.anomalies["comms-over-bound"] += 1
                return None
            comm = self.comms[cid] = Comm(id=cid)
        if not comm.job and rec is not None and rec.job:
            comm.job = rec.job
        prev = comm.pids.get(rank)
        if (node, pid) in comm.retired or (prev is not None and prev != (node, pid) and not is_init):
            self.anomalies["stale-pid"] += 1  # an old incarnation of a restarted rank; ignore it
            return None
        if prev is not None and prev != (node, pid):
            # The rank was restarted and rebuilt this group: sequence numbers start over.
            self.anomalies["comm-reset"] += 1
            comm = self.comms[cid] = Comm(id=cid, job=comm.job, backend=comm.backend, resets=comm.resets + 1,
                                          retired=comm.retired | set(comm.pids.values()))
        comm.pids[rank] = (node, pid)
        return comm

    def _view(self, comm: Comm, seq: int, op: str, create: bool) -> Optional[CollView]:
        view = comm.colls.get(seq)
        if view is not None or not create:
            return view
        if seq <= comm.evicted_upto:
            self.anomalies["late-event"] += 1  # its collective already fell out of the bound
            return None
        view = comm.colls[seq] = CollView(comm=comm.id, seq=seq, op=op)
        keep = min(MAX_COLLS_PER_COMM, max(MIN_COLLS_PER_COMM, MAX_RANK_ENTRIES_PER_COMM // max(1, len(comm.members))))
        while len(comm.colls) > keep:
            old, _ = comm.colls.popitem(last=False)
            comm.evicted_upto = max(comm.evicted_upto, old)
        return view

    def _enter(self, comm: Comm, rank: int, e: ev.CollEnter, t: float) -> None:
        comm.members.add(rank)
        if not comm.backend:
            comm.backend = e.backend
        view = self._view(comm, e.seq, e.op, create=True)
        if view is None:
            return
        if rank in view.enter:
            self.anomalies["duplicate-enter"] += 1
            return
        if not view.op:
            view.op = e.op
        view.enter[rank] = t
        view.ops[rank] = e.op
        if e.count >= 0 or e.dtype or e.nbytes >= 0:  # NCCL probes say count and dtype; gloo's the bytes
            view.sizes[rank] = (e.count, e.dtype, e.nbytes)
        self.enter_counts[(rank, e.op)] += 1
        last = comm.last_entered.get(rank)
        if last is None or e.seq >= last[0]:
            comm.last_entered[rank] = (e.seq, e.op, t)
        comm.max_seq = max(comm.max_seq, e.seq)

    def _maybe_completed(self, comm: Comm, view: CollView) -> None:
        if view.completed_at is not None:
            return
        expected = self.expected_members(comm.id)
        if not expected or len(view.end) < len(expected):  # cheap test first: most ends are not the last
            return
        if not expected.issubset(view.enter.keys()) or not expected.issubset(view.end.keys()):
            return
        view.completed_at = max(map(view.end.__getitem__, expected))
        comm.completed += 1
        if comm.first_done_at is None:
            comm.first_done_at = view.completed_at
        spread = view.last_enter() - view.first_enter()
        duration = max(0.0, view.completed_at - view.last_enter())
        bucket = int(view.completed_at // PEAK_BUCKET_S)
        s, d = comm.peaks.get(bucket, (0.0, 0.0))
        comm.peaks[bucket] = (max(s, spread), max(d, duration))
        while len(comm.peaks) > PEAK_BUCKETS:
            del comm.peaks[min(comm.peaks)]

    # ---- questions ------------------------------------------------------------------------------

    def expected_members(self, comm_id: str) -> FrozenSet[int]:
        """Global ranks that must take part in every collective of `comm_id`.

        The whole world of the job when the group spans it (or its size is unknown, which happens
        when we attached after the group was built) and the agents have announced enough of that world
        to believe it (at least half of it, or it is small); otherwise the ranks that announced it. A
        world no agent backs (a frame claiming 2^17 ranks, a job traced on a few of its nodes) would
        make every tick weigh ranks nobody reports.
        """
        comm = self.comms.get(comm_id)
        if comm is None:
            return frozenset()
        world = self.jobs.get(comm.job, -1) if comm.job else -1
        seen = self.job_ranks.get(comm.job, 0)
        # Asked for every WorkEnd: building range(world) each time made a collective cost O(world^2).
        key = (world, comm.group_size, len(comm.members), seen)
        if comm.expected_key != key:
            spans = world > 0 and (comm.group_size < 0 or comm.group_size == world) \
                and world <= 2 * seen + SMALL_WORLD and not comm.members_only
            comm.expected = frozenset(range(world)) if spans else frozenset(comm.members)
            comm.expected_key = key
        return comm.expected

    def global_of(self, comm: Comm, group_rank: int) -> Optional[int]:
        """The global rank of `comm`'s group rank `group_rank`: from the members' CommInits, else the
        group rank itself when the group spans the job's world (the default group), else the n-th
        smallest member (torch orders a new group's ranks); None when that cannot be told yet."""
        got = comm.global_by_group.get(group_rank)
        if got is not None:
            return got
        expected = self.expected_members(comm.id)
        world = self.jobs.get(comm.job, -1) if comm.job else -1
        if world > 0 and len(expected) == world:
            return group_rank if 0 <= group_rank < world else None
        ordered = self._ordered(comm, expected)
        return ordered[group_rank] if 0 <= group_rank < len(ordered) else None

    def _ordered(self, comm: Comm, expected: FrozenSet[int]) -> List[int]:
        if comm.ordered[0] != comm.expected_key:
            comm.ordered = (comm.expected_key, sorted(expected))
        return comm.ordered[1]

    def group_of(self, comm: Comm, rank: int) -> Optional[int]:
        """`global_of`'s inverse."""
        g = comm.group_of.get(rank)
        if g is not None:
            return g
        expected = self.expected_members(comm.id)
        world = self.jobs.get(comm.job, -1) if comm.job else -1
        if world > 0 and len(expected) == world:
            return rank
        if rank not in expected:
            return None
        return bisect.bisect_left(self._ordered(comm, expected), rank)

    def open_p2p(self, job: str, rank: int) -> Optional[Tuple[Comm, P2POp]]:
        """The newest p2p op `rank` posted and is not over, on any communicator of `job`, or None."""
        best: Optional[Tuple[Comm, P2POp]] = None
        for c in self.comms.values():
            if c.p2p is None or c.job != job:
                continue
            op = c.p2p.newest_open(rank)
            if op is not None and (best is None or op.posted > best[1].posted):
                best = (c, op)
        return best

    def recent_peaks(self, comm_id: str, now: float) -> Tuple[float, float]:
        """(max arrival spread s, max duration s) of the collectives completed in the last hour."""
        comm = self.comms.get(comm_id)
        if comm is None:
            return 0.0, 0.0
        oldest = int(now // PEAK_BUCKET_S) - PEAK_BUCKETS + 1
        got = [v for b, v in comm.peaks.items() if b >= oldest]
        return (max((s for s, _ in got), default=0.0), max((d for _, d in got), default=0.0))

    def rank_record(self, job: str, rank: int) -> Optional[RankRecord]:
        key = self.by_rank.get((job, rank))
        if key is None and not job:  # comm of unknown job: accept a unique match on the rank alone
            keys = [k for (j, r), k in self.by_rank.items() if r == rank]
            key = keys[0] if len(keys) == 1 else None
        return self.ranks.get(key) if key else None

    def agent_silent_s(self, agent: str, now: float) -> Optional[float]:
        info = self.agents.get(agent)
        return None if info is None or "last_recv" not in info else max(0.0, now - info["last_recv"])

    def agent_is_silent(self, agent: str, now: float, floor_s: float) -> bool:
        """True when the agent, which normally sends often, has sent nothing for far longer than usual:
        more than max(floor_s, 10 x its typical frame gap)."""
        info = self.agents.get(agent)
        if info is None or "last_recv" not in info or "gap_s" not in info:
            return False
        return now - info["last_recv"] > max(floor_s, 10 * info["gap_s"])

    def counters(self) -> Dict[str, Any]:
        """JSON-ready counters for stats.json and `ccld diagnose`."""
        return {"events_by_kind": dict(self.events_by_kind), "anomalies": dict(self.anomalies),
                "agent_loss": {a: dict(c) for a, c in self.agent_loss.items()},
                "clock_samples_rejected": self.clock.rejected, "clock": self.clock.summary(),
                "pending_no_clock": sum(len(q) for q in self._pending.values()),
                "agents": len(self.agents), "ranks": len(self.ranks), "comms": len(self.comms),
                "gpu": self.gpu.counters(), "nccl_alignment": self.align.counters()}
