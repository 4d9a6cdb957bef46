"""Job overhead of ccld's agent: a gloo job with the agent attached and detached in short alternating windows.

The figure is the ratio of the job's step time with the agent attached over without it, with a 95 %
confidence interval, measured in one run on a noisy shared box. What makes 0.3 % resolvable here:
  - a workload that leaves the CPUs room (default 2 ranks; each step is a little compute, then a sleep
    standing in for the time a GPU job waits on its device), so the agent does not compete with busy
    ranks for the 2 vCPUs and the windows' medians are steady;
  - many short windows, in cycles: detached, then attached once per probe set; each attached window is
    compared with the mean of the detached windows either side of it (bracketing cancels slow drift
    of the box), and the interval is a t-interval on those per-cycle log ratios;
  - the agent in a child process started for each attached window and gone (probes closed) before the
    next detached one, so "detached" is the job with no ccld at all; its start and stop lie outside
    the windows.
Steady figures per probe set, from the agent process itself: its CPU (user+sys) per wall second and
per shipped event (µs/event), the run time of its BPF programs (kernel.bpf_stats_enabled, restored
afterwards) per wall second and per hit of each program, events shipped per second, resident memory.
Writes the `overhead` section of bench/RESULTS.md with --write-results.

  .venv/bin/python bench/overhead.py [--ranks 2] [--cycles 12] [--window-s 4] [--configs "gloo;all"]
                                     [--write-results]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

STEP_RX = re.compile(r"^rank 0 step (\d+) t ([\d.]+)$", re.M)
PROGRESS_EVERY = 5          # steps between rank 0's timestamps: one sample of step time each
BPF_STATS = "/proc/sys/kernel/bpf_stats_enabled"
READY_TIMEOUT_S = 120       # the child's compile + attach on a loaded 2-vCPU box
SETTLE_S = 1.0              # after the agent attached / left: let the job's pace settle before measuring
COLLS_PER_STEP = 4          # allreduce, broadcast, allreduce, barrier
JOB_ARGS = ["--ops", "allreduce,broadcast,allreduce,barrier", "--elems", "1024", "--compute-ms", "1",
            "--step-sleep-ms", "10"]
# gloo's TCP device loop thread polls while a rank waits for its peers: its CPU time measures waiting
# (it moves with whatever else shares the CPUs), not work; the probes never fire on it.
POLLING_THREADS = ("gloo_tcp_loop",)
# t quantiles (two-sided 95 %) by degrees of freedom; 1.96 beyond the table
T975 = {1: 12.71, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
        20: 2.086, 25: 2.060, 30: 2.042, 40: 2.021, 60: 2.000}


def t975(df: int) -> float:
    if df in T975:
        return T975[df]
    below = [k for k in T975 if k <= df]
    return T975[max(below)] if below and df <= 60 else 1.96


def ratio_ci(on: Sequence[float], off: Sequence[float]) -> Tuple[float, float, float, int]:
    """(ratio, low, high, n): on[i] against the mean of off[i] and off[i+1] (the detached windows
    either side of it), as the geometric mean of those ratios with a t-interval on their logs."""
    logs = [math.log(x / ((off[i] + off[i + 1]) / 2 if i + 1 < len(off) else off[i])) for i, x in enumerate(on)]
    n = len(logs)
    m = statistics.fmean(logs)
    if n < 2:
        return math.exp(m), float("nan"), float("nan"), n
    half = t975(n - 1) * statistics.stdev(logs) / math.sqrt(n)
    return math.exp(m), math.exp(m - half), math.exp(m + half), n


def progress(text: str) -> List[Tuple[float, int]]:
    """(Unix time, step) of rank 0's progress lines."""
    return [(float(t), int(n)) for n, t in STEP_RX.findall(text)]


def steps_at(pts: List[Tuple[float, int]], t: float) -> float:
    """Rank 0's step count at time t, interpolated between its progress lines."""
    import bisect
    i = bisect.bisect_left(pts, (t, -1))
    if i == 0 or i == len(pts):
        raise SystemExit(f"no progress line around {t:.3f}: the window is outside the job's run")
    (ta, na), (tb, nb) = pts[i - 1], pts[i]
    return na + (nb - na) * (t - ta) / (tb - ta) if tb > ta else float(nb)


def rank_pids(job_pid: int) -> List[int]:
    from ccld.tracer import discover
    return sorted(p for p in discover.descendants(job_pid, discover.all_pids()) if discover.identify(p) is not None)


