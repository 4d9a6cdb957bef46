"""The agent's end of ccld's NCCL profiler plugin: a Unix datagram socket, datagrams -> wire events.

Ranks started by `ccld run` load libnccl-profiler-ccld.so (ccld/ncclprof/), which sends fixed-size
records in datagrams (ccld/ncclprof/format.py) every ~100 ms. Each becomes: CommInit (seq_source
"library": the plugin is loaded at each communicator's creation, so its collectives are numbered from
the first one on every member: ncclprof_seq.py; NCCL's own per-function number rides as lib_seq),
CollEnter when a collective started, WorkStart when its first kernel channel started on the GPU, WorkEnd when
it completed, P2P / P2PEnd for sends and receives (numbered per peer and direction by the plugin),
NetProgress per link and interval, a ProbeStatus of family "ncclprof" when a rank's plugin goes on or
off, and LossCounters-style counters (the plugin's drops) in `loss()`.

Communicators are named `<job>/nccl:<NCCL's commHash as 16 hex digits>`; the job comes from the
rank's environment (discovery), like every other event of that rank. A datagram from a process the
agent cannot identify yet (its /proc scan has not run) waits here, up to HOLD_S, then is converted
with the plugin's RANK and the job "job". Times are the rank's CLOCK_MONOTONIC ns (the plugin reads
that clock), nothing is re-stamped. The socket is bound in a fresh 0700 directory; a datagram that
does not parse is counted by reason, never fatal; `poll()` never blocks.
"""
from __future__ import annotations

import collections
import os
import shutil
import socket
import stat
import tempfile
import threading
import time
from typing import Callable, Deque, Dict, List, Mapping, Optional, Tuple

import numpy as np

from ccld import wire as ev
from ccld.bpf.rows import KIND_COLL, KIND_END, KIND_START, Builder, Groups, group_keys
from ccld.cupti.shim import gpu_present
from ccld.errors import CcldError
from ccld.tracer.ncclprof_seq import CollNumbering

RCVBUF_BYTES = 8 * 1024 * 1024  # datagrams queued for us; beyond it the plugins' sends fail (counted there)
MAX_DATAGRAM = 65_536           # the plugin sends <= 60 KiB
MAX_PER_POLL = 512              # datagrams handled per poll, so one flood cannot starve the BPF drain
MAX_INBOX = 8192                # datagrams read and not yet handled (~20 s of 32 ranks); beyond: dropped, counted
READ_TIMEOUT_S = 0.2            # the reader thread's wait, so that close() ends it soon
HOLD_S = 2.0                    # a datagram from a pid not yet identified waits this long for discovery
MAX_HELD = 1024                 # datagrams held in all (beyond: converted at once with what the plugin said)
MAX_PIDS = 65_536

ENV_PLUGIN = "NCCL_PROFILER_PLUGIN"     # NCCL's: which profiler plugin to load
ENV_ENDPOINT = "CCLD_NCCLPROF_ENDPOINT"  # the plugin's: where to send
ENV_CHAIN = "CCLD_NCCLPROF_CHAIN"       # the plugin's: the user's own plugin, called after ours
ENV_MODE = "CCLD_NCCLPROF"              # ccld run's: "off" leaves NCCL_PROFILER_PLUGIN alone
ENV_FORCE = "CCLD_NCCLPROF_FORCE"       # "1": inject without a GPU (tests drive the plugin themselves)
ENV_LIB = "CCLD_NCCLPROF_LIB"           # another build of the plugin to inject (default: setup's)

Ident = Tuple[int, str]  # (global rank, job)


