"""Loader of sched.bpf.c: runqueue wait and off-CPU time of the traced ranks, shipped as SchedStats.

Every DRAIN_MS the agent reads `stats` (cumulative per process) and `runq_max` (longest wait since the
last drain, deleted as it is read) and ships one SchedStats per traced process whose numbers moved.
Times are nanoseconds of CLOCK_MONOTONIC; the counters are cumulative from when the agent attached.
"""
from __future__ import annotations

import ctypes as ct
import time
from typing import Callable, Dict, Tuple

from ccld import events as ev
from ccld.bpf.loader import KernelFamily


class SchedVal(ct.Structure):
    """Mirror of struct sched_stats in sched.bpf.c (size asserted on both sides)."""
    _fields_ = [("runq_ns", ct.c_uint64), ("runq_waits", ct.c_uint64), ("offcpu_ns", ct.c_uint64),
                ("switches", ct.c_uint64)]


class SchedFamily(KernelFamily):
    NAME = "sched"
    SOURCE = "sched.bpf.c"

    def drain(self) -> None:
        maxes = self.bpf[b"runq_max"]
        peak: Dict[int, int] = {}
        for k, v in list(maxes.items()):
            peak[k.value] = v.value
            try:
                del maxes[k]
            except KeyError:
                pass
        stats = self.bpf[b"stats"]
        for k, v in stats.items():
            tgid = k.value
            if tgid in self.attached:
                self.on_record(tgid, (v, peak.get(tgid, 0)))
            else:
                try:
                    del stats[k]  # a process no longer traced: its counters would only grow stale
                except KeyError:
                    pass


class SchedTranslator:
    def __init__(self, emit: Callable[[ev.Event], None]):
        self.emit = emit
        self.ranks: Dict[int, int] = {}
        self._last: Dict[int, Tuple[int, int]] = {}

    def add_process(self, pid: int, rank: int, job: str) -> None:
        self.ranks[pid] = rank

    def forget(self, pid: int) -> None:
        self.ranks.pop(pid, None)
        self._last.pop(pid, None)

    def __call__(self, tgid: int, rec) -> None:
        v, peak = rec
        rank = self.ranks.get(tgid)
        if rank is None:
            return
        key = (v.switches, v.runq_waits)
        if self._last.get(tgid) == key:
            return
        self._last[tgid] = key
        self.emit(ev.SchedStats(pid=tgid, rank=rank, ts_ns=time.monotonic_ns(), runq_ns=v.runq_ns,
                                runq_waits=v.runq_waits, runq_max_ns=peak, offcpu_ns=v.offcpu_ns,
                                switches=v.switches))
