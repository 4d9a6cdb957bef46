"""Import speed: how fast ccld reads the traces people already have (issue 19), per format, in rows/s.

Generates in a temporary directory a per-op table of ROWS rows (CSV, CSV.gz, JSON Lines; Parquet when
pyarrow is importable), Kineto traces of KINETO collectives in all, and NCCL Inspector logs (verbose
form) of INSPECTOR records, then times each reader alone (optable.read_table, kineto.read_traces,
inspector.read_logs: parsing and validation, not the join into a job), and separately the whole
`ccld diagnose --nccl-inspector` (read, join, temporary store, timeline, detectors) on the Inspector logs.
Units: rows/s over wall time and over CPU time (user + system of this process); generation is not timed.
Caveat: a shared 2-vCPU machine moves these by ~1.5x; ratios within one run compare best.

    .venv/bin/python bench/import_speed.py                  # print
    .venv/bin/python bench/import_speed.py --write-results  # and update bench/RESULTS.md (import_speed)
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import functools
import gzip
import io
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from export_bench import machine  # noqa: E402  (bench/ is on sys.path when run as a script)
from results import write_section  # noqa: E402
from ccld import cli  # noqa: E402
from ccld.diagnose.inspector import read_logs  # noqa: E402
from ccld.diagnose.kineto import read_traces  # noqa: E402
from ccld.diagnose.optable import read_table  # noqa: E402

RANKS = 8                 # the ops table's ranks
WORLD = 4                 # Kineto traces and Inspector logs: one per rank
T0_S = 1_790_000_000.0    # Unix seconds: no mtime shift
STEP_S = 0.01
COLUMNS = ["rank", "op", "start", "duration", "step", "bytes"]


def ops_rows(n: int) -> List[Dict[str, Any]]:
    """n rows: per step each rank's forward then its all_reduce (half compute, half collectives)."""
    out = []
    for i in range(n):
        rank, step, coll = i % RANKS, i // (2 * RANKS), (i // RANKS) % 2
        start = T0_S + step * STEP_S + coll * 0.006
        out.append({"rank": rank, "op": "all_reduce" if coll else "forward", "start": round(start, 6),
                    "duration": 0.004 if coll else 0.006, "step": step, "bytes": 4096 if coll else ""})
    return out


def write_ops(d: str, n: int) -> Dict[str, str]:
    rows = ops_rows(n)
    buf = io.StringIO()
    w = csv.DictWriter(buf, COLUMNS)
    w.writeheader()
    w.writerows(rows)
    paths = {"csv": os.path.join(d, "ops.csv"), "csv.gz": os.path.join(d, "ops.csv.gz"),
             "jsonl": os.path.join(d, "ops.jsonl")}
    with open(paths["csv"], "w") as f:
        f.write(buf.getvalue())
    with gzip.open(paths["csv.gz"], "wt", compresslevel=6) as f:
        f.write(buf.getvalue())
    with open(paths["jsonl"], "w") as f:
        f.writelines(json.dumps({k: v for k, v in r.items() if v != ""}) + "\n" for r in rows)
    with contextlib.suppress(ImportError):
        import pyarrow as pa  # type: ignore[import-not-found]  # optional, as for ccld
        import pyarrow.parquet as pq  # type: ignore[import-not-found]
        paths["parquet"] = os.path.join(d, "ops.parquet")
        pq.write_table(pa.Table.from_pylist([{**r, "bytes": r["bytes"] or None} for r in rows]), paths["parquet"])
    return paths


