"""Loader of gloo.bpf.c: PyTorch's gloo backend (c10d::ProcessGroupGloo in libtorch_cpu.so).

Turns the program's records into wire events: CommInit when a process group is built, CollEnter when
a rank calls collective `seq`, WorkStart/WorkEnd when gloo's worker thread runs and finishes it, P2P
for send/recv. Times stay CLOCK_MONOTONIC ns. Per-process state (process group pointer -> communicator
name, work pointer -> (comm, seq)) lives here and is dropped when the process is forgotten.

Sizes: CollEnter.nbytes is the per-rank tensor's bytes (the smallest buffer c10d hands gloo, see
gloo.bpf.c), for the ops whose ranks must agree on it (SIZED_OPS). It is measured on gloo's worker
thread when the work runs, after the Python thread's enter, so the enter of such an op is held until
its size record comes, the work ends, the process is forgotten, or HOLD_MS pass (a worker busy with
earlier works: the enter then goes out without a size). Its timestamp is the call's either way; only
when the collector sees it moves, by at most HOLD_MS plus one drain. Count and dtype stay unknown
(-1, ""): gloo's buffers carry bytes, not elements.

Broken connections: when gloo's I/O thread finds a connection broken (PAIR_FAIL: EOF, reset), the
first such peer since the process's last successful collective is named in the error of its next
failed WorkEnd: "...; connection to group rank N broke: <gloo's message>" (LOST_RE reads it back).
A rank killed inside a collective is the one its peers' errors name.

Caveat: communicators are named `<job>/gloo:<k>`, k = order in which the process built its gloo
groups. Every rank builds the default group first, so it always matches; subgroups match as long as
ranks build the groups they belong to in the same order (torch's new_group requires that).
"""
from __future__ import annotations

import ctypes as ct
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

from ccld import events as ev
from ccld.bpf.loader import Family, Probe
from ccld.bpf.records import Header

TITLE_LEN = 32

# c10d::OpType (torch/csrc/distributed/c10d/Work.hpp)
OP_NAMES = {
    0: "broadcast", 1: "allreduce", 2: "allreduce_coalesced", 3: "reduce", 4: "allgather",
    5: "_allgather_base", 6: "allgather_coalesced", 7: "gather", 8: "scatter", 9: "reduce_scatter",
    10: "alltoall_base", 11: "alltoall", 12: "send", 13: "recv", 14: "recvanysource", 15: "barrier",
    16: "_reduce_scatter_base", 17: "coalesced", 18: "_allreduce_sparse",
    19: "reduce_scatter_tensor_coalesced", 100: "unknown",
}

PG_INIT, WORK_INIT, WORK_START, WORK_END, P2P_REC, WORK_SIZE, PAIR_FAIL = 1, 2, 3, 4, 5, 6, 7
ERR_LEN = 160

# Ops whose ranks must all pass the same tensor bytes and whose buffers c10d hands to one of gloo's
# probed algorithm entry points (checked on torch 2.13: all_gather_into_tensor and reduce_scatter_tensor
# run as allgather and allreduce works). Not: barrier (no tensor), alltoall* (uneven splits are legal),
# the sparse allreduce (nnz differs per rank), and the coalesced, list reduce_scatter and *_base works
# (other code paths, not checked): their enters go out at once, without a size.
SIZED_OPS = frozenset({"allreduce", "broadcast", "reduce", "allgather", "gather", "scatter"})
LOST_RE = re.compile(r"connection to group rank (\d+) broke")  # in WorkEnd.error; diagnose/hang.py reads it
HOLD_MS = 200  # longest an enter waits for its size: gloo's worker normally takes the work within microseconds


class PgInit(ct.Structure):
    _fields_ = [("hdr", Header), ("pg", ct.c_uint64), ("rank", ct.c_int32), ("size", ct.c_int32)]


class WorkInit(ct.Structure):
    _fields_ = [("hdr", Header), ("pg", ct.c_uint64), ("work", ct.c_uint64), ("seq", ct.c_uint64),
                ("enter_ns", ct.c_uint64), ("timeout_ms", ct.c_uint64), ("op", ct.c_int32),
                ("pad", ct.c_uint32), ("title", ct.c_char * TITLE_LEN)]


class WorkEv(ct.Structure):
    _fields_ = [("hdr", Header), ("work", ct.c_uint64), ("ok", ct.c_int32), ("pad", ct.c_uint32)]


class WorkSize(ct.Structure):
    _fields_ = [("hdr", Header), ("work", ct.c_uint64), ("min_bytes", ct.c_uint64), ("total_bytes", ct.c_uint64),
                ("nbufs", ct.c_uint32), ("pad", ct.c_uint32)]


class PairFail(ct.Structure):
    _fields_ = [("hdr", Header), ("pair", ct.c_uint64), ("peer", ct.c_int32), ("pad", ct.c_uint32),
                ("msg", ct.c_char * ERR_LEN)]


