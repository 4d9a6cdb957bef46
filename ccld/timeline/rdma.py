"""RDMA state in the collector: every rank's queue pairs, joined to the peer rank's, and NIC port counters.

QPs come from QpInfo (libibverbs' control path, ccld/bpf/rdma.py): a QP is known by (node, pid,
qp_num) and, once moved to RTR, names its remote end by QP number and GID (RoCE, or IB with a GRH)
or LID. The far end of QP A is the QP B of another process whose qp_num is A's dest_qp_num; the join
is "mutual" when B's dest_qp_num also names A. QP numbers are only unique per NIC, so in a large
job several candidates can share a number: then mutual candidates win, and after that the GID A
targets must be one that node is known to own (learned from earlier mutual, unambiguous joins: A's
dgid is a GID of B's node). Anything still ambiguous is left unjoined rather than guessed.

NicCounters are kept per (node, device, port): the latest sample and the one before, so rates can be
read without a series. Times are Unix seconds (converted by the Timeline). Bounds: MAX_QPS queue pairs
and MAX_PORTS ports, oldest-updated dropped first, and counted in the timeline's anomalies.
Caveat: what the NIC carries per QP (bytes, retries) is not visible here; see the README's RDMA section.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

from ccld import wire as ev

MAX_QPS = 1_048_576        # 16,384 ranks x 64 QPs; NCCL opens a few QPs per peer and channel
MAX_PORTS = 65_536         # 8,192 nodes x 8 NIC ports
MAX_GIDS_PER_NODE = 64     # GIDs learned per node: a node has a few ports, each a few GIDs (IPv4/IPv6, v1/v2)
MAX_GID_NODES = 65_536

QpKey = Tuple[str, int, int]       # (node, pid, qp_num)
PortKey = Tuple[str, str, int]     # (node, device, port)


@dataclass
class Qp:
    node: str
    pid: int
    rank: int
    job: str
    qp_num: int
    first_at: float
    updated_at: float
    state: str = ""
    dest_qp_num: int = -1
    dgid: str = ""
    dlid: int = -1
    port: int = -1


@dataclass
class PortCounters:
    node: str
    device: str
    port: int
    at: float
    counters: Dict[str, int]
    prev_at: Optional[float] = None
    prev: Dict[str, int] = field(default_factory=dict)

    def rates(self) -> Dict[str, float]:
        """Per-second increase of each counter between the last two samples (a counter that went down,
        e.g. after a driver reload, is left out)."""
        if self.prev_at is None or self.at <= self.prev_at:
            return {}
        dt = self.at - self.prev_at
        return {k: (v - self.prev[k]) / dt for k, v in self.counters.items()
                if k in self.prev and v >= self.prev[k]}


class RdmaTable:
    def __init__(self, anomalies: "collections.Counter"):
        self.anomalies = anomalies
        self.qps: "collections.OrderedDict[QpKey, Qp]" = collections.OrderedDict()  # least recently updated first
        self.by_qpn: Dict[int, Set[QpKey]] = {}
        self.ports: "collections.OrderedDict[PortKey, PortCounters]" = collections.OrderedDict()
        self.creates: collections.Counter = collections.Counter()   # (node, pid) -> ibv_create_qp calls
        self.node_gids: Dict[str, Set[str]] = {}

    # ---- ingest ---------------------------------------------------------------------------------

    def update(self, node: str, job: str, e: ev.Event, t: float) -> None:
        if isinstance(e, ev.NicCounters):
            self._port(node, e, t)
        elif isinstance(e, ev.QpInfo):
            self._qp(node, job, e, t)

    def _port(self, node: str, e: ev.NicCounters, t: float) -> None:
        key = (node, e.device, e.port)
        p = self.ports.pop(key, None)
        if p is None:
            p = PortCounters(node, e.device, e.port, t, dict(e.counters))
        else:
            p.prev, p.prev_at, p.counters, p.at = p.counters, p.at, dict(e.counters), t
        self.ports[key] = p
        while len(self.ports) > MAX_PORTS:
            self.ports.popitem(last=False)
            self.anomalies["rdma-ports-over-bound"] += 1

    def _qp(self, node: str, job: str, e: ev.QpInfo, t: float) -> None:
        if e.call == "ibv_create_qp" or e.qp_num < 0:
            if len(self.creates) < MAX_QPS or (node, e.pid) in self.creates:
                self.creates[(node, e.pid)] += 1  # its number comes with the first modify
            return
        key = (node, e.pid, e.qp_num)
        if e.call == "ibv_destroy_qp":
            self._drop(key)
            return
        q = self.qps.pop(key, None)
        if q is None:
            q = Qp(node, e.pid, e.rank, job, e.qp_num, first_at=t, updated_at=t)
            self.by_qpn.setdefault(e.qp_num, set()).add(key)
        # A modify names only the attributes its mask sets (RTS carries no address): keep what is known.
        q.updated_at = t
        if e.rank >= 0:
            q.rank = e.rank
        q.job = job or q.job
        q.state = e.state or q.state
        if e.state == "RESET":  # back to RESET clears the QP's remote end; it may be reconnected elsewhere
            q.dest_qp_num, q.dgid, q.dlid = -1, "", -1
        if e.dest_qp_num >= 0:
            q.dest_qp_num = e.dest_qp_num
        if e.dgid:
            q.dgid = e.dgid.lower()
        if e.dlid >= 0:
            q.dlid = e.dlid
        if e.port >= 0:
            q.port = e.port
        self.qps[key] = q
        while len(self.qps) > MAX_QPS:
            self._drop(next(iter(self.qps)))
            self.anomalies["rdma-qps-over-bound"] += 1
        if e.dest_qp_num >= 0:
            self._learn(q)

    def _drop(self, key: QpKey) -> None:
        if self.qps.pop(key, None) is None:
            return
        keys = self.by_qpn.get(key[2])
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self.by_qpn[key[2]]

    def _learn(self, q: Qp) -> None:
        """When q and its far end name each other and nothing else competes, their GIDs are facts:
        q's dgid belongs to the peer's node, and the peer's dgid to q's node."""
        peer = self.peer_of(q.node, q.pid, q.qp_num)
        if peer is None or peer.dest_qp_num != q.qp_num:
            return
        for node, gid in ((peer.node, q.dgid), (q.node, peer.dgid)):
            if not gid:
                continue
            gids = self.node_gids.get(node)
            if gids is None:
                if len(self.node_gids) >= MAX_GID_NODES:
                    continue
                gids = self.node_gids[node] = set()
            if len(gids) < MAX_GIDS_PER_NODE:
                gids.add(gid)

    # ---- questions ------------------------------------------------------------------------------

    def peer_of(self, node: str, pid: int, qp_num: int) -> Optional[Qp]:
        """The QP at the far end of (node, pid, qp_num), or None when unknown or ambiguous."""
        a = self.qps.get((node, pid, qp_num))
        if a is None or a.dest_qp_num < 0:
            return None
        cands = []
        for key in self.by_qpn.get(a.dest_qp_num, ()):
            b = self.qps[key]
            if (b.node, b.pid) == (a.node, a.pid):
                continue  # a process's QPs do not connect to each other (NCCL's loopback uses shared memory)
            if b.dest_qp_num >= 0 and b.dest_qp_num != a.qp_num:
                continue  # b is connected to some other QP
            if a.job and b.job and a.job != b.job:
                continue
            cands.append(b)
        if len(cands) > 1:
            mutual = [b for b in cands if b.dest_qp_num == a.qp_num]
            cands = mutual or cands
        if len(cands) > 1 and a.dgid:
            cands = [b for b in cands if a.dgid in self.node_gids.get(b.node, ())]
        return cands[0] if len(cands) == 1 else None

    def peer_ranks(self, job: Optional[str] = None) -> Dict[Tuple[int, int], int]:
        """(rank, peer rank) -> QPs of `rank` joined to a QP of `peer rank` (each side counts its own)."""
        out: collections.Counter = collections.Counter()
        for q in self.qps.values():
            if job is not None and q.job != job:
                continue
            b = self.peer_of(q.node, q.pid, q.qp_num)
            if b is not None and q.rank >= 0 and b.rank >= 0:
                out[(q.rank, b.rank)] += 1
        return dict(out)

    def qps_of(self, node: str, pid: int) -> List[Qp]:
        return [q for (n, p, _), q in self.qps.items() if (n, p) == (node, pid)]

    def counters(self) -> Dict[str, int]:
        return {"qps": len(self.qps), "ports": len(self.ports), "qp_creates": sum(self.creates.values())}
