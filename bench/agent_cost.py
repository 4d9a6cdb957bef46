"""What the agent costs when the job is quiet, and per event on the collective path.

  idle       the real agent (every family) on a 2-rank gloo job that makes one step of 4 collectives a
             second: the agent process's CPU per wall second, per thread (/proc schedstat), and its
             resident memory; the collector runs in another process
  busy       the real agent on the overhead bench's job (~470 collective calls/s), windows alternating
             drain periods (CCLD_DRAIN_MS: 250 and 500 ms by default)
  per event  the collective path alone, in this process: drains of real-shaped gloo records (enter,
             start with sizes, end; 2 ranks) through the batch translator and the frame encoder, CPU
             time per event (process_time), for drains of 24 to 2,000 collectives
  decode     the same drains read record by record the old way (bcc's ctypes callback, a ctypes
             copy, a translator call per record, an Event per event, blocks.split), for the ratio
Writes the `agent_cost` section of bench/RESULTS.md with --write-results.

  .venv/bin/python bench/agent_cost.py [--idle-s 20] [--write-results]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "tests", "bpf"))

QUIET_JOB = ["--ops", "allreduce,broadcast,allreduce,barrier", "--elems", "1024", "--compute-ms", "1",
             "--step-sleep-ms", "1000", "--progress-every", "1"]


COLD_REPS = 12  # drains timed one drain period apart (the hot loop above them runs back to back)


def threads_cpu(pid: int):
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{t}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                run_ns, _, slices = f.read().split()[:3]  # on-CPU ns, runqueue ns, times it ran (wakeups)
                out[(t, name)] = (int(run_ns), int(slices))
        except OSError:
            pass
    return out


AGENT = r"""
import sys, time, json
sys.path.insert(0, sys.argv[1])
from ccld.tracer.agent import Agent
a = Agent(sys.argv[2], pids=[int(sys.argv[3])], say=lambda s: None)
a.load(); a.start()
import threading
print("ready " + json.dumps({str(t.native_id): t.name for t in threading.enumerate()}), flush=True)
for line in sys.stdin:  # each line: the counts so far; "q": and stop
    with open("/proc/self/status") as f:
        rss = [int(l.split()[1]) / 1024 for l in f if l.startswith("VmRSS:")][0]
    print(json.dumps({"events": a.shipper.sent_events, "frames": a.shipper.sent_frames, "rss_mib": rss}), flush=True)
    if line.strip() == "q":
        break
