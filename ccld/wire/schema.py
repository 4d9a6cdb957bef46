"""The wire schema between agents and the collector: one frozen class per event kind.

Every event is a frozen dataclass whose KIND names it on the wire ("k"); its fields, in order, are
its wire fields, with their declared types (int, str, bool, List[...], Dict[...]) checked when a
frame is read (validate.py). A field with a default may be missing from a frame (older senders).
Times: every `ts_ns` is CLOCK_MONOTONIC nanoseconds of the node that made the event (BPF's
bpf_ktime_get_ns and Python's time.monotonic_ns share that clock). Nothing here converts clocks:
the collector does that in one place (`timeline.clock`), from the agent's `clock` samples.
Compatibility: a frame with a newer MAJOR is rejected; a newer MINOR is read, unknown fields ignored,
events of an unknown kind skipped and counted (codec.py; readers of 1.7 refuse 1.8's packed columns,
readers of 1.8 skip 1.9's tables: blocks.py). Field names: PyTorch's (process group, seq, group size,
count, dtype): traces join with Flight Recorder and Kineto.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Tuple, Type

SCHEMA_MAJOR = 1
SCHEMA_MINOR = 9  # 1.1 link, sched, qp, nic; 1.2 gpu_kernel, gpu_memop, gpu_loss; 1.3 clock_sync; 1.4 column
                  # blocks, "resend"; 1.5 p2p_end, P2P's seq/nbytes/lib_seq, CollEnter's lib_seq, CommInit's seq_source;
                  # 1.6 RankExit's fields; 1.7 net_progress, compute; 1.8 packed columns, subgroup; 1.9 tables
# CommInit.seq_source: how a rank numbers `seq` (collectives) and P2P.seq on that communicator
SEQ_LIBRARY = "library"      # the library's own collective counter (gloo: c10d's tag): exact, also mid-run
SEQ_FROM_INIT = "counted"    # counted by the agent from the group's creation: exact
SEQ_FROM_ATTACH = "attach"   # counted from the first call the agent saw: ranks may be offset (attached mid-run)

_WIRE_NAMES: Dict[type, Tuple[str, ...]] = {}


@dataclass(frozen=True)
class Event:
    KIND: ClassVar[str] = ""

    def to_wire(self) -> Dict[str, Any]:
        # Not dataclasses.asdict: it deep-copies recursively and was the agent's biggest per-event cost.
        names = _WIRE_NAMES.get(type(self))
        if names is None:
            names = _WIRE_NAMES[type(self)] = tuple(f.name for f in dataclasses.fields(self))
        d: Dict[str, Any] = {"k": self.KIND}
        for n in names:
            d[n] = getattr(self, n)
        return d


@dataclass(frozen=True)
class AgentHello(Event):
    """First event of every agent connection: who is sending and which sources are active."""
    KIND: ClassVar[str] = "hello"
    agent: str
    node: str
    pid: int
    version: str
    sources: List[str]
    ts_ns: int


@dataclass(frozen=True)
class ClockSample(Event):
    """A (monotonic, wall) pair read back to back on the agent's node: the basis of clock conversion."""
    KIND: ClassVar[str] = "clock"
    mono_ns: int
    wall_ns: int
    ts_ns: int = 0


@dataclass(frozen=True)
class ClockSync(Event):
    """This node's clock measured against the collector's by timestamped round trips (NTP-style, the
    agent's ccld/tracer/timesync.py): collector Unix ns = t + offset_ns + drift_ppb * (t - ref_ns) / 1e9
    for a time t of this node's clock (the clock of every ts_ns it sends). `uncertainty_ns` bounds the
    error: half the smallest round trip plus the fit's residual. `epoch` names the time service
    instance (a restarted collector starts a new fit). Sent with every frame once an estimate exists."""
    KIND: ClassVar[str] = "clock_sync"
    ts_ns: int          # when the estimate was made (this node's clock)
    ref_ns: int         # this node's time at which offset_ns holds (the newest sample)
    offset_ns: int      # collector Unix ns minus this node's ns, at ref_ns
    drift_ppb: int      # how fast the offset grows: ns per s of this node's clock
    uncertainty_ns: int
    rtt_min_ns: int = 0     # smallest round trip in the fit's window
    residual_ns: int = 0    # RMS of the fit's residuals
    samples: int = 0        # round trips (best of each burst) in the fit
    epoch: int = 0


