"""Diagnosis accuracy and cost: every registered fault scenario run N times and scored strictly,
healthy running as false findings per hour, and the detectors' tick over synthetic timelines of
1,024 / 4,096 / 16,384 ranks.

Accuracy (tests/e2e/scenarios.py's registry: real jobs under `ccld run` or across simulated nodes,
one fault each, root + eBPF + torch): each scenario N times (--runs), scored by scenarios.judge: a
run is correct only when its first hang or slow finding (informational ones excluded) has the
expected class, names exactly the culprit ranks (or exactly the link) and came within the deadline
(hangs 15 s, slowdowns 60 s from the onset). Per scenario: runs, correct (top-1 strict) with its 95 %
Wilson interval, detection rate (a finding of the expected class within the deadline, whatever it
named), onset -> first finding p50 / p90, false findings (every other hang or slow finding). Jobs
that serve several scenarios (a healthy phase, then a fault) run once per run for all of them.
Healthy running: the healthy scenarios (pauses, checkpoints, a batch change, an elastic restart, a
multi-node baseline) and, with --healthy-s S, a run of S seconds of each workload without a fault
(DDP, bare collectives, GPipe, 1F1B, FSDP-style, torch FSDP2, hybrid: 7 workloads, so --healthy-s 600
is 70 minutes): false findings per hour, with their classes.
Tick cost: Diagnoser.diagnose() (hangs, inconsistent, comp-slow, comm-slow localiser, pauses) on an
in-process Timeline fed with Batch objects (no ZeroMQ, no MessagePack: bench/collector_scale.py
measures those): the world communicator plus one 8-rank communicator per node, HISTORY collectives
each, one rank late at every world collective, then one new collective per communicator between
ticks; the last ticks with a world collective left open by one missing rank (a hang being judged).
Times are this machine's, on its shared 2 vCPUs: floors for a dedicated collector.

    .venv/bin/python bench/accuracy.py --runs 1 --no-tick --lock /tmp/ccld-heavy.lock   # each scenario once
    .venv/bin/python bench/accuracy.py --runs 10 --healthy-s 600 --no-tick [--write-results]
    .venv/bin/python bench/accuracy.py --runs 5 --scenarios pp-io,hybrid-io --no-tick [--write-results]
    .venv/bin/python bench/accuracy.py --tick-only [--ranks 1024,4096,16384] [--write-results]
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

ROOT = os.path.dirname(os.path.abspath(__file__)).rsplit(os.sep, 1)[0]
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))

from ccld import wire as ev  # noqa: E402
from ccld.timeline.timeline import Timeline  # noqa: E402
from ccld.diagnose import Diagnoser, commslow  # noqa: E402
from results import write_section  # noqa: E402

RANKS_PER_NODE = 8      # one agent and one node-local communicator per 8 ranks, as on a GPU node
HISTORY = 40            # collectives per communicator before the timed ticks (> slow.MIN_COLLS)
TICKS = 12              # timed ticks per size: 8 healthy-with-a-late-rank, 4 with a hang open
PERIOD_S = 0.5          # one collective per communicator per tick period (the collector ticks every 0.5 s)
LATE_S = 0.040          # rank 1 arrives this late at every world collective (comp-slow has work to do)


# ---- accuracy ------------------------------------------------------------------------------------

def pct(xs: List[float], q: float) -> Optional[float]:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


@contextlib.contextmanager
def held(path: Optional[str]):
    """flock(path) around one job: the machine's heavy-run lock, taken per job, not for the whole run."""
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _brief(f: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    if f is None:
        return None
    ev_ = f.get("evidence") or {}
    return {k: f.get(k) for k in ("kind", "class", "ranks", "link", "comm", "seq", "op", "onset_at", "detected_at")} | \
        {"summary": ev_.get("summary") or ev_.get("reason")}


def score(s, runs: List[Any]) -> Dict[str, Any]:
    """One row: runs is a list of (Verdict, Result) or None for a run whose job failed before the fault."""
    from scenarios import wilson
    done = [x for x in runs if x is not None]
    n, k = len(done), sum(1 for v, _ in done if v.correct)
    lat = [v.latency_s for v, _ in done if v.latency_s is not None]
    return {"key": s.key, "name": s.title, "expect": s.expect, "shape": s.shape, "kind": s.kind, "lat": lat,
            "runs": n, "failed": len(runs) - n, "correct": k,
            "ci95": wilson(k, n), "detected": sum(1 for v, _ in done if v.detected), "p50": pct(lat, 0.5),
            "p90": pct(lat, 0.9), "false": sum(len(v.false) for v, _ in done),
            "healthy_s": sum(getattr(r, "healthy_s", 0.0) for _, r in done) if s.expect is None else 0.0,
            "false_classes": sorted({f.get("class") for v, _ in done for f in v.false})}


def run_accuracy(runs: int, healthy_s: float, say, only: Optional[List[str]] = None, lock: Optional[str] = None,
                 ci_only: bool = False, log: Optional[str] = None) -> Dict[str, Any]:
    import scenarios
    from fault_scenarios import Session
    reg = scenarios.load()
    keys = only if only else [k for k, s in reg.items() if not s.long_run and (s.ci or not ci_only)]
    got: Dict[str, List[Any]] = {k: [] for k in keys}
    spent: Dict[str, float] = {}
    out = open(log, "a") if log else None
    for unit, members in scenarios.plan(keys):
        for i in range(runs if not all(m.long_run for m in members) else 1):
            tmp = tempfile.mkdtemp(prefix=f"ccld-acc-{unit}-")
            with held(lock):
                t0 = time.time()
                s = Session(tmp)
                try:
                    kw = {"seconds": healthy_s} if all(m.long_run for m in members) else {}
                    results = scenarios.run_unit(unit, s, **kw)
                except Exception as e:  # noqa: BLE001 - the job never got to the fault: a failed run, not a miss
                    say(f"{unit} run {i + 1}: setup failed ({tmp}): {type(e).__name__}: {str(e)[:2000]}")
                    results = None
                finally:
                    s.cleanup()
                spent[unit] = spent.get(unit, 0.0) + time.time() - t0
            for m in members:
                if results is None:
                    got[m.key].append(None)
                    if out:
                        out.write(json.dumps({"key": m.key, "run": i + 1, "failed": True, "dir": tmp}) + "\n")
                        out.flush()
                    continue
                r = results[m.key]
                v = scenarios.judge(m, r)
                got[m.key].append((v, r))
                say(f"run {i + 1}: " + scenarios.describe(m, r, v).replace("\n", "\n    "))
                if out:
                    out.write(json.dumps({"key": m.key, "run": i + 1, "correct": v.correct, "detected": v.detected,
                                          "why": v.why,
                                          "latency_s": v.latency_s, "first": _brief(v.first),
                                          "false": [_brief(f) for f in v.false], "baseline_s": r.baseline_s,
                                          "healthy_s": r.healthy_s, "notes": _jsonable(r.notes),
                                          "terminal": r.terminal[:20], "dir": tmp}) + "\n")
                    out.flush()
            say(f"{unit} run {i + 1}: {time.time() - t0:.0f} s")
    return _summary([score(reg[k], got[k]) for k in keys], spent)


def _summary(rows: List[Dict[str, Any]], spent: Dict[str, float]) -> Dict[str, Any]:
    healthy = [r for r in rows if r["expect"] is None]
    return {"rows": rows, "healthy_h": sum(r["healthy_s"] for r in healthy) / 3600,
            "healthy_false": sum(r["false"] for r in healthy),
            "healthy_classes": sorted({c for r in healthy for c in r["false_classes"]}),
            "healthy_by": {r["key"]: (r["healthy_s"], r["false"]) for r in healthy if r["runs"]},
            "spent_s": spent}


def from_logs(paths: List[str]) -> Dict[str, Any]:
    """run_accuracy's summary from --log files (every line one scenario run): scores runs that were
    logged by separate invocations, or by one that was stopped, exactly as run_accuracy would."""
    import scenarios
    from types import SimpleNamespace
    reg = scenarios.load()
    got: Dict[str, List[Any]] = {}
    for path in paths:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                try:
                    d = json.loads(line)
                    key = d["key"]
                except (ValueError, KeyError, TypeError) as e:
                    raise SystemExit(f"accuracy: {path}:{n}: not a logged scenario run ({e})") from None
                if key not in reg:
                    raise SystemExit(f"accuracy: {path}:{n}: scenario {key!r} is not registered")
                if d.get("failed"):
                    got.setdefault(key, []).append(None)
                    continue
                v = SimpleNamespace(correct=d["correct"], detected=d.get("detected", d["correct"]),
                                    latency_s=d.get("latency_s"), false=d.get("false") or [])
                got.setdefault(key, []).append((v, SimpleNamespace(healthy_s=d.get("healthy_s") or 0.0)))
    return _summary([score(reg[k], got[k]) for k in reg if k in got], {})


def _jsonable(x: Any) -> Any:
    try:
        json.dumps(x)
        return x
    except TypeError:
        return repr(x)


GOAL_TOP1 = 0.98          # issue 18: top-1 >= 98 % per class ...
GOAL_RUNS = 10            # ... with >= 10 runs per scenario
GOAL_HANG_P90_S = 10.0    # hangs named p90 <= 10 s after the onset on every shape ...
GOAL_HANG_P90_DDP_S = 5.0  # ... and <= 5 s on DDP-style jobs
GOAL_SLOW_P90_S = 60.0    # slowdowns <= 60 s


def goals_md(a: Dict[str, Any]) -> List[str]:
    """Issue 18's goals against these runs: per class (top-1 with its 95 % interval, the fewest runs of
    one of its scenarios), and the onset -> finding p90 of hangs per shape and of slowdowns."""
    from scenarios import wilson
    rows = [r for r in a["rows"] if r["expect"] is not None and r["runs"]]
    if not rows:
        return []
    out = ["", "Issue 18's goals, from these runs (top-1 >= 98 % per class with >= 10 runs per scenario; "
               "hangs named p90 <= 10 s after the onset on every shape, <= 5 s on DDP; slowdowns p90 <= 60 s):",
           "", "| class | scenarios | runs (fewest of one scenario) | correct | 95 % interval | goal |",
           "|---|---:|---:|---:|---:|---|"]
    for cls in sorted({r["expect"] for r in rows}):
        rs = [r for r in rows if r["expect"] == cls]
        n, k, fewest = sum(r["runs"] for r in rs), sum(r["correct"] for r in rs), min(r["runs"] for r in rs)
        lo, hi = wilson(k, n)
        met = k >= GOAL_TOP1 * n and fewest >= GOAL_RUNS
        why = "met" if met else "not met: " + ", ".join(
            ([f"{100 * k / n:.1f} %"] if k < GOAL_TOP1 * n else []) +
            ([f"a scenario with {fewest} runs"] if fewest < GOAL_RUNS else []))
        out.append(f"| {cls} | {len(rs)} | {n} ({fewest}) | {k}/{n} ({100 * k / n:.1f} %) | "
                   f"{lo * 100:.0f}-{hi * 100:.0f} % | {why} |")
    hangs = [r for r in rows if r["kind"] == "hang"]
    parts = []
    for shape in sorted({r["shape"] for r in hangs}):
        p90 = pct([x for r in hangs if r["shape"] == shape for x in r["lat"]], 0.9)
        if p90 is not None:
            goal = GOAL_HANG_P90_DDP_S if shape == "ddp" else GOAL_HANG_P90_S
            parts.append(f"{shape} {p90:.1f} s ({'met' if p90 <= goal else 'not met'}: <= {goal:.0f})")
    slow = pct([x for r in rows if r["kind"] == "slow" for x in r["lat"]], 0.9)
    if parts or slow is not None:
        out.append("")
    if parts:
        out.append("Onset -> finding p90 of hangs, per shape: " + "; ".join(parts) + ".")
    if slow is not None:
        out.append(f"Slowdowns: p90 {slow:.1f} s ({'met' if slow <= GOAL_SLOW_P90_S else 'not met'}: "
                   f"<= {GOAL_SLOW_P90_S:.0f}).")
    return out


def accuracy_md(a: Dict[str, Any], cmd: str) -> str:
    def s(x):
        return "-" if x is None else f"{x:.1f}"

    def ci(r):
        return "-" if r["ci95"] is None else f"{r['ci95'][0] * 100:.0f}-{r['ci95'][1] * 100:.0f} %"
    out = [f"`{cmd}` on {time.strftime('%Y-%m-%d')}, {platform.node()}: {os.cpu_count()} vCPUs shared with other "
           "work; real jobs under `ccld run` (and across simulated nodes), one fault each; strict scoring "
           "(tests/e2e/scenarios.py: the first hang/slow finding, exactly the culprits or the link, within 15 s "
           "for hangs and 60 s for slowdowns).", "",
           "| scenario | runs | correct (top-1 strict) | 95 % interval | detected in time | "
           "onset -> finding p50 / p90 s | false findings |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for r in a["rows"]:
        if r["expect"] is None:
            continue
        failed = f" ({r['failed']} failed to start)" if r["failed"] else ""
        out.append(f"| {r['name']} | {r['runs']}{failed} | {r['correct']}/{r['runs']} | {ci(r)} | "
                   f"{r['detected']}/{r['runs']} | {s(r['p50'])} / {s(r['p90'])} | {r['false']} |")
    out += goals_md(a)
    healthy = [r for r in a["rows"] if r["expect"] is None and r["runs"]]
    if healthy:
        out += ["", "| healthy run | runs | without a finding | minutes | false findings |", "|---|---:|---:|---:|---:|"]
        for r in healthy:
            out.append(f"| {r['name']} | {r['runs']} | {r['correct']}/{r['runs']} | {r['healthy_s'] / 60:.1f} | "
                       f"{r['false']}" + (f" ({', '.join(r['false_classes'])})" if r["false_classes"] else "") + " |")
        rate = a["healthy_false"] / a["healthy_h"] if a["healthy_h"] else 0.0
        out += ["", f"False findings in healthy running: {a['healthy_false']} in {a['healthy_h'] * 60:.1f} min = "
                    f"**{rate:.1f} per hour**" + (f" (classes: {', '.join(a['healthy_classes'])})"
                                                  if a["healthy_classes"] else "") + "."]
    return "\n".join(out)


# ---- tick cost -----------------------------------------------------------------------------------

class SynthCluster:
    """`ranks` ranks on ranks/8 nodes (one agent each), the world communicator and one 8-rank
    communicator per node, fed to a Timeline as Batch objects with a clock sample each (every agent
    sends each period, as the real shipper does)."""

    def __init__(self, ranks: int, t0: float):
        self.ranks, self.t0 = ranks, t0
        self.nodes = ranks // RANKS_PER_NODE
        self.tl = Timeline()
        self.batch = 0
        self.seq_world = 0
        self.seq_node = 0
        self.pending: Dict[int, List[ev.Event]] = {n: [] for n in range(self.nodes)}
        for r in range(ranks):
            n = r // RANKS_PER_NODE
            self.pending[n] += [
                ev.RankInfo(pid=10_000 + r, rank=r, world_size=ranks, local_rank=r % RANKS_PER_NODE,
                            node=f"n{n}", job="job", ts_ns=self.ns(t0)),
                ev.CommInit(pid=10_000 + r, rank=r, ts_ns=self.ns(t0), backend="gloo", comm="job/gloo:0",
                            group_rank=r, group_size=ranks),
                ev.CommInit(pid=10_000 + r, rank=r, ts_ns=self.ns(t0), backend="gloo", comm=f"job/node{n}",
                            group_rank=r % RANKS_PER_NODE, group_size=RANKS_PER_NODE)]

    def ns(self, t: float) -> int:
        return int((t - self.t0 + 1000.0) * 1e9)  # every node's monotonic clock: 1000 s after boot at t0

    def send(self, t: float) -> None:
        self.batch += 1
        for n in range(self.nodes):
            events = self.pending[n] + [ev.ClockSample(mono_ns=self.ns(t), wall_ns=int(t * 1e9), ts_ns=self.ns(t))]
            self.pending[n] = []
            self.tl.ingest(ev.Batch(agent=f"a{n}", node=f"n{n}", batch=self.batch, version=(1, 1), events=events), t)

    def collectives(self, t: float, world: bool = True, open_missing: Optional[int] = None) -> None:
        """One world collective (rank 1 late by LATE_S; left open without `open_missing` if given),
        unless not `world`, and one collective on every node communicator."""
        self.seq_world += 1 if world else 0
        self.seq_node += 1
        for r in range(self.ranks):
            n, pid = r // RANKS_PER_NODE, 10_000 + r
            if world and r != open_missing:
                enter = t + 0.0005 * ((r * 7919) % 13) / 13 + (LATE_S if r == 1 else 0.0)
                self.pending[n].append(ev.CollEnter(pid=pid, rank=r, ts_ns=self.ns(enter), backend="gloo",
                                                    comm="job/gloo:0", seq=self.seq_world, op="allreduce"))
                if open_missing is None:
                    self.pending[n].append(ev.WorkEnd(pid=pid, rank=r, ts_ns=self.ns(t + LATE_S + 0.003),
                                                      comm="job/gloo:0", seq=self.seq_world))
            self.pending[n].append(ev.CollEnter(pid=pid, rank=r, ts_ns=self.ns(t + 0.1), backend="gloo",
                                                comm=f"job/node{n}", seq=self.seq_node, op="allgather"))
            self.pending[n].append(ev.WorkEnd(pid=pid, rank=r, ts_ns=self.ns(t + 0.102), comm=f"job/node{n}",
                                              seq=self.seq_node))


def tick_cost(ranks: int, say) -> Dict[str, Any]:
    t0 = 1_800_000_000.0
    build = time.perf_counter()
    c = SynthCluster(ranks, t0)
    c.send(t0)
    t = t0 + 1
    for _ in range(HISTORY):
        c.collectives(t)
        c.send(t + PERIOD_S / 2)
        t += PERIOD_S
    build = time.perf_counter() - build
    d = Diagnoser(c.tl)
    spent: List[float] = []
    real = commslow.find_comm_slow

    def timed(tl, now):  # the link localiser's share of each tick (it keeps state: timing it apart would lie)
        x = time.perf_counter()
        try:
            return real(tl, now)
        finally:
            spent.append(time.perf_counter() - x)
    commslow.find_comm_slow = timed
    gc.collect()
    first = time.perf_counter()
    d.diagnose(t)
    first = time.perf_counter() - first
    steady, hang, found = [], [], set()
    hang_at = None
    for i in range(TICKS):
        open_one = i >= TICKS - 4
        if open_one and hang_at is None:  # the world collective rank ranks-1 never enters ...
            hang_at = t
            c.collectives(t, open_missing=ranks - 1)
            t = hang_at + 5.0             # ... judged from past the 5 s floor on
        else:  # while it hangs, only the node communicators go on
            c.collectives(t, world=not open_one)
        c.send(t + PERIOD_S / 2)
        now = t + PERIOD_S
        spent.clear()
        gc.collect()  # a collection of the timeline's millions of objects is the ingest's cost, not the tick's
        cpu, x = time.thread_time(), time.perf_counter()
        out = d.diagnose(now)
        total, cpu = time.perf_counter() - x, time.thread_time() - cpu
        (hang if open_one else steady).append((total, sum(spent), cpu))
        found |= {(f.kind, f.cls) for f in out}
        t += PERIOD_S
    commslow.find_comm_slow = real

    def ms(xs, i, f=statistics.median):
        return f([x[i] for x in xs]) * 1e3
    row = {"ranks": ranks, "comms": len(c.tl.comms), "first_ms": first * 1e3,
           "steady_ms": ms(steady, 0), "steady_max_ms": ms(steady, 0, max), "steady_links_ms": ms(steady, 1),
           "steady_cpu_ms": ms(steady, 2), "steady_cpu_max_ms": ms(steady, 2, max),
           "hang_ms": ms(hang, 0), "hang_max_ms": ms(hang, 0, max), "hang_links_ms": ms(hang, 1),
           "hang_cpu_ms": ms(hang, 2), "hang_cpu_max_ms": ms(hang, 2, max), "found": sorted(found)}
    say(f"{ranks} ranks: built in {build:.1f} s; first tick {first * 1e3:.1f} ms; steady {row['steady_ms']:.1f} ms "
        f"(CPU {row['steady_cpu_ms']:.1f}, links {row['steady_links_ms']:.1f}); with a hang {row['hang_ms']:.1f} ms "
        f"(CPU {row['hang_cpu_ms']:.1f}, links {row['hang_links_ms']:.1f}); found {sorted(found)}")
    return row


def tick_md(rows: List[Dict[str, Any]], cmd: str) -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    out = [f"`{cmd}` on {time.strftime('%Y-%m-%d')}, {platform.node()} ({os.cpu_count()} vCPUs, shared: load "
           f"average {load:.1f} at the end), Python {platform.python_version()}. World communicator + one 8-rank "
           f"communicator per node, {HISTORY} collectives each before timing, rank 1 {LATE_S * 1e3:.0f} ms late at "
           "every world collective; then one new collective per communicator between ticks; the last 4 ticks with "
           "the world collective left open by one missing rank. Goals: <= 20 ms at 4,096 ranks, <= 100 ms at "
           "16,384.", "",
           "| ranks | communicators | first tick (cold caches) | tick, median / max | CPU per tick, median / max "
           "| of which comm-slow localiser (commslow.py) / the other detectors | ticks with a hang open, median / max "
           "| CPU, median / max | findings |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        found = ", ".join(f"{k} {c}" for k, c in r["found"])
        out.append(f"| {r['ranks']:,} | {r['comms']:,} | {r['first_ms']:.1f} ms | {r['steady_ms']:.1f} / "
                   f"{r['steady_max_ms']:.1f} ms | {r['steady_cpu_ms']:.1f} / {r['steady_cpu_max_ms']:.1f} ms | "
                   f"{r['steady_links_ms']:.1f} / {r['steady_ms'] - r['steady_links_ms']:.1f} ms | "
                   f"{r['hang_ms']:.1f} / {r['hang_max_ms']:.1f} ms | {r['hang_cpu_ms']:.1f} / "
                   f"{r['hang_cpu_max_ms']:.1f} ms | {found} |")
    out += ["", "Wall time is what a tick took on this shared box (other jobs ran alongside); CPU is the tick's "
                "own thread time (time.thread_time), the cost on a dedicated core. The first tick summarises "
                "every collective already in the timeline (comp-slow keeps one summary per completed "
                "collective, comm-slow one duration); later ticks only what completed since. \"of which\" is "
                "the link localiser (wall, timed inside the same ticks). A full garbage collection runs before each "
                "timed tick: collecting the timeline's millions of objects is the ingest's cost, not the detectors'."]
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="examples: bench/accuracy.py --runs 1 --no-tick --lock /tmp/ccld-heavy.lock; "
                                        "bench/accuracy.py --runs 10 --healthy-s 600 --write-results; "
                                        "bench/accuracy.py --tick-only --ranks 4096")
    ap.add_argument("--quick", action="store_true", help="each scenario once (--runs 1)")
    ap.add_argument("--runs", type=int, default=3, help="runs per scenario (default 3)")
    ap.add_argument("--healthy-s", type=float, default=0.0,
                    help="also run each workload this many seconds without a fault (default 0: none)")
    ap.add_argument("--tick-only", action="store_true", help="only the tick cost (no jobs, no root needed)")
    ap.add_argument("--scenarios", default="", help="only these scenario keys (comma list; --list shows them)")
    ap.add_argument("--ci-only", action="store_true", help="only the scenarios the e2e suite runs in CI")
    ap.add_argument("--list", action="store_true", help="list the registered scenarios and exit")
    ap.add_argument("--lock", metavar="FILE", help="hold this flock around each job (a shared machine's heavy-run lock)")
    ap.add_argument("--log", metavar="FILE.jsonl", help="append one JSON line per scenario run (verdict, findings)")
    ap.add_argument("--from-log", metavar="FILE.jsonl", action="append", default=[],
                    help="run no job: score the runs these --log files hold (repeatable; with --write-results "
                         "the section says which command made them: --made-by)")
    ap.add_argument("--made-by", metavar="CMD", default="", help="with --from-log: the command that wrote the logs")
    ap.add_argument("--no-tick", action="store_true", help="only the scenarios")
    ap.add_argument("--ranks", default="1024,4096,16384")
    ap.add_argument("--write-results", action="store_true", help="write bench/RESULTS.md's sections")
    a = ap.parse_args()
    if a.quick:
        a.runs = 1

    def say(m: str) -> None:
        print(f"accuracy: {m}", file=sys.stderr, flush=True)

    if a.list:
        import scenarios
        for k, s in scenarios.load().items():
            print(f"{k:24} {'ci ' if s.ci else '   '}{s.kind:8} {s.title}")
        return 0
    cmd = "python bench/accuracy.py " + " ".join(x for x in sys.argv[1:] if x != "--write-results")
    if a.from_log:
        acc = from_logs(a.from_log)
        md = accuracy_md(acc, a.made_by or cmd)
        if a.made_by:
            md += (f"\n\nScored from the runs' log by `python bench/accuracy.py "
                   f"{' '.join('--from-log ' + x for x in a.from_log)}`.")
        print(md)
        if a.write_results and a.scenarios:  # the logs of a repeat of a few scenarios: its own section
            write_section("accuracy-repeat", "### Diagnosis accuracy, repeated scenarios\n\n" + md)
        elif a.write_results:
            write_section("accuracy", "## Diagnosis accuracy (scenario suite, strict scoring)\n\n" + md)
        return 0
    if not a.tick_only:
        only = [k for k in a.scenarios.split(",") if k]
        if a.healthy_s > 0 and not only:
            import scenarios
            only = [k for k, s in scenarios.load().items() if not s.long_run and (s.ci or not a.ci_only)] + \
                   [k for k, s in scenarios.load().items() if s.long_run]
        acc = run_accuracy(a.runs, a.healthy_s, say, only or None, a.lock, a.ci_only, a.log)
        md = accuracy_md(acc, cmd)
        print(md)
        say("time per job: " + ", ".join(f"{k} {v:.0f} s" for k, v in acc["spent_s"].items()))
        if a.write_results and a.scenarios:  # a repeat of a few scenarios: its own section
            write_section("accuracy-repeat", "### Diagnosis accuracy, repeated scenarios\n\n" + md)
        elif a.write_results:
            write_section("accuracy", "## Diagnosis accuracy (scenario suite, strict scoring)\n\n" + md)
    if not a.no_tick:
        rows = [tick_cost(int(n), say) for n in a.ranks.split(",")]
        md = tick_md(rows, cmd)
        print(md)
        if a.write_results:
            write_section("diagnosis-tick", "## Diagnosis tick cost (detectors only)\n\n" + md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
