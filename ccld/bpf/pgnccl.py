"""Loader of pgnccl.bpf.c: PyTorch's NCCL process groups (c10d::ProcessGroupNCCL, libtorch_cuda.so),
and the translator of its records to wire events.

A collective a ProcessGroupNCCL builds arrives as a CollEnter of the communicator `<job>/nccl-pg:<name>`
(the group's name, c10d's pg_uid: "0" for the default group, the same on every member) numbered by
c10d's own seqCollective_, which counts the group's collectives only and is the same on every member
for one collective, also when ccld attached mid-run (CommInit.seq_source "library"): no alignment
guess is needed, and the numbers are Flight Recorder's `collective_seq_id`. The group's size comes
from its constructor when ccld saw it; else -1, and a group other than the default one ("0", the world)
is marked CommInit.subgroup: its members are the ranks seen in it, not the world. Point-to-point works are counted and left to the NCCL API probes
(nccl.py), whose ncclSend/ncclRecv records carry the peer.

One source per collective: the agent tells the NCCL API translator to leave the collectives of a process
these probes are attached to (NcclTranslator.leave_collectives), and, when ccld's NCCL profiler plugin
reports a process, tells this translator to leave it to the plugin (defer_to_plugin).
Caveat: the constructor carries no sizes, so these enters have count -1 and no dtype (the API probes'
ncclAllReduce arguments had them; the profiler plugin has them too). Times: CLOCK_MONOTONIC ns.
"""
from __future__ import annotations

import ctypes as ct
from typing import Callable, Dict, Tuple

import numpy as np

from ccld import wire as ev
from ccld.bpf import records
from ccld.bpf.gloo_records import OP_LIST
from ccld.bpf.loader import Family, Probe
from ccld.bpf.records import Header
from ccld.bpf.rows import KIND_COLL, Builder, Groups

PG, WORK = 1, 2
REC_SIZE = 96   # CCLD_REC_SIZE in pgnccl.bpf.c
UID_BYTES = 48  # PGN_UID_BYTES
DEFAULT_GROUP = "0"  # torch names the default group "0" (init_process_group makes it first): the world

# The mangled names (Itanium ABI) as torch 2.x's libtorch_cuda.so exports them, cut after the arguments
# the program reads, so a torch that adds trailing arguments (as 2.5 and 2.6 did) still matches. C1 and
# C2 constructors are aliases at one address. tests/data/libtorch_cuda_symbols.txt holds the full names
# read off torch 2.14.1's libtorch_cuda.so, which the fake library of the tests must export unchanged.
_PGN = "_ZN4c10d16ProcessGroupNCCL"
PG_CTOR = _PGN + "C1EN3c1013intrusive_ptrINS_5StoreENS1_6detail34intrusive_target_default_null_typeIS3_EEEEii"
INIT_WORK = _PGN + "8initWorkERN3c106DeviceEiNS_6OpTypeEb"
WORK_CTOR = (_PGN + "8WorkNCCLC1ENSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEES7_RN3c106DeviceEiNS_6OpTypeEmb")


class PgnPg(ct.Structure):
    _fields_ = [("hdr", Header), ("pg", ct.c_uint64), ("rank", ct.c_int32), ("size", ct.c_int32)]


class PgnWork(ct.Structure):
    _fields_ = [("hdr", Header), ("pg", ct.c_uint64), ("seq", ct.c_uint64), ("rank", ct.c_int32),
                ("op", ct.c_uint8), ("p2p", ct.c_uint8), ("uid_len", ct.c_uint16), ("uid", ct.c_char * UID_BYTES)]


class PgncclFamily(Family):
    NAME = "pgnccl"
    SOURCE = "pgnccl.bpf.c"
    LIB_PATTERN = r"/libtorch_cuda\.so(\.[0-9.]+)?$"
    KINDS = records.Kinds({PG: PgnPg, WORK: PgnWork}, REC_SIZE)
    PROBES = (
        Probe(WORK_CTOR, "work_new", True),  # the one that matters: the group's name and c10d's seq
        Probe(INIT_WORK, "init_work"),       # which group built the work (its size, from pg_init)
        Probe(PG_CTOR, "pg_init"),           # a group built while we watch: its rank and size
    )


