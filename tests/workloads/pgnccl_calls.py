"""One rank of a PyTorch NCCL job as c10d's ProcessGroupNCCL would drive it, without a GPU or a CUDA torch:
tests/workloads/fake_torch_cuda.cpp (built by the test as libtorch_cuda.so) has torch's three probed
functions with torch's signatures; this process calls them through its two C helpers.

Plan (the same on every rank, so ranks line up by c10d's numbers): group "0" (the default group) is
built before `ready` (ccld attaches after it, so it is a group made before the attach), then
--early collectives of it happen before `ready` too (what a rank had done before ccld attached:
ranks attached at different points). After the go-file: group "1" is built (under the probes), then
--n collectives of group "0" (allreduce, broadcast, barrier in turn) and one of group "1" every 5th, one
every --period-ms from the CLOCK_MONOTONIC ns START written in the go-file; a rank with --p2p also
makes a send then a recv of group "0" after every 3rd collective (a pipeline stage's p2p, which c10d
counts apart). Prints `ready {json}`, then `done {json}` with the seqs c10d handed out.
"""
import argparse
import ctypes as ct
import json
import os
import sys
import time

ALLREDUCE, BROADCAST, BARRIER, SEND, RECV = 1, 0, 15, 12, 13  # c10d::OpType
OPS = (ALLREDUCE, BROADCAST, BARRIER)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--size", type=int, default=2)
    ap.add_argument("--early", type=int, default=0)
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--p2p", action="store_true")
    ap.add_argument("--period-ms", type=float, default=20.0)
    ap.add_argument("--go-file", required=True)
    a = ap.parse_args()
    lib = ct.CDLL(a.lib)
    lib.fake_pg_new.restype = ct.c_void_p
    lib.fake_pg_new.argtypes = [ct.c_char_p, ct.c_int, ct.c_int]
    lib.fake_op.restype = ct.c_uint64
    lib.fake_op.argtypes = [ct.c_void_p, ct.c_int, ct.c_int]
    world = lib.fake_pg_new(b"0", a.rank, a.size)
    for k in range(a.early):
        lib.fake_op(world, OPS[k % len(OPS)], 0)
    print("ready " + json.dumps({"pid": os.getpid()}), flush=True)
    deadline = time.monotonic() + 60
    while not os.path.exists(a.go_file):
        if time.monotonic() > deadline:
            print("gave up waiting for the go-file", file=sys.stderr)
            return 1
        time.sleep(0.01)
    start_ns = int(open(a.go_file).read().strip())
    sub = lib.fake_pg_new(b"1", a.rank, a.size)
    seqs = {"0": [], "1": [], "p2p": []}
    for k in range(a.early, a.early + a.n):
        wait = (start_ns + int(k * a.period_ms * 1e6) - time.monotonic_ns()) / 1e9
        if wait > 0:
            time.sleep(wait)
        seqs["0"].append(lib.fake_op(world, OPS[k % len(OPS)], 0))
        if k % 5 == 0:
            seqs["1"].append(lib.fake_op(sub, ALLREDUCE, 0))
        if a.p2p and k % 3 == 0:
            seqs["p2p"].append(lib.fake_op(world, SEND, 1))
            seqs["p2p"].append(lib.fake_op(world, RECV, 1))
    print("done " + json.dumps(seqs), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
