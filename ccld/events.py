"""The wire schema between agents and the collector: one frozen class per event kind.

A frame is one MessagePack map (an *envelope*) holding a batch of events:

    {"v": [MAJOR, MINOR], "agent": str, "node": str, "batch": int, "events": [{"k": KIND, ...}, ...],
     "blocks": [...]}

Any MessagePack reader can decode a frame; every event is a plain map whose "k" names its kind, except
the hot collective kinds, which travel as column blocks (optional key "blocks", since 1.4; blocks.py).
Optional "resend": true, before "events" (also 1.4): the sender numbers its batches 1, 2, 3... per
agent id and may send a frame again (its spool replays what the collector did not acknowledge), so
the collector keeps one copy per (agent, batch) (collector/acks.py); unmarked frames are never deduplicated.
Times: every `ts_ns` is CLOCK_MONOTONIC nanoseconds of the node that made the event (BPF's
bpf_ktime_get_ns and Python's time.monotonic_ns share that clock). Nothing here converts clocks:
the collector does that in one place (`collector.clock`), from the agent's `clock` samples.

Compatibility: a frame with a newer MAJOR is rejected with a clear error; a newer MINOR is read,
unknown fields are ignored, and events of an unknown kind are skipped and counted.
Bounds on hostile input: at most MAX_FRAME_BYTES and MAX_EVENTS_PER_FRAME events per frame; every bad
event is counted by reason, the first MAX_ERRORS_KEPT with their message; values shown in messages
are shortened.
Field names follow PyTorch's vocabulary (process group, seq, group size, count, dtype) so traces
join with Flight Recorder and Kineto.
"""
from __future__ import annotations

import dataclasses
import reprlib
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional, Tuple, Type

import msgpack

from ccld.errors import CcldError

SCHEMA_MAJOR = 1
SCHEMA_MINOR = 6  # 1.1 added link, sched, qp and nic; 1.2 gpu_kernel, gpu_memop, gpu_loss (CUPTI); 1.3 clock_sync;
                  # 1.4 column blocks (blocks.py) for coll/start/end; the envelope's "resend" flag;
                  # 1.5 p2p_end, P2P's seq/nbytes/lib_seq, CollEnter's lib_seq, CommInit's seq_source;
                  # 1.6 RankExit's exact, signal and by_launcher
# CommInit.seq_source: how a rank numbers `seq` (collectives) and P2P.seq on that communicator
SEQ_LIBRARY = "library"      # the library's own collective counter (gloo: c10d's tag): exact, also mid-run
SEQ_FROM_INIT = "counted"    # counted by the agent from the group's creation: exact
SEQ_FROM_ATTACH = "attach"   # counted from the first call the agent saw: ranks may be offset (attached mid-run)
MAX_FRAME_BYTES = 4 * 1024 * 1024  # agents send <= 2,048 events (~300 KiB) a frame; 4 MiB bounds a hostile one
# 32x the shipper's MAX_BATCH. Checked by the MessagePack reader before it allocates anything: a
# 16 MiB frame of 16M one-byte junk events once took 7 GiB and 80 s to reject.
MAX_EVENTS_PER_FRAME = 65_536
MAX_ERRORS_KEPT = 32  # bad events of one frame kept with their message; all of them are counted by reason


class FrameError(CcldError):
    """A frame that cannot be read. `reason` is a short stable tag used to count rejections."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


_WIRE_NAMES: Dict[type, Tuple[str, ...]] = {}


@dataclass(frozen=True)
class Event:
    KIND: ClassVar[str] = ""

    def to_wire(self) -> Dict[str, Any]:
        # Not dataclasses.asdict: it deep-copies recursively and was the agent's biggest per-event cost.
        names = _WIRE_NAMES.get(type(self))
        if names is None:
            names = _WIRE_NAMES[type(self)] = tuple(f.name for f in dataclasses.fields(self))
        d = {"k": self.KIND}
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
    `seq_source` says how this rank numbers its collectives and p2p ops there (SEQ_*; "" before 1.5)."""
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


