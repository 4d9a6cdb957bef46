"""GPU kernels joined to the collectives they ran: per rank, enter (host) -> GPU start -> GPU end.

A CollEnter says thread `tid` of a rank called collective (comm, seq) at `ts_ns`; a GpuKernel says
an NCCL kernel ran from `ts_ns` to `end_ns` and was launched by thread `launch_tid` at `launch_ns`
(all node-monotonic ns of the same node, so they compare without clock conversion). The join rule
(which calls a kernel ran, which communicator its stream serves, stream order for a kernel without a
launch record) is ccld/timeline/gpujoin.py, shared with the trace export. Here, live, an enter belongs to the
EARLIEST kernel launched by the same thread at or after it, for the same communicator, whatever the
arrival order: a kernel that arrives late takes back the enters a later kernel had claimed. Calls
grouped into one kernel (coalesced) all get that kernel's times. A kernel that comes before its
enter (BPF records wait up to a poll period in the kernel) waits, bounded, and is retried when an
enter of its thread arrives. P2P kernels (SendRecv) are not joined (P2P events carry no seq).

Caveat: when CUPTI drops a kernel's record (counted in GpuLoss), the next kernel on that thread
and communicator claims its enters too, as if they had been grouped. Times written to CollView are
Unix seconds (ClockTable). Bounds: MAX_ENTERS_PER_THREAD, KEEP_NS, MAX_PROCS; overflow is counted.
"""
from __future__ import annotations

import bisect
import collections
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Optional, Tuple

from ccld import wire as ev
from ccld.timeline import gpujoin
from ccld.timeline.gpujoin import MAX_LAUNCH_LAG_NS

GPU_EVENTS = (ev.GpuKernel, ev.GpuMemop, ev.GpuLoss)
KEEP_NS = 120_000_000_000           # enters older than this behind a thread's newest are forgotten
MAX_ENTERS_PER_THREAD = 8192        # ~minutes of a fast job's collectives on one thread
# (both checked with an eighth of slack, so that forgetting is done in chunks)
MAX_PROCS = 100_000                 # like timeline.MAX_RANKS
MAX_WAITING = 1024                  # kernels per thread that came before their enter (BPF drains later)


@dataclass
class Enter:
    ts: int
    comm: str
    seq: int
    op: str
    rank: int
    launch: Optional[int] = None    # launch_ns of the kernel that claimed it (GPU start if by stream order)
    kernel: Optional[Tuple[str, ev.GpuKernel]] = None  # (agent, kernel) that claimed it

    @property
    def claimed(self) -> bool:
        return self.launch is not None


@dataclass
class Proc:
    ts: Dict[int, List[int]] = field(default_factory=dict)         # tid -> enter times, ascending
    enters: Dict[int, List[Enter]] = field(default_factory=dict)   # tid -> enters, same order
    by_comm: Dict[str, Deque[Enter]] = field(default_factory=dict)  # comm -> enters in call order
    stream_comm: Dict[Tuple[int, int], str] = field(default_factory=dict)  # (device, stream) -> comm
    waiting: Dict[int, Deque[Tuple[str, ev.GpuKernel]]] = field(default_factory=dict)  # tid -> (agent, kernel)


