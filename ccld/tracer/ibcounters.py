"""Per-port InfiniBand/RoCE NIC counters from sysfs, as NicCounters events.

Reads /sys/class/infiniband/<device>/ports/<port>/counters/* (the IB PortCounters every RDMA driver
exposes: port_xmit_wait, port_rcv_errors, symbol_error, link_downed, ...) and, where the driver has
them, ports/<port>/hw_counters/* (e.g. mlx5's out_of_sequence, packet_seq_err, local_ack_timeout_err,
np_cnp_sent, rp_cnp_handled), shipped as "hw.<name>". Values are cumulative and as the NIC reports
them: port_xmit_data / port_rcv_data count 4-byte words, port_xmit_wait counts ticks in which the
port had data but no credit to send (the congestion signal). `ts_ns` is this node's CLOCK_MONOTONIC.

Robust by design: a device or port vanishing mid-scan, a file that cannot be read, or one that holds
no counter (text, "N/A (no PMA)", a negative or over-64-bit number) is skipped and counted by reason;
the first failure of each path is kept as a message naming the file. Nothing here raises on sysfs content.
Caveat: these are per-port totals for everything on the NIC, not per QP or per rank.
"""
from __future__ import annotations

import os
import stat
import time
from typing import Callable, Dict, List

from ccld import wire as ev

SYSFS_ROOT = "/sys/class/infiniband"
HW_PREFIX = "hw."
# hw_counters/lifespan is how long (ms) the driver caches the other hw counters: a setting, not a counter.
NOT_COUNTERS = frozenset({"lifespan"})
MAX_VALUE_BYTES = 64        # a sysfs counter is one decimal number and a newline; more is not a counter
MAX_MESSAGES_KEPT = 256     # distinct failing paths remembered (each message once); counts go on regardless
U64_MAX = (1 << 64) - 1     # MessagePack's integer limit, and the widest counter a NIC reports


class CounterReader:
    """Reads every port's counters under `root`. Not thread-safe; one caller (the agent loop)."""

    def __init__(self, root: str = SYSFS_ROOT, clock: Callable[[], int] = time.monotonic_ns):
        self.root = root
        self.clock = clock
        self.errors: Dict[str, int] = {}     # reason -> files (or directories) skipped, cumulative
        self.messages: Dict[str, str] = {}   # path -> first message about it
        self._unsent: List[str] = []

    def present(self) -> bool:
        return os.path.isdir(self.root)

    def sample(self) -> List[ev.NicCounters]:
        """One NicCounters per (device, port) that has at least one readable counter, sorted."""
        out = []
        for dev in self._listdir(self.root):
            ports_dir = os.path.join(self.root, dev, "ports")
            if not os.path.isdir(ports_dir):
                continue  # not an RDMA device directory (or it went away): nothing to read
            for name in self._listdir(ports_dir):
                if not name.isdigit():
                    self._bad("bad-port", os.path.join(ports_dir, name), "port directory name is not a number")
                    continue
                port_dir = os.path.join(ports_dir, name)
                counters = self._read_dir(os.path.join(port_dir, "counters"), "")
                counters.update(self._read_dir(os.path.join(port_dir, "hw_counters"), HW_PREFIX))
                if counters:
                    out.append(ev.NicCounters(ts_ns=self.clock(), device=dev, port=int(name), counters=counters))
        return out

    def take_messages(self) -> List[str]:
        """Messages about paths that failed for the first time since the last call."""
        got, self._unsent = self._unsent, []
        return got

    def error_count(self) -> int:
        return sum(self.errors.values())

    # -- reading ----------------------------------------------------------------------------------
    def _listdir(self, path: str) -> List[str]:
        try:
            return sorted(os.listdir(path))
        except FileNotFoundError:
            return []  # absent is normal: no RDMA NICs, or no hw_counters on this driver
        except OSError as e:
            self._bad("unreadable", path, f"cannot list: {e.strerror or e}")
            return []

    def _read_dir(self, path: str, prefix: str) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for name in self._listdir(path):
            if name in NOT_COUNTERS:
                continue
            value = self._read_counter(os.path.join(path, name))
            if value is not None:
                out[prefix + name] = value
        return out

    def _read_counter(self, path: str):
        try:
            st = os.stat(path)
            if not stat.S_ISREG(st.st_mode):  # never open a FIFO or device: it could block the agent
                self._bad("not-a-file", path, "not a regular file")
                return None
            with open(path, "rb") as f:
                raw = f.read(MAX_VALUE_BYTES + 1)
        except OSError as e:  # vanished (device removed), EINVAL/EIO from the driver, EACCES as non-root
            self._bad("unreadable", path, f"cannot read: {e.strerror or e}")
            return None
        text = raw.strip()
        if text.startswith(b"N/A"):  # drivers without a PMA for this port say "N/A (no PMA)"
            self._bad("not-available", path, f"no value ({text[:40].decode(errors='replace')!r})")
            return None
        if len(raw) > MAX_VALUE_BYTES or not text.isdigit():
            self._bad("garbage", path, f"not a counter: {text[:40].decode(errors='replace')!r}")
            return None
        value = int(text)
        if value > U64_MAX:
            self._bad("garbage", path, f"counter {value} is wider than 64 bits")
            return None
        return value

    def _bad(self, reason: str, path: str, message: str) -> None:
        self.errors[reason] = self.errors.get(reason, 0) + 1
        if path not in self.messages and len(self.messages) < MAX_MESSAGES_KEPT:
            self.messages[path] = f"{path}: {message}"
            self._unsent.append(self.messages[path])