class PgncclTranslator:
    """Records of one PgncclFamily -> wire events, a drain at a time: CommInit the first time a process
    names a group, and every collective work as a CollEnter row (rows.Rows)."""

    def __init__(self, emit: Callable):
        self.emit = emit
        self.groups = Groups()
        self.procs: Dict[int, Tuple[int, str]] = {}        # pid -> (global rank, job)
        self.sizes: Dict[Tuple[int, int], Tuple[int, int]] = {}  # (pid, ProcessGroupNCCL) -> (rank, size)
        self.named: Dict[Tuple[int, str], str] = {}        # (pid, group name) -> communicator announced
        self._plugin_since: Dict[int, int] = {}            # pid -> ns from which ccld's NCCL plugin reports it
        self.counters: Dict[str, int] = {"p2p_left_to_api": 0, "left_to_plugin": 0, "cut_names": 0,
                                         "no_group": 0}

    def add_process(self, pid: int, rank: int, job: str) -> None:
        self.procs.setdefault(pid, (rank, job))

    def forget(self, pid: int) -> None:
        self.procs.pop(pid, None)
        self._plugin_since.pop(pid, None)
        self.sizes = {k: v for k, v in self.sizes.items() if k[0] != pid}
        self.named = {k: v for k, v in self.named.items() if k[0] != pid}

    def defer_to_plugin(self, pid: int, since_ns: int) -> None:
        """ccld's NCCL profiler plugin reports this process's NCCL from since_ns on (as NcclTranslator's)."""
        self._plugin_since[pid] = min(since_ns, self._plugin_since.get(pid, since_ns))

    def records(self, rows: np.ndarray, kinds: np.ndarray) -> None:
        """Every record of one drain, in ring order: groups built are rare (record by record), works
        are read as arrays."""
        out = Builder(self.groups)
        for i in np.flatnonzero(kinds == PG).tolist():
            r = PgncclFamily.KINDS.record(rows[i])
            self.sizes[(r.hdr.tgid, r.pg)] = (r.rank, r.size)
        works = kinds == WORK
        if works.any():
            self._works(out, records.view(rows[works], PgncclFamily.KINDS.dtypes[WORK]))
        for item in out.done():
            self.emit(item)

    def _works(self, out: Builder, r: np.ndarray) -> None:
        pid = r["hdr"]["tgid"].astype(np.int64)
        ts = r["hdr"]["ts_ns"].astype(np.int64)
        keep = records.member(pid, list(self.procs))  # not a process we were told to forget
        if self._plugin_since:
            since = np.array([self._plugin_since.get(p, 1 << 62) for p in pid.tolist()], np.int64)
            left = keep & (ts >= since)
            self.counters["left_to_plugin"] += int(np.count_nonzero(left))
            keep &= ~left
        p2p = keep & (r["p2p"] != 0)
        self.counters["p2p_left_to_api"] += int(np.count_nonzero(p2p))
        keep &= ~p2p
        if not keep.any():
            return
        r, pid, ts = r[keep], pid[keep], ts[keep]
        n = len(r)
        gids = np.empty(n, np.int32)
        ranks = np.empty(n, np.int64)
        for i, (p, uid, ulen, op, pg, grank) in enumerate(zip(pid.tolist(), r["uid"].tolist(), r["uid_len"].tolist(),
                                                              r["op"].tolist(), r["pg"].tolist(),
                                                              r["rank"].tolist())):
            rank, job = self.procs[p]
            ranks[i] = rank
            name = uid.split(b"\0", 1)[0].decode("utf-8", "replace")  # what follows a NUL is not the name
            comm = self._comm(out, p, rank, job, name, ulen, pg, grank, int(ts[i]))
            gids[i] = self.groups.id(KIND_COLL, {"backend": "nccl", "comm": comm, "op": OP_LIST[op]})
        seq = r["seq"].astype(np.int64)
        out.add(np.full(n, KIND_COLL, np.uint8), gids,
                {"seq": seq, "pid": pid, "rank": ranks, "ts_ns": ts, "tid": r["hdr"]["tid"].astype(np.int64),
                 "lib_seq": seq})

    def _comm(self, out: Builder, pid: int, rank: int, job: str, uid: str, ulen: int, pg: int, grank: int,
              ts: int) -> str:
        """The communicator of group `uid` in process `pid`, announced (CommInit) the first time."""
        name = self.named.get((pid, uid))
        if name is not None:
            return name
        if ulen >= UID_BYTES:
            self.counters["cut_names"] += 1  # 47 bytes and a NUL are kept: names equal that far are one
        got = self.sizes.get((pid, pg)) if pg else None
        if got is None:
            self.counters["no_group"] += 1  # built before we attached: its size is unknown
        size = got[1] if got is not None else -1
        name = self.named[(pid, uid)] = f"{job}/nccl-pg:{uid}"
        out.event(ev.CommInit(pid=pid, rank=rank, ts_ns=ts, backend="nccl", comm=name, group_rank=grank,
                              group_size=size, handle=pg, seq_source=ev.SEQ_LIBRARY,
                              subgroup=size < 0 and uid != DEFAULT_GROUP))
        return name
