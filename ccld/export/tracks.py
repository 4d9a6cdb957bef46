"""The trace's tracks: what the exporter draws on, independent of the output format.

A Track is one output track (a process, a thread, a plain slice track or a counter); the sinks
(protobuf.ProtoSink, chrome.ChromeSink) keep their own encoding of it in `out`. Lanes spreads slices
that may overlap (async collectives) over several tracks so each stays properly nested and ordered.
A Proc is one traced process (node, pid) with the tracks made for it, on first use (its GPU streams'
tracks are in gpu.GpuProc).
Times: Unix ns in the collector's timebase (see model.TIMEBASE). `last_ts` is per track: every sink
call for a track must not go back in time.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional

if TYPE_CHECKING:
    from ccld.export.model import TraceModel


class Track:
    """One output track. kind: process | thread | track | counter. `last_ts` keeps per-track order;
    `value` is a counter's last written value (a counter is a step function: an unchanged value is
    not written again); `unit` names a counter's unit for the viewer."""
    __slots__ = ("uuid", "parent", "name", "kind", "pid", "tid", "order", "child_order", "description",
                 "unit", "last_ts", "value", "declared", "out")

    def __init__(self, uuid: int, parent: Optional["Track"], name: str, kind: str = "track",
                 pid: int = 0, tid: int = 0, order: Optional[int] = None, child_order: int = 0,
                 description: str = "", unit: str = ""):
        self.uuid, self.parent, self.name, self.kind = uuid, parent, name, kind
        self.pid, self.tid, self.order, self.child_order = pid, tid, order, child_order
        self.description, self.unit = description, unit
        self.last_ts = -(1 << 62)
        self.value: Any = None
        self.declared = False
        self.out = None  # the sink's own data for this track (cached bytes, chrome pid/tid)


class Lanes:
    """Tracks for slices that may overlap: each slice goes to the first lane free at its begin, so
    every lane holds non-overlapping slices in begin order (balanced and ordered by construction)."""
    __slots__ = ("model", "parent", "name", "order", "tracks", "first_kind", "tid")

    def __init__(self, model: "TraceModel", parent: Track, name: str, order: int,
                 first_kind: str = "track", tid: int = 0, base: Optional[int] = None):
        """Lane n sorts at order * 100 + n among its siblings (`base` + n when given)."""
        self.model, self.parent, self.name = model, parent, name
        self.order = order * 100 if base is None else base
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
                                     order=self.order)
        else:
            t = self.model.new_track(self.parent, self.name if n == 0 else f"{self.name} {n + 1}",
                                     order=self.order + n)
            if n:
                self.model.stats["extra_lanes"] += 1
        self.tracks.append(t)
        t.last_ts = end
        return t


def comm_args(seq: int, comm: str, ranks: int, first_rank: int, last_rank: int, spread_us: int,
              partial: bool, unfinished: int) -> List[tuple]:
    """The args of a collective's slice on its communicator's track, as every sink writes them."""
    args = [("seq", seq), ("comm", comm), ("ranks", ranks), ("first_rank", first_rank),
            ("last_rank", last_rank), ("arrival_spread_us", spread_us)]
    if partial:
        args.append(("partial", True))
    if unfinished:
        args.append(("unfinished", unfinished))
    return args


class Proc:
    """A traced process (node, pid) and its tracks, made when first needed. sched_ts/sched_runq: its
    latest SchedStats (time, cumulative runqueue ns), the base of the next runqueue-wait sample."""
    __slots__ = ("node", "pid", "rank", "job", "world", "skip", "track", "calls", "worker", "p2p",
                 "state", "findings", "state_letter", "runq", "sched_ts", "sched_runq", "gpu")

    def __init__(self, node: str, pid: int, rank: int, skip: bool):
        self.node, self.pid, self.rank, self.skip = node, pid, rank, skip
        self.job, self.world = "", -1
        self.track = self.calls = self.worker = self.p2p = self.state = self.findings = None
        self.runq: Optional[Track] = None
        self.sched_ts = self.sched_runq = -1
        self.state_letter = ""
        self.gpu = None  # gpu.GpuProc once it is known to have CUPTI capture (or sends GPU records)
