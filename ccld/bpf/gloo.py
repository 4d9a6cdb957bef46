"""Loader of gloo.bpf.c: PyTorch's gloo backend (c10d::ProcessGroupGloo in libtorch_cpu.so).

Turns the program's records into wire events, a drain at a time: CommInit when a process group is
built, CollEnter when a rank calls collective `seq`, WorkStart/WorkEnd when gloo's worker thread runs
and finishes it, P2P when a send/recv is posted and P2PEnd when the wait on it is over. Times stay
CLOCK_MONOTONIC ns. The collectives' records (three per collective: enter; start with sizes; end)
are read as arrays and their events leave as rows.Rows (columns), with no Python step per record;
the rare kinds (groups, p2p ops, broken connections) are read one by one. Per-process state
(process group pointer -> communicator name, enters waiting for their size, p2p counters) lives here
and is dropped when the process is forgotten; which collective a work is (its group and seq) is kept
by the kernel from its enter to its end and comes with each of its records.

Numbering: a collective's `seq` is c10d's collective tag + 1, read in the kernel (the first
collective of a group is 1, as c10d's own seq is when no p2p came before), identical on every member
whatever p2p ops some of them did; c10d's seq (which counts both) goes along as `lib_seq`. Where the
tag cannot be read (tag_offset found no accessor it knows), the kernel numbers collectives per
(process, group) from the first one seen. A p2p op's `seq` is this rank's n-th op of that direction
with that peer on that group, counted here. CommInit.seq_source says which numbering holds and
whether it began at the group's creation (exact) or at our attach (ranks may be offset: the collector
must align them).

Sizes: CollEnter.nbytes is the per-rank tensor's bytes (the smallest buffer c10d hands gloo, see
gloo.bpf.c), for the ops whose ranks must agree on it (SIZED_OPS). It is measured on gloo's worker
thread when the work runs, after the Python thread's enter, and comes with the work's start, so the
enter of such an op is held until its start comes, the work ends, the process is forgotten, or
HOLD_MS pass (a worker busy with earlier works: the enter then goes out without a size). Its
timestamp is the call's either way; only when the collector sees it moves, by at most HOLD_MS plus
one drain. Count and dtype stay unknown (-1, ""): gloo's buffers carry bytes, not elements.

Broken connections: when gloo's I/O thread finds a connection broken (PAIR_FAIL: EOF, reset), the
first such peer since the process's last successful collective is named in the error of its next
failed WorkEnd: "...; connection to group rank N broke: <gloo's message>" (LOST_RE reads it back).
A rank killed inside a collective is the one its peers' errors name.

Communicators are named `<job>/gloo:<name>`, name = c10d's group name (setGroupName, right after the
group is built: "0" for the world, then "1", "2", ... in new_group order, or a hash of the ranks),
the same on every member and different between groups. Ranks of a 2 x 2 tensor-parallel job build
different groups in the same place ({0,1} and {2,3} are each one rank's second group), so an order
of creation alone would join unrelated groups. Caveat: a group built before we attached, or by a
c10d without setGroupName, has no name we saw: it is named `<job>/gloo:<k>`, k = the order in which
the process built (or first used) its gloo groups; right for the world group, and for subgroups only
when every rank belongs to the same ones (a job attached mid-run with tp x dp groups is not).
"""
from __future__ import annotations

import ctypes as ct
import re
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from ccld import wire as ev
from ccld.bpf import elfcode, records
from ccld.bpf.loader import Attachment, Family, Probe
from ccld.bpf.records import Header
from ccld.bpf.rows import KIND_COLL, KIND_END, KIND_START, Builder, Groups, group_keys

ERR_LEN = 160
NAME_LEN = 64   # CCLD_NAME_LEN in gloo.bpf.c
REC_SIZE = 200  # CCLD_REC_SIZE in gloo.bpf.c: every record's slot (gloo_pair_fail, the largest)

# c10d::OpType (torch/csrc/distributed/c10d/Work.hpp)
OP_NAMES = {
    0: "broadcast", 1: "allreduce", 2: "allreduce_coalesced", 3: "reduce", 4: "allgather",
    5: "_allgather_base", 6: "allgather_coalesced", 7: "gather", 8: "scatter", 9: "reduce_scatter",
    10: "alltoall_base", 11: "alltoall", 12: "send", 13: "recv", 14: "recvanysource", 15: "barrier",
    16: "_reduce_scatter_base", 17: "coalesced", 18: "_allreduce_sparse",
    19: "reduce_scatter_tensor_coalesced", 100: "unknown",
}

PG_INIT, WORK_INIT, WORK_START, WORK_END, P2P_REC, PAIR_FAIL, P2P_END, PG_NAME = 1, 2, 3, 4, 5, 7, 8, 9
P2P_OPS = {12: "send", 13: "recv", 14: "recvanysource"}  # c10d::OpType

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


class PgName(ct.Structure):
    _fields_ = [("hdr", Header), ("pg", ct.c_uint64), ("len", ct.c_uint32), ("pad", ct.c_uint32),
                ("name", ct.c_char * NAME_LEN)]