class GpuJoin:
    """Owned by a Timeline (`tl`): reads its clock, communicators and views; writes views' gpu times."""

    def __init__(self, tl: Any):
        self.tl = tl
        self.procs: Dict[Tuple[str, int], Proc] = {}
        self.capture: set = set()  # (node, pid) with CUPTI capture (note_capture)
        self.loss: Dict[Tuple[str, int], Dict[str, int]] = {}   # (node, pid) -> the shim's GpuLoss counters
        self.status: Dict[str, int] = collections.Counter()     # type: ignore[assignment]

    # ---- host side ------------------------------------------------------------------------------
    def note_capture(self, node: str, pid: int) -> None:
        """(node, pid) has CUPTI capture: a cupti ProbeStatus (the shim says so as the rank starts) or a
        GPU record came from it. Only such ranks' NCCL enters are kept for the join (as the export
        does), so a job without CUPTI pays nothing for it: its enters stay rows of their blocks."""
        if len(self.capture) < MAX_PROCS:
            self.capture.add((node, pid))
        elif (node, pid) not in self.capture:
            self.status["procs-over-bound"] += 1

    def capturing(self, node: str, pids) -> bool:
        return any((node, pid) in self.capture for pid in pids)

    def on_enter(self, node: str, e: ev.CollEnter) -> None:
        """A CollEnter the timeline accepted (it is in its collective's view)."""
        if e.backend != "nccl" or e.tid <= 0 or (node, e.pid) not in self.capture:
            return  # only NCCL calls of a rank with CUPTI capture run kernels we see; tid 0: the probe did not say
        rec = self.tl.ranks.get((node, e.pid))
        rank = e.rank if e.rank >= 0 else (rec.rank if rec is not None else -1)
        view = self._view(e.comm, e.seq)
        if view is None or view.enter.get(rank) is None or self._pid_of(e.comm, rank) != (node, e.pid):
            return  # the timeline did not take it (stale pid, evicted, no rank)
        proc = self._proc(node, e.pid)
        if proc is None:
            return
        ts, enters = proc.ts.setdefault(e.tid, []), proc.enters.setdefault(e.tid, [])
        i = bisect.bisect_right(ts, e.ts_ns)
        ts.insert(i, e.ts_ns)
        enter = Enter(e.ts_ns, e.comm, e.seq, e.op, rank)
        enters.insert(i, enter)
        # Forget beyond the bounds in chunks (an eighth of them), not one enter at a time: each cut
        # moves the whole list, which at 8,192 enters a thread was a fifth of a replay's time.
        if len(ts) > MAX_ENTERS_PER_THREAD * 9 // 8 or ts[-1] - ts[0] > KEEP_NS * 9 // 8:
            cut = max(bisect.bisect_left(ts, ts[-1] - KEEP_NS), len(ts) - MAX_ENTERS_PER_THREAD)
            if cut > 0:
                self.status["enters-forgotten"] += sum(1 for x in enters[:cut] if x.launch is None)
                del ts[:cut], enters[:cut]
        q = proc.by_comm.setdefault(e.comm, collections.deque(maxlen=MAX_ENTERS_PER_THREAD))
        q.append(enter)  # not enters[i]: the cut above may have shifted (or removed) index i
        waiting = proc.waiting.get(e.tid)
        if waiting and any(k.launch_ns >= e.ts_ns for _, k in waiting):
            proc.waiting[e.tid] = collections.deque()
            for agent, k in waiting:  # those that still find no enter go back to waiting
                self._by_launch(agent, node, k)

    def _pid_of(self, comm_id: str, rank: int) -> Optional[Tuple[str, int]]:
        comm = self.tl.comms.get(comm_id)
        return comm.pids.get(rank) if comm is not None else None

    def _view(self, comm_id: str, seq: int):
        comm = self.tl.comms.get(comm_id)
        return comm.colls.get(seq) if comm is not None else None

    def _proc(self, node: str, pid: int) -> Optional[Proc]:
        key = (node, pid)
        proc = self.procs.get(key)
        if proc is None:
            if len(self.procs) >= MAX_PROCS:
                self.status["procs-over-bound"] += 1
                return None
            proc = self.procs[key] = Proc()
        return proc

    # ---- GPU side -------------------------------------------------------------------------------
    def apply(self, agent: str, node: str, e: ev.Event) -> None:
        if isinstance(e, ev.GpuLoss):
            self.loss[(node, e.pid)] = dict(e.counters)  # cumulative: the latest replaces the previous
        elif isinstance(e, ev.GpuMemop):
            self.status["memops"] += 1
        elif isinstance(e, ev.GpuKernel):
            if not e.nccl:
                self.status["compute-kernels"] += 1
            elif e.op == "sendrecv":
                self.status["p2p-kernels"] += 1
            elif e.launch_tid > 0 and e.launch_ns > 0:
                self._by_launch(agent, node, e)
            else:
                self._by_stream_order(agent, node, e)

    def _wait(self, node: str, agent: str, k: ev.GpuKernel) -> None:
        """No enter for this kernel yet: its CollEnter may still be on the way (BPF is drained every
        50 ms, a fast kernel can be flushed sooner); it is retried when an enter of its thread comes."""
        proc = self._proc(node, k.pid)
        if proc is None:
            return
        q = proc.waiting.setdefault(k.launch_tid, collections.deque())
        if len(q) >= MAX_WAITING:
            q.popleft()
            self.status["unjoined-no-enter"] += 1  # no host-side event from that thread (no eBPF, or lost)
        q.append((agent, k))

    def _by_launch(self, agent: str, node: str, k: ev.GpuKernel, rerun: bool = False) -> None:
        proc = self.procs.get((node, k.pid))
        ts = proc.ts.get(k.launch_tid) if proc is not None else None
        if not ts:
            self._wait(node, agent, k)
            return
        enters = proc.enters[k.launch_tid]
        cands = enters[bisect.bisect_left(ts, k.launch_ns - MAX_LAUNCH_LAG_NS):bisect.bisect_right(ts, k.launch_ns)]
        # open: unclaimed, or claimed by a later launch (this kernel arrived late), or by this kernel
        chosen, ambiguous = gpujoin.choose(
            cands, proc.stream_comm, (k.device, k.stream), k.op,
            lambda c: c.launch is None or c.launch > k.launch_ns or (c.kernel is not None and c.kernel[1] is k))
        if not chosen:
            self._wait(node, agent, k)
            return
        if ambiguous:
            self.status["ambiguous-streams"] += 1
        robbed = []
        for c in chosen:
            if c.kernel is not None and c.kernel[1] is not k:
                self.status["reassigned"] += 1  # a later kernel had it; this earlier one arrived late
                robbed.append(c.kernel)
            c.launch, c.kernel = k.launch_ns, (agent, k)
            self._record(agent, c, k)
        if not rerun:  # "joins": a kernel robbed by an earlier one and joined again later counts twice
            self.status["joins"] += 1
            if len(chosen) > 1:
                self.status["coalesced-enters"] += len(chosen) - 1
        for other_agent, other in robbed:  # it lost its enters: they were an earlier launch's; look again
            self._by_launch(other_agent, node, other, rerun=True)

    def _by_stream_order(self, agent: str, node: str, k: ev.GpuKernel) -> None:
        proc = self.procs.get((node, k.pid))
        c = None
        if proc is not None:
            c = gpujoin.by_stream_order(proc.by_comm, proc.stream_comm.get((k.device, k.stream)), k.ts_ns)
        if c is None:
            self.status["unjoined-no-launch"] += 1  # neither a launch record nor a known stream, or no call
            return
        c.launch, c.kernel = k.ts_ns, (agent, k)  # a kernel launched before its GPU start may still take it
        self._record(agent, c, k)
        self.status["joined-by-stream-order"] += 1

    def _record(self, agent: str, c: Enter, k: ev.GpuKernel) -> None:
        view = self._view(c.comm, c.seq)
        if view is None:
            self.status["view-gone"] += 1  # the collective fell out of the timeline's bound
            return
        to_unix = self.tl.clock.to_unix
        view.gpu_start[c.rank] = to_unix(agent, k.ts_ns)
        view.gpu_end[c.rank] = to_unix(agent, k.end_ns)

    # ---- questions ------------------------------------------------------------------------------
    def span(self, comm: str, seq: int, rank: int) -> Optional[Tuple[float, Optional[float], Optional[float]]]:
        """(host enter, GPU start, GPU end) of one rank in collective (comm, seq), Unix s; None if not entered."""
        view = self._view(comm, seq)
        if view is None or rank not in view.enter:
            return None
        return view.enter[rank], view.gpu_start.get(rank), view.gpu_end.get(rank)

    def kernels_joined(self) -> int:
        """Distinct kernels that hold at least one collective now (walks every kept enter: for tests)."""
        return len({id(c.kernel[1]) for p in self.procs.values() for es in p.enters.values() for c in es
                    if c.kernel is not None})

    def counters(self) -> Dict[str, Any]:
        lost = collections.Counter()
        for c in self.loss.values():
            for k in ("cupti_dropped", "queue_dropped", "records_dropped_send", "no_launch", "callback_errors"):
                lost[k] += c.get(k, 0)
        waiting = sum(len(q) for p in self.procs.values() for q in p.waiting.values())
        return {"join": dict(self.status), "kernels_waiting_for_enter": waiting, "shim_loss": dict(lost),
                "ranks_reporting": len(self.loss)}
