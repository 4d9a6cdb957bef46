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

import numpy as np

from ccld import wire as ev
from ccld.bpf import records
from ccld.bpf.kernel_family import KernelFamily, set_bit
from ccld.bpf.progcache import NET_BTF
from ccld.errors import EnvironmentProblem

AF_INET, AF_INET6 = 2, 10
TCP_CLOSE = 7
TCP_STATES = {1: "ESTABLISHED", 2: "SYN_SENT", 3: "SYN_RECV", 4: "FIN_WAIT1", 5: "FIN_WAIT2", 6: "TIME_WAIT",
              7: "CLOSE", 8: "CLOSE_WAIT", 9: "LAST_ACK", 10: "LISTEN", 11: "CLOSING", 12: "NEW_SYN_RECV"}
MAX_TRACKED = 8192  # = CCLD_MAX_CONNS: last-shipped values kept per connection, never more than the map
SOCK_WORDS = 1024    # = CCLD_SOCK_WORDS: the socket bitmap's words


def sock_bit(sk: int) -> int:
    """The socket's bit in sock_bits: net.bpf.c's sock_bit(), the same arithmetic."""
    return ((sk >> 6) ^ (sk >> 22)) & (SOCK_WORDS * 64 - 1)


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
    KERNEL_CFLAGS = (NET_BTF,)

    def _trace(self, pid: int, att) -> None:
        set_bit(self.bpf[b"proc_bits"], pid, True, self.NAME)  # the program's one test of a process

    def _untrace(self, pid: int) -> None:
        set_bit(self.bpf[b"proc_bits"], pid, False, self.NAME)

    def _rebuild_sock_bits(self, live: List[int]) -> None:
        """sock_bits for exactly the sockets still in `conns` (closed ones leave bits that would make
        other sockets' ACKs look themselves up); a socket added meanwhile sets its bit again at its
        next send or receive."""
        want: Dict[int, int] = {}
        for sk in live:
            b = sock_bit(sk)
            want[b >> 6] = want.get(b >> 6, 0) | (1 << (b & 63))
        bits = self.bpf[b"sock_bits"]
        for k, v in bits.items():
            w = k.value
            if v.value != want.get(w, 0):
                bits[ct.c_int(w)] = ct.c_uint64(want.get(w, 0))

    def __init__(self, on_record: Callable[[int, object], None], cflags=()):
        super().__init__(on_record, cflags)
        self._sock_cflags: Optional[List[str]] = None
        self._reader = None                          # mapread.BatchReader of `conns`
        self._last_sk = np.zeros(0, np.uint64)       # the last drain's live connections (sorted) ...
        self._last_rows = np.zeros((0, CONN_LAYOUT.size), np.uint8)  # ... and their struct conn bytes

    def all_cflags(self) -> List[str]:
        if self._sock_cflags is None:
            self._sock_cflags = sock_cflags()
        return super().all_cflags() + self._sock_cflags

    def drain(self) -> None:
        """Read `conns` in a few syscalls (mapread), hand the translator the connections whose
        counters moved since the last drain (compared as arrays: an idle connection costs no Python
        step), and delete those that closed or whose process is no longer traced."""
        from ccld.bpf.mapread import BatchReader
        conns = self.bpf[b"conns"]
        if self._reader is None:
            self._reader = BatchReader(conns)
        keys, vals = self._reader.read()
        sk = keys.view(np.uint64).reshape(-1)
        tgid = vals[:, 0:4].copy().view(np.uint32).reshape(-1).astype(np.int64)
        state = vals[:, 12:16].copy().view(np.int32).reshape(-1)
        traced = records.member(tgid, np.fromiter(self.attached, np.int64, len(self.attached)))
        gone = ~traced | (state == TCP_CLOSE)
        moved = np.ones(len(sk), bool)
        if len(self._last_sk) and len(sk):
            at = np.minimum(np.searchsorted(self._last_sk, sk), len(self._last_sk) - 1)
            moved = (self._last_sk[at] != sk) | np.any(self._last_rows[at] != vals, axis=1)
        for i in np.flatnonzero(traced & (moved | gone)).tolist():
            self.on_record(int(sk[i]), vals[i].tobytes())
        keep = ~gone
        order = np.argsort(sk[keep], kind="stable")
        self._last_sk, self._last_rows = sk[keep][order], vals[keep][order]
        if gone.any():
            for s_ in sk[gone].tolist():
                try:
                    del conns[ct.c_uint64(s_)]
                except KeyError:
                    pass
            self._rebuild_sock_bits(sk[keep].tolist())


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
