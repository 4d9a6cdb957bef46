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
import functools
import socket
import struct
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


# struct conn as one unpack: a drain reads thousands of entries, and 20 ctypes attribute reads each
# cost more than the rest of the drain together.
CONN_LAYOUT = struct.Struct("<IHHHHi16s16s12Q")


@functools.lru_cache(maxsize=4096)
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
        try:
            entries = conns.items_lookup_batch()  # one syscall per batch (5.6+); ~3x cheaper than items()
        except Exception:
            entries = conns.items()
        for k, c in entries:
            sk = k.value if hasattr(k, "value") else int(k)  # the batch API gives ints, items() ctypes
            raw = ct.string_at(ct.addressof(c), CONN_LAYOUT.size)
            tgid = CONN_LAYOUT.unpack_from(raw)[0]
            traced = tgid in self.attached
            if traced:
                self.on_record(sk, raw)
            if not traced or c.state == TCP_CLOSE:
                gone.append(sk)
        for sk in gone:
            try:
                del conns[ct.c_uint64(sk)]
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

    def __call__(self, sk: int, raw: bytes) -> None:
        """One map entry, as the raw bytes of struct conn (CONN_LAYOUT)."""
        if self._last.get(sk) == raw:
            return  # nothing moved since the last shipment: the common case for an idle connection
        (tgid, family, sport, dport, _pad, state, saddr, daddr, tx_bytes, rx_bytes, tx_calls, rx_calls,
         tx_errs, rx_errs, retrans, resets, srtt_us, cwnd, last_tx_ns, last_rx_ns) = CONN_LAYOUT.unpack(raw)
        rank = self.ranks.get(tgid)
        if rank is None:
            return
        closed = state == TCP_CLOSE
        if closed:
            self._last.pop(sk, None)
        else:
            if len(self._last) >= MAX_TRACKED and sk not in self._last:
                self._last.clear()  # only costs one redundant shipment per connection
            self._last[sk] = raw
        try:
            src, dst = format_addr(family, saddr), format_addr(family, daddr)
        except (ValueError, OSError):
            return
        self.emit(ev.LinkStats(
            pid=tgid, rank=rank, ts_ns=time.monotonic_ns(), saddr=src, sport=sport, daddr=dst, dport=dport,
            tx_bytes=tx_bytes, rx_bytes=rx_bytes, tx_calls=tx_calls, rx_calls=rx_calls, tx_errs=tx_errs,
            rx_errs=rx_errs, retrans=retrans, resets=resets, srtt_us=srtt_us, cwnd=cwnd,
            state=TCP_STATES.get(state, ""), last_tx_ns=last_tx_ns, last_rx_ns=last_rx_ns, closed=closed))