def write_kineto(d: str, n: int) -> str:
    """WORLD traces of n // WORLD record_param_comms each (torch.profiler's CPU-op form)."""
    os.makedirs(d)
    for rank in range(WORLD):
        evs = [{"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": 1, "tid": 1,
                "ts": i * STEP_S * 1e6 + 100, "dur": 400.0,
                "args": {"Collective name": "allreduce", "Process Group Name": "0", "Seq": i + 1,
                         "In msg nelems": 1024, "dtype": "Float"}} for i in range(n // WORLD)]
        doc = {"distributedInfo": {"rank": rank, "world_size": WORLD, "backend": "nccl"},
               "baseTimeNanoseconds": int(T0_S * 1e9), "traceEvents": evs}
        with gzip.open(os.path.join(d, f"rank{rank}.json.gz"), "wt", compresslevel=6) as f:
            json.dump(doc, f)
    return d


def write_inspector(d: str, n: int) -> str:
    """WORLD logs (one a process) of n // WORLD verbose coll_perf records each."""
    os.makedirs(d)
    for rank in range(WORLD):
        with open(os.path.join(d, f"node0-pid{4000 + rank}.log"), "w") as f:
            for sn in range(1, n // WORLD + 1):
                us = int((T0_S + sn * STEP_S) * 1e6)
                f.write(json.dumps({
                    "header": {"id": "0x7f8c496ae9f661", "comm_name": "unknown", "rank": rank, "n_ranks": WORLD,
                               "nnodes": 1},
                    "metadata": {"inspector_output_format_version": "v4.0", "dump_timestamp_us": us + 5000,
                                 "hostname": "node0", "pid": 4000 + rank},
                    "coll_perf": {"coll": "AllReduce", "coll_sn": sn, "coll_msg_size_bytes": 1 << 20,
                                  "coll_exec_time_us": 400, "coll_timing_source": "kernel_gpu",
                                  "event_trace_ts": {"coll_start_ts": us - 50, "coll_stop_ts": us - 40,
                                                     "kernel_events": [{"channel_id": 0, "kernel_start_ts": us,
                                                                        "kernel_stop_ts": us + 400}]}}},
                                   separators=(",", ":")) + "\n")
    return d


def table_rows(path: str) -> int:
    return len(read_table(path).rows)


def timed(fn: Callable[[], int]) -> Dict[str, float]:
    """rows and wall/CPU seconds of fn() (which returns the rows it read)."""
    w0, c0 = time.perf_counter(), time.process_time()
    rows = fn()
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    return {"rows": rows, "wall_s": wall, "cpu_s": cpu, "rows_s": rows / wall, "rows_cpu_s": rows / cpu}


def diagnose(d: str) -> int:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main(["diagnose", "--nccl-inspector", d])
    if rc != 0:
        raise SystemExit(f"diagnose failed ({rc})")
    first = out.getvalue().splitlines()[0]  # "...; N collectives in ..."
    return int(first.split("; ")[1].split()[0])


def fmt_n(x: float) -> str:
    return f"{x / 1e6:.2f} M" if x >= 1e6 else f"{x / 1e3:.0f} k"


def report(results: List[Dict[str, Any]], parquet: bool, command: str) -> str:
    lines = [
        "### Import speed: reading per-op tables, Kineto traces and NCCL Inspector logs",
        "",
        f"`{command}` on {machine()}, a 2-vCPU VM shared with a CI run while this ran (its figures move by up "
        f"to 1.5x; CPU time, user + system of this process, is the steadier one); "
        f"{datetime.date.today().isoformat()}. Synthetic inputs, made in a temporary directory and not timed: "
        f"a per-op table ({RANKS} ranks; half `forward`, half `all_reduce` rows with step and bytes), "
        f"{WORLD} Kineto traces (.json.gz, `record_param_comms` with Seq), {WORLD} NCCL Inspector logs "
        "(verbose records: event_trace_ts with one kernel channel). `reader`: the reader alone (parse and "
        "validate into rows); `diagnose`: the whole `ccld diagnose --nccl-inspector` (read, join, temporary "
        "store, timeline, detectors), rows = collectives read. "
        + ("Parquet: read with pyarrow." if parquet else "Parquet: not measured (pyarrow is not installed "
                                                        "here; ccld reads Parquet only with it)."),
        "",
        "| input | format | MiB | run | rows | wall s | CPU s | rows/s | rows/CPU-s |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(f"| {r['input']} | {r['format']} | {r['mib']:.1f} | {r['run']} | {r['rows']:,} | "
                     f"{r['wall_s']:.1f} | {r['cpu_s']:.1f} | {fmt_n(r['rows_s'])} | {fmt_n(r['rows_cpu_s'])} |")
    if not parquet:
        lines.append("| per-op table | parquet | - | reader | not measured: pyarrow not installed | | | | |")
    return "\n".join(lines + ["", summary(results)]) + "\n"


def summary(results: List[Dict[str, Any]]) -> str:
    """One paragraph: the slowest and fastest readers, and what the rest of diagnose costs."""
    readers = sorted((r for r in results if r["run"] == "reader"), key=lambda r: r["rows_cpu_s"])
    slow, fast = readers[0], readers[-1]
    text = (f"Every reader validates its rows in plain Python (csv, json, zlib; Parquet's columns are decoded by "
            f"pyarrow): {fmt_n(slow['rows_cpu_s'])} rows/CPU-s ({slow['input']}, {slow['format']}) to "
            f"{fmt_n(fast['rows_cpu_s'])} ({fast['input']}, {fast['format']}), so a million-row table reads in seconds.")
    parquet = next((r for r in readers if r["format"] == "parquet"), None)
    csv_r = next((r for r in readers if r["format"] == "csv"), None)
    if parquet and csv_r:
        text += (f" Parquet reads at {parquet['rows_cpu_s'] / csv_r['rows_cpu_s']:.1f}x the CSV's rows per CPU-s "
                 f"from {parquet['mib'] / csv_r['mib']:.2f}x its bytes: pyarrow decodes the columns in C++, but every "
                 "row still becomes a Python dict (iter_batches, to_pylist) and is validated as a CSV row is; the "
                 "first read also pays pyarrow's import.")
    diag = next((r for r in results if r["run"] == "diagnose"), None)
    read = next((r for r in readers if r["input"] == "NCCL Inspector logs"), None)
    if diag and read:
        text += (f" The whole diagnose on the Inspector logs takes {diag['cpu_s'] / read['cpu_s']:.1f}x the reader's "
                 "CPU time: the rest is the job's frames, the temporary store and the replay through the timeline "
                 "and detectors, the store's own path.")
    return text


def size_mib(path: str) -> float:
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)) / 2**20
    return os.path.getsize(path) / 2**20


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000, help="per-op table rows")
    p.add_argument("--kineto", type=int, default=100_000, help="Kineto collectives, all traces together")
    p.add_argument("--inspector", type=int, default=100_000, help="Inspector records, all logs together")
    p.add_argument("--dir", default=None, help="where the inputs go (deleted after)")
    p.add_argument("--write-results", action="store_true", help="update the import_speed section of RESULTS.md")
    args = p.parse_args()
    root = tempfile.mkdtemp(prefix="ccld-import-", dir=args.dir)
    results: List[Dict[str, Any]] = []
    try:
        ops = write_ops(root, args.rows)
        kin = write_kineto(os.path.join(root, "kineto"), args.kineto)
        ins = write_inspector(os.path.join(root, "inspector"), args.inspector)
        runs: List[Tuple[str, str, str, str, Callable[[], int]]]
        runs = [("per-op table", fmt, path, "reader", functools.partial(table_rows, path)) for fmt, path in ops.items()]
        runs += [("Kineto traces", "json.gz", kin, "reader", lambda: len(read_traces([kin]).table.rows)),
                 ("NCCL Inspector logs", "jsonl", ins, "reader", lambda: len(read_logs(ins).table.rows)),
                 ("NCCL Inspector logs", "jsonl", ins, "diagnose", lambda: diagnose(ins))]
        for name, fmt, path, run, fn in runs:
            r: Dict[str, Any] = {"input": name, "format": fmt, "mib": size_mib(path), "run": run, **timed(fn)}
            results.append(r)
            print(f"{name:20s} {fmt:8s} {run:8s} {r['rows']:>9,} rows {r['wall_s']:6.1f} s  CPU {r['cpu_s']:6.1f} s"
                  f"  {fmt_n(r['rows_s'])} rows/s", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    command = (".venv/bin/python bench/import_speed.py " + " ".join(sys.argv[1:])).strip()
    text = report(results, "parquet" in ops, command)
    print(text)
    if args.write_results:
        write_section("import_speed", text)
        print("updated bench/RESULTS.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
