"""What every probe family's loader shares: compile one *.bpf.c with -D cflags, read its ring buffer,
attach uprobes to one process as a unit, and count what goes wrong instead of raising.

A family subclass names its source file, its record kinds, and its uprobe plan: a list of
(symbol prefix, BPF function, required?) resolved against the library each process has mapped.
Clock: records carry CLOCK_MONOTONIC ns from the kernel; nothing here re-stamps them.
"""
from __future__ import annotations

import ctypes as ct
import logging
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ccld.bpf import records
from ccld.errors import EnvironmentProblem

log = logging.getLogger("ccld.bpf")
BPF_DIR = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class Probe:
    prefix: str   # mangled-name prefix; every defined function symbol starting with it is probed
    fn: str       # BPF function name in the family's .bpf.c
    required: bool = False


@dataclass
class Attachment:
    pid: int
    lib: str
    points: List[Tuple[str, int]] = field(default_factory=list)  # (symbol, address)
    missing: List[str] = field(default_factory=list)             # optional prefixes not found


def bpf_available() -> Optional[EnvironmentProblem]:
    """None when this process can load BPF programs with bcc, else the problem and its fix."""
    try:
        import bcc  # noqa: F401
    except ImportError:
        return EnvironmentProblem("bcc is not importable",
                                  "install it: apt-get install python3-bpfcc (then re-run scripts/setup.sh)")
    if os.geteuid() != 0:
        return EnvironmentProblem("eBPF needs root (or CAP_BPF+CAP_PERFMON)",
                                  "run ccld with sudo, or: setcap cap_bpf,cap_perfmon,cap_sys_ptrace+ep $(which python3)")
    return None


class Family:
    """One probe family: one .bpf.c, one loaded program, attached per process."""

    NAME = ""
    SOURCE = ""
    LIB_PATTERN = ""   # regex matched against paths in /proc/PID/maps
    KINDS: Dict[int, type] = {}
    PROBES: Sequence[Probe] = ()

    def __init__(self, on_record: Callable[[int, object], None], cflags: Sequence[str] = ()):
        self.on_record = on_record
        self.cflags = list(cflags)
        self.bpf = None
        self.bad_records: Dict[str, int] = {}
        self.attached: Dict[int, Attachment] = {}
        self._plans: Dict[str, Tuple[List[Tuple[str, int, Probe]], List[str]]] = {}
        self._lock = threading.Lock()

    # -- program -----------------------------------------------------------------------------
    def source_path(self) -> str:
        return os.path.join(BPF_DIR, self.SOURCE)

    def all_cflags(self) -> List[str]:
        return [f"-I{BPF_DIR}"] + self.cflags

    def program_text(self) -> str:
        """The final program and cflags, as `--ebpf` prints them. Needs no root."""
        with open(self.source_path()) as f:
            text = f.read()
        return f"// cflags: {' '.join(self.all_cflags())}\n{text}"

    def load(self) -> None:
        from bcc import BPF
        from ccld.bpf.kheaders import ensure_kernel_headers
        ensure_kernel_headers()
        try:
            self.bpf = BPF(src_file=self.source_path().encode(), cflags=self.all_cflags())
        except Exception as e:
            raise EnvironmentProblem(f"could not compile/load {self.SOURCE}: {e}",
                                     "check kernel headers (apt-get install linux-headers-amd64) and that you are root")
        self.bpf["events"].open_ring_buffer(self._on_raw)

    def _on_raw(self, _ctx, data, size) -> int:
        raw = ct.string_at(data, size)
        kind, rec = records.decode(raw, self.KINDS)
        if kind is None:
            self.bad_records[rec] = self.bad_records.get(rec, 0) + 1
            return 0
        try:
            self.on_record(kind, rec)
        except Exception:  # a bug in one handler must not stop the drain
            log.exception("%s: handler failed on record kind %d", self.NAME, kind)
            self.bad_records["handler-error"] = self.bad_records.get("handler-error", 0) + 1
        return 0

    def poll(self, timeout_ms: int) -> None:
        self.bpf.ring_buffer_poll(timeout_ms)

    def lost(self) -> int:
        """Records the kernel side could not reserve (ring buffer full), summed over CPUs."""
        return int(sum(self.bpf["lost"][ct.c_int(0)]))

    # -- attaching ---------------------------------------------------------------------------
    def find_lib(self, pid: int) -> Optional[str]:
        """Path of this family's library in /proc/PID/maps, or None when not mapped (yet)."""
        pat = re.compile(self.LIB_PATTERN)
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    parts = line.split(None, 5)
                    if len(parts) == 6 and pat.search(parts[5]):
                        return parts[5].strip()
        except OSError:
            return None
        return None

    def _plan(self, lib: str) -> Tuple[List[Tuple[str, int, Probe]], List[str]]:
        """Resolve every probe's symbols in `lib` once (the ELF scan is the slow part)."""
        if lib in self._plans:
            return self._plans[lib]
        from bcc import BPF
        points, missing, seen = [], [], set()
        for p in self.PROBES:
            found = BPF.get_user_functions_and_addresses(lib.encode(), "^" + re.escape(p.prefix) + ".*")
            got = False
            for sym, addr in found:
                if addr in seen:  # C1/C2 constructor aliases share one address: probe it once
                    got = True
                    continue
                seen.add(addr)
                points.append((sym.decode() if isinstance(sym, bytes) else sym, addr, p))
                got = True
            if not got:
                missing.append(p.prefix)
        self._plans[lib] = (points, missing)
        return self._plans[lib]

    def attach(self, pid: int, lib: str) -> Attachment:
        """Attach every probe of the plan to `pid`, as a unit: if a required one fails, none stay."""
        points, missing = self._plan(lib)
        need = {p.prefix for p in self.PROBES if p.required}
        lacking = need & set(missing)
        if lacking:
            raise EnvironmentProblem(f"{self.NAME}: {os.path.basename(lib)} lacks {sorted(lacking)}",
                                     "this library version is not supported yet")
        att = Attachment(pid, lib, missing=[m for m in missing])
        with self._lock:
            try:
                for sym, addr, probe in points:
                    self.bpf.attach_uprobe(name=lib.encode(), addr=addr, fn_name=probe.fn.encode(), pid=pid)
                    att.points.append((sym, addr))
            except Exception as e:
                self._detach_points(lib, att.points, pid)
                raise EnvironmentProblem(f"{self.NAME}: attaching to pid {pid} failed after "
                                         f"{len(att.points)} probes: {e}", "is the process still alive?")
            self.attached[pid] = att
        return att

    def _detach_points(self, lib: str, points, pid: int) -> None:
        for sym, addr in points:
            try:
                self.bpf.detach_uprobe(name=lib.encode(), addr=addr, pid=pid)
            except Exception:
                pass  # the process may be gone, taking its probe with it

    def detach(self, pid: int) -> None:
        with self._lock:
            att = self.attached.pop(pid, None)
            if att:
                self._detach_points(att.lib, att.points, pid)

    def close(self) -> None:
        for pid in list(self.attached):
            self.detach(pid)
        if self.bpf is not None:
            self.bpf.cleanup()
            self.bpf = None
