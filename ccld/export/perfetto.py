"""Export a store as a Perfetto trace (TrackEvent protobuf), streamed: one pass, flat memory.

What the trace holds. A process track per traced process, "rank R (node, pid P)", with children:
`calls` (a slice per collective, CollEnter -> WorkEnd; args op, seq, comm, count/dtype/nbytes when
known, ok), `worker` (WorkStart -> WorkEnd, the library's own thread), `p2p` (send/recv instants),
`state` (exit and stopped/zombie/disk-wait instants) and `findings` (per finding that blames the
rank: a slice onset -> detected and an instant at onset). A `communicators` group has one track
per communicator (first enter -> last end of each collective), and a `ccld` group the agents'
loss counters and clock offsets. A flow joins the slices of one collective (communicator, seq)
across ranks in arrival order; the last rank to arrive terminates it.
Times: Unix ns in the collector's timebase: an event's ts_ns (its node's CLOCK_MONOTONIC) plus the
offset (wall - mono) of its agent's latest ClockSample, kept in a collector.clock.ClockTable, the
same rule as the live timeline (events before an agent's first sample wait for it). The trace opens
with a clock snapshot (REALTIME = BOOTTIME) so viewers can show wall-clock times.
Memory: frames are read one segment at a time and processed in order; only bounded state is held
(MAX_OPEN open collectives, MAX_GROUPS collectives waiting for their last rank, a REORDER_S window
for instants and counters), so memory does not grow with the store.
Caveats: a rank's slice is written when its collective ends, so one that never ends (a hang) is
drawn up to the end of the recording with `unfinished`; slices that overlap without nesting (async
collectives) go to extra lanes ("calls 2") so every track stays properly nested and ordered.
"""
from __future__ import annotations

import collections
import heapq
import json
import operator
import os
import struct
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import msgpack

from ccld.collector.clock import ClockTable
from ccld.collector.store import list_segments, read_meta, read_store
from ccld.events import SCHEMA_MAJOR
from ccld.errors import CcldError

MAX_OPEN = 100_000        # collectives entered but not ended, all ranks together (a job has a few per rank)
MAX_GROUPS = 50_000       # collectives ended on some ranks, waiting for the others (for their flow)
GROUP_WAIT_S = 60.0       # ... at most this long in recorded time; then written without the missing ranks
MAX_LATE_FLOWS = 20_000   # collectives written partially, remembered so a late rank joins the same flow
REORDER_S = 1.0           # instants and counters are sorted within this window of recorded time
REORDER_MAX = 100_000     # ... holding at most this many
MAX_PENDING_NO_CLOCK = 100_000  # events held until their agent's first clock sample (as the timeline does)
PROGRESS_EVERY_S = 1.0
ABNORMAL_STATES = {"T": "stopped", "t": "tracing stop", "Z": "zombie", "X": "dead", "D": "disk sleep"}
TIMEBASE = ("Unix ns (collector timebase): each event's CLOCK_MONOTONIC ts_ns on its node plus the "
            "offset wall-mono of its agent's latest clock sample")
_BEGIN = operator.itemgetter(0)
_RARE_KINDS = frozenset(("rank", "comm", "p2p", "proc", "rank_exit", "loss", "hello", "probe"))


class ExportError(CcldError):
    """The trace cannot be written (output not writable, bad window or rank list)."""


# ---- tracks and lanes -------------------------------------------------------------------------------

class Track:
    """One output track. kind: process | thread | track | counter. `last_ts` keeps per-track order."""
    __slots__ = ("uuid", "parent", "name", "kind", "pid", "tid", "order", "child_order", "description",
                 "last_ts", "declared", "out")

    def __init__(self, uuid: int, parent: Optional["Track"], name: str, kind: str = "track",
                 pid: int = 0, tid: int = 0, order: Optional[int] = None, child_order: int = 0,
                 description: str = ""):
        self.uuid, self.parent, self.name, self.kind = uuid, parent, name, kind
        self.pid, self.tid, self.order, self.child_order = pid, tid, order, child_order
        self.description = description
        self.last_ts = -(1 << 62)
        self.declared = False
        self.out = None  # the sink's own data for this track (cached bytes, chrome pid/tid)


class Lanes:
    """Tracks for slices that may overlap: each slice goes to the first lane free at its begin, so
    every lane holds non-overlapping slices in begin order (balanced and ordered by construction)."""
    __slots__ = ("model", "parent", "name", "order", "tracks", "first_kind", "tid")

    def __init__(self, model: "TraceModel", parent: Track, name: str, order: int,
                 first_kind: str = "track", tid: int = 0):
        self.model, self.parent, self.name, self.order = model, parent, name, order
        self.first_kind, self.tid = first_kind, tid
        self.tracks: List[Track] = []

    def pick(self, begin: int, end: int) -> Track:
        for t in self.tracks:
            if t.last_ts <= begin:
                t.last_ts = end
                return t
        n = len(self.tracks)
        if n == 0 and self.first_kind == "thread":
            t = self.model.new_track(self.parent, self.name, "thread", pid=self.parent.pid, tid=self.tid,
                                     order=self.order * 100)
        else:
            t = self.model.new_track(self.parent, self.name if n == 0 else f"{self.name} {n + 1}",
                                     order=self.order * 100 + n)
            if n:
                self.model.stats["extra_lanes"] += 1
        self.tracks.append(t)
        t.last_ts = end
        return t


class Proc:
    """A traced process (node, pid) and its tracks, made when first needed."""
    __slots__ = ("node", "pid", "rank", "job", "world", "skip", "track", "calls", "worker", "p2p",
                 "state", "findings", "state_letter")

    def __init__(self, node: str, pid: int, rank: int, skip: bool):
        self.node, self.pid, self.rank, self.skip = node, pid, rank, skip
        self.job, self.world = "", -1
        self.track = self.calls = self.worker = self.p2p = self.state = self.findings = None
        self.state_letter = ""


# ---- the model: events in, tracks/slices/flows out --------------------------------------------------

