"""The trace model: a store's frames in, calls on a sink out (tracks, slices, instants, counters, flows).

What the trace holds. A process track per traced process, "rank R (node, pid P)", with children:
`calls` (a slice per collective, CollEnter -> WorkEnd; args op, seq, comm, count/dtype/nbytes when
known, ok), `worker` (WorkStart -> WorkEnd, the library's own thread), `p2p` (send/recv instants),
`state` (exit and stopped/zombie/disk-wait instants), `findings` (marks.py), `GPU d stream s` (a slice
per kernel and memcpy/memset from CUPTI, NCCL kernels joined to their collective: gpu.py), and counters: `link
R->D MiB/s`, `RTT ms` and `retrans` per peer rank D, `rank R runqueue wait %` (netcounters.py), and
NCCL's proxy progress per communicator, peer and direction, `nccl:H R->P MiB/s`, `steps in flight`
and `net wait %` (netprog.py). A `communicators` group has one track per communicator
(collectives.py), and a `ccld` group the agents' loss counters and clock offsets.
Times: Unix ns in the collector's timebase: an event's ts_ns (its node's CLOCK_MONOTONIC) plus the
offset (wall - mono) of its agent's latest ClockSample, kept in a timeline.clock.ClockTable, the
same rule as the live timeline (events before an agent's first sample wait for it).
Memory: frames are processed in store order and only bounded state is held (see the bounds in
collectives.py, netcounters.py and netprog.py, and REORDER_S/REORDER_MAX for instants and counters,
which are sorted within that window of recorded time), so memory does not grow with the store.
"""
from __future__ import annotations

import collections
import heapq
import struct
from typing import Any, Dict, Iterable, List, Optional, Tuple

import msgpack

from ccld.timeline.clock import ClockTable
from ccld import wire as ev
from ccld.export import clocktrack, colblocks, facts, gpu, marks
from ccld.export.collectives import MAX_OPEN, Collectives, GROUP_WAIT_S
from ccld.export.netcounters import NetCounters
from ccld.export.netprog import NcclProgress
from ccld.export.tracks import Lanes, Proc, Track

_PID_MAX = 1 << 22         # Linux's largest pid_max: the trace's own pids for clashes go above it
REORDER_S = 1.0           # instants and counters are sorted within this window of recorded time
REORDER_MAX = 100_000     # ... holding at most this many
MAX_PENDING_NO_CLOCK = 100_000  # events held until their agent's first clock sample (as the timeline does)
TIMEBASE = ("Unix ns (collector timebase): each event's CLOCK_MONOTONIC ts_ns on its node plus the "
            "offset wall-mono of its agent's latest clock sample")
_SINK_ERRORS = (TypeError, ValueError, AttributeError, OverflowError, struct.error)


