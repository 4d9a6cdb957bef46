"""The datagrams of ccld's NCCL profiler plugin (ccld_profiler.h), as numpy dtypes, and `decode()`.

One datagram = a 96-byte header, `n_records` records of 80 bytes, `text_len` bytes of UTF-8 (why the
plugin turned off; usually none). Byte 0 of a record is its kind; kinds share three layouts: TASK
(coll/p2p start, first kernel, end), COMM, PROGRESS. Little-endian, as the plugin writes it on every
machine NCCL runs on.

Times: `t_ns`, `t_enq_ns`, `last_ns`, `sent_ns` are the sending host's CLOCK_MONOTONIC ns (nothing is
re-stamped here); `gpu_start_ns`/`gpu_end_ns` are the GPU's %globaltimer ns, raw, valid only where
`flags` has F_GPU_START / F_GPU_END. Counts are elements (`count`) or bytes (`nbytes`).

Validation: a datagram that is not one (bad magic, another major version, sizes smaller than this
reader knows, truncated) raises DatagramError (a ValueError) whose `reason` names what was wrong;
fields added later (a larger header or record size) are skipped; a record of a kind this reader does
not know is counted in `Batch.unknown`, never fatal.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional

import numpy as np

from ccld.errors import CcldError

MAGIC = 0x504E4343            # b"CCNP"
VERSION = 1                   # the major version this reader knows; another one is rejected
DATAGRAM_MAX_BYTES = 61_440   # the plugin sends at most this (60 KiB)

STATE_OFF, STATE_ON, STATE_BYE = 0, 1, 2
STATES = {STATE_OFF: "off", STATE_ON: "on", STATE_BYE: "bye"}

KIND_COMM, KIND_COLL_START, KIND_COLL_KERNEL, KIND_COLL_END = 1, 2, 3, 4
KIND_P2P_START, KIND_P2P_KERNEL, KIND_P2P_END, KIND_PROGRESS = 5, 6, 7, 8
KINDS = {KIND_COMM: "comm", KIND_COLL_START: "coll_start", KIND_COLL_KERNEL: "coll_kernel",
         KIND_COLL_END: "coll_end", KIND_P2P_START: "p2p_start", KIND_P2P_KERNEL: "p2p_kernel",
         KIND_P2P_END: "p2p_end", KIND_PROGRESS: "progress"}

# task flags
F_GPU_START = 0x01     # gpu_start_ns holds a kernel timestamp (v4+)
F_GPU_END = 0x02       # gpu_end_ns does
F_END_CHILDREN = 0x04  # END: t_ns is when its last kernel channel / proxy op stopped: it completed
F_END_ENQUEUE = 0x08   # END: no child event ever came; t_ns = t_enq_ns, it was only launched
F_END_STALE = 0x10     # END: no kernel channel ever started within 3000 flush intervals; t_ns = 0
# comm flags
F_FROM_INIT = 0x01     # rank/nranks/nnodes from NCCL's init (v4+); else rank only, the others -1
# progress flags
F_SEND = 0x01

# ids -> c10d's vocabulary ("" = not known); index = the plugin's id (NCCL's enum + 1)
OP_NAMES = ("", "broadcast", "reduce", "allgather", "reduce_scatter", "allreduce", "sendrecv", "send",
            "recv", "alltoall", "scatter", "gather", "allgatherv", "put_signal", "signal", "wait_signal")
DTYPE_NAMES = ("", "int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64",
               "bfloat16", "float8_e4m3fn", "float8_e5m2")
ALGO_NAMES = ("", "TREE", "RING", "COLLNET_DIRECT", "COLLNET_CHAIN", "NVLS", "NVLS_TREE", "PAT")
PROTO_NAMES = ("", "LL", "LL128", "SIMPLE")

HEADER_DTYPE = np.dtype([
    ("magic", "<u4"), ("version", "<u2"), ("header_size", "<u2"), ("record_size", "<u2"),
    ("api_version", "u1"), ("state", "u1"), ("pid", "<i4"), ("rank", "<i4"), ("n_records", "<u4"),
    ("number", "<u8"), ("sent_ns", "<u8"), ("text_len", "<u4"), ("last_errno", "<i4"),
    ("drop_queue", "<u8"), ("drop_handles", "<u8"), ("drop_datagrams", "<u8"),
    ("drop_sent_records", "<u8"), ("drop_links", "<u8"), ("orphans", "<u8"),
])
TASK_DTYPE = np.dtype([
    ("kind", "u1"), ("flags", "u1"), ("op", "u1"), ("dtype", "u1"), ("channels", "<u2"), ("proxy_ops", "<u2"),
    ("id", "<u8"), ("comm_hash", "<u8"), ("seq", "<u8"), ("count", "<u8"), ("t_ns", "<u8"), ("t_enq_ns", "<u8"),
    ("gpu_start_ns", "<u8"), ("gpu_end_ns", "<u8"), ("peer", "<i4"), ("algo", "u1"), ("proto", "u1"),
    ("nwarps", "u1"), ("reserved", "u1"),
])
COMM_DTYPE = np.dtype([
    ("kind", "u1"), ("flags", "u1"), ("reserved2", "<u2"), ("reserved4", "<u4"), ("id", "<u8"),
    ("comm_hash", "<u8"), ("rank", "<i4"), ("nranks", "<i4"), ("nnodes", "<i4"), ("reserved", "<i4"),
    ("t_ns", "<u8"), ("pad", "V32"),
])
PROGRESS_DTYPE = np.dtype([
    ("kind", "u1"), ("flags", "u1"), ("channel", "<u2"), ("in_flight", "<u4"), ("id", "<u8"),
    ("comm_hash", "<u8"), ("peer", "<i4"), ("proxy_ops", "<u4"), ("nbytes", "<u8"), ("steps", "<u8"),
    ("net_wait_ns", "<u8"), ("gpu_wait_ns", "<u8"), ("last_ns", "<u8"), ("pad", "V8"),
])
HEADER_SIZE = HEADER_DTYPE.itemsize  # 96
RECORD_SIZE = TASK_DTYPE.itemsize    # 80

# what decode() returns per kind: the wire fields, ids also as names, the direction as a bool
TASK_OUT_DTYPE = np.dtype(TASK_DTYPE.descr + [("op_name", "U16"), ("dtype_name", "U16"),
                                              ("algo_name", "U16"), ("proto_name", "U8")])
PROGRESS_OUT_DTYPE = np.dtype([d for d in PROGRESS_DTYPE.descr if d[0] != "pad"] + [("send", "?")])
COMM_OUT_DTYPE = np.dtype([d for d in COMM_DTYPE.descr if d[0] != "pad"])
# (wire dtype, decoded dtype) per kind; every kind not here is a task
_LAYOUTS = {KIND_COMM: (COMM_DTYPE, COMM_OUT_DTYPE), KIND_PROGRESS: (PROGRESS_DTYPE, PROGRESS_OUT_DTYPE)}
DROP_FIELDS = ("drop_queue", "drop_handles", "drop_datagrams", "drop_sent_records", "drop_links", "orphans")

_OPS = np.array(OP_NAMES)
_DTYPES = np.array(DTYPE_NAMES)
_ALGOS = np.array(ALGO_NAMES)
_PROTOS = np.array(PROTO_NAMES)


class DatagramError(CcldError, ValueError):
    """Not a datagram of this format. `reason`: magic, version, size, truncated (a short tag, for counters)."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"NCCL profiler datagram: {message}")
        self.reason = reason


