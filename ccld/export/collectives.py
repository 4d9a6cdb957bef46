"""Collectives in the trace: a slice per rank (enter -> end), a worker slice (start -> end), one
communicator-track slice, and one flow joining the ranks of each (communicator, seq) in arrival order.

The model's input loop opens an entry in `open` at CollEnter, stamps WorkStart into it, and calls
`ended` at WorkEnd. A collective's slices wait in `groups` until every expected rank has ended, so
that the flow is written in arrival order and the last rank to arrive terminates it.
Times: Unix ns (collector timebase). Bounds: MAX_OPEN open collectives (the oldest is closed as
unfinished beyond it), MAX_GROUPS waiting groups and GROUP_WAIT_S of recorded time (written without
the missing ranks), MAX_LATE_FLOWS partially written flows a late rank may still join.
Caveat: a rank's slice is written when its collective ends, so one that never ends (a hang) is drawn
to the end of the recording, marked `unfinished`.
"""
from __future__ import annotations

import collections
import operator
import struct
from typing import TYPE_CHECKING, Any, Dict, Tuple

from ccld.export import accel
from ccld.export.gpu import slice_flow
from ccld.export.protobuf import ProtoSink
from ccld.export.tracks import Lanes, Proc
from ccld.timeline.align import per_process
from ccld.timeline.members import spans_world

if TYPE_CHECKING:
    from ccld.export.model import TraceModel

MAX_OPEN = 100_000        # collectives entered but not ended, all ranks together (a job has a few per rank)
MAX_GROUPS = 50_000       # collectives ended on some ranks, waiting for the others (for their flow)
GROUP_WAIT_S = 60.0       # ... at most this long in recorded time; then written without the missing ranks
MAX_LATE_FLOWS = 20_000   # collectives written partially, remembered so a late rank joins the same flow
_BEGIN = operator.itemgetter(0)
_NO_ROLES = (0,) * 4096  # roles of a collective without a flow (one rank alone)
_SINK_ERRORS = (TypeError, ValueError, AttributeError, OverflowError, struct.error)
_NONE: frozenset = frozenset()


