"""A 4-rank gloo job that leaves real PyTorch Flight Recorder dumps (run it under torchrun).

5 steps of (all_reduce, broadcast, all_gather, barrier) on the default group (seqs 1-20), one
all_reduce on a [0, 1] subgroup, then a final all_reduce (seq 21) with a fault:
  --hang-rank R       rank R sleeps instead of entering seq 21 (not-entered)
  --wrong-op-rank R   rank R calls all_gather where the others all_reduce (inconsistent)
Every rank runs a thread that waits for DIR/dump-now and then writes its Flight Recorder buffer with
torch's own dump API: DIR/pickle/fr_rank_<r> (_dump_fr_trace) and DIR/json/fr_rank_<r>
(_dump_fr_trace_json), each written to a temporary name and renamed, so a reader never sees half a
file. Prints "rank R at seq 21" before the faulty step and "rank R dumped" after its dump.
"""
import argparse
import datetime
import os
import threading
import time


def say(line: str) -> None:
    os.write(1, (line + "\n").encode())  # one write(2): ranks share torchrun's stdout


def write_atomically(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.rename(path + ".tmp", path)


def dump_when_asked(directory: str, rank: int) -> None:
    import torch._C._distributed_c10d as c10d
    trigger = os.path.join(directory, "dump-now")
    while not os.path.exists(trigger):
        time.sleep(0.05)
    write_atomically(os.path.join(directory, "pickle", f"fr_rank_{rank}"), c10d._dump_fr_trace())
    text = c10d._dump_fr_trace_json()
    write_atomically(os.path.join(directory, "json", f"fr_rank_{rank}"), text if isinstance(text, bytes) else text.encode())
    say(f"rank {rank} dumped")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--hang-rank", type=int, default=-1)
    p.add_argument("--wrong-op-rank", type=int, default=-1)
    p.add_argument("--timeout-s", type=float, default=120.0)
    a = p.parse_args()
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    threading.Thread(target=dump_when_asked, args=(a.dir, rank), daemon=True).start()
    t = torch.ones(8)
    for _ in range(5):
        dist.all_reduce(t)
        dist.broadcast(t, 0)
        dist.all_gather([torch.zeros(8) for _ in range(world)], t)
        dist.barrier()
    sub = dist.new_group([0, 1])
    if rank in (0, 1):
        dist.all_reduce(t, group=sub)
    say(f"rank {rank} at seq 21")
    try:
        if rank == a.hang_rank:
            time.sleep(a.timeout_s * 2)
        elif rank == a.wrong_op_rank:
            dist.all_gather([torch.zeros(8) for _ in range(world)], t)
        else:
            dist.all_reduce(t)
    except RuntimeError as e:
        say(f"rank {rank} error: {str(e)[:120]}")
    time.sleep(a.timeout_s)  # stay until the test has the dumps and ends the job


if __name__ == "__main__":
    main()
