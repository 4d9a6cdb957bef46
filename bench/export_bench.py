"""Export benchmark: `ccld export` of synthetic stores of 1 M and 10 M events: events/s and peak memory.

Each store is generated once under /tmp with events.encode_batch + StoreWriter, in batches like an
agent's: every 100 ms, one frame per node holding its ranks' collective events (enter, start, end,
with count/dtype/nbytes as NCCL reports them), /proc states every 0.5 s, loss counters every second,
a few send/recv, and the clock sample. Stores come in four shapes: "table", as agents write since
schema 1.9 (a frame's coll/start/end as one table, ccld/wire/table.py, made by the agent's own frame
encoder, ccld/tracer/frames.py), "packed", as agents wrote in 1.8 (coll/start/end as column blocks,
their int columns packed as little-endian ints),
"blocks", as agents wrote from 1.4 to 1.7 (the same blocks, columns as lists), and "maps", every
event a map (schema <= 1.3, and what an agent with columns=False sends). Every run is a child process of its own, so its peak RSS
(ru_maxrss from wait4) and its CPU time (user + system) are that run's alone. Runs: `decode`
(MessagePack decoding of the store alone), `perfetto` (the writer, findings skipped, with the C
accelerator ccld/export/_hotpath.c when built), `perfetto-python` (the same with CCLD_PURE_PYTHON=1:
the Python loops alone, so the accelerator's gain is a ratio of one run), `json` (Chrome JSON), and
`perfetto+findings` (as `ccld export` runs by default: the store is replayed through the detectors for
findings first); on request `model` (the trace model with a sink that writes nothing; with the
accelerator its per-rank calls into that sink are Python calls, so it is no longer a lower bound).
Units: events read from the store per second of wall time and per CPU-second (the box is shared:
CPU time is the steadier figure), MiB (2^20 bytes). Stores and traces are deleted afterwards.
Caveat: on a shared machine the figures move by ~1.5x from run to run.

    .venv/bin/python bench/export_bench.py                  # 1 M and 10 M events, both shapes; print
    .venv/bin/python bench/export_bench.py --write-results  # and update bench/RESULTS.md (export section)
    .venv/bin/python bench/export_bench.py --sizes 200000 --shapes blocks   # a quick look
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import msgpack  # noqa: E402
import numpy as np  # noqa: E402

from ccld import wire as ev  # noqa: E402
from ccld.bpf.rows import pack_column  # noqa: E402
from ccld.tracer import frames as agent_frames  # noqa: E402
from ccld.tracer.nodeclock import NodeClock  # noqa: E402
from ccld.store import StoreWriter  # noqa: E402
from results import write_section  # noqa: E402  (bench/ is on sys.path when run as a script)

RESULTS = os.path.join(ROOT, "bench", "RESULTS.md")
GOAL_EVENTS_S = 1_000_000   # events written per second
WORLD, NODES = 16, 2        # 8 ranks per node, one agent per node
COLL_PERIOD_S = 0.002       # a collective every 2 ms (a busy data-parallel job)
FRAME_S = 0.1               # agents ship every 100 ms
T0 = 1_764_400_000.0
OPS = [("allreduce", 1 << 22), ("allreduce", 1 << 20), ("allgather", 1 << 18), ("broadcast", 1 << 10)]


def packed(frame: bytes) -> bytes:
    """The frame with its blocks' int columns packed (schema 1.8), as agents write them since."""
    env = msgpack.unpackb(frame, raw=False)
    for b in env.get("blocks", ()):
        b["cols"] = {k: pack_column(np.array(v, np.int64)) if all(type(x) is int for x in v) else v
                     for k, v in b["cols"].items()}
    return msgpack.packb(env, use_bin_type=True)


