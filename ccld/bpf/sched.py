"""Loader of sched.bpf.c: runqueue wait and off-CPU time of the traced ranks, shipped as SchedStats.

Each traced process gets a slot in the program's per-CPU arrays (its `traced` value). Every DRAIN_MS
the agent reads its slot of `stats` (cumulative, one copy per CPU: added up here) and of `runq_max`
(longest wait since the last drain, per CPU: the largest is taken and the slot reset), and ships one
SchedStats per traced process whose numbers moved: a few map reads per process, never per switch.
Times are nanoseconds of CLOCK_MONOTONIC; the counters are cumulative from when the agent attached.
`exit_info(pid)` is when a traced process's main thread exited (sched_process_exit) and the first
signal that ends a process by default sent to it (signal_generate: number, sender), for the agent's
RankExit: a death timed by the kernel, not by the agent's next /proc scan, and how it came.
"""
from __future__ import annotations

import ctypes as ct
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from ccld import wire as ev
from ccld.bpf.kernel_family import KernelFamily, set_bit
from ccld.bpf.loader import Attachment
from ccld.errors import EnvironmentProblem

MAX_PROCS = 4096  # = CCLD_MAX_PROCS: slots in the per-CPU arrays


class SchedVal(ct.Structure):
    """Mirror of struct sched_stats in sched.bpf.c (size asserted on both sides)."""
    _fields_ = [("runq_ns", ct.c_uint64), ("runq_waits", ct.c_uint64), ("offcpu_ns", ct.c_uint64),
                ("switches", ct.c_uint64)]


class FatalSignal(ct.Structure):
    """Mirror of struct fatal_signal in sched.bpf.c (size asserted on both sides)."""
    _fields_ = [("ts_ns", ct.c_uint64), ("sender", ct.c_uint32), ("sig", ct.c_int32)]


@dataclass(frozen=True)
class ExitInfo:
    exit_ns: Optional[int]  # CLOCK_MONOTONIC ns of the main thread's exit; None: not seen
    signal: int             # the first fatal signal sent to it, 0 none
    sender: int             # the pid that sent it, 0 none


class SchedFamily(KernelFamily):
    NAME = "sched"
    SOURCE = "sched.bpf.c"

    def __init__(self, on_record, cflags=()):
        super().__init__(on_record, cflags)
        self.slots: Dict[int, int] = {}          # traced pid -> its slot
        self._readers = None                     # mapread.BatchReader of stats and runq_max
        self._free: List[int] = list(range(MAX_PROCS - 1, -1, -1))

    def _trace(self, pid: int, att: Attachment) -> None:
        if pid not in self.slots:
            if not self._free:
                raise EnvironmentProblem(f"sched: {MAX_PROCS} processes traced already", "raise CCLD_MAX_PROCS")
            slot = self.slots[pid] = self._free.pop()
            zero = self.bpf[b"stats"].Leaf()  # a fresh slot: no counts of the process that had it
            self.bpf[b"stats"][ct.c_int(slot)] = zero
            self.bpf[b"runq_max"][ct.c_int(slot)] = self.bpf[b"runq_max"].Leaf()
            self.bpf[b"exited"][ct.c_int(slot)] = ct.c_uint64(0)
            self.bpf[b"signals"][ct.c_int(slot)] = FatalSignal()
        self.bpf[b"traced"][ct.c_uint32(pid)] = ct.c_uint32(self.slots[pid])
        set_bit(self.bpf[b"proc_bits"], pid, True, self.NAME)

    def _untrace(self, pid: int) -> None:
        super()._untrace(pid)
        slot = self.slots.pop(pid, None)
        # its threads: out of `threads` and `thread_bits` (a reused tid must not count for it)
        threads, bits = self.bpf[b"threads"], self.bpf[b"thread_bits"]
        try:
            entries = list(threads.items_lookup_batch())
        except Exception:
            entries = list(threads.items())
        for k, t in entries:
            if t.tgid == pid:
                tid = k.value if hasattr(k, "value") else int(k)
                try:
                    del threads[ct.c_uint32(tid)]
                except KeyError:
                    pass
                if tid >> 6 < bits.max_entries:
                    set_bit(bits, tid, False, self.NAME)
        if slot is not None:
            self._free.append(slot)

    def exit_info(self, pid: int) -> Optional[ExitInfo]:
        """How traced process `pid` ended, as far as the kernel said (None: not traced here)."""
        slot = self.slots.get(pid)
        if slot is None or self.bpf is None:
            return None
        try:
            at = int(self.bpf[b"exited"][ct.c_int(slot)].value)
            sig = self.bpf[b"signals"][ct.c_int(slot)]
        except (KeyError, OSError):
            return None
        return ExitInfo(at or None, int(sig.sig), int(sig.sender) if sig.sig else 0)

    def drain(self) -> None:
        """Every traced process's slot of the per-CPU sums, added up over the CPUs, and of the
        per-CPU longest waits (the largest taken; a slot that had one is reset): one batch read of
        each array for all processes (mapread), not a lookup per process."""
        if not self.slots:
            return
        from ccld.bpf.mapread import BatchReader
        stats, maxes = self.bpf[b"stats"], self.bpf[b"runq_max"]
        if self._readers is None:
            self._readers = (BatchReader(stats), BatchReader(maxes))
        top = max(self.slots.values()) + 1
        _, sv = self._readers[0].read(limit=top)
        _, mv = self._readers[1].read(limit=top)
        if len(sv) < top or len(mv) < top:
            return  # a partial read (the kernel reported no progress): the next drain has them all
        sums = sv.view(np.uint64).reshape(top, -1, 4).sum(axis=1)   # slot -> (runq_ns, waits, offcpu, switches)
        peaks = mv.view(np.uint64).reshape(top, -1).max(axis=1)
        zero = maxes.Leaf()
        for pid, slot in list(self.slots.items()):
            peak = int(peaks[slot])
            if peak:
                maxes[ct.c_int(slot)] = zero
            r = sums[slot].tolist()
            self.on_record(pid, (SimpleNamespace(runq_ns=r[0], runq_waits=r[1], offcpu_ns=r[2], switches=r[3]), peak))


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