class WorkInit(ct.Structure):
    _fields_ = [("hdr", Header), ("pg", ct.c_uint64), ("work", ct.c_uint64), ("seq", ct.c_uint64),
                ("lib_seq", ct.c_uint64), ("enter_ns", ct.c_uint64), ("timeout_ms", ct.c_uint64),
                ("tag", ct.c_int64), ("op", ct.c_int32), ("reuse", ct.c_uint8), ("pad", ct.c_uint8 * 3)]


class EnterOf(ct.Structure):
    """What a start or an end carries of its enter (struct gloo_enter_of)."""
    _fields_ = [("enter_ns", ct.c_uint64), ("lib_seq", ct.c_uint64), ("tid", ct.c_uint32), ("op", ct.c_int32),
                ("found", ct.c_uint8), ("releases", ct.c_uint8), ("pad", ct.c_uint8 * 6)]


class WorkStart(ct.Structure):
    _fields_ = [("hdr", Header), ("pg", ct.c_uint64), ("work", ct.c_uint64), ("seq", ct.c_uint64),
                ("start_ns", ct.c_uint64), ("e", EnterOf), ("min_bytes", ct.c_uint64), ("total_bytes", ct.c_uint64),
                ("nbufs", ct.c_uint32), ("sized", ct.c_uint8), ("pad", ct.c_uint8 * 3)]


class WorkEnd(ct.Structure):
    _fields_ = [("hdr", Header), ("pg", ct.c_uint64), ("work", ct.c_uint64), ("seq", ct.c_uint64),
                ("start_ns", ct.c_uint64), ("e", EnterOf), ("ok", ct.c_int32), ("pad", ct.c_uint32)]


class PairFail(ct.Structure):
    _fields_ = [("hdr", Header), ("pair", ct.c_uint64), ("peer", ct.c_int32), ("pad", ct.c_uint32),
                ("msg", ct.c_char * ERR_LEN)]


class P2pRec(ct.Structure):
    _fields_ = [("hdr", Header), ("pg", ct.c_uint64), ("work", ct.c_uint64), ("seq", ct.c_uint64),
                ("enter_ns", ct.c_uint64), ("nbytes", ct.c_uint64), ("op", ct.c_int32), ("peer", ct.c_int32),
                ("tag", ct.c_int32), ("pad", ct.c_uint32)]


class P2pEnd(ct.Structure):
    _fields_ = [("hdr", Header), ("work", ct.c_uint64), ("wait_ns", ct.c_uint64), ("ok", ct.c_int32),
                ("pad", ct.c_uint32)]


class HotHead(ct.Structure):
    """What the three records of a collective (WorkInit, WorkStart, WorkEnd) share, at the same offsets."""
    _fields_ = [("hdr", Header), ("pg", ct.c_uint64), ("work", ct.c_uint64), ("seq", ct.c_uint64)]


KINDS = records.Kinds({PG_INIT: PgInit, WORK_INIT: WorkInit, WORK_START: WorkStart, WORK_END: WorkEnd,
                       P2P_REC: P2pRec, PAIR_FAIL: PairFail, P2P_END: P2pEnd, PG_NAME: PgName}, REC_SIZE)
HOT_HEAD = records.record_dtype(HotHead, REC_SIZE)
HOT_KINDS = (WORK_INIT, WORK_START, WORK_END)
_SIZED_AT = WorkStart.sized.offset   # byte of a start that says whether an algorithm entry sized it
_REUSE_AT = WorkInit.reuse.offset    # byte of an enter that says its work object's last enter still waits
assert (WorkStart.start_ns.offset, WorkStart.e.offset) == (WorkEnd.start_ns.offset, WorkEnd.e.offset)

NEXT_TAG = "_ZN4c10d16ProcessGroupGloo7nextTagEv"
TAG_CODE_BYTES = 32  # nextTag is 4 instructions (~20 bytes, 24 with endbr64)
_ENDBR64 = b"\xf3\x0f\x1e\xfa"


