"""Loader of rdma.bpf.c: the queue-pair control path of libibverbs, and the translator to QpInfo events.

Every ibv_create_qp / ibv_modify_qp / ibv_destroy_qp a traced rank makes becomes one QpInfo: the QP's
number, the state it is moved to, and, on the move to RTR, the remote QP number, GID and LID that tie
it to a peer rank (the collector joins the two ends: ccld/timeline/rdma.py). Times stay CLOCK_MONOTONIC
ns. Only the default-version symbols are probed (see elfver.py): libibverbs' IBVERBS_1.0 compat entries
take a different struct layout and call the default ones, whose probes see the call anyway.

Caveats: this is the control path only. The data path (RDMA writes posted to the NIC from user space)
is invisible to the kernel, so there are no per-QP byte counts; the NIC's per-port counters
(ccld/tracer/ibcounters.py) are the only volume and error figures. Probes fire at entry, so a QpInfo
says what the process asked for, not that the NIC accepted it. A QP created before we attached shows
up at its next modify or destroy only. QpInfo.device names the NIC (e.g. mlx5_0) carrying the QP.
"""
from __future__ import annotations

import ctypes as ct
import logging
from typing import Callable, Dict, List, Tuple

from ccld import wire as ev
from ccld.bpf import elfver, records
from ccld.bpf.loader import Family, Probe, lib_key
from ccld.bpf.records import Header

log = logging.getLogger("ccld.bpf")

DEV_NAME_LEN = 32
QP_CREATE, QP_MODIFY, QP_DESTROY = 1, 2, 3

# enum ibv_qp_state (verbs.h)
QP_STATES = {0: "RESET", 1: "INIT", 2: "RTR", 3: "RTS", 4: "SQD", 5: "SQE", 6: "ERR", 7: "UNKNOWN"}
# enum ibv_qp_attr_mask bits the probe reads (verbs.h)
IBV_QP_STATE, IBV_QP_PORT, IBV_QP_AV, IBV_QP_DEST_QPN = 1 << 0, 1 << 5, 1 << 7, 1 << 20


class QpCreate(ct.Structure):
    _fields_ = [("hdr", Header), ("pd", ct.c_uint64), ("qp_type", ct.c_int32), ("pad", ct.c_uint32),
                ("dev", ct.c_char * DEV_NAME_LEN)]


class QpModify(ct.Structure):
    _fields_ = [("hdr", Header), ("qp", ct.c_uint64), ("qp_num", ct.c_uint32), ("attr_mask", ct.c_uint32),
                ("state", ct.c_int32), ("dest_qp_num", ct.c_int32), ("dlid", ct.c_int32), ("port", ct.c_int32),
                ("ah_port", ct.c_int32), ("is_global", ct.c_uint8), ("pad", ct.c_uint8 * 3),
                ("dgid", ct.c_uint8 * 16), ("dev", ct.c_char * DEV_NAME_LEN)]


class QpDestroy(ct.Structure):
    _fields_ = [("hdr", Header), ("qp", ct.c_uint64), ("qp_num", ct.c_uint32), ("pad", ct.c_uint32),
                ("dev", ct.c_char * DEV_NAME_LEN)]


REC_SIZE = 112  # CCLD_REC_SIZE in rdma.bpf.c (rdma_qp_modify, the largest)


