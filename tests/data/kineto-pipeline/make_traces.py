"""Make the Kineto traces in this folder (not run by the tests): a 4-rank gloo job on 127.0.0.1 laid out
as two pipeline stages x two data-parallel replicas, torch.profiler on every rank (CPU activities,
record_shapes); each rank writes rank<R>.json.gz (export_chrome_trace, then gzip).

    stage 0: ranks 0, 1     forward (record_function, WORK_S), then send its activation to rank + 2
    stage 1: ranks 2, 3     recv from rank - 2, forward (WORK_S + SLOW_S: the slow stage)
    every step, every rank: all_reduce in its stage's data-parallel group (new_group [0, 1] for stage 0,
                            [2, 3] for stage 1), then all_reduce of a loss in the default group

So the traces hold p2p (gloo:send / gloo:recv under c10d::send / c10d::recv_, the peer an argument of
the c10d op), collectives on three process groups (gloo runs each group's on worker threads of its
own), and compute (record_function "forward").

    .venv/bin/python tests/data/kineto-pipeline/make_traces.py [OUT_DIR]   # default: this folder
"""
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kineto"))
from make_traces import WORLD, main, save  # noqa: E402  (the first traces' generator: saving, spawning)

STEPS = 131        # a prime (a lost or doubled op shows in a count); ~6 s: episodes of 5 s or more are judged
ELEMS = 256        # floats per message
WORK_S = 0.010     # every rank's forward
SLOW_S = 0.025     # stage 1's forward takes this much longer: ranks 2 and 3, slow together


def run(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    dp = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes both, in the same order
    mine = dp[rank // 2]
    x, loss = torch.ones(ELEMS), torch.ones(1)
    dist.all_reduce(x, group=mine)  # warm-up, outside the trace
    dist.all_reduce(loss)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(STEPS):
            if rank >= 2:
                dist.recv(x, src=rank - 2)
            with record_function("forward"):
                time.sleep(WORK_S + (SLOW_S if rank >= 2 else 0.0))
            if rank < 2:
                dist.send(x, dst=rank + 2)
            dist.all_reduce(x, group=mine)
            dist.all_reduce(loss)
    dist.barrier()
    save(prof, out, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(run, os.path.dirname(os.path.abspath(__file__)))
