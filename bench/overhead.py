"""Job overhead of ccld's agent: one 4-rank gloo job, ccld attached and detached in alternating windows.

These machines are noisy, so the figure is a ratio within one run: median step time of rank 0 in the
windows where the agent is attached, over the same in the windows where it is not, several windows
each. Also the agent's own CPU (this process while attached: user+sys time / wall time), the run time
of its BPF programs in the kernel (kernel.bpf_stats_enabled, restored afterwards), and the events it
shipped per second. With --configs, each window cycle runs one detached window and then one attached
window per probe set (e.g. "gloo;net,sched;all"), so every set is compared with the same baseline.
Writes the `overhead` section of bench/RESULTS.md with --write-results.

  .venv/bin/python bench/overhead.py [--windows 3] [--window-s 20] [--configs "all"] [--write-results]
"""
import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ccld.tracer.agent import FAMILY_NAMES, Agent, parse_probes  # noqa: E402
from results import write_section  # noqa: E402  (bench/ is on sys.path when run as a script)

STEP_RX = re.compile(r"^rank 0 step (\d+) t ([\d.]+)$", re.M)
PROGRESS_EVERY = 10  # steps between rank 0's timestamps: one sample of step time each


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def step_times(text: str, t0: float, t1: float):
    """Per-step times (s) of rank 0 from progress samples inside [t0, t1]."""
    pts = [(int(s), float(t)) for s, t in STEP_RX.findall(text)]
    pts = [p for p in pts if t0 <= p[1] <= t1]
    return [(b[1] - a[1]) / (b[0] - a[0]) for a, b in zip(pts, pts[1:]) if b[0] > a[0]]


BPF_STATS = "/proc/sys/kernel/bpf_stats_enabled"


def bpf_prog_ns() -> int:
    """Total run time (ns) of the BPF programs this process holds, from /proc/self/fdinfo (needs
    kernel.bpf_stats_enabled=1; 0 otherwise)."""
    total = 0
    for fd in os.listdir("/proc/self/fdinfo"):
        try:
            with open(f"/proc/self/fdinfo/{fd}") as f:
                text = f.read()
        except OSError:
            continue
        if "prog_type:" in text:
            m = re.search(r"^run_time_ns:\s+(\d+)", text, re.M)
            total += int(m.group(1)) if m else 0
    return total


