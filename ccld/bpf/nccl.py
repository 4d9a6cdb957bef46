"""Loader of nccl.bpf.c: NCCL's host API (libnccl.so), and the translator of its records to wire events.

CommInit when a communicator is created (ncclCommInitRank[Config], ncclCommSplit), CollEnter when a
rank calls a collective, P2P for ncclSend/ncclRecv. Times stay CLOCK_MONOTONIC ns. Per-process state
(communicator handle -> name and sequence counter) lives here and is dropped when the process is forgotten.

Communicator names are `<job>/nccl:<identity as 16 hex digits>`. The identity of an init'ed
communicator is FNV-1a 64 of its ncclUniqueId, which every member rank passes in, so every rank
names it alike. A split's identity hashes (parent identity, color, index of the split among the
parent's splits): ncclCommSplit is collective over the parent, so every parent rank counts the same
splits. NCCL has no sequence number of its own: `seq` counts the collectives called on a communicator
in this process from 0, which matches across ranks because NCCL requires every rank to call the
same collectives in the same order.

Caveats: an entry probe sees the call, not the GPU work (NCCL is asynchronous). A communicator
created before we attached has no known identity: it is named `<job>/nccl:handle-r<rank>-<hex>` (a
per-process name that cannot match across ranks; `p<pid>` when the rank is unknown), its seq starts
at our attach (CommInit.seq_source "attach"), and `unknown_handles` counts it; the collector joins
such streams across ranks (ccld/timeline/align.py).
"""
from __future__ import annotations

import ctypes as ct
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import numpy as np

from ccld import wire as ev
from ccld.bpf import records
from ccld.bpf.loader import Family, Probe
from ccld.bpf.records import Header
from ccld.bpf.rows import KIND_COLL, Builder, Groups, group_keys

COLL, P2P_REC, GROUP, COMM_INIT, COMM_END = 1, 2, 3, 4, 5
REC_SIZE = 80  # CCLD_REC_SIZE in nccl.bpf.c (nccl_call and nccl_comm_init, the largest)

# enum nccl_fn in nccl.bpf.c
FN_ALLREDUCE, FN_BROADCAST, FN_REDUCE, FN_ALLGATHER, FN_REDUCESCATTER = 1, 2, 3, 4, 5
FN_ALLTOALL, FN_GATHER, FN_SCATTER = 6, 7, 8
FN_SEND, FN_RECV = 20, 21
FN_GROUP_START, FN_GROUP_END = 30, 31
FN_INIT_RANK, FN_INIT_RANK_CONFIG, FN_SPLIT = 40, 41, 42
FN_DESTROY, FN_ABORT = 50, 51

# Collective names in c10d's OpType vocabulary, so they read like gloo's and Flight Recorder's.
OP_NAMES = {FN_ALLREDUCE: "allreduce", FN_BROADCAST: "broadcast", FN_REDUCE: "reduce",
            FN_ALLGATHER: "allgather", FN_REDUCESCATTER: "reduce_scatter", FN_ALLTOALL: "alltoall",
            FN_GATHER: "gather", FN_SCATTER: "scatter", FN_SEND: "send", FN_RECV: "recv"}

# ncclDataType_t (nccl.h) -> (torch dtype name, bytes per element)
DTYPES = {0: ("int8", 1), 1: ("uint8", 1), 2: ("int32", 4), 3: ("uint32", 4), 4: ("int64", 8),
          5: ("uint64", 8), 6: ("float16", 2), 7: ("float32", 4), 8: ("float64", 8), 9: ("bfloat16", 2),
          10: ("float8_e4m3fn", 1), 11: ("float8_e5m2", 1)}

# ncclRedOp_t; values >= 5 are ops made at run time by ncclRedOpCreatePreMulSum
REDOPS = {0: "sum", 1: "prod", 2: "max", 3: "min", 4: "avg"}

NCCL_SUCCESS, NCCL_IN_PROGRESS = 0, 7   # ncclResult_t; InProgress = a non-blocking init under way
NCCL_SPLIT_NOCOLOR = -1                 # this rank joins no new communicator


