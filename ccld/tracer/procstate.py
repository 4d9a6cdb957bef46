"""What a rank's process is doing, from /proc: its state letter, kernel wait channel and CPU time.

This is the agent's source of last resort: it needs no eBPF and still tells a stopped (T), dead or
busy (R) rank from one blocked in a collective (S). CPU time is utime+stime in ns.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

_TICK_NS = 1_000_000_000 // os.sysconf("SC_CLK_TCK")

STATE_NAMES = {"R": "running", "S": "sleeping", "D": "disk wait", "T": "stopped", "t": "traced/stopped",
               "Z": "zombie", "X": "dead", "I": "idle"}


def read_state(pid: int) -> Optional[Tuple[str, str, int]]:
    """(state letter, wchan, cpu_ns) of the process's main thread, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    try:
        rest = stat[stat.rindex(")") + 2:].split()
        state, utime, stime = rest[0], int(rest[11]), int(rest[12])
    except (ValueError, IndexError):
        return None
    try:
        with open(f"/proc/{pid}/wchan") as f:
            wchan = f.read().strip()
    except OSError:
        wchan = ""
    return state, ("" if wchan == "0" else wchan), (utime + stime) * _TICK_NS