@dataclass(frozen=True)
class Batch:
    """One datagram: its header's fields, and its records as numpy arrays per kind (KINDS' names; every
    kind present, empty when none). Task kinds have TASK_OUT_DTYPE, "comm" COMM_OUT_DTYPE, "progress"
    PROGRESS_OUT_DTYPE."""
    version: int
    api_version: int           # the ncclProfiler_vN NCCL picked
    state: str                 # "on", "off" (text says why; the last), "bye" (the last)
    pid: int
    rank: int                  # global rank from the rank's env RANK, -1 when unset
    number: int                # datagram number in its process, from 1
    sent_ns: int
    last_errno: int            # of the plugin's last refused send, 0 if none
    drops: Dict[str, int]      # DROP_FIELDS, cumulative since the plugin loaded
    text: str
    records: Dict[str, np.ndarray] = field(default_factory=dict)
    unknown: int = 0           # records of kinds this reader does not know

    def __getitem__(self, kind: str) -> np.ndarray:
        return self.records[kind]


def _names(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    return table[np.where(ids < len(table), ids, 0)]


def _convert(rows: np.ndarray, wire: np.dtype, out_dtype: np.dtype) -> np.ndarray:
    """Rows of RECORD_SIZE bytes -> out_dtype: the wire fields it has, then names and the direction."""
    raw = rows.view(wire).reshape(-1)
    out = np.zeros(len(raw), out_dtype)
    have: Mapping[str, Any] = out_dtype.fields or {}
    for name in wire.fields or {}:
        if name in have:
            out[name] = raw[name]
    if "op_name" in have:
        out["op_name"] = _names(_OPS, raw["op"])
        out["dtype_name"] = _names(_DTYPES, raw["dtype"])
        out["algo_name"] = _names(_ALGOS, raw["algo"])
        out["proto_name"] = _names(_PROTOS, raw["proto"])
    if "send" in have:
        out["send"] = (raw["flags"] & F_SEND) != 0
    return out


def decode(datagram: bytes) -> Batch:
    """One datagram -> Batch. Raises DatagramError (a ValueError) when it is not one."""
    buf = memoryview(datagram).cast("B")
    if len(buf) < 8:
        raise DatagramError("truncated", f"{len(buf)} bytes, shorter than any header")
    magic, version = int(np.frombuffer(buf, "<u4", 1)[0]), int(np.frombuffer(buf, "<u2", 1, 4)[0])
    if magic != MAGIC:
        raise DatagramError("magic", f"magic {magic:#010x}, not {MAGIC:#010x} (not from ccld's plugin)")
    if version != VERSION:
        raise DatagramError("version", f"format version {version}; this ccld reads version {VERSION} "
                                       f"(plugin and ccld from different releases: rebuild with make setup)")
    if len(buf) < HEADER_SIZE:
        raise DatagramError("truncated", f"{len(buf)} bytes, shorter than its {HEADER_SIZE}-byte header")
    h = np.frombuffer(buf, HEADER_DTYPE, 1)[0]
    hsize, rsize, n, tlen = int(h["header_size"]), int(h["record_size"]), int(h["n_records"]), int(h["text_len"])
    if hsize < HEADER_SIZE or rsize < RECORD_SIZE:
        raise DatagramError("size", f"header {hsize} / record {rsize} bytes, smaller than this reader's "
                                    f"{HEADER_SIZE} / {RECORD_SIZE}")
    need = hsize + n * rsize + tlen
    if len(buf) < need:
        raise DatagramError("truncated", f"{len(buf)} bytes, its header says {n} records of {rsize} bytes "
                                         f"and {tlen} bytes of text: {need}")
    body = np.frombuffer(buf, np.uint8, n * rsize, hsize).reshape(n, rsize)[:, :RECORD_SIZE]
    kinds = body[:, 0]
    records: Dict[str, np.ndarray] = {}
    for kind, name in KINDS.items():
        wire, out = _LAYOUTS.get(kind, (TASK_DTYPE, TASK_OUT_DTYPE))
        records[name] = _convert(np.ascontiguousarray(body[kinds == kind]), wire, out)
    unknown = int(np.count_nonzero(~np.isin(kinds, list(KINDS))))
    text = bytes(buf[hsize + n * rsize:need]).decode("utf-8", "replace")
    state = int(h["state"])
    return Batch(version=version, api_version=int(h["api_version"]), state=STATES.get(state, f"state{state}"),
                 pid=int(h["pid"]), rank=int(h["rank"]), number=int(h["number"]), sent_ns=int(h["sent_ns"]),
                 last_errno=int(h["last_errno"]), drops={k: int(h[k]) for k in DROP_FIELDS}, text=text,
                 records=records, unknown=unknown)


def encode(header: Dict[str, int], records: Optional[np.ndarray] = None, text: str = "") -> bytes:
    """A datagram as the plugin lays it out (tests and replays): header fields not given are the
    defaults of a well-formed datagram; records: an array of any of the wire dtypes (80 bytes each)."""
    rec = b"" if records is None else np.ascontiguousarray(records).tobytes()
    raw = text.encode()
    h = np.zeros(1, HEADER_DTYPE)
    defaults = {"magic": MAGIC, "version": VERSION, "header_size": HEADER_SIZE, "record_size": RECORD_SIZE,
                "state": STATE_ON, "rank": -1, "number": 1, "n_records": len(rec) // RECORD_SIZE,
                "text_len": len(raw)}
    for k, v in {**defaults, **header}.items():
        h[k] = v
    return h.tobytes() + rec + raw
