"""NCCL's profiler plugin ABI as ctypes, declared from its published headers (NVIDIA/nccl ext-profiler
profiler_v1.h .. profiler_v5.h), and `Nccl`: plays NCCL against one ncclProfiler_vN table of a loaded
plugin library (calls, descriptors laid out per version, NCCL's event types and states).

Shared by the plugin's unit harness (tests/unit/test_ncclprof_plugin.py, which checks these mirrors
field by field against the layout the plugin was compiled with) and the fake NCCL job of the e2e test
(tests/workloads/fake_nccl_job.py). Imports nothing of ccld.
"""
import ctypes as C
import os

EV_GROUP, EV_COLL, EV_P2P, EV_PROXY_OP, EV_PROXY_STEP, EV_KERNEL_CH = 1, 2, 4, 8, 16, 64
ST_SEND_GPU_WAIT, ST_SEND_WAIT, ST_RECV_WAIT, ST_RECV_FLUSH_WAIT, ST_RECV_GPU_WAIT = 8, 9, 10, 11, 12
ST_SEND_PEER_WAIT, ST_KERNEL_CH_STOP = 20, 22
ST_OP_SEND_POSTED, ST_OP_SEND_TRANSMITTED, ST_OP_SEND_DONE = 0, 2, 3
DEFAULT_MASK = {1: 0x1E, 2: 0x1E, 3: 0x5E, 4: 0x5E, 5: 0x5E}  # coll, p2p, proxyOp, proxyStep (+ kernelCh v3+)
HASH = 0xC0FFEE0012345678

# ---- NCCL's descriptors, declared from its headers ----------------------------------------------------


def _anon_union(name, members):
    return type(name, (C.Union,), {"_fields_": members})


class ProxyOp(C.Structure):
    _fields_ = [("pid", C.c_int), ("channel", C.c_uint8), ("peer", C.c_int), ("nsteps", C.c_int),
                ("chunk_size", C.c_int), ("is_send", C.c_int)]


class ProxyStep(C.Structure):
    _fields_ = [("step", C.c_int)]


class NetPlugin(C.Structure):
    _fields_ = [("id", C.c_int64), ("data", C.c_void_p)]


class Coll1(C.Structure):
    _fields_ = [("name", C.c_char_p), ("comm_hash", C.c_uint64), ("seq", C.c_uint64), ("func", C.c_uint8),
                ("sendbuf", C.c_void_p), ("recvbuf", C.c_void_p), ("count", C.c_size_t), ("root", C.c_int),
                ("dtype", C.c_uint8), ("redop", C.c_uint32), ("traffic_bytes", C.c_size_t),
                ("max_channels", C.c_uint8), ("nwarps", C.c_uint8), ("algo", C.c_uint8), ("proto", C.c_uint8),
                ("is_collnet", C.c_int), ("is_nvls", C.c_int)]


class P2p1(C.Structure):
    _fields_ = [("name", C.c_char_p), ("comm_hash", C.c_uint64), ("func", C.c_uint8), ("buf", C.c_void_p),
                ("dtype", C.c_uint8), ("count", C.c_size_t), ("peer", C.c_int)]


class Coll2(C.Structure):
    _fields_ = [("name", C.c_char_p), ("comm_hash", C.c_uint64), ("seq", C.c_uint64), ("func", C.c_char_p),
                ("sendbuf", C.c_void_p), ("recvbuf", C.c_void_p), ("count", C.c_size_t), ("root", C.c_int),
                ("dtype", C.c_char_p), ("traffic_bytes", C.c_size_t), ("max_channels", C.c_uint8),
                ("nwarps", C.c_uint8), ("algo", C.c_char_p), ("proto", C.c_char_p)]


class Coll3(C.Structure):  # v2 without trafficBytes
    _fields_ = [f for f in Coll2._fields_ if f[0] != "traffic_bytes"]


class P2p2(C.Structure):  # v2, v3
    _fields_ = [("name", C.c_char_p), ("comm_hash", C.c_uint64), ("func", C.c_char_p), ("buf", C.c_void_p),
                ("dtype", C.c_char_p), ("count", C.c_size_t), ("peer", C.c_int)]


class KernelCh3(C.Structure):
    _fields_ = [("channel", C.c_uint8)]


class Coll4(C.Structure):
    _fields_ = [("seq", C.c_uint64), ("func", C.c_char_p), ("sendbuf", C.c_void_p), ("recvbuf", C.c_void_p),
                ("count", C.c_size_t), ("root", C.c_int), ("dtype", C.c_char_p), ("nchannels", C.c_uint8),
                ("nwarps", C.c_uint8), ("algo", C.c_char_p), ("proto", C.c_char_p)]


class P2p4(C.Structure):
    _fields_ = [("func", C.c_char_p), ("buf", C.c_void_p), ("dtype", C.c_char_p), ("count", C.c_size_t),
                ("peer", C.c_int), ("nchannels", C.c_uint8)]


class KernelCh4(C.Structure):
    _fields_ = [("channel", C.c_uint8), ("ptimer", C.c_uint64)]


class Coll5(C.Structure):
    _fields_ = Coll4._fields_ + [("parent_group", C.c_void_p)]