def generate(path: str, events: int, seed: int = 1, shape: str = "blocks") -> Dict[str, Any]:
    """Write a store of about `events` events, frames of `shape` (table, packed, blocks or maps); returns what
    was written."""
    rnd = random.Random(seed)
    per_node = WORLD // NODES
    boot = [T0 - 3600.0 * (n + 1) for n in range(NODES)]  # each node's monotonic epoch differs

    def mono(n: int, t: float) -> int:
        return int((t - boot[n]) * 1e9)

    w = StoreWriter(path)
    comm = "job:29500/nccl:0x7f3a"
    pending: List[List[ev.Event]] = [[] for _ in range(NODES)]
    for r in range(WORLD):
        n = r // per_node
        pending[n].append(ev.RankInfo(pid=1000 + r, rank=r, world_size=WORLD, local_rank=r % per_node,
                                      node=f"node{n}", job="job:29500", ts_ns=mono(n, T0)))
        pending[n].append(ev.CommInit(pid=1000 + r, rank=r, ts_ns=mono(n, T0), backend="nccl", comm=comm,
                                      group_rank=r, group_size=WORLD))
    written = batch = seq = 0
    t = T0 + 0.01
    next_frame = T0 + FRAME_S
    frames = 0
    while written < events:
        seq += 1
        op, count = OPS[seq % len(OPS)]
        enters = [t + rnd.random() * 200e-6 for _ in range(WORLD)]
        last = max(enters)
        done = last + 0.001 + rnd.random() * 100e-6
        for r in range(WORLD):
            n = r // per_node
            pid = 1000 + r
            pending[n] += [ev.CollEnter(pid=pid, rank=r, ts_ns=mono(n, enters[r]), backend="nccl", comm=comm, seq=seq,
                                        op=op, tid=pid, count=count, dtype="bfloat16", nbytes=2 * count),
                           ev.WorkStart(pid=pid, rank=r, ts_ns=mono(n, last), comm=comm, seq=seq),
                           ev.WorkEnd(pid=pid, rank=r, ts_ns=mono(n, done + r * 1e-6), comm=comm, seq=seq)]
        if seq % 97 == 0:  # pipeline-style send/recv between neighbours now and then
            for r in range(0, WORLD, 2):
                n = r // per_node
                pending[n] += [ev.P2P(pid=1000 + r, rank=r, ts_ns=mono(n, done), backend="nccl", comm=comm,
                                      op="send", peer=r + 1, count=count, dtype="bfloat16"),
                               ev.P2P(pid=1001 + r, rank=r + 1, ts_ns=mono(n, done), backend="nccl", comm=comm,
                                      op="recv", peer=r, count=count, dtype="bfloat16")]
        t += COLL_PERIOD_S
        if t >= next_frame:
            frames += 1
            for n in range(NODES):
                evs = pending[n]
                if frames % 5 == 0:
                    evs += [ev.RankState(pid=1000 + r, rank=r, ts_ns=mono(n, t), state="R", cpu_ns=int(t * 1e9) % 10**12)
                            for r in range(n * per_node, (n + 1) * per_node)]
                if frames % 10 == 0:
                    evs.append(ev.LossCounters(ts_ns=mono(n, t), counters={"ringbuf_lost": 0, "queue_dropped": frames // 100}))
                evs.append(ev.ClockSample(mono_ns=mono(n, t), wall_ns=int(t * 1e9), ts_ns=mono(n, t)))
                batch += 1
                if shape == "table":
                    frame = agent_frames.encode(f"agent-{n}", f"node{n}", batch, evs, NodeClock())
                else:
                    frame = ev.encode_batch(f"agent-{n}", f"node{n}", batch, evs, columns=shape != "maps")
                w.append(packed(frame) if shape == "packed" else frame, t + 0.002)
                written += len(evs)
                pending[n] = []
            next_frame += FRAME_S
    w.close()
    meta_path = os.path.join(path, "store.json")
    with open(meta_path) as f:
        meta = json.load(f)
    meta["closed_at"] = t + 0.1  # recorded time, not the generator's clock
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    size = sum(os.path.getsize(os.path.join(path, x)) for x in os.listdir(path))
    return dict(events=written, collectives=seq, frames=batch, store_mib=size / 2**20, recorded_s=t - T0)


CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
mode, store, out = sys.argv[2:5]
import msgpack, ccld.export.perfetto, ccld.export.chrome, ccld.export.model  # imports are not the export's rate
from perfetto.protos.perfetto.trace import perfetto_trace_pb2
from ccld.export import accel
t0, c0 = time.monotonic(), time.process_time()  # the run's own time: not the interpreter's start
if mode == "decode":
    import msgpack
    from ccld.store import read_store
    n = 0
    for _, f in read_store(store):
        env = msgpack.unpackb(f, raw=False, strict_map_key=False)
        n += len(env["events"]) + sum(b["n"] for b in env.get("blocks") or ())
    stats = {"events": n}
elif mode == "model":
    from ccld.export.perfetto import run_export
    class NullSink:  # the model's calls, each doing nothing: what is left is reading and matching
        def __init__(self, f):
            pass
        def __getattr__(self, name):
            return lambda *a, **k: 0
    stats = run_export(store, out, NullSink, "wb", findings=[])
else:
    from ccld.export import export_trace
    stats = export_trace(store, out, "json" if mode == "json" else "perfetto",
                         findings=None if mode == "perfetto+findings" else [])
    stats["accel"] = accel.hot is not None
stats["wall_s"] = time.monotonic() - t0
stats["cpu_s"] = time.process_time() - c0
if mode == "model":
    stats.pop("bytes", None)
print(json.dumps({k: stats[k] for k in ("events", "wall_s", "cpu_s", "bytes", "replay_s", "slices", "flows", "accel")
                  if k in stats}))
"""
RUNS = ("decode", "model", "perfetto", "perfetto-python", "json", "perfetto+findings")
DEFAULT_RUNS = ("decode", "perfetto", "perfetto-python", "json", "perfetto+findings")


def run_child(mode: str, store: str, out: str) -> Dict[str, Any]:
    """One run in a child process; {"failed": why} when it fails (the others still run)."""
    with tempfile.TemporaryFile() as err:
        env = dict(os.environ, CCLD_PURE_PYTHON="1" if mode == "perfetto-python" else "")
        p = subprocess.Popen([sys.executable, "-c", CHILD, ROOT, "perfetto" if mode == "perfetto-python" else mode,
                              store, out], stdout=subprocess.PIPE, stderr=err, env=env)
        data = p.stdout.read()
        _, status, usage = os.wait4(p.pid, 0)  # not p.wait(): wait4 gives the child's own rusage
        p.returncode = os.waitstatus_to_exitcode(status)
        if p.returncode != 0:
            err.seek(0)
            last = (err.read().decode(errors="replace").strip().splitlines() or ["?"])[-1]
            print(f"export_bench: {mode} on {store} failed (exit {p.returncode}): {last}", file=sys.stderr)
            return {"failed": last}
    r = json.loads(data)
    r["peak_mib"] = usage.ru_maxrss / 1024  # Linux: KiB
    r["events_s"] = r["events"] / r["wall_s"]
    r["events_cpu_s"] = r["events"] / r["cpu_s"]
    if os.path.exists(out):
        os.unlink(out)
    return r


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} CPUs ({cpu}), {ram:.0f} GiB RAM, Python {platform.python_version()}"


def fmt_n(x: float) -> str:
    return f"{x / 1e6:.2f} M" if x >= 1e6 else f"{x / 1e3:.0f} k"


def report(sizes: List[Dict[str, Any]], command: str) -> str:
    lines = [
        "### Export: `ccld export` (Perfetto protobuf and Chrome JSON), streamed",
        "",
        f"`{command}` on {machine()}, a 2-vCPU VM whose speed moves by up to 1.5x from hour to hour (CPU "
        f"time, user + system of the run, is the steadier figure; ratios within one run compare best); "
        f"{datetime.date.today().isoformat()}. Synthetic stores: {WORLD} ranks on {NODES} nodes, a collective "
        f"every {COLL_PERIOD_S * 1000:.0f} ms (enter, start, end per rank), /proc states, losses, p2p, one frame "
        f"per node every {FRAME_S * 1000:.0f} ms; shape `table`: a frame's coll/start/end as one table (schema "
        "1.9, what agents send now, made by their frame encoder), `packed`: as column blocks with packed "
        "int columns (1.8), `blocks`: the same blocks with list columns (1.4 to "
        "1.7), `maps`: every event a map (stores from before 1.4). Each run is a child "
        "process: events/s = events read / its wall time, events/CPU-s = events read / its CPU time (both "
        "from the export's start, after its imports); peak = its max RSS. `perfetto`: with the C accelerator "
        "(ccld/export/_hotpath.c) " + accel_state(sizes) + "; `perfetto-python`: the same export with "
        "CCLD_PURE_PYTHON=1 (the Python loops it mirrors; the traces are byte-identical, "
        "tests/unit/test_export_hotpath.py).",
        "",
        f"Goal: >= {GOAL_EVENTS_S / 1e6:.0f} M events/s written; memory independent of store size.",
        "",
        "| store events | shape | store MiB | run | wall s | CPU s | events/s | events/CPU-s | vs goal (CPU) "
        "| peak RSS MiB | trace MiB |",
        "|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in sizes:
        for mode, r in s["runs"].items():
            if "failed" in r:
                lines.append(f"| {s['events']:,} | {s['shape']} | {s['store_mib']:.0f} | {mode} | failed: "
                             f"{r['failed'][:80]} | | | | | | |")
                continue
            trace = f"{r['bytes'] / 2**20:.0f}" if "bytes" in r else "-"
            extra = f" (replay {r['replay_s']:.0f} s)" if r.get("replay_s") else ""
            goal = "-" if mode in ("decode", "model") else f"{r['events_cpu_s'] / GOAL_EVENTS_S:.2f}"
            lines.append(f"| {s['events']:,} | {s['shape']} | {s['store_mib']:.0f} | {mode}{extra} | {r['wall_s']:.1f} "
                         f"| {r['cpu_s']:.1f} | {fmt_n(r['events_s'])} | {fmt_n(r['events_cpu_s'])} | {goal} "
                         f"| {r['peak_mib']:.0f} | {trace} |")
    for shape in sorted({s["shape"] for s in sizes}):
        ss = [s for s in sizes if s["shape"] == shape and "peak_mib" in s["runs"].get("perfetto", {})]
        if len(ss) >= 2:
            a, b = ss[0], ss[-1]
            pa, pb = a["runs"]["perfetto"]["peak_mib"], b["runs"]["perfetto"]["peak_mib"]
            line = (f"Memory ({shape}): at {b['events'] / a['events']:.0f}x the events the Perfetto writer's peak RSS "
                    f"goes {pa:.0f} -> {pb:.0f} MiB")
            if all("peak_mib" in x["runs"].get("decode", {}) for x in (a, b)):
                da, db = a["runs"]["decode"]["peak_mib"], b["runs"]["decode"]["peak_mib"]
                line += (f"; reading the store alone (`decode`) {da:.0f} -> {db:.0f} MiB (read_store holds one "
                         f"segment, up to 64 MiB); the writer's own share {pa - da:.0f} and {pb - db:.0f} MiB")
            lines += ["", line + "."]
    ratios = [f"{s['events']:,} {s['shape']}: {s['runs']['perfetto-python']['cpu_s'] / s['runs']['perfetto']['cpu_s']:.2f}x"
              for s in sizes if all("cpu_s" in s["runs"].get(k, {}) for k in ("perfetto", "perfetto-python"))]
    if ratios:
        lines += ["", "The accelerator's gain (CPU time of perfetto-python / perfetto, same run): " + ", ".join(ratios) + "."]
    splits = [split_line(s) for s in sizes if split_line(s)]
    if splits:
        lines += ["", "Where the time goes (CPU): " + "; ".join(splits) + "."]
    lines += ["", PROFILE]
    return "\n".join(lines) + "\n"


# What a sampling profile of the Perfetto writer showed (not re-measured by this script: run
# `py-spy record -f raw` on an export of the 1 M-event blocks store to see it again).
PROFILE = (
    "Where the time goes now (perf and py-spy on the 1 M-event blocks store with the accelerator, "
    "2026-11-30): the C row loops and per-rank slices take about 60% (mostly CPython's own work they ask "
    "for: allocating and freeing the open-collective entries, their (process, comm, seq) keys and the "
    "group items, dict lookups, int comparisons), MessagePack decoding ~12%, and Python once per "
    "collective ~20% (arrival order, flow roles, the group's cached argument pieces, the communicator "
    "slice's lanes). The Python path it replaced spent ~5 us per rank of each collective on the same work "
    "in bytecode: filing and finding its open collective, lanes, and 4 TracePackets from ~25 cached byte "
    "pieces. Memory is the same either way. With findings (`ccld export`'s default) the replay through the "
    "detectors (`ccld diagnose`'s) comes first and dominates (3-4x faster than on 2026-11-29, 12 -> 3 s for "
    "the 1 M store: NCCL enters of ranks without CUPTI now take the timeline's fast path, and the clock "
    "refinement is recomputed at most twice a second); `--findings FILE.jsonl` (the collector's) or "
    "`--no-findings` skip it, and `ccld collector --perfetto` uses the findings it made live.")


def accel_state(sizes: List[Dict[str, Any]]) -> str:
    runs = [s["runs"]["perfetto"] for s in sizes if "accel" in s["runs"].get("perfetto", {})]
    if not runs:
        return "(no perfetto run)"
    return "built and used" if all(r["accel"] for r in runs) else "NOT built here: both rows are Python"


def split_line(s: Dict[str, Any]) -> str:
    """decode / matching / encoding shares of the Perfetto writer's CPU time, from the decode, model and
    perfetto runs of one store."""
    r = s["runs"]
    if not all("cpu_s" in r.get(k, {}) for k in ("decode", "model", "perfetto")):
        return ""
    n = s["events"]
    dec, mod, pf = (r[k]["cpu_s"] for k in ("decode", "model", "perfetto"))
    return (f"{s['shape']}: {pf:.1f} s for {n / 1e6:.0f} M events = {pf / n * 1e6:.2f} us/event: reading and "
            f"decoding {dec / n * 1e6:.2f}, the model (clock, matching, lanes, flows) {(mod - dec) / n * 1e6:.2f}, "
            f"encoding and writing {(pf - mod) / n * 1e6:.2f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="1000000,10000000", help="store sizes in events (comma-separated)")
    p.add_argument("--shapes", default="table,packed,blocks,maps",
                   help="store shapes: table, packed, blocks, maps (comma-separated)")
    p.add_argument("--runs", default=",".join(DEFAULT_RUNS), help=f"runs, of {', '.join(RUNS)} (comma-separated)")
    p.add_argument("--dir", default="/tmp", help="where the stores and traces go (deleted after)")
    p.add_argument("--write-results", action="store_true", help=f"update the export section of {RESULTS}")
    args = p.parse_args()
    runs = [r for r in args.runs.split(",") if r]
    bad = [r for r in runs if r not in RUNS]
    if bad:
        p.error(f"unknown run {bad[0]!r}")
    sizes = []
    os.makedirs(args.dir, exist_ok=True)
    for shape in [x for x in args.shapes.split(",") if x]:
        if shape not in ("table", "packed", "blocks", "maps"):
            p.error(f"unknown shape {shape!r}")
        for n in [int(float(x)) for x in args.sizes.split(",")]:
            root = tempfile.mkdtemp(prefix="ccld-export-bench-", dir=args.dir)
            try:
                store = os.path.join(root, "store")
                t0 = time.monotonic()
                s = generate(store, n, shape=shape)
                s["shape"] = shape
                print(f"store: {s['events']:,} events as {shape}, {s['store_mib']:.0f} MiB, {s['recorded_s']:.0f} s "
                      f"recorded (generated in {time.monotonic() - t0:.0f} s)", flush=True)
                s["runs"] = {}
                for mode in runs:
                    out = os.path.join(root, "trace.json" if mode == "json" else "trace.pftrace")
                    r = s["runs"][mode] = run_child(mode, store, out)
                    if "failed" in r:
                        continue
                    print(f"  {mode:18s} {r['wall_s']:7.1f} s  CPU {r['cpu_s']:6.1f} s  {fmt_n(r['events_s'])} events/s  "
                          f"{fmt_n(r['events_cpu_s'])} events/CPU-s  peak {r['peak_mib']:.0f} MiB" +
                          (f"  trace {r['bytes'] / 2**20:.0f} MiB" if "bytes" in r else ""), flush=True)
                sizes.append(s)
            finally:
                shutil.rmtree(root, ignore_errors=True)
    command = ".venv/bin/python bench/export_bench.py " + " ".join(sys.argv[1:])
    text = report(sizes, command.strip())
    print(text)
    if args.write_results:
        write_section("export", text)
        print(f"updated {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