a.stop()
"""


def a_name(snapshot, tid):
    return next((n for (t, n) in snapshot if t == tid), "")


def agent_windows(job_args, seconds: float, drain_ms) -> list:
    """One job (gloo_job.py, 2 ranks, `job_args`) and its collector; for each period in `drain_ms`
    (None: the default), a real agent (every family) with CCLD_DRAIN_MS set to it, measured over
    `seconds` once its /proc scans have slowed to their steady pace. Returns one dict a window."""
    from conftest import free_port
    from ccld.launch import stop_group
    from overhead import STEP_RX
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                            "127.0.0.1", "--master-port", str(free_port()),
                            os.path.join(ROOT, "ccld", "workloads", "gloo_job.py"), "--steps", "100000000"] + job_args,
                           stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
    ep = f"tcp://127.0.0.1:{free_port()}"
    coll = subprocess.Popen([sys.executable, "-m", "ccld.cli", "collector", "--listen", ep],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out = []
    try:
        deadline = time.monotonic() + 120
        while not STEP_RX.search(open(log.name).read()):
            if time.monotonic() > deadline or job.poll() is not None:
                raise SystemExit("the job did not start:\n" + open(log.name).read()[-2000:])
            time.sleep(0.5)
        for ms in drain_ms:
            env = dict(os.environ)
            if ms is not None:
                env["CCLD_DRAIN_MS"] = str(ms)
            out.append(dict(_window(ep, job.pid, seconds, env), drain_ms=ms))
    finally:
        stop_group(job)
        coll.terminate()
        coll.wait(30)
        os.unlink(log.name)
    return out


def _window(ep: str, job_pid: int, seconds: float, env: dict) -> dict:
    ag = subprocess.Popen([sys.executable, "-c", AGENT, ROOT, ep, str(job_pid)], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True, env=env)
    try:
        return _measure(ag, seconds)
    finally:
        if ag.poll() is None:
            ag.kill()
            ag.wait(30)


def _measure(ag: subprocess.Popen, seconds: float) -> dict:
    line = ag.stdout.readline().strip()
    assert line.startswith("ready "), line
    names = json.loads(line[len("ready "):])
    time.sleep(35)  # past STABLE_S: the agent scans /proc at its idle pace

    def counts(cmd):
        ag.stdin.write(cmd + "\n")
        ag.stdin.flush()
        return json.loads(ag.stdout.readline())
    c0, a, t0 = counts("s"), threads_cpu(ag.pid), time.monotonic()
    time.sleep(seconds)
    b, t1 = threads_cpu(ag.pid), time.monotonic()
    stats = counts("q")
    ag.wait(60)
    wall = t1 - t0
    per, wakes = {}, {}
    for (tid, name), (ns, slices) in b.items():
        name = names.get(tid, name)
        ns0, slices0 = a.get((tid, name if tid not in names else a_name(a, tid)), (ns, slices))
        per[name] = per.get(name, 0) + (ns - ns0) / 1e9 / wall
        wakes[name] = wakes.get(name, 0) + (slices - slices0) / wall
    return {"wall_s": wall, "cpu": sum(per.values()), "threads": per, "wakeups": wakes, "rss_mib": stats["rss_mib"],
            "events_per_s": (stats["events"] - c0["events"]) / wall, "frames_per_s": (stats["frames"] - c0["frames"]) / wall}


def drain_records(ncoll: int):
    """Records of ncoll collectives on each of 2 ranks, as gloo.bpf.c writes them (its model in the tests)."""
    from test_gloo_batch import Kernel, rows_of
    k = Kernel(True)
    for p in (100, 200):
        k.pg_init(p, 0x1000, 0, 2)
    setup = len(k.recs)
    for i in range(ncoll):
        for p in (100, 200):
            k.api_enter(p, 0x1000)
            k.next_tag(0x1000)
            k.work_init(p, p, 0xA0, [1, 1, 0, 15][i % 4], i)
            k.work_exec(p, p + 1, 0xA0)
            k.buf(p + 1, 4096)
            k.algo(p, p + 1)
            k.finish(p, p + 1, 0xA0, 1)
    return rows_of(k.recs[:setup]), rows_of(k.recs[setup:]), k.recs[setup:]


def per_event(sizes=(24, 200, 2000)) -> dict:
    from ccld.bpf.gloo_translator import GlooTranslator
    from ccld.bpf.rows import Rows
    from ccld.tracer import frames
    from ccld.tracer.agent import POLL_MS
    from ccld.tracer.nodeclock import NodeClock
    out = {}
    for n in sizes:
        setup, (rows, kinds), _ = drain_records(n // 2)
        items: list = []
        t = GlooTranslator(items.append)
        for p in (100, 200):
            t.add_process(p, p // 100, "job")
            t.tags_readable(p, True)
        t.records(*setup)
        t.records(rows, kinds)  # warm: groups named
        reps = max(5, 4000 // n)
        c0 = time.process_time()
        for _ in range(reps):
            items.clear()
            t.records(rows, kinds)
        c1 = time.process_time()
        cold = 0.0
        for _ in range(COLD_REPS):  # as the agent pays it: each drain after a drain period's sleep
            items.clear()
            time.sleep(POLL_MS / 1000)
            t0 = time.thread_time()
            t.records(rows, kinds)
            cold += time.thread_time() - t0
        got = list(items)
        events = sum(len(x) if isinstance(x, Rows) else 1 for x in got)
        c2 = time.process_time()
        for _ in range(reps):
            frames.encode("a", "n", 1, got, NodeClock())
        c3 = time.process_time()
        out[n] = {"events": events, "translate_us": (c1 - c0) / reps / events * 1e6,
                  "encode_us": (c3 - c2) / reps / events * 1e6, "drain_us": (c1 - c0) / reps * 1e6,
                  "cold_drain_us": cold / COLD_REPS * 1e6}
    return out


def old_path(n: int = 200) -> float:
    """µs per event the agent spent before its batch path, on the same records: a ctypes copy and a
    reference-translator call per record, an Event per event, then events.encode_batch (blocks.split)."""
    import ctypes as ct
    from ccld import wire as ev
    from gloo_reference import ReferenceTranslator
    setup, _, recs = drain_records(n // 2)
    raws = [bytes(r) for r in recs]
    cls = [type(r) for r in recs]
    evs: list = []
    t = ReferenceTranslator(evs.append)
    for p in (100, 200):
        t.add_process(p, p // 100, "job")
        t.tags_readable(p, True)
    from ccld.bpf.gloo_records import KINDS
    for row in setup[0]:
        rec = KINDS.record(row)
        t.feed(rec.hdr.kind, rec)
    reps = 20
    c0 = time.process_time()
    for _ in range(reps):
        evs.clear()
        for raw, c in zip(raws, cls):
            rec = c.from_buffer_copy(raw)
            t.feed(rec.hdr.kind, rec)
        ev.encode_batch("a", "n", 1, list(evs), resend=True)
    c1 = time.process_time()
    return (c1 - c0) / reps / len(evs) * 1e6


def write_results(r: dict, cmd: str) -> None:
    from results import write_section
    i = r["idle"]
    top = sorted(i["threads"].items(), key=lambda kv: -kv[1])
    threads = ", ".join(f"{name} {v * 100:.3f} %" for name, v in top if v * 100 >= 0.005)
    wakes = ", ".join(f"{name} {v:.1f}" for name, v in sorted(i["wakeups"].items(), key=lambda kv: -kv[1]) if v >= 0.05)
    from ccld.tracer.agent import POLL_MS
    rows = [f"| {n:,} | {v['events']:,} | {v['drain_us']:,.0f} us | {v['cold_drain_us']:,.0f} us | {v['translate_us']:.2f} us | "
            f"{v['encode_us']:.2f} us | {v['translate_us'] + v['encode_us']:.2f} us |" for n, v in r["per_event"].items()]
    busy = []
    for w in r["busy"]:
        top = sorted(w["threads"].items(), key=lambda kv: -kv[1])[:3]
        busy.append(f"| {w['drain_ms']} ms | **{w['cpu'] * 100:.3f} %** | "
                    + ", ".join(f"{name} {v * 100:.3f} %" for name, v in top)
                    + f" | {w['events_per_s']:,.0f} | {w['frames_per_s']:.1f} | "
                    f"{w['cpu'] * 1e6 / max(w['events_per_s'], 1):.1f} us | {sum(w['wakeups'].values()):.1f} |")
    by = {}
    for w in r["busy"]:
        by.setdefault(w["drain_ms"], []).append(w["cpu"])
    means = {ms: statistics.mean(v) for ms, v in by.items()}
    ratio = ""
    if len(means) == 2:
        (lo, clo), (hi, chi) = sorted(means.items())
        ratio = (f"\nAgent CPU, mean of the windows: {clo * 100:.3f} % of a core draining every {lo} ms, "
                 f"{chi * 100:.3f} % every {hi} ms ({chi / clo:.2f}x).\n")
    body = f"""### Agent cost: idle, and per event on the collective path

