"""Call NCCL's host API a known number of times with known arguments, without a GPU.

Drives the NCCL probe tests (tests/bpf/test_nccl_probes.py). It loads libnccl.so.2 with ctypes (path
from --lib, else from the nvidia-nccl wheel), prints one `ready {json}` line, waits for --go-file,
then makes the calls in PLAN and prints each return code. Without a GPU every call fails fast with an
error code, which is fine: the uprobes fire at function entry either way.

Why it is safe: collectives and p2p get `comm` = a zeroed buffer. NCCL's first check (CommCheck) sees
startMagic == 0 and returns ncclInvalidArgument before it touches anything else; the NVTX payload
before it reads comm->commHash, which the buffer covers. Destroy/abort get NULL (they return at once
for NULL but would dereference any other pointer). Split's first step is cudaGetDevice, which fails.
Prints `done {json}` with what was called, and exits 0 unless the library could not be loaded.

With --stream N it makes no PLAN calls but collectives FIRST..N-1 of a mixed stream that every rank
shares (stream(), from a fixed seed): collective k at CLOCK_MONOTONIC ns START + k * --period-ms, START
being the number written in the go-file. Ranks started with different --first are what the agent sees
of one job's collectives when it attached to them at different points (tests/bpf/test_nccl_attach_align.py).
"""
import argparse
import ctypes as ct
import json
import os
import sys
import time

UNIQUE_ID = bytes(range(128))            # the ncclUniqueId passed to the init calls
NRANKS, RANK = 4, 1
COMM_BUF_BYTES = 1 << 20                 # zeroed stand-in for a ncclComm; larger than NCCL reads
STREAM_BUF_BYTES = 4096                  # zeroed stand-in for a cudaStream_t, never reached
DATA_BYTES = 4096                        # send/recv buffers: NCCL rejects the comm before using them

# ncclDataType_t / ncclRedOp_t values (nccl.h)
INT8, UINT8, INT32, UINT32, INT64, UINT64, FLOAT16, FLOAT32, FLOAT64, BFLOAT16 = range(10)
SUM, PROD, MAX, MIN, AVG = range(5)

# name -> (repetitions, arguments). Distinct primes, counts, dtypes and ops so a mixed-up field or a
# probe firing for the wrong function shows in the test.
PLAN = {
    "allreduce": (23, dict(count=1001, dtype=FLOAT32, op=MAX)),
    "broadcast": (7, dict(count=1003, dtype=INT64, root=2)),
    "reduce": (11, dict(count=1005, dtype=FLOAT16, op=MIN, root=3)),
    "allgather": (13, dict(count=1007, dtype=BFLOAT16)),
    "reduce_scatter": (17, dict(count=1009, dtype=FLOAT64, op=PROD)),
    "send": (5, dict(count=1011, dtype=INT32, peer=2)),
    "recv": (3, dict(count=1013, dtype=UINT8, peer=3)),
    "group": (19, {}),                     # ncclGroupStart + ncclGroupEnd pairs
    "init_rank": (1, dict(nranks=NRANKS, rank=RANK)),
    "init_rank_config": (2, dict(nranks=NRANKS + 4, rank=RANK + 4)),
    "split": (3, dict(color=5, key=9)),
    "destroy": (2, {}),
    "abort": (1, {}),
    # Only where the library has them (NCCL >= 2.28-ish); the test reads `done` to know.
    "allreduce_config": (2, dict(count=1015, dtype=INT8, op=SUM)),
}


def stream(n: int):
    """n collectives as (function, count, dtype): mixed ops and sizes, the same on every rank."""
    import random
    rng = random.Random(20)
    kinds = [("ncclAllReduce", 1001, FLOAT32), ("ncclAllReduce", 64, FLOAT32), ("ncclBroadcast", 1003, INT64),
             ("ncclAllGather", 1007, BFLOAT16), ("ncclReduceScatter", 1009, FLOAT64)]
    return [rng.choice(kinds) for _ in range(n)]


def find_lib() -> str:
    import nvidia.nccl
    for d in nvidia.nccl.__path__:
        p = os.path.join(d, "lib", "libnccl.so.2")
        if os.path.exists(p):
            return p
    raise FileNotFoundError("libnccl.so.2 not found in the nvidia-nccl package; pass --lib")


