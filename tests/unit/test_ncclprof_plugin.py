"""libnccl-profiler-ccld.so (ccld/ncclprof/ccld_profiler.c) driven without NCCL or a GPU.

The harness plays NCCL: it loads the built library with ctypes, takes each ncclProfiler_vN table and
calls it with descriptors laid out as NCCL's published headers (plugins/profiler/example/nccl/
profiler_v1.h .. profiler_v5.h) define them -- the ctypes mirrors below, checked field by field against
the layout the C side was compiled with (ccld_np_layout()). What the plugin sends arrives on a real
AF_UNIX datagram socket bound here and is read with ccld.ncclprof.format.decode().

The plugin's state is process-wide (one thread, one queue, env read once), so every scenario runs in
a child process: `python <this file> <scenario> <library> [args]`, which prints one JSON line (handles,
return codes, its own CLOCK_MONOTONIC readings around the calls) for the assertions here. Counts are
exact; times are bracketed by the child's readings, never compared with fixed durations.
"""
import ctypes as C
import errno
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from ccld.ncclprof import build, format as fmt  # noqa: E402

from ncclprof_abi import (  # noqa: E402  (tests/unit is on sys.path: conftest)
    DEFAULT_MASK, DESCR, EV_COLL, EV_GROUP, EV_KERNEL_CH, HASH, ST_KERNEL_CH_STOP,
    ST_OP_SEND_DONE, ST_OP_SEND_POSTED, ST_OP_SEND_TRANSMITTED, ST_RECV_FLUSH_WAIT, ST_RECV_GPU_WAIT, ST_RECV_WAIT,
    ST_SEND_GPU_WAIT, ST_SEND_PEER_WAIT, ST_SEND_WAIT, TABLES, Args1, Args4, Nccl)

pytestmark = pytest.mark.unit

FLUSH_MS = 20  # the children's send interval: many intervals per second keeps the tests short


def mono():
    return time.monotonic_ns()  # CLOCK_MONOTONIC, the plugin's host clock


def sleep_intervals(n):
    time.sleep(n * int(os.environ.get("CCLD_NCCLPROF_FLUSH_MS", FLUSH_MS)) / 1000)


def enqueued(lib, version, seq=1):
    """NCCL up to one enqueued collective: (driver, context, mask, its handle, clock before/after its stop)."""
    n = Nccl(lib, version)
    ctx, mask = n.init()
    h = n.start(ctx, n.coll(seq=seq))
    t0 = mono()
    n.stop(h)
    return n, ctx, mask, h, (t0, mono())


# ---- scenarios (run in the child) ------------------------------------------------------------------


def sc_coll(lib, version):
    """One collective through its whole life: start, enqueued, children (kernel channels v3+, proxy ops
    v1/v2), over. The child's clock brackets every call."""
    n = Nccl(lib, int(version))
    t = {}
    ctx, mask = n.init()
    t["start0"] = mono()
    h = n.start(ctx, n.coll(seq=7))
    t["start1"] = mono()
    t["stop0"] = mono()
    n.stop(h)
    t["stop1"] = mono()
    if n.v >= 3:
        k0 = n.start(ctx, n.kernel_ch(h, 0, ptimer=1000))
        k1 = n.start(ctx, n.kernel_ch(h, 1, ptimer=1100))
        n.kernel_stop(k0, 5000)
        t["end0"] = mono()
        n.kernel_stop(k1, 5200)
        t["end1"] = mono()
    else:
        o0 = n.start(ctx, n.proxy_op(h, 0, 2, True))
        o1 = n.start(ctx, n.proxy_op(h, 1, 0, False))
        n.stop(o0)
        t["end0"] = mono()
        n.stop(o1)
        t["end1"] = mono()
    n.finalize(ctx)
    return {"mask": mask, "t": t, "pid": os.getpid()}


def sc_hang(lib):
    """v5: A enqueued, its kernel never starts; B's kernel starts, never stops; C completes. Longer than
    the enqueue-only grace: kernel events are on, so A and B stay open."""
    n = Nccl(lib, 5)
    ctx, _ = n.init()
    a, b, c = (n.start(ctx, n.coll(seq=s)) for s in (1, 2, 3))
    for h in (a, b, c):
        n.stop(h)
    n.start(ctx, n.kernel_ch(b, 0, ptimer=10))
    kc = n.start(ctx, n.kernel_ch(c, 0, ptimer=20))
    n.kernel_stop(kc, 30)
    sleep_intervals(15)
    n.finalize(ctx)
    return {}


def sc_late_channel(lib):
    """v5: channel 1 of A starts only after channel 0 stopped (NCCL's proxy sees channels one poll at a
    time): still A's. B's channel 1 starts long after B was over: an orphan, counted."""
    n = Nccl(lib, 5)
    ctx, _ = n.init()
    t = {}
    for name, gap in (("a", 0), ("b", 6)):
        h = n.start(ctx, n.coll(seq=1 if name == "a" else 2))
        n.stop(h)
        n.kernel_stop(n.start(ctx, n.kernel_ch(h, 0, ptimer=100)), 200)
        sleep_intervals(gap)
        k1 = n.start(ctx, n.kernel_ch(h, 1, ptimer=300))
        time.sleep(0.002)
        t[name + "0"] = mono()
        n.kernel_stop(k1, 400)
        t[name + "1"] = mono()
    n.finalize(ctx)
    return t