class NcclCall(ct.Structure):  # NCCL_COLL and NCCL_P2P
    _fields_ = [("hdr", Header), ("comm", ct.c_uint64), ("count", ct.c_uint64), ("stream", ct.c_uint64),
                ("sendbuff", ct.c_uint64), ("recvbuff", ct.c_uint64), ("fn", ct.c_int32),
                ("datatype", ct.c_int32), ("redop", ct.c_int32), ("root", ct.c_int32)]


class NcclGroup(ct.Structure):
    _fields_ = [("hdr", Header), ("fn", ct.c_int32), ("pad", ct.c_uint32)]


class NcclCommInit(ct.Structure):
    _fields_ = [("hdr", Header), ("comm", ct.c_uint64), ("parent", ct.c_uint64), ("idhash", ct.c_uint64),
                ("enter_ns", ct.c_uint64), ("fn", ct.c_int32), ("ret", ct.c_int32), ("nranks", ct.c_int32),
                ("rank", ct.c_int32), ("color", ct.c_int32), ("key", ct.c_int32)]


class NcclCommEnd(ct.Structure):
    _fields_ = [("hdr", Header), ("comm", ct.c_uint64), ("fn", ct.c_int32), ("pad", ct.c_uint32)]


def _api(sym: str, fn: str, required: bool = False, ret: bool = False) -> Probe:
    return Probe(sym, fn, required, exact=True, ret=ret)


class NcclFamily(Family):
    NAME = "nccl"
    SOURCE = "nccl.bpf.c"
    LIB_PATTERN = r"/libnccl\.so(\.[0-9.]+)?$"
    KINDS = records.Kinds({COLL: NcclCall, P2P_REC: NcclCall, GROUP: NcclGroup, COMM_INIT: NcclCommInit,
                           COMM_END: NcclCommEnd}, REC_SIZE)
    PROBES = (
        # What every NCCL 2.x a torch of this decade can load has.
        _api("ncclAllReduce", "coll_allreduce", True),
        _api("ncclBroadcast", "coll_broadcast", True),
        _api("ncclReduce", "coll_reduce", True),
        _api("ncclAllGather", "coll_allgather", True),
        _api("ncclReduceScatter", "coll_reducescatter", True),
        _api("ncclSend", "p2p_send", True),
        _api("ncclRecv", "p2p_recv", True),
        _api("ncclGroupStart", "group_start", True),
        _api("ncclGroupEnd", "group_end", True),
        _api("ncclCommInitRank", "init_rank", True),
        _api("ncclCommInitRank", "init_ret", True, ret=True),
        _api("ncclCommDestroy", "comm_destroy", True),
        _api("ncclCommAbort", "comm_abort", True),
        # Newer: InitRankConfig 2.14, Split 2.18, AlltoAll/Gather/Scatter and the per-call *Config variants
        # later (all in 2.32). Each Config variant takes the plain one's arguments plus a trailing config.
        _api("ncclCommInitRankConfig", "init_rank_config"),
        _api("ncclCommInitRankConfig", "init_ret", ret=True),
        _api("ncclCommSplit", "comm_split"),
        _api("ncclCommSplit", "init_ret", ret=True),
        _api("ncclAlltoAll", "coll_alltoall"),
        _api("ncclGather", "coll_gather"),
        _api("ncclScatter", "coll_scatter"),
        _api("ncclAllReduceConfig", "coll_allreduce"),
        _api("ncclBroadcastConfig", "coll_broadcast"),
        _api("ncclReduceConfig", "coll_reduce"),
        _api("ncclAllGatherConfig", "coll_allgather"),
        _api("ncclReduceScatterConfig", "coll_reducescatter"),
        _api("ncclAlltoAllConfig", "coll_alltoall"),
        _api("ncclGatherConfig", "coll_gather"),
        _api("ncclScatterConfig", "coll_scatter"),
    )


FNV64_OFFSET, FNV64_PRIME = 0xCBF29CE484222325, 0x100000001B3


