"""Overhead of ccld's CUPTI capture on a GPU job: off vs NCCL-only vs all-kernels, as ratios in one run.

Two workloads, each run in windows of a fixed amount of work, in one process on one GPU:
  kernels    a loop of tiny kernels (x.add_(1) on one element: launch-bound, the worst case per kernel)
  allreduce  a loop of small NCCL all-reduces (1024 floats, AVG) on a world-size-1 process group
Capture is the real shim (ccld/cupti/shim.py: CUPTI callbacks, launch correlation, clock conversion,
MessagePack over ZeroMQ ipc) pushing to a separate receiver process, as in a traced job. Between
windows it is paused (off) or resumed with the NCCL filter or for all kernels; modes rotate each
round so drift hits all alike. A figure is the median window time of a mode over that of "off" for
the same workload. The issue's goal: <= 1.01 with the NCCL filter. Also the records each mode kept
and lost (CUPTI drops, queue drops, send drops).

Needs torch with CUDA, a GPU, cupti-python; installs nothing. Writes cupti_overhead.{txt,json,md} to
$OUT (or --out); --write-results puts the table in bench/RESULTS.md (section cupti-overhead).

  python bench/cupti_overhead.py [--rounds 5] [--kernels 20000] [--allreduces 2000] [--write-results]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MODES = ("off", "nccl", "all")
WORKLOADS = ("kernels", "allreduce")
GOAL_NCCL = 1.01  # the goal for the NCCL-only filter

# A receiver in its own process, like the agent: counts records, prints them as JSON when told to stop.
RECEIVER = r"""
import json, signal, sys, zmq, msgpack
ctx = zmq.Context(); s = ctx.socket(zmq.PULL); s.bind(sys.argv[1]); n = {"msgs": 0, "kernels": 0, "memops": 0}
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
print("ready", flush=True)
while not stop:
    if s.poll(100):
        m = msgpack.unpackb(s.recv(), raw=False)
        n["msgs"] += 1; n["kernels"] += len(m.get("kernels", ())); n["memops"] += len(m.get("memops", ()))
