"""What would split the collector's work, measured: one collector's ingest of a job's frames against
the same job's frames split by node group (K collectors, each taking the frames of a contiguous 1/K of
the nodes) and by communicator (each node sending its world communicator's events to one collector and
its 8-rank group communicator's to another, a frame to each, as a shipper with two collectors would).

The job is collector_scale.py's (8 ranks and one agent per node; `rate` world all-reduces a second
plus one node-group collective each time; enter, start and end on every rank; a frame per node every
FRAME_S, the agent's drain period POLL_MS (500 ms; 250 and 100 ms before), with events, else a heartbeat once a second). The frames `--seconds` of the job would send are
built first, then ingested collector after collector in this thread as collector_scale.py
--profile-ingest does (Collector._take: decode, store to disk; then the timeline per GROUP_FRAMES or
GROUP_EVENTS; no detector ticks); the first fifth of each collector's frames (the ranks'
announcements) is not timed. Figures: CPU-seconds of the ingest path (thread time) per collector; the
largest part against the one collector (how much faster the parts, each on its own core, keep up);
the sum against it (what the split costs in all, e.g. per-frame work paid twice). Split by
communicator, each part's frames carry their own clock sample, counted among its events.

What a split would need beyond this, not measured here: by node group no collector sees a whole world
collective, so its hang and lateness detectors would need a merge of per-collective summaries from
every part (who entered, first and last enter, who ended); by communicator each collector sees whole
collectives, but rank records (exits, stops, scheduler state) and the wait chains that cross
communicators would have to be shared. Caveat: split by node group, a part's world collectives never
complete (the other parts' members never end them there), so the work done when a collective completes
(its summary, the clock refinement, its eviction) is not done in the parts: they cost less than a real
split would, whose merge would do that work once per collective; the by-communicator figures have no
such gap.

    .venv/bin/python bench/split_work.py [--ranks 4096,16384] [--rates 2,10] [--seconds 4] [--parts 2,4] [--write-results]
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from collector_scale import RANKS_PER_NODE, ingest_cpu, job_frames  # noqa: E402
from results import write_section  # noqa: E402


def _ingest(frames: List[bytes]) -> Dict[str, Any]:
    gc.collect()  # the previous collector's timeline (kept by reference cycles) is not this one's cost
    return ingest_cpu(frames)


def measure(ranks: int, rate: float, seconds: float, parts: List[int], say) -> List[Dict[str, Any]]:
    nodes = ranks // RANKS_PER_NODE
    whole = job_frames(ranks, rate, seconds)
    one = _ingest([f for _, f in whole])
    rows = [dict(one, split="one collector", parts=1, max_cpu_s=one["cpu_s"], sum_cpu_s=one["cpu_s"])]
    for k in parts:
        got = [_ingest([f for n, f in whole if n * k // nodes == i]) for i in range(k)]
        rows.append({"split": "by node group", "parts": k, "frames": sum(g["frames"] for g in got),
                     "events": sum(g["events"] for g in got), "max_cpu_s": max(g["cpu_s"] for g in got),
                     "sum_cpu_s": sum(g["cpu_s"] for g in got)})
    got = [_ingest([f for _, f in job_frames(ranks, rate, seconds, only)]) for only in ("world", "group")]
    rows.append({"split": "by communicator (world; node groups)", "parts": 2,
                 "frames": sum(g["frames"] for g in got), "events": sum(g["events"] for g in got),
                 "max_cpu_s": max(g["cpu_s"] for g in got), "sum_cpu_s": sum(g["cpu_s"] for g in got),
                 "each": [round(g["cpu_s"], 2) for g in got]})
    for r in rows:
        r.update(ranks=ranks, rate=rate, speedup=one["cpu_s"] / r["max_cpu_s"], cost=r["sum_cpu_s"] / one["cpu_s"],
                 per_part_per_cpu_s=r["events"] / r["sum_cpu_s"])
        say(f"{ranks:,} ranks x {rate:g}/s, {r['split']} ({r['parts']}): {r['frames']:,} frames, {r['events']:,} "
            f"events; CPU-s largest part {r['max_cpu_s']:.2f}, all parts {r['sum_cpu_s']:.2f}; "
            f"x{r['speedup']:.2f} faster than one, x{r['cost']:.2f} the CPU in all")
    return rows


def write_results(rows: List[Dict[str, Any]], cmd: str) -> None:
    out = ["### What would split the collector's work (bench/split_work.py)\n",
           f"`{cmd}` on {time.strftime('%Y-%m-%d')}, one process on a 2-CPU VM shared with other work "
           "(thread CPU time, so the load of other processes moves it little). " + __doc__.split("\n\n")[1]
           .replace("\n", " ") + "\n",
           "| ranks | rate | split | collectors | frames | events | CPU-s, largest part | CPU-s, all parts | "
           "faster than one collector | CPU in all, against one | events per CPU-s |",
           "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        each = f" ({' / '.join(f'{x:.2f}' for x in r['each'])})" if "each" in r else ""
        out.append(f"| {r['ranks']:,} | {r['rate']:g} | {r['split']} | {r['parts']} | {r['frames']:,} | "
                   f"{r['events']:,} | {r['max_cpu_s']:.2f}{each} | {r['sum_cpu_s']:.2f} | x{r['speedup']:.2f} | "
                   f"x{r['cost']:.2f} | {r['per_part_per_cpu_s']:,.0f} |")
    out.append("\n" + __doc__.split("\n\n")[2].replace("\n", " "))
    write_section("split-work", "\n".join(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="4096,16384")
    ap.add_argument("--rates", default="2,10")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--parts", default="2,4", help="node-group splits to measure (collectors)")
    ap.add_argument("--write-results", action="store_true")
    a = ap.parse_args()
    rows = []
    for n in (int(x) for x in a.ranks.split(",")):
        for rate in (float(x) for x in a.rates.split(",")):
            rows += measure(n, rate, a.seconds, [int(x) for x in a.parts.split(",")], lambda s: print(s, flush=True))
    if a.write_results:
        write_results(rows, "python bench/split_work.py " + " ".join(x for x in sys.argv[1:] if x != "--write-results"))


if __name__ == "__main__":
    main()
