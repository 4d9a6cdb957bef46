"""The bpf(2) and perf_event_open(2) system calls through ctypes: what the agent needs to load a
compiled program and attach it, without bcc (whose import alone costs ~64 MiB and ~0.1 s).

Commands: BPF_MAP_CREATE, BPF_PROG_LOAD (the verifier's log is asked for only when a load fails,
then the load is repeated with it), the element commands (lookup, update, delete, next key) and
BPF_MAP_LOOKUP_BATCH (5.6+), BPF_LINK_CREATE. Uprobes: where the kernel has them (6.6+,
`has_uprobe_multi`), one uprobe_multi link holds one program's probes at many offsets of a file, and
closing it removes them all after one wait for the kernel's grace period (44 gloo probes: ~0.02 s,
where closing 44 perf events takes ~4.7 s, each waiting its own); its program must be loaded for it
(expected_attach_type). Elsewhere, perf events as bcc makes them: a uprobe through the uprobe PMU (a
file path and an offset in the file, 4.17+; closing the event's fd removes the probe, nothing is
written to tracefs). A tracepoint: a perf event by its tracefs id. A perf event takes its program
with PERF_EVENT_IOC_SET_BPF and PERF_EVENT_IOC_ENABLE. Every failure is an OSError with the errno and
the object named.
The attr structs below are the leading fields of the kernel's (uapi linux/bpf.h, perf_event.h): the
kernel takes a shorter struct and reads the rest as zeros.
"""
from __future__ import annotations

import ctypes as ct
import errno
import functools
import os
from typing import Optional, Sequence, Tuple

# (bpf, perf_event_open) system call numbers
_NR = {"x86_64": (321, 298), "aarch64": (280, 241)}

BPF_MAP_CREATE, BPF_MAP_LOOKUP_ELEM, BPF_MAP_UPDATE_ELEM, BPF_MAP_DELETE_ELEM = 0, 1, 2, 3
BPF_MAP_GET_NEXT_KEY, BPF_PROG_LOAD, BPF_MAP_LOOKUP_BATCH, BPF_LINK_CREATE = 4, 5, 24, 28
BPF_TRACE_UPROBE_MULTI = 48      # enum bpf_attach_type (6.6+)
BPF_F_UPROBE_MULTI_RETURN = 1    # a uprobe_multi link's return probes
BPF_PROG_TYPE_KPROBE, BPF_PROG_TYPE_TRACEPOINT = 2, 5  # a uprobe's program is a KPROBE program
OBJ_NAME_LEN = 16            # BPF_OBJ_NAME_LEN, with the NUL
LOG_BYTES = 1 << 20          # verifier log of a failed load; its tail goes into the error
PERF_TYPE_TRACEPOINT = 2
PERF_FLAG_FD_CLOEXEC = 1 << 3
PERF_EVENT_IOC_ENABLE = 0x2400        # _IO('$', 0)
PERF_EVENT_IOC_SET_BPF = 0x40042408   # _IOW('$', 8, __u32)
UPROBE_PMU = "/sys/bus/event_source/devices/uprobe"
# The kernel keeps one uprobe per (inode, offset) and refuses (EINVAL, "ref_ctr_offset mismatch" in
# dmesg) a second one whose reference-counter offset differs. bcc 0.26's Python attach_uprobe calls
# the 7-argument bpf_attach_uprobe with 6, so its probes carry whatever the 7th slot held (6 here):
# ours (0, no counter) cannot share an offset with a probe a bcc tool holds at the same time.
REF_CTR_HINT = ("another tracer holds a uprobe at this offset with a different ref_ctr_offset (bcc 0.26's "
                "Python attach_uprobe sets a stray one; dmesg says 'ref_ctr_offset mismatch')")
TRACEFS = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")


class _MapCreate(ct.Structure):
    _fields_ = [("map_type", ct.c_uint32), ("key_size", ct.c_uint32), ("value_size", ct.c_uint32),
                ("max_entries", ct.c_uint32), ("map_flags", ct.c_uint32), ("inner_map_fd", ct.c_uint32),
                ("numa_node", ct.c_uint32), ("map_name", ct.c_char * OBJ_NAME_LEN)]


class _Elem(ct.Structure):
    _fields_ = [("map_fd", ct.c_uint32), ("key", ct.c_uint64), ("value", ct.c_uint64), ("flags", ct.c_uint64)]


