"""Loader of net.bpf.c: per-connection TCP counters of the traced ranks, shipped as LinkStats.

Every DRAIN_MS the agent reads the program's `conns` map (struct sock * -> cumulative counters and
the 4-tuple) and ships each connection whose counters changed, with the values as they stand
(cumulative, so a lost frame costs resolution, not bytes). Connections that reached TCP CLOSE are
shipped one last time with closed=True and removed from the map; so are those of processes no
longer traced. Times: CLOCK_MONOTONIC ns of this node (`last_tx_ns`, `last_rx_ns`, `ts_ns`).
struct sock offsets come from the running kernel's BTF (ccld/bpf/btf.py), passed as -D cflags.
"""
from __future__ import annotations

import ctypes as ct
import socket
import time
from typing import Callable, Dict, List, Optional, Tuple

from ccld import events as ev
from ccld.bpf.loader import KernelFamily
from ccld.errors import EnvironmentProblem

AF_INET, AF_INET6 = 2, 10
TCP_CLOSE = 7
TCP_STATES = {1: "ESTABLISHED", 2: "SYN_SENT", 3: "SYN_RECV", 4: "FIN_WAIT1", 5: "FIN_WAIT2", 6: "TIME_WAIT",
              7: "CLOSE", 8: "CLOSE_WAIT", 9: "LAST_ACK", 10: "LISTEN", 11: "CLOSING", 12: "NEW_SYN_RECV"}
MAX_TRACKED = 65536  # = CCLD_MAX_CONNS: last-shipped values kept per connection, never more than the map


class Conn(ct.Structure):
    """Mirror of struct conn in net.bpf.c (size asserted on both sides)."""
    _fields_ = [("tgid", ct.c_uint32), ("family", ct.c_uint16), ("sport", ct.c_uint16),
                ("dport", ct.c_uint16), ("pad", ct.c_uint16), ("state", ct.c_int32),
                ("saddr", ct.c_uint8 * 16), ("daddr", ct.c_uint8 * 16),
                ("tx_bytes", ct.c_uint64), ("rx_bytes", ct.c_uint64), ("tx_calls", ct.c_uint64),
                ("rx_calls", ct.c_uint64), ("tx_errs", ct.c_uint64), ("rx_errs", ct.c_uint64),
                ("retrans", ct.c_uint64), ("resets", ct.c_uint64), ("srtt_us", ct.c_uint64),
                ("cwnd", ct.c_uint64), ("last_tx_ns", ct.c_uint64), ("last_rx_ns", ct.c_uint64)]


def format_addr(family: int, raw: bytes) -> str:
    """Text form of an address from the socket; IPv4-mapped IPv6 becomes plain IPv4 so that both
    ends of one connection spell it the same way."""
    if family == AF_INET6:
        b = bytes(raw[:16])
        if b[:12] == b"\0" * 10 + b"\xff\xff":
            return socket.inet_ntop(socket.AF_INET, b[12:])
        return socket.inet_ntop(socket.AF_INET6, b)
    return socket.inet_ntop(socket.AF_INET, bytes(raw[:4]))


def sock_cflags() -> List[str]:
    """-D cflags with struct sock member offsets of the running kernel."""
    from ccld.bpf.btf import Btf, BtfError, sock_offsets
    try:
        offs = sock_offsets(Btf.from_file())
    except BtfError as e:
        raise EnvironmentProblem(f"net: cannot find struct sock offsets: {e}",
                                 "the kernel needs BTF (CONFIG_DEBUG_INFO_BTF=y, /sys/kernel/btf/vmlinux)")
    return [f"-D{k}={v}" for k, v in sorted(offs.items())]


class NetFamily(KernelFamily):
    NAME = "net"
    SOURCE = "net.bpf.c"

    def __init__(self, on_record: Callable[[int, object], None], cflags=()):
        super().__init__(on_record, cflags)
        self._sock_cflags: Optional[List[str]] = None

    def all_cflags(self) -> List[str]:
        if self._sock_cflags is None:
            self._sock_cflags = sock_cflags()
        return super().all_cflags() + self._sock_cflags

    def drain(self) -> None:
        conns = self.bpf[b"conns"]
        gone = []
        for k, c in conns.items():
            traced = c.tgid in self.attached
            if traced:
                self.on_record(k.value, c)
            if not traced or c.state == TCP_CLOSE:
                gone.append(k)
        for k in gone:
            try:
                del conns[k]
            except KeyError:
                pass


class NetTranslator:
    """Conn map entries -> LinkStats, only when something changed since the last one shipped."""

    def __init__(self, emit: Callable[[ev.Event], None]):
        self.emit = emit
        self.ranks: Dict[int, int] = {}
        self._last: Dict[int, Tuple] = {}  # sock pointer -> counters last shipped

    def add_process(self, pid: int, rank: int, job: str) -> None:
        self.ranks[pid] = rank

    def forget(self, pid: int) -> None:
        self.ranks.pop(pid, None)

    def __call__(self, sk: int, c: Conn) -> None:
        rank = self.ranks.get(c.tgid)
        if rank is None:
            return
        closed = c.state == TCP_CLOSE
        values = (c.tx_bytes, c.rx_bytes, c.tx_calls, c.rx_calls, c.tx_errs, c.rx_errs, c.retrans, c.resets,
                  c.srtt_us, c.cwnd, c.state, c.tgid, c.sport, c.dport)
        if not closed and self._last.get(sk) == values:
            return
        if closed:
            self._last.pop(sk, None)
        else:
            if len(self._last) >= MAX_TRACKED and sk not in self._last:
                self._last.clear()  # only costs one redundant shipment per connection
            self._last[sk] = values
        try:
            saddr, daddr = format_addr(c.family, bytes(c.saddr)), format_addr(c.family, bytes(c.daddr))
        except (ValueError, OSError):
            return
        self.emit(ev.LinkStats(
            pid=c.tgid, rank=rank, ts_ns=time.monotonic_ns(), saddr=saddr, sport=c.sport, daddr=daddr,
            dport=c.dport, tx_bytes=c.tx_bytes, rx_bytes=c.rx_bytes, tx_calls=c.tx_calls, rx_calls=c.rx_calls,
            tx_errs=c.tx_errs, rx_errs=c.rx_errs, retrans=c.retrans, resets=c.resets, srtt_us=c.srtt_us,
            cwnd=c.cwnd, state=TCP_STATES.get(c.state, ""), last_tx_ns=c.last_tx_ns, last_rx_ns=c.last_rx_ns,
            closed=closed))