class UniqueId(ct.Structure):
    _fields_ = [("internal", ct.c_ubyte * 128)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default="")
    ap.add_argument("--go-file", default="")
    ap.add_argument("--go-timeout-s", type=float, default=120)
    ap.add_argument("--stream", type=int, default=0, help="call collectives FIRST..N-1 of stream() instead of PLAN")
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--period-ms", type=float, default=20.0)
    a = ap.parse_args()

    lib = ct.CDLL(a.lib or find_lib())
    vp, sz, i = ct.c_void_p, ct.c_size_t, ct.c_int
    sig = {
        "ncclAllReduce": [vp, vp, sz, i, i, vp, vp],
        "ncclBroadcast": [vp, vp, sz, i, i, vp, vp],
        "ncclReduce": [vp, vp, sz, i, i, i, vp, vp],
        "ncclAllGather": [vp, vp, sz, i, vp, vp],
        "ncclReduceScatter": [vp, vp, sz, i, i, vp, vp],
        "ncclSend": [vp, sz, i, i, vp, vp],
        "ncclRecv": [vp, sz, i, i, vp, vp],
        "ncclGroupStart": [],
        "ncclGroupEnd": [],
        "ncclCommInitRank": [ct.POINTER(vp), i, UniqueId, i],
        "ncclCommInitRankConfig": [ct.POINTER(vp), i, UniqueId, i, vp],
        "ncclCommSplit": [vp, i, i, ct.POINTER(vp), vp],
        "ncclCommDestroy": [vp],
        "ncclCommAbort": [vp],
        "ncclAllReduceConfig": [vp, vp, sz, i, i, vp, vp, vp],
    }
    fns = {}
    for name, argtypes in sig.items():
        f = getattr(lib, name, None)
        if f is None:
            continue
        f.argtypes, f.restype = argtypes, ct.c_int
        fns[name] = f
    lib.ncclGetErrorString.argtypes, lib.ncclGetErrorString.restype = [ct.c_int], ct.c_char_p
    version = ct.c_int(0)
    lib.ncclGetVersion(ct.byref(version))

    comm_buf = ct.create_string_buffer(COMM_BUF_BYTES)
    stream_buf = ct.create_string_buffer(STREAM_BUF_BYTES)
    send_buf = ct.create_string_buffer(DATA_BYTES)
    recv_buf = ct.create_string_buffer(DATA_BYTES)
    comm, stream_ptr = ct.addressof(comm_buf), ct.addressof(stream_buf)
    sb, rb = ct.addressof(send_buf), ct.addressof(recv_buf)
    uid = UniqueId()
    ct.memmove(uid.internal, UNIQUE_ID, len(UNIQUE_ID))

    print("ready " + json.dumps({"pid": os.getpid(), "version": version.value, "comm": comm,
                                 "stream": stream_ptr, "sendbuff": sb, "recvbuff": rb}), flush=True)
    if a.go_file:
        deadline = time.monotonic() + a.go_timeout_s
        while not os.path.exists(a.go_file):
            if time.monotonic() > deadline:
                print("gave up waiting for the go-file", file=sys.stderr)
                return 2
            time.sleep(0.02)

    if a.stream:
        start_ns = int(open(a.go_file).read().strip() or 0) if a.go_file else time.monotonic_ns()
        for k, (fname, count, dtype) in enumerate(stream(a.stream)):
            if k < a.first:
                continue
            time.sleep(max(0.0, (start_ns + k * a.period_ms * 1e6 - time.monotonic_ns()) / 1e9))
            args = (sb, rb, count, dtype) + ((0,) if fname == "ncclBroadcast" else ()) \
                + ((SUM,) if fname in ("ncclAllReduce", "ncclReduceScatter") else ()) + (comm, stream_ptr)
            fns[fname](*args)
        print("done " + json.dumps({"called": a.stream - a.first}), flush=True)
        return 0

    called = {}
    rcs = {}
    outs = {}  # label -> the out-parameter's value after each init call (what the uretprobe must read)

    def call(label, fname, *args):
        rc = fns[fname](*args)
        called[label] = called.get(label, 0) + 1
        rcs.setdefault(label, set()).add(rc)
        print(f"{label} {fname} -> {rc} ({lib.ncclGetErrorString(rc).decode()})", flush=True)
        return rc

    for label, (reps, p) in PLAN.items():
        for _ in range(reps):
            if label == "allreduce":
                call(label, "ncclAllReduce", sb, rb, p["count"], p["dtype"], p["op"], comm, stream_ptr)
            elif label == "broadcast":
                call(label, "ncclBroadcast", sb, rb, p["count"], p["dtype"], p["root"], comm, stream_ptr)
            elif label == "reduce":
                call(label, "ncclReduce", sb, rb, p["count"], p["dtype"], p["op"], p["root"], comm, stream_ptr)
            elif label == "allgather":
                call(label, "ncclAllGather", sb, rb, p["count"], p["dtype"], comm, stream_ptr)
            elif label == "reduce_scatter":
                call(label, "ncclReduceScatter", sb, rb, p["count"], p["dtype"], p["op"], comm, stream_ptr)
            elif label == "send":
                call(label, "ncclSend", sb, p["count"], p["dtype"], p["peer"], comm, stream_ptr)
            elif label == "recv":
                call(label, "ncclRecv", rb, p["count"], p["dtype"], p["peer"], comm, stream_ptr)
            elif label == "group":
                call(label, "ncclGroupStart")
                fns["ncclGroupEnd"]()  # counted with its start; its rc is the group's error, if any
            elif label == "init_rank":
                out = vp(comm)  # not NULL, so the test sees the uretprobe read a real value; if NCCL
                call(label, "ncclCommInitRank", ct.byref(out), p["nranks"], uid, p["rank"])  # reads it, it is zeroes
                outs.setdefault(label, []).append(out.value or 0)
            elif label == "init_rank_config" and "ncclCommInitRankConfig" in fns:
                out = vp(comm)
                call(label, "ncclCommInitRankConfig", ct.byref(out), p["nranks"], uid, p["rank"], None)
                outs.setdefault(label, []).append(out.value or 0)
            elif label == "split" and "ncclCommSplit" in fns:
                out = vp(0)  # NULL, as NCCL requires: on return it reads (*newcomm)->commHash when it is not
                call(label, "ncclCommSplit", comm, p["color"], p["key"], ct.byref(out), None)
                outs.setdefault(label, []).append(out.value or 0)
            elif label == "destroy":
                call(label, "ncclCommDestroy", None)
            elif label == "abort":
                call(label, "ncclCommAbort", None)
            elif label == "allreduce_config" and "ncclAllReduceConfig" in fns:
                call(label, "ncclAllReduceConfig", sb, rb, p["count"], p["dtype"], p["op"], comm, stream_ptr, None)

    print("done " + json.dumps({"called": called, "rcs": {k: sorted(v) for k, v in rcs.items()}, "outs": outs}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