class _Batch(ct.Structure):
    _fields_ = [("in_batch", ct.c_uint64), ("out_batch", ct.c_uint64), ("keys", ct.c_uint64),
                ("values", ct.c_uint64), ("count", ct.c_uint32), ("map_fd", ct.c_uint32),
                ("elem_flags", ct.c_uint64), ("flags", ct.c_uint64)]


class _ProgLoad(ct.Structure):
    _fields_ = [("prog_type", ct.c_uint32), ("insn_cnt", ct.c_uint32), ("insns", ct.c_uint64),
                ("license", ct.c_uint64), ("log_level", ct.c_uint32), ("log_size", ct.c_uint32),
                ("log_buf", ct.c_uint64), ("kern_version", ct.c_uint32), ("prog_flags", ct.c_uint32),
                ("prog_name", ct.c_char * OBJ_NAME_LEN), ("prog_ifindex", ct.c_uint32),
                ("expected_attach_type", ct.c_uint32)]


class _UprobeMultiLink(ct.Structure):
    """BPF_LINK_CREATE's attr for a uprobe_multi link (uapi linux/bpf.h, link_create.uprobe_multi)."""
    _fields_ = [("prog_fd", ct.c_uint32), ("target_fd", ct.c_uint32), ("attach_type", ct.c_uint32),
                ("flags", ct.c_uint32), ("path", ct.c_uint64), ("offsets", ct.c_uint64),
                ("ref_ctr_offsets", ct.c_uint64), ("cookies", ct.c_uint64), ("cnt", ct.c_uint32),
                ("multi_flags", ct.c_uint32), ("pid", ct.c_uint32)]


class _PerfAttr(ct.Structure):
    """perf_event_attr up to config2 (PERF_ATTR_SIZE_VER1, 72 bytes)."""
    _fields_ = [("type", ct.c_uint32), ("size", ct.c_uint32), ("config", ct.c_uint64),
                ("sample_period", ct.c_uint64), ("sample_type", ct.c_uint64), ("read_format", ct.c_uint64),
                ("flags", ct.c_uint64), ("wakeup_events", ct.c_uint32), ("bp_type", ct.c_uint32),
                ("config1", ct.c_uint64), ("config2", ct.c_uint64)]


_libc = ct.CDLL(None, use_errno=True)
_libc.syscall.restype = ct.c_long
_libc.ioctl.restype = ct.c_int
_libc.ioctl.argtypes = [ct.c_int, ct.c_ulong, ct.c_ulong]


@functools.lru_cache(maxsize=None)  # a syscall's number: looked up once, not per map read of every drain
def _numbers() -> Tuple[int, int]:
    machine = os.uname().machine
    if machine not in _NR:
        raise OSError(0, f"no bpf(2) system call number known for {machine}")
    return _NR[machine]


def _addr(obj) -> int:
    return ct.addressof(obj) if obj is not None else 0


def _call(cmd: int, attr: ct.Structure) -> Tuple[int, int]:
    """bpf(cmd, &attr, sizeof attr) as (result, 0), or (-1, errno): the drains' expected ENOENT (a
    map's end, no such key) is no exception."""
    res = _libc.syscall(ct.c_long(_numbers()[0]), ct.c_long(cmd), ct.byref(attr), ct.c_ulong(ct.sizeof(attr)))
    return (int(res), 0) if res >= 0 else (-1, ct.get_errno())


def bpf(cmd: int, attr: ct.Structure) -> int:
    """bpf(cmd, &attr, sizeof attr): its result, or an OSError."""
    res, err = _call(cmd, attr)
    if res < 0:
        raise OSError(err, os.strerror(err))
    return res


def map_create(map_type: int, key_size: int, value_size: int, max_entries: int, flags: int, name: str) -> int:
    attr = _MapCreate(map_type, key_size, value_size, max_entries, flags)
    attr.map_name = name.encode()[:OBJ_NAME_LEN - 1]
    try:
        return bpf(BPF_MAP_CREATE, attr)
    except OSError as e:
        raise OSError(e.errno, f"cannot create map {name} (type {map_type}): {e.strerror}") from None