def fnv1a64(data: bytes, h: int = FNV64_OFFSET) -> int:
    """FNV-1a 64, exactly as nccl.bpf.c computes it over the ncclUniqueId."""
    for b in data:
        h = ((h ^ b) * FNV64_PRIME) & 0xFFFFFFFFFFFFFFFF
    return h


def unique_id_identity(unique_id: bytes) -> int:
    """The cross-rank identity of a communicator made from this 128-byte ncclUniqueId."""
    return fnv1a64(unique_id)


def split_identity(parent: int, color: int, index: int) -> int:
    """Identity of the communicator that split number `index` of `parent` made for `color`."""
    return fnv1a64(parent.to_bytes(8, "little") + (color & 0xFFFFFFFF).to_bytes(4, "little")
                   + (index & 0xFFFFFFFF).to_bytes(4, "little"))


@dataclass
class CommState:
    name: str
    identity: Optional[int]  # None when the communicator was made before we attached
    seq: int = 0             # next collective's sequence number
    splits: int = 0          # splits of this communicator so far (part of each child's identity)


@dataclass
class ProcState:
    rank: int
    job: str
    comms: Dict[int, CommState] = field(default_factory=dict)  # handle -> state


MAX_COMMS_PER_PROC = 4096  # jobs make tens of communicators; this only bounds leaks from missed destroys


_OP_ARR = np.array([OP_NAMES.get(i, "") for i in range(64)], object)  # fn -> op name ("": not a collective)


