"""The records gloo.bpf.c writes, mirrored in ctypes (sizes checked against its `_Static_assert`s by
tests/unit/test_bpf_records.py), and the c10d vocabulary they carry.

Kinds: a process group built (PG_INIT) and named (PG_NAME); the three records of a collective (its
enter WORK_INIT, WORK_START with the sizes gloo's algorithm entry saw, WORK_END), which share a head
(HotHead: read as arrays, a drain at a time); a p2p op posted (P2P_REC) and waited for (P2P_END); a
broken connection (PAIR_FAIL). Every record takes one REC_SIZE slot; times are CLOCK_MONOTONIC ns.
"""
from __future__ import annotations

import ctypes as ct

from ccld.bpf import records
from ccld.bpf.records import Header

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
OP_LIST = [OP_NAMES.get(i, f"op{i}") for i in range(256)]  # c10d::OpType (a uint8_t) -> name

PG_INIT, WORK_INIT, WORK_START, WORK_END, P2P_REC, PAIR_FAIL, P2P_END, PG_NAME = 1, 2, 3, 4, 5, 7, 8, 9
P2P_OPS = {12: "send", 13: "recv", 14: "recvanysource"}  # c10d::OpType
NO_BYTES = (1 << 64) - 1    # gloo_p2p.nbytes when no buffer was seen


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
assert (WorkStart.start_ns.offset, WorkStart.e.offset) == (WorkEnd.start_ns.offset, WorkEnd.e.offset)
