"""GPU activity in the trace (CUPTI's GpuKernel / GpuMemop / GpuLoss): a track per (device, stream) under
each rank's process track, a slice per kernel and per memcpy/memset, and a flow from a rank's collective
slice to the NCCL kernel that ran it. A ComputeSpan (facts.py hands it here on COMPUTE_DEVICE) is a compute span of a per-op table or
a trace (timeline/compute.py), drawn on a "compute" track of its rank: no GPU, nothing to join.

Join: the collector's rule (ccld/timeline/gpujoin.py), applied as the trace is written: an NCCL kernel launched
by thread T at L runs the collectives T entered at or before L (within MAX_LAUNCH_LAG_NS) not yet run by
an earlier kernel, of the communicator its stream serves (learned from kernels whose candidates are all
of one communicator), else of its op, else of the oldest candidate; several (a group) -> one kernel.
A kernel without a launch record takes the oldest unclaimed enter of its stream's communicator. Kernels
are joined in GPU start order as the model's reorder window releases them (REORDER_S after them in
recorded time), so their enters, which BPF ships sooner than CUPTI ships kernels, have come.
Flow: a collective slice gets a flow id when it is written if its kernel has claimed it already or
its rank has sent GPU records (its enter is then likely to be claimed); the kernel terminates that
flow. A kernel whose collective was written without one has args comm/seq only.
Times: ts_ns/end_ns are the node's CLOCK_MONOTONIC (the CUPTI shim converted them from CUPTI's clock in
ccld/cupti/clock.py, the one place for that); here they get the agent's offset like every event
(model.TIMEBASE). Enters are matched on node-monotonic ns (launch and enter come from the same node).
Bounds: MAX_ENTERS enters per thread and per communicator of a rank; GPU slices wait in the model's
reorder heap (REORDER_MAX).
"""
from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, Deque, Dict, List, Optional, Tuple

from ccld.export.tracks import Lanes, Proc
from ccld.timeline import gpujoin
from ccld.timeline.compute import COMPUTE_DEVICE
from ccld.timeline.gpujoin import MAX_LAUNCH_LAG_NS

if TYPE_CHECKING:
    from ccld.export.model import TraceModel

MAX_ENTERS = 4096          # NCCL enters kept per launching thread and per communicator of one rank
MAX_STREAMS = 256          # stream tracks per rank; more share the last one's name ("GPU d stream other")
STREAM_ORDER = 500         # stream tracks sort after calls, worker, p2p, state (100..499), before links
MAX_NAME_CHARS = 512       # CUPTI names are cut at 256 by the shim; a longer one from elsewhere is cut here
# CUpti_ActivityMemcpyKind
COPY_KINDS = {1: "HtoD", 2: "DtoH", 3: "HtoA", 4: "AtoH", 5: "AtoA", 6: "AtoD", 7: "DtoA", 8: "DtoD", 9: "HtoH",
              10: "PtoP"}
# fields a newer wire schema may add to kernels (launch configuration); written as args when present
EXTRA_KERNEL_ARGS = ("grid", "block", "shared_bytes", "registers")


class KEnter:
    """One NCCL collective a rank entered, for the kernel join. ts: node-monotonic ns. fid: the flow
    from its slice to its kernel (0: none yet); state: 0 slice not written yet, 1 written with fid,
    2 written without."""
    __slots__ = ("ts", "comm", "seq", "op", "claimed", "fid", "state")

    def __init__(self, ts: int, comm: str, seq: int, op: str):
        self.ts, self.comm, self.seq, self.op = ts, comm, seq, op
        self.claimed = False
        self.fid = self.state = 0


class GpuProc:
    """A rank's GPU state: its NCCL enters by launching thread and by communicator, what its streams
    serve, and its stream tracks. seen: it has sent GPU records (its collectives get flow ids)."""
    __slots__ = ("threads", "by_comm", "stream_comm", "streams", "seen")

    def __init__(self):
        self.threads: Dict[int, Deque[KEnter]] = {}
        self.by_comm: Dict[str, Deque[KEnter]] = {}
        self.stream_comm: Dict[Tuple[int, int], str] = {}
        self.streams: Dict[Tuple[int, int], Lanes] = {}
        self.seen = False

    def enter(self, ts: int, comm: str, seq: int, op: str, tid: Any) -> KEnter:
        k = KEnter(ts, comm, seq, op)
        if type(tid) is int and tid > 0:
            q = self.threads.get(tid)
            if q is None:
                q = self.threads[tid] = collections.deque(maxlen=MAX_ENTERS)
            q.append(k)
        q = self.by_comm.get(comm)
        if q is None:
            q = self.by_comm[comm] = collections.deque(maxlen=MAX_ENTERS)
        q.append(k)
        return k


def gpu_proc(p: Proc) -> GpuProc:
    if p.gpu is None:
        p.gpu = GpuProc()
    return p.gpu


def _int(e: dict, key: str) -> int:
    v = e[key]
    if type(v) is not int:
        raise TypeError(key)
    return v