def sc_enqueue_only(lib):
    """v2 (no kernel events): a collective with no child at all ends "enqueue only" after the grace."""
    n, ctx, _, _, (t0, t1) = enqueued(lib, 2)
    sleep_intervals(20)
    n.finalize(ctx)
    return {"stop0": t0, "stop1": t1}


def sc_stale(lib):
    """v5 with a 1 ms interval: an enqueued collective no kernel starts for is given back after 3000."""
    n, ctx, _, _, _ = enqueued(lib, 5)
    time.sleep(3.6)
    n.finalize(ctx)
    return {}


def sc_p2p(lib, version):
    """Sends and receives numbered per (peer, direction): 2 sends to 3, 1 receive from 3, 1 send to 2."""
    n = Nccl(lib, int(version))
    ctx, _ = n.init()
    for func, peer in (("Send", 3), ("Send", 3), ("Recv", 3), ("Send", 2)):
        h = n.start(ctx, n.p2p(func, peer))
        n.stop(h)
        if n.v >= 3:
            k = n.start(ctx, n.kernel_ch(h, 0, ptimer=100))
            n.kernel_stop(k, 200)
        else:
            o = n.start(ctx, n.proxy_op(h, 0, peer, func == "Send"))
            n.stop(o)
    n.finalize(ctx)
    return {}


def sc_p2p_self(lib):
    """v5, rank 1: a send to itself and a receive from itself (NCCL copies locally: no proxy op, no
    kernel channel event for them), then an ordinary send to 2 with its kernel channel."""
    n = Nccl(lib, 5)
    ctx, _ = n.init(rank=1)
    for func, peer in (("Send", 1), ("Recv", 1)):
        n.stop(n.start(ctx, n.p2p(func, peer)))
    h = n.start(ctx, n.p2p("Send", 2))
    n.stop(h)
    n.kernel_stop(n.start(ctx, n.kernel_ch(h, 0, ptimer=100)), 200)
    sleep_intervals(14)  # past the no-child grace (10 intervals): ends come before finalize
    t = mono()
    n.finalize(ctx)
    return {"t": t}


def _steps(n, ctx, op, states, count, first):
    """`count` steps of one proxy op, each through `states` [(state, trans_size or None, sleep_s)]."""
    for i in range(count):
        s = n.start(ctx, n.proxy_step(op, first + i))
        for state, trans, pause in states:
            n.record(s, state, n.step_args(trans) if trans is not None else None)
            time.sleep(pause)
        n.stop(s)


def sc_progress(lib):
    """v5: a collective's send and receive proxy ops on channel 1 with peer 3; three steps each through
    NCCL's step states, then one send step left in flight over several intervals."""
    n, ctx, _, coll, (t0, _) = enqueued(lib, 5)
    send = n.start(ctx, n.proxy_op(coll, 1, 3, True))
    recv = n.start(ctx, n.proxy_op(coll, 1, 3, False))
    _steps(n, ctx, send, [(ST_SEND_GPU_WAIT, 0, 0.010), (ST_SEND_PEER_WAIT, 0, 0.005), (ST_SEND_WAIT, 4096, 0.015)],
           3, 0)
    _steps(n, ctx, recv, [(ST_RECV_WAIT, 0, 0.015), (ST_RECV_FLUSH_WAIT, 8192, 0.005), (ST_RECV_GPU_WAIT, 8192, 0.005)],
           3, 0)
    stuck = n.start(ctx, n.proxy_step(send, 3))
    n.record(stuck, ST_SEND_WAIT, n.step_args(1000))
    sleep_intervals(6)  # flushes see it in flight
    n.stop(stuck)
    n.stop(send)
    n.stop(recv)
    t1 = mono()
    n.finalize(ctx)
    return {"t0": t0, "t1": t1}


def sc_progress_v2(lib):
    """v2: bytes come from the proxy op's running transSize (its step states carry no size)."""
    n, ctx, _, coll, _ = enqueued(lib, 2)
    op = n.start(ctx, n.proxy_op(coll, 0, 1, True))
    for i, total in enumerate((4096, 8192)):
        s = n.start(ctx, n.proxy_step(op, i))
        n.record(op, ST_OP_SEND_POSTED, n.op_args(total - 4096))
        n.record(s, ST_SEND_GPU_WAIT)
        n.record(s, ST_SEND_WAIT)
        n.record(op, ST_OP_SEND_TRANSMITTED, n.op_args(total))
        n.stop(s)
    n.record(op, ST_OP_SEND_DONE, n.op_args(8192))
    n.stop(op)
    n.finalize(ctx)
    return {}


def sc_many(lib, count, stop):
    """v5: `count` collectives started (and stopped if `stop`), no kernel events."""
    n = Nccl(lib, 5)
    ctx, _ = n.init()
    handles = [n.start(ctx, n.coll(seq=i)) for i in range(int(count))]
    if stop == "1":
        for h in handles:
            if h:
                n.stop(h)
    n.finalize(ctx)
    return {"null_handles": sum(1 for h in handles if not h)}


def sc_absent(lib):
    """v5, the endpoint not there yet: what is sent is refused and counted; then (parent binds) bye."""
    n = Nccl(lib, 5)
    ctx, _ = n.init()
    for i in range(5):
        n.stop(n.start(ctx, n.coll(seq=i)))
    sleep_intervals(25)  # the first flush (refused) is due after one
    print("ready", flush=True)
    sys.stdin.readline()
    n.finalize(ctx)
    return {}


def sc_calls_when_off(lib, version):
    """Every call returns ncclSuccess and gives no handle when the plugin is off (and nothing chained)."""
    n = Nccl(lib, int(version))
    ctx, mask = n.init()
    h = n.start(ctx, n.coll(seq=1))
    n.finalize(ctx)
    return {"mask": mask, "handle": h}