@dataclass(frozen=True)
class RankInfo(Event):
    """A training process was found (announced again whenever it is re-discovered)."""
    KIND: ClassVar[str] = "rank"
    pid: int
    rank: int
    world_size: int
    local_rank: int
    node: str
    job: str
    ts_ns: int
    master_addr: str = ""
    master_port: int = 0
    cmdline: str = ""
    libs: Dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RankExit(Event):
    """A rank's process is gone (reason "exited"), or no longer traced ("agent stopped"). `exact`: ts_ns
    is when its main thread exited, from the kernel (sched_process_exit); else when the agent found it
    gone (its /proc scan: up to a scan interval late). `signal`: the first signal whose default action
    ends a process that it was sent (0: none seen, e.g. it exited by itself or crashed in Python);
    `by_launcher`: that signal came from its parent process (torchrun stopping its workers)."""
    KIND: ClassVar[str] = "rank_exit"
    pid: int
    rank: int
    ts_ns: int
    reason: str = "exited"
    exact: bool = False
    signal: int = 0
    by_launcher: bool = False


@dataclass(frozen=True)
class RankState(Event):
    """What a rank's process is doing, from /proc: state letter (R/S/D/T/t/Z), kernel wait channel, CPU time."""
    KIND: ClassVar[str] = "proc"
    pid: int
    rank: int
    ts_ns: int
    state: str
    wchan: str = ""
    cpu_ns: int = 0


@dataclass(frozen=True)
class CommInit(Event):
    """A communicator (process group) was created in a rank. `comm` is its cross-rank identity.
    `seq_source` says how this rank numbers its collectives and p2p ops there (SEQ_*; "" before 1.5);
    `subgroup` (1.8), that a group of unknown size (-1, which stands for the world's) is not the world."""
    KIND: ClassVar[str] = "comm"
    pid: int
    rank: int
    ts_ns: int
    backend: str
    comm: str
    group_rank: int
    group_size: int
    handle: int = 0
    seq_source: str = ""
    subgroup: bool = False


@dataclass(frozen=True)
class CollEnter(Event):
    """A rank called collective `seq` of communicator `comm` (the Python thread reached the library).
    `seq` counts collectives only: the same number on every member for one collective. `lib_seq` is
    the library's own call counter where it differs (c10d's per-group seq, which counts p2p ops too)."""
    KIND: ClassVar[str] = "coll"
    pid: int
    rank: int
    ts_ns: int
    backend: str
    comm: str
    seq: int
    op: str
    tid: int = 0
    count: int = -1
    dtype: str = ""
    root: int = -1
    nbytes: int = -1
    lib_seq: int = -1


@dataclass(frozen=True)
class WorkStart(Event):
    """The library began running collective (comm, seq) in this rank (gloo worker thread / NCCL kernel)."""
    KIND: ClassVar[str] = "start"
    pid: int
    rank: int
    ts_ns: int
    comm: str
    seq: int


@dataclass(frozen=True)
class WorkEnd(Event):
    """Collective (comm, seq) finished in this rank; ok=False when the library reported an error."""
    KIND: ClassVar[str] = "end"
    pid: int
    rank: int
    ts_ns: int
    comm: str
    seq: int
    ok: bool = True
    error: str = ""


@dataclass(frozen=True)
class P2P(Event):
    """A point-to-point call (send/recv) of a rank to `peer` (a group rank of `comm`), when it was
    posted. `seq` numbers this rank's ops of one direction with one peer on `comm` (its n-th send to
    peer, or n-th recv from peer, from 1): the n-th send a->b pairs with the n-th recv on b from a.
    -1: not numbered (recv from any source, or an agent before 1.5)."""
    KIND: ClassVar[str] = "p2p"
    pid: int
    rank: int
    ts_ns: int
    backend: str
    comm: str
    op: str
    peer: int
    tag: int = 0
    count: int = -1
    dtype: str = ""
    seq: int = -1
    nbytes: int = -1
    lib_seq: int = -1