class P2pRec(ct.Structure):
    _fields_ = [("hdr", Header), ("pg", ct.c_uint64), ("op", ct.c_int32), ("peer", ct.c_int32),
                ("tag", ct.c_int32), ("pad", ct.c_uint32)]


_PGG = "_ZN4c10d16ProcessGroupGloo"
_AW = _PGG + "9AsyncWork"
_TCP_PAIR = "_ZN4gloo9transport3tcp4Pair"
_GLOO_ALGOS = ["_ZN4gloo9allreduceE", "_ZN4gloo9broadcastE", "_ZN4gloo9allgatherE", "_ZN4gloo10allgathervE",
               "_ZN4gloo6gatherE", "_ZN4gloo7scatterE", "_ZN4gloo6reduceE", "_ZN4gloo8alltoallE",
               "_ZN4gloo9alltoallvE", "_ZN4gloo7barrierE"]
_API = ["allreduce", "allreduce_coalesced", "allreduce_sparse", "broadcast", "reduce", "allgather",
        "_allgather_base", "allgather_coalesced", "allgather_into_tensor_coalesced", "gather", "scatter",
        "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "alltoall",
        "alltoall_base", "barrier"]


def _member(name: str) -> str:
    return f"{_PGG}{len(name)}{name}E"


class GlooFamily(Family):
    NAME = "gloo"
    SOURCE = "gloo.bpf.c"
    LIB_PATTERN = r"/libtorch_cpu\.so(\.[0-9.]+)?$"
    KINDS = {PG_INIT: PgInit, WORK_INIT: WorkInit, WORK_START: WorkEv, WORK_END: WorkEv, P2P_REC: P2pRec,
             WORK_SIZE: WorkSize, PAIR_FAIL: PairFail}
    PROBES = (
        [Probe(_PGG + "C1E", "pg_init", True),          # C2 is an alias at the same address
         Probe(_AW + "C1E", "work_init", True),
         Probe(_AW + "7executeE", "work_exec", True),
         Probe(_AW + "14finishWorkGlooEv", "work_done", True),
         Probe(_AW + "19finishWorkGlooErrorE", "work_fail", True),
         Probe(_member("send"), "p2p_send"),
         Probe(_member("recv"), "p2p_recv"),
         Probe(_member("recvAnysource"), "p2p_recvany"),
         # sizes: optional, the enters go out without them when these are missing
         Probe("_ZN4gloo7Context19createUnboundBufferEPvm", "buf_new", exact=True),
         # broken connections: optional, a failed collective then says no more than that it failed
         Probe(_TCP_PAIR + "C1E", "pair_new"),
         Probe(_TCP_PAIR + "15signalExceptionERKNSt7__cxx1112basic_string", "pair_fail")]
        + [Probe(_member(n), "api_enter") for n in _API]
        + [Probe(a, "algo_enter") for a in _GLOO_ALGOS]
    )

    def poll(self, timeout_ms: int) -> None:
        """Drain, then let the translator send the enters whose size is not coming (HOLD_MS)."""
        super().poll(timeout_ms)
        flush = getattr(self.on_record, "flush", None)
        if flush is not None:
            flush(time.monotonic_ns())


@dataclass
class ProcState:
    rank: int
    job: str
    pgs: Dict[int, Tuple[str, int, int]] = field(default_factory=dict)  # pg ptr -> (comm, group_rank, size)
    works: Dict[int, Tuple[str, int]] = field(default_factory=dict)    # work ptr -> (comm, seq)
    held: Dict[int, "Held"] = field(default_factory=dict)              # work ptr -> enter waiting for its size
    lost: Optional[Tuple[int, str]] = None  # first broken connection since the last good end: (peer, message)
    next_index: int = 0


def gloo_message(raw: bytes) -> str:
    """gloo's exception text without its source location and advice: "Read error [a]:p: reset by peer"."""
    text = raw.decode("utf-8", "replace")
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". This is typically", 1)[0].strip()[:120]


@dataclass
class Held:
    enter: Dict                    # CollEnter's fields but the size
    since_ns: int                  # the WORK_INIT record's time
    start_ns: Optional[int] = None  # a WorkStart that came while the enter waited (sent right after it)


MAX_WORKS_PER_PROC = 65536  # in flight at once is a handful; this only bounds leaks from missed ends