def record(m: "TraceModel", node: str, procs: Dict[int, Proc], k: str, e: dict, off: int) -> None:
    """A gpu_kernel or gpu_memop wire event: queued in the model's reorder heap, drawn by emit()."""
    pid = e["pid"]
    p = procs.get(pid) or m.new_proc(node, pid, e["rank"])
    if p.skip:
        return
    compute = e.get("device") == COMPUTE_DEVICE  # a table's or trace's compute span: no GPU, no kernel to join
    if not compute:
        gpu_proc(p).seen = True
    raw = _int(e, "ts_ns")
    b, end = raw + off, _int(e, "end_ns") + off
    if end < b:
        end = b  # CUPTI reports 0 for "not collected": never draw a negative slice
    if b > m.max_ts:
        m.max_ts = b
    dev, stream = _int(e, "device"), _int(e, "stream")
    if k == "gpu_kernel":
        name = e["name"]
        if type(name) is not str:
            raise TypeError("name")
        args: List[Tuple[str, Any]] = [("corr", _int(e, "corr")), ("device", dev), ("stream", stream)]
        for key in ("op", "redop", "dtype", "algo", "proto"):
            v = e.get(key)
            if v and type(v) is str:
                args.append((key, v))
        for key in EXTRA_KERNEL_ARGS:
            if key in e:
                args.append((key, e[key] if type(e[key]) in (int, str) else str(e[key])))
        nccl = e.get("nccl") is True and e.get("op") != "sendrecv" and not compute  # P2P: no seq to join on
        m.stats["compute_spans" if compute else "gpu_kernels"] += 1
    else:
        op = e["op"]
        kind = e.get("copy_kind", 0)
        name = f"{op} {COPY_KINDS[kind]}" if op == "memcpy" and kind in COPY_KINDS else str(op)
        nbytes = e.get("nbytes", 0)
        args = [("corr", _int(e, "corr")), ("device", dev), ("stream", stream)]
        if type(nbytes) is int:
            args.append(("bytes", nbytes))
        nccl = False
        m.stats["gpu_memops"] += 1
    launch_tid, launch = e.get("launch_tid", 0), e.get("launch_ns", 0)
    if type(launch_tid) is not int or type(launch) is not int:
        launch_tid = launch = 0
    if launch_tid > 0:
        args.append(("launch_tid", launch_tid))
        if launch > 0:
            args.append(("queued_us", round((raw - launch) / 1e3, 3)))
    m.later(b, p, "g", name[:MAX_NAME_CHARS], (end, dev, stream, args, nccl, raw, launch_tid, launch,
                                               e.get("op") or ""))


def emit(m: "TraceModel", b: int, p: Proc, name: str, payload: tuple) -> None:
    """One GPU slice, released by the reorder heap in start order: joined, then drawn on its stream."""
    end, dev, stream, args, nccl, raw, launch_tid, launch, op = payload
    g = gpu_proc(p)
    fids: List[int] = []
    if nccl:
        chosen = _join(m, g, (dev, stream), raw, launch_tid, launch, op)
        if chosen:
            c = chosen[0]
            args = args + [("comm", c.comm), ("seq", c.seq)]
            if len(chosen) > 1:
                args.append(("collectives", len(chosen)))
            for c in chosen:
                if c.state == 0 and not c.fid:
                    c.fid = m.colls.new_flow()
                if c.state != 2 and c.fid and c.fid not in fids:
                    fids.append(c.fid)
            m.stats["gpu_joined"] += 1
            m.stats["gpu_flows"] += len(fids)
        else:
            m.stats["gpu_unjoined"] += 1
    if end < m.t_from or b > m.t_to:
        return  # outside the window: joined all the same, so that it does not leave its enters to the next
    lanes = g.streams.get((dev, stream))
    if lanes is None:
        n = len(g.streams)
        if n >= MAX_STREAMS:
            lanes = g.streams.get((-1, -1))
            if lanes is None:
                lanes = g.streams[(-1, -1)] = Lanes(m, m.proc_track(p), "GPU streams (more)", 0,
                                                     base=STREAM_ORDER + 10 * (MAX_STREAMS - 1))
        else:
            label = "compute" if dev == COMPUTE_DEVICE else f"GPU {dev} stream {stream}"
            lanes = g.streams[(dev, stream)] = Lanes(m, m.proc_track(p), label, 0, base=STREAM_ORDER + 10 * n)
    t = lanes.pick(b, end)
    if not t.declared:
        m.declare(t)
    m.sink.gpu(t, b, end, name, args, fids)
    m.stats["slices"] += 1


def _join(m: "TraceModel", g: GpuProc, key: Tuple[int, int], raw: int, tid: int, launch: int,
          op: str) -> Optional[List[KEnter]]:
    """The enters (one, or a group's) an NCCL kernel ran; marks them claimed."""
    if tid > 0 and launch > 0:
        q = g.threads.get(tid)
        if not q:
            return None
        lo = launch - MAX_LAUNCH_LAG_NS
        while q and (q[0].claimed or q[0].ts < lo):
            q.popleft()  # run already, or too old for any kernel still to come (they come in start order)
        cands = []
        for c in q:
            if c.ts > launch:
                break
            if not c.claimed:
                cands.append(c)
        chosen, _ = gpujoin.choose(cands, g.stream_comm, key, op)
        if not chosen:
            return None
    else:
        first = gpujoin.by_stream_order(g.by_comm, g.stream_comm.get(key), raw)
        if first is None:
            return None
        chosen = [first]
    for c in chosen:
        c.claimed = True
    return chosen


def slice_flow(p: Proc, ke: Optional[KEnter], new_flow) -> int:
    """The flow id a rank's collective slice carries to its kernel (0: none), decided as it is written."""
    if ke is None:
        return 0
    if not ke.fid and p.gpu is not None and p.gpu.seen:
        ke.fid = new_flow()
    ke.state = 1 if ke.fid else 2
    return ke.fid


def loss(m: "TraceModel", node: str, procs: Dict[int, Proc], e: dict, ts: int) -> None:
    """GpuLoss: the rank's CUPTI shim's cumulative loss counters, as counters under `ccld`."""
    pid = e["pid"]
    p = procs.get(pid) or m.new_proc(node, pid, e["rank"])
    if p.skip:
        return
    gpu_proc(p).seen = True
    for name, value in sorted(e["counters"].items()):
        m.counter(f"rank {p.rank} cupti", str(name), ts, value)