@dataclass(frozen=True)
class P2PEnd(Event):
    """The p2p op (comm, op, peer, seq) of P2P is over in this rank: the wait on it returned (ok) or
    failed. `wait_ns` is when the rank began waiting on it (0: not seen); a rank blocked in a send or
    recv is one with a P2P and no P2PEnd."""
    KIND: ClassVar[str] = "p2p_end"
    pid: int
    rank: int
    ts_ns: int
    comm: str
    op: str
    peer: int
    seq: int
    ok: bool = True
    error: str = ""
    wait_ns: int = 0


@dataclass(frozen=True)
class ProbeStatus(Event):
    """The outcome of attaching (or detaching) one probe family to one process."""
    KIND: ClassVar[str] = "probe"
    pid: int
    family: str
    ok: bool
    ts_ns: int
    target: str = ""
    attached: int = 0
    message: str = ""


@dataclass(frozen=True)
class LossCounters(Event):
    """Cumulative loss counters of one agent (e.g. ringbuf_lost, queue_dropped, decode_errors)."""
    KIND: ClassVar[str] = "loss"
    ts_ns: int
    counters: Dict[str, int]


@dataclass(frozen=True)
class LinkStats(Event):
    """One TCP connection of a rank, as this side sees it: cumulative counters since the agent first
    saw it, sent whenever they change (so a lost frame loses no bytes, only resolution).
    Addresses are text (IPv4 dotted or IPv6); ports are host order; `srtt_us`/`cwnd` are the latest
    sample (0 when none); `last_tx_ns`/`last_rx_ns` are this node's CLOCK_MONOTONIC."""
    KIND: ClassVar[str] = "link"
    pid: int
    rank: int
    ts_ns: int
    saddr: str
    sport: int
    daddr: str
    dport: int
    tx_bytes: int = 0
    rx_bytes: int = 0
    tx_calls: int = 0
    rx_calls: int = 0
    tx_errs: int = 0
    rx_errs: int = 0
    retrans: int = 0
    resets: int = 0
    srtt_us: int = 0
    cwnd: int = 0
    state: str = ""
    last_tx_ns: int = 0
    last_rx_ns: int = 0
    closed: bool = False


@dataclass(frozen=True)
class SchedStats(Event):
    """CPU scheduling of one rank's threads, cumulative: time spent runnable but waiting for a CPU
    (runqueue), time off CPU while blocked, and the longest single runqueue wait since the last report."""
    KIND: ClassVar[str] = "sched"
    pid: int
    rank: int
    ts_ns: int
    runq_ns: int = 0
    runq_waits: int = 0
    runq_max_ns: int = 0
    offcpu_ns: int = 0
    switches: int = 0


@dataclass(frozen=True)
class QpInfo(Event):
    """An RDMA queue pair of a rank was created or moved to a new state (libibverbs control path).
    `dgid` is the remote GID as 32 hex digits ("" when not known), `dest_qp_num` the remote QP."""
    KIND: ClassVar[str] = "qp"
    pid: int
    rank: int
    ts_ns: int
    qp_num: int
    state: str = ""
    dest_qp_num: int = -1
    dgid: str = ""
    dlid: int = -1
    port: int = -1
    call: str = ""
    device: str = ""   # the NIC (e.g. mlx5_0): ties the QP to that port's NicCounters


@dataclass(frozen=True)
class NicCounters(Event):
    """Counters of one InfiniBand/RoCE port from /sys/class/infiniband/DEV/ports/PORT/counters
    (cumulative, as the NIC reports them)."""
    KIND: ClassVar[str] = "nic"
    ts_ns: int
    device: str
    port: int
    counters: Dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class GpuKernel(Event):
    """A kernel ran on a rank's GPU (CUPTI activity, captured in the rank by ccld's shim).
    `ts_ns`/`end_ns`: GPU start and end; `launch_ns`: when the host thread `launch_tid` (a kernel
    thread id, like CollEnter.tid) called the launch; all this node's CLOCK_MONOTONIC, converted by the
    shim (ccld/cupti/clock.py). `launch_tid` 0: its launch record was not seen. `corr` is CUPTI's
    correlation id. op/redop/dtype/algo/proto are read from an NCCL kernel's name ("" if it does not say)."""
    KIND: ClassVar[str] = "gpu_kernel"
    pid: int
    rank: int
    ts_ns: int
    end_ns: int
    device: int
    stream: int
    corr: int
    name: str
    launch_tid: int = 0
    launch_ns: int = 0
    nccl: bool = False
    op: str = ""
    redop: str = ""
    dtype: str = ""
    algo: str = ""
    proto: str = ""