def sc_impossible(lib, what):
    """v5: a collective completes; then NCCL makes a call it cannot make; the plugin goes off; later calls
    still return 0 and a handle given before is still taken back."""
    n = Nccl(lib, 5)
    ctx, _ = n.init()
    done = n.start(ctx, n.coll(seq=1))
    n.stop(done)
    k = n.start(ctx, n.kernel_ch(done, 0, 5))
    n.kernel_stop(k, 6)
    open_ = n.start(ctx, n.coll(seq=2))
    if what == "null_descr":
        n.start(ctx, None)
    elif what == "foreign_handle":
        n.stop(0x1234)
    after = n.start(ctx, n.coll(seq=3))
    n.stop(open_)
    sleep_intervals(4)
    n.finalize(ctx)
    return {"after": after}


class ChainEntry(C.Structure):
    _fields_ = [("op", C.c_int), ("state", C.c_int), ("type", C.c_uint64), ("handle", C.c_void_p),
                ("parent", C.c_void_p), ("group", C.c_void_p), ("arg", C.c_uint64), ("ctx", C.c_void_p)]


CHAIN_OPS = {1: "init", 2: "start", 3: "stop", 4: "record", 5: "finalize"}


def chain_log(path):
    lib = C.CDLL(path)  # the same library the plugin dlopened: the same log
    lib.chain_log.restype = C.POINTER(ChainEntry)
    n, log = lib.chain_log_n(), lib.chain_log()
    return [{"op": CHAIN_OPS[e.op], "state": e.state, "type": e.type, "handle": e.handle or 0,
             "parent": e.parent or 0, "group": e.group or 0, "arg": e.arg, "ctx": e.ctx or 0}
            for e in (log[i] for i in range(n))]


def sc_chain(lib, chain_path):
    """v5 with a chained plugin: a group (only the chained plugin follows it), a collective with a kernel
    channel and a proxy op (the chained plugin did not ask for proxy ops)."""
    n = Nccl(lib, 5)
    ctx, mask = n.init(rank=2)
    g = n.start(ctx, n.group())
    coll = n.start(ctx, n.coll(seq=4, group=g))
    n.stop(coll)
    k = n.start(ctx, n.kernel_ch(coll, 3, ptimer=111))
    op = n.start(ctx, n.proxy_op(coll, 3, 1, True))
    n.stop(op)
    n.kernel_stop(k, 222)
    n.stop(g)
    n.finalize(ctx)
    return {"mask": mask, "ours": {"group": g, "coll": coll, "kernel": k, "op": op}, "log": chain_log(chain_path)}


def sc_chain_v1(lib, chain_path):
    n, ctx, mask, _, _ = enqueued(lib, 1)
    n.finalize(ctx)
    return {"mask": mask, "log": chain_log(chain_path) if chain_path != "-" else []}


def sc_two_comms(lib):
    """v5: two communicators; the first one's finalize is not the last; a third comes after the bye and
    the process exits without finalizing it (the library's destructor says bye)."""
    n = Nccl(lib, 5)
    a, _ = n.init(comm_hash=0xA)
    b, _ = n.init(comm_hash=0xB)
    n.finalize(a)
    sleep_intervals(3)
    h = n.start(b, n.coll(seq=1))
    n.stop(h)
    n.kernel_stop(n.start(b, n.kernel_ch(h, 0, 1)), 2)
    n.finalize(b)
    c, _ = n.init(comm_hash=0xC)
    h = n.start(c, n.coll(seq=9))
    n.stop(h)
    return {}


SCENARIOS = {f.__name__[3:]: f for f in (sc_coll, sc_hang, sc_late_channel, sc_enqueue_only, sc_stale, sc_p2p,
                                         sc_progress, sc_progress_v2, sc_many, sc_absent, sc_calls_when_off,
                                         sc_impossible, sc_chain, sc_chain_v1, sc_two_comms, sc_p2p_self)}

# ---- the parent: build, bind, run, receive -----------------------------------------------------------


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    if build.compiler() is None:
        pytest.skip("no C compiler (cc, gcc, clang or $CC): the plugin cannot be built here")
    res = build.build(str(tmp_path_factory.mktemp("ncclprof")))
    if res.path is None:
        pytest.fail(res.reason)  # a compiler that fails on the plugin is a failure, not a skip
    return res.path