def tag_offset(code: bytes) -> Optional[int]:
    """The offset of c10d's collective counter in ProcessGroupGloo, read off nextTag()'s x86-64 code:
    `mov OFF(%rdi),%eax; lea 0x1(%rax),%edx; mov %edx,OFF(%rdi); ret` (disp32 or disp8 forms, an
    optional endbr64 first), i.e. "return collectiveCounter_++". None for any other code: then the
    counter is not read (a build we have not seen; the translator numbers collectives itself)."""
    if code.startswith(_ENDBR64):
        code = code[len(_ENDBR64):]
    for load, store, width in ((b"\x8b\x87", b"\x89\x97", 4), (b"\x8b\x47", b"\x89\x57", 1)):
        n = 2 + width
        if len(code) < 2 * n + 4 or not code.startswith(load):
            continue
        off = code[2:n]
        if code[n:n + 3] == b"\x8d\x50\x01" and code[n + 3:2 * n + 3] == store + off and code[2 * n + 3] == 0xC3:
            value = int.from_bytes(off, "little", signed=True)
            return value if 0 < value < 65536 else None
    return None


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
    KINDS = KINDS
    PROBES = (
        [Probe(_PGG + "C1E", "pg_init", True),          # C2 is an alias at the same address
         # the group's name, which joins a subgroup across ranks; optional (without it: creation order)
         Probe("_ZN4c10d12ProcessGroup12setGroupNameERKNSt7__cxx1112basic_string", "pg_name"),
         Probe(_AW + "C1E", "work_init", True),
         Probe(_AW + "7executeE", "work_exec", True),
         Probe(_AW + "14finishWorkGlooEv", "work_done", True),
         Probe(_AW + "19finishWorkGlooErrorE", "work_fail", True),
         Probe(_member("send"), "p2p_send"),
         Probe(_member("recv"), "p2p_recv"),
         Probe(_member("recvAnysource"), "p2p_recvany"),
         # where the collective counter lives, read off nextTag's code (not probed: see gloo.bpf.c)
         Probe(NEXT_TAG, "", exact=True),
         # p2p ops as works: posted (with c10d's seq) and over (the wait returned); optional
         Probe(_PGG + "8SendWorkC1E", "p2p_send_work"),
         Probe(_PGG + "8RecvWorkC1E", "p2p_recv_work"),
         Probe(_PGG + "8SendWork4waitE", "p2p_wait"),
         Probe(_PGG + "8RecvWork4waitE", "p2p_wait"),
         Probe("_ZN4c10d4Work14finishAndThrowE", "p2p_done"),
         # sizes: optional, the enters go out without them when these are missing
         Probe("_ZN4gloo7Context19createUnboundBufferEPvm", "buf_new", exact=True),
         # broken connections: optional, a failed collective then says no more than that it failed
         Probe(_TCP_PAIR + "C1E", "pair_new"),
         Probe(_TCP_PAIR + "15signalExceptionERKNSt7__cxx1112basic_string", "pair_fail")]
        + [Probe(_member(n), "api_enter") for n in _API]
        + [Probe(a, "algo_enter") for a in _GLOO_ALGOS]
    )

    def _attach_lib(self, lib: str) -> Attachment:
        att = super()._attach_lib(lib)
        att.config["tag_off"] = None
        addr = att.symbols.get(NEXT_TAG)
        if addr is not None:
            try:
                att.config["tag_off"] = tag_offset(elfcode.code_at(lib, addr, TAG_CODE_BYTES))
            except (OSError, ValueError):
                pass
        if att.config["tag_off"] is None:
            att.missing.append("nextTag's collective counter (collectives are numbered from the first one seen)")
        return att

    def traced_value(self, att: Attachment) -> ct.c_uint32:
        """gloo.bpf.c's `traced` value: the process's counter offset + 1, 1 when unknown."""
        off = att.config.get("tag_off")
        return ct.c_uint32(off + 1 if off else 1)

    def attach(self, pid: int, lib: str) -> Attachment:
        att = super().attach(pid, lib)
        tell = getattr(self.on_record, "tags_readable", None)
        if tell is not None:
            tell(pid, bool(att.config.get("tag_off")))
        return att


@dataclass
class ProcState:
    rank: int
    job: str
    pgs: Dict[int, Tuple[str, int, int]] = field(default_factory=dict)  # pg ptr -> (comm, group_rank, size)
    built: Dict[int, Tuple[int, int, int, int]] = field(default_factory=dict)  # pg ptr -> (index, group_rank,
                                            # size, ts) of a group seen built and not yet named or used
    unnamed: List[int] = field(default_factory=list)  # groups built since the last setGroupName: it names
                                            # the first (TORCH_DISTRIBUTED_DEBUG=DETAIL builds a helper
                                            # gloo group after the group's own backend)
    codes: Dict[int, int] = field(default_factory=dict)  # pg ptr -> its comm's index in GlooTranslator.comms
    lost: Optional[Tuple[int, str]] = None  # first broken connection since the last good end: (peer, message)
    next_index: int = 0
    tags: bool = False                      # the collective tag is read (GlooFamily.attach says)
    p2p_n: Dict[Tuple[int, str, int], int] = field(default_factory=dict)  # (pg, op, peer) -> ops posted
    p2p: Dict[int, Tuple[str, str, int, int]] = field(default_factory=dict)  # work ptr -> (comm, op, peer, seq)


def gloo_message(raw: bytes) -> str:
    """gloo's exception text without its source location and advice: "Read error [a]:p: reset by peer"."""
    text = raw.decode("utf-8", "replace")
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". This is typically", 1)[0].strip()[:120]


@dataclass
class Held:
    """An enter waiting for its size: CollEnter's fields but nbytes."""
    pid: int
    rank: int
    ts_ns: int       # the enter's time (the API entry)
    comm: int        # index into GlooTranslator.comms
    seq: int
    op: int          # index into OP_LIST
    tid: int
    lib_seq: int
    since_ns: int    # the WORK_INIT record's time (HOLD_MS counts from it)
    start_ns: int = 0  # a start that came while it waited (sent right after it); 0: none


MAX_WORKS_PER_PROC = 65536  # p2p ops in flight at once are a handful; this only bounds leaks from missed ends
NO_BYTES = (1 << 64) - 1    # gloo_p2p.nbytes when no buffer was seen
OP_LIST = [OP_NAMES.get(i, f"op{i}") for i in range(256)]  # c10d::OpType (a uint8_t) -> name
_SIZED = np.array([name in SIZED_OPS for name in OP_LIST])
_SLOT_KINDS = np.array([KIND_COLL, KIND_START, KIND_END], np.uint8)
_NB_LIMIT, _COMM_LIMIT = (1 << 34) - 1, 1 << 20  # what fits a group key of one int64 (kind 2, comm 20, op 8 bits)