class RdmaFamily(Family):
    NAME = "rdma"
    SOURCE = "rdma.bpf.c"
    # The real file behind libibverbs.so.1 (e.g. libibverbs.so.1.14.44.0), as /proc/PID/maps shows it.
    LIB_PATTERN = r"/libibverbs\.so\.1(\.[0-9.]+)?$"
    KINDS = records.Kinds({QP_CREATE: QpCreate, QP_MODIFY: QpModify, QP_DESTROY: QpDestroy}, REC_SIZE)
    PROBES = (
        # In every libibverbs since 1.1 (2006), hence required.
        Probe("ibv_create_qp", "create_qp", True, exact=True),
        Probe("ibv_modify_qp", "modify_qp", True, exact=True),
        Probe("ibv_destroy_qp", "destroy_qp", True, exact=True),
    )

    def _plan(self, lib: str) -> Tuple[List[Tuple[str, int, Probe]], List[str]]:
        """The loader's plan, less the non-default symbol versions. When the versions cannot be read
        and a name has more than one address, that name is not probed at all (so reported missing):
        a probe on the compat entry would double-count and misread every call."""
        if lib_key(lib) in self._plans:
            return self._plans[lib_key(lib)]
        points, missing = super()._plan(lib)
        try:
            default = elfver.default_symbol_addresses(lib, {p.prefix for p in self.PROBES})
        except (OSError, ValueError) as e:
            log.warning("rdma: cannot read symbol versions of %s (%s); probing only unambiguous symbols", lib, e)
            default = None
        addrs: Dict[str, int] = {}
        for sym, _, _ in points:
            addrs[sym] = addrs.get(sym, 0) + 1
        kept = []
        for sym, addr, probe in points:
            if default is not None and addr in default.get(sym, ()):
                kept.append((sym, addr, probe))
            elif default is None and addrs[sym] == 1:
                kept.append((sym, addr, probe))
        got = {sym for sym, _, _ in kept}
        missing = sorted(set(missing) | {p.prefix for p in self.PROBES if p.prefix not in got})
        self._plans[lib_key(lib)] = (kept, missing)
        return self._plans[lib_key(lib)]


def gid_hex(raw) -> str:
    """A 16-byte GID as 32 lowercase hex digits, in wire (network) order."""
    return bytes(raw).hex()


def _dev(rec) -> str:
    return rec.dev.decode("utf-8", "replace")


class RdmaTranslator:
    """Records of one RdmaFamily -> QpInfo events, per process. `emit` receives each event."""

    def __init__(self, emit: Callable[[ev.Event], None]):
        self.emit = emit
        self.ranks: Dict[int, int] = {}  # pid -> global rank
        self.unmatched = 0               # records of processes we were not told about (being forgotten)

    def add_process(self, pid: int, rank: int, job: str) -> None:
        self.ranks.setdefault(pid, rank)

    def forget(self, pid: int) -> None:
        self.ranks.pop(pid, None)

    def records(self, rows, kinds) -> None:
        """One drain: queue-pair calls come at connection set-up only, so each is read as a record."""
        for row in rows:
            rec = RdmaFamily.KINDS.record(row)
            self(rec.hdr.kind, rec)

    def __call__(self, kind: int, rec) -> None:
        pid = rec.hdr.tgid
        rank = self.ranks.get(pid)
        if rank is None:
            self.unmatched += 1
            return
        ts = rec.hdr.ts_ns
        if kind == QP_CREATE:
            # The QP's number is the create call's result, which an entry probe cannot see.
            self.emit(ev.QpInfo(pid=pid, rank=rank, ts_ns=ts, qp_num=-1, call="ibv_create_qp", device=_dev(rec)))
        elif kind == QP_MODIFY:
            port = rec.port if rec.port >= 0 else rec.ah_port
            self.emit(ev.QpInfo(pid=pid, rank=rank, ts_ns=ts, qp_num=rec.qp_num,
                                state=QP_STATES.get(rec.state, f"state{rec.state}") if rec.state >= 0 else "",
                                dest_qp_num=rec.dest_qp_num, dgid=gid_hex(rec.dgid) if rec.is_global else "",
                                dlid=rec.dlid, port=port, call="ibv_modify_qp", device=_dev(rec)))
        elif kind == QP_DESTROY:
            self.emit(ev.QpInfo(pid=pid, rank=rank, ts_ns=ts, qp_num=rec.qp_num, call="ibv_destroy_qp",
                                device=_dev(rec)))