def cpu_ns(pids: Sequence[int]) -> int:
    """CPU time (ns) so far of every thread of these processes but gloo's polling loops
    (/proc/PID/task/TID/schedstat)."""
    total = 0
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    if f.read().strip() in POLLING_THREADS:
                        continue
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                pass
    return total


class Window:
    """One measured window: its wall-clock bounds and the ranks' CPU time at each end."""

    def __init__(self, pids: Sequence[int]):
        self.pids = pids
        self.t0, self.c0 = time.time(), cpu_ns(pids)

    def close(self) -> "Window":
        self.t1, self.c1 = time.time(), cpu_ns(self.pids)
        return self

    def figures(self, pts) -> Tuple[float, float]:
        """(mean step time ms, ranks' CPU ms per step) over the window."""
        steps = steps_at(pts, self.t1) - steps_at(pts, self.t0)
        return (self.t1 - self.t0) * 1e3 / steps, (self.c1 - self.c0) / 1e6 / steps


# ---- the agent's side: one attached window in a child process ----------------------------------

def prog_times(families) -> Dict[str, Tuple[int, int]]:
    """'family:function' -> (run_time_ns, run_cnt) of every loaded BPF program."""
    from probe_cost import prog_stats
    out = {}
    for fam, _ in families:
        if fam.bpf is not None:
            for name, v in prog_stats(fam.bpf).items():
                out[f"{fam.NAME}:{name}"] = v
    return out


def rss_mib() -> float:
    from agent_profile import rss_of
    now, _ = rss_of(os.getpid())
    return float("nan") if now is None else now


def child(endpoint: str, pid: int, probes: str, ranks: int) -> None:
    """Attach, say "ready", measure between "go" and "stop" on stdin, print the figures as JSON."""
    from ccld.tracer.agent import Agent
    from ccld.tracer.families import FAMILY_NAMES, parse_probes
    names = FAMILY_NAMES if probes == "all" else tuple(parse_probes(probes))
    t_launch = time.monotonic()
    agent = Agent(endpoint, pids=[pid], say=lambda s: print(s, file=sys.stderr), probes=names)
    agent.load()
    agent.start()

    def ready() -> bool:  # every family whose library a rank maps (kernel families: all) is on
        rs = list(agent.ranks.values())
        return len(rs) >= ranks and all(f.NAME in r.attached for r in rs for f, _ in agent.families
                                        if f.find_lib(r.ident.pid) is not None)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not ready():
        if time.monotonic() > deadline:
            raise SystemExit("the agent did not attach to every rank")
        time.sleep(0.05)
    print(json.dumps({"ready_s": time.monotonic() - t_launch}), flush=True)
    sys.stdin.readline()  # "go"
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    p0, sent0, t0 = prog_times(agent.families), agent.shipper.sent_events, time.monotonic()
    sys.stdin.readline()  # "stop"
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    p1, sent1, t1 = prog_times(agent.families), agent.shipper.sent_events, time.monotonic()
    progs = {k: (v[0] - p0.get(k, (0, 0))[0], v[1] - p0.get(k, (0, 0))[1]) for k, v in p1.items()}
    out = {"wall_s": t1 - t0, "cpu_s": (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime),
           "events": sent1 - sent0, "progs": progs, "rss_mib": rss_mib(), "maxrss_mib": ru1.ru_maxrss / 1024,
           "loss": {k: v for k, v in agent.shipper.loss().items() if v and not k.endswith("_unmatched")}}
    agent.stop()
    print(json.dumps(out), flush=True)


# ---- the bench's side ------------------------------------------------------------------------