CHAIN_SRC = r"""
#include <stdint.h>
#include <stdlib.h>
struct entry { int op, state; uint64_t type; void *handle, *parent, *group; uint64_t arg; void* ctx; };
static struct entry LOG[4096];
static int N, CTXOBJ, NH;
static char HANDLES[4096];
int chain_log_n(void) { return N; }
const struct entry* chain_log(void) { return LOG; }
static void add(int op, int state, uint64_t type, void* h, void* parent, void* group, uint64_t arg, void* ctx) {
  if (N < 4096) { struct entry e = {op, state, type, h, parent, group, arg, ctx}; LOG[N++] = e; }
}
static int mask(void) { const char* s = getenv("CHAIN_MASK"); return s ? (int)strtol(s, 0, 0) : 67; }
static int init5(void** ctx, uint64_t id, int* m, const char* name, int nn, int nr, int r, void* log) {
  *ctx = &CTXOBJ; *m = mask(); add(1, 0, id, 0, 0, 0, (uint64_t)r, *ctx); return 0; }
static int init1(void** ctx, int* m) { *ctx = &CTXOBJ; *m = mask(); add(1, 0, 0, 0, 0, 0, 0, *ctx); return 0; }
static int start5(void* ctx, void** h, void* d) {            /* v5: type u64 @0, parent @8, coll.parentGroup @104 */
  uint64_t type = *(uint64_t*)d;
  *h = &HANDLES[NH++ % 4096];
  add(2, 0, type, *h, *(void**)((char*)d + 8), type == 2 ? *(void**)((char*)d + 104) : 0, 0, ctx); return 0; }
static int start1(void* ctx, void** h, void* d) {            /* v1: type u8 @0, parent @8 */
  *h = &HANDLES[NH++ % 4096]; add(2, 0, *(uint8_t*)d, *h, *(void**)((char*)d + 8), 0, 0, ctx); return 0; }
static int stop(void* h) { add(3, 0, 0, h, 0, 0, 0, 0); return 0; }
static int record(void* h, int st, void* a) { add(4, st, 0, h, 0, 0, a ? *(uint64_t*)a : 0, 0); return 0; }
static int fin(void* ctx) { add(5, 0, 0, 0, 0, 0, 0, ctx); return 0; }
struct t5 { const char* name; int (*init)(void**, uint64_t, int*, const char*, int, int, int, void*);
            int (*start)(void*, void**, void*); int (*stop)(void*); int (*record)(void*, int, void*); int (*fin)(void*); };
struct t1 { const char* name; int (*init)(void**, int*); int (*start)(void*, void**, void*); int (*stop)(void*);
            int (*record)(void*, int, void*); int (*fin)(void*); };
const struct t5 ncclProfiler_v5 = {"chaintest", init5, start5, stop, record, fin};
#ifndef ONLY_V5
const struct t1 ncclProfiler_v1 = {"chaintest", init1, start1, stop, record, fin};
#endif
"""


def build_chain(tmp_path, only_v5=False):
    src = tmp_path / "chain.c"
    src.write_text(CHAIN_SRC)
    out = tmp_path / ("libchain5.so" if only_v5 else "libchain.so")
    subprocess.run([build.compiler() or "cc", "-O1", "-shared", "-fPIC", "-o", str(out), str(src)]
                   + (["-DONLY_V5"] if only_v5 else []), check=True)
    return str(out)


class Run:
    def __init__(self, rc, out, stderr, datagrams):
        self.rc, self.out, self.stderr = rc, out, stderr
        self.batches = [fmt.decode(d) for d in datagrams]

    def records(self, kind):
        parts = [b.records[kind] for b in self.batches]
        return np.concatenate(parts) if parts else np.zeros(0)

    @property
    def ccld_lines(self):
        return [ln for ln in self.stderr.splitlines() if ln.startswith("ccld:")]


def run(plugin, scenario, *args, env=None, bind=True, flush_ms=FLUSH_MS, handshake=False, timeout=60):
    """Run one scenario in a child with the plugin's env; collect every datagram it sends."""
    d = tempfile.mkdtemp(prefix="np-", dir="/tmp")  # short: sun_path holds 108 bytes
    path = os.path.join(d, "sink")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    if bind:
        sock.bind(path)
    e = {k: v for k, v in os.environ.items() if not k.startswith("CCLD_NCCLPROF")}
    e.update({"CCLD_NCCLPROF_ENDPOINT": path, "CCLD_NCCLPROF_FLUSH_MS": str(flush_ms), "RANK": "3"})
    for k, v in (env or {}).items():
        if v is None:
            e.pop(k, None)
        else:
            e[k] = v
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), scenario, plugin, *map(str, args)],
                             env=e, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    got, lines = [], []
    deadline = time.monotonic() + timeout
    try:
        while True:
            watch = [sock] + ([child.stdout] if handshake and not lines else [])
            ready, _, _ = select.select(watch, [], [], 0.05)
            if sock in ready:
                got.append(sock.recv(1 << 17))
                continue
            if child.stdout in ready:  # the child waits for the socket: bind it now
                lines.append(child.stdout.readline())
                sock.bind(path)
                child.stdin.write("go\n")
                child.stdin.flush()
                continue
            if child.poll() is not None:
                break
            if time.monotonic() > deadline:
                child.kill()
                raise AssertionError(f"scenario {scenario} did not end in {timeout} s")
        out, err = child.communicate(timeout=10)
        sock.setblocking(False)
        while True:  # what was sent before the child exited is all queued here by now
            try:
                got.append(sock.recv(1 << 17))
            except OSError:
                break
    finally:
        sock.close()
        shutil.rmtree(d, ignore_errors=True)
    assert child.returncode == 0, f"scenario {scenario} failed ({child.returncode}):\n{err}"
    last = (out.strip().splitlines() or ["{}"])[-1]
    return Run(child.returncode, json.loads(last), err, got)


def only(arr, **match):
    sel = np.ones(len(arr), bool)
    for k, v in match.items():
        sel &= arr[k] == v
    return arr[sel]


# ---- layouts ----------------------------------------------------------------------------------------


def _ctypes_fields(cls, prefix="", base=0, out=None):
    out = {} if out is None else out
    anon = getattr(cls, "_anonymous_", ())
    for name, typ in cls._fields_:
        off = base + getattr(cls, name).offset
        if name in anon:
            _ctypes_fields(typ, prefix, off, out)
            continue
        out[prefix + name] = (off, C.sizeof(typ))
        if isinstance(typ, type) and issubclass(typ, (C.Structure, C.Union)):
            _ctypes_fields(typ, prefix + name + ".", off, out)
    return out