print(json.dumps(n), flush=True)
"""


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5, help="windows per mode and workload (default 5)")
    ap.add_argument("--kernels", type=int, default=20000, help="tiny kernels per window (default 20000)")
    ap.add_argument("--allreduces", type=int, default=2000, help="all-reduces per window (default 2000)")
    ap.add_argument("--size", type=int, default=1024, help="elements per all-reduce (default 1024)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma list of: " + ", ".join(WORKLOADS))
    ap.add_argument("--out", default=os.environ.get("OUT", ""), help="directory for the result files (default $OUT)")
    ap.add_argument("--write-results", action="store_true", help="write the section of bench/RESULTS.md")
    args = ap.parse_args(argv)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in args.workloads if w not in WORKLOADS]
    if bad or not args.workloads:
        ap.error(f"--workloads: unknown {', '.join(bad) or '(none)'}; choose from {', '.join(WORKLOADS)}")
    for name in ("rounds", "kernels", "allreduces", "size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1")
    return args


def mode_order(round_no: int) -> List[str]:
    """Modes of one round, rotated each round so slow drift (clocks, heat) is shared evenly."""
    k = round_no % len(MODES)
    return list(MODES[k:] + MODES[:k])


def summarize(samples: Dict[str, Dict[str, List[float]]], iters: Dict[str, int],
              records: Dict[str, Dict[str, Dict[str, int]]]) -> List[Dict[str, Any]]:
    """Rows (workload, mode, median s, per-iteration us, ratio to off, records kept/lost) from window times."""
    rows = []
    for wl, by_mode in samples.items():
        base = statistics.median(by_mode["off"]) if by_mode.get("off") else None
        for mode in MODES:
            times = by_mode.get(mode) or []
            if not times:
                continue
            med = statistics.median(times)
            rec = records.get(wl, {}).get(mode, {})
            rows.append({"workload": wl, "mode": mode, "windows": len(times), "median_s": med,
                         "per_iter_us": med / iters[wl] * 1e6, "ratio": (med / base) if base else None,
                         "kept": rec.get("kept", 0), "lost": rec.get("lost", 0)})
    return rows


def format_table(rows: List[Dict[str, Any]]) -> str:
    head = (f"{'workload':<10} {'mode':<5} {'windows':>7} {'median s':>9} {'us/iter':>8} {'ratio':>7} "
            f"{'kept':>9} {'lost':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = f"{r['ratio']:.4f}" if r["ratio"] is not None else "-"
        lines.append(f"{r['workload']:<10} {r['mode']:<5} {r['windows']:>7} {r['median_s']:>9.4f} "
                     f"{r['per_iter_us']:>8.2f} {ratio:>7} {r['kept']:>9} {r['lost']:>6}")
    return "\n".join(lines)


def verdict(rows: List[Dict[str, Any]]) -> str:
    worst = max((r["ratio"] for r in rows if r["mode"] == "nccl" and r["ratio"] is not None), default=None)
    if worst is None:
        return "no NCCL-only figure"
    return (f"NCCL-only filter: worst ratio {worst:.4f} ({'meets' if worst <= GOAL_NCCL else 'misses'} "
            f"the {GOAL_NCCL:.2f} goal)")


def markdown(rows: List[Dict[str, Any]], meta: Dict[str, Any]) -> str:
    return "\n".join([
        "## CUPTI capture overhead (bench/cupti_overhead.py)", "",
        f"{meta.get('date', '')} on {meta.get('gpu', '?')}; torch {meta.get('torch', '?')}, "
        f"cupti-python {meta.get('cupti', '?')}; {meta.get('rounds', '?')} rounds. Ratio = median window time "
        "with capture over without, same workload, same process.", "",
        "```", format_table(rows), "```", "", verdict(rows), ""])


def write_outputs(out_dir: str, rows: List[Dict[str, Any]], meta: Dict[str, Any]) -> List[str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, text in (("cupti_overhead.txt", format_table(rows) + "\n" + verdict(rows) + "\n"),
                       ("cupti_overhead.json", json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n"),
                       ("cupti_overhead.md", markdown(rows, meta))):
        path = os.path.join(out_dir, name)
        with open(path, "w") as f:
            f.write(text)
        paths.append(path)
    return paths


# ---- GPU part (imports torch and CUPTI only here) ------------------------------------------------

def _lost(c: Dict[str, int]) -> int:
    return sum(c.get(k, 0) for k in ("cupti_dropped", "queue_dropped", "records_dropped_send"))


def run(args: argparse.Namespace) -> int:
    tmp = tempfile.mkdtemp(prefix="ccld-cupti-bench-")
    try:
        return _run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run(args: argparse.Namespace, tmp: str) -> int:
    import torch
    import torch.distributed as dist
    from cupti import cupti
    from ccld.cupti.capture import CaptureConfig
    from ccld.cupti.shim import Shim
    if not torch.cuda.is_available():
        print("cupti_overhead: no CUDA device", file=sys.stderr)
        return 2
    endpoint = f"ipc://{tmp}/sink"
    recv = subprocess.Popen([sys.executable, "-c", RECEIVER, endpoint], stdout=subprocess.PIPE, text=True)
    try:
        recv.stdout.readline()  # "ready"
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1, store=dist.FileStore(os.path.join(tmp, "store"), 1))
        x = torch.zeros(1, device="cuda")
        buf = torch.ones(args.size, device="cuda")
        dist.all_reduce(buf, op=dist.ReduceOp.AVG)  # communicator set up before any timing
        torch.cuda.synchronize()

        def kernels():
            for _ in range(args.kernels):
                x.add_(1)

        def allreduce():
            for _ in range(args.allreduces):
                dist.all_reduce(buf, op=dist.ReduceOp.AVG)

        work = {"kernels": (kernels, args.kernels), "allreduce": (allreduce, args.allreduces)}
        shim = Shim(cupti, endpoint, CaptureConfig(kernels="nccl"), rank=0).start()
        if shim.disabled:
            print("cupti_overhead: capture could not start (see the line above)", file=sys.stderr)
            return 2
        shim.capture.pause()
        samples = {wl: {m: [] for m in MODES} for wl in args.workloads}
        records = {wl: {m: {"kept": 0, "lost": 0} for m in MODES} for wl in args.workloads}
        for wl in args.workloads:
            fn, _ = work[wl]
            fn()  # warm-up
            torch.cuda.synchronize()
            for rnd in range(args.rounds):
                for mode in mode_order(rnd):
                    if mode != "off":
                        shim.capture.resume(kernels=mode)
                    before = shim._snapshot()
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    fn()
                    torch.cuda.synchronize()
                    samples[wl][mode].append(time.perf_counter() - t0)
                    if mode != "off":
                        shim.capture.pause()
                    shim.tick()  # ship this window's records now, outside the timed part
                    after = shim._snapshot()
                    records[wl][mode]["kept"] += after.get("kernels", 0) - before.get("kernels", 0)
                    records[wl][mode]["lost"] += _lost(after) - _lost(before)
        shim.shutdown()
        recv.terminate()
        got = json.loads(recv.communicate(timeout=30)[0].strip().splitlines()[-1])
    finally:
        if recv.poll() is None:  # an error above: the receiver must not outlive us
            recv.kill()
            recv.wait()
    dist.destroy_process_group()
    rows = summarize(samples, {wl: work[wl][1] for wl in args.workloads}, records)
    meta = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "cupti": _version("cupti-python"), "rounds": args.rounds, "receiver": got,
            "api_mode": shim.capture.api_mode, "thread_ids": shim.capture.thread_ids}
    print(format_table(rows))
    print(verdict(rows))
    print(f"receiver got {got}; launch records: {meta['api_mode']}, thread ids: {meta['thread_ids']}")
    if args.out:
        for p in write_outputs(args.out, rows, meta):
            print(f"wrote {p}")
    if args.write_results:
        from results import write_section
        write_section("cupti-overhead", markdown(rows, meta))
    return 0


def _version(dist_name: str) -> str:
    try:
        from importlib.metadata import version
        return version(dist_name)
    except Exception:
        return "?"


if __name__ == "__main__":
    sys.exit(run(parse_args()))