def run(ranks: int, cycles: int, window_s: float, configs: List[str]) -> dict:
    from conftest import free_port  # tests/conftest.py: a free 127.0.0.1 port
    from ccld.launch import stop_group
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    port = free_port()
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                            "--master-addr", "127.0.0.1", "--master-port", str(port),
                            os.path.join(ROOT, "ccld", "workloads", "gloo_job.py"), "--steps", "100000000",
                            "--progress-every", str(PROGRESS_EVERY)] + JOB_ARGS,
                           stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    # The collector is a process of its own, so the agent's CPU time is the agent's alone.
    coll = subprocess.Popen([sys.executable, "-m", "ccld.cli", "collector", "--listen", endpoint],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    off: List[Window] = []
    on: Dict[str, List[Window]] = {c: [] for c in configs}
    agent_stats: Dict[str, List[dict]] = {c: [] for c in configs}
    ready_s: Dict[str, List[float]] = {c: [] for c in configs}
    try:
        with open(BPF_STATS) as f:
            stats_before = f.read().strip()
    except OSError:
        stats_before = None
    try:
        if stats_before is not None:
            with open(BPF_STATS, "w") as f:
                f.write("1")
        deadline = time.time() + READY_TIMEOUT_S
        while not STEP_RX.search(open(log.name).read()):
            if time.time() > deadline or job.poll() is not None:
                raise SystemExit("the job did not start:\n" + open(log.name).read()[-2000:])
            time.sleep(0.5)
        time.sleep(3)  # warm up
        pids = rank_pids(job.pid)
        if len(pids) != ranks:
            raise SystemExit(f"found {len(pids)} rank processes, expected {ranks}")
        for c in range(cycles + 1):  # cycles + 1 detached windows bracket the attached ones
            w = Window(pids)
            time.sleep(window_s)
            off.append(w.close())
            if c == cycles:
                break
            for name in configs:
                ch = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", endpoint, str(job.pid),
                                       name, str(ranks)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                ready_s[name].append(json.loads(ch.stdout.readline())["ready_s"])
                time.sleep(SETTLE_S)
                ch.stdin.write("go\n")
                ch.stdin.flush()
                w = Window(pids)
                time.sleep(window_s)
                w.close()
                ch.stdin.write("stop\n")
                ch.stdin.flush()
                agent_stats[name].append(json.loads(ch.stdout.readline()))
                on[name].append(w)
                ch.wait(60)
                time.sleep(SETTLE_S)  # probes gone before the next window
            print(f"cycle {c + 1}/{cycles} done", file=sys.stderr)
        time.sleep(SETTLE_S)  # a progress line after the last window, to interpolate against
    finally:
        if stats_before is not None:
            with open(BPF_STATS, "w") as f:
                f.write(stats_before)
        stop_group(job)  # torchrun's workers have sessions of their own: every descendant is signalled
        coll.terminate()
        coll.wait(30)
    pts = progress(open(log.name).read())
    os.unlink(log.name)
    off_ms, off_cpu = zip(*(w.figures(pts) for w in off))
    res = {"ranks": ranks, "cycles": cycles, "window_s": window_s, "off_ms": off_ms, "off_cpu_ms": off_cpu,
           "configs": {}}
    for name in configs:
        on_ms, on_cpu = zip(*(w.figures(pts) for w in on[name]))
        st = agent_stats[name]
        wall = sum(s["wall_s"] for s in st)
        cpu = sum(s["cpu_s"] for s in st)
        events = sum(s["events"] for s in st)
        progs: Dict[str, List[int]] = {}
        for s in st:
            for k, (t, n) in s["progs"].items():
                p = progs.setdefault(k, [0, 0])
                p[0] += t
                p[1] += n
        bpf_ns = sum(t for t, _ in progs.values())
        hits = sum(n for _, n in progs.values())
        ratio, lo, hi, n = ratio_ci(on_ms, off_ms)
        cratio, clo, chi, _ = ratio_ci(on_cpu, off_cpu)
        res["configs"][name] = {
            "on_ms": on_ms, "ratio": ratio, "ci": (lo, hi), "n": n,
            "on_cpu_ms": on_cpu, "cpu_ratio": cratio, "cpu_ci": (clo, chi),
            "agent_cpu": cpu / wall, "events_per_s": events / wall,
            "us_per_event": cpu / events * 1e6 if events else float("nan"),
            "bpf_cpu": bpf_ns / 1e9 / wall, "bpf_ns_per_hit": bpf_ns / hits if hits else float("nan"),
            "hits_per_s": hits / wall,
            "progs": {k: (t / n, n / wall) for k, (t, n) in sorted(progs.items()) if n},
            "rss_mib": statistics.median(s["rss_mib"] for s in st),
            "ready_s": statistics.median(ready_s[name]),
            "loss": [s["loss"] for s in st if s["loss"]],
        }
    return res


def write_results(r: dict, cmd: str, section: str = "overhead", title: str = "") -> None:
    from results import write_section
    base, base_cpu = statistics.median(r["off_ms"]), statistics.median(r["off_cpu_ms"])
    colls = r["ranks"] * COLLS_PER_STEP * 1e3 / base
    rows, progs = [], []
    for name, c in r["configs"].items():
        lo, hi = c["ci"]
        clo, chi = c["cpu_ci"]
        rows.append(f"| {name} | {base:.3f} ms | {statistics.median(c['on_ms']):.3f} ms | **{c['ratio']:.4f}** "
                    f"[{lo:.4f}, {hi:.4f}] | {c['cpu_ratio']:.4f} [{clo:.4f}, {chi:.4f}] | "
                    f"{c['agent_cpu'] * 100:.2f} % | {c['us_per_event']:.1f} us | "
                    f"{c['bpf_cpu'] * 100:.3f} % | {c['bpf_ns_per_hit']:,.0f} ns | {c['events_per_s']:,.0f} | "
                    f"{c['rss_mib']:.0f} MiB |")
        top = sorted(c["progs"].items(), key=lambda kv: -kv[1][0] * kv[1][1])[:8]
        progs.append(f"{name}: " + ", ".join(f"{k} {ns:,.0f} ns x {rate:,.0f}/s" for k, (ns, rate) in top))
    per = "; ".join(f"{n}: {', '.join(f'{x:.2f}' for x in c['on_ms'])}" for n, c in r["configs"].items())
    body = f"""### Job overhead of the agent, attached vs detached in alternating windows{title}

`{cmd}` as root, {time.strftime('%Y-%m-%d')}, on a VM with 2 vCPUs shared with other work (other
sessions' editors and tests; no other benchmark ran: the heavy-run lock was held). Job: {r['ranks']} gloo ranks
on loopback, each step 2 x allreduce + broadcast + barrier of 4 KiB, 1 ms of compute and a 10 ms sleep
(a GPU job waits on its device: the ranks leave the CPUs room), ~{colls:,.0f} collective calls/s on the node.
{r['cycles']} cycles of {r['window_s']:g} s windows: detached, then attached once per probe set (the agent
in a child process started for the window, its probes closed before the next detached one). Step
time = the mean over a window (rank 0's step count, interpolated between its progress lines); ratio = geometric mean over cycles of attached / mean of the
detached windows either side, with its 95 % t-interval; the same for the ranks' own CPU time per step
(their threads but gloo's polling TCP loops, /proc schedstat: the probes' traps are charged there,
and it moves less than wall time when other work shares the CPUs; {base_cpu:.3f} ms per step detached). Agent CPU = user+sys of the agent's process
(the collector runs elsewhere) per wall second, and per event it shipped; BPF = run time of its
programs in the kernel (kernel.bpf_stats_enabled) per wall second as a share of one core, and per hit.

| probes | step, detached | step, attached | step ratio [95 % CI] | ranks' CPU per step, ratio [95 % CI] | agent CPU | agent per event | BPF CPU | BPF per hit | events/s | agent RSS |
|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|
{chr(10).join(rows)}

BPF programs, ns per hit x hits/s: {'; '.join(progs)}.
Per window (ms), detached: {', '.join(f'{x:.2f}' for x in r['off_ms'])}; attached, {per}."""
    write_section(section, body)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        endpoint, pid, probes, ranks = sys.argv[2:6]
        child(endpoint, int(pid), probes, int(ranks))
        return
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--cycles", type=int, default=12)
    ap.add_argument("--window-s", type=float, default=4.0)
    ap.add_argument("--configs", default="all", help='probe sets separated by ";", each a comma list or "all" '
                                                        '(e.g. "gloo;net,sched;all")')
    ap.add_argument("--write-results", action="store_true")
    ap.add_argument("--section", default="overhead", help="the RESULTS.md section to write (e.g. overhead-before)")
    ap.add_argument("--title", default="", help="appended to the section's heading")
    a = ap.parse_args()
    configs = [c for c in a.configs.split(";") if c]
    r = run(a.ranks, a.cycles, a.window_s, configs)
    print(json.dumps(r, indent=1))
    if a.write_results:
        write_results(r, "python bench/overhead.py" + (f" --ranks {a.ranks}" if a.ranks != 2 else "")
                      + (f" --cycles {a.cycles}" if a.cycles != 12 else "")
                      + (f" --window-s {a.window_s:g}" if a.window_s != 4 else "")
                      + (f' --configs "{a.configs}"' if a.configs != "all" else "") + " --write-results"
                      + (f" --section {a.section}" if a.section != "overhead" else ""), a.section, a.title)


if __name__ == "__main__":
    main()