def test_layouts_match_the_compiled_plugin(plugin):
    """Every size and offset the C side was built with equals its mirror here (descriptors, state args)
    and in ccld/ncclprof/format.py (datagram header, records)."""
    class Field(C.Structure):
        _fields_ = [("name", C.c_char_p), ("offset", C.c_uint32), ("size", C.c_uint32)]
    lib = C.CDLL(plugin)
    lib.ccld_np_layout.restype = C.POINTER(Field)
    n = C.c_uint32()
    table = lib.ccld_np_layout(C.byref(n))
    mirrors = {f"v{v}": (C.sizeof(d), _ctypes_fields(d)) for v, d in DESCR.items()}
    mirrors.update({"args_v1": (C.sizeof(Args1), _ctypes_fields(Args1)),
                    "args_v4": (C.sizeof(Args4), _ctypes_fields(Args4))})
    dtypes = {"header": fmt.HEADER_DTYPE, "task": fmt.TASK_DTYPE, "comm": fmt.COMM_DTYPE,
              "progress": fmt.PROGRESS_DTYPE}
    checked = 0
    for i in range(n.value):
        name, off, size = table[i].name.decode(), table[i].offset, table[i].size
        top, _, rest = name.partition(".")
        if top in dtypes:
            dt = dtypes[top]
            mine = (0, dt.itemsize) if not rest else (dt.fields[rest][1], dt.fields[rest][0].itemsize)
        else:
            total, fields = mirrors[top]
            mine = (0, total) if not rest else fields[rest]
        assert mine == (off, size), f"{name}: the C side has offset {off} size {size}, the mirror {mine}"
        checked += 1
    assert checked > 80  # the table is not empty or cut short


def test_exports_every_version_named_ccld(plugin):
    lib = C.CDLL(plugin)
    for v in range(1, 6):
        assert TABLES[v].in_dll(lib, f"ncclProfiler_v{v}").name == b"ccld"
    assert not build.stale(plugin)


# ---- what arrives -------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [1, 2, 3, 4, 5])
def test_collective_start_first_kernel_end(plugin, version):
    r = run(plugin, "coll", version)
    t = r.out["t"]
    assert r.out["mask"] == DEFAULT_MASK[version]
    assert r.ccld_lines == []
    b0 = r.batches[0]
    assert (b0.api_version, b0.pid, b0.rank, b0.state) == (version, r.out["pid"], 3, "on")
    assert [b.number for b in r.batches] == list(range(1, len(r.batches) + 1))
    assert [b.state for b in r.batches][-1] == "bye" and all(b.state == "on" for b in r.batches[:-1])
    assert all(v == 0 for v in r.batches[-1].drops.values())

    comm = r.records("comm")
    assert len(comm) == 1 and comm[0]["comm_hash"] == HASH and comm[0]["rank"] == 1
    if version >= 4:
        assert (comm[0]["nranks"], comm[0]["nnodes"], comm[0]["flags"]) == (4, 2, fmt.F_FROM_INIT)
    else:
        assert (comm[0]["nranks"], comm[0]["nnodes"], comm[0]["flags"]) == (-1, -1, 0)

    start, kernel, end = r.records("coll_start"), r.records("coll_kernel"), r.records("coll_end")
    assert len(start) == 1 and len(end) == 1
    s, e = start[0], end[0]
    assert (s["comm_hash"], s["seq"], s["count"], s["op_name"], s["dtype_name"], s["algo_name"], s["proto_name"],
            s["channels"], s["nwarps"], s["peer"]) == (HASH, 7, 1024, "allreduce", "bfloat16", "RING", "SIMPLE",
                                                       2, 8, -1)
    assert t["start0"] <= s["t_ns"] <= t["start1"]
    assert e["id"] == s["id"] and (e["seq"], e["op_name"], e["comm_hash"]) == (7, "allreduce", HASH)
    assert t["stop0"] <= e["t_enq_ns"] <= t["stop1"]
    assert t["end0"] <= e["t_ns"] <= t["end1"]  # the last child's stop, not the enqueue
    assert e["flags"] & fmt.F_END_CHILDREN
    if version >= 3:
        assert len(kernel) == 1 and kernel[0]["id"] == s["id"] and kernel[0]["channels"] == 0
        assert t["stop1"] <= kernel[0]["t_ns"] <= t["end0"]
        assert e["channels"] == 2 and e["proxy_ops"] == 0
    else:
        assert len(kernel) == 0 and e["channels"] == 0 and e["proxy_ops"] == 2
    if version >= 4:
        assert kernel[0]["gpu_start_ns"] == 1000 and kernel[0]["flags"] == fmt.F_GPU_START
        assert (e["gpu_start_ns"], e["gpu_end_ns"]) == (1000, 5200)
        assert e["flags"] == fmt.F_END_CHILDREN | fmt.F_GPU_START | fmt.F_GPU_END
    else:
        assert e["flags"] == fmt.F_END_CHILDREN and e["gpu_start_ns"] == 0 and e["gpu_end_ns"] == 0


def test_kernel_never_started_vs_started_not_finished(plugin):
    r = run(plugin, "hang")
    start, kernel, end = r.records("coll_start"), r.records("coll_kernel"), r.records("coll_end")
    assert sorted(start["seq"]) == [1, 2, 3]
    assert sorted(kernel["seq"]) == [2, 3]              # A's kernel never started
    assert list(end["seq"]) == [3]                      # B started and never finished; neither ended
    assert kernel[kernel["seq"] == 2][0]["gpu_start_ns"] == 10
    assert r.batches[-1].state == "bye"


