"""A torch.distributed NCCL job on one GPU for the NCCL profiler plugin's device test.

Two communicators (the default group and dist.new_group over all ranks); on each, --iters AVG
all-reduces then one broadcast; then --p2p rounds of dist.all_to_all (the list form) on the default
group, which torch issues as one NCCL group of ncclSend + ncclRecv to every rank, this rank included.
It knows nothing of ccld: the test sets NCCL_PROFILER_PLUGIN and CCLD_NCCLPROF_ENDPOINT and compares
what the plugin sent with what this job says it ran (--trace, JSON): per communicator the collectives
in order, the p2p ops per peer and direction, and the NCCL it loaded (path and version).

Rank and world size come from the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT: env://).
Every rank uses GPU 0: one rank, or two where NCCL lets two ranks share a GPU (NCCL 2.30+ with
NCCL_MULTI_RANK_GPU_ENABLE=1). With one rank NCCL runs collectives without a kernel plan and calls no
profiler event for them (its enqueue.cc: nRanks == 1 -> ncclLaunchOneRank); send/recv to self do go
through a plan.
"""
import argparse
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _built_with(torch) -> tuple:
    v = torch.cuda.nccl.version()  # a tuple (major, minor, patch[, suffix]) in torch 2
    return tuple(v[:3]) if isinstance(v, tuple) else (v,)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=23, help="all-reduces per communicator (then one broadcast)")
    ap.add_argument("--p2p", type=int, default=7, help="all_to_all rounds on the default group")
    ap.add_argument("--trace", required=True)
    ap.add_argument("--settle-s", type=float, default=0.5,
                    help="pause before destroying the groups: a few plugin flushes (100 ms) with the job alive")
    args = ap.parse_args()
    import torch
    import torch.distributed as dist
    from ccld.ncclprof import loaded_nccl

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")  # env://; the NCCL communicator is made at its first collective
    second = dist.new_group(list(range(world)))
    x = torch.ones(1024, device="cuda")
    ran = {"default": [], "second": []}
    for name, group in (("default", None), ("second", second)):
        for _ in range(args.iters):
            dist.all_reduce(x, op=dist.ReduceOp.AVG, group=group)
            ran[name].append("allreduce")
        dist.broadcast(x, src=0, group=group)
        ran[name].append("broadcast")
    ins = [torch.full((256,), float(rank), device="cuda") for _ in range(world)]
    outs = [torch.empty(256, device="cuda") for _ in range(world)]
    for _ in range(args.p2p):
        dist.all_to_all(outs, ins)
    torch.cuda.synchronize()
    got = [float(o[0]) for o in outs]
    path, version = loaded_nccl()
    trace = {"pid": os.getpid(), "tid": threading.get_native_id(), "rank": rank, "world": world, "ran": ran,
             "p2p_rounds": args.p2p, "p2p_peers": list(range(world)), "alltoall_got": got,
             "nccl_lib": path, "nccl_version": list(version or _built_with(torch)),
             "nccl_version_from": "ncclGetVersion" if version else "torch.cuda.nccl.version (built with)",
             "torch": torch.__version__, "device": torch.cuda.get_device_name(0)}
    with open(args.trace, "w") as f:
        json.dump(trace, f)
    time.sleep(args.settle_s)
    dist.destroy_process_group()
    print(f"ncclprof_gpu_job: rank {rank}/{world} done: {sum(map(len, ran.values()))} collectives, "
          f"{args.p2p} all_to_all", flush=True)


if __name__ == "__main__":
    main()