class TraceModel:
    """Turns a store's frames into calls on a sink (protobuf.ProtoSink, chrome.ChromeSink)."""

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
        self.colls = Collectives(self)
        self.net = NetCounters(self)
        self.nccl = NcclProgress(self)
        self.counter_tracks: Dict[Tuple[str, str], Track] = {}
        self.heap: List[tuple] = []
        self.heap_n = 0
        self.max_ts = -(1 << 62)
        self.next_uuid = 1
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
            if type(pid) is not int or not 0 < pid < _PID_MAX:  # not a Linux pid (a damaged store):
                pid = _PID_MAX                                     # Perfetto's pid is an int32
            while pid in self.used_pids:  # same pid on two nodes: Perfetto would merge them
                pid += _PID_MAX             # above Linux's pid_max; the name keeps the real pid
                if pid >= 1 << 31:
                    pid = pid % _PID_MAX + 1
            self.used_pids.add(pid)
            rank = p.rank if type(p.rank) is int else -1  # a damaged store's rank: None, a bool, a string
            who = f"rank {rank}" if rank >= 0 else "unknown rank"
            name = f"{who} ({p.node}, pid {p.pid})" if type(p.pid) is not int or p.pid > 0 else \
                f"{who} (not seen by any agent)"
            order = rank if -(1 << 31) <= rank < 1 << 31 else None  # an int32 too
            p.track = self.new_track(None, name, "process", pid=pid, order=order, child_order=3)
            p.calls = Lanes(self, p.track, "calls", 1, first_kind="thread", tid=pid)  # the rank's main thread
            p.worker = Lanes(self, p.track, "worker", 2)
            p.findings = Lanes(self, p.track, "findings", 0)
        return p.track

    def instant_track(self, p: Proc, attr: str, name: str, order: int) -> Track:
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

    def new_proc(self, node: str, pid: int, rank: int) -> Proc:
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
        if type(v) not in (list, tuple) or len(v) != 2 or v[0] != ev.SCHEMA_MAJOR:
            self.frames_rejected["version"] += 1
            return
        agent, node, evs = env.get("agent"), env.get("node"), env.get("events")
        if type(agent) is not str or type(node) is not str or type(evs) is not list:
            self.frames_rejected["bad-envelope"] += 1
            return
        blocks = env.get("blocks")
        if blocks is not None and type(blocks) is not list:
            self.frames_rejected["bad-envelope"] += 1
            return
        self.stats["frames"] += 1
        if blocks:  # schema 1.4: coll/start/end as column blocks (colblocks.py)
            self.stats["events"] += len(evs) + colblocks.rows_in(blocks)
            colblocks.feed_frame(self, agent, node, evs, blocks)
        else:
            self.stats["events"] += len(evs)
            self.events(agent, node, evs)
        self.housekeeping()

    def events(self, agent: str, node: str, evs: list) -> None:
        """The hot loop: collective events inline, everything else through facts.rare()."""
        off = self.offsets.get(agent)
        procs = self.procs.get(node)
        if procs is None:
            procs = self.procs[node] = {}
        colls = self.colls
        open_ = colls.open
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
                        p = self.new_proc(node, pid, e["rank"])
                    if p.skip:
                        continue
                    ts = e["ts_ns"]
                    if type(ts) is not int:
                        raise TypeError("ts_ns")
                    ts += off  # node CLOCK_MONOTONIC -> collector Unix ns (ClockTable's offset)
                    comm, seq = e["comm"], e["seq"]
                    key = (p, comm, seq)
                    if key in open_:
                        self.anomalies["duplicate-enter"] += 1
                        continue
                    op = e["op"]
                    o = open_[key] = [ts, (op, e.get("count", -1), e.get("dtype", ""), e.get("nbytes", -1)), 0, None]
                    if p.gpu is not None:  # a rank with CUPTI capture: kept for the kernel join (gpu.py)
                        o[3] = p.gpu.enter(ts - off, comm, seq, op, e.get("tid"))
                    if ts > max_ts:
                        max_ts = ts
                    if len(open_) > MAX_OPEN:
                        colls.evict_open(max_ts)
                elif k == "end":
                    pid = e["pid"]
                    p = procs.get(pid)
                    if p is None:
                        p = self.new_proc(node, pid, e["rank"])
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
                    self.max_ts = max_ts
                    colls.ended(p, comm, seq, o, ts, e.get("ok", True), e.get("error", ""), False)
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
                        o[2] = ts + off
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
                elif k == "clock_sync":  # round-trip clock estimate: converts what follows; clock tracks
                    off = clocktrack.on_sync(self, agent, e, off)
                else:
                    self.max_ts = max_ts
                    facts.rare(self, agent, node, procs, k, e, off)
                    max_ts = self.max_ts
            except (KeyError, TypeError, ValueError, AttributeError, IndexError):
                self.stats["bad_events"] += 1
        self.max_ts = max_ts

    def counter(self, scope: str, name: str, ts: int, value: Any) -> None:
        """A sample on the counter track `scope name` under `ccld` (the agents' loss counters)."""
        if not (self.t_from <= ts <= self.t_to) or type(value) not in (int, float):
            return
        t = self.counter_tracks.get((scope, name))
        if t is None:
            t = self.counter_tracks[(scope, name)] = self.new_track(self._root_ccld(), f"{scope} {name}",
                                                                    "counter")
        self.later(ts, t, "c", name, value)

    def sample(self, t: Track, ts: int, value: Any) -> None:
        """A sample on counter track `t`, when inside the window and different from its last one
        (a counter is a step function: the same value again adds nothing)."""
        if value == t.value or not (self.t_from <= ts <= self.t_to):
            return
        t.value = value
        self.later(ts, t, "c", t.name, value)

    def _first_clock(self, agent: str, node: str, wall_ns: int) -> None:
        if self.clock_track is None:
            self.clock_track = self.new_track(self._root_ccld(), "clock offsets", order=0)
        off = self.offsets[agent]
        if self.t_from <= wall_ns <= self.t_to:
            self.later(wall_ns, self.clock_track, "i", f"clock {agent}",
                       [("agent", agent), ("node", node), ("offset_ns", off), ("timebase", TIMEBASE)])

    # -- output helpers

    def slice(self, t: Track, b: int, e: int, name: str, args: list) -> None:
        if not t.declared:
            self.declare(t)
        try:
            self.sink.slice(t, b, e, name, args)
        except _SINK_ERRORS:
            self.stats["bad_events"] += 1
            return
        self.stats["slices"] += 1

    def later(self, ts: int, t: Track, kind: str, name: str, payload: Any) -> None:
        """Queue an instant ("i"), counter ("c") or GPU slice ("g", gpu.py); released in time order
        within REORDER_S."""
        self.heap_n += 1
        heapq.heappush(self.heap, (ts, self.heap_n, t, kind, name, payload))

    def housekeeping(self, final: bool = False) -> None:
        self.net.due((1 << 62) if final else self.max_ts)
        self.nccl.due((1 << 62) if final else self.max_ts)
        heap = self.heap
        if heap:
            horizon = (1 << 62) if final else self.max_ts - int(REORDER_S * 1e9)
            while heap and (heap[0][0] <= horizon or len(heap) > REORDER_MAX):
                ts, _, t, kind, name, payload = heapq.heappop(heap)
                self._emit_point(ts, t, kind, name, payload)
        if self.colls.groups:
            self.colls.flush_waiting(self.max_ts - int(GROUP_WAIT_S * 1e9))

    def _emit_point(self, ts: int, t: Any, kind: str, name: str, payload: Any) -> None:
        if kind == "g":  # a GPU slice; t is its Proc (gpu.py picks the stream track)
            try:
                gpu.emit(self, ts, t, name, payload)
            except _SINK_ERRORS:
                self.stats["bad_events"] += 1
            return
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
        except _SINK_ERRORS:
            self.stats["bad_events"] += 1

    # -- end of the store

    def finish(self, closed_at: Optional[float], findings: List[Dict[str, Any]]) -> None:
        """Close what is still open (drawn up to the end of the recording), write findings, flush."""
        end = self.max_ts
        if isinstance(closed_at, (int, float)) and not isinstance(closed_at, bool):
            end = max(end, int(closed_at * 1e9))
        self.colls.finish(end)
        marks.write_findings(self, findings)
        self.housekeeping(final=True)