@dataclass(frozen=True)
class GpuMemop(Event):
    """A memcpy or memset ran on a rank's GPU (`op`); times and launch as in GpuKernel. `copy_kind` is
    CUPTI's CUpti_ActivityMemcpyKind (8 = device to device), 0 for memsets."""
    KIND: ClassVar[str] = "gpu_memop"
    pid: int
    rank: int
    ts_ns: int
    end_ns: int
    device: int
    stream: int
    corr: int
    op: str
    nbytes: int = 0
    copy_kind: int = 0
    launch_tid: int = 0
    launch_ns: int = 0


@dataclass(frozen=True)
class GpuLoss(Event):
    """Cumulative counters of one rank's CUPTI shim: records CUPTI dropped (cupti_dropped), dropped
    from its queue (queue_dropped) or on the way to the agent (records_dropped_send), kernels left out by
    the NCCL filter (kernels_filtered), activities without a launch record (no_launch), and so on."""
    KIND: ClassVar[str] = "gpu_loss"
    pid: int
    rank: int
    ts_ns: int
    counters: Dict[str, int] = field(default_factory=dict)



@dataclass(frozen=True)
class NetProgress(Event):
    """How one rank's transfers to (send) or from (recv) one peer of communicator `comm` moved on one
    NCCL channel over an interval ending at `ts_ns`, from NCCL's proxy steps (ccld's NCCL profiler
    plugin sums them in the rank; never one event per step). `nbytes`/`steps`: what completed in the
    interval; `net_wait_ns`: summed time its steps waited on the network (the peer), `gpu_wait_ns`:
    on the GPU (data not ready, or a flush); `in_flight`: steps posted and not done at `ts_ns`;
    `last_ns`: when a step last moved (0: none yet). `peer` is a rank of `comm` (group rank). All
    times this node's CLOCK_MONOTONIC ns."""
    KIND: ClassVar[str] = "net_progress"
    pid: int
    rank: int
    ts_ns: int
    comm: str
    peer: int
    send: bool
    channel: int = 0
    nbytes: int = 0
    steps: int = 0
    net_wait_ns: int = 0
    gpu_wait_ns: int = 0
    in_flight: int = 0
    last_ns: int = 0


@dataclass(frozen=True)
class ComputeSpan(Event):
    """A rank ran compute op `name` from ts_ns to end_ns (this node's CLOCK_MONOTONIC ns): a row of a
    per-op table or a record_function range of a Kineto trace, read offline (diagnose/opframes.py).
    `n` numbers this rank's runs of `name` from 1 (the n-th run on one rank compares with the n-th on
    the others); -1: not numbered. Not a GPU kernel: those are GpuKernel."""
    KIND: ClassVar[str] = "compute"
    pid: int
    rank: int
    ts_ns: int
    end_ns: int
    name: str
    n: int = -1


EVENT_TYPES: Dict[str, Type[Event]] = {
    cls.KIND: cls
    for cls in (AgentHello, ClockSample, RankInfo, RankExit, RankState, CommInit,
                CollEnter, WorkStart, WorkEnd, P2P, P2PEnd, ProbeStatus, LossCounters,
                LinkStats, SchedStats, QpInfo, NicCounters,
                GpuKernel, GpuMemop, GpuLoss, ClockSync, NetProgress, ComputeSpan)
}

_FIELDS: Dict[str, Tuple[Dict[str, str], Dict[str, str]]] = {}


def field_types(cls: Type[Event]) -> Tuple[Dict[str, str], Dict[str, str]]:
    """(required fields, optional fields) of an event class, each name -> declared type string."""
    got = _FIELDS.get(cls.KIND)
    if got is None:
        req: Dict[str, str] = {}
        opt: Dict[str, str] = {}
        for f in dataclasses.fields(cls):
            has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            (opt if has_default else req)[f.name] = str(f.type)
        got = _FIELDS[cls.KIND] = (req, opt)
    return got
