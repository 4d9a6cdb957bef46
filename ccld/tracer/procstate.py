"""What a rank's process is doing, from /proc: its state letter, kernel wait channel and CPU time.

This is the agent's source of last resort: it needs no eBPF and still tells a stopped (T), dead or
busy (R) rank from one blocked in a collective (S). CPU time is utime+stime in ns.
Caveat: /proc/PID/stat is parsed as bytes. Its comm (field 2) is whatever the process set (up to 15
bytes: ')', spaces, newlines, invalid UTF-8, a multi-byte character cut in half), so comm is what
lies between the first '(' and the LAST ')'; the fields after it are numbers and letters only.
"""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Optional, Tuple

from ccld.errors import CcldError

log = logging.getLogger("ccld.procstate")

_TICK_NS = 1_000_000_000 // os.sysconf("SC_CLK_TCK")
SMALL_READ = 4096  # bytes a read of a small /proc file asks for (stat is a few hundred; wchan a name)

STATE_NAMES = {"R": "running", "S": "sleeping", "D": "disk wait", "T": "stopped", "t": "traced/stopped",
               "Z": "zombie", "X": "dead", "I": "idle"}

_INT = re.compile(rb"-?[0-9]{1,20}")


class ProcParseError(CcldError):
    """A /proc file whose content cannot be read as documented in proc(5); names the file and the field."""


@dataclass(frozen=True)
class Stat:
    """The fields of /proc/PID/stat that ccld uses (numbered as in proc(5))."""
    comm: str     # field 2, undecodable bytes replaced
    state: str    # field 3
    ppid: int     # field 4
    utime: int    # field 14, clock ticks
    stime: int    # field 15, clock ticks
    starttime: int = 0  # field 22, clock ticks after boot: with the pid, names one process (pids are reused)
    vsize: int = 0      # field 23, bytes of virtual memory: moves when a library is mapped


def parse_stat(raw: bytes, source: str) -> Stat:
    """Parse the content of a /proc/PID/stat file. Raises ProcParseError naming `source` and the field."""
    lp, rp = raw.find(b"("), raw.rfind(b")")
    if lp < 0 or rp < lp:
        raise ProcParseError(f"{source}: field 2 (comm) is not in parentheses: {raw[:80]!r}")
    comm = raw[lp + 1:rp].decode(errors="replace")
    rest = raw[rp + 1:].split()  # fields 3, 4, ...

    def field(n: int, name: str) -> bytes:
        if n - 3 >= len(rest):
            raise ProcParseError(f"{source}: field {n} ({name}) is missing: only {len(rest) + 2} fields")
        return rest[n - 3]

    def number(n: int, name: str) -> int:
        got = field(n, name)
        if not _INT.fullmatch(got):
            raise ProcParseError(f"{source}: field {n} ({name}) is {got[:40]!r}, not an integer")
        return int(got)

    state = field(3, "state")
    if len(state) != 1 or not state.isalpha():
        raise ProcParseError(f"{source}: field 3 (state) is {state[:40]!r}, not a state letter")
    return Stat(comm=comm, state=state.decode(), ppid=number(4, "ppid"), utime=number(14, "utime"),
                stime=number(15, "stime"), starttime=number(22, "starttime"), vsize=number(23, "vsize"))


def read_small(path: str) -> bytes:
    """A small /proc file's bytes in three system calls (open, read, close); Python's open() makes
    eight (fstat twice, a terminal check, two seeks), and the agent reads a few of these per rank a
    second. OSError when it cannot be opened or read (the process is gone)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while True:
            got = os.read(fd, SMALL_READ)
            chunks.append(got)
            if len(got) < SMALL_READ:  # procfs hands a small file over in one read
                return b"".join(chunks)
    finally:
        os.close(fd)


def read_stat(pid: int, proc: str = "/proc") -> Optional[Stat]:
    """PROC/PID/stat parsed, or None when the process is gone (or its stat cannot be parsed: logged).
    `proc`: where procfs is mounted (a fake tree in tests)."""
    source = f"{proc}/{pid}/stat"
    try:
        raw = read_small(source)
    except OSError:
        return None
    try:
        return parse_stat(raw, source)
    except ProcParseError as e:
        log.warning("%s", e)
        return None


def read_state(pid: int, st: Optional[Stat] = None) -> Optional[Tuple[str, str, int]]:
    """(state letter, wchan, cpu_ns) of the process's main thread, or None when it is gone. `st`: its
    stat when the caller has just read it."""
    if st is None:
        st = read_stat(pid)
    if st is None:
        return None
    try:
        wchan = read_small(f"/proc/{pid}/wchan").strip().decode(errors="replace")
    except OSError:
        wchan = ""
    return st.state, ("" if wchan == "0" else wchan), (st.utime + st.stime) * _TICK_NS


def vsize(pid: int) -> int:
    """The process's virtual memory size in bytes (/proc/PID/stat field 23), -1 when gone."""
    st = read_stat(pid)
    return -1 if st is None else st.vsize