class P2p5(C.Structure):
    _fields_ = P2p4._fields_ + [("parent_group", C.c_void_p)]


class GroupApi5(C.Structure):
    _fields_ = [("graph_captured", C.c_bool), ("group_depth", C.c_int)]


class CollApi5(C.Structure):
    _fields_ = [("func", C.c_char_p), ("count", C.c_size_t), ("dtype", C.c_char_p), ("root", C.c_int),
                ("stream", C.c_void_p), ("graph_captured", C.c_bool)]


class P2pApi5(C.Structure):
    _fields_ = [("func", C.c_char_p), ("count", C.c_size_t), ("dtype", C.c_char_p), ("stream", C.c_void_p),
                ("graph_captured", C.c_bool)]


class KernelLaunch5(C.Structure):
    _fields_ = [("stream", C.c_void_p)]


def _descr(name, type_ctype, members):
    union = _anon_union(name + "U", members)
    return type(name, (C.Structure,), {"_anonymous_": ("u",), "_fields_": [
        ("type", type_ctype), ("parent", C.c_void_p), ("rank", C.c_int), ("u", union)]})


_PROXY = [("proxy_op", ProxyOp), ("proxy_step", ProxyStep)]
DESCR = {
    1: _descr("Descr1", C.c_uint8, [("coll", Coll1), ("p2p", P2p1)] + _PROXY),
    2: _descr("Descr2", C.c_uint8, [("coll", Coll2), ("p2p", P2p2)] + _PROXY),
    3: _descr("Descr3", C.c_uint8, [("coll", Coll3), ("p2p", P2p2)] + _PROXY +
              [("kernel_ch", KernelCh3), ("net", NetPlugin)]),
    4: _descr("Descr4", C.c_uint8, [("coll", Coll4), ("p2p", P2p4)] + _PROXY +
              [("kernel_ch", KernelCh4), ("net", NetPlugin)]),
    5: _descr("Descr5", C.c_uint64, [("group_api", GroupApi5), ("coll_api", CollApi5), ("p2p_api", P2pApi5),
                                     ("kernel_launch", KernelLaunch5), ("coll", Coll5), ("p2p", P2p5)] + _PROXY +
              [("kernel_ch", KernelCh4), ("net", NetPlugin)]),
}


class _ArgsOp(C.Structure):
    _fields_ = [("trans_size", C.c_size_t), ("steps", C.c_int)]


class _ArgsCtrl(C.Structure):
    _fields_ = [("appended", C.c_int)]


class Args1(C.Union):  # v1..v3
    _fields_ = [("proxy_op", _ArgsOp), ("proxy_ctrl", _ArgsCtrl)]


class Args4(C.Union):  # v4, v5
    _fields_ = [("proxy_step", type("_S", (C.Structure,), {"_fields_": [("trans_size", C.c_size_t)]})),
                ("proxy_ctrl", _ArgsCtrl),
                ("net", type("_N", (C.Structure,), {"_fields_": [("data", C.c_void_p)]})),
                ("kernel_ch", type("_K", (C.Structure,), {"_fields_": [("ptimer", C.c_uint64)]}))]


RES = C.c_int
START = C.CFUNCTYPE(RES, C.c_void_p, C.POINTER(C.c_void_p), C.c_void_p)
STOP = C.CFUNCTYPE(RES, C.c_void_p)
RECORD = C.CFUNCTYPE(RES, C.c_void_p, C.c_int, C.c_void_p)
FINALIZE = C.CFUNCTYPE(RES, C.c_void_p)
INIT1 = C.CFUNCTYPE(RES, C.POINTER(C.c_void_p), C.POINTER(C.c_int))
INIT4 = C.CFUNCTYPE(RES, C.POINTER(C.c_void_p), C.POINTER(C.c_int), C.c_char_p, C.c_uint64, C.c_int, C.c_int,
                    C.c_int, C.c_void_p)
INIT5 = C.CFUNCTYPE(RES, C.POINTER(C.c_void_p), C.c_uint64, C.POINTER(C.c_int), C.c_char_p, C.c_int, C.c_int,
                    C.c_int, C.c_void_p)


def _table(init):
    return type("Table", (C.Structure,), {"_fields_": [
        ("name", C.c_char_p), ("init", init), ("start", START), ("stop", STOP), ("record", RECORD),
        ("finalize", FINALIZE)]})


TABLES = {1: _table(INIT1), 2: _table(INIT1), 3: _table(INIT1), 4: _table(INIT4), 5: _table(INIT5)}
V1_FUNC = {"Broadcast": 0, "Reduce": 1, "AllGather": 2, "ReduceScatter": 3, "AllReduce": 4, "SendRecv": 5,
           "Send": 6, "Recv": 7}
V1_DTYPE = {"ncclInt8": 0, "ncclUint8": 1, "ncclInt32": 2, "ncclUint32": 3, "ncclInt64": 4, "ncclUint64": 5,
            "ncclFloat16": 6, "ncclFloat32": 7, "ncclFloat64": 8, "ncclBfloat16": 9}