`{cmd}` as root, {time.strftime('%Y-%m-%d')}, on a VM with 2 vCPUs shared with other work (the heavy-run
lock held). Idle: the agent (every family) on a 2-rank gloo job making one step of 4 collectives a
second, after its /proc scans slowed to their idle pace; the collector in another process.

| figure | value |
|---|---|
| agent process, idle | **{i['cpu'] * 100:.3f} % of one core** ({threads}) |
| agent wakeups, idle | {sum(i['wakeups'].values()):.1f} a second ({wakes}) |
| agent resident memory | {i['rss_mib']:.0f} MiB |

Per event on the collective path, in one process (CPU time, process_time): drains of real-shaped gloo
records (enter; start with sizes; end: 3 records, 3 events a collective, 2 ranks) through the batch
translator, then the frame encoder (column blocks, MessagePack). The path before issue 16 (a ctypes
copy and a translator call per record, an Event per event, events.encode_batch) on the same 200
events: **{r['old_us']:.1f} us per event**.

| collectives in the drain | events | translator per drain | the same, each drain {POLL_MS} ms after the last | translator per event | encoder per event | together per event |
|---:|---:|---:|---:|---:|---:|---:|
{chr(10).join(rows)}

The hot loop times drains back to back; the agent drains once every drain period (POLL_MS = {POLL_MS} ms),
and after that sleep the same drain costs several times more (cold caches: the "each drain {POLL_MS} ms
after the last" column). That is why the cost per drain, not per event, dominates a busy job's agent.

Busy: the real agent (every family) on the overhead bench's job (bench/overhead.py: 2 gloo ranks,
~470 collective calls/s), one window per drain period (CCLD_DRAIN_MS), in this order, each after
35 s of warm-up; all told: the agent process's CPU over its shipped events.

| drain period | agent process | busiest threads | events/s shipped | frames/s | CPU per event, all told | wakeups/s |
|---|---:|---|---:|---:|---:|---:|
{chr(10).join(busy)}
{ratio}"""
    write_section("agent_cost", body)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--idle-s", type=float, default=20.0)
    ap.add_argument("--busy-s", type=float, default=30.0, help="each drain-period window on the busy job")
    ap.add_argument("--periods", default="250,500,250,500",
                    help="drain periods (ms, CCLD_DRAIN_MS) of the busy job's windows, in order")
    ap.add_argument("--write-results", action="store_true")
    a = ap.parse_args()
    for sig in (signal.SIGTERM, signal.SIGHUP):  # a `timeout` or a closed terminal: stop the job too (finally)
        signal.signal(sig, lambda signum, _f: sys.exit(128 + signum))
    from overhead import JOB_ARGS
    r = {"per_event": per_event(), "old_us": old_path()}
    print(json.dumps(r, indent=1), file=sys.stderr)
    r["idle"] = agent_windows(QUIET_JOB, a.idle_s, [None])[0]
    r["busy"] = agent_windows(JOB_ARGS + ["--progress-every", "5"], a.busy_s, [int(x) for x in a.periods.split(",")])
    print(json.dumps(r, indent=1))
    if a.write_results:
        write_results(r, "python bench/agent_cost.py" + (f" --idle-s {a.idle_s:g}" if a.idle_s != 20 else "")
                      + (f" --busy-s {a.busy_s:g}" if a.busy_s != 30 else "")
                      + (f" --periods {a.periods}" if a.periods != "250,500,250,500" else "") + " --write-results")


if __name__ == "__main__":
    main()
