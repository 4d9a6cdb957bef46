"""A cache of compiled BPF programs, so a start does not pay bcc's compile (~1 s a family) again.

bcc compiles a family's C text with its embedded clang each time a BPF() object is made; the maps
it creates and the bytecode it makes depend only on the text, the -D cflags, the kernel (its
headers and tracepoint formats) and bcc itself. After a compile, `save()` keeps what loading needs:
each map's definition (type, key/value sizes, entries, flags, and bcc's description of its key and
value types), and each function's instructions, with the places where an instruction names a map
(a 64-bit immediate load of the map's fd, BPF_PSEUDO_MAP_FD). program.Program loads that without
bcc: it creates the maps, patches each function's map fds and loads functions when they are first
attached. A compile (compile.py) runs bcc in a child process and hands its description back, so the
agent never imports bcc; describe() is what that child runs.

Keyed by a SHA-256 of everything the output depends on (source files, cflags, kernel release and
version, bcc's version and library, read off its files without importing it, this file's format);
one JSON file per key. The directory and each file must belong to this user and be writable by no one else (a program from the cache runs in the
kernel), else the cache is not used. A file that does not load (a changed kernel the key missed,
a damaged file) is removed and the program compiled again.
Minimum kernel: what bcc needs; nothing more.
"""
from __future__ import annotations

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


# Each family's program (its loader is ccld/bpf/<name>.py), and the cflags the cache keys it by
# beyond -I: net's struct offsets are read off the running kernel's BTF, which the key already names,
# so the cache names them instead of reading them (a cached start parses no BTF).
NET_BTF = "-D<struct sock offsets from this kernel's BTF>"
PROGRAMS = {"gloo": ("gloo.bpf.c", ()), "nccl": ("nccl.bpf.c", ()), "pgnccl": ("pgnccl.bpf.c", ()),
            "net": ("net.bpf.c", (NET_BTF,)), "sched": ("sched.bpf.c", ()), "rdma": ("rdma.bpf.c", ())}
ALSO_READ = ("common.h",)  # files every program includes
PID_MAX_FILE = "/proc/sys/kernel/pid_max"
DEFAULT_PID_MAX = 1 << 22  # the 64-bit kernel's default, when the file cannot be read
LIBBCC = "libbcc.so.0"    # what bcc's libbcc.py loads; the dirs the dynamic linker searches for it here
LIBBCC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


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


def bcc_files() -> List[str]:
    """bcc's version file and its C library, found without importing bcc ([] when it is not
    installed): the cache key names them, and a compile needs them."""
    import importlib.util
    spec = importlib.util.find_spec("bcc")  # locates the package; runs none of it
    if spec is None or not spec.submodule_search_locations:
        return []
    files = [os.path.join(list(spec.submodule_search_locations)[0], "version.py")]
    for d in LIBBCC_DIRS:
        if os.path.exists(os.path.join(d, LIBBCC)):
            files.append(os.path.realpath(os.path.join(d, LIBBCC)))
            break
    return files


def bpf_available():
    """None when this process can load BPF programs (and compile those the cache lacks: bcc, in a
    child process), else the problem (EnvironmentProblem) and its fix."""
    from ccld.errors import EnvironmentProblem
    if not bcc_files():
        return EnvironmentProblem("bcc is not installed (it compiles the probe programs)",
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
    program.Program, for those the cache holds. Needs neither bcc nor the translators: `ccld run`
    does this before it starts the command."""
    from ccld.bpf.program import Program
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
            out[name] = Program(spec)
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
    for path in _bcc_identity():
        h.update(path.encode() + b"\0")
    return h.hexdigest()


_BCC_ID: Optional[List[str]] = None


def _bcc_identity() -> List[str]:
    """What tells one bcc from another (once a process): its version file's text, and its C library's
    size and modification time (a rebuilt libbcc with the same version changes the key too)."""
    global _BCC_ID
    if _BCC_ID is None:
        out = []
        for path in bcc_files():
            try:
                if path.endswith(".py"):
                    with open(path) as f:
                        out.append(f.read().strip())
                else:
                    st = os.stat(path)
                    out.append(f"{os.path.basename(path)} {st.st_size} {st.st_mtime_ns}")
            except OSError:
                out.append(f"{path} unreadable")
        _BCC_ID = out
    return _BCC_ID


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
                            ("bpf_table_leaf_size_id", ct.c_size_t, [ct.c_void_p, ct.c_ulonglong])):
        f = getattr(lib, name)
        f.restype, f.argtypes = res, args
    return lib


def describe(bpf) -> Dict[str, Any]:
    """What program.Program needs to make `bpf` (a freshly compiled bcc.BPF) again. Runs in the
    compile's child process (compile.py): it reads bcc's module through libbcc."""
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


def describe_cached(prog) -> Dict[str, Any]:
    """describe() of a program.Program: the spec it was made from, with its maps' fds in the functions."""
    spec = dict(prog._spec)
    funcs = []
    for f in spec["functions"]:
        funcs.append(dict(f, code=base64.b64encode(prog.code(f["name"])).decode()))
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