class NcclProfSink:
    def __init__(self, emit: Callable[[ev.Event], None],
                 ident_of: Callable[[int], Optional[Ident]] = lambda pid: None,
                 mono_ns: Callable[[], int] = time.monotonic_ns, path: Optional[str] = None):
        """`path`: a socket path of the caller's (`ccld agent --nccl-plugin-socket`: jobs started
        elsewhere send there; whoever may write to it may send events); default a fresh private one."""
        self.emit, self.ident_of, self.mono_ns = emit, ident_of, mono_ns
        self._dir: Optional[str] = None
        if path is None:
            base = tempfile.gettempdir()
            if len(base) > 60:  # the path must fit in sun_path (108 bytes)
                base = "/tmp"
            self._dir = tempfile.mkdtemp(prefix="ccld-ncclprof-", dir=base)  # mode 0700
            path = os.path.join(self._dir, "sink")
        self.path = os.path.abspath(path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF_BYTES)
        try:
            if self._dir is None and stat.S_ISSOCK(os.lstat(self.path).st_mode):
                os.unlink(self.path)  # a socket left by an agent that died: nobody reads it
        except FileNotFoundError:
            pass
        try:
            self._sock.bind(self.path)
        except OSError as e:
            self._sock.close()
            raise CcldError(f"NCCL plugin socket {self.path}: cannot bind: {e.strerror}") from None
        self._sock.settimeout(READ_TIMEOUT_S)
        self.counters: Dict[str, int] = collections.Counter()  # type: ignore[assignment]
        self.ranks_on: Dict[int, str] = {}          # pid -> "on" / "off: why" / "bye"
        self.plugin_since: Dict[int, int] = {}      # pid -> ns of its first datagram's oldest record
        self._held: Deque[Tuple[float, bytes]] = collections.deque()
        self._last_n: Dict[int, int] = {}
        self._state: Dict[int, "_ProcState"] = {}
        self.groups = Groups()
        self._closed = False
        self.on_first: Optional[Callable[[int, int], None]] = None  # (pid, since_ns): the plugin took over NCCL
        # A Unix datagram socket queues only net.unix.max_dgram_qlen datagrams (10 by default), whatever
        # its buffer: the agent's loop polls every POLL_MS (500 ms), so a thread of its own reads them as they come
        # into a bounded inbox (the ranks' sends would be refused otherwise). Handling stays in poll(),
        # on the agent's loop, in order with its probe drains.
        self._inbox: Deque[bytes] = collections.deque()
        self.received = 0
        self._reader = threading.Thread(target=self._read, name="ccld-ncclprof-sink", daemon=True)
        self._reader.start()

    # -- receiving ------------------------------------------------------------------------------
    def _read(self) -> None:
        while not self._closed:
            try:
                raw = self._sock.recv(MAX_DATAGRAM)
            except (socket.timeout, InterruptedError):
                continue
            except OSError:
                if not self._closed:
                    self.counters["recv_errors"] += 1
                    time.sleep(READ_TIMEOUT_S)
                continue
            if len(self._inbox) >= MAX_INBOX:
                self.counters["inbox_dropped"] += 1
                continue
            self._inbox.append(raw)
            self.received += 1

    def poll(self, most: int = MAX_PER_POLL) -> int:
        """Handle what has arrived (up to `most` datagrams) and what waited long enough. Returns how many."""
        n = 0
        now = time.monotonic()
        while self._held and (now - self._held[0][0] >= HOLD_S or len(self._held) > MAX_HELD):
            self.handle(self._held.popleft()[1], final=True)
        while n < most and self._inbox:
            n += 1
            self.handle(self._inbox.popleft())
        return n

    def handle(self, raw: bytes, final: bool = False) -> None:
        from ccld.ncclprof import format as fmt
        try:
            batch = fmt.decode(raw)
        except ValueError as e:
            self.counters[f"bad_datagram_{getattr(e, 'reason', 'format')}"] += 1
            return
        st = self._state.get(batch.pid)
        ident = self.ident_of(batch.pid) or (st.ident if st is not None else None)  # exited: as it was known
        if ident is None and not final:
            if len(self._held) < MAX_HELD:
                self._held.append((time.monotonic(), raw))
                self.counters["held"] += 1
                return
        if ident is None:
            ident = (batch.rank, "job")
            self.counters["ident_from_plugin"] += 1
        self.counters["datagrams"] += 1
        self._gap(batch.pid, batch.number)
        convert(self, batch, ident)

    def _gap(self, pid: int, n: int) -> None:
        if len(self._last_n) >= MAX_PIDS and pid not in self._last_n:
            self._last_n.clear()
            self._state.clear()
        last = self._last_n.get(pid)
        if last is not None and n > last + 1:
            self.counters["datagrams_lost"] += n - last - 1
        self._last_n[pid] = n

    def loss(self) -> Dict[str, int]:
        """The sink's counters and the plugins' own drop counters, named for the agent's LossCounters."""
        out = {f"ncclprof_sink_{k}": int(v) for k, v in list(self.counters.items())}
        for st in list(self._state.values()):
            for k, v in st.plugin_counters.items():
                out[f"ncclprof_{k}"] = out.get(f"ncclprof_{k}", 0) + int(v)
        return out

    def announce(self) -> List[ev.ProbeStatus]:
        """Every rank whose plugin is on, said again (a restarted collector must learn it)."""
        now = self.mono_ns()
        return [ev.ProbeStatus(pid=pid, family="ncclprof", ok=True, ts_ns=now, target="libnccl-profiler-ccld",
                               message="NCCL profiler plugin on (said again)")
                for pid, state in list(self.ranks_on.items()) if state == "on"]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._reader.join(2 * READ_TIMEOUT_S + 1)
        self._sock.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        else:
            try:
                os.unlink(self.path)
            except OSError:
                pass


