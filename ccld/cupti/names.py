"""NCCL kernel names -> (op, reduction, dtype, algorithm, protocol), and the cheap "is it NCCL?" test.

CUPTI reports a kernel's name as the compiler emitted it: usually mangled
(`_Z38ncclDevKernel_AllReduce_Sum_f32_RING_LL24ncclDevKernelArgsStorageILm4096EE`), sometimes plain
(`ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)`). Two naming schemes:

  NCCL >= 2.19   ncclDevKernel_<Coll>[_<RedOp>_<type>]_<ALGO>_<PROTO>   types i8 u8 i32 … f32 bf16 f8e4m3
                 ncclDevKernel_SendRecv, ncclDevKernel_Generic[_N] (one kernel for any collective)
  NCCL <  2.19   ncclKernel_<Coll>_<ALGO>_<PROTO>_<RedOp>_<type>        types int8_t … float __nv_bfloat16

Names that do not parse keep what could be read ("" for the rest): a Generic kernel says it is NCCL
but not which collective, so the collector joins it by launch correlation alone. Vocabulary is
c10d's (allreduce, reduce_scatter, float32) so it reads like the host-side CollEnter events.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

NCCL_PREFIX_SPAN = 32  # "nccl" must appear this early: after "_Z<len>" of a mangled name, or at 0

OPS = {"AllReduce": "allreduce", "AllGather": "allgather", "ReduceScatter": "reduce_scatter",
       "Broadcast": "broadcast", "Reduce": "reduce", "SendRecv": "sendrecv", "AllToAll": "alltoall",
       "Gather": "gather", "Scatter": "scatter", "Generic": ""}
REDOPS = {"Sum": "sum", "Prod": "prod", "MinMax": "minmax", "Min": "min", "Max": "max",
          "PreMulSum": "premulsum", "SumPostDiv": "sumpostdiv"}
DTYPES = {"i8": "int8", "u8": "uint8", "i32": "int32", "u32": "uint32", "i64": "int64", "u64": "uint64",
          "f16": "float16", "f32": "float32", "f64": "float64", "bf16": "bfloat16",
          "f8e4m3": "float8_e4m3fn", "f8e5m2": "float8_e5m2",
          "int8_t": "int8", "uint8_t": "uint8", "int32_t": "int32", "uint32_t": "uint32", "int64_t": "int64",
          "uint64_t": "uint64", "half": "float16", "float": "float32", "double": "float64",
          "__nv_bfloat16": "bfloat16", "__nv_fp8_e4m3": "float8_e4m3fn", "__nv_fp8_e5m2": "float8_e5m2"}
ALGOS = ("COLLNET_DIRECT", "COLLNET_CHAIN", "NVLS_TREE", "NVLS", "TREE", "RING", "PAT")  # longest first
PROTOS = ("LL128", "LL", "SIMPLE")

_ALGO_RX = re.compile(r"(?:^|_)(" + "|".join(ALGOS) + r")(?=_|$)")
_PROTO_RX = re.compile(r"(?:^|_)(" + "|".join(PROTOS) + r")(?=_|$)")
_DTYPE_RX = re.compile(r"(?:^|_)(" + "|".join(sorted(map(re.escape, DTYPES), key=len, reverse=True)) + r")(?=_|$)")
_MANGLED = re.compile(r"_Z(\d{1,4})")


@dataclass(frozen=True)
class KernelName:
    nccl: bool
    op: str = ""      # c10d name ("allreduce"); "" when the kernel does not say (Generic, not NCCL)
    redop: str = ""
    dtype: str = ""
    algo: str = ""    # RING, TREE, NVLS, ...
    proto: str = ""   # LL, LL128, SIMPLE


NOT_NCCL = KernelName(False)


def is_nccl(name: str) -> bool:
    """The filter run for every kernel record in the CUPTI callback: cheap, no regex."""
    return "nccl" in name[:NCCL_PREFIX_SPAN]


def _identifier(name: str) -> str:
    """The function's own identifier: the length-prefixed one of a mangled name, else up to '('."""
    m = _MANGLED.match(name)
    if m:
        start = m.end()
        return name[start:start + int(m.group(1))]
    return name.split("(", 1)[0].strip()


@functools.lru_cache(maxsize=1024)  # a job has tens of distinct NCCL kernels; names repeat millions of times
def parse(name: str) -> KernelName:
    """What an NCCL kernel's name says about the collective it runs; NOT_NCCL for other kernels."""
    if not isinstance(name, str) or not is_nccl(name):
        return NOT_NCCL
    ident = _identifier(name)
    for prefix in ("ncclDevKernel_", "ncclKernel_"):
        if ident.startswith(prefix):
            rest = ident[len(prefix):]
            break
    else:
        return KernelName(True)  # NCCL's, but not a collective kernel we know (e.g. a helper)
    coll, _, tail = rest.partition("_")
    op = OPS.get(coll, coll.lower())
    algo = _ALGO_RX.search(tail)
    proto = _PROTO_RX.search(tail)
    dtype = _DTYPE_RX.search(tail)
    redop = ""
    for tok in tail.split("_"):
        if tok in REDOPS:
            redop = REDOPS[tok]
            break
    return KernelName(True, op=op, redop=redop, dtype=DTYPES[dtype.group(1)] if dtype else "",
                      algo=algo.group(1) if algo else "", proto=proto.group(1) if proto else "")
