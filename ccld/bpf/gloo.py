"""Loader of gloo.bpf.c: PyTorch's gloo backend (c10d::ProcessGroupGloo in libtorch_cpu.so).

Turns the program's records into wire events: CommInit when a process group is built, CollEnter when
a rank calls collective `seq`, WorkStart/WorkEnd when gloo's worker thread runs and finishes it, P2P
for send/recv. Times stay CLOCK_MONOTONIC ns. Per-process state (process group pointer -> communicator
name, work pointer -> (comm, seq)) lives here and is dropped when the process is forgotten.

Caveat: communicators are named `<job>/gloo:<k>`, k = order in which the process built its gloo
groups. Every rank builds the default group first, so it always matches; subgroups match as long as
ranks build the groups they belong to in the same order (torch's new_group requires that).
"""
from __future__ import annotations

import ctypes as ct
import os
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

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

PG_INIT, WORK_INIT, WORK_START, WORK_END, P2P_REC = 1, 2, 3, 4, 5


class PgInit(ct.Structure):
    _fields_ = [("hdr", Header), ("pg", ct.c_uint64), ("rank", ct.c_int32), ("size", ct.c_int32)]


class WorkInit(ct.Structure):
    _fields_ = [("hdr", Header), ("pg", ct.c_uint64), ("work", ct.c_uint64), ("seq", ct.c_uint64),
                ("enter_ns", ct.c_uint64), ("timeout_ms", ct.c_uint64), ("op", ct.c_int32),
                ("pad", ct.c_uint32), ("title", ct.c_char * TITLE_LEN)]


class WorkEv(ct.Structure):
    _fields_ = [("hdr", Header), ("work", ct.c_uint64), ("ok", ct.c_int32), ("pad", ct.c_uint32)]


class P2pRec(ct.Structure):
    _fields_ = [("hdr", Header), ("pg", ct.c_uint64), ("op", ct.c_int32), ("peer", ct.c_int32),
                ("tag", ct.c_int32), ("pad", ct.c_uint32)]


_PGG = "_ZN4c10d16ProcessGroupGloo"
_AW = _PGG + "9AsyncWork"
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
    KINDS = {PG_INIT: PgInit, WORK_INIT: WorkInit, WORK_START: WorkEv, WORK_END: WorkEv, P2P_REC: P2pRec}
    PROBES = (
        [Probe(_PGG + "C1E", "pg_init", True),          # C2 is an alias at the same address
         Probe(_AW + "C1E", "work_init", True),
         Probe(_AW + "7executeE", "work_exec", True),
         Probe(_AW + "14finishWorkGlooEv", "work_done", True),
         Probe(_AW + "19finishWorkGlooErrorE", "work_fail", True),
         Probe(_member("send"), "p2p_send"),
         Probe(_member("recv"), "p2p_recv"),
         Probe(_member("recvAnysource"), "p2p_recvany")]
        + [Probe(_member(n), "api_enter") for n in _API]
    )


@dataclass
class ProcState:
    rank: int
    job: str
    pgs: Dict[int, Tuple[str, int, int]] = field(default_factory=dict)  # pg ptr -> (comm, group_rank, size)
    works: Dict[int, Tuple[str, int]] = field(default_factory=dict)    # work ptr -> (comm, seq)
    next_index: int = 0


MAX_WORKS_PER_PROC = 65536  # in flight at once is a handful; this only bounds leaks from missed ends


class GlooTranslator:
    """Records of one GlooFamily -> wire events, per process. `emit` receives each event."""

    def __init__(self, emit: Callable[[ev.Event], None]):
        self.emit = emit
        self.procs: Dict[int, ProcState] = {}
        self.unmatched = 0  # start/end records of works we never saw built (e.g. attached mid-collective)

    def add_process(self, pid: int, rank: int, job: str) -> None:
        self.procs.setdefault(pid, ProcState(rank, job))

    def forget(self, pid: int) -> None:
        self.procs.pop(pid, None)

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
            st.works[rec.work] = (comm, rec.seq)
            self.emit(ev.CollEnter(pid=pid, rank=st.rank, ts_ns=rec.enter_ns, backend="gloo", comm=comm,
                                   seq=rec.seq, op=op, tid=rec.hdr.tid))
        elif kind in (WORK_START, WORK_END):
            got = st.works.get(rec.work)
            if got is None:
                self.unmatched += 1
                return
            comm, seq = got
            if kind == WORK_START:
                self.emit(ev.WorkStart(pid=pid, rank=st.rank, ts_ns=ts, comm=comm, seq=seq))
            else:
                del st.works[rec.work]
                self.emit(ev.WorkEnd(pid=pid, rank=st.rank, ts_ns=ts, comm=comm, seq=seq, ok=bool(rec.ok),
                                     error="" if rec.ok else "gloo reported an error (finishWorkGlooError)"))
        elif kind == P2P_REC:
            comm = self._comm_for(pid, st, rec.pg, ts)
            op = {12: "send", 13: "recv", 14: "recvanysource"}.get(rec.op, f"op{rec.op}")
            self.emit(ev.P2P(pid=pid, rank=st.rank, ts_ns=ts, backend="gloo", comm=comm, op=op,
                             peer=rec.peer, tag=rec.tag))
