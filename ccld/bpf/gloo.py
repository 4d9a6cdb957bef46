"""Loader of gloo.bpf.c: PyTorch's gloo backend (c10d::ProcessGroupGloo in libtorch_cpu.so).

GlooFamily's probes: a process group built and named (setGroupName), c10d's works built, run,
finished and failed, send/recv and their works, the buffers gloo's algorithm entries take (sizes), and
gloo's TCP pairs (broken connections); nextTag is only resolved, to read where c10d's collective
counter lives (tag_offset). The records they write are gloo_records.py; gloo_translator.py turns them
into wire events, a drain at a time, with gloo_comms.py naming the communicators. Times stay
CLOCK_MONOTONIC ns.

Numbering: a collective's `seq` is c10d's collective tag + 1, read in the kernel (the first
collective of a group is 1, as c10d's own seq is when no p2p came before), identical on every member
whatever p2p ops some of them did; c10d's seq (which counts both) goes along as `lib_seq`. Where the
tag cannot be read (tag_offset found no accessor it knows), the kernel numbers collectives per
(process, group) from the first one seen. A p2p op's `seq` is this rank's n-th op of that direction
with that peer on that group, counted in gloo_comms.py. CommInit.seq_source says which numbering
holds and whether it began at the group's creation (exact) or at our attach (ranks may be offset:
the collector must align them).
"""
from __future__ import annotations

import ctypes as ct
from typing import Optional

from ccld.bpf import elfcode
from ccld.bpf.gloo_records import KINDS
from ccld.bpf.loader import Attachment, Family, Probe

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