class GlooTranslator:
    """Records of one GlooFamily -> wire events, per process. `emit` receives each event."""

    def __init__(self, emit: Callable[[ev.Event], None], hold_ns: int = HOLD_MS * 1_000_000):
        self.emit = emit
        self.hold_ns = hold_ns
        self.procs: Dict[int, ProcState] = {}
        self.unmatched = 0  # start/end records of works we never saw built (e.g. attached mid-collective)
        self.unsized = 0    # enters of SIZED_OPS sent without a size (HOLD_MS passed, or the work ended first)
        self._holding = 0   # enters held, all processes together (flush() returns at once when 0)

    def add_process(self, pid: int, rank: int, job: str) -> None:
        self.procs.setdefault(pid, ProcState(rank, job))

    def forget(self, pid: int) -> None:
        st = self.procs.get(pid)
        if st is not None:  # its last enters still happened: send them before forgetting it
            for work in list(st.held):
                self._release(pid, st, work, None)
        self.procs.pop(pid, None)

    def flush(self, now_ns: int) -> None:
        """Send the enters that waited HOLD_MS for a size (their worker is busy with earlier works)."""
        if not self._holding:
            return
        for pid, st in list(self.procs.items()):
            for work, h in list(st.held.items()):
                if now_ns - h.since_ns >= self.hold_ns:
                    self._release(pid, st, work, None)

    def _release(self, pid: int, st: ProcState, work: int, nbytes: Optional[int]) -> None:
        h = st.held.pop(work)
        self._holding -= 1
        if nbytes is None:
            self.unsized += 1
        self.emit(ev.CollEnter(**h.enter, nbytes=-1 if nbytes is None else nbytes))
        if h.start_ns is not None:
            self.emit(ev.WorkStart(pid=pid, rank=st.rank, ts_ns=h.start_ns, comm=h.enter["comm"], seq=h.enter["seq"]))

    def _comm_for(self, pid: int, st: ProcState, pg: int, ts: int, group_rank=-1, size=-1) -> str:
        known = st.pgs.get(pg)
        if known is not None and group_rank < 0:
            return known[0]
        comm = known[0] if known else f"{st.job}/gloo:{st.next_index}"
        if not known:
            st.next_index += 1
        st.pgs[pg] = (comm, group_rank, size)
        self.emit(ev.CommInit(pid=pid, rank=st.rank, ts_ns=ts, backend="gloo", comm=comm,
                              group_rank=group_rank, group_size=size, handle=pg))
        return comm

    def __call__(self, kind: int, rec) -> None:
        pid = rec.hdr.tgid
        st = self.procs.get(pid)
        if st is None:
            return  # a process we were told to forget; its probes are being detached
        ts = rec.hdr.ts_ns
        if kind == PG_INIT:
            self._comm_for(pid, st, rec.pg, ts, rec.rank, rec.size)
        elif kind == WORK_INIT:
            op = OP_NAMES.get(rec.op, f"op{rec.op}")
            if op in ("send", "recv", "recvanysource"):
                return  # p2p works are reported by the P2P record
            if rec.pg == 0 and len(st.pgs) == 1:
                comm = next(iter(st.pgs.values()))[0]
            else:
                comm = self._comm_for(pid, st, rec.pg, ts)
            if len(st.works) >= MAX_WORKS_PER_PROC:
                st.works.clear()
                for work in list(st.held):
                    self._release(pid, st, work, None)
            st.works[rec.work] = (comm, rec.seq)
            enter = dict(pid=pid, rank=st.rank, ts_ns=rec.enter_ns, backend="gloo", comm=comm, seq=rec.seq,
                         op=op, tid=rec.hdr.tid)
            if op in SIZED_OPS:
                if rec.work in st.held:  # a work object reused before its size came: the old one is done
                    self._release(pid, st, rec.work, None)
                st.held[rec.work] = Held(enter, ts)
                self._holding += 1
            else:
                self.emit(ev.CollEnter(**enter))
        elif kind == WORK_SIZE:
            if rec.work in st.held:
                self._release(pid, st, rec.work, rec.min_bytes if rec.nbufs else None)
        elif kind in (WORK_START, WORK_END):
            got = st.works.get(rec.work)
            if got is None:
                self.unmatched += 1
                return
            comm, seq = got
            h = st.held.get(rec.work)
            if kind == WORK_START:
                if h is not None:
                    h.start_ns = ts  # sent after the enter, when its size comes
                else:
                    self.emit(ev.WorkStart(pid=pid, rank=st.rank, ts_ns=ts, comm=comm, seq=seq))
            else:
                if h is not None:
                    self._release(pid, st, rec.work, None)  # ended before any size: the enter comes first
                del st.works[rec.work]
                error = ""
                if rec.ok:
                    st.lost = None
                else:
                    error = "gloo reported an error (finishWorkGlooError)"
                    if st.lost is not None:
                        peer, msg = st.lost
                        error += (f"; connection to group rank {peer} broke" if peer >= 0 else
                                  "; a connection broke") + (f": {msg}" if msg else "")
                self.emit(ev.WorkEnd(pid=pid, rank=st.rank, ts_ns=ts, comm=comm, seq=seq, ok=bool(rec.ok),
                                     error=error))
        elif kind == PAIR_FAIL:
            if st.lost is None:  # the first one: later ones follow from it (the process group is broken)
                st.lost = (rec.peer, gloo_message(rec.msg))
        elif kind == P2P_REC:
            comm = self._comm_for(pid, st, rec.pg, ts)
            op = {12: "send", 13: "recv", 14: "recvanysource"}.get(rec.op, f"op{rec.op}")
            self.emit(ev.P2P(pid=pid, rank=st.rank, ts_ns=ts, backend="gloo", comm=comm, op=op,
                             peer=rec.peer, tag=rec.tag))