class NcclTranslator:
    """Records of one NcclFamily -> wire events, a drain at a time. `emit` receives Events (communicators,
    p2p calls) and rows.Rows (the collectives' enters, as columns).

    A drain is cut where a record that changes who is who is (a communicator made or destroyed, a p2p
    call, which may name an unknown communicator); each part's collective calls are numbered per
    communicator with array operations, in call order, as one call at a time would number them."""

    def __init__(self, emit: Callable):
        self.emit = emit
        self.groups = Groups()
        self._out: Optional[Builder] = None  # the drain being translated (records())
        self.procs: Dict[int, ProcState] = {}
        # What could not be named or was not worth an event; shipped by the agent as loss/health counters.
        self.counters: Dict[str, int] = {"unknown_handles": 0, "unknown_parents": 0, "init_failed": 0,
                                         "groups": 0, "destroyed": 0, "aborted": 0, "unknown_fn": 0,
                                         "left_to_plugin": 0, "left_to_c10d": 0}
        self._plugin_since: Dict[int, int] = {}  # pid -> ns from which ccld's NCCL profiler plugin reports it
        self._c10d: set = set()  # pids whose collectives the ProcessGroupNCCL probes report (pgnccl.py)
        self._index()

    def add_process(self, pid: int, rank: int, job: str) -> None:
        self.procs.setdefault(pid, ProcState(rank, job))
        self._index()

    def forget(self, pid: int) -> None:
        self.procs.pop(pid, None)
        self._plugin_since.pop(pid, None)
        self._c10d.discard(pid)
        self._index()

    def leave_collectives(self, pid: int) -> None:
        """PyTorch's ProcessGroupNCCL probes (pgnccl.py) report this process's collectives, numbered by
        c10d: its collective calls are dropped here (counted), its p2p calls and communicators kept."""
        self._c10d.add(pid)

    def defer_to_plugin(self, pid: int, since_ns: int) -> None:
        """ccld's NCCL profiler plugin reports this process's NCCL from since_ns (its clock) on, with
        NCCL's own communicator hashes and sequence numbers: this process's records from then on are
        dropped (counted), so each collective has one source."""
        self._plugin_since[pid] = min(since_ns, self._plugin_since.get(pid, since_ns))

    def _index(self) -> None:
        pids = sorted(self.procs)
        self._pids = np.array(pids, np.int64)
        self._ranks = np.array([self.procs[p].rank for p in pids], np.int64)

    def records(self, rows: np.ndarray, kinds: np.ndarray) -> None:
        """Every record of one drain, in ring order."""
        out = Builder(self.groups)
        self._out = out
        hdr = records.view(rows[:, :records.HEADER_SIZE].copy(), records.HDR_DTYPE)
        tgid = hdr["tgid"].astype(np.int64)
        known = records.member(tgid, self._pids)
        if not known.all():  # processes we were told to forget; their probes are being detached
            rows, kinds = rows[known], kinds[known]
        if self._plugin_since:
            ts = hdr["ts_ns"].astype(np.int64)[known]
            tgid = tgid[known]
            dp = np.array(sorted(self._plugin_since), np.int64)  # a few pids: per process, not per record
            ds = np.array([self._plugin_since[p] for p in dp.tolist()], np.int64)
            i = np.clip(np.searchsorted(dp, tgid), 0, len(dp) - 1)
            left = (dp[i] == tgid) & (ts >= ds[i])
            if left.any():
                self.counters["left_to_plugin"] += int(np.count_nonzero(left))
                rows, kinds = rows[~left], kinds[~left]
        if self._c10d:
            pids = records.view(rows[:, :records.HEADER_SIZE].copy(), records.HDR_DTYPE)["tgid"].astype(np.int64)
            left = (kinds == COLL) & records.member(pids, list(self._c10d))
            if left.any():
                self.counters["left_to_c10d"] += int(np.count_nonzero(left))
                rows, kinds = rows[~left], kinds[~left]
        groups = kinds == GROUP
        if groups.any():
            self.counters["groups"] += int(np.count_nonzero(groups))
            rows, kinds = rows[~groups], kinds[~groups]
        n = len(kinds)
        cuts = np.flatnonzero(kinds != COLL).tolist()
        a = 0
        for c in cuts + [n]:
            if c > a:
                self._colls(out, records.view(rows[a:c], NcclFamily.KINDS.dtypes[COLL]))
            if c < n:
                self(int(kinds[c]), NcclFamily.KINDS.record(rows[c]))
            a = c + 1
        self._out = None
        for item in out.done():
            self.emit(item)

    def _colls(self, out: Builder, r: np.ndarray) -> None:
        """Collective calls, all of one part: numbered per (process, communicator) in call order."""
        fn = r["fn"].astype(np.int64)
        op = _OP_ARR[np.clip(fn, 0, len(_OP_ARR) - 1)]
        good = (fn >= 0) & (fn < len(_OP_ARR)) & (op != "")
        if not good.all():
            self.counters["unknown_fn"] += int(np.count_nonzero(~good))
            r, fn, op = r[good], fn[good], op[good]
        n = len(r)
        if n == 0:
            return
        pid = r["hdr"]["tgid"].astype(np.int64)
        handle = r["comm"].astype(np.uint64)
        first, inv = group_keys(pid, handle.view(np.int64))
        # the n-th call of a (process, communicator) in this part: its position among that pair's calls
        order = np.lexsort((np.arange(n), inv))
        starts = np.r_[0, np.flatnonzero(inv[order][1:] != inv[order][:-1]) + 1]
        nth = np.empty(n, np.int64)
        nth[order] = np.arange(n) - np.repeat(starts, np.diff(np.r_[starts, n]))
        base = np.empty(len(first), np.int64)
        names = np.empty(len(first), object)
        counts = np.bincount(inv, minlength=len(first))
        for u in range(len(first)):  # in order of first sight, as call by call
            i = int(first[u])
            p = int(pid[i])
            cs = self._comm(p, self.procs[p], int(handle[i]), int(r["hdr"]["ts_ns"][i]))
            base[u], names[u] = cs.seq, cs.name
            cs.seq += int(counts[u])
        seq = base[inv] + nth
        dt = r["datatype"].astype(np.int64)
        count = r["count"].astype(np.int64)
        root = r["root"].astype(np.int64)
        gfirst, ginv = group_keys(inv, fn, count, dt, root)
        gids = []
        for g in gfirst.tolist():
            u, f, c, d, ro = int(inv[g]), int(fn[g]), int(count[g]), int(dt[g]), int(root[g])
            dtype, size = DTYPES.get(d, (f"nccl_dtype{d}", 0))
            gids.append(self.groups.id(KIND_COLL, {"backend": "nccl", "comm": names[u], "op": OP_NAMES[f],
                                                   "count": c, "dtype": dtype, "root": ro,
                                                   "nbytes": c * size if size else -1}))
        group = np.array(gids, np.int32)[ginv]
        out.add(np.full(n, KIND_COLL, np.uint8), group,
                {"seq": seq, "pid": pid, "rank": self._ranks[np.searchsorted(self._pids, pid)],
                 "ts_ns": r["hdr"]["ts_ns"].astype(np.int64), "tid": r["hdr"]["tid"].astype(np.int64),
                 "lib_seq": np.full(n, -1, np.int64)})

    def _count(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1

    def _new_comm(self, pid: int, st: ProcState, handle: int, identity: Optional[int], ts: int,
                  group_rank: int = -1, group_size: int = -1) -> CommState:
        if identity is None:  # the process in the name too: two processes may hold one address
            who = f"r{st.rank}" if st.rank >= 0 else f"p{pid}"
            name = f"{st.job}/nccl:handle-{who}-{handle:x}"
        else:
            name = f"{st.job}/nccl:{identity:016x}"
        if len(st.comms) >= MAX_COMMS_PER_PROC and handle not in st.comms:
            st.comms.clear()
        cs = st.comms[handle] = CommState(name, identity)
        self._out.event(ev.CommInit(pid=pid, rank=st.rank, ts_ns=ts, backend="nccl", comm=name,
                                    group_rank=group_rank, group_size=group_size, handle=handle,
                                    seq_source=ev.SEQ_FROM_ATTACH if identity is None else ev.SEQ_FROM_INIT))
        return cs

    def _comm(self, pid: int, st: ProcState, handle: int, ts: int) -> CommState:
        cs = st.comms.get(handle)
        if cs is None:  # made before we attached (or its init record was lost)
            self._count("unknown_handles")
            cs = self._new_comm(pid, st, handle, None, ts)
        return cs

    def __call__(self, kind: int, rec) -> None:
        """One record of a rare kind (within records(): collective calls go through _colls)."""
        pid = rec.hdr.tgid
        st = self.procs.get(pid)
        if st is None:
            return  # a process we were told to forget; its probes are being detached
        ts = rec.hdr.ts_ns
        if kind == P2P_REC:
            cs = self._comm(pid, st, rec.comm, ts)
            dtype = DTYPES.get(rec.datatype, (f"nccl_dtype{rec.datatype}", 0))[0]
            self._out.event(ev.P2P(pid=pid, rank=st.rank, ts_ns=ts, backend="nccl", comm=cs.name,
                                   op=OP_NAMES.get(rec.fn, f"fn{rec.fn}"), peer=rec.root, count=rec.count,
                                   dtype=dtype))
        elif kind == COMM_INIT:
            self._on_init(pid, st, rec)
        elif kind == COMM_END:
            self._count("aborted" if rec.fn == FN_ABORT else "destroyed")
            st.comms.pop(rec.comm, None)  # the handle's memory may be reused by the next communicator
        elif kind == GROUP:
            self._count("groups")  # calls inside a group are recorded as they are called

    def _on_init(self, pid: int, st: ProcState, rec) -> None:
        ts = rec.hdr.ts_ns
        identity: Optional[int] = None
        if rec.fn == FN_SPLIT:
            parent = st.comms.get(rec.parent)
            if parent is not None:
                # Count every split of the parent, failed or NOCOLOR ones too: every parent rank calls it.
                index, parent.splits = parent.splits, parent.splits + 1
                if parent.identity is not None:
                    identity = split_identity(parent.identity, rec.color, index)
            if identity is None and rec.comm and rec.ret in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
                self._count("unknown_parents")
        elif rec.idhash:
            identity = rec.idhash
        if rec.ret not in (NCCL_SUCCESS, NCCL_IN_PROGRESS) or not rec.comm:
            if not (rec.fn == FN_SPLIT and rec.color == NCCL_SPLIT_NOCOLOR and rec.ret == NCCL_SUCCESS):
                self._count("init_failed")
            return
        self._new_comm(pid, st, rec.comm, identity, ts, rec.rank, rec.nranks)
