"""A cache of compiled BPF programs, so a start does not pay bcc's compile (~1 s a family) again.

bcc compiles a family's C text with its embedded clang each time a BPF() object is made; the maps
it creates and the bytecode it makes depend only on the text, the -D cflags, the kernel (its
headers and tracepoint formats) and bcc itself. After a compile, `save()` keeps what loading needs:
each map's definition (type, key/value sizes, entries, flags, and bcc's description of its key and
value types), and each function's instructions, with the places where an instruction names a map
(a 64-bit immediate load of the map's fd, BPF_PSEUDO_MAP_FD). `CachedBPF` is a bcc.BPF made from
that without clang: it creates the maps, patches each function's map fds, and loads functions as
bcc would when they are first attached; the rest of bcc's API (tables, uprobes, tracepoints,
cleanup) is bcc's own.

Keyed by a SHA-256 of everything the output depends on (source files, cflags, kernel release and
version, bcc's version, this file's format); one JSON file per key. The directory and each file
must belong to this user and be writable by no one else (a program from the cache runs in the
kernel), else the cache is not used. A file that does not load (a changed kernel the key missed,
a damaged file) is removed and the program compiled again.
Minimum kernel: what bcc needs; nothing more.
"""
from __future__ import annotations

import atexit
import base64
import ctypes as ct
import hashlib
import json
import logging
import os
import stat
import struct
import tempfile
from typing import Any, Dict, List, Optional, Sequence

log = logging.getLogger("ccld.bpf")

BPF_DIR = os.path.dirname(os.path.abspath(__file__))
FORMAT = 1
ENV_DIR = "CCLD_BPF_CACHE"           # a directory, or "off"
INSN = 8                             # bytes per BPF instruction
LD_IMM64 = 0x18                      # BPF_LD | BPF_IMM | BPF_DW: two instruction slots
PSEUDO_MAP_FD = 1                    # src_reg of an ld_imm64 whose immediate is a map fd
MAX_FILE_BYTES = 16 << 20            # a cache file is tens of KiB; refuse anything absurd
LOG_BUF_BYTES = 1 << 16


# Each family's program (its loader is ccld/bpf/<name>.py), and the cflags the cache keys it by
# beyond -I: net's struct offsets are read off the running kernel's BTF, which the key already names,
# so the cache names them instead of reading them (a cached start parses no BTF).
NET_BTF = "-D<struct sock offsets from this kernel's BTF>"
PROGRAMS = {"gloo": ("gloo.bpf.c", ()), "nccl": ("nccl.bpf.c", ()), "net": ("net.bpf.c", (NET_BTF,)),
            "sched": ("sched.bpf.c", ()), "rdma": ("rdma.bpf.c", ())}
ALSO_READ = ("common.h",)  # files every program includes
PID_MAX_FILE = "/proc/sys/kernel/pid_max"
DEFAULT_PID_MAX = 1 << 22  # the 64-bit kernel's default, when the file cannot be read


