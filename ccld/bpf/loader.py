"""What every probe family's loader shares: compile one *.bpf.c with -D cflags, read its ring buffer
a drain at a time, attach uprobes to one process as a unit, and count what goes wrong instead of raising.

A family subclass names its source file, its record kinds (a records.Kinds: every record of a family
takes one slot size), and its uprobe plan: a list of (symbol prefix, BPF function, required?)
resolved against the library each process has mapped. A drain hands its translator every record
that came since the last one as one array (`records(rows, kinds)`), never one call per record.
The families of kernel tracepoints (net, sched) build on it: kernel_family.py.
Clock: records carry CLOCK_MONOTONIC ns from the kernel; nothing here re-stamps them.
"""
from __future__ import annotations

import concurrent.futures
import ctypes as ct
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ccld.bpf import records
from ccld.errors import EnvironmentProblem

log = logging.getLogger("ccld.bpf")
BPF_DIR = os.path.dirname(os.path.abspath(__file__))
DETACH_THREADS = 8  # uprobe links (or perf events) closed at once (perf events: ~25 % faster than one by one)
COMPILE_CHILDREN = 4  # a cold start's compile children at most (one per CPU): clang is CPU-bound


@dataclass(frozen=True)
class Probe:
    prefix: str   # mangled-name prefix; every defined function symbol starting with it is probed
    fn: str       # BPF function name in the family's .bpf.c
    required: bool = False
    exact: bool = False  # the whole symbol name, not a prefix: for C APIs, where "ncclReduce" would also
                         # hit ncclReduceScatter and ncclReduceConfig
    ret: bool = False    # a uretprobe; only on functions no C++ exception can unwind through
    # fn "" = resolve only: the symbol's address is looked up with the others (one pass over the
    # library) and kept in Attachment.symbols, but nothing is attached to it


@dataclass
class Attachment:
    pid: int
    lib: str
    points: List[Tuple[str, int]] = field(default_factory=list)  # (symbol, address)
    events: List[int] = field(default_factory=list)              # fds holding our uprobes (links or perf events)
    missing: List[str] = field(default_factory=list)             # optional prefixes not found
    ret_points: List[Tuple[str, int]] = field(default_factory=list)  # (symbol, address) of uretprobes
    config: Dict[str, Any] = field(default_factory=dict)             # what the family read off the library
    symbols: Dict[str, int] = field(default_factory=dict)            # resolve-only symbols -> address


def seen_from_here(pid: int, path: str) -> str:
    """`path` as process `pid` sees it -> a path naming the same file in this process's mount namespace.
    The same namespace: the path itself. Another one: /proc/PID/root + path, which the kernel resolves
    in the process's own root (needs the rights to read /proc/PID/root: root, or ptrace on it)."""
    try:
        if os.stat(f"/proc/{pid}/ns/mnt").st_ino == os.stat("/proc/self/ns/mnt").st_ino:
            return path
    except OSError:
        return path  # no namespace information (old kernel, a process gone): the path as it was given
    return f"/proc/{pid}/root{path}"