class TraceModel:
    """Turns a store's frames into calls on a sink (ProtoSink here, chrome.ChromeSink for JSON)."""

    def __init__(self, sink, t_from_ns: Optional[int] = None, t_to_ns: Optional[int] = None,
                 ranks: Optional[Iterable[int]] = None):
        self.sink = sink
        self.t_from = -(1 << 62) if t_from_ns is None else t_from_ns
        self.t_to = 1 << 62 if t_to_ns is None else t_to_ns
        self.windowed = t_from_ns is not None or t_to_ns is not None
        self.ranks = None if ranks is None else frozenset(ranks)
        self.clock = ClockTable()
        self.offsets: Dict[str, int] = {}       # agent -> offset_ns of its latest ClockSample
        self.pending: Dict[str, collections.deque] = {}
        self.procs: Dict[str, Dict[int, Proc]] = {}   # node -> pid -> Proc
        self.by_rank: Dict[Tuple[str, int], List[Tuple[int, Proc]]] = {}  # (job, rank) -> [(first ts, proc)]
        self.worlds: Dict[str, int] = {}
        self.comm_size: Dict[str, int] = {}
        self.comm_job: Dict[str, str] = {}
        self.comm_backend: Dict[str, str] = {}
        self.comm_members: Dict[str, set] = {}
        self.expected: Dict[str, int] = {}        # comm -> ranks expected in each collective (cache)
        self.open: Dict[Tuple[Proc, str, int], list] = {}
        self.groups: "collections.OrderedDict[Tuple[str, int], list]" = collections.OrderedDict()
        self.late_flows: "collections.OrderedDict[Tuple[str, int], int]" = collections.OrderedDict()
        self.comm_lanes: Dict[str, Lanes] = {}
        self.counter_tracks: Dict[Tuple[str, str], Track] = {}
        self.heap: List[tuple] = []
        self.heap_n = 0
        self.max_ts = -(1 << 62)
        self.next_uuid = 1
        self.next_flow = 1
        self.used_pids: set = set()
        self.stats = collections.Counter()
        self.anomalies = collections.Counter()
        self.frames_rejected = collections.Counter()
        self.root_comms: Optional[Track] = None
        self.root_ccld: Optional[Track] = None
        self.clock_track: Optional[Track] = None

    # -- tracks

    def new_track(self, parent: Optional[Track], name: str, kind: str = "track", **kw) -> Track:
        t = Track(self.next_uuid, parent, name, kind, **kw)
        self.next_uuid += 1
        return t

    def declare(self, t: Track) -> None:
        if t.parent is not None and not t.parent.declared:
            self.declare(t.parent)
        t.declared = True
        self.stats["tracks"] += 1
        self.sink.declare(t)

    def proc_track(self, p: Proc) -> Track:
        if p.track is None:
            pid = p.pid
            while pid in self.used_pids or pid <= 0:  # same pid on two nodes: Perfetto would merge them
                pid += 1 << 22                          # above Linux's pid_max; the name keeps the real pid
            self.used_pids.add(pid)
            who = f"rank {p.rank}" if p.rank >= 0 else "unknown rank"
            name = f"{who} ({p.node}, pid {p.pid})" if p.pid > 0 else f"{who} (not seen by any agent)"
            p.track = self.new_track(None, name, "process", pid=pid,
                                     order=p.rank, child_order=3)
            p.calls = Lanes(self, p.track, "calls", 1, first_kind="thread", tid=pid)  # the rank's main thread
            p.worker = Lanes(self, p.track, "worker", 2)
            p.findings = Lanes(self, p.track, "findings", 0)
        return p.track

    def _instant_track(self, p: Proc, attr: str, name: str, order: int) -> Track:
        t = getattr(p, attr)
        if t is None:
            t = self.new_track(self.proc_track(p), name, order=order)
            setattr(p, attr, t)
        return t

    def _root_ccld(self) -> Track:
        if self.root_ccld is None:
            self.root_ccld = self.new_track(None, "ccld", child_order=1, description=
                                            "ccld itself: agents' loss counters and clock offsets. "
                                            "Timestamps: " + TIMEBASE)
        return self.root_ccld

    def _comm_lanes(self, comm: str) -> Lanes:
        lanes = self.comm_lanes.get(comm)
        if lanes is None:
            if self.root_comms is None:
                self.root_comms = self.new_track(None, "communicators", child_order=1, description=
                                                 "one track per communicator: each collective from "
                                                 "its first rank's enter to its last rank's end")
            backend = self.comm_backend.get(comm, "")
            lanes = self.comm_lanes[comm] = Lanes(self, self.root_comms,
                                                  comm + (f" ({backend})" if backend else ""), 0)
        return lanes

    def _proc(self, node: str, pid: int, rank: int) -> Proc:
        p = Proc(node, pid, rank, skip=self.ranks is not None and rank not in self.ranks)
        self.procs.setdefault(node, {})[pid] = p
        return p

    # -- input

    def feed(self, frame: bytes) -> None:
        """One stored frame. Bad frames and events are counted, never fatal (as in the collector)."""
        try:
            env = msgpack.unpackb(frame, raw=False, strict_map_key=False)
        except Exception:
            self.frames_rejected["not-msgpack"] += 1
            return
        if type(env) is not dict:
            self.frames_rejected["bad-envelope"] += 1
            return
        v = env.get("v")
        if type(v) not in (list, tuple) or len(v) != 2 or v[0] != SCHEMA_MAJOR:
            self.frames_rejected["version"] += 1
            return
        agent, node, evs = env.get("agent"), env.get("node"), env.get("events")
        if type(agent) is not str or type(node) is not str or type(evs) is not list:
            self.frames_rejected["bad-envelope"] += 1
            return
        self.stats["frames"] += 1
        self.stats["events"] += len(evs)
        self.events(agent, node, evs)
        self.housekeeping()

    def events(self, agent: str, node: str, evs: list) -> None:
        off = self.offsets.get(agent)
        procs = self.procs.get(node)
        if procs is None:
            procs = self.procs[node] = {}
        open_ = self.open
        max_ts = self.max_ts
        for e in evs:
            try:
                k = e["k"]
                if off is None and k != "clock":
                    q = self.pending.setdefault(agent, collections.deque())
                    if len(q) >= MAX_PENDING_NO_CLOCK:
                        self.anomalies["no-clock-dropped"] += 1
                    else:
                        q.append(e)
                    continue
                if k == "coll":
                    pid = e["pid"]
                    p = procs.get(pid)
                    if p is None:
                        p = self._proc(node, pid, e["rank"])
                    if p.skip:
                        continue
                    ts = e["ts_ns"]
                    if type(ts) is not int:
                        raise TypeError("ts_ns")
                    ts += off  # node CLOCK_MONOTONIC -> collector Unix ns (ClockTable's offset)
                    key = (p, e["comm"], e["seq"])
                    if key in open_:
                        self.anomalies["duplicate-enter"] += 1
                        continue
                    open_[key] = [ts, e["op"], e.get("count", -1), e.get("dtype", ""), e.get("nbytes", -1), 0]
                    if ts > max_ts:
                        max_ts = ts
                    if len(open_) > MAX_OPEN:
                        self._evict_open(max_ts)
                elif k == "end":
                    pid = e["pid"]
                    p = procs.get(pid)
                    if p is None:
                        p = self._proc(node, pid, e["rank"])
                    if p.skip:
                        continue
                    ts = e["ts_ns"]
                    if type(ts) is not int:
                        raise TypeError("ts_ns")
                    ts += off
                    if ts > max_ts:
                        max_ts = ts
                    comm, seq = e["comm"], e["seq"]
                    o = open_.pop((p, comm, seq), None)
                    if o is None:
                        self.anomalies["end-without-enter"] += 1
                        continue
                    self.ended(p, comm, seq, o, ts, e.get("ok", True), e.get("error", ""), False)
                elif k == "start":
                    p = procs.get(e["pid"])
                    if p is None or p.skip:
                        continue
                    ts = e["ts_ns"]
                    if type(ts) is not int:
                        raise TypeError("ts_ns")
                    o = open_.get((p, e["comm"], e["seq"]))
                    if o is None:
                        self.anomalies["start-without-enter"] += 1
                    else:
                        o[5] = ts + off
                elif k == "clock":
                    if self.clock.update(agent, e["mono_ns"], e["wall_ns"]):
                        first = off is None
                        off = self.offsets[agent] = self.clock.offset(agent).offset_ns
                        if first:
                            self.max_ts = max_ts
                            self._first_clock(agent, node, e["wall_ns"])
                            q = self.pending.pop(agent, None)
                            if q:
                                self.events(agent, node, list(q))
                            max_ts = self.max_ts
                    else:
                        self.anomalies["bad-clock-sample"] += 1
                else:
                    self.max_ts = max_ts
                    self.rare(agent, node, procs, k, e, off)
                    max_ts = self.max_ts
            except (KeyError, TypeError, ValueError, AttributeError, IndexError):
                self.stats["bad_events"] += 1
        self.max_ts = max_ts

    def rare(self, agent: str, node: str, procs: Dict[int, Proc], k: str, e: dict, off: int) -> None:
        """Everything but the per-collective events: process and communicator facts, p2p, losses."""
        if k not in _RARE_KINDS:
            if type(k) is not str:
                raise TypeError("event kind")
            self.stats["skipped_events"] += 1  # a kind newer than this exporter
            return
        ts = e["ts_ns"]
        if type(ts) is not int:
            raise TypeError("ts_ns")
        ts += off
        if ts > self.max_ts:
            self.max_ts = ts
        if k == "rank":
            pid, rank = e["pid"], e["rank"]
            p = procs.get(pid)
            if p is None:
                p = self._proc(node, pid, rank)
            elif p.rank != rank and p.track is None:
                p.rank, p.skip = rank, self.ranks is not None and rank not in self.ranks
            job, world = e["job"], e["world_size"]
            if p.job != job or p.world != world:
                p.job, p.world = job, world
                if world > 0:
                    self.worlds[job] = max(self.worlds.get(job, 0), world)
                    self.expected.clear()
                lst = self.by_rank.setdefault((job, rank), [])
                if not any(q is p for _, q in lst):
                    lst.append((ts, p))
        elif k == "comm":
            comm, gs = e["comm"], e["group_size"]
            self.comm_backend.setdefault(comm, e.get("backend", ""))
            if type(gs) is int and gs > 0:
                self.comm_size[comm] = gs
            self.comm_members.setdefault(comm, set()).add(e["rank"])
            p = procs.get(e["pid"])
            if p is not None and p.job:
                self.comm_job.setdefault(comm, p.job)
            self.expected.pop(comm, None)
        elif k == "p2p":
            p = procs.get(e["pid"]) or self._proc(node, e["pid"], e["rank"])
            if not p.skip and self.t_from <= ts <= self.t_to:
                args = [("peer", e["peer"]), ("comm", e["comm"]), ("tag", e.get("tag", 0))]
                if e.get("count", -1) >= 0:
                    args.append(("count", e["count"]))
                if e.get("dtype"):
                    args.append(("dtype", e["dtype"]))
                self.later(ts, self._instant_track(p, "p2p", "p2p", 300), "i", f"{e['op']} {e['peer']}", args)
        elif k == "proc":
            p = procs.get(e["pid"])
            if p is None or p.skip:
                return
            letter = e["state"]
            was, now = ABNORMAL_STATES.get(p.state_letter), ABNORMAL_STATES.get(letter)
            if (was or now) and was != now and self.t_from <= ts <= self.t_to:
                name = f"state {letter} ({now})" if now else f"state {letter} (back from {p.state_letter})"
                self.later(ts, self._instant_track(p, "state", "state", 400), "i", name,
                           [("state", letter), ("wchan", e.get("wchan", ""))])
            p.state_letter = letter
        elif k == "rank_exit":
            p = procs.get(e["pid"])
            if p is not None and not p.skip and self.t_from <= ts <= self.t_to:
                self.later(ts, self._instant_track(p, "state", "state", 400), "i",
                           f"exit ({e.get('reason', 'exited')})", [])
        elif k == "loss":
            for name, value in sorted(e["counters"].items()):
                self.counter(agent, str(name), ts, value)
        # hello, probe: who is sending and what is attached; for `ccld diagnose`, not for a timeline

    def counter(self, scope: str, name: str, ts: int, value: Any) -> None:
        """A counter sample on track `scope name` under `ccld` (losses now; link metrics later)."""
        if not (self.t_from <= ts <= self.t_to) or type(value) not in (int, float):
            return
        t = self.counter_tracks.get((scope, name))
        if t is None:
            t = self.counter_tracks[(scope, name)] = self.new_track(self._root_ccld(), f"{scope} {name}",
                                                                    "counter")
        self.later(ts, t, "c", name, value)

    def _first_clock(self, agent: str, node: str, wall_ns: int) -> None:
        if self.clock_track is None:
            self.clock_track = self.new_track(self._root_ccld(), "clock offsets", order=0)
        off = self.offsets[agent]
        if self.t_from <= wall_ns <= self.t_to:
            self.later(wall_ns, self.clock_track, "i", f"clock {agent}",
                       [("agent", agent), ("node", node), ("offset_ns", off), ("timebase", TIMEBASE)])

    # -- collectives

    def ended(self, p: Proc, comm: str, seq: int, o: list, end: int, ok: Any, error: Any,
              unfinished: bool) -> None:
        begin = o[0]
        if end < begin:
            end = begin  # a wall-clock step between enter and end; never draw a negative slice
        if p.track is None:
            self.proc_track(p)
        if o[5] and end >= self.t_from and o[5] <= self.t_to:
            start = o[5]
            start = begin if start < begin else end if start > end else start
            t = p.worker.pick(start, end)
            if not t.declared:
                self.declare(t)
            try:
                self.sink.work(t, start, end, o[1], seq, comm, unfinished)
                self.stats["slices"] += 1
            except (TypeError, ValueError, AttributeError, OverflowError, struct.error):
                self.stats["bad_events"] += 1
        gk = (comm, seq)
        groups = self.groups
        g = groups.get(gk)
        if g is None:
            g = groups[gk] = [self.max_ts, []]
            if comm not in self.comm_job and p.job:
                self.comm_job[comm] = p.job
        items = g[1]
        items.append((begin, end, p, o, ok, error, unfinished))
        want = self.expected.get(comm)
        if want is None:
            want = self._expected(comm)
        if want and len(items) >= want:
            del groups[gk]
            self.flush_group(gk, items, True)
        elif len(groups) > MAX_GROUPS:
            k, old = groups.popitem(last=False)
            self.flush_group(k, old[1], False)

    def _expected(self, comm: str) -> int:
        """How many (selected) ranks take part in each collective of `comm`; 0 when unknown."""
        gs = self.comm_size.get(comm, -1)
        world = self.worlds.get(self.comm_job.get(comm, ""), -1)
        if world > 0 and (gs < 0 or gs == world):
            n = world if self.ranks is None else len(self.ranks & frozenset(range(world)))
        elif gs > 0:
            n = gs if self.ranks is None else len(self.ranks & self.comm_members.get(comm, set()))
        else:
            n = 0
        self.expected[comm] = n
        return n

    def flush_group(self, gk: Tuple[str, int], items: list, complete: bool) -> None:
        """Write one collective's slices, in arrival order, joined by one flow."""
        items.sort(key=_BEGIN)
        if self.windowed:
            t_from, t_to = self.t_from, self.t_to
            items = [it for it in items if it[1] >= t_from and it[0] <= t_to]
            if not items:
                return
        comm, seq = gk
        fid = self.late_flows.pop(gk, 0) if self.late_flows else 0
        late = fid != 0
        n = len(items)
        if not fid and (n > 1 or not complete):
            fid = self.next_flow
            self.next_flow += 1
            self.stats["flows"] += 1
        if not complete and fid:
            self.late_flows[gk] = fid
            if len(self.late_flows) > MAX_LATE_FLOWS:
                self.late_flows.popitem(last=False)
        # flow roles: s starts it, t continues, f (terminating) on the last rank to arrive
        roles = (["t"] * n if late else ["s"] + ["t"] * (n - 1)) if fid else [0] * n
        if complete and fid and (n > 1 or late):
            roles[-1] = "f"
        coll = self.sink.coll
        end = written = 0
        for (b, e, p, o, ok, error, unfinished), role in zip(items, roles):
            if e > end:
                end = e
            if p.track is None:
                self.proc_track(p)
            t = p.calls.pick(b, e)
            if not t.declared:
                self.declare(t)
            try:
                coll(t, b, e, o[1], seq, comm, o[2], o[3], o[4], ok, error, unfinished, fid, role)
                written += 1
            except (TypeError, ValueError, AttributeError, OverflowError, struct.error):
                self.stats["bad_events"] += 1
        self.stats["slices"] += written
        first, last = items[0], items[-1]
        args = [("seq", seq), ("comm", comm), ("ranks", n), ("first_rank", first[2].rank),
                ("last_rank", last[2].rank), ("arrival_spread_us", (last[0] - first[0]) // 1000)]
        if not complete:
            args.append(("partial", True))
        unfinished = sum(1 for it in items if it[6])
        if unfinished:
            args.append(("unfinished", unfinished))
        self.slice(self._comm_lanes(comm).pick(first[0], end), first[0], end, first[3][1], args)

    def _evict_open(self, now: int) -> None:
        key = next(iter(self.open))
        o = self.open.pop(key)
        self.anomalies["open-evicted"] += 1  # over MAX_OPEN: its end was lost, or it is a very long wait
        self.ended(key[0], key[1], key[2], o, now, False, "no end seen (over MAX_OPEN open collectives)", True)

    # -- output helpers

    def slice(self, t: Track, b: int, e: int, name: str, args: list) -> None:
        if not t.declared:
            self.declare(t)
        try:
            self.sink.slice(t, b, e, name, args)
        except (TypeError, ValueError, AttributeError, OverflowError, struct.error):
            self.stats["bad_events"] += 1
            return
        self.stats["slices"] += 1

    def later(self, ts: int, t: Track, kind: str, name: str, payload: Any) -> None:
        """Queue an instant ("i") or counter ("c"); released in time order within REORDER_S."""
        self.heap_n += 1
        heapq.heappush(self.heap, (ts, self.heap_n, t, kind, name, payload))

    def housekeeping(self, final: bool = False) -> None:
        heap = self.heap
        if heap:
            horizon = (1 << 62) if final else self.max_ts - int(REORDER_S * 1e9)
            while heap and (heap[0][0] <= horizon or len(heap) > REORDER_MAX):
                ts, _, t, kind, name, payload = heapq.heappop(heap)
                self._emit_point(ts, t, kind, name, payload)
        groups = self.groups
        if groups:
            horizon = self.max_ts - int(GROUP_WAIT_S * 1e9)
            while groups:
                gk = next(iter(groups))
                if groups[gk][0] > horizon:
                    break
                self.flush_group(gk, groups.pop(gk)[1], False)

    def _emit_point(self, ts: int, t: Track, kind: str, name: str, payload: Any) -> None:
        if ts < t.last_ts:
            ts = t.last_ts  # later than REORDER_S out of order: moved forward, counted, never dropped
            self.stats["reordered"] += 1
        t.last_ts = ts
        if not t.declared:
            self.declare(t)
        try:
            if kind == "c":
                self.sink.counter(t, ts, payload)
                self.stats["counters"] += 1
            else:
                self.sink.instant(t, ts, name, payload)
                self.stats["instants"] += 1
        except (TypeError, ValueError, AttributeError, OverflowError, struct.error):
            self.stats["bad_events"] += 1

    # -- end of the store

    def finish(self, closed_at: Optional[float], findings: List[Dict[str, Any]]) -> None:
        """Close what is still open (drawn up to the end of the recording), write findings, flush."""
        end = self.max_ts
        if isinstance(closed_at, (int, float)) and not isinstance(closed_at, bool):
            end = max(end, int(closed_at * 1e9))
        while self.open:
            key, o = self.open.popitem()
            self.ended(key[0], key[1], key[2], o, end, False, "no end seen before the recording stopped", True)
        for gk in list(self.groups):
            items = self.groups.pop(gk)[1]
            self.flush_group(gk, items, len(items) >= (self.expected.get(gk[0]) or self._expected(gk[0]) or
                                                      1 << 30))
        self.write_findings(findings)
        self.housekeeping(final=True)

    def write_findings(self, findings: List[Dict[str, Any]]) -> None:
        """A slice onset -> detected (and an instant at onset) on each blamed rank's findings track."""
        for f in sorted(findings, key=lambda f: f.get("onset_at") if isinstance(f.get("onset_at"), (int, float)) else 0):
            try:
                self._finding(f)
            except (KeyError, TypeError, ValueError, AttributeError, OverflowError):
                self.stats["bad_findings"] += 1

    def _finding(self, f: Dict[str, Any]) -> None:
        from ccld.diagnose.findings import Finding, format_line
        onset = int(float(f["onset_at"]) * 1e9)
        detected = max(onset, int(float(f.get("detected_at") or f["onset_at"]) * 1e9))
        ranks = [int(r) for r in f.get("ranks") or []]
        if detected < self.t_from or onset > self.t_to:
            return
        try:
            line = format_line(Finding(kind=f["kind"], cls=f["class"], ranks=ranks, comm=f.get("comm") or "",
                                       seq=f.get("seq", -1), op=f.get("op") or "", onset_at=onset / 1e9,
                                       detected_at=detected / 1e9, evidence=f.get("evidence") or {},
                                       id=f.get("id") or ""))
        except Exception:  # a finding file from another version: show it raw rather than not at all
            line = json.dumps(f, default=str)[:200]
        name = f"{str(f['kind']).upper()} {f['class']}"
        args = [("id", f.get("id") or ""), ("class", f["class"]), ("ranks", ",".join(map(str, ranks))),
                ("comm", f.get("comm") or ""), ("seq", f.get("seq", -1)), ("op", f.get("op") or ""),
                ("waited_s", round((detected - onset) / 1e9, 3)), ("finding", line)]
        placed = False
        for r in ranks:
            if self.ranks is not None and r not in self.ranks:
                continue
            p = self._rank_proc(f.get("job") or "", r, onset)
            t = p.findings.pick(onset, detected)
            if not t.declared:
                self.declare(t)
            self.sink.slice(t, onset, detected, name, args, instant_at_begin=name + " onset")
            self.stats["slices"] += 1
            self.stats["instants"] += 1
            placed = True
        self.stats["findings"] += placed

    def _rank_proc(self, job: str, rank: int, at: int) -> Proc:
        """The process that was rank `rank` of `job` at time `at` (a restarted rank has several)."""
        cands = self.by_rank.get((job, rank))
        if not cands and not job:
            got = [v for (j, r), v in self.by_rank.items() if r == rank]
            cands = got[0] if len(got) == 1 else None
        if cands:
            before = [p for ts, p in cands if ts <= at]
            p = before[-1] if before else cands[0][1]
        else:  # blamed but never reported by any agent: give it a track of its own
            p = self.procs.get("not seen", {}).get(-rank - 1) or self._proc("not seen", -rank - 1, rank)
        self.proc_track(p)
        return p


# ---- protobuf output --------------------------------------------------------------------------------

def _uv(n: int) -> bytes:
    """Protobuf varint (negative ints as 64-bit two's complement, like int64), from tables of the
    1- and 2-byte ones: 14 bits at a time."""
    if n < _SMALL_N:
        if n >= 0:
            return _SMALL[n]
        n += 1 << 64
    if n < (1 << 28):
        return _LOW14[n & 0x3FFF] + _SMALL[n >> 14]
    if n >= (1 << 64):
        raise OverflowError(f"{n} does not fit in 64 bits")  # a longer varint would make the trace unreadable
    return _LOW14[n & 0x3FFF] + _LOW14[(n >> 14) & 0x3FFF] + _uv(n >> 28)


_SMALL_N = 1 << 14  # every 1- and 2-byte varint, precomputed (lengths, iids, small seqs)
_SMALL = [bytes((i,)) for i in range(0x80)] + [bytes(((i & 0x7F) | 0x80, i >> 7)) for i in range(0x80, _SMALL_N)]
_LOW14 = [bytes(((i & 0x7F) | 0x80, (i >> 7) | 0x80)) for i in range(1 << 14)]  # 14 bits, more to follow
_TS_TAILS: Dict[int, bytes] = {}
_TS_TAILS_MAX = 1 << 16


def _ts(n: int) -> bytes:
    """Varint of a timestamp (>= 2^28): two table lookups for the low 28 bits, and the rest, which
    changes every 268 ms of Unix ns, from a cache."""
    if n < (1 << 28) or n >= (1 << 63):
        if n < 0 or n >= (1 << 63):
            raise OverflowError(f"timestamp {n} ns is outside 0..2^63")
        return _uv(n)
    h = n >> 28
    tail = _TS_TAILS.get(h)
    if tail is None:
        if len(_TS_TAILS) >= _TS_TAILS_MAX:
            _TS_TAILS.clear()
        tail = _TS_TAILS[h] = _uv(h)
    return _LOW14[n & 0x3FFF] + _LOW14[(n >> 14) & 0x3FFF] + tail


def _ld(tag: bytes, body: bytes) -> bytes:
    return tag + _uv(len(body)) + body


SEQ_ID = 1
_SEQ_TAIL = b"\x50\x01\x68\x02"   # trusted_packet_sequence_id=1, sequence_flags=SEQ_NEEDS_INCREMENTAL_STATE
_FLOW = {"s": b"\xf9\x02", "t": b"\xf9\x02", "f": b"\x81\x03"}  # flow_ids=47 / terminating_flow_ids=48 (fixed64)
_Q = struct.Struct("<Q").pack
_D = struct.Struct("<d").pack
# Debug-annotation names interned by the first packet; iids 1..9 are hard-coded in ProtoSink.coll.
_FIXED_KEYS = ("op", "seq", "comm", "count", "dtype", "nbytes", "ok", "error", "unfinished")
_ANN_SEQ = b"\x08\x02\x20"        # name_iid=2 (seq), int_value follows
_ANN_COUNT = b"\x08\x04\x20"
_ANN_NBYTES = b"\x08\x06\x20"
_ANN_DTYPE = b"\x08\x05\x88\x01"  # name_iid=5 (dtype), string_value_iid follows
_ANN_UNFINISHED = b"\x22\x04\x08\x09\x10\x01"
FLUSH_PACKETS = 8192    # packets joined per write (~0.5 MiB)
ANN_CACHE_MAX = 10_000  # encoded (key, string) args kept


class ProtoSink:
    """Writes TracePackets to a binary file. Hot packets (slices) are encoded by hand from cached
    pieces, with interned names and arg keys; rare ones (track descriptors, the clock snapshot)
    with the shipped perfetto_trace_pb2. Field numbers are perfetto's (trace_packet.proto,
    track_event.proto, debug_annotation.proto, interned_data.proto)."""

    def __init__(self, f):
        from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb
        self.pb = pb
        self.f = f
        self.buf: List[bytes] = []
        self.bytes = 0
        self.names: Dict[str, int] = {}
        self.strs: Dict[str, int] = {}
        self.coll_pre: Dict[tuple, bytes] = {}
        self.ann_cache: Dict[tuple, bytes] = {}
        self.size_anns: Dict[tuple, bytes] = {}
        self.started = False
        # First packet of the sequence: clears incremental state and interns the usual arg names.
        body = b"".join(_ld(b"\x1a", b"\x08" + _uv(i + 1) + _ld(b"\x12", k.encode()))
                        for i, k in enumerate(_FIXED_KEYS))
        self.keys = {k: i + 1 for i, k in enumerate(_FIXED_KEYS)}
        self._packet(_ld(b"\x62", body) + b"\x50\x01\x68\x01")

    def _packet(self, pkt: bytes) -> None:
        self.buf.append(b"\x0a" + _uv(len(pkt)) + pkt)
        if len(self.buf) >= FLUSH_PACKETS:
            self.flush()

    def flush(self) -> None:
        if self.buf:
            data = b"".join(self.buf)
            self.f.write(data)
            self.bytes += len(data)
            self.buf = []

    def _intern(self, table: Dict[str, int], field: bytes, s: str) -> int:
        iid = table.get(s)
        if iid is None:
            iid = table[s] = len(table) + 1
            value = s.encode("utf-8", "replace")
            self._packet(_ld(b"\x62", _ld(field, b"\x08" + _uv(iid) + _ld(b"\x12", value))) + _SEQ_TAIL)
        return iid

    def _name(self, s: str) -> int:
        return self._intern(self.names, b"\x12", s)      # InternedData.event_names = 2

    def _key(self, s: str) -> int:
        return self._intern(self.keys, b"\x1a", s)       # InternedData.debug_annotation_names = 3

    def _str(self, s: str) -> int:
        if type(s) is not str:
            raise TypeError("string expected")
        return self._intern(self.strs, b"\xea\x01", s)   # InternedData.debug_annotation_string_values = 29

    def _ann(self, key: str, v: Any) -> bytes:
        """One debug annotation; (key, string) pairs are cached (comm names, states repeat)."""
        c = v.__class__
        if c is str or c is bool:
            got = self.ann_cache.get((key, v))
            if got is not None:
                return got
        head = b"\x08" + _uv(self._key(key))
        if c is int:
            x = head + b"\x20" + _uv(v)
            return b"\x22" + _SMALL[len(x)] + x
        if c is bool:
            body = head + (b"\x10\x01" if v else b"\x10\x00")
        elif c is float:
            body = head + b"\x29" + _D(v)
        else:
            s = v if c is str else json.dumps(v, default=str)
            body = head + _ld(b"\x32", s.encode("utf-8", "replace"))
        got = _ld(b"\x22", body)
        if (c is str or c is bool) and len(self.ann_cache) < ANN_CACHE_MAX:
            self.ann_cache[(key, v)] = got
        return got

    def _anns(self, args: list) -> bytes:
        return b"".join([self._ann(k, v) for k, v in args])

    def start(self, ts: int) -> None:
        """The clock relation, before the first timed packet: REALTIME = BOOTTIME (Unix ns)."""
        pkt = self.pb.TracePacket()
        pkt.timestamp = ts
        for cid in (self.pb.BUILTIN_CLOCK_REALTIME, self.pb.BUILTIN_CLOCK_BOOTTIME):
            c = pkt.clock_snapshot.clocks.add()
            c.clock_id, c.timestamp = cid, ts
        pkt.trusted_packet_sequence_id = SEQ_ID
        self._packet(pkt.SerializeToString())
        self.started = True

    def declare(self, t: Track) -> None:
        pkt = self.pb.TracePacket()
        d = pkt.track_descriptor
        d.uuid = t.uuid
        if t.parent is not None:
            d.parent_uuid = t.parent.uuid
        if t.kind == "process":
            d.process.pid = t.pid
            d.process.process_name = t.name
        elif t.kind == "thread":
            d.thread.pid, d.thread.tid, d.thread.thread_name = t.pid, t.tid, t.name
        else:
            d.name = t.name
        if t.kind == "counter":
            d.counter.SetInParent()
        if t.child_order:
            d.child_ordering = t.child_order
        if t.order is not None:
            d.sibling_order_rank = t.order
        if t.description:
            d.description = t.description
        pkt.trusted_packet_sequence_id = SEQ_ID
        self._packet(pkt.SerializeToString())
        # cached pieces of this track's events: its uuid field, and its whole END event + packet tail
        end = _ld(b"\x5a", b"\x48\x02\x58" + _uv(t.uuid)) + _SEQ_TAIL
        t.out = (b"\x58" + _uv(t.uuid), end, b"\x0a" + _SMALL[10 + len(end)] + b"\x40")

    def _pair(self, t: Track, b: int, e: int, te: bytes) -> None:
        """A BEGIN packet with track event `te` at b and the matching END at e, as one write."""
        if not self.started:
            self.start(b)
        bt, et, lt = _ts(b), _ts(e), len(te)
        out = t.out
        head = _SMALL[1 + len(bt) + 1 + (1 if lt < 0x80 else 2) + lt + 4] if lt < 0x3F00 else None
        if head is None or len(et) != 9:  # the general case (not Unix-epoch ns, or a huge event)
            pkt = b"\x40" + bt + b"\x5a" + _uv(lt) + te + _SEQ_TAIL
            end = b"\x40" + et + out[1]
            self.buf.append(b"\x0a" + _uv(len(pkt)) + pkt + b"\x0a" + _uv(len(end)) + end)
        else:
            self.buf.append(b"".join((b"\x0a", head, b"\x40", bt, b"\x5a", _SMALL[lt], te, _SEQ_TAIL,
                                      out[2], et, out[1])))
        if len(self.buf) >= FLUSH_PACKETS:
            self.flush()

    def coll(self, t: Track, b: int, e: int, op: str, seq: int, comm: str, count: int, dtype: str,
             nbytes: int, ok: Any, error: Any, unfinished: bool, fid: int, role: Any) -> None:
        key = (t.uuid, op, comm, ok is True)
        te = self.coll_pre.get(key)
        if te is None:  # type BEGIN, track, name, and the args that repeat: op, comm, ok
            te = self.coll_pre[key] = (
                b"\x48\x01" + t.out[0] + b"\x50" + _uv(self._name(op)) +
                _ld(b"\x22", b"\x08\x01\x88\x01" + _uv(self._str(op))) +
                _ld(b"\x22", b"\x08\x03\x88\x01" + _uv(self._str(comm))) +
                (b"\x22\x04\x08\x07\x10\x01" if ok is True else b"\x22\x04\x08\x07\x10\x00"))
        x = _uv(seq)
        te += b"\x22" + _SMALL[3 + len(x)] + _ANN_SEQ + x
        size = self.size_anns.get((count, dtype, nbytes))
        if size is None:  # count, dtype, nbytes: a job repeats a few combinations (its buckets)
            size = b""
            if count.__class__ is int and count >= 0:
                x = _uv(count)
                size += b"\x22" + _SMALL[3 + len(x)] + _ANN_COUNT + x
            if dtype:
                x = _uv(self._str(dtype))
                size += b"\x22" + _SMALL[4 + len(x)] + _ANN_DTYPE + x
            if nbytes.__class__ is int and nbytes >= 0:
                x = _uv(nbytes)
                size += b"\x22" + _SMALL[3 + len(x)] + _ANN_NBYTES + x
            if len(self.size_anns) < ANN_CACHE_MAX:
                self.size_anns[(count, dtype, nbytes)] = size
        te += size
        if error:
            te += self._ann("error", error)
        if unfinished:
            te += _ANN_UNFINISHED
        if role:
            te += _FLOW[role] + _Q(fid)
        self._pair(t, b, e, te)

    def work(self, t: Track, b: int, e: int, op: str, seq: int, comm: str, unfinished: bool) -> None:
        """A worker slice: the collective as the library ran it (args seq, comm)."""
        key = (t.uuid, op, comm, None)
        te = self.coll_pre.get(key)
        if te is None:
            te = self.coll_pre[key] = (b"\x48\x01" + t.out[0] + b"\x50" + _uv(self._name(op)) +
                                       _ld(b"\x22", b"\x08\x03\x88\x01" + _uv(self._str(comm))))
        x = _uv(seq)
        te += b"\x22" + _SMALL[3 + len(x)] + _ANN_SEQ + x
        if unfinished:
            te += _ANN_UNFINISHED
        self._pair(t, b, e, te)

    def slice(self, t: Track, b: int, e: int, name: str, args: list, instant_at_begin: str = "") -> None:
        te = b"\x48\x01" + t.out[0] + b"\x50" + _uv(self._name(name)) + self._anns(args)
        if instant_at_begin:
            bt, et = _ts(b), _ts(e)  # both first: a bad time must not leave a BEGIN without its END
            if not self.started:
                self.start(b)
            self._packet(b"\x40" + bt + _ld(b"\x5a", te) + _SEQ_TAIL)
            self.instant(t, b, instant_at_begin, args[:1])
            self._packet(b"\x40" + et + t.out[1])
        else:
            self._pair(t, b, e, te)

    def instant(self, t: Track, ts: int, name: str, args: list) -> None:
        if not self.started:
            self.start(ts)
        te = b"\x48\x03" + t.out[0] + b"\x50" + _uv(self._name(name)) + self._anns(args)
        self._packet(b"\x40" + _ts(ts) + _ld(b"\x5a", te) + _SEQ_TAIL)

    def counter(self, t: Track, ts: int, value: Any) -> None:
        if not self.started:
            self.start(ts)
        v = b"\xf0\x01" + _uv(value) if type(value) is int else b"\xe1\x02" + _D(float(value))
        self._packet(b"\x40" + _ts(ts) + _ld(b"\x5a", b"\x48\x04" + t.out[0] + v) + _SEQ_TAIL)

    def finish(self, meta: Dict[str, Any]) -> int:
        self.flush()
        return self.bytes


# ---- the export ------------------------------------------------------------------------------------

def _ns(t: Optional[float]) -> Optional[int]:
    return None if t is None else int(round(float(t) * 1e9))


def _findings_dicts(findings) -> List[Dict[str, Any]]:
    out = []
    for f in findings or []:
        d = f.to_json() if hasattr(f, "to_json") else f
        if isinstance(d, dict) and d.get("kind") in ("hang", "slow"):
            out.append(d)
    return out


def run_export(store_dir: str, out_path: str, make_sink: Callable[[Any], Any], mode: str,
               t_from: Optional[float] = None, t_to: Optional[float] = None,
               ranks: Optional[Iterable[int]] = None, progress: Optional[Callable[[Dict[str, Any]], None]] = None,
               findings=None, hang_after: float = 5.0) -> Dict[str, Any]:
    """Shared by the Perfetto and Chrome JSON exports: stream the store through a TraceModel into
    `make_sink(file)`. findings=None replays the store for them (ccld.diagnose.replay); a list
    (Finding objects or their JSON dicts) is used as given."""
    meta = read_meta(store_dir)  # StoreError now, before any output is made
    if t_from is not None and t_to is not None and t_from > t_to:
        raise ExportError(f"--from {t_from} is after --to {t_to}")
    t0 = time.monotonic()
    replay_s = 0.0
    if findings is None:
        from ccld.diagnose.replay import replay
        if progress:
            progress({"phase": "findings", "elapsed_s": 0.0})
        findings = replay(store_dir, floor_s=hang_after)[1]
        replay_s = time.monotonic() - t0
    found = _findings_dicts(findings)
    total = sum(os.path.getsize(p) for _, p in list_segments(store_dir))
    tmp = out_path + ".tmp"
    try:
        f = open(tmp, mode)
    except OSError as e:
        raise ExportError(f"cannot write {out_path}: {e.strerror}") from None
    problems: List[str] = []
    t1 = time.monotonic()
    try:
        with f:
            sink = make_sink(f)
            model = TraceModel(sink, _ns(t_from), _ns(t_to), ranks)
            done = 0
            last = t1
            for i, (_recv, frame) in enumerate(read_store(store_dir, problems)):
                model.feed(frame)
                done += len(frame) + 12
                if progress and (i & 63) == 0:
                    now = time.monotonic()
                    if now - last >= PROGRESS_EVERY_S:
                        last = now
                        progress({"phase": "write", "events": model.stats["events"], "bytes_read": done,
                                  "bytes_total": total, "elapsed_s": now - t1})
            model.finish(meta.get("closed_at"), found)
            size = sink.finish({"timebase": TIMEBASE,
                                "clock_offsets_ns": {a: o.offset_ns for a, o in model.clock.agents().items()}})
        os.replace(tmp, out_path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    end = time.monotonic()
    st = model.stats
    stats = {"out": os.path.abspath(out_path), "bytes": size, "seconds": end - t0, "replay_s": replay_s,
             "write_s": end - t1, "events": st["events"], "frames": st["frames"], "tracks": st["tracks"],
             "slices": st["slices"], "instants": st["instants"], "counters": st["counters"],
             "flows": st["flows"], "findings": st["findings"], "findings_total": len(found),
             "extra_lanes": st["extra_lanes"], "reordered": st["reordered"], "bad_events": st["bad_events"],
             "skipped_events": st["skipped_events"], "frames_rejected": dict(model.frames_rejected),
             "anomalies": dict(model.anomalies), "store_problems": problems}
    stats["events_per_s"] = stats["events"] / stats["write_s"] if stats["write_s"] > 0 else 0.0
    return stats


def export_perfetto(store_dir: str, out_path: str, t_from: Optional[float] = None, t_to: Optional[float] = None,
                    ranks: Optional[Iterable[int]] = None, progress: Optional[Callable[[Dict[str, Any]], None]] = None,
                    findings=None, hang_after: float = 5.0) -> Dict[str, Any]:
    """Write `store_dir` as a Perfetto protobuf trace at `out_path`; returns stats (see run_export).

    t_from/t_to: Unix seconds (slices overlapping the window are kept whole); ranks: global ranks
    to keep (None: all)."""
    return run_export(store_dir, out_path, ProtoSink, "wb", t_from, t_to, ranks, progress, findings, hang_after)