class GlooTranslator:
    """Records of one GlooFamily -> wire events, a drain at a time. `emit` receives Events (rare kinds:
    communicators, p2p ops, failures) and rows.Rows (enters, starts and ends, as columns).

    What a drain's collective records become, as the reference one-record-at-a-time translator
    (tests/bpf/gloo_reference.py) makes them: an enter of a sized op waits for its size (the next
    record of the same work: its start with the sizes, its end, or a newer enter of a reused work
    object), a start that came while it waited goes right after it; the others go at once. Each drain
    is cut where a rare record is (they change who is who: a new group, a broken connection), and
    each part is done with array operations; enters still waiting pass to the next drain in `held`."""

    def __init__(self, emit: Callable, hold_ns: int = HOLD_MS * 1_000_000):
        self.emit = emit
        self.hold_ns = hold_ns
        self.procs: Dict[int, ProcState] = {}
        self.unmatched = 0  # start/end records of works we never saw built (e.g. attached mid-collective)
        self.unsized = 0    # enters of SIZED_OPS sent without a size (HOLD_MS passed, or the work ended first)
        self.abandoned = 0  # p2p works rebuilt at the same address before their wait ended (never waited for)
        self.held: Dict[Tuple[int, int], Held] = {}  # (pid, work) -> enter waiting for its size, oldest first
        self.expired: set = set()  # (pid, work) of enters HOLD_MS sent unsized whose start/end has not come
        self.comms: List[str] = []                   # communicator names by index
        self.zero_pg: Dict[Tuple[int, int], int] = {}  # (pid, work) -> comm index, for works entered with pg 0
        self.groups = Groups()
        self._group_ids: Dict[Tuple[int, int, int, int], int] = {}  # (kind, comm, op, nbytes) -> Groups id
        self._table = self.groups.table
        self._pids = np.zeros(0, np.int64)   # known pids, sorted, and their ranks
        self._ranks = np.zeros(0, np.int64)
        self._comm_table = (np.zeros(0, np.uint64), np.zeros(0, np.int64), np.zeros(0, np.int64))
        self._gkeys = np.zeros(0, np.int64)  # group keys seen (sorted) and their Groups ids, for _groups_of
        self._gids = np.zeros(0, np.int32)
        self._gtable = None                  # the Groups table those ids are in

    # -- processes --------------------------------------------------------------------------------
    def add_process(self, pid: int, rank: int, job: str) -> None:
        self.procs.setdefault(pid, ProcState(rank, job))
        self._index()

    def _index(self) -> None:
        pids = sorted(self.procs)
        self._pids = np.array(pids, np.int64)
        self._ranks = np.array([self.procs[p].rank for p in pids], np.int64)
        self._tables()

    def _tables(self) -> None:
        """The sorted (pg pointer, pid, comm index) table of every named group, for _comm_codes."""
        rows = sorted((g, p, c) for p, st in self.procs.items() for g, c in st.codes.items() if g)
        self._comm_table = (np.array([r[0] for r in rows], np.uint64), np.array([r[1] for r in rows], np.int64),
                            np.array([r[2] for r in rows], np.int64))

    def tags_readable(self, pid: int, yes: bool) -> None:
        """GlooFamily.attach: whether the probes read c10d's collective tag in this process."""
        st = self.procs.get(pid)
        if st is not None:
            st.tags = yes

    def forget(self, pid: int) -> None:
        st = self.procs.get(pid)
        if st is not None:  # its last enters still happened: send them before forgetting it
            out = Builder(self.groups)
            for key in [k for k in self.held if k[0] == pid]:
                self._release_one(out, self.held.pop(key), None)
            self.expired = {k for k in self.expired if k[0] != pid}
            self._send(out)
        self.procs.pop(pid, None)
        self.zero_pg = {k: v for k, v in self.zero_pg.items() if k[0] != pid}
        self._index()

    def flush(self, now_ns: int) -> None:
        """Send the enters that waited HOLD_MS for a size (their worker is busy with earlier works)."""
        if not self.held:
            return
        out = Builder(self.groups)
        for key, h in list(self.held.items()):
            if now_ns - h.since_ns >= self.hold_ns:
                del self.held[key]
                self.expired.add(key)
                self._release_one(out, h, None)
        self._send(out)

    def _send(self, out: Builder) -> None:
        for item in out.done():
            self.emit(item)

    # -- a drain ----------------------------------------------------------------------------------
    def records(self, rows: np.ndarray, kinds: np.ndarray) -> None:
        """Every record of one drain, in ring order: (n, REC_SIZE) uint8 rows and their kinds."""
        head = records.view(rows, HOT_HEAD)
        known = np.isin(head["hdr"]["tgid"], self._pids)
        if not known.all():  # processes we were told to forget; their probes are being detached
            rows, kinds, head = rows[known], kinds[known], head[known]
        n = len(kinds)
        if n == 0:
            return
        # Cut at the rare kinds, and at the two collective records that change a waiting enter
        # without sending it: a start no algorithm entry sized, an enter of a reused work object.
        is_s, is_e = kinds == WORK_START, kinds == WORK_INIT
        odd = ~(is_e | is_s | (kinds == WORK_END))
        odd |= is_s & (rows[:, _SIZED_AT] == 0)
        odd |= is_e & (rows[:, _REUSE_AT] != 0)
        out = Builder(self.groups)
        if not odd.any():
            self._hot(out, rows, kinds, head)
        else:
            a = 0
            for c in np.flatnonzero(odd).tolist() + [n]:
                if c > a:
                    self._hot(out, rows[a:c], kinds[a:c], head[a:c])
                if c < n:
                    k = int(kinds[c])
                    if k == WORK_START:
                        self._start_only(out, KINDS.record(rows[c]))
                    elif k == WORK_INIT:
                        self._reused(out, KINDS.record(rows[c]))
                        self._hot(out, rows[c:c + 1], kinds[c:c + 1], head[c:c + 1])
                    else:
                        self._rare(out, k, KINDS.record(rows[c]))
                a = c + 1
        self._send(out)

    def _rank_of(self, pids: np.ndarray) -> np.ndarray:
        return self._ranks[np.searchsorted(self._pids, pids)]

    def _comm_codes(self, out: Builder, pid: np.ndarray, pg: np.ndarray, work: np.ndarray, ts: np.ndarray,
                    is_enter: np.ndarray, is_end: np.ndarray) -> np.ndarray:
        """Communicator index of each record (-1: none known, for a start or end of a work we did not
        see entered). Enters name their groups in order of first sight (a CommInit for each new one),
        as the reference does; pg 0 (the API entry was not seen): an enter takes the process's one
        group if it has exactly one, else a group of its own for pg 0, and its start and end take
        what it took. Starts and ends never name a group."""
        # the common case, with no Python step: every row's (pid, pg) named already (a sorted table of
        # every process's groups, by pg pointer; two processes with a group at one address fall through)
        table = self._comm_table
        if len(table[0]):
            at = np.minimum(np.searchsorted(table[0], pg), len(table[0]) - 1)
            if np.count_nonzero((table[0][at] != pg) | (table[1][at] != pid)) == 0:
                return table[2][at]
        zero = pg == 0
        codes = np.full(len(pid), -1, np.int64)
        e = np.flatnonzero(is_enter & ~zero)
        steps = []  # (row, unique pair of an enter's first sight, or -1 for a row of pg 0), in ring order
        if len(e):
            first, inv = group_keys(pid[e], pg[e].view(np.int64))
            steps = [(int(e[f]), u) for u, f in enumerate(first.tolist())]
        steps += [(int(i), -1) for i in np.flatnonzero(zero).tolist()]
        for i, u in sorted(steps):
            p = int(pid[i])
            st = self.procs[p]
            if u >= 0:
                g = int(pg[i])
                got = st.codes.get(g)
                codes[e[inv == u]] = got if got is not None else self._comm_for(out, p, st, g, int(ts[i]))
                continue
            key = (p, int(work[i]))
            if not is_enter[i]:  # an end is the last of its work: forget what its enter took
                codes[i] = self.zero_pg.pop(key, -1) if is_end[i] else self.zero_pg.get(key, -1)
                continue
            if len(st.pgs) == 1:
                code = next(iter(st.codes.values()))
            else:
                code = st.codes.get(0)
                if code is None:
                    code = self._comm_for(out, p, st, 0, int(ts[i]))
            self.zero_pg[key] = codes[i] = code
        rest = np.flatnonzero(~is_enter & ~zero)
        if len(rest):
            first, inv = group_keys(pid[rest], pg[rest].view(np.int64))
            got = np.array([self.procs[int(pid[rest[f]])].codes.get(int(pg[rest[f]]), -1) for f in first.tolist()],
                           np.int64)
            codes[rest] = got[inv]
        return codes

    def _group(self, kind: int, comm: int, op: int = 0, nbytes: int = -1) -> int:
        """The Groups id of the shared fields of a coll (comm, op, nbytes), start or end (comm) row."""
        key = (kind, comm, op, nbytes)
        if self._table is not self.groups.table:  # the table started afresh: our ids are stale
            self._group_ids, self._table = {}, self.groups.table
        got = self._group_ids.get(key)
        if got is None:
            if kind == KIND_COLL:
                same = {"backend": "gloo", "comm": self.comms[comm], "op": OP_LIST[op], "count": -1, "dtype": "",
                        "root": -1, "nbytes": nbytes}
            elif kind == KIND_START:
                same = {"comm": self.comms[comm]}
            else:
                same = {"comm": self.comms[comm], "ok": True, "error": ""}
            got = self.groups.id(kind, same)
            if self._table is not self.groups.table:  # this very id started a new table
                self._group_ids, self._table = {}, self.groups.table
            self._group_ids[key] = got
        return got

    def _groups_of(self, kind: np.ndarray, comm: np.ndarray, op: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """Groups ids of rows: from a sorted table of the keys seen before (no Python step), else one
        Python step per distinct (kind, comm, op, nbytes)."""
        if len(comm) == 0:
            return np.zeros(0, np.int32)
        if nbytes.max() >= _NB_LIMIT or comm.max() >= _COMM_LIMIT:  # a key too wide for one int64
            first, inv = group_keys(kind, comm, op, nbytes)
            return np.array([self._group(int(kind[f]), int(comm[f]), int(op[f]), int(nbytes[f]))
                             for f in first.tolist()], np.int32)[inv]
        key = (kind.astype(np.int64) << 62) | (comm << 42) | (op << 34) | (nbytes + 1)
        if self._gtable is self.groups.table and len(self._gkeys):
            at = np.minimum(np.searchsorted(self._gkeys, key), len(self._gkeys) - 1)
            if np.count_nonzero(self._gkeys[at] != key) == 0:
                return self._gids[at]
        _, first, inv = np.unique(key, return_index=True, return_inverse=True)
        while True:
            table = self.groups.table
            ids = np.array([self._group(int(kind[f]), int(comm[f]), int(op[f]), int(nbytes[f]))
                            for f in first.tolist()], np.int32)
            if self.groups.table is table:
                break  # (else the table started afresh on the way: number them all in the new one)
        if self._gtable is not table:
            self._gkeys, self._gids, self._gtable = np.zeros(0, np.int64), np.zeros(0, np.int32), table
        keys, keep = np.unique(np.concatenate([self._gkeys, key[first]]), return_index=True)
        self._gkeys, self._gids = keys, np.concatenate([self._gids, ids])[keep]
        return ids[inv]

    def _hot(self, out: Builder, rows: np.ndarray, kinds: np.ndarray, head: np.ndarray) -> None:
        """One part of a drain: enters, sized starts and ends only, in ring order.

        Each row makes up to three events, at (its position, enter < start < end): an enter of an op
        with no size to wait for goes at once; a start or an end that the kernel marks as the first
        since its enter ("releases") sends a sized op's enter, with the start's size (or none), unless
        HOLD_MS already sent it; then the start (an end's own when no algorithm entry sent one, or
        one that came while the enter waited); then the end. The enters of sized ops no row of this
        part releases wait in `held` for a later one."""
        n = len(kinds)
        hdr = head["hdr"]
        pid = hdr["tgid"].astype(np.int64)
        work = head["work"].astype(np.uint64)
        ts = hdr["ts_ns"].astype(np.int64)
        seq = head["seq"].astype(np.int64)
        is_e, is_s, is_d = kinds == WORK_INIT, kinds == WORK_START, kinds == WORK_END
        comm = self._comm_codes(out, pid, head["pg"].astype(np.uint64), work, ts, is_e, is_d)
        # an enter's fields: its own for an enter, the kernel's copy for a start or an end
        ve, vs, vd = (records.view(rows, KINDS.dtypes[k]) for k in (WORK_INIT, WORK_START, WORK_END))
        e = vs["e"]  # at the same offset in a start and an end
        op = np.where(is_e, ve["op"], e["op"]).astype(np.int64) & 0xFF
        enter_ns = np.where(is_e, ve["enter_ns"], e["enter_ns"]).astype(np.int64)
        lib_seq = np.where(is_e, ve["lib_seq"], e["lib_seq"]).astype(np.int64)
        tid = np.where(is_e, hdr["tid"], e["tid"]).astype(np.int64)
        start_ns = np.where(is_e, 0, vs["start_ns"]).astype(np.int64)
        found = ~is_e & (e["found"] != 0) & (comm >= 0)  # a group we never named: its enter was not seen here
        ok = ~is_d | (vd["ok"] != 0)
        nbytes = np.where(is_s & (vs["nbufs"] > 0), vs["min_bytes"].astype(np.int64), -1)
        self.unmatched += int(np.count_nonzero(~is_e & ~found) + np.count_nonzero(is_d & ~found & (start_ns != 0)))
        sized = _SIZED[op]
        rel = found & (e["releases"] != 0) & sized  # sends a waiting enter
        wait = is_e & sized                         # waits
        held_start = np.zeros(n, np.int64)          # a start that came while the enter waited
        paired = np.zeros(n, bool)                  # releasing rows whose enter is in this part
        if wait.any() and rel.any():
            self._pair(pid, work, rel, wait, paired)
        if self.held or self.expired:
            self._unhold(pid, work, rel & ~paired, rel, held_start)
        self.unsized += int(np.count_nonzero(rel & (nbytes < 0)))
        if wait.any():
            for r in np.flatnonzero(wait).tolist():
                p = int(pid[r])
                self.held[(p, int(work[r]))] = Held(p, self.procs[p].rank, int(enter_ns[r]), int(comm[r]),
                                                    int(seq[r]), int(op[r]), int(tid[r]), int(lib_seq[r]), int(ts[r]))

        # three slots per row (enter, start, end): the rows' slots in C order are the events in order
        coll = (is_e & ~sized) | rel
        st_ts = np.where(start_ns != 0, start_ns, held_start)
        start = found & (is_s | (st_ts != 0))
        end = is_d & found
        mask = np.stack([coll, start, end], 1)
        per_row = mask.sum(1)
        kind = np.broadcast_to(_SLOT_KINDS, (n, 3))[mask]

        def slots(a, b, c):
            return np.stack([a, b, c], 1)[mask]
        o_pid, o_seq, o_comm = np.repeat(pid, per_row), np.repeat(seq, per_row), np.repeat(comm, per_row)
        zeros, minus = np.zeros(n, np.int64), np.full(n, -1, np.int64)
        o_ts = slots(enter_ns, st_ts, ts)
        o_op = slots(op, zeros, zeros)
        o_nb = slots(nbytes, minus, minus)
        cols = {"seq": o_seq, "pid": o_pid, "rank": self._rank_of(o_pid), "ts_ns": o_ts,
                "tid": slots(tid, zeros, zeros), "lib_seq": slots(lib_seq, minus, minus)}
        failed = end & ~ok
        if not failed.any():
            out.add(kind, self._groups_of(kind, o_comm, o_op, o_nb), cols)
        else:  # a failed end says which connection broke, if one did since the process's last good end
            o_failed = slots(np.zeros(n, bool), np.zeros(n, bool), failed)
            group = self._groups_of(kind, o_comm, o_op, o_nb)
            o_row = np.repeat(np.arange(n), per_row)
            a = 0
            for f in np.flatnonzero(o_failed).tolist():
                out.add(kind[a:f], group[a:f], {c: x[a:f] for c, x in cols.items()})
                p = int(o_pid[f])
                cleared = bool(np.any(end & ok & (pid == p) & (np.arange(n) < o_row[f])))
                out.event(self._failed_end(p, int(o_ts[f]), int(o_comm[f]), int(o_seq[f]),
                                           None if cleared else self.procs[p].lost))
                a = f + 1
            out.add(kind[a:], group[a:], {c: x[a:] for c, x in cols.items()})
        good = end & ok
        if good.any():
            for p in np.unique(pid[good]).tolist():
                self.procs[int(p)].lost = None

    @staticmethod
    def _pair(pid, work, rel, wait, paired) -> None:
        """A waiting enter whose (pid, work) has a releasing row after it in this part waits no more
        (`wait` cleared for it, `paired` set for that row). The kernel marks only the first start or
        end after an enter, so the next of the two kinds in the same (pid, work) is the one."""
        idx = np.flatnonzero(wait | rel)
        order = idx[np.lexsort((idx, work[idx], pid[idx]))]
        op, ow = pid[order], work[order]
        nxt_same = np.r_[(op[1:] == op[:-1]) & (ow[1:] == ow[:-1]), False]
        nxt_rel = np.r_[rel[order][1:], False]
        hit = wait[order] & nxt_same & nxt_rel
        wait[order[hit]] = False
        paired[order[np.r_[False, hit[:-1]]]] = True

    def _unhold(self, pid, work, todo, rel, held_start) -> None:
        """A releasing row whose enter came in an earlier part (`todo`) takes it out of `held` (with
        the start that came while it waited), or, if HOLD_MS sent it already, sends no enter again
        (`rel` cleared). Only when enters waited across parts: one Python step per such row."""
        for i in np.flatnonzero(todo).tolist():
            key = (int(pid[i]), int(work[i]))
            h = self.held.pop(key, None)
            if h is not None:
                held_start[i] = h.start_ns
            elif key in self.expired:
                self.expired.discard(key)
                rel[i] = False

    def _reused(self, out: Builder, rec) -> None:
        """An enter of a work object whose last enter still waits (that work never started nor ended):
        the older one goes now, without a size."""
        key = (rec.hdr.tgid, rec.work)
        self.expired.discard(key)
        h = self.held.pop(key, None)
        if h is not None:
            self._release_one(out, h, None)

    def _start_only(self, out: Builder, rec) -> None:
        """A start no algorithm entry sized: it goes with its enter if that still waits, else at once."""
        pid, work = rec.hdr.tgid, rec.work
        comm = self._comm_codes(out, np.array([pid], np.int64), np.array([rec.pg], np.uint64),
                                np.array([work], np.uint64), np.array([rec.hdr.ts_ns], np.int64),
                                np.zeros(1, bool), np.zeros(1, bool))[0]
        if not rec.e.found or comm < 0:
            self.unmatched += 1
            return
        h = self.held.get((pid, work))
        if h is not None:
            h.start_ns = rec.start_ns
        else:
            out.one(KIND_START, self._group(KIND_START, int(comm)), rec.seq, pid, self.procs[pid].rank, rec.start_ns)

    def _failed_end(self, pid: int, ts: int, comm: int, seq: int, lost) -> ev.WorkEnd:
        error = "gloo reported an error (finishWorkGlooError)"
        if lost is not None:
            peer, msg = lost
            error += (f"; connection to group rank {peer} broke" if peer >= 0 else "; a connection broke") + \
                (f": {msg}" if msg else "")
        return ev.WorkEnd(pid=pid, rank=self.procs[pid].rank, ts_ns=ts, comm=self.comms[comm], seq=seq, ok=False,
                          error=error)

    def _release_one(self, out: Builder, h: Held, nbytes: Optional[int]) -> None:
        """Send one waiting enter (and the start that came while it waited)."""
        if nbytes is None:
            self.unsized += 1
        out.one(KIND_COLL, self._group(KIND_COLL, h.comm, h.op, -1 if nbytes is None else nbytes), h.seq, h.pid,
                h.rank, h.ts_ns, h.tid, h.lib_seq)
        if h.start_ns:
            out.one(KIND_START, self._group(KIND_START, h.comm), h.seq, h.pid, h.rank, h.start_ns)

    # -- communicators and the rare records ------------------------------------------------------
    def _comm_for(self, out: Builder, pid: int, st: ProcState, pg: int, ts: int) -> int:
        """The code of group `pg` at its first use: named already, else by its order of creation (seen
        built and never named) or, not seen built (attached mid-run), of first use."""
        code = st.codes.get(pg)
        if code is not None:
            return code
        built = st.built.pop(pg, None)
        if built is not None:
            index, group_rank, size, _ = built
            return self._named(out, pid, st, pg, f"{st.job}/gloo:{index}", group_rank, size, ts)
        st.next_index += 1
        return self._named(out, pid, st, pg, f"{st.job}/gloo:{st.next_index - 1}", -1, -1, ts)

    def _built(self, st: ProcState, pg: int, group_rank: int, size: int, ts: int) -> None:
        """A gloo group built (PG_INIT): named by the setGroupName that follows, or at its first use."""
        if st.codes.pop(pg, None) is not None:  # an address a destroyed group had: a new group
            st.pgs.pop(pg, None)
            self._tables()
        st.built[pg] = (st.next_index, group_rank, size, ts)
        st.next_index += 1
        st.unnamed.append(pg)

    def _named(self, out: Builder, pid: int, st: ProcState, pg: int, comm: str, group_rank: int, size: int,
               ts: int) -> int:
        st.pgs[pg] = (comm, group_rank, size)
        code = st.codes[pg] = len(self.comms)
        self.comms.append(comm)
        self._tables()
        # Seen at its creation (PG_INIT: group_rank known) -> every count here starts with the group's.
        source = (ev.SEQ_LIBRARY if st.tags else ev.SEQ_FROM_INIT) if group_rank >= 0 else \
            (ev.SEQ_LIBRARY if st.tags else ev.SEQ_FROM_ATTACH)
        out.event(ev.CommInit(pid=pid, rank=st.rank, ts_ns=ts, backend="gloo", comm=comm,
                              group_rank=group_rank, group_size=size, handle=pg, seq_source=source))
        return code

    def _rare(self, out: Builder, kind: int, rec) -> None:
        pid = rec.hdr.tgid
        st = self.procs[pid]
        ts = rec.hdr.ts_ns
        if kind == PG_INIT:
            self._built(st, rec.pg, rec.rank, rec.size, ts)
        elif kind == PG_NAME:
            # c10d names a group right after building its backends, on the same thread
            pg = next((g for g in st.unnamed if g in st.built), None)
            st.unnamed.clear()
            if pg is None:
                return  # a group of another backend (NCCL), or one whose gloo backend we did not see built
            index, group_rank, size, _ = st.built.pop(pg)
            name = rec.name.decode("utf-8", "replace") or str(index)
            self._named(out, pid, st, pg, f"{st.job}/gloo:{name}", group_rank, size, ts)
        elif kind == PAIR_FAIL:
            if st.lost is None:  # the first one: later ones follow from it (the process group is broken)
                st.lost = (rec.peer, gloo_message(rec.msg))
        elif kind == P2P_REC:
            self._p2p(out, pid, st, rec, ts)
        elif kind == P2P_END:
            got = st.p2p.pop(rec.work, None)
            if got is None:
                self.unmatched += 1  # posted before we attached
                return
            comm, op, peer, seq = got
            out.event(ev.P2PEnd(pid=pid, rank=st.rank, ts_ns=ts, comm=comm, op=op, peer=peer, seq=seq,
                                ok=bool(rec.ok), error="" if rec.ok else "gloo reported an error (send/recv wait)",
                                wait_ns=rec.wait_ns))

    def _p2p(self, out: Builder, pid: int, st: ProcState, rec, ts: int) -> None:
        if rec.pg == 0 and len(st.pgs) == 1:
            comm = next(iter(st.pgs.values()))[0]
        else:
            comm = self.comms[self._comm_for(out, pid, st, rec.pg, ts)]
        op = P2P_OPS.get(rec.op, f"op{rec.op}")
        seq = -1
        if rec.peer >= 0:
            key = (rec.pg, op, rec.peer)
            seq = st.p2p_n[key] = st.p2p_n.get(key, 0) + 1
        if rec.work in st.p2p:
            self.abandoned += 1  # a work object reused: its op was never waited for (isend, dropped)
        if len(st.p2p) >= MAX_WORKS_PER_PROC:
            st.p2p.clear()
        st.p2p[rec.work] = (comm, op, rec.peer, seq)
        nbytes = -1 if rec.nbytes == NO_BYTES else rec.nbytes
        out.event(ev.P2P(pid=pid, rank=st.rank, ts_ns=rec.enter_ns or ts, backend="gloo", comm=comm, op=op,
                         peer=rec.peer, tag=rec.tag, seq=seq, nbytes=nbytes, lib_seq=rec.seq))