def test_a_channel_that_starts_after_another_stopped(plugin):
    r = run(plugin, "late_channel", flush_ms=100)  # a wide quiet interval: a loaded box cannot close A early
    end = r.records("coll_end")
    a, b = end[end["seq"] == 1], end[end["seq"] == 2]
    assert len(a) == 1 and len(b) == 1
    assert (a[0]["channels"], a[0]["gpu_start_ns"], a[0]["gpu_end_ns"]) == (2, 100, 400)
    assert r.out["a0"] <= a[0]["t_ns"] <= r.out["a1"]          # the late channel's stop ends it
    assert (b[0]["channels"], b[0]["gpu_end_ns"]) == (1, 200)  # over before its late channel came
    assert r.batches[-1].drops["orphans"] == 1


def test_no_child_at_all_ends_enqueue_only_v2(plugin):
    r = run(plugin, "enqueue_only")
    end = r.records("coll_end")
    assert len(end) == 1 and end[0]["flags"] == fmt.F_END_ENQUEUE
    assert end[0]["t_ns"] == end[0]["t_enq_ns"] and r.out["stop0"] <= end[0]["t_enq_ns"] <= r.out["stop1"]


def test_stale_collective_is_given_back(plugin):
    r = run(plugin, "stale", flush_ms=1)
    end = r.records("coll_end")
    assert len(end) == 1 and end[0]["flags"] == fmt.F_END_STALE and end[0]["t_ns"] == 0
    assert r.records("coll_kernel").size == 0


@pytest.mark.parametrize("version", [1, 5])
def test_p2p_numbered_per_peer_and_direction(plugin, version):
    r = run(plugin, "p2p", version)
    start, end = r.records("p2p_start"), r.records("p2p_end")
    got = [(int(x["peer"]), str(x["op_name"]), int(x["seq"])) for x in start]
    assert got == [(3, "send", 1), (3, "send", 2), (3, "recv", 1), (2, "send", 1)]
    assert (start["dtype_name"] == "float32").all() and (start["count"] == 256).all()
    assert sorted(end["id"]) == sorted(start["id"]) and (end["flags"] & fmt.F_END_CHILDREN).all()
    assert len(r.records("p2p_kernel")) == (4 if version >= 3 else 0)
    assert len(r.records("coll_start")) == 0


def test_a_send_to_itself_ends_without_waiting_for_a_kernel(plugin):
    # NCCL gives a send/receive to the rank itself no kernel-channel event: waiting for one would keep it
    # open (a blocked send to the collector) until it went stale, and hold a handle meanwhile.
    r = run(plugin, "p2p_self")
    start, end = r.records("p2p_start"), r.records("p2p_end")
    assert [(int(x["peer"]), str(x["op_name"])) for x in start] == [(1, "send"), (1, "recv"), (2, "send")]
    by_id = {int(x["id"]): x for x in end}
    assert sorted(by_id) == sorted(int(x["id"]) for x in start)
    self_ends = [by_id[int(x["id"])] for x in start[:2]]
    assert all(int(e["flags"]) & fmt.F_END_ENQUEUE and not int(e["flags"]) & fmt.F_END_STALE for e in self_ends)
    assert all(0 < int(e["t_ns"]) <= r.out["t"] for e in self_ends)  # ended before finalize, at its launch
    assert int(by_id[int(start[2]["id"])]["flags"]) & fmt.F_END_CHILDREN


def test_link_progress_bytes_steps_and_wait_split(plugin):
    r = run(plugin, "progress")
    prog = r.records("progress")
    assert set(zip(prog["comm_hash"], prog["peer"], prog["channel"])) == {(HASH, 3, 1)}
    ms = 1_000_000
    for send in (True, False):
        p = prog[prog["send"] == send]
        assert (p["flags"] == (fmt.F_SEND if send else 0)).all()
        assert p["proxy_ops"].sum() == 1
        assert p["steps"].sum() == (4 if send else 3)
        assert p["nbytes"].sum() == (3 * 4096 + 1000 if send else 3 * 8192)
        net, gpu = int(p["net_wait_ns"].sum()), int(p["gpu_wait_ns"].sum())
        if send:   # peer wait 5 + send wait 15 per step (+ the stuck step's send wait); GPU wait 10
            assert net >= 3 * 20 * ms + 3 * FLUSH_MS * ms and gpu >= 3 * 10 * ms
        else:      # recv wait 15; flush 5 + GPU wait 5
            assert net >= 3 * 15 * ms and gpu >= 3 * 10 * ms
        assert net + gpu <= r.out["t1"] - r.out["t0"]
        assert (p["last_ns"] >= r.out["t0"]).all() and (p["last_ns"] <= r.out["t1"]).all()
        assert p["in_flight"][-1] == 0
    assert (prog[prog["send"]]["in_flight"] == 1).any()  # the stuck step, seen while it was stuck
    ids = prog[prog["send"]]["id"]
    assert (np.diff(ids) > 0).all()  # one record per link per interval


def test_link_progress_v2_bytes_from_the_op(plugin):
    r = run(plugin, "progress_v2")
    p = r.records("progress")
    assert p["nbytes"].sum() == 8192 and p["steps"].sum() == 2 and p["send"].all()
    assert p["net_wait_ns"].sum() > 0 and p["gpu_wait_ns"].sum() > 0


# ---- losses --------------------------------------------------------------------------------------------