def prog_load(prog_type: int, insns: bytes, license: str, kern_version: int, name: str,
              expected_attach_type: int = 0) -> int:
    """Load one program (insns: its instructions, map fds in place). A refused program is loaded again
    with the verifier's log, whose tail the error carries."""
    code = ct.create_string_buffer(insns, len(insns))
    lic = ct.create_string_buffer(license.encode())
    attr = _ProgLoad(prog_type, len(insns) // 8, ct.addressof(code), ct.addressof(lic))
    attr.kern_version = kern_version
    attr.expected_attach_type = expected_attach_type
    attr.prog_name = name.encode()[:OBJ_NAME_LEN - 1]
    try:
        return bpf(BPF_PROG_LOAD, attr)
    except OSError as first:
        log = ct.create_string_buffer(LOG_BYTES)
        attr.log_level, attr.log_size, attr.log_buf = 1, LOG_BYTES, ct.addressof(log)
        try:
            return bpf(BPF_PROG_LOAD, attr)  # a load that only failed for want of memory may pass now
        except OSError:
            text = log.value.decode(errors="replace")[-2000:]
            raise OSError(first.errno, f"the kernel refused program {name}: {first.strerror}\n{text}") from None


def _found(cmd: int, attr: ct.Structure) -> bool:
    """bpf(cmd): True when done, False when the map has no such key (ENOENT); other errors raise."""
    res, err = _call(cmd, attr)
    if res >= 0 or err == errno.ENOENT:
        return res >= 0
    raise OSError(err, os.strerror(err))


def map_lookup(fd: int, key, value) -> bool:
    """Read `key`'s value into `value` (ctypes objects); False when the map has no such key."""
    return _found(BPF_MAP_LOOKUP_ELEM, _Elem(fd, _addr(key), _addr(value)))


def map_update(fd: int, key, value, flags: int = 0) -> None:
    bpf(BPF_MAP_UPDATE_ELEM, _Elem(fd, _addr(key), _addr(value), flags))


def map_delete(fd: int, key) -> bool:
    """Delete `key`; False when the map had no such key."""
    return _found(BPF_MAP_DELETE_ELEM, _Elem(fd, _addr(key)))


def map_next_key(fd: int, key, next_key) -> bool:
    """The key after `key` (None: the first key) into `next_key`; False past the last."""
    return _found(BPF_MAP_GET_NEXT_KEY, _Elem(fd, _addr(key), _addr(next_key)))


def lookup_batch(fd: int, in_batch, out_batch, keys, values, count: int) -> Tuple[int, int]:
    """BPF_MAP_LOOKUP_BATCH of up to `count` entries from `in_batch` (None: the start):
    (errno, entries read); errno 0 when more may follow, ENOENT when the map's end was reached."""
    attr = _Batch(_addr(in_batch), _addr(out_batch), _addr(keys), _addr(values), count, fd)
    res, err = _call(BPF_MAP_LOOKUP_BATCH, attr)
    if res >= 0:
        return 0, attr.count
    return err, attr.count if err == errno.ENOENT else 0  # ENOENT: the last entries came with it


def _perf_event_open(attr: _PerfAttr, pid: int, cpu: int, what: str) -> int:
    attr.size = ct.sizeof(attr)
    attr.sample_period = attr.wakeup_events = 1
    fd = _libc.syscall(ct.c_long(_numbers()[1]), ct.byref(attr), ct.c_int(pid), ct.c_int(cpu), ct.c_int(-1),
                       ct.c_ulong(PERF_FLAG_FD_CLOEXEC))
    if fd < 0:
        err = ct.get_errno()
        raise OSError(err, f"perf_event_open of {what}: {os.strerror(err)}")
    return int(fd)


def _read_int(path: str) -> int:
    with open(path) as f:
        return int(f.read().strip())


_uprobe_pmu: Optional[Tuple[int, int]] = None


def _uprobe_type() -> Tuple[int, int]:
    """(the uprobe PMU's perf type, the config bit that makes a probe a return probe)."""
    global _uprobe_pmu
    if _uprobe_pmu is None:
        kind = _read_int(f"{UPROBE_PMU}/type")
        with open(f"{UPROBE_PMU}/format/retprobe") as f:
            fmt = f.read().strip()  # "config:0"
        if not fmt.startswith("config:"):
            raise OSError(0, f"{UPROBE_PMU}/format/retprobe says {fmt!r}, not config:BIT")
        _uprobe_pmu = (kind, int(fmt.split(":", 1)[1]))
    return _uprobe_pmu


def uprobe_event(path: str, offset: int, retprobe: bool, pid: int = -1) -> int:
    """A perf event for a uprobe (or uretprobe) at file offset `offset` of `path`; pid -1: every
    process (on CPU 0, as bcc opens it: the probe itself fires on any CPU)."""
    try:
        kind, bit = _uprobe_type()
    except (OSError, ValueError) as e:
        raise OSError(getattr(e, "errno", 0) or 0, f"no uprobe PMU ({UPROBE_PMU}): {e}") from None
    name = ct.create_string_buffer(os.fsencode(path))
    attr = _PerfAttr(type=kind, config=(1 << bit) if retprobe else 0)
    attr.config1, attr.config2 = ct.addressof(name), offset
    try:
        return _perf_event_open(attr, pid, 0 if pid == -1 else -1,
                                f"{'uretprobe' if retprobe else 'uprobe'} {path}+{offset:#x}")
    except OSError as e:
        if e.errno == errno.EINVAL:
            raise OSError(e.errno, f"{e.strerror}; perhaps {REF_CTR_HINT}") from None
        raise


def uprobe_multi(prog_fd: int, path: str, offsets: Sequence[int], retprobe: bool, pid: int = -1) -> int:
    """A uprobe_multi link running `prog_fd` (loaded with expected_attach_type
    BPF_TRACE_UPROBE_MULTI) at each file offset of `path`, in every process (pid -1) or one; closing
    the link's fd removes every probe."""
    name = ct.create_string_buffer(os.fsencode(path))
    offs = (ct.c_uint64 * len(offsets))(*offsets)
    attr = _UprobeMultiLink(prog_fd, 0, BPF_TRACE_UPROBE_MULTI, 0, ct.addressof(name), ct.addressof(offs),
                            0, 0, len(offsets), BPF_F_UPROBE_MULTI_RETURN if retprobe else 0, max(pid, 0))
    try:
        return bpf(BPF_LINK_CREATE, attr)
    except OSError as e:
        hint = f"; perhaps {REF_CTR_HINT}" if e.errno == errno.EINVAL else ""
        raise OSError(e.errno, f"uprobe_multi link of {len(offsets)} {'uretprobe' if retprobe else 'uprobe'}(s) "
                               f"on {path} (first at {offsets[0]:#x}): {e.strerror}{hint}") from None


_multi: Optional[bool] = None
RETURN_ZERO = bytes.fromhex("b700000000000000" "9500000000000000")  # r0 = 0; exit


def has_uprobe_multi() -> bool:
    """Whether this kernel makes uprobe_multi links (asked once): a program loaded for them, linked to
    a probe in "/", fails with EBADF (not a file it can probe) where they exist and EINVAL where the
    attach type is unknown. CCLD_UPROBE_MULTI=0 says no (perf events, as on kernels before 6.6)."""
    global _multi
    if _multi is None:
        if os.environ.get("CCLD_UPROBE_MULTI", "1") == "0":
            _multi = False
            return _multi
        try:
            fd = prog_load(BPF_PROG_TYPE_KPROBE, RETURN_ZERO, "GPL", 0, "ccld_probe_um", BPF_TRACE_UPROBE_MULTI)
        except OSError:
            _multi = False
            return _multi
        try:
            os.close(uprobe_multi(fd, "/", [0], False))
            _multi = False  # "/" probed: not the kernel we know
        except OSError as e:
            _multi = e.errno == errno.EBADF
        finally:
            os.close(fd)
    return _multi


def tracepoint_id(category: str, name: str) -> int:
    for root in TRACEFS:
        path = os.path.join(root, "events", category, name, "id")
        if os.path.exists(path):
            return _read_int(path)
    raise OSError(2, f"tracepoint {category}:{name} not found under {' or '.join(TRACEFS)}")


def tracepoint_event(category: str, name: str) -> int:
    """A perf event for kernel tracepoint category:name, every process (CPU 0, as bcc opens it)."""
    attr = _PerfAttr(type=PERF_TYPE_TRACEPOINT, config=tracepoint_id(category, name))
    return _perf_event_open(attr, -1, 0, f"tracepoint {category}:{name}")


def attach(perf_fd: int, prog_fd: int) -> None:
    """Run program `prog_fd` on perf event `perf_fd`'s hits, and enable the event."""
    for req, arg, what in ((PERF_EVENT_IOC_SET_BPF, prog_fd, "SET_BPF"), (PERF_EVENT_IOC_ENABLE, 0, "ENABLE")):
        if _libc.ioctl(perf_fd, req, arg) != 0:
            err = ct.get_errno()
            raise OSError(err, f"ioctl PERF_EVENT_IOC_{what}: {os.strerror(err)}")
