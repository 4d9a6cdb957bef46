"""A rank of a fake NCCL job: plays NCCL against the profiler plugin named by NCCL_PROFILER_PLUGIN.

Run one per rank under torchrun (RANK, WORLD_SIZE from it) inside `ccld run`, which injects ccld's
plugin. No GPU and no NCCL: this process calls the plugin's ncclProfiler_v5 table as NCCL's enqueue,
kernel and proxy threads would (tests/unit/ncclprof_abi.py declares the ABI from NCCL's headers), for
a ring all-reduce on one communicator, one every --period-ms, all ranks on one wall-clock schedule
(--start-at) so that they line up without talking to each other. Each collective: start, enqueued
(stopEvent), a kernel channel starts, a send proxy op to rank+1 and a receive from rank-1 move
--steps steps each, the kernel stops.

Faults at collective --fault-at:
  stall-link SRC DST   SRC's send steps to DST are posted and never complete; everyone else's kernel
                       waits (their receives stay posted): nobody finishes; the link is to blame
  no-kernel RANK       RANK's kernel never starts; the others' start and never finish
  slow-link SRC DST    from then on every send step of SRC to DST waits --slow-step-ms longer on the
                       network (a slow InfiniBand link); the other senders' steps wait as long on their
                       GPU (the data reaches them late), so every rank's all-reduce takes longer while
                       all still enter each collective on time
After a stall-link or no-kernel fault every rank holds for --hold-s and exits 0; a slow-link job runs
its --collectives and finalizes. Prints `rank R: fault at collective K` at the onset.
"""
import argparse
import ctypes as C
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "unit"))
from ncclprof_abi import ST_RECV_WAIT, ST_SEND_GPU_WAIT, ST_SEND_WAIT, Nccl  # noqa: E402

COMM_HASH = 0x5EED0000CAFE0042
STEP_BYTES = 1 << 17


def until(t):
    d = t - time.time()
    if d > 0:
        time.sleep(d)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--collectives", type=int, default=200)
    ap.add_argument("--period-ms", type=float, default=50.0)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--start-at", type=float, required=True, help="Unix time of collective 0 on every rank")
    ap.add_argument("--fault", nargs="*", default=[])
    ap.add_argument("--fault-at", type=int, default=-1)
    ap.add_argument("--hold-s", type=float, default=10.0)
    ap.add_argument("--slow-step-ms", type=float, default=5.0, help="slow-link: the extra wait of each step")
    a = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    lib = C.CDLL(os.environ["NCCL_PROFILER_PLUGIN"])
    n = Nccl(lib, 5)
    ctx, _mask = n.init(comm_hash=COMM_HASH, nnodes=1, nranks=world, rank=rank)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    slow_link = a.fault[:1] == ["slow-link"]
    slow_sender = slow_link and int(a.fault[1]) == rank and int(a.fault[2]) == nxt
    extra_s = a.slow_step_ms / 1000
    print(f"rank {rank}: plugin loaded, starting at {a.start_at:.3f}", flush=True)
    for i in range(a.collectives):
        until(a.start_at + i * a.period_ms / 1000)
        fault = i == a.fault_at
        coll = n.start(ctx, n.coll(i, func="AllReduce", count=STEP_BYTES // 4 * a.steps, dtype="ncclFloat32",
                                   nchannels=1))
        n.stop(coll)  # enqueued: NCCL stops the collective's event when it is launched
        if fault:
            print(f"rank {rank}: fault at collective {i} ({' '.join(a.fault)})", flush=True)
        if fault and a.fault[:1] == ["no-kernel"] and int(a.fault[1]) == rank:
            break  # its kernel never starts: nothing more happens in this rank
        kernel = n.start(ctx, n.kernel_ch(coll, 0, ptimer=time.time_ns()))
        send = n.start(ctx, n.proxy_op(coll, 0, nxt, True))
        recv = n.start(ctx, n.proxy_op(coll, 0, prv, False))
        if fault and not slow_link:  # stall-link, or no-kernel on the other ranks: they wait forever
            if a.fault[:1] == ["stall-link"] and int(a.fault[1]) == rank and int(a.fault[2]) == nxt:
                for k in range(a.steps):  # posted on the network, never completed
                    s = n.start(ctx, n.proxy_step(send, k))
                    n.record(s, ST_SEND_WAIT, n.step_args(STEP_BYTES))
            r = n.start(ctx, n.proxy_step(recv, 0))
            n.record(r, ST_RECV_WAIT, n.step_args(0))  # waits for data that never comes
            break
        slow = slow_link and i >= a.fault_at
        for k in range(a.steps):
            s = n.start(ctx, n.proxy_step(send, k))
            n.record(s, ST_SEND_GPU_WAIT, n.step_args(0))
            if slow and not slow_sender:
                time.sleep(extra_s)  # the data to send comes late: the ring waits on the slow link
            n.record(s, ST_SEND_WAIT, n.step_args(STEP_BYTES))
            time.sleep(0.0002 + (extra_s if slow and slow_sender else 0.0))
            n.stop(s)
            r = n.start(ctx, n.proxy_step(recv, k))
            n.record(r, ST_RECV_WAIT, n.step_args(STEP_BYTES))
            n.stop(r)
        n.stop(send)
        n.stop(recv)
        n.kernel_stop(kernel, time.time_ns())
    else:
        n.finalize(ctx)
        print(f"rank {rank}: done", flush=True)
        return
    time.sleep(a.hold_s)
    print(f"rank {rank}: held {a.hold_s:.0f} s, exiting", flush=True)


if __name__ == "__main__":
    main()