def run(windows: int, window_s: float, configs=(("all", FAMILY_NAMES),)) -> dict:
    out = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    port = 29700 + os.getpid() % 200
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
           "--master-port", str(port), os.path.join(ROOT, "ccld", "workloads", "gloo_job.py"),
           "--steps", "100000000", "--ops", "allreduce,broadcast,allreduce,barrier", "--elems", "16384",
           "--compute-ms", "3", "--progress-every", str(PROGRESS_EVERY)]
    job = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
    cport = port + 1000
    endpoint = f"tcp://127.0.0.1:{cport}"
    # The collector is a process of its own, so this process's CPU time is the agent's alone.
    coll = subprocess.Popen([sys.executable, "-m", "ccld.cli", "collector", "--listen", endpoint],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    res = {"off": []}
    for name, _ in configs:
        res[name] = {"on": [], "agent_cpu": [], "bpf_cpu": [], "events_per_s": []}
    try:
        with open(BPF_STATS) as f:
            stats_before = f.read().strip()
    except OSError:
        stats_before = None
    try:
        if stats_before is not None:
            with open(BPF_STATS, "w") as f:
                f.write("1")
        deadline = time.time() + 120
        while not STEP_RX.search(open(out.name).read()):
            if time.time() > deadline or job.poll() is not None:
                raise SystemExit("the job did not start:\n" + open(out.name).read()[-2000:])
            time.sleep(0.5)
        time.sleep(3)  # warm up
        for w in range(windows):
            t0 = time.time()
            time.sleep(window_s)
            res["off"].append((t0, time.time()))
            for name, probes in configs:
                agent = Agent(endpoint, pids=[job.pid], say=lambda s: None, probes=probes)
                agent.load()
                agent.start()
                def ready() -> bool:  # every family whose library a rank maps (kernel families: all) is on
                    ranks = list(agent.ranks.values())
                    return len(ranks) >= 4 and all(f.NAME in rk.attached for rk in ranks for f, _ in agent.families
                                                   if f.find_lib(rk.ident.pid) is not None)
                while not ready():
                    time.sleep(0.1)
                r = res[name]
                sent0, c0, b0, t0 = agent.shipper.sent_events, cpu_s(), bpf_prog_ns(), time.time()
                time.sleep(window_s)
                t1 = time.time()
                r["on"].append((t0, t1))
                r["agent_cpu"].append((cpu_s() - c0) / (t1 - t0))
                r["bpf_cpu"].append((bpf_prog_ns() - b0) / 1e9 / (t1 - t0))
                r["events_per_s"].append((agent.shipper.sent_events - sent0) / (t1 - t0))
                agent.stop()
                time.sleep(2)  # probes gone before the next window
            print(f"window {w + 1}/{windows} done", file=sys.stderr)
    finally:
        if stats_before is not None:
            with open(BPF_STATS, "w") as f:
                f.write(stats_before)
        from ccld.launch import stop_group
        stop_group(job)  # torchrun's workers have sessions of their own: every descendant is signalled
        coll.terminate()
        coll.wait(30)
    text = open(out.name).read()
    os.unlink(out.name)
    off = [statistics.median(step_times(text, a, b)) for a, b in res["off"]]
    out = {"off_ms": [x * 1e3 for x in off], "windows": windows, "window_s": window_s, "configs": {}}
    for name, _ in configs:
        r = res[name]
        on = [statistics.median(step_times(text, a, b)) for a, b in r["on"]]
        out["configs"][name] = {"on_ms": [x * 1e3 for x in on], "ratio": statistics.median(on) / statistics.median(off),
                                "agent_cpu": statistics.median(r["agent_cpu"]), "bpf_cpu": statistics.median(r["bpf_cpu"]),
                                "events_per_s": statistics.median(r["events_per_s"])}
    return out


def write_results(r: dict, cmd: str) -> None:
    colls_per_s = 4 * 1e3 / statistics.median(r["off_ms"])  # 4 collectives a step (2 allreduce, broadcast, barrier)
    rows = []
    for name, c in r["configs"].items():
        rows.append(f"| {name} | {statistics.median(r['off_ms']):.2f} ms | {statistics.median(c['on_ms']):.2f} ms | "
                    f"{c['ratio']:.3f} | {c['agent_cpu'] * 100:.2f} % | {c['bpf_cpu'] * 100:.3f} % | {c['events_per_s']:.0f} |")
    per = "; ".join(f"{n}: {', '.join(f'{x:.2f}' for x in c['on_ms'])}" for n, c in r["configs"].items())
    body = f"""### Job overhead of the agent, per probe set, attached vs detached in one run

`{cmd}` as root on {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')}; a 4-rank gloo job (2 x allreduce,
broadcast, barrier of 64 KiB per step, 3 ms compute) on loopback, ~{colls_per_s:.0f} collectives/s per node. Each
cycle: one {r['window_s']:.0f} s window detached, then one attached window per probe set; {r['windows']} cycles. Step
time = rank 0's median over each window. Agent CPU = user+sys of the agent's process (the collector
runs elsewhere) per wall second; BPF = run time of its programs in the kernel (kernel.bpf_stats_enabled),
per wall second, as a share of one core.

| probes | median step, detached | median step, attached | ratio | agent CPU | BPF CPU | events/s |
|---|---:|---:|---:|---:|---:|---:|
{chr(10).join(rows)}

Goals: job ratio <= 1.003; agent <= 1 % of one core (net probes: job <= 1.003, agent <= 1 %).
Per window (ms), detached: {', '.join(f'{x:.2f}' for x in r['off_ms'])}; attached, {per}.
4 ranks on 2 vCPUs: the ranks and the agent compete for the same cores, so the spread between windows
is as large as the effect; read the ratios with that."""
    write_section("overhead", body)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--window-s", type=float, default=20.0)
    ap.add_argument("--configs", default="all", help='probe sets separated by ";", each a comma list or "all" '
                                                        '(e.g. "gloo;net,sched;all")')
    ap.add_argument("--write-results", action="store_true")
    a = ap.parse_args()
    configs = [(c, FAMILY_NAMES if c == "all" else tuple(parse_probes(c))) for c in a.configs.split(";") if c]
    r = run(a.windows, a.window_s, configs)
    print(r)
    if a.write_results:
        write_results(r, "python bench/overhead.py" + (f" --windows {a.windows}" if a.windows != 3 else "")
                      + (f" --window-s {a.window_s:g}" if a.window_s != 20 else "")
                      + (f' --configs "{a.configs}"' if a.configs != "all" else "") + " --write-results")


if __name__ == "__main__":
    main()
