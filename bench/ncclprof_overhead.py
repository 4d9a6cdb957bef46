"""Overhead of ccld's NCCL profiler plugin on a one-GPU NCCL job: plugin off vs on, as ratios in one run.

NCCL reads NCCL_PROFILER_PLUGIN once, at its first communicator, so each configuration is a process of
its own; both live at once on GPU 0, each a world-size-1 torch.distributed NCCL job:
  off  no plugin (NCCL_PROFILER_PLUGIN unset: a job without ccld)
  on   ccld's plugin, sending to an NcclProfSink in this process that drains it as the agent does
Workloads, each at 4 KiB (launch-bound: the worst case per op) and 1 MiB:
  allreduce  dist.all_reduce (AVG). One rank: NCCL runs it without a kernel plan and calls the plugin
             for none of them (enqueue.cc, ncclLaunchOneRank): this is the plugin loaded and idle.
  alltoall   dist.all_to_all (the list form): ncclSend + ncclRecv to self in one NCCL group, a plan with
             two p2p tasks the plugin gets start and stop events for: its cost per op on NCCL's thread.
This process tells the workers in turn to run one window of --iters ops (which goes first alternates
each round, so drift hits both alike); a worker times its window between two torch.cuda.synchronize().
A figure is the median window time "on" over "off" for one workload and size; the spread is the lowest
and highest of the rounds' paired ratios. Also what the sink received (2 P2P per all_to_all when none
is lost) and the plugin's loss counters.

Caveat, from NCCL's source: a send/receive to self gets no proxy op, hence no kernel-channel event, and
from ncclProfiler_v3 the plugin waits for one (F_END_STALE after 3000 flushes), holding its handle. So
the "on" worker gets enough handles (CCLD_NCCLPROF_HANDLES) for every op of the run: measured is the
per-op path, not the "pool empty" one that the default 8192 would reach after 4096 all_to_alls.

Needs torch with CUDA, a GPU and a C compiler (the plugin is built into a temporary directory unless
--plugin names one); installs nothing. Without a GPU it exits 2 with one line. Writes
ncclprof_overhead.{txt,json,md} to $OUT (or --out); --write-results puts the table in bench/RESULTS.md.

  python bench/ncclprof_overhead.py [--rounds 9] [--iters 4000] [--plugin PATH] [--write-results]
"""
import argparse
import collections
import json
import os
import queue
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CONFIGS = ("off", "on")
WORKLOADS = ("allreduce", "alltoall")
SIZES = (4096, 1 << 20)  # bytes per op (float32 elements: size / 4)
WARMUP = 50              # ops per workload and size before any timing (communicator, plan caches)
READY_TIMEOUT_S = 180    # a worker's import of torch and NCCL's init
WINDOW_TIMEOUT_S = 120
BYE_WAIT_S = 10          # after the "on" worker ends: its last datagrams, then the sink is read out
TAG = "@@ "              # a worker's protocol lines on stdout (anything else there is passed through)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=9, help="windows per configuration, workload and size (default 9)")
    ap.add_argument("--iters", type=int, default=4000, help="ops per window (default 4000)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma list of: " + ", ".join(WORKLOADS))
    ap.add_argument("--plugin", default="", help="a built libnccl-profiler-ccld.so (default: build one now)")
    ap.add_argument("--out", default=os.environ.get("OUT", ""), help="directory for the result files (default $OUT)")
    ap.add_argument("--write-results", action="store_true", help="write the section of bench/RESULTS.md")
    ap.add_argument("--worker", choices=CONFIGS, help=argparse.SUPPRESS)  # internal: one configuration's process
    args = ap.parse_args(argv)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in args.workloads if w not in WORKLOADS]
    if bad or not args.workloads:
        ap.error(f"--workloads: unknown {', '.join(bad) or '(none)'}; choose from {', '.join(WORKLOADS)}")
    for name in ("rounds", "iters"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1")
    return args


def size_name(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def handles_needed(args: argparse.Namespace) -> int:
    """Plugin handles for every all_to_all of the "on" worker (two p2p tasks each, none given back:
    see the caveat), as a power of two within the plugin's 16..2^20."""
    n = 2 * len(SIZES) * (args.rounds * args.iters + WARMUP) + 4096 if "alltoall" in args.workloads else 8192
    return min(1 << 20, 1 << (n - 1).bit_length())


# ---- results (no GPU needed) ------------------------------------------------------------------------

def summarize(samples: Dict[Tuple[str, int], Dict[str, List[float]]], iters: int) -> List[Dict[str, Any]]:
    """Rows per (workload, size): median window times, us per op, ratio on/off and its spread over rounds."""
    rows = []
    for (wl, size), by in samples.items():
        off, on = by.get("off") or [], by.get("on") or []
        if not off or not on:
            continue
        paired = [b / a for a, b in zip(off, on) if a > 0]
        m_off, m_on = statistics.median(off), statistics.median(on)
        rows.append({"workload": wl, "size": size, "windows": min(len(off), len(on)),
                     "off_us": m_off / iters * 1e6, "on_us": m_on / iters * 1e6,
                     "ratio": m_on / m_off if m_off > 0 else None,
                     "low": min(paired) if paired else None, "high": max(paired) if paired else None})
    return rows


def format_table(rows: List[Dict[str, Any]]) -> str:
    head = f"{'workload':<10} {'size':>6} {'windows':>7} {'off us/op':>9} {'on us/op':>9} {'ratio':>7} {'spread':>15}"
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = f"{r['ratio']:.4f}" if r["ratio"] is not None else "-"
        spread = f"{r['low']:.3f}..{r['high']:.3f}" if r["low"] is not None else "-"
        lines.append(f"{r['workload']:<10} {size_name(r['size']):>6} {r['windows']:>7} {r['off_us']:>9.2f} "
                     f"{r['on_us']:>9.2f} {ratio:>7} {spread:>15}")
    return "\n".join(lines)


def verdict(rows: List[Dict[str, Any]], meta: Dict[str, Any]) -> str:
    """The last line of the table in gpu_check.sh's summary: worst ratio, and whether every op was seen."""
    worst = max((r for r in rows if r["ratio"] is not None), key=lambda r: r["ratio"], default=None)
    head = (f"ncclprof overhead: worst ratio {worst['ratio']:.4f} ({worst['workload']} {size_name(worst['size'])})"
            if worst else "ncclprof overhead: no figure")
    seen = meta.get("p2p_per_alltoall")
    lost = {k: v for k, v in (meta.get("plugin_loss") or {}).items() if v}
    return (f"{head}; ncclProfiler_v{meta.get('api_version') or '?'} under NCCL {meta.get('nccl') or '?'}"
            + (f"; {seen:.3f} P2P events per all_to_all (2 = none lost)" if seen is not None else "")
            + f"; plugin losses {lost or 'none'}")


def markdown(rows: List[Dict[str, Any]], meta: Dict[str, Any]) -> str:
    return "\n".join([
        "## NCCL profiler plugin overhead (bench/ncclprof_overhead.py)", "",
        f"{meta.get('date', '')} on {meta.get('gpu', '?')}; torch {meta.get('torch', '?')}, NCCL "
        f"{meta.get('nccl', '?')}, ncclProfiler_v{meta.get('api_version') or '?'}; {meta.get('rounds', '?')} rounds "
        f"of {meta.get('iters', '?')} ops; one rank. Ratio = median window time with the plugin over without, same "
        "workload and size, two processes alive together on one GPU; spread = lowest..highest ratio of one round.",
        "", "```", format_table(rows), "```", "", verdict(rows, meta), ""])


def write_outputs(out_dir: str, rows: List[Dict[str, Any]], meta: Dict[str, Any]) -> List[str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, text in (("ncclprof_overhead.txt", format_table(rows) + "\n" + verdict(rows, meta) + "\n"),
                       ("ncclprof_overhead.json", json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n"),
                       ("ncclprof_overhead.md", markdown(rows, meta))):
        path = os.path.join(out_dir, name)
        with open(path, "w") as f:
            f.write(text)
        paths.append(path)
    return paths


# ---- a worker: one configuration's NCCL job (imports torch only here) ------------------------------

def _say(msg: Dict[str, Any]) -> None:
    sys.stdout.write(TAG + json.dumps(msg) + "\n")
    sys.stdout.flush()


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from ccld.ncclprof import loaded_nccl

    torch.cuda.set_device(0)
    dist.init_process_group("nccl")  # env:// (this process's own MASTER_PORT), rank 0 of 1
    bufs = {s: torch.ones(s // 4, device="cuda") for s in SIZES}
    a2a = {s: ([torch.ones(s // 4, device="cuda")], [torch.empty(s // 4, device="cuda")]) for s in SIZES}

    def run(wl: str, size: int, n: int) -> None:
        if wl == "allreduce":
            b = bufs[size]
            for _ in range(n):
                dist.all_reduce(b, op=dist.ReduceOp.AVG)
        else:
            ins, outs = a2a[size]
            for _ in range(n):
                dist.all_to_all(outs, ins)

    for wl in args.workloads:
        for size in SIZES:
            run(wl, size, WARMUP)
    torch.cuda.synchronize()
    path, version = loaded_nccl()
    _say({"ready": True, "pid": os.getpid(), "nccl": ".".join(map(str, version)) if version else "",
          "nccl_lib": path, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("op") != "run":
            break
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run(cmd["workload"], int(cmd["size"]), int(cmd["iters"]))
        torch.cuda.synchronize()
        _say({"s": time.perf_counter() - t0})
    dist.destroy_process_group()
    _say({"bye": True})
    return 0


# ---- this process: the workers, the sink, the windows ----------------------------------------------

class BenchError(Exception):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    """One configuration's process; its protocol lines come through a queue (read by a thread), others
    are passed to our stdout."""

    def __init__(self, config: str, args: argparse.Namespace, env: Dict[str, str]):
        self.config = config
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", config, "--workloads", ",".join(args.workloads)]
        self.p = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.q: "queue.Queue[Optional[Dict[str, Any]]]" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            if line.startswith(TAG):
                self.q.put(json.loads(line[len(TAG):]))
            else:
                sys.stdout.write(f"[{self.config}] {line}")
        self.q.put(None)  # EOF: the worker is gone

    def get(self, timeout: float) -> Dict[str, Any]:
        try:
            msg = self.q.get(timeout=timeout)
        except queue.Empty:
            raise BenchError(f"worker {self.config!r} said nothing for {timeout:.0f} s") from None
        if msg is None:
            raise BenchError(f"worker {self.config!r} ended (exit {self.p.wait()}); its stderr is above")
        return msg

    def send(self, msg: Dict[str, Any]) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps(msg) + "\n")
        self.p.stdin.flush()

    def window(self, workload: str, size: int, iters: int) -> float:
        self.send({"op": "run", "workload": workload, "size": size, "iters": iters})
        return float(self.get(WINDOW_TIMEOUT_S)["s"])

    def quit(self) -> None:
        self.send({"op": "quit"})
        self.get(WINDOW_TIMEOUT_S)  # "bye": its communicators are destroyed
        self.p.wait(timeout=30)

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


def nccl_gpu_missing() -> Optional[str]:
    """Why NCCL cannot run on a GPU here (None: it can). Also the gpu test's skip reason."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    if not torch.distributed.is_available() or not torch.distributed.is_nccl_available():
        return "this torch has no NCCL backend"
    return None


def run(args: argparse.Namespace) -> int:
    why = nccl_gpu_missing()
    if why:
        print(f"ncclprof_overhead: {why}; nothing measured (needs a GPU)", file=sys.stderr)
        return 2
    tmp = tempfile.mkdtemp(prefix="ccld-np-bench-")
    try:
        plugin = args.plugin
        if not plugin:
            from ccld.ncclprof import build
            got = build.build(tmp)
            if got.path is None:
                print(f"ncclprof_overhead: the plugin cannot be built: {got.reason}", file=sys.stderr)
                return 2
            plugin = got.path
        return _run(args, os.path.abspath(plugin))
    except BenchError as e:
        print(f"ncclprof_overhead: {e}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run(args: argparse.Namespace, plugin: str) -> int:
    from ccld.bpf.rows import Rows
    from ccld.tracer.ncclprof_sink import NcclProfSink

    received: Dict[str, int] = collections.Counter()
    apis: List[int] = []  # the ncclProfiler_vN NCCL picked, as the sink's "on" status says it

    def emit(item: Any) -> None:
        for e in item.events() if isinstance(item, Rows) else [item]:
            received[type(e).__name__] += 1
            m = re.search(r"ncclProfiler_v(\d+)", getattr(e, "message", "") or "")
            if m:
                apis.append(int(m.group(1)))

    sink = NcclProfSink(emit, ident_of=lambda pid: (0, "bench"))
    workers: Dict[str, Worker] = {}
    try:
        base = {k: v for k, v in os.environ.items() if not k.startswith("CCLD_") and k != "NCCL_PROFILER_PLUGIN"}
        base.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", PYTHONUNBUFFERED="1",
                    PYTHONPATH=os.pathsep.join([ROOT] + [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p]))
        handles = handles_needed(args)
        plugin_env = {"NCCL_PROFILER_PLUGIN": plugin, "CCLD_NCCLPROF_ENDPOINT": sink.path,
                      "CCLD_NCCLPROF_HANDLES": str(handles)}
        for cfg in CONFIGS:  # both start at once: their imports and NCCL inits overlap
            workers[cfg] = Worker(cfg, args, dict(base, MASTER_PORT=str(_free_port()),
                                                  **(plugin_env if cfg == "on" else {})))
        hello = {cfg: w.get(READY_TIMEOUT_S) for cfg, w in workers.items()}
        print(f"ncclprof_overhead: {hello['on'].get('gpu')}, torch {hello['on'].get('torch')}, NCCL "
              f"{hello['on'].get('nccl') or '?'}; {args.rounds} rounds of {args.iters} ops per window", flush=True)
        samples: Dict[Tuple[str, int], Dict[str, List[float]]] = {}
        for rnd in range(args.rounds):
            order = CONFIGS if rnd % 2 == 0 else CONFIGS[::-1]
            for wl in args.workloads:
                for size in SIZES:
                    for cfg in order:
                        t = workers[cfg].window(wl, size, args.iters)
                        samples.setdefault((wl, size), {c: [] for c in CONFIGS})[cfg].append(t)
                    sink.poll(1 << 30)  # between windows, never inside one
        for cfg in CONFIGS:
            workers[cfg].quit()
        deadline = time.monotonic() + BYE_WAIT_S
        while time.monotonic() < deadline and "bye" not in sink.ranks_on.values():
            if not sink.poll():
                time.sleep(0.05)
        sink.poll(1 << 30)
    finally:
        for w in workers.values():
            w.kill()
        sink.close()
    statuses = list(sink.ranks_on.values())
    loss = sink.loss()
    api = apis[0] if apis else None
    a2a = len(SIZES) * (args.rounds * args.iters + WARMUP) if "alltoall" in args.workloads else 0
    rows = summarize(samples, args.iters)
    meta = {"date": time.strftime("%Y-%m-%d"), "gpu": hello["on"].get("gpu"), "torch": hello["on"].get("torch"),
            "nccl": hello["on"].get("nccl"), "nccl_lib": hello["on"].get("nccl_lib"), "api_version": api,
            "rounds": args.rounds, "iters": args.iters, "handles": handles, "plugin_states": statuses,
            "received": dict(received),
            "plugin_loss": {k: v for k, v in loss.items() if not k.startswith("ncclprof_sink_")},
            "sink_counters": {k: v for k, v in loss.items() if k.startswith("ncclprof_sink_")},
            "p2p_per_alltoall": received.get("P2P", 0) / a2a if a2a else None}
    print(format_table(rows))
    print(verdict(rows, meta))
    print(f"sink received {dict(received)}; plugin states {statuses}", flush=True)
    if args.out:
        for p in write_outputs(args.out, rows, meta):
            print(f"wrote {p}")
    if args.write_results:
        from results import write_section
        write_section("ncclprof-overhead", markdown(rows, meta))
    return 0


if __name__ == "__main__":
    a = parse_args()
    sys.exit(worker(a) if a.worker else run(a))
