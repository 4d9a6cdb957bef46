"""A one-GPU job for the CUPTI device tests: compute kernels, or NCCL all-reduces on two communicators.

It knows nothing of ccld; the tests run it with the shim injected (sitecustomize on PYTHONPATH, as
`ccld run` does) and compare what the shim captured with what the job says it did: each launching
call's CLOCK_MONOTONIC window and the calling thread's id, written as JSON to the --trace file.

  --mode compute   --iters N tiny elementwise kernels
  --mode nccl      world size 1 (one GPU allows no more: NCCL refuses two ranks on one device), two
                   communicators (the default group and dist.new_group([0])), --iters AVG all-reduces
                   on each, alternating. AVG, because a one-rank SUM in place may launch nothing.
"""
import argparse
import json
import os
import tempfile
import threading
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("compute", "nccl"), required=True)
    ap.add_argument("--iters", type=int, default=23)
    ap.add_argument("--trace", required=True)
    ap.add_argument("--settle-s", type=float, default=1.5,
                    help="pause after warm-up: two shim flushes, so a CUPTI that needs the whole launch-API "
                         "kinds on has them on (the shim widens by itself) before the measured calls")
    args = ap.parse_args()
    import torch
    torch.cuda.set_device(0)
    calls = []
    mono = time.monotonic_ns
    w = torch.zeros(1024, device="cuda")
    for _ in range(32):  # warm-up kernels
        w.add_(1)
    torch.cuda.synchronize()
    if args.mode == "compute":
        x = torch.zeros(1024, device="cuda")
        torch.cuda.synchronize()
        time.sleep(args.settle_s)
        for _ in range(args.iters):
            t0 = mono()
            x.add_(1)
            calls.append(["compute", t0, mono()])
    else:
        import torch.distributed as dist
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="cupti-gpu-job-"), "store"), 1)
        dist.init_process_group("nccl", rank=0, world_size=1, store=store)
        g2 = dist.new_group([0])
        a = torch.ones(1024, device="cuda")
        b = torch.ones(1024, device="cuda")
        dist.all_reduce(a, op=dist.ReduceOp.AVG)  # communicators are created at their first collective
        dist.all_reduce(b, op=dist.ReduceOp.AVG, group=g2)
        torch.cuda.synchronize()
        time.sleep(args.settle_s)
        for _ in range(args.iters):
            t0 = mono()
            dist.all_reduce(a, op=dist.ReduceOp.AVG)
            calls.append(["default", t0, mono()])
            t0 = mono()
            dist.all_reduce(b, op=dist.ReduceOp.AVG, group=g2)
            calls.append(["second", t0, mono()])
    torch.cuda.synchronize()
    synced = mono()
    with open(args.trace, "w") as f:
        json.dump({"pid": os.getpid(), "tid": threading.get_native_id(), "calls": calls, "synced": synced}, f)
    if args.mode == "nccl":
        import torch.distributed as dist
        dist.destroy_process_group()
    print(f"cupti_gpu_job: {args.mode} done, {len(calls)} calls", flush=True)


if __name__ == "__main__":
    main()
