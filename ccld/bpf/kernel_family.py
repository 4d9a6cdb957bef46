"""What the kernel-tracepoint families' loaders (net.py, sched.py) share: KernelFamily, whose
programs attach to the whole kernel when they load and aggregate in maps drained every DRAIN_MS, the
bitmap over pids their programs test first (set_bit), and mounting tracefs where it is not.

Processes are filtered in the kernel: attach/detach only add and remove a pid (`traced`, `proc_bits`),
so there is no library to find and no probe to attach or detach per process. Clock: the maps' sums are read on
the agent's CLOCK_MONOTONIC schedule (tick); nothing here re-stamps a record.
"""
from __future__ import annotations

import ctypes as ct
import logging
import os
import time
from typing import Optional, Sequence

from ccld.bpf.loader import Attachment, Family
from ccld.errors import EnvironmentProblem

log = logging.getLogger("ccld.bpf")


def set_bit(bits, pid: int, on: bool, family: str) -> None:
    """Set or clear `pid`'s bit in a program's bitmap over pids (a BPF_ARRAY of u64 words). A pid past
    the bitmap (pid_max raised after the program was loaded) cannot be traced: an error naming it."""
    w = pid >> 6
    if w >= bits.max_entries:
        raise EnvironmentProblem(f"{family}: pid {pid} is past the {bits.max_entries * 64} pids the program was "
                                 f"built for (kernel.pid_max was raised since)", "restart the agent")
    key = ct.c_int(w)
    cur = bits[key].value
    new = cur | (1 << (pid & 63)) if on else cur & ~(1 << (pid & 63))
    if new != cur:
        bits[key] = ct.c_uint64(new)


TRACEFS = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")


def ensure_tracefs() -> None:
    """A compile (bcc) reads tracepoint formats from tracefs to build TRACEPOINT_PROBE's `args`, and
    attaching reads each tracepoint's id there (sysbpf.py); mount it where a minimal system (a
    container, a fresh VM) has not."""
    if any(os.path.isdir(os.path.join(d, "events")) for d in TRACEFS):
        return
    import subprocess
    got = subprocess.run(["mount", "-t", "tracefs", "nodev", TRACEFS[0]], capture_output=True, text=True)
    if got.returncode != 0:
        raise EnvironmentProblem(f"tracefs is not mounted and mounting it failed: {got.stderr.strip()}",
                                 f"mount -t tracefs nodev {TRACEFS[0]}")


class KernelFamily(Family):
    """A family of kernel tracepoints rather than library uprobes.

    Its programs attach to the whole kernel when it loads (program.Program attaches TRACEPOINT_PROBEs),
    are filtered in the kernel by the `traced` tgid set that attach/detach maintain, and aggregate in
    maps instead of writing records; `drain()` reads those maps every DRAIN_MS. "Attaching" a process
    is one map update, so there is no library to find: `find_lib` answers LIB for any live process.
    """

    LIB = "kernel"
    DRAIN_MS = 500  # link and scheduler counters are per-interval sums; 0.5 s is finer than any finding needs

    def __init__(self, on_record, cflags: Sequence[str] = ()):
        super().__init__(on_record, cflags)
        self._next_drain = 0.0

    def load(self, program=None) -> None:
        ensure_tracefs()
        if program is not None:
            self.bpf, self.from_cache = program, True
        else:
            self._compile()

    def find_lib(self, pid: int, maps: Optional[str] = None) -> Optional[str]:
        return self.LIB if os.path.isdir(f"/proc/{pid}") else None

    def _attach_lib(self, lib: str) -> Attachment:
        return Attachment(-1, lib)

    def _trace(self, pid: int, att: Attachment) -> None:
        """`traced` entry, then the pid's bit in `proc_bits`: the programs' first test, before any
        map of theirs (an array lookup the verifier inlines: no cost on the node's other switches)."""
        super()._trace(pid, att)
        set_bit(self.bpf[b"proc_bits"], pid, True, self.NAME)

    def _untrace(self, pid: int) -> None:
        set_bit(self.bpf[b"proc_bits"], pid, False, self.NAME)
        super()._untrace(pid)

    def poll(self, timeout_ms: int) -> None:
        """Wait timeout_ms, then drain at once (the agent does poll(0) before it forgets a dead
        process, and when it stops)."""
        if timeout_ms > 0:
            time.sleep(timeout_ms / 1000)
        self._drain_now(time.monotonic())

    def tick(self, now_ns: int) -> int:
        """Drain if DRAIN_MS have passed since the last drain (the agent calls this every POLL_MS, or
        more often during a burst; a drain's sums are records the ring families do not count)."""
        now = now_ns / 1e9
        if now >= self._next_drain:
            self._drain_now(now)
        return 0

    def _drain_now(self, now: float) -> None:
        self._next_drain = now + self.DRAIN_MS / 1000
        try:
            self.drain()
        except Exception:  # one bad read must not end tracing; the next interval tries again
            log.exception("%s: drain failed", self.NAME)
            self.bad_records["drain-error"] = self.bad_records.get("drain-error", 0) + 1

    def drain(self) -> None:
        raise NotImplementedError

    def lost(self) -> int:
        return 0  # nothing is written to a ring buffer; LRU evictions are counted by the family itself