def test_refused_sends_are_counted_when_the_socket_is_absent(plugin):
    r = run(plugin, "absent", bind=False, handshake=True)
    assert r.batches, "nothing arrived after the socket was bound"
    last = r.batches[-1]
    assert last.state == "bye"
    assert last.drops["drop_sent_records"] == 6          # 1 comm + 5 starts, in what was refused
    assert last.drops["drop_datagrams"] >= 1 and last.number == last.drops["drop_datagrams"] + len(r.batches)
    assert last.last_errno in (errno.ENOENT, errno.ECONNREFUSED)
    assert r.records("coll_start").size == 0


def test_queue_overflow_is_counted(plugin):
    r = run(plugin, "many", 20, 1, env={"CCLD_NCCLPROF_QUEUE": "16"}, flush_ms=60000)
    assert len(r.records("coll_start")) + len(r.records("comm")) == 16
    assert r.batches[-1].drops["drop_queue"] == 21 - 16
    assert r.batches[-1].state == "bye"


def test_handle_pool_exhaustion_is_counted(plugin):
    r = run(plugin, "many", 20, 0, env={"CCLD_NCCLPROF_HANDLES": "16"})
    assert r.out["null_handles"] == 4
    assert len(r.records("coll_start")) == 16
    assert r.batches[-1].drops["drop_handles"] == 4


# ---- off: one line, every call ncclSuccess -------------------------------------------------------------


@pytest.mark.parametrize("env,why,datagram", [
    ({"CCLD_NCCLPROF_FLUSH_MS": "abc"}, "CCLD_NCCLPROF_FLUSH_MS='abc' is not a number in 1..60000", True),
    ({"CCLD_NCCLPROF_QUEUE": "100"}, "CCLD_NCCLPROF_QUEUE=100 is not a power of 2", True),
    ({"CCLD_NCCLPROF_ENDPOINT": None}, "CCLD_NCCLPROF_ENDPOINT is not set", False),
    ({"CCLD_NCCLPROF_FAULT": "alloc"}, "cannot allocate its buffers", True),
    ({"CCLD_NCCLPROF_FAULT": "thread"}, "cannot start its sending thread: Resource temporarily unavailable", True),
])
def test_off_with_one_line(plugin, env, why, datagram):
    r = run(plugin, "calls_when_off", 5, env=env)
    assert r.ccld_lines == [f"ccld: NCCL profiler plugin off: {why}"]
    assert (r.out["mask"], r.out["handle"]) == (0, None)
    if datagram:
        assert [(b.state, b.text, sum(len(a) for a in b.records.values())) for b in r.batches] == [("off", why, 0)]
    else:
        assert r.batches == []


@pytest.mark.parametrize("what,why", [
    ("null_descr", "startEvent got a NULL pointer"),
    ("foreign_handle", "stopEvent got a handle ccld never gave"),
])
def test_off_mid_run_on_an_impossible_call(plugin, what, why):
    r = run(plugin, "impossible", what)
    assert r.ccld_lines == [f"ccld: NCCL profiler plugin off: {why}"]
    assert r.out["after"] is None
    states = [b.state for b in r.batches]
    assert states[-1] == "off" and "bye" not in states and states.count("off") == 1
    assert r.batches[-1].text == why
    assert sorted(r.records("coll_start")["seq"]) == [1, 2]   # nothing after it went off
    assert list(r.records("coll_end")["seq"]) == [1]


# ---- chaining --------------------------------------------------------------------------------------------


def test_chained_plugin_gets_every_call_with_its_own_handles(plugin, tmp_path):
    chain = build_chain(tmp_path)
    r = run(plugin, "chain", chain, env={"CCLD_NCCLPROF_CHAIN": chain})
    assert r.ccld_lines == []
    assert r.out["mask"] == DEFAULT_MASK[5] | 67
    log, ours = r.out["log"], r.out["ours"]
    init = [x for x in log if x["op"] == "init"]
    assert len(init) == 1 and init[0]["type"] == HASH and init[0]["arg"] == 2  # same commId, rank
    starts = {x["type"]: x for x in log if x["op"] == "start"}
    assert set(starts) == {EV_GROUP, EV_COLL, EV_KERNEL_CH}  # no proxy op: it did not ask for them
    grp, coll, kch = starts[EV_GROUP], starts[EV_COLL], starts[EV_KERNEL_CH]
    assert ours["group"] == grp["handle"]                    # not followed by ccld: its handle as it is
    assert ours["coll"] != coll["handle"] and ours["kernel"] != kch["handle"]  # ours, wrapping its own
    assert coll["group"] == grp["handle"]                    # parentGroup translated to its handle
    assert kch["parent"] == coll["handle"]                   # parent translated to its handle
    stops = [x["handle"] for x in log if x["op"] == "stop"]
    assert sorted(stops) == sorted([coll["handle"], kch["handle"], grp["handle"]])
    rec = [x for x in log if x["op"] == "record"]
    assert [(x["handle"], x["state"], x["arg"]) for x in rec] == [(kch["handle"], ST_KERNEL_CH_STOP, 222)]
    fin = [x for x in log if x["op"] == "finalize"]
    assert len(fin) == 1 and fin[0]["ctx"] == init[0]["ctx"]
    end = r.records("coll_end")
    assert len(end) == 1 and end[0]["seq"] == 4 and end[0]["gpu_end_ns"] == 222 and end[0]["proxy_ops"] == 1