class Collectives:
    def __init__(self, model: "TraceModel"):
        self.m = model
        self.worlds: Dict[str, int] = {}
        self.announced: Dict[str, set] = {}       # job -> its ranks that announced themselves (RankInfo)
        self.comm_size: Dict[str, int] = {}
        self.comm_job: Dict[str, str] = {}
        self.comm_backend: Dict[str, str] = {}
        self.comm_members: Dict[str, set] = {}
        self.subgroups: set = set()               # comms of unknown size known not to be the world
        self.per_process: set = set()             # NCCL comms named by one process's handle (align.py)
        self.expected: Dict[str, int] = {}        # comm -> ranks expected in each collective (cache)
        # (proc, comm, seq) -> [enter ts, (op, count, dtype, nbytes), start ts or 0, gpu.KEnter or None]
        self.open: Dict[Tuple[Proc, str, int], list] = {}
        self.groups: "collections.OrderedDict[Tuple[str, int], list]" = collections.OrderedDict()
        self.late_flows: "collections.OrderedDict[Tuple[str, int], int]" = collections.OrderedDict()
        self.comm_lanes: Dict[str, Lanes] = {}
        self.next_flow = 1

    def new_flow(self) -> int:
        """A flow id (collectives' and the GPU kernel links share one numbering)."""
        fid = self.next_flow
        self.next_flow += 1
        return fid

    # -- facts about jobs and communicators (from rare events)

    def note_rank(self, job: str, rank: Any, world: int) -> None:
        """A RankInfo: its job's world (the largest told) and one more rank backing it (the timeline's
        jobs and job_ranks, which members.spans_world weighs)."""
        new = False
        if world > 0 and world > self.worlds.get(job, 0):
            self.worlds[job] = world
            new = True
        if type(rank) is int and rank >= 0:
            ranks = self.announced.setdefault(job, set())
            if rank not in ranks:
                ranks.add(rank)
                new = True
        if new:
            self.expected.clear()

    def note_comm(self, comm: str, backend: str, group_size: Any, rank: int, job: str, subgroup: Any = False,
                  seq_source: Any = "") -> None:
        self.comm_backend.setdefault(comm, backend)
        if type(group_size) is int and group_size >= 0:  # as the timeline: 0 is a size, not the world's
            self.comm_size[comm] = group_size
        if subgroup is True:  # of unknown size, not the world (CommInit.subgroup): its members are those seen
            self.subgroups.add(comm)
        if per_process(backend, comm, seq_source):  # never joined here (align.py is the collector's)
            self.per_process.add(comm)
        self.comm_members.setdefault(comm, set()).add(rank)
        if job:
            self.comm_job.setdefault(comm, job)
        self.expected.pop(comm, None)

    def want(self, comm: str) -> int:
        """How many ranks each collective of `comm` waits for (the cache, else _expected)."""
        n = self.expected.get(comm)
        return self._expected(comm) if n is None else n

    def _expected(self, comm: str) -> int:
        """How many (selected) ranks take part in each collective of `comm` (the timeline's rule,
        members.spans_world: the job's world, else the members its CommInits announced); 0 when unknown."""
        ranks = self.m.ranks
        job = self.comm_job.get(comm, "")
        world = self.worlds.get(job, -1) if job else -1
        if spans_world(world, self.comm_size.get(comm, -1), comm in self.subgroups,
                       len(self.announced.get(job, _NONE)), comm in self.per_process):
            n = world if ranks is None else sum(1 for r in ranks if r < world)
        else:
            seen = self.comm_members.get(comm, _NONE)
            n = len(seen) if ranks is None else len(ranks & seen)
        self.expected[comm] = n
        return n

    def _comm_lanes(self, comm: str) -> Lanes:
        lanes = self.comm_lanes.get(comm)
        if lanes is None:
            m = self.m
            if m.root_comms is None:
                m.root_comms = m.new_track(None, "communicators", child_order=1, description=
                                           "one track per communicator: each collective from "
                                           "its first rank's enter to its last rank's end")
            backend = self.comm_backend.get(comm, "")
            lanes = self.comm_lanes[comm] = Lanes(m, m.root_comms, comm + (f" ({backend})" if backend else ""), 0)
        return lanes

    # -- one rank's collective ended

    def ended(self, p: Proc, comm: str, seq: int, o: list, end: int, ok: Any, error: Any,
              unfinished: bool) -> None:
        """Rank `p` ended (comm, seq) at `end`; its slices are written with the group's (flush_group)."""
        if end < o[0]:
            end = o[0]  # a wall-clock step between enter and end; never draw a negative slice
        gk = (comm, seq)
        groups = self.groups
        g = groups.get(gk)
        if g is None:
            g = groups[gk] = [self.m.max_ts, []]
            if comm not in self.comm_job and p.job:
                self.comm_job[comm] = p.job
        items = g[1]
        items.append((o[0], end, p, o, ok, error, unfinished))
        want = self.want(comm)
        if want and len(items) >= want:
            del groups[gk]
            self.flush_group(gk, items, True)
        elif len(groups) > MAX_GROUPS:
            k, old = groups.popitem(last=False)
            self.flush_group(k, old[1], False)

    def flush_group(self, gk: Tuple[str, int], items: list, complete: bool) -> None:
        """Write one collective's slices, in arrival order, joined by one flow: per rank its `calls`
        slice (enter -> end) and its `worker` slice (start -> end), then one on the communicator's track."""
        m = self.m
        items.sort(key=_BEGIN)
        t_from, t_to = m.t_from, m.t_to
        if m.windowed:
            items = [it for it in items if it[1] >= t_from and it[0] <= t_to]
            if not items:
                return
        comm, seq = gk
        fid = self.late_flows.pop(gk, 0) if self.late_flows else 0
        late = fid != 0
        n = len(items)
        if not fid and (n > 1 or not complete):
            fid = self.new_flow()
            m.stats["flows"] += 1
        if not complete and fid:
            self.late_flows[gk] = fid
            if len(self.late_flows) > MAX_LATE_FLOWS:
                self.late_flows.popitem(last=False)
        # flow roles: s starts it, t continues, f (terminating) on the last rank to arrive
        if fid:
            roles = ["t"] * n
            if not late:
                roles[0] = "s"
            if complete and (n > 1 or late):
                roles[-1] = "f"
        else:
            roles = _NO_ROLES if n <= len(_NO_ROLES) else [0] * n
        sink = m.sink
        if accel.hot is not None:  # the loop below, in C
            end, written, nunf, bad = accel.hot.ranks(m, sink, type(sink) is ProtoSink, items, roles, seq, comm, fid,
                                                      t_to, _SINK_ERRORS, self.new_flow, slice_flow)
            if bad:
                m.stats["bad_events"] += bad
        else:
            end, written, nunf = self._ranks(items, roles, seq, comm, fid)
        m.stats["slices"] += written
        first, last = items[0], items[-1]
        lanes = self.comm_lanes.get(comm) or self._comm_lanes(comm)
        t = lanes.pick(first[0], end)
        if not t.declared:
            m.declare(t)
        try:
            sink.comm(t, first[0], end, first[3][1][0], seq, comm, n, first[2].rank, last[2].rank,
                      (last[0] - first[0]) // 1000, not complete, nunf)
            m.stats["slices"] += 1
        except _SINK_ERRORS:
            m.stats["bad_events"] += 1

    def _ranks(self, items: list, roles: Any, seq: int, comm: str, fid: int) -> Tuple[int, int, int]:
        """flush_group's per-rank loop (accel.hot.ranks is the same in C): each rank's `calls` and
        `worker` slices; returns (the last end, slices written, unfinished ranks)."""
        m = self.m
        sink, t_to = m.sink, m.t_to
        rank = sink.rank
        new_flow = self.new_flow
        end = written = 0
        g = None  # the (op, count, dtype, nbytes) the sink's group() has now
        nunf = 0
        for (b, e, p, o, ok, error, unfinished), role in zip(items, roles):
            if e > end:
                end = e
            if unfinished:
                nunf += 1
            if p.track is None:
                m.proc_track(p)
            a = o[1]  # (op, count, dtype, nbytes): one collective's ranks share them, unless it is inconsistent
            if a is not g and a != g:
                g = a
                try:
                    sink.group(a[0], seq, comm, a[1], a[2], a[3], fid)
                except _SINK_ERRORS:
                    m.stats["bad_events"] += 1
                    g = None
                    continue
            lanes = p.calls.tracks  # Lanes.pick, inline: the first lane is free but for overlapping calls
            tc = lanes[0] if lanes else None
            if tc is not None and tc.last_ts <= b:
                tc.last_ts = e
            else:
                tc = p.calls.pick(b, e)
                if not tc.declared:
                    m.declare(tc)
            start = o[2]
            if start and start <= t_to:
                start = b if start < b else e if start > e else start
                lanes = p.worker.tracks
                tw = lanes[0] if lanes else None
                if tw is not None and tw.last_ts <= start:
                    tw.last_ts = e
                else:
                    tw = p.worker.pick(start, e)
                    if not tw.declared:
                        m.declare(tw)
            else:
                tw = None
            ke = o[3]  # an NCCL rank with CUPTI: the flow to its kernel (gpu.py)
            try:
                rank(tc, tw, b, start, e, ok, error, unfinished, role,
                     slice_flow(p, ke, new_flow) if ke is not None else 0)
                written += 1 if tw is None else 2
            except _SINK_ERRORS:
                m.stats["bad_events"] += 1
        return end, written, nunf

    def evict_open(self, now: int) -> None:
        key = next(iter(self.open))
        o = self.open.pop(key)
        self.m.anomalies["open-evicted"] += 1  # over MAX_OPEN: its end was lost, or it is a very long wait
        self.ended(key[0], key[1], key[2], o, now, False, "no end seen (over MAX_OPEN open collectives)", True)

    def flush_waiting(self, horizon: int) -> None:
        """Write the groups that waited since before `horizon` without their missing ranks."""
        groups = self.groups
        while groups:
            gk = next(iter(groups))
            if groups[gk][0] > horizon:
                break
            self.flush_group(gk, groups.pop(gk)[1], False)

    def finish(self, end: int) -> None:
        """End of the store: what is open is drawn up to `end`; every waiting group is written."""
        while self.open:
            key, o = self.open.popitem()
            self.ended(key[0], key[1], key[2], o, end, False, "no end seen before the recording stopped", True)
        for gk in list(self.groups):
            items = self.groups.pop(gk)[1]
            self.flush_group(gk, items, len(items) >= (self.want(gk[0]) or 1 << 30))