V1_ALGO = {"TREE": 0, "RING": 1, "COLLNET_DIRECT": 2, "COLLNET_CHAIN": 3, "NVLS": 4, "NVLS_TREE": 5, "PAT": 6}
V1_PROTO = {"LL": 0, "LL128": 1, "SIMPLE": 2}


class Nccl:
    """Plays NCCL against one ncclProfiler_vN table. Every call must return ncclSuccess (0)."""

    def __init__(self, lib, version):
        self.v = version
        self.t = TABLES[version].in_dll(lib, f"ncclProfiler_v{version}")
        self.keep = []  # descriptors and args alive until the process ends (NCCL's are on its stack)
        self.rank = 1   # the descriptors' originating rank: init's

    def _ok(self, rc, what):
        if rc != 0:
            raise AssertionError(f"{what} returned {rc}, not ncclSuccess")

    def init(self, comm_hash=HASH, nnodes=2, nranks=4, rank=1):
        ctx, mask = C.c_void_p(), C.c_int(-1)
        if self.v <= 3:
            rc = self.t.init(C.byref(ctx), C.byref(mask))
        elif self.v == 4:
            rc = self.t.init(C.byref(ctx), C.byref(mask), b"comm", comm_hash, nnodes, nranks, rank, None)
        else:
            rc = self.t.init(C.byref(ctx), comm_hash, C.byref(mask), b"comm", nnodes, nranks, rank, None)
        self._ok(rc, "init")
        self.rank = rank
        return ctx.value, mask.value

    def start(self, ctx, d):
        h = C.c_void_p()
        self._ok(self.t.start(ctx, C.byref(h), C.cast(C.pointer(d), C.c_void_p) if d is not None else None), "start")
        return h.value

    def stop(self, h):
        self._ok(self.t.stop(h), "stop")

    def record(self, h, state, args=None):
        self._ok(self.t.record(h, state, C.cast(C.pointer(args), C.c_void_p) if args is not None else None), "record")

    def finalize(self, ctx):
        self._ok(self.t.finalize(ctx), "finalize")

    # descriptors as NCCL fills them, per version
    def _d(self, type_, parent, rank=None):
        d = DESCR[self.v]()
        d.type, d.parent, d.rank = type_, parent, self.rank if rank is None else rank
        self.keep.append(d)
        return d

    def coll(self, seq, func="AllReduce", count=1024, dtype="ncclBfloat16", root=-1, nchannels=2, algo="RING",
             proto="SIMPLE", parent=None, group=None, comm_hash=HASH):
        d = self._d(EV_COLL, parent)
        c = d.coll
        c.seq, c.count, c.root, c.nwarps = seq, count, root, 8
        if self.v == 1:
            c.func, c.dtype, c.algo, c.proto = V1_FUNC[func], V1_DTYPE[dtype], V1_ALGO[algo], V1_PROTO[proto]
        else:
            c.func, c.dtype, c.algo, c.proto = func.encode(), dtype.encode(), algo.encode(), proto.encode()
        if self.v <= 3:
            c.comm_hash, c.max_channels, c.name = comm_hash, nchannels, b"comm"
        else:
            c.nchannels = nchannels
        if self.v == 5:
            c.parent_group = group
        return d

    def p2p(self, func, peer, count=256, dtype="ncclFloat32", nchannels=1, parent=None, comm_hash=HASH):
        d = self._d(EV_P2P, parent)
        p = d.p2p
        p.peer, p.count = peer, count
        if self.v == 1:
            p.func, p.dtype = V1_FUNC[func], V1_DTYPE[dtype]
        else:
            p.func, p.dtype = func.encode(), dtype.encode()
        if self.v <= 3:
            p.comm_hash = comm_hash
        else:
            p.nchannels = nchannels
        return d

    def proxy_op(self, parent, channel, peer, send, pid=None):
        d = self._d(EV_PROXY_OP, parent)
        o = d.proxy_op
        o.pid, o.channel, o.peer, o.nsteps, o.chunk_size, o.is_send = (os.getpid() if pid is None else pid), \
            channel, peer, 4, 131072, int(send)
        return d

    def proxy_step(self, parent, step):
        d = self._d(EV_PROXY_STEP, parent)
        d.proxy_step.step = step
        return d

    def kernel_ch(self, parent, channel, ptimer=0):
        d = self._d(EV_KERNEL_CH, parent)
        d.kernel_ch.channel = channel
        if self.v >= 4:
            d.kernel_ch.ptimer = ptimer
        return d

    def group(self):
        return self._d(EV_GROUP, None)

    def step_args(self, trans_size):
        a = Args4()
        a.proxy_step.trans_size = trans_size
        self.keep.append(a)
        return a

    def op_args(self, trans_size):
        a = Args1()
        a.proxy_op.trans_size = trans_size
        self.keep.append(a)
        return a

    def kernel_stop(self, h, ptimer):
        """NCCL's ncclProfilerStopKernelChEvent: the stop timestamp (v4+), then stopEvent."""
        if self.v >= 4:
            a = Args4()
            a.kernel_ch.ptimer = ptimer
            self.keep.append(a)
            self.record(h, ST_KERNEL_CH_STOP, a)
        self.stop(h)
