"""A tiny CPU training-like job over gloo, for the demo, the tests and the benchmarks.

Run it under torchrun (RANK/WORLD_SIZE/MASTER_* come from the environment). Each step does the listed
collectives on small tensors plus a little compute. Faults are injected from the command line, so the
job itself stands in for a user's script that ccld knows nothing about:
  --hang-rank R --hang-step K    rank R sleeps forever before step K (a "not-entered" hang)
  --pause-step K --pause-s S     every rank sleeps S seconds before step K (a healthy long step)
  --wait-file F                  block after init until F exists (lets a tracer attach first)
  --progress-every N             print "rank R step N t UNIX" every N steps (tests watch these)
Prints one line per rank at the end: "rank R done: N steps, ops {op: count}".
"""
import argparse
import os
import sys
import time


def say(line: str) -> None:
    """One write(2) per line: ranks share torchrun's stdout, and print() may split a line in two
    writes, interleaving ranks mid-line (tests and users read these lines)."""
    os.write(1, (line + "\n").encode())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=23)
    ap.add_argument("--seconds", type=float, default=0, help="run for this long instead of --steps")
    ap.add_argument("--ops", default="allreduce", help="comma list: allreduce,broadcast,allgather,"
                                                       "reduce_scatter,barrier,sendrecv")
    ap.add_argument("--elems", type=int, default=4096)
    ap.add_argument("--compute-ms", type=float, default=2.0)
    ap.add_argument("--step-sleep-ms", type=float, default=0.0)
    ap.add_argument("--hang-rank", type=int, default=-1)
    ap.add_argument("--hang-step", type=int, default=-1)
    ap.add_argument("--pause-step", type=int, default=-1)
    ap.add_argument("--pause-s", type=float, default=0)
    ap.add_argument("--wait-file", default="")
    ap.add_argument("--progress-every", type=int, default=0, help="print 'rank R step N t T' every N steps")
    ap.add_argument("--timeout-s", type=float, default=1800)
    a = ap.parse_args()

    import datetime
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    if a.wait_file:
        while not os.path.exists(a.wait_file):
            time.sleep(0.05)
    ops = [o for o in a.ops.split(",") if o]
    counts = {o: 0 for o in ops}
    t = torch.ones(a.elems)
    w = torch.randn(64, 64)
    deadline = time.monotonic() + a.seconds if a.seconds else None
    step = 0
    while (step < a.steps) if deadline is None else (time.monotonic() < deadline):
        if step == a.hang_step and rank == a.hang_rank:
            say(f"rank {rank}: hanging before step {step}")
            while True:
                time.sleep(3600)
        if step == a.pause_step:
            time.sleep(a.pause_s)
        end = time.perf_counter() + a.compute_ms / 1e3
        while time.perf_counter() < end:  # stand-in for forward/backward
            w = (w @ w).clamp_(-1, 1)
        for o in ops:
            if o == "allreduce":
                dist.all_reduce(t)
                t.fill_(1.0)
            elif o == "broadcast":
                dist.broadcast(t, src=step % world)
            elif o == "allgather":
                out = [torch.empty(a.elems) for _ in range(world)]
                dist.all_gather(out, t)
            elif o == "reduce_scatter":
                out = torch.empty(a.elems // world)
                dist.reduce_scatter_tensor(out, t[: (a.elems // world) * world])
            elif o == "barrier":
                dist.barrier()
            elif o == "sendrecv":
                peer_to, peer_from = (rank + 1) % world, (rank - 1) % world
                buf = torch.empty(a.elems)
                if rank % 2 == 0:
                    dist.send(t, peer_to)
                    dist.recv(buf, peer_from)
                else:
                    dist.recv(buf, peer_from)
                    dist.send(t, peer_to)
            else:
                raise SystemExit(f"unknown op {o!r}")
            counts[o] += 1
        if a.step_sleep_ms:
            time.sleep(a.step_sleep_ms / 1e3)
        step += 1
        if a.progress_every and step % a.progress_every == 0:
            say(f"rank {rank} step {step} t {time.time():.3f}")
    say(f"rank {rank} done: {step} steps, ops {counts}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
