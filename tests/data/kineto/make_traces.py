"""Make the Kineto traces in this folder (not run by the tests): a 4-rank gloo job on 127.0.0.1,
torch.profiler on every rank (CPU activities, record_shapes), STEPS all_reduces of ELEMS floats, each
after a WORK_S sleep, rank 2 sleeping SLOW_S more; each rank writes rank<R>.json.gz (export_chrome_trace,
then gzip).

    .venv/bin/python tests/data/kineto/make_traces.py [OUT_DIR]   # default: this folder
"""
import gzip
import os
import shutil
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile

WORLD = 4
STEPS = 167        # a prime (a lost or doubled collective shows in a count); ~7 s: slow.py judges
                   # lateness over episodes of 5 s or more
ELEMS = 1024
SLOW_RANK, SLOW_S = 2, 0.030
WORK_S = 0.010     # every rank's "compute" before each all_reduce


def run(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    x = torch.ones(ELEMS)
    dist.all_reduce(x)  # warm-up, outside the trace
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(STEPS):
            time.sleep(WORK_S + (SLOW_S if rank == SLOW_RANK else 0.0))
            dist.all_reduce(x)
    dist.barrier()
    save(prof, out, rank)
    dist.destroy_process_group()


def save(prof, out: str, rank: int) -> None:
    """The profile as out/rank<R>.json.gz (export_chrome_trace, then gzip)."""
    path = os.path.join(out, f"rank{rank}.json")
    prof.export_chrome_trace(path)
    with open(path, "rb") as src, gzip.open(path + ".gz", "wb", compresslevel=9) as dst:
        shutil.copyfileobj(src, dst)
    os.remove(path)


def main(run=run, here: str = os.path.dirname(os.path.abspath(__file__))) -> None:
    """`run(rank, port, out)` on WORLD processes; out: the first argument, else the script's folder."""
    out = sys.argv[1] if len(sys.argv) > 1 else here
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(port, out), nprocs=WORLD)


if __name__ == "__main__":
    main()