class _ProcState:
    """What the sink keeps per plugin process: its drop counters, its state, its collective numbers."""
    def __init__(self) -> None:
        self.plugin_counters: Dict[str, int] = {}
        self.state = ""
        self.numbers = CollNumbering()
        self.ident: Optional[Ident] = None  # (rank, job) as last known: a process that exited keeps it


_DTYPE_BYTES = {"int8": 1, "uint8": 1, "int32": 4, "uint32": 4, "int64": 8, "uint64": 8, "float16": 2,
                "float32": 4, "float64": 8, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def _comm_names(job: str, hashes: np.ndarray) -> List[str]:
    return [f"{job}/nccl:{h:016x}" for h in hashes.tolist()]


def convert(sink: NcclProfSink, batch, ident: Ident) -> None:
    """One decoded datagram of one rank -> events, in an order the collector can apply: communicators,
    then collectives (enters, first kernels, ends, as column rows), then p2p, then progress."""
    from ccld.ncclprof import format as fmt
    pid = batch.pid
    rank, job = ident
    st = sink._state.get(pid)
    if st is None:
        st = sink._state[pid] = _ProcState()
    st.plugin_counters = dict(batch.drops, unknown_records=batch.unknown)
    st.ident = ident
    out = Builder(sink.groups)
    recs = batch.records
    if batch.state != st.state:
        _status(sink, out, pid, batch, st.state)
        st.state = batch.state
    comms = recs["comm"]
    if pid not in sink.plugin_since and batch.state == "on":
        t0 = [int(x) for x in (comms["t_ns"].min() if len(comms) else 0,
                                recs["coll_start"]["t_ns"].min() if len(recs["coll_start"]) else 0) if x]
        since = min(t0) if t0 else sink.mono_ns()
        sink.plugin_since[pid] = since
        if sink.on_first is not None:
            sink.on_first(pid, since)
    for c, name in zip(comms, _comm_names(job, comms["comm_hash"])):
        from_init = bool(c["flags"] & fmt.F_FROM_INIT)
        out.event(ev.CommInit(pid=pid, rank=rank, ts_ns=int(c["t_ns"]), backend="nccl", comm=name,
                              group_rank=int(c["rank"]), group_size=int(c["nranks"]) if from_init else -1,
                              seq_source=ev.SEQ_LIBRARY))
    starts = recs["coll_start"]
    _colls(sink, out, pid, rank, job, starts, KIND_COLL, st.numbers.number(starts["comm_hash"], starts["id"]))
    kernels = recs["coll_kernel"]
    kseq, kfound = st.numbers.lookup(kernels["id"])
    _colls(sink, out, pid, rank, job, kernels[kfound], KIND_START, kseq[kfound])
    ends = recs["coll_end"]
    seq, found = st.numbers.lookup(ends["id"])
    sink.counters["unknown_tasks"] += int(np.count_nonzero(~kfound)) + int(np.count_nonzero(~found))
    # Ended: completed (its kernels/proxy ops stopped), or only launched when NCCL gave no child events
    # (an old API version, a narrowed mask): then the end is the launch, as for NCCL's API probes, not
    # a collective left open forever. Never started on the GPU: left open, for the hang detector.
    done = (ends["flags"] & (fmt.F_END_CHILDREN | fmt.F_END_ENQUEUE)) != 0
    sink.counters["ends_launch_only"] += int(np.count_nonzero(ends["flags"] & fmt.F_END_ENQUEUE))
    sink.counters["ends_never_started"] += int(np.count_nonzero(ends["flags"] & fmt.F_END_STALE))
    _colls(sink, out, pid, rank, job, ends[done & found], KIND_END, seq[done & found])
    st.numbers.retire(ends["id"])
    for r, name in zip(recs["p2p_start"], _comm_names(job, recs["p2p_start"]["comm_hash"])):
        op, dtype = str(r["op_name"]), str(r["dtype_name"])
        out.event(ev.P2P(pid=pid, rank=rank, ts_ns=int(r["t_ns"]), backend="nccl", comm=name, op=op,
                         peer=int(r["peer"]), count=int(r["count"]), dtype=dtype, seq=int(r["seq"]),
                         nbytes=int(r["count"]) * _DTYPE_BYTES.get(dtype, 0) or -1))
    for r, name in zip(recs["p2p_end"], _comm_names(job, recs["p2p_end"]["comm_hash"])):
        if int(r["flags"]) & fmt.F_END_STALE:
            continue  # never started on the GPU: left open, as a blocked send/recv
        out.event(ev.P2PEnd(pid=pid, rank=rank, ts_ns=int(r["t_ns"]), comm=name, op=str(r["op_name"]),
                            peer=int(r["peer"]), seq=int(r["seq"])))
    prog = recs["progress"]
    for r, name in zip(prog, _comm_names(job, prog["comm_hash"])):
        out.event(ev.NetProgress(pid=pid, rank=rank, ts_ns=batch.sent_ns, comm=name, peer=int(r["peer"]),
                                 send=bool(r["send"]), channel=int(r["channel"]), nbytes=int(r["nbytes"]),
                                 steps=int(r["steps"]), net_wait_ns=int(r["net_wait_ns"]),
                                 gpu_wait_ns=int(r["gpu_wait_ns"]), in_flight=int(r["in_flight"]),
                                 last_ns=int(r["last_ns"])))
    sink.counters["collectives"] += len(recs["coll_start"])
    sink.counters["p2p"] += len(recs["p2p_start"])
    sink.counters["progress"] += len(prog)
    for item in out.done():
        sink.emit(item)


def _colls(sink: NcclProfSink, out: Builder, pid: int, rank: int, job: str, r: np.ndarray, kind: int,
           seq: np.ndarray) -> None:
    """Task records of one kind as column rows (`seq`: their collective numbers, ncclprof_seq.py): one
    shared-field group per (communicator, op, sizes); NCCL's own per-function number is lib_seq."""
    n = len(r)
    if n == 0:
        return
    hashes = r["comm_hash"].view(np.int64)
    if kind == KIND_COLL:
        first, inv = group_keys(hashes, r["op"].astype(np.int64), r["dtype"].astype(np.int64),
                                r["count"].view(np.int64), r["peer"].astype(np.int64))
    else:
        first, inv = group_keys(hashes)
    gids = []
    for i in first.tolist():  # per distinct communicator and shape in the datagram, not per record
        name = f"{job}/nccl:{int(r['comm_hash'][i]):016x}"
        if kind == KIND_COLL:
            dtype, count = str(r["dtype_name"][i]), int(r["count"][i])
            size = _DTYPE_BYTES.get(dtype, 0)
            same = {"backend": "nccl", "comm": name, "op": str(r["op_name"][i]), "count": count, "dtype": dtype,
                    "root": int(r["peer"][i]), "nbytes": count * size if size else -1}
        elif kind == KIND_END:
            same = {"comm": name, "ok": True, "error": ""}
        else:
            same = {"comm": name}
        gids.append(sink.groups.id(kind, same))
    out.add(np.full(n, kind, np.uint8), np.array(gids, np.int32)[inv],
            {"seq": seq.astype(np.int64), "pid": np.full(n, pid, np.int64), "rank": np.full(n, rank, np.int64),
             "ts_ns": r["t_ns"].view(np.int64).copy(), "tid": np.zeros(n, np.int64),
             "lib_seq": r["seq"].astype(np.int64) if kind == KIND_COLL else np.full(n, -1, np.int64)})


def _status(sink: NcclProfSink, out: Builder, pid: int, batch, before: str) -> None:
    now = sink.mono_ns()
    if batch.state == "on":
        sink.ranks_on[pid] = "on"
        out.event(ev.ProbeStatus(pid=pid, family="ncclprof", ok=True, ts_ns=now, target="libnccl-profiler-ccld",
                                 message=f"NCCL profiler plugin on (ncclProfiler_v{batch.api_version})"))
    elif batch.state == "bye":
        sink.ranks_on[pid] = "bye"  # NCCL finalized its last communicator: nothing more comes from it
    else:
        why = batch.text[:300] or "no reason given"
        sink.ranks_on[pid] = f"off: {why}"
        out.event(ev.ProbeStatus(pid=pid, family="ncclprof", ok=False, ts_ns=now, target="libnccl-profiler-ccld",
                                 message=f"NCCL profiler plugin off: {why}"))


# -- ccld run ----------------------------------------------------------------------------------------
def plugin_path(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The plugin to inject: $CCLD_NCCLPROF_LIB when set, else the one scripts/setup.sh built (when a C
    compiler was present); None when there is none."""
    from ccld.ncclprof import build
    environ = os.environ if environ is None else environ
    p = environ.get(ENV_LIB) or build.installed_path()
    return os.path.abspath(p) if p and os.path.exists(p) else None


def job_env(agent, say: Callable[[str], None], base: Optional[Mapping[str, str]] = None) -> Optional[Dict[str, str]]:
    """The job's environment with ccld's NCCL profiler plugin on it (the user's own plugin, if any,
    chained behind it), or None to leave the environment as it is. Says one line when it is on, or
    why not where the job could want it (a GPU is present)."""
    base = os.environ if base is None else base
    forced = base.get(ENV_FORCE) == "1"
    if base.get(ENV_MODE, "on").strip().lower() == "off":
        say(f"ccld: NCCL profiler plugin: off ({ENV_MODE}=off), NCCL traced by its API's uprobes")
        return None
    if not forced and not gpu_present(base):
        return None  # no GPU: no NCCL; nothing to say
    user = base.get(ENV_PLUGIN, "").strip()
    if user.lower() == "none":
        say(f"ccld: NCCL profiler plugin: not injected ({ENV_PLUGIN}=none), NCCL traced by its API's uprobes")
        return None
    path = plugin_path(base)
    if path is None:
        say("ccld: NCCL profiler plugin: not built (setup found no C compiler), NCCL traced by its API's uprobes")
        return None
    env = dict(base)
    if user and os.path.abspath(user) != path:
        env[ENV_CHAIN] = user
    env[ENV_PLUGIN] = path
    env[ENV_ENDPOINT] = agent.open_ncclprof_sink()
    say("ccld: NCCL profiler plugin: offered to the job's NCCL (NCCL >= 2.23 loads it)"
        + (f", chaining {user}" if user and os.path.abspath(user) != path else ""))
    return env