EVENT_TYPES: Dict[str, Type[Event]] = {
    cls.KIND: cls
    for cls in (AgentHello, ClockSample, RankInfo, RankExit, RankState, CommInit,
                CollEnter, WorkStart, WorkEnd, P2P, P2PEnd, ProbeStatus, LossCounters,
                LinkStats, SchedStats, QpInfo, NicCounters,
                GpuKernel, GpuMemop, GpuLoss, ClockSync)
}

_FIELDS: Dict[str, Tuple[Dict[str, Any], Dict[str, Any]]] = {}


def _fields(cls: Type[Event]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(required fields, optional fields) of an event class, each name -> declared type string."""
    got = _FIELDS.get(cls.KIND)
    if got is None:
        req, opt = {}, {}
        for f in dataclasses.fields(cls):
            has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            (opt if has_default else req)[f.name] = f.type
        got = _FIELDS[cls.KIND] = (req, opt)
    return got


_TYPE_CHECKS = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "bool": lambda v: isinstance(v, bool),
}


class _ShortRepr(reprlib.Repr):
    """repr() of hostile values for error messages: short, and safe on deeply nested ones."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother = 3, 60, 60
        self.maxlist = self.maxtuple = self.maxdict = 4

    def repr_bytes(self, x: bytes, level: int) -> str:
        return repr(x[:self.maxstring]) + ("..." if len(x) > self.maxstring else "")


_show = _ShortRepr().repr


def _type_problem(declared: str, value: Any) -> Optional[str]:
    """None when `value` matches the declared type string (e.g. "Dict[str, int]"), else what it is."""
    check = _TYPE_CHECKS.get(declared)
    if check is not None:
        return None if check(value) else type(value).__name__
    base, _, inner = declared.partition("[")
    inner = inner[:-1]
    if base == "List":
        if not isinstance(value, list):
            return type(value).__name__
        for x in value if inner else ():
            if _type_problem(inner, x):
                return f"a list holding a {type(x).__name__}"
        return None
    if base == "Dict":
        if not isinstance(value, dict):
            return type(value).__name__
        kt, _, vt = inner.partition(", ")
        for k, v in value.items():  # elements are checked too: they end up in stats.json and reports
            if kt and _type_problem(kt, k):
                return f"a dict with a {type(k).__name__} key"
            if vt and _type_problem(vt, v):
                return f"a dict with a {type(v).__name__} value"
    return None


def _check_type(kind: str, name: str, declared: str, value: Any) -> None:
    got = _type_problem(declared, value)
    if got is not None:
        raise FrameError("bad-field", f"event {kind!r}: field {name!r} should be {declared}, got {got}")


_SIMPLE = {"int": int, "str": str, "bool": bool}
# kind -> (class, ((name, exact type or None, declared), ...) required, same for optional, defaults)
_SPECS: Dict[str, Tuple[type, tuple, tuple, Dict[str, Any], tuple]] = {}


def _spec(cls: Type[Event]):
    """How to read one kind, worked out once: the hot path of the collector (~1 µs an event) is here."""
    got = _SPECS.get(cls.KIND)
    if got is None:
        req, opt = _fields(cls)
        defaults, factories = {}, []
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                defaults[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                factories.append((f.name, f.default_factory))
        got = _SPECS[cls.KIND] = (cls, tuple((n, _SIMPLE.get(t), t) for n, t in req.items()),
                                  tuple((n, _SIMPLE.get(t), t) for n, t in opt.items()), defaults, tuple(factories))
    return got


def event_from_wire(d: Any) -> Event:
    """Build one event from its wire map. Raises FrameError (reason 'unknown-kind' for kinds newer than us)."""
    if type(d) is not dict:
        raise FrameError("bad-event", f"event is a {type(d).__name__}, not a map")
    if "k" not in d:
        raise FrameError("missing-field", "event has no kind (field 'k')")
    kind = d["k"]
    if type(kind) is not str:  # also keeps unhashable kinds (lists, maps) out of the dict lookup
        raise FrameError("bad-field", f"event kind (field 'k') should be str, got {type(kind).__name__}")
    cls = EVENT_TYPES.get(kind)
    if cls is None:
        raise FrameError("unknown-kind", f"unknown event kind {_show(kind)}")
    cls, req, opt, defaults, factories = _spec(cls)
    args = dict(defaults)
    for name, exact, declared in req:
        if name not in d:
            raise FrameError("missing-field", f"event {kind!r}: missing field {name!r}")
        v = d[name]
        # type(v) is int: exact types, so True is not an int and a subclass cannot sneak in
        if type(v) is not exact and (exact is not None or _type_problem(declared, v) is not None):
            _check_type(kind, name, declared, v)
        args[name] = v
    for name, exact, declared in opt:
        if name in d:
            v = d[name]
            if type(v) is not exact and (exact is not None or _type_problem(declared, v) is not None):
                _check_type(kind, name, declared, v)
            args[name] = v
    for name, factory in factories:
        if name not in args:
            args[name] = factory()
    # Not cls(**args): a frozen dataclass's __init__ sets each field through object.__setattr__, which
    # was a third of the decode. Every field is set here, validated, so the instance is the same.
    e = object.__new__(cls)
    e.__dict__.update(args)
    return e  # unknown fields are ignored on purpose: a newer minor version may add some


class Batch:
    """One decoded frame. `plain` holds the events that came as maps, `blocks` the column blocks
    (blocks.py); `events` is every event in frame order, built from the blocks on first use (the
    timeline reads `plain` and `blocks` directly and never pays for that)."""
    __slots__ = ("agent", "node", "batch", "version", "plain", "blocks", "skipped", "errors", "bad_counts", "_all")

    def __init__(self, agent: str, node: str, batch: int, version: Tuple[int, int], events: List[Event],
                 skipped: int = 0, errors: Optional[List[FrameError]] = None,
                 bad_counts: Optional[Dict[str, int]] = None, blocks: Optional[list] = None):
        self.agent, self.node, self.batch, self.version = agent, node, batch, version
        self.plain = events
        self.blocks = blocks or []
        self.skipped = skipped  # events of kinds this reader does not know (newer minor versions)
        self.errors = errors if errors is not None else []  # bad events dropped; the rest of the frame is kept
        self.bad_counts = bad_counts if bad_counts is not None else {}  # every bad event by reason (errors keeps the first few)
        self._all: Optional[List[Event]] = None

    @property
    def events(self) -> List[Event]:
        if not self.blocks:
            return self.plain
        if self._all is None:
            out: List[Event] = []
            for item in _blocks.in_order(self.plain, self.blocks):
                if type(item) is tuple:
                    out.extend(_blocks.run_rows(*item))
                else:
                    out.append(item)
            self._all = out
        return self._all

    def __len__(self) -> int:
        """Events in the frame (without building them)."""
        return len(self.plain) + sum(b.n for b in self.blocks)


def encode_batch(agent: str, node: str, batch: int, events: List[Event], columns: bool = True,
                 resend: bool = False) -> bytes:
    """One frame. With `columns` (the default) the hot collective kinds go as column blocks (1.4);
    `resend` marks a frame its sender may send again (deduplicated by the collector)."""
    if columns:
        plain, blocks = _blocks.split(events)
    else:
        plain, blocks = [e.to_wire() for e in events], []
    env = {"v": [SCHEMA_MAJOR, SCHEMA_MINOR], "agent": agent, "node": node, "batch": batch}
    if resend:
        env["resend"] = True  # before "events": the collector reads it without walking the events
    env["events"] = plain
    if blocks:
        env["blocks"] = blocks
    return msgpack.packb(env, use_bin_type=True)


def decode_batch(frame: bytes) -> Batch:
    """Decode and validate one frame. Raises FrameError naming what was wrong; never anything else."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise FrameError("bad-frame", f"frame is a {type(frame).__name__}, not bytes")
    if len(frame) == 0:
        raise FrameError("empty", "empty frame")
    if len(frame) > MAX_FRAME_BYTES:
        raise FrameError("too-large", f"frame of {len(frame)} bytes is over the {MAX_FRAME_BYTES}-byte limit")
    try:
        env = msgpack.unpackb(frame, raw=False, strict_map_key=False, max_array_len=MAX_EVENTS_PER_FRAME)
    except msgpack.exceptions.ExtraData:
        raise FrameError("trailing-bytes", "frame has bytes after its MessagePack map") from None
    except (ValueError, msgpack.exceptions.UnpackException) as e:
        if "max_array_len" in str(e):
            raise FrameError("too-many-items", f"frame has an array of more than {MAX_EVENTS_PER_FRAME} items "
                                               f"(the most events a frame may carry): {e}") from None
        reason = "truncated" if "incomplete" in str(e).lower() or isinstance(
            e, msgpack.exceptions.OutOfData) else "not-msgpack"
        detail = str(e) or type(e).__name__  # StackError (nesting too deep) has no message of its own
        raise FrameError(reason, f"frame is not valid MessagePack ({reason}): {detail}") from None
    except Exception as e:  # msgpack raises a few other types on hostile input (e.g. TypeError for bad keys)
        raise FrameError("not-msgpack", f"frame is not valid MessagePack: {type(e).__name__}: {e}") from None
    if not isinstance(env, dict):
        raise FrameError("bad-envelope", f"frame is a MessagePack {type(env).__name__}, not a map")
    v = env.get("v")
    if (not isinstance(v, (list, tuple)) or len(v) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in v)):
        raise FrameError("no-version", f"frame has no valid schema version 'v' (got {_show(v)})")
    if v[0] > SCHEMA_MAJOR:
        raise FrameError("newer-major",
                         f"frame has schema version {v[0]}.{v[1]}, newer than this collector's "
                         f"{SCHEMA_MAJOR}.{SCHEMA_MINOR}; upgrade the collector")
    if v[0] < SCHEMA_MAJOR:
        raise FrameError("older-major", f"frame has schema version {v[0]}.{v[1]}, no longer supported "
                                        f"(this collector reads {SCHEMA_MAJOR}.x)")
    for key, typ in (("agent", str), ("node", str), ("batch", int), ("events", list)):
        got = env.get(key)
        if not isinstance(got, typ) or isinstance(got, bool):
            raise FrameError("bad-envelope", f"frame envelope field {key!r} is missing or not a {typ.__name__} "
                                             f"(got {type(got).__name__})")
    events, skipped, errors, bad_counts = [], 0, [], {}
    for i, raw in enumerate(env["events"]):
        try:
            events.append(event_from_wire(raw))
        except FrameError as e:
            if e.reason == "unknown-kind" and v[1] > SCHEMA_MINOR:
                skipped += 1  # a newer minor version may add kinds; skip them, count them
                continue
            # One bad event must not cost the good ones beside it: drop it, say which and why.
            bad_counts[e.reason] = bad_counts.get(e.reason, 0) + 1
            if len(errors) < MAX_ERRORS_KEPT:
                errors.append(FrameError(e.reason, f"agent {_show(env['agent'])} batch {env['batch']} "
                                                   f"event #{i}: {e}"))
    blocks: list = []
    if "blocks" in env:
        blocks, more = _blocks.read_blocks(env["blocks"], len(env["events"]), v[1], env["agent"], env["batch"],
                                           errors, bad_counts)
        skipped += more
    return Batch(env["agent"], env["node"], env["batch"], (v[0], v[1]), events, skipped, errors, bad_counts, blocks)


from ccld import blocks as _blocks  # noqa: E402  (blocks.py reads this module's classes; imported last)