def test_chained_plugin_that_does_not_load(plugin):
    r = run(plugin, "chain_v1", "-", env={"CCLD_NCCLPROF_CHAIN": "/nonexistent/libnope.so"})
    assert len(r.ccld_lines) == 1
    assert r.ccld_lines[0].startswith("ccld: NCCL profiler plugin: chained plugin /nonexistent/libnope.so not loaded")
    assert r.out["mask"] == DEFAULT_MASK[1]
    assert len(r.records("coll_start")) == 1 and r.batches[-1].state == "bye"


def test_chained_plugin_without_the_version_nccl_picked(plugin, tmp_path):
    chain = build_chain(tmp_path, only_v5=True)
    r = run(plugin, "chain_v1", chain, env={"CCLD_NCCLPROF_CHAIN": chain})
    assert r.ccld_lines == [f"ccld: NCCL profiler plugin: chained plugin {chain} not used (it has no ncclProfiler "
                            "table of the version NCCL picked); ccld's goes on"]
    assert r.out["log"] == [] and r.out["mask"] == DEFAULT_MASK[1]


def test_chain_only_when_ccld_is_off(plugin, tmp_path):
    chain = build_chain(tmp_path)
    r = run(plugin, "chain_v1", chain, env={"CCLD_NCCLPROF_CHAIN": chain, "CCLD_NCCLPROF_ENDPOINT": None,
                                            "CHAIN_MASK": "2"})
    assert r.ccld_lines == ["ccld: NCCL profiler plugin off: CCLD_NCCLPROF_ENDPOINT is not set"]
    assert r.out["mask"] == 2
    ops = [x["op"] for x in r.out["log"]]
    assert ops == ["init", "start", "stop", "finalize"]
    assert r.batches == []


# ---- lifecycle and mask ------------------------------------------------------------------------------------


def test_bye_after_the_last_communicator_and_again_at_exit(plugin):
    r = run(plugin, "two_comms")
    states = [b.state for b in r.batches]
    assert states.count("bye") == 2 and states[-1] == "bye"
    first_bye = states.index("bye")
    before, after = r.batches[:first_bye + 1], r.batches[first_bye + 1:]
    seq_before = np.concatenate([b.records["coll_end"]["seq"] for b in before])
    assert list(seq_before) == [1]  # comm B's collective, after comm A's finalize: the thread went on
    assert sorted(np.concatenate([b.records["comm"]["comm_hash"] for b in before])) == [0xA, 0xB]
    assert list(np.concatenate([b.records["coll_start"]["seq"] for b in after])) == [9]
    assert [b.number for b in r.batches] == list(range(1, len(r.batches) + 1))


@pytest.mark.parametrize("mask,expect", [("0x2", 0x2), ("0xffff", DEFAULT_MASK[5]), ("6", 6)])
def test_mask_narrows_the_default(plugin, mask, expect):
    r = run(plugin, "calls_when_off", 5, env={"CCLD_NCCLPROF_MASK": mask})
    assert r.out["mask"] == expect and r.ccld_lines == []


# ---- the format, on its own -----------------------------------------------------------------------------


def _task_records(**fields):
    a = np.zeros(1, fmt.TASK_DTYPE)
    for k, v in fields.items():
        a[k] = v
    return a


def test_decode_names_and_tolerates_what_it_does_not_know():
    recs = np.concatenate([_task_records(kind=fmt.KIND_COLL_START, op=5, dtype=10, algo=2, proto=3, seq=9),
                           _task_records(kind=99), _task_records(kind=fmt.KIND_P2P_START, op=40, dtype=200)])
    b = fmt.decode(fmt.encode({"api_version": 5, "number": 7}, recs, text="hi"))
    s = b["coll_start"][0]
    assert (s["op_name"], s["dtype_name"], s["algo_name"], s["proto_name"], s["seq"]) == \
        ("allreduce", "bfloat16", "RING", "SIMPLE", 9)
    p = b["p2p_start"][0]
    assert (p["op_name"], p["dtype_name"]) == ("", "")
    assert b.unknown == 1 and b.text == "hi" and b.number == 7 and b.state == "on"
    assert set(b.records) == set(fmt.KINDS.values())
    # a newer minor: a longer header and longer records are read by their known prefix
    raw = fmt.encode({}, recs[:1])
    hdr = np.frombuffer(raw[:fmt.HEADER_SIZE], fmt.HEADER_DTYPE).copy()
    hdr["header_size"], hdr["record_size"] = fmt.HEADER_SIZE + 8, fmt.RECORD_SIZE + 16
    longer = hdr.tobytes() + bytes(8) + recs[:1].tobytes() + bytes(16)
    assert fmt.decode(longer)["coll_start"][0]["seq"] == 9


@pytest.mark.parametrize("mutate,reason", [
    (lambda raw: b"XXXX" + raw[4:], "magic"),
    (lambda raw: raw[:4] + (2).to_bytes(2, "little") + raw[6:], "version"),
    (lambda raw: raw[:50], "truncated"),
    (lambda raw: raw[:-1], "truncated"),
    (lambda raw: raw[:3], "truncated"),
    (lambda raw: raw[:8] + (64).to_bytes(2, "little") + raw[10:], "size"),
])
def test_decode_rejects_what_is_not_a_datagram(mutate, reason):
    raw = fmt.encode({}, _task_records(kind=fmt.KIND_COLL_START))
    with pytest.raises(ValueError) as e:
        fmt.decode(mutate(raw))
    assert e.value.reason == reason and "NCCL profiler datagram" in str(e.value)


if __name__ == "__main__":  # a scenario's child
    _lib = C.CDLL(sys.argv[2])
    print(json.dumps(SCENARIOS[sys.argv[1]](_lib, *sys.argv[3:]) or {}), flush=True)