def pid_words() -> int:
    """64-bit words of a bitmap over every pid this kernel may hand out (pid_max)."""
    try:
        with open(PID_MAX_FILE) as f:
            pid_max = int(f.read().strip())
    except (OSError, ValueError):
        pid_max = DEFAULT_PID_MAX
    return max(1, -(-pid_max // 64))


def default_cflags(name: str) -> List[str]:
    """The -D cflags a family's program needs from the running system (read each time: cheap):
    the kernel families filter by bitmaps over pids, sized by pid_max."""
    if name in ("sched", "net"):
        return [f"-DCCLD_PID_WORDS={pid_words()}"]
    return []


def bpf_available():
    """None when this process can load BPF programs with bcc, else the problem (EnvironmentProblem)
    and its fix."""
    from ccld.errors import EnvironmentProblem
    try:
        import bcc  # noqa: F401
    except ImportError:
        return EnvironmentProblem("bcc is not importable",
                                  "install it: apt-get install python3-bpfcc (then re-run scripts/setup.sh)")
    if os.geteuid() != 0:
        return EnvironmentProblem("eBPF needs root (or CAP_BPF+CAP_PERFMON)",
                                  "run ccld with sudo, or: setcap cap_bpf,cap_perfmon,cap_sys_ptrace+ep $(which python3)")
    return None


def keyed_cflags(cflags: Sequence[str], kernel: Sequence[str] = ()) -> List[str]:
    """The cflags a program is cached under: -I, the family's own cflags, and names for those read
    off the kernel."""
    return [f"-I{BPF_DIR}"] + list(cflags) + list(kernel)


def program_key(source: str, cflags: Sequence[str], kernel: Sequence[str] = ()) -> str:
    return cache_key([os.path.join(BPF_DIR, source)] + [os.path.join(BPF_DIR, f) for f in ALSO_READ],
                     keyed_cflags(cflags, kernel))


def preload(names: Sequence[str]) -> Dict[str, Any]:
    """The cached programs of the families named (default cflags), loaded into the kernel: name ->
    CachedBPF, for those the cache holds. Needs bcc only (no numpy, no translators): `ccld run` does
    this before it starts the command."""
    directory = cache_dir()
    out: Dict[str, Any] = {}
    for name in names:
        source, kernel = PROGRAMS[name]
        try:
            key = program_key(source, default_cflags(name), kernel)
        except OSError:
            continue
        spec = lookup(directory, key)
        if spec is None:
            continue
        try:
            out[name] = cached_bpf(spec)
        except Exception as e:
            log.warning("%s: cached program did not load (%s); it will be compiled", name, e)
            forget(directory, key)
    return out


def cache_dir() -> Optional[str]:
    d = os.environ.get(ENV_DIR, "").strip()
    if d == "off":
        return None
    if d:
        return d
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ccld", "bpf")


def cache_key(sources: Sequence[str], cflags: Sequence[str]) -> str:
    import bcc
    h = hashlib.sha256()
    h.update(f"ccld-progcache {FORMAT}\0".encode())
    for path in sources:
        with open(path, "rb") as f:
            h.update(os.path.basename(path).encode() + b"\0" + f.read() + b"\0")
    for c in cflags:
        h.update(c.encode() + b"\0")
    u = os.uname()
    h.update(f"{u.release}\0{u.version}\0{u.machine}\0".encode())
    try:
        with open("/proc/version", "rb") as f:
            h.update(f.read())
    except OSError:
        pass
    h.update(str(getattr(bcc, "__version__", "?")).encode())
    return h.hexdigest()


def _private(path: str, is_dir: bool) -> bool:
    """Ours and writable by no one else (a file others could write could put code in the kernel)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    kind_ok = stat.S_ISDIR(st.st_mode) if is_dir else stat.S_ISREG(st.st_mode)
    return kind_ok and st.st_uid == os.geteuid() and not (st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def _lib():
    from bcc.libbcc import lib
    for name, res, args in (("bpf_num_tables", ct.c_ulonglong, [ct.c_void_p]),
                            ("bpf_table_name", ct.c_char_p, [ct.c_void_p, ct.c_ulonglong]),
                            ("bpf_table_key_size_id", ct.c_size_t, [ct.c_void_p, ct.c_ulonglong]),
                            ("bpf_table_leaf_size_id", ct.c_size_t, [ct.c_void_p, ct.c_ulonglong]),
                            ("bcc_create_map", ct.c_int, [ct.c_int, ct.c_char_p, ct.c_int, ct.c_int, ct.c_int,
                                                          ct.c_int]),
                            ("bcc_prog_load", ct.c_int, [ct.c_int, ct.c_char_p, ct.c_void_p, ct.c_int, ct.c_char_p,
                                                         ct.c_uint, ct.c_int, ct.c_char_p, ct.c_uint])):
        f = getattr(lib, name)
        f.restype, f.argtypes = res, args
    return lib


def describe(bpf) -> Dict[str, Any]:
    """What CachedBPF needs to make `bpf` (a freshly compiled bcc.BPF) again."""
    lib = _lib()
    m = bpf.module
    tables, by_fd = [], {}
    for i in range(lib.bpf_num_tables(m)):
        name = lib.bpf_table_name(m, i)
        tid = lib.bpf_table_id(m, name)
        fd = lib.bpf_table_fd(m, name)
        by_fd[fd] = name.decode()
        tables.append({"name": name.decode(), "type": lib.bpf_table_type_id(m, tid),
                       "key_size": lib.bpf_table_key_size_id(m, tid), "leaf_size": lib.bpf_table_leaf_size_id(m, tid),
                       "max_entries": lib.bpf_table_max_entries_id(m, tid), "flags": lib.bpf_table_flags_id(m, tid),
                       "key_desc": (lib.bpf_table_key_desc(m, name) or b"").decode(),
                       "leaf_desc": (lib.bpf_table_leaf_desc(m, name) or b"").decode()})
    funcs = []
    for i in range(lib.bpf_num_functions(m)):
        name = lib.bpf_function_name(m, i)
        code = ct.string_at(lib.bpf_function_start(m, name), lib.bpf_function_size(m, name))
        relocs = []
        for k in range(0, len(code) // INSN - 1):
            op, regs, _off, imm = struct.unpack_from("<BBhi", code, k * INSN)
            if op == LD_IMM64 and (regs >> 4) == PSEUDO_MAP_FD:
                if imm not in by_fd:
                    raise ValueError(f"{name.decode()}: instruction {k} names fd {imm}, which is no map of the module")
                relocs.append([k, by_fd[imm]])
        funcs.append({"name": name.decode(), "code": base64.b64encode(code).decode(), "relocs": relocs})
    return {"format": FORMAT, "license": (lib.bpf_module_license(m) or b"GPL").decode(),
            "kern_version": lib.bpf_module_kern_version(m), "tables": tables, "functions": funcs}


def describe_cached(bpf) -> Dict[str, Any]:
    """describe() of a CachedBPF: the spec it was made from, with its maps' fds in the functions."""
    spec = dict(bpf._spec)
    funcs = []
    for f in spec["functions"]:
        funcs.append(dict(f, code=base64.b64encode(bpf._code[f["name"].encode()]).decode()))
    spec["functions"] = funcs
    return spec


def save(directory: str, key: str, spec: Dict[str, Any]) -> None:
    """Keep `spec` under `key` (atomically; a failure is only logged: the cache is an optimisation)."""
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        if not _private(directory, True):
            log.warning("BPF cache %s is not private to this user: not used", directory)
            return
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")  # mode 0600
        with os.fdopen(fd, "w") as f:
            json.dump(spec, f)
        os.replace(tmp, os.path.join(directory, key + ".json"))
    except OSError as e:
        log.warning("cannot write the BPF cache in %s: %s", directory, e)


def lookup(directory: Optional[str], key: str) -> Optional[Dict[str, Any]]:
    if directory is None or not _private(directory, True):
        return None
    path = os.path.join(directory, key + ".json")
    if not _private(path, False):
        return None
    try:
        if os.path.getsize(path) > MAX_FILE_BYTES:
            raise ValueError("too large")
        with open(path) as f:
            spec = json.load(f)
        if spec.get("format") != FORMAT:
            raise ValueError(f"format {spec.get('format')}")
        return spec
    except (OSError, ValueError) as e:
        log.warning("BPF cache file %s unreadable (%s): compiling again", path, e)
        forget(directory, key)
        return None


def forget(directory: Optional[str], key: str) -> None:
    if directory is None:
        return
    try:
        os.unlink(os.path.join(directory, key + ".json"))
    except OSError:
        pass


def _make_cached_class():
    from bcc import BPF
    from bcc import table as bt

    classes = {bt.BPF_MAP_TYPE_HASH: bt.HashTable, bt.BPF_MAP_TYPE_ARRAY: bt.Array,
               bt.BPF_MAP_TYPE_PERCPU_HASH: bt.PerCpuHash, bt.BPF_MAP_TYPE_PERCPU_ARRAY: bt.PerCpuArray,
               bt.BPF_MAP_TYPE_LRU_HASH: bt.LruHash, bt.BPF_MAP_TYPE_RINGBUF: bt.RingBuf}

    class CachedBPF(BPF):
        """A bcc.BPF made from describe()'s output, without compiling (see the module's text)."""

        def __init__(self, spec: Dict[str, Any]):  # noqa: D401 (bcc's __init__ is not called: it compiles)
            self.kprobe_fds, self.uprobe_fds, self.tracepoint_fds, self.raw_tracepoint_fds = {}, {}, {}, {}
            self.kfunc_entry_fds, self.kfunc_exit_fds, self.lsm_fds = {}, {}, {}
            self.perf_buffers, self.open_perf_events = {}, {}
            self._ringbuf_manager = None
            self.tracefile = None
            self.debug = 0
            self.funcs, self.tables = {}, {}
            self.module = None
            self._spec = spec
            self._maps: Dict[str, Dict[str, Any]] = {}
            self._map_fds: List[int] = []
            atexit.register(self.cleanup)
            lib = _lib()
            try:
                for i, t in enumerate(spec["tables"]):
                    fd = lib.bcc_create_map(t["type"], t["name"][:15].encode(), t["key_size"], t["leaf_size"],
                                            t["max_entries"], t["flags"])
                    if fd < 0:
                        raise OSError(ct.get_errno(), f"cannot create map {t['name']}: {os.strerror(ct.get_errno())}")
                    self._map_fds.append(fd)
                    self._maps[t["name"]] = dict(t, fd=fd, id=i)
                self._code = {}
                for f in spec["functions"]:
                    code = bytearray(base64.b64decode(f["code"]))
                    for k, table in f["relocs"]:
                        struct.pack_into("<i", code, k * INSN + 4, self._maps[table]["fd"])
                    self._code[f["name"].encode()] = bytes(code)
                self._trace_autoload()
            except BaseException:
                self.cleanup()
                raise

        def _trace_autoload(self):
            for name in self._code:
                if name.startswith(b"tracepoint__"):
                    tp = name[len(b"tracepoint__"):].replace(b"__", b":")
                    self.attach_tracepoint(tp=tp, fn_name=name)

        def load_func(self, func_name, prog_type, device=None, attach_type=-1):
            func_name = func_name if isinstance(func_name, bytes) else func_name.encode()
            if func_name in self.funcs:
                return self.funcs[func_name]
            code = self._code.get(func_name)
            if code is None:
                raise Exception(f"Unknown program {func_name.decode()}")
            buf = ct.create_string_buffer(code, len(code))
            logbuf = ct.create_string_buffer(LOG_BUF_BYTES)
            fd = _lib().bcc_prog_load(prog_type, func_name[:15], buf, len(code), self._spec["license"].encode(),
                                      self._spec["kern_version"], 1, logbuf, LOG_BUF_BYTES)
            if fd < 0:
                err = os.strerror(ct.get_errno())
                raise Exception(f"Failed to load BPF program {func_name.decode()}: {err}\n"
                                f"{logbuf.value.decode(errors='replace')[-2000:]}")
            fn = BPF.Function(self, func_name, fd)
            self.funcs[func_name] = fn
            return fn

        def get_table(self, name, keytype=None, leaftype=None, reducer=None):
            name = name if isinstance(name, str) else name.decode()
            t = self._maps.get(name)
            if t is None:
                raise KeyError(name)
            cls = classes.get(t["type"])
            if cls is None:
                raise Exception(f"map type {t['type']} of {name} is not one the cache knows")
            key = keytype or (BPF._decode_table_type(json.loads(t["key_desc"])) if t["key_desc"] else ct.c_int)
            leaf = leaftype or (BPF._decode_table_type(json.loads(t["leaf_desc"])) if t["leaf_desc"] else ct.c_int)
            tab = cls.__new__(cls)
            # what bt.TableBase.__init__ sets, from the description instead of a compiled module
            tab.bpf, tab.map_id, tab.map_fd, tab.Key, tab.Leaf = self, t["id"], t["fd"], key, leaf
            tab.ttype, tab.flags, tab._cbs, tab._name = t["type"], t["flags"], {}, name.encode()
            tab.max_entries = int(t["max_entries"])
            if cls is bt.PerCpuArray or cls is bt.PerCpuHash:
                tab.reducer = reducer
                tab.sLeaf = tab.Leaf
                tab.total_cpu = len(bt.get_possible_cpus())
                tab.alignment = ct.sizeof(tab.sLeaf) % 8
                if tab.alignment == 0:
                    tab.Leaf = tab.sLeaf * tab.total_cpu
                elif tab.sLeaf in (ct.c_uint, ct.c_int):
                    tab.Leaf = (ct.c_uint64 if tab.sLeaf == ct.c_uint else ct.c_int64) * tab.total_cpu
                else:
                    raise IndexError("Leaf must be aligned to 8 bytes")
            if cls is bt.RingBuf:
                tab._ringbuf, tab._event_class = None, None
            return tab

        def close(self):
            for name, fn in list(self.funcs.items()):
                os.close(fn.fd)
                del self.funcs[name]
            for fd in self._map_fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._map_fds = []

    return CachedBPF


_CACHED = None


def cached_bpf(spec: Dict[str, Any]):
    global _CACHED
    if _CACHED is None:
        _CACHED = _make_cached_class()
    return _CACHED(spec)
