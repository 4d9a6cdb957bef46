"""The timeline: events of all agents joined into ranks, communicators and collectives.

A collective is identified across ranks by (communicator, seq); for each one the timeline keeps
every rank's enter/start/end time. Times: every time here is Unix seconds (float), converted from
the event's node-monotonic `ts_ns` by `ClockTable.to_unix`, keyed by the batch's agent; `recv_unix`
is only used for how long an agent has been silent.

Bounds: MAX_RANKS processes, MAX_PENDING_NO_CLOCK events waiting for their agent's first clock
sample; per communicator, comms.py's (MAX_COLLS_PER_COMM collectives, MAX_COMMS communicators).
Whatever falls outside a bound, and every odd event (end without enter, unknown pid, duplicate),
is counted in `anomalies`, never fatal. Not thread-safe: the caller serialises ingest and reads.
Caveat: a communicator whose group size is unknown (attached after init) is assumed to span its
job's whole world, except one its CommInit marks a subgroup (its members: the ranks seen in it) and
an NCCL one named by one process's handle: align.py joins those across ranks, by their op streams
and enter times, and rewrites their events at ingest.
Here: the ingest of one or several frames, each event dispatched by kind, and the questions the
analyses ask. The records are records.py's; every collective enter, start and end (a column block's
rows, or one event) is gathered and applied as rows by collrows.py, the other communicator events one
at a time by comms.py.
"""
from __future__ import annotations

import bisect
import collections
from typing import Any, Deque, Dict, FrozenSet, List, Optional, Set, Tuple

from ccld import wire as ev
from ccld.timeline.align import Aligner
from ccld.timeline.blocked import BlockedTable
from ccld.timeline.clock import ClockTable
from ccld.timeline.collrows import Rows
from ccld.timeline.colltable import CollStore
from ccld.timeline.comms import MAX_COMMS, PEAK_BUCKET_S, PEAK_BUCKETS, rank_event
from ccld.timeline.compute import ComputeTable
from ccld.timeline.gpu import GPU_EVENTS, GpuJoin
from ccld.timeline.links import LinkTable
from ccld.timeline.members import spans_world
from ccld.timeline.netprog import ProgressTable
from ccld.timeline.p2p import P2POp
from ccld.timeline.rdma import RdmaTable
from ccld.timeline.records import Comm, RankRecord
from ccld.wire.blocks import Block, frame_order
from ccld.wire.table import Table

MAX_RANKS = 100_000           # processes per collector
MAX_WORLD_SIZE = 1 << 17      # 131,072 ranks: above the largest jobs run today; a bigger value is a corrupt event
FLUSH_ROWS = 16_384           # collective rows gathered before they are applied, at most (and one frame's)
MAX_PENDING_NO_CLOCK = 100_000  # events held until their agent's first clock sample (sent every batch)
LAG_MIN_SCANS = 3             # an agent's RankStates are its data horizon once they came from this many scans
LAG_PERIODS = 3.0             # ... and it is lagging when none came for this many of its scan periods

_RANK_EVENTS = (ev.RankState, ev.RankExit, ev.CommInit, ev.P2P, ev.P2PEnd)  # applied by comms.rank_event
ROW_KINDS = frozenset({"coll", "start", "end"})  # gathered as rows (collrows.py)
# Kinds that cannot change how gathered rows apply (who is which rank, which communicator, a kernel
# joined to a collective): the others flush the rows gathered before them.
NEUTRAL = frozenset({"clock", "clock_sync", "proc", "link", "sched", "loss", "net_progress", "compute",
                     "qp", "nic", "probe", "hello", "rank_exit"})


