"""Job overhead of ccld's agent: one 4-rank gloo job, ccld attached and detached in alternating windows.

These machines are noisy, so the figure is a ratio within one run: median step time of rank 0 in the
windows where the agent is attached, over the same in the windows where it is not, several windows
each. Also the agent's own CPU (this process while attached: user+sys time / wall time) and the
events it shipped per second. Writes the `overhead` section of bench/RESULTS.md with --write-results.

  .venv/bin/python bench/overhead.py [--windows 3] [--window-s 20] [--write-results]   (as root)
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

from ccld.tracer.agent import Agent  # noqa: E402
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


def run(windows: int, window_s: float) -> dict:
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
    res = {"on": [], "off": [], "agent_cpu": [], "events_per_s": []}
    try:
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
            agent = Agent(endpoint, pids=[job.pid], say=lambda s: None)
            agent.load()
            agent.start()
            while not all("gloo" in r.attached for r in list(agent.ranks.values())) or len(agent.ranks) < 4:
                time.sleep(0.1)
            sent0, c0, t0 = agent.shipper.sent_events, cpu_s(), time.time()
            time.sleep(window_s)
            t1 = time.time()
            res["on"].append((t0, t1))
            res["agent_cpu"].append((cpu_s() - c0) / (t1 - t0))
            res["events_per_s"].append((agent.shipper.sent_events - sent0) / (t1 - t0))
            agent.stop()
            time.sleep(2)  # probes gone before the next untraced window
            print(f"window {w + 1}/{windows} done", file=sys.stderr)
    finally:
        from ccld.launch import stop_group
        stop_group(job)  # torchrun's workers have sessions of their own: every descendant is signalled
        coll.terminate()
        coll.wait(30)
    text = open(out.name).read()
    os.unlink(out.name)
    on = [statistics.median(step_times(text, a, b)) for a, b in res["on"]]
    off = [statistics.median(step_times(text, a, b)) for a, b in res["off"]]
    return {"on_ms": [x * 1e3 for x in on], "off_ms": [x * 1e3 for x in off],
            "ratio": statistics.median(on) / statistics.median(off),
            "agent_cpu": statistics.median(res["agent_cpu"]), "events_per_s": statistics.median(res["events_per_s"]),
            "windows": windows, "window_s": window_s}


def write_results(r: dict, cmd: str) -> None:
    colls_per_s = 4 * 1e3 / statistics.median(r["off_ms"])  # 4 collectives a step (2 allreduce, broadcast, barrier)
    body = f"""### Job overhead of the agent (gloo probes + /proc), attached vs detached in one run

`{cmd}` as root on {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')}; a 4-rank gloo job (2 x allreduce,
broadcast, barrier of 64 KiB per step, 3 ms compute), agent attached and detached in alternating
{r['window_s']:.0f} s windows, {r['windows']} of each. Step time = rank 0's median over each window.

| | median step, detached | median step, attached | ratio attached/detached | goal |
|---|---:|---:|---:|---:|
| step time | {statistics.median(r['off_ms']):.2f} ms | {statistics.median(r['on_ms']):.2f} ms | {r['ratio']:.3f} | <= 1.003 |

Per window (ms), detached: {', '.join(f'{x:.2f}' for x in r['off_ms'])}; attached: {', '.join(f'{x:.2f}' for x in r['on_ms'])}.
Agent CPU while attached (user+sys of the agent's process, collector elsewhere, per wall second):
{r['agent_cpu'] * 100:.1f} % of one core, shipping {r['events_per_s']:.0f} events/s at ~{colls_per_s:.0f} collectives/s per node
(goal: <= 1 % of one core at 1,000 collectives/s). 4 ranks on 2 vCPUs: the ranks and the agent compete
for the same cores, so the spread between windows is as large as the effect; read the ratio with that."""
    write_section("overhead", body)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--window-s", type=float, default=20.0)
    ap.add_argument("--write-results", action="store_true")
    a = ap.parse_args()
    r = run(a.windows, a.window_s)
    print(r)
    if a.write_results:
        write_results(r, "python bench/overhead.py" + (f" --windows {a.windows}" if a.windows != 3 else "")
                      + (f" --window-s {a.window_s:g}" if a.window_s != 20 else "") + " --write-results")


if __name__ == "__main__":
    main()
