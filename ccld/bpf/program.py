"""A compiled BPF program loaded into the kernel without bcc: made from the description a compile
leaves (progcache.describe: maps, each function's instructions and where they name a map).

Program(spec) creates the maps and writes their fds into the instructions (the 64-bit immediate
loads progcache found); a function is loaded when it is first attached, with the program type its
attach point needs (a uprobe's is BPF_PROG_TYPE_KPROBE, a tracepoint's BPF_PROG_TYPE_TRACEPOINT).
bcc's TRACEPOINT_PROBE(cat, name) functions, named tracepoint__cat__name, attach when the program
is made, as bcc attaches them. Uprobes sit at file offsets (elfcode.py turns a symbol's address into
one): one uprobe_multi link per function where the kernel has them (its functions are then loaded for
them), else a perf event of the uprobe PMU per offset (sysbpf). Closing the link or event removes the
probes, so close_events() is all a detach is, and it may run on several threads at once.
close() closes every event, function and map (idempotent; also at exit).
"""
from __future__ import annotations

import atexit
import base64
import os
import struct
import threading
from typing import Any, Dict, Iterable, List, Sequence, Tuple

from ccld.bpf import elfcode, sysbpf
from ccld.bpf.maps import Map

INSN = 8                 # bytes per BPF instruction
TRACEPOINT_PREFIX = "tracepoint__"


class Function:
    def __init__(self, name: str, fd: int):
        self.name, self.fd = name, fd


class Program:
    """The maps and functions of one loaded program (see the module's text)."""

    def __init__(self, spec: Dict[str, Any]):
        self._spec = spec
        self.license = str(spec.get("license") or "GPL")
        self.kern_version = int(spec.get("kern_version") or 0)
        self._maps: Dict[str, Map] = {}
        self._code: Dict[str, bytes] = {}
        self.funcs: Dict[str, Function] = {}
        self._events: List[int] = []   # perf event fds this object opened and has not closed
        self._lock = threading.Lock()
        self._closed = False
        atexit.register(self.close)
        try:
            for t in spec["tables"]:
                fd = sysbpf.map_create(int(t["type"]), int(t["key_size"]), int(t["leaf_size"]),
                                       int(t["max_entries"]), int(t["flags"]), t["name"])
                try:
                    self._maps[t["name"]] = Map(t["name"], fd, t)
                except BaseException:
                    os.close(fd)
                    raise
            for f in spec["functions"]:
                code = bytearray(base64.b64decode(f["code"]))
                for k, table in f["relocs"]:
                    if table not in self._maps or (k + 1) * INSN > len(code):
                        raise ValueError(f"{f['name']}: relocation {k} names {table!r}, not a map of the program")
                    struct.pack_into("<i", code, k * INSN + 4, self._maps[table].map_fd)
                self._code[f["name"]] = bytes(code)
            for name in self._code:
                if name.startswith(TRACEPOINT_PREFIX):
                    category, _, event = name[len(TRACEPOINT_PREFIX):].partition("__")
                    self.attach_tracepoint(category, event, name)
        except BaseException:
            self.close()
            raise

    # -- maps and functions ------------------------------------------------------------------
    def __getitem__(self, name: Any) -> Map:
        key = name.decode() if isinstance(name, bytes) else name
        if key not in self._maps:
            raise KeyError(name)
        return self._maps[key]

    def code(self, name: str) -> bytes:
        """Function `name`'s instructions, with this program's map fds in them."""
        return self._code[name]

    def load_func(self, name: Any, prog_type: int) -> Function:
        """Function `name` loaded as `prog_type` (once; later calls return the same one)."""
        name = name.decode() if isinstance(name, bytes) else name
        with self._lock:
            if name in self.funcs:
                return self.funcs[name]
            if name not in self._code:
                raise KeyError(f"no function {name} in the program")
            multi = prog_type == sysbpf.BPF_PROG_TYPE_KPROBE and sysbpf.has_uprobe_multi()  # uprobes: links
            fn = self.funcs[name] = Function(name, sysbpf.prog_load(
                prog_type, self._code[name], self.license, self.kern_version, name,
                sysbpf.BPF_TRACE_UPROBE_MULTI if multi else 0))
            return fn

    # -- attach points -----------------------------------------------------------------------
    def _attach(self, perf_fd: int, prog_fd: int) -> int:
        try:
            sysbpf.attach(perf_fd, prog_fd)
        except BaseException:
            os.close(perf_fd)
            raise
        return self._keep(perf_fd)

    def _keep(self, fd: int) -> int:
        """Count `fd` (a perf event or link) among ours: close_events() and close() close it."""
        with self._lock:
            self._events.append(fd)
        return fd

    def attach_tracepoint(self, category: str, event: str, fn_name: str) -> int:
        fn = self.load_func(fn_name, sysbpf.BPF_PROG_TYPE_TRACEPOINT)
        return self._attach(sysbpf.tracepoint_event(category, event), fn.fd)

    def attach_uprobes(self, path: str, points: Sequence[Tuple[int, str, bool]], pid: int = -1) -> List[int]:
        """Uprobes on `path`, for every process (pid -1) or one: each point (symbol address st_value,
        function to run, whether a return probe). Returns the fds that hold them: where the kernel has
        uprobe_multi, one link per (function, return or not); else one perf event per point.
        close_events() of those fds detaches them; if one attach fails, the ones made are closed."""
        multi = sysbpf.has_uprobe_multi()
        groups: Dict[Tuple[str, bool], List[int]] = {}
        for addr, fn_name, ret in points:
            groups.setdefault((fn_name, ret), []).append(elfcode.file_offset(path, addr))
        made: List[int] = []
        try:
            for (fn_name, ret), offsets in groups.items():
                fd = self.load_func(fn_name, sysbpf.BPF_PROG_TYPE_KPROBE).fd
                if multi:
                    made.append(self._keep(sysbpf.uprobe_multi(fd, path, offsets, ret, pid)))
                    continue
                for offset in offsets:
                    made.append(self._attach(sysbpf.uprobe_event(path, offset, ret, pid), fd))
        except BaseException:
            self.close_events(made)
            raise
        return made

    def close_events(self, fds: Iterable[int], pool=None) -> None:
        """Detach the events `fds` (of this program), on `pool` (an Executor) when given."""
        with self._lock:
            mine = [fd for fd in fds if fd in self._events]
            for fd in mine:
                self._events.remove(fd)
        if pool is not None:
            list(pool.map(os.close, mine))
        else:
            for fd in mine:
                os.close(fd)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            fds = self._events + [f.fd for f in self.funcs.values()] + [m.map_fd for m in self._maps.values()]
            self._events, self.funcs = [], {}
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
        atexit.unregister(self.close)

    cleanup = close  # bcc's name, which the agent's shutdown paths call