def read_maps(pid: int) -> str:
    """The text of /proc/PID/maps ("" when the process is gone), searched whole by mapped_path: a torch
    rank maps thousands of lines, and one regex over the text is ~20x cheaper than a Python step per line
    (the agent looks again whenever a rank's address space changed)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return f.read()
    except OSError:
        return ""


def mapped_path(maps: str, pattern: "re.Pattern[str]") -> Optional[str]:
    """The path of the first line of `maps` (read_maps' text) whose path `pattern` (compiled with
    re.MULTILINE, anchored with $ at the path's end) finds, or None."""
    m = pattern.search(maps)
    if m is None:
        return None
    start = maps.rfind("\n", 0, m.start()) + 1
    end = maps.find("\n", m.end())
    parts = maps[start:end if end >= 0 else len(maps)].split(None, 5)
    return parts[5].strip() if len(parts) == 6 else None


def lib_key(path: str) -> Any:
    """What identifies a library file across paths: (device, inode); the path when it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return path
    return (st.st_dev, st.st_ino)


def compile_ahead(families: Sequence["Family"]) -> None:
    """Compile the programs of `families` that the cache lacks in child processes, one per CPU (up to
    COMPILE_CHILDREN), each taking several families (bcc and its LLVM start once per child, and the
    compiles run side by side); each family's load() takes its own result. A failure, of a child or
    of one program, is left to that family's own compile, which reports it."""
    from ccld.bpf import progcache
    from ccld.bpf.compile import compile_specs
    directory = progcache.cache_dir()
    todo, requests = [], []
    for fam in families:
        try:
            if progcache.lookup(directory, fam.cache_key()) is None:
                requests.append((fam.source_path(), fam.all_cflags()))
                todo.append(fam)
        except (OSError, EnvironmentProblem):
            pass  # its load() says what it cannot read
    if len(todo) < 2:
        return
    children = max(1, min(COMPILE_CHILDREN, len(os.sched_getaffinity(0)), len(todo)))  # the CPUs we may use
    shares = [list(range(k, len(todo), children)) for k in range(children)]  # round robin: sizes differ

    def one(share: List[int]) -> None:
        try:
            specs = compile_specs([requests[i] for i in share])
        except Exception as e:  # whatever it was: each family's own compile tries again and reports
            log.warning("compiling %s ahead failed: %s", ", ".join(todo[i].NAME for i in share), e)
            return
        for i, spec in zip(share, specs):
            todo[i].ahead = spec

    try:
        with concurrent.futures.ThreadPoolExecutor(children) as pool:
            list(pool.map(one, shares))
    except RuntimeError as e:  # no thread to be had (a pids limit): the families compile one by one
        log.warning("compiling ahead: %s", e)


class Family:
    """One probe family: one .bpf.c, one loaded program, attached per process."""

    NAME = ""
    SOURCE = ""
    KERNEL_CFLAGS: Sequence[str] = ()  # cflags read off the running kernel, as the cache names them
    LIB_PATTERN = ""   # regex matched against paths in /proc/PID/maps
    KINDS: Optional[records.Kinds] = None   # the record kinds and the slot size of every record
    PROBES: Sequence[Probe] = ()

    def __init__(self, on_record, cflags: Sequence[str] = ()):
        """`on_record`: the translator; a ring family calls its records(rows, kinds) once per drain
        (and flush(now_ns) after, if it has one)."""
        from ccld.bpf.progcache import default_cflags
        self.on_record = on_record
        self.cflags = default_cflags(self.NAME) + list(cflags)
        self.bpf = None
        self.ring = None  # ringbuf.RingReader over the program's `events`
        self.from_cache = False  # the program came from the compiled-program cache (no compile)
        self.bad_records: Dict[str, int] = {}
        self.attached: Dict[int, Attachment] = {}   # traced pid -> the attachment of its library
        self.libs: Dict[Any, Attachment] = {}       # lib_key(library) -> probes attached for all processes
        self._plans: Dict[Any, Tuple[List[Tuple[str, int, Probe]], List[str]]] = {}
        self._lock = threading.Lock()
        self._lost_at_close = 0  # lost() after close(): the agent's final loss report comes after it
        self.ahead: Any = None   # this program compiled by compile_ahead (a spec, or why it did not compile)

    # -- program -----------------------------------------------------------------------------
    def source_path(self) -> str:
        return os.path.join(BPF_DIR, self.SOURCE)

    def all_cflags(self) -> List[str]:
        return [f"-I{BPF_DIR}"] + self.cflags

    def cache_key(self) -> str:
        """The compiled-program cache's key of this program: its text, its cflags (those read off the
        running kernel, e.g. net's struct offsets from BTF, by name: the kernel is part of the key, so
        a cached start reads no BTF), the kernel and bcc (progcache.py)."""
        from ccld.bpf import progcache
        return progcache.program_key(self.SOURCE, self.cflags, self.KERNEL_CFLAGS)

    def program_text(self) -> str:
        """The final program and cflags, as `--ebpf` prints them. Needs no root."""
        with open(self.source_path()) as f:
            text = f.read()
        return f"// cflags: {' '.join(self.all_cflags())}\n{text}"

    def _compile(self) -> None:
        """Load the program: from the compiled-program cache (progcache.py) when it holds this text,
        these cflags and this kernel, else compile it with bcc in a child process (compile.py) and
        keep the result there. Either way the program is loaded by program.Program: this process
        never imports bcc."""
        from ccld.bpf import progcache
        from ccld.bpf.program import Program
        try:
            key = self.cache_key()
        except OSError as e:
            raise EnvironmentProblem(f"cannot read {self.SOURCE}: {e}", "reinstall ccld")
        directory = progcache.cache_dir()
        spec = progcache.lookup(directory, key)
        if spec is not None:
            try:
                self.bpf = Program(spec)
                self.from_cache = True
                return
            except Exception as e:  # a kernel the key did not tell apart, a damaged file: compile again
                log.warning("%s: cached program did not load (%s); compiling it", self.NAME, e)
                progcache.forget(directory, key)
        from ccld.bpf.compile import compile_spec
        spec, self.ahead = self.ahead, None
        if not isinstance(spec, dict):  # not compiled ahead, or that failed (e.g. before tracefs was mounted)
            spec = compile_spec(self.source_path(), self.all_cflags())
        try:
            self.bpf = Program(spec)
        except Exception as e:
            raise EnvironmentProblem(f"could not load {self.SOURCE}: {e}", "are you root (CAP_BPF, CAP_PERFMON)?")
        self.from_cache = False
        if directory is not None:
            progcache.save(directory, key, spec)

    def load(self, program=None) -> None:
        """Load the program (`program`: one progcache.preload() already put in the kernel)."""
        if program is not None:
            self.bpf, self.from_cache = program, True
        else:
            self._compile()
        from ccld.bpf.ringbuf import RingReader
        events = self.bpf[b"events"]
        self.ring = RingReader(events.map_fd, int(events.max_entries), self.KINDS.rec_size, self.bad_records)

    def poll(self, timeout_ms: int) -> None:
        """Wait timeout_ms, then drain. Records are submitted without wakeups (CCLD_SUBMIT_FLAGS):
        the agent drains on its own clock, so there is nothing to wait on but time."""
        if timeout_ms > 0:
            time.sleep(timeout_ms / 1000)
        self.tick(time.monotonic_ns())

    def tick(self, now_ns: int) -> int:
        """Drain what came since the last drain (nothing to do costs two loads), then let the
        translator send what has waited long enough (flush). Returns how many records came."""
        n = 0
        if self.ring is not None and self.ring.pending():
            rows = self.ring.read()
            n = len(rows)
            good, kinds = self.KINDS.check(rows, self.bad_records)
            if len(good):
                try:
                    self.on_record.records(good, kinds)
                except Exception:  # a bug in the translator must not stop tracing; its records are counted
                    log.exception("%s: translator failed on a drain of %d records", self.NAME, len(good))
                    self.bad_records["handler-error"] = self.bad_records.get("handler-error", 0) + len(good)
        flush = getattr(self.on_record, "flush", None)
        if flush is not None:
            flush(now_ns)
        return n

    def ring_share(self, n: int) -> float:
        """The share of this family's ring buffer that n records take (0 for a family without one)."""
        return 0.0 if self.ring is None else n * self.ring.stride / self.ring.data_size

    def lost(self) -> int:
        """Records the kernel side could not reserve (ring buffer full), summed over CPUs; once
        closed, the count at close (the agent ships its final loss counters after closing us)."""
        if self.bpf is None:
            return self._lost_at_close
        return int(sum(self.bpf[b"lost"][ct.c_int(0)]))

    # -- attaching ---------------------------------------------------------------------------
    def find_lib(self, pid: int, maps: Optional[str] = None) -> Optional[str]:
        """Path of this family's library as mapped by `pid` (/proc/PID/maps, or its text `maps` read
        once for several families), made valid from here: through /proc/PID/root when the process
        lives in another mount namespace (a container, while the agent runs on the host or in a
        DaemonSet). None when not mapped (yet)."""
        path = mapped_path(read_maps(pid) if maps is None else maps, re.compile(self.LIB_PATTERN, re.M))
        return None if path is None else seen_from_here(pid, path)

    def _plan(self, lib: str) -> Tuple[List[Tuple[str, int, Probe]], List[str]]:
        """Resolve every probe's symbols in `lib` once (the ELF scan is the slow part)."""
        key = lib_key(lib)
        if key in self._plans:
            return self._plans[key]
        from ccld.bpf import elfsyms
        # One pass over the symbol tables for all prefixes: each pass over libtorch_cpu.so costs ~0.5 s.
        pattern = "^(" + "|".join(re.escape(p.prefix) for p in self.PROBES) + ")"
        found = elfsyms.functions(lib, pattern)
        points, missing, seen = [], [], set()
        for p in self.PROBES:
            got = False
            for sym, addr in found:
                if not (sym == p.prefix if p.exact else sym.startswith(p.prefix)) or "." in sym:
                    continue  # "foo.cold" is a split-off block, not a function entry: never probe it
                got = True
                if (addr, p.ret) in seen:  # C1/C2 constructor aliases share one address: probe it once
                    continue
                seen.add((addr, p.ret))
                points.append((sym, addr, p))
            if not got:
                missing.append(p.prefix)
        self._plans[key] = (points, missing)
        return self._plans[key]

    def attach(self, pid: int, lib: str) -> Attachment:
        """Trace `pid`: make sure the family's probes are on `lib` (once, for every process that maps
        it, as a unit: if one fails, none stay), then add pid to the program's `traced` set."""
        with self._lock:
            # By file, not by path: the same library reached as /usr/lib/x.so and /proc/PID/root/usr/lib/x.so
            # (or through a bind mount) is one set of probes; two would report every call twice. The key
            # is read once, before the attach: /proc/PID/root goes away if the process exits meanwhile.
            key = lib_key(lib)
            att = self.libs.get(key)
            if att is None:
                att = self.libs[key] = self._attach_lib(lib)
            try:
                self._trace(pid, att)
            except Exception as e:
                raise EnvironmentProblem(f"{self.NAME}: cannot trace pid {pid}: {e}",
                                         f"raise CCLD_MAX_PROCS (now tracing {len(self.attached)} processes)")
            self.attached[pid] = att
        return att

    def _trace(self, pid: int, att: Attachment) -> None:
        """Make the program report `pid` (its `traced` entry)."""
        self.bpf[b"traced"][ct.c_uint32(pid)] = self.traced_value(att)

    def _untrace(self, pid: int) -> None:
        try:
            del self.bpf[b"traced"][ct.c_uint32(pid)]
        except KeyError:
            pass

    def traced_value(self, att: Attachment) -> Any:
        """The value of a traced process in the program's `traced` map (its per-process settings):
        a u8 1 unless the family's program keeps more there."""
        return ct.c_uint8(1)

    def _attach_lib(self, lib: str) -> Attachment:
        try:
            points, missing = self._plan(lib)
        except (OSError, ValueError) as e:  # a library gone, unreadable or no ELF file we read
            raise EnvironmentProblem(f"{self.NAME}: cannot read the symbols of {lib}: {e}",
                                     "is the library readable from the agent (same mount namespace, "
                                     "or /proc/PID/root reachable: run the agent as root with hostPID)?") from e
        need = {p.prefix for p in self.PROBES if p.required}
        lacking = need & set(missing)
        if lacking:
            raise EnvironmentProblem(f"{self.NAME}: {os.path.basename(lib)} lacks {sorted(lacking)}",
                                     "this library version is not supported yet")
        att = Attachment(-1, lib, missing=list(missing))
        probed = []
        for sym, addr, probe in points:
            if not probe.fn:
                att.symbols[sym] = addr
                continue
            probed.append((addr, probe.fn, probe.ret))
            (att.ret_points if probe.ret else att.points).append((sym, addr))
        try:
            att.events = self.bpf.attach_uprobes(lib, probed)  # all or none
        except Exception as e:
            hint = ("let the other tracer detach, or stop it, then restart the rank's tracing"
                    if "ref_ctr_offset" in str(e) else "is the library readable, and are you root?")
            raise EnvironmentProblem(f"{self.NAME}: attaching {len(probed)} probes to {lib} failed: {e}", hint)
        return att

    def _detach_events(self, fds: List[int]) -> None:
        """Close our uprobe links or perf events (a few threads at once).

        A uprobe_multi link holds one function's probes and closes in one grace period (~20 ms); a
        perf event holds one probe and each close waits its own (~80-110 ms here, the kernel serialises
        most of it): that is why probes are per library, not per process, and only closed when the
        family closes. Closing the fd removes the probes; tracefs is not touched."""
        if not fds:
            return
        with concurrent.futures.ThreadPoolExecutor(min(DETACH_THREADS, len(fds))) as pool:
            self.bpf.close_events(fds, pool)
        fds.clear()

    def detach(self, pid: int) -> None:
        """Stop tracing `pid`: one map delete. The library's probes stay for the other ranks."""
        with self._lock:
            if self.attached.pop(pid, None) is not None and self.bpf is not None:
                self._untrace(pid)

    def close(self) -> None:
        if self.bpf is None:
            return
        try:
            self._lost_at_close = self.lost()
        except Exception:  # a map read failing here must not keep the probes attached
            log.exception("%s: cannot read the loss counter at close", self.NAME)
        with self._lock:
            self.attached.clear()
            for att in self.libs.values():
                self._detach_events(att.events)
            self.libs.clear()
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        self.bpf.cleanup()
        self.bpf = None