class Timeline:
    def __init__(self) -> None:
        self.clock = ClockTable()
        self.ranks: Dict[Tuple[str, int], RankRecord] = {}
        self.by_rank: Dict[Tuple[str, int], Tuple[str, int]] = {}   # (job, global rank) -> (node, pid)
        self.jobs_of_rank: Dict[int, Set[str]] = {}                 # global rank -> the jobs that have it
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
        self.store = CollStore()  # every communicator's collectives as arrays (colltable.py)
        self.p2p_counts: collections.Counter = collections.Counter()
        self.rows = Rows(self)
        self._node_codes: Dict[str, int] = {}
        self._node_names: List[str] = []
        self._pending: Dict[str, Deque[Tuple[str, ev.Event]]] = {}
        self.last_recv: Optional[float] = None
        self._recv_prev: Optional[float] = None  # the last frame's receive time, and the forward-only sum
        self._recv_s = 0.0                      # of the steps between them (clock.arrived)

    # ---- ingest ---------------------------------------------------------------------------------

    def ingest(self, batch: ev.Batch, recv_unix: float) -> None:
        """One frame."""
        self.ingest_many([(batch, recv_unix)])

    def ingest_many(self, frames: List[Tuple[ev.Batch, float]]) -> None:
        """Frames in the order they arrived, their collective rows applied together (collrows.py)."""
        for batch, recv_unix in frames:
            self._frame(batch, recv_unix)
            if self.rows.n >= FLUSH_ROWS:
                self.rows.flush()  # between frames: a frame's enters and ends apply together
        self.rows.flush()
        if self.align.waiting:
            self.align.tick(self._recv_s)

    def _frame(self, batch: ev.Batch, recv_unix: float) -> None:
        agent = batch.agent
        info = self.agents.setdefault(agent, {"node": batch.node, "last_batch": 0, "frames": 0})
        prev = info.get("last_recv")
        if prev is not None and recv_unix >= prev:
            # Typical gap between this agent's frames (EWMA): a live agent sends every 0.5 s, so it
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
        plain, blocks = batch.plain, batch.parts
        if batch.node in self.align.nodes:  # its NCCL calls seen after the attach are aligned (align.py)
            plain, blocks = self.align.rewrite(plain, batch.blocks)
        for e in frame_order(plain, blocks):  # a block's rows are gathered (collrows.py): ordered there
            t = type(e)
            if t is Table:
                self._table(agent, batch.node, e)
            elif t is Block:
                self._block(agent, batch.node, e)
            else:
                self._event(agent, batch.node, e)

    def _event(self, agent: str, node: str, e: ev.Event) -> None:
        self.events_by_kind[e.KIND] += 1
        if isinstance(e, (ev.ClockSample, ev.ClockSync)):
            if self.clock.update_event(agent, e):
                self._drain_pending(agent)
            else:
                self.anomalies["bad-clock-sample"] += 1
        elif self.clock.has(agent):
            self._apply(agent, node, e)
        else:
            self._hold(agent, node, e)

    def _hold(self, agent: str, node: str, e: ev.Event) -> None:
        """An event held until its agent's first clock sample."""
        q = self._pending.setdefault(agent, collections.deque())
        if len(q) >= MAX_PENDING_NO_CLOCK:
            self.anomalies["no-clock-dropped"] += 1
        else:
            q.append((node, e))

    def _block(self, agent: str, node: str, b: Block) -> None:
        if b.kind not in ROW_KINDS or not self.clock.has(agent):  # any kind may come as a block; rows
            for e in b.rows():                                     # need their agent's clock (held till then)
                self._event(agent, node, e)
            return
        self.events_by_kind[b.kind] += b.n
        self.rows.block(agent, node, b)

    def _table(self, agent: str, node: str, t: Table) -> None:
        """A table's rows gathered at once; as its groups' blocks where a block would take another way
        (no clock yet, NCCL enters the kernel join wants, a kind not gathered as rows)."""
        if not self.clock.has(agent) or any(g[0] not in ROW_KINDS or (
                self.gpu.capture and g[0] == "coll" and g[4].get("backend") == "nccl") for g in t.groups):
            for b in t.blocks():
                self._block(agent, node, b)
            return
        kinds = self.events_by_kind
        for g in t.groups:
            kinds[g[0]] += g[2]
        self.rows.table(agent, node, t)

    def _drain_pending(self, agent: str) -> None:
        q = self._pending.pop(agent, None)
        while q:
            node, e = q.popleft()
            self._apply(agent, node, e)

    def _apply(self, agent: str, node: str, e: ev.Event) -> None:
        kind = e.KIND
        if kind in ROW_KINDS:
            self.rows.event(agent, node, e)
            return
        if kind not in NEUTRAL and self.rows.n:
            self.rows.flush()  # it may say who is who: the rows before it apply first
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
            rank_event(self, agent, node, e, t)
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
            self.jobs_of_rank.setdefault(e.rank, set()).add(e.job)
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

    # ---- questions ------------------------------------------------------------------------------

    def node_code(self, node: str) -> int:
        code = self._node_codes.get(node)
        if code is None:
            code = self._node_codes[node] = len(self._node_names)
            self._node_names.append(node)
        return code

    def node_name(self, code: int) -> str:
        return self._node_names[code]

    @property
    def enter_counts(self) -> collections.Counter:
        """(global rank, op) -> collectives entered, all jobs together (tests and sanity checks)."""
        return self._counts("enter")

    @property
    def end_counts(self) -> collections.Counter:
        """(global rank, op) -> collectives ended."""
        return self._counts("end")

    def _counts(self, which: str) -> collections.Counter:
        out: collections.Counter = collections.Counter()
        for key, n in self.store.op_counts(which):  # a rank has a cell per communicator it is in
            out[key] += n
        return out

    def expected_members(self, comm_id: str) -> FrozenSet[int]:
        """Global ranks that must take part in every collective of `comm_id`.

        The whole world of the job when the group spans it (or its size is unknown, which happens
        when we attached after the group was built, and no CommInit said it is a subgroup: pgnccl
        marks PyTorch's non-default groups so) and the agents have announced enough of that world
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
        key = (world, comm.group_size, len(comm.members), seen, comm.members_only, comm.dropped, comm.subgroup)
        if comm.expected_key != key:
            # members.spans_world: the one rule (the export asks it too). The world's set is kept while
            # the world holds, so caches keyed on it stay valid.
            if spans_world(world, comm.group_size, comm.subgroup, seen, comm.members_only):
                if comm.expected_world != world:
                    comm.expected, comm.expected_world = frozenset(range(world)), world
            else:
                comm.expected, comm.expected_world = frozenset(comm.members), -1
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
            jobs = self.jobs_of_rank.get(rank, ())
            key = self.by_rank.get((next(iter(jobs)), rank)) if len(jobs) == 1 else None
        return self.ranks.get(key) if key else None

    def agent_silent_s(self, agent: str, now: float) -> Optional[float]:
        info = self.agents.get(agent)
        return None if info is None or "last_recv" not in info else max(0.0, now - info["last_recv"])

    def agent_lag_s(self, agent: str, now: float) -> Optional[float]:
        """How far behind `now` the agent's data is known complete: its agent ships each rank's /proc
        state every second, after the ring-buffer drain before it (tracer/agent.py), so the latest
        RankState's time says up to when that agent's probe records are in. None when it sent none."""
        info = self.agents.get(agent)
        at = None if info is None else info.get("state_at")
        return None if at is None else max(0.0, now - at)

    def agent_is_lagging(self, agent: str, now: float, floor_s: float) -> bool:
        """True when the agent, which has shown a cadence of RankStates (LAG_MIN_SCANS scans), sent
        none for more than max(floor_s, LAG_PERIODS x its scan period) while frames may still come (its
        shipper's heartbeats are another thread): its drains stalled, or it, the node or this collector
        was frozen, and what its ranks did since is not in yet. A source with no such cadence (a
        synthetic or imported one) is never lagging, nor an agent whose ranks have all exited."""
        info = self.agents.get(agent)
        if info is None or info.get("state_scans", 0) < LAG_MIN_SCANS or "state_period_s" not in info:
            return False
        if now - info["state_at"] <= max(floor_s, LAG_PERIODS * info["state_period_s"]):
            return False
        # No RankState is due from an agent whose ranks all exited (a job that ended): looked up once
        # per stale horizon, O(ranks), and remembered until a RankState moves it.
        if info.get("idle_at") == info["state_at"]:
            return False
        if not any(r.agent == agent and not r.exited() for r in self.ranks.values()):
            info["idle_at"] = info["state_at"]
            return False
        return True

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

