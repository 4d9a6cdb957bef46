"""Where the agent's CPU goes: a py-spy profile of a real `ccld agent --pid` on the overhead bench's job.

The overhead bench (bench/overhead.py) measures how much CPU the agent takes per shipped event; this
says on what. Job: bench/overhead.py's (2 gloo ranks, 4 collectives a step, 1 ms of compute and a
10 ms sleep: ~470 collective calls/s); the collector in a process of its own; the agent with every
family (or --probes). After a warm-up, py-spy samples the agent's threads (--rate per second, idle
samples dropped) for --seconds; the table gives each thread's share of the agent's busy samples and,
per thread, the functions that take the most samples, inclusive (the frame or anything it calls)
and self (the innermost frame). The agent's CPU over the same span is /proc/PID/stat's utime+stime.

    .venv/bin/python bench/agent_profile.py [--seconds 30] [--rate 250] [--probes all] [--top 12] [--job idle]

Root (eBPF) and py-spy (a dependency of ccld) are needed. Prints a Markdown table; writes nothing.
"""
from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.abspath(__file__)).rsplit(os.sep, 1)[0]
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from agent_cost import QUIET_JOB  # noqa: E402
from overhead import JOB_ARGS, STEP_RX  # noqa: E402

WARM_S = 35.0  # after the agent says it traces: its first scans and attaches are over, and its /proc
              # scans have slowed to their steady pace (agent.py STABLE_S)


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_of(pid: int) -> Tuple[Optional[float], Optional[float]]:
    """A process's resident memory now and at its peak (VmRSS, VmHWM), MiB; None when unknown (gone)."""
    got: Dict[str, float] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    got[line[:5]] = int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return got.get("VmRSS"), got.get("VmHWM")


def thread_cpu(pid: int) -> Dict[str, float]:
    """CPU seconds (utime+stime) of each of pid's threads, by "name (tid)": what the kernel charged,
    not what sampling saw."""
    out: Dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                head, _, rest = f.read().rpartition(")")
        except OSError:
            continue  # the thread ended
        fields = rest.split()
        name = head.split("(", 1)[1]
        out[f"{name} ({tid})"] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def parse_raw(path: str) -> List[Tuple[str, List[str], int]]:
    """py-spy's raw (collapsed) output: (thread, frames outermost first, samples) per line."""
    out = []
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if not stack or not n.isdigit():
                continue
            frames = stack.split(";")
            out.append((frames[0], frames[1:], int(n)))
    return out


def short(frame: str) -> str:
    """"func (path/to/file.py:12)" -> "func (file.py)": one row per function, whatever the line."""
    name, _, where = frame.partition(" (")
    base = os.path.basename(where.split(":")[0].rstrip(")")) if where else ""
    return f"{name} ({base})" if base else name


def report(rows: List[Tuple[str, List[str], int]], top: int) -> List[str]:
    by_thread: Dict[str, int] = collections.Counter()
    incl: Dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    self_: Dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for thread, frames, n in rows:
        t = thread.split(" ", 1)[-1].strip('"') if thread else "?"
        by_thread[t] += n
        if frames:
            self_[t][short(frames[-1])] += n
            for fr in set(short(x) for x in frames):
                incl[t][fr] += n
    total = sum(by_thread.values()) or 1
    lines = ["| thread | share of busy samples | top functions, inclusive (share of the thread) | top, self |",
             "|---|---:|---|---|"]
    for t, n in by_thread.most_common():
        inc = "; ".join(f"{f} {100 * c / n:.0f}%" for f, c in incl[t].most_common(top))
        own = "; ".join(f"{f} {100 * c / n:.0f}%" for f, c in self_[t].most_common(top))
        lines.append(f"| {t} | {100 * n / total:.1f}% | {inc} | {own} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    ap.add_argument("--probes", default="all", help="probe families for the agent (default: all)")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--job", choices=("busy", "idle"), default="busy",
                    help="busy: the overhead bench's job (default); idle: agent_cost's quiet job "
                         "(one step of 4 collectives a second)")
    a = ap.parse_args()
    job_args = ["--progress-every", "5"] + JOB_ARGS if a.job == "busy" else QUIET_JOB
    from conftest import free_port
    from ccld.launch import stop_group
    py = sys.executable
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    job = subprocess.Popen([py, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                            "127.0.0.1", "--master-port", str(free_port()),
                            os.path.join(ROOT, "ccld", "workloads", "gloo_job.py"), "--steps", "100000000"] + job_args, stdout=log, stderr=subprocess.STDOUT,
                           start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    coll = subprocess.Popen([py, "-m", "ccld.cli", "collector", "--listen", endpoint],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    agent = None
    raw = tempfile.NamedTemporaryFile(suffix=".txt", delete=False).name
    try:
        deadline = time.time() + 120
        while not STEP_RX.search(open(log.name).read()):
            if time.time() > deadline or job.poll() is not None:
                raise SystemExit("the job did not start:\n" + open(log.name).read()[-2000:])
            time.sleep(0.5)
        argv = [py, "-m", "ccld.cli", "agent", "--collector", endpoint, "--pid", str(job.pid), "--spool", "memory"]
        if a.probes != "all":
            argv += ["--probes", a.probes]
        agent = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        first = agent.stdout.readline()
        if "tracing" not in first:
            raise SystemExit(f"the agent did not start: {first}{agent.stdout.read()[:2000]}")
        time.sleep(WARM_S)
        c0, t0, th0 = cpu_s(agent.pid), time.monotonic(), thread_cpu(agent.pid)
        subprocess.run([os.path.join(os.path.dirname(sys.executable), "py-spy"), "record", "-p", str(agent.pid), "--threads", "--rate", str(a.rate),
                        "--duration", str(int(a.seconds)), "--format", "raw", "--output", raw, "--nonblocking"],
                       check=True, capture_output=True, timeout=a.seconds + 60)
        c1, t1, th1 = cpu_s(agent.pid), time.monotonic(), thread_cpu(agent.pid)
        print(f"agent {first.strip()}")
        print(f"agent CPU over the profile: {100 * (c1 - c0) / (t1 - t0):.2f} % of one core "
              f"(py-spy --nonblocking: it reads the agent's memory without stopping it)")
        per = sorted(((th1[k] - th0.get(k, 0.0), k) for k in th1), reverse=True)
        print("per thread (kernel's count): " + ", ".join(f"{k} {100 * d / (t1 - t0):.2f} %"
                                                         for d, k in per if d > 0) + "\n")
        print("\n".join(report(parse_raw(raw), a.top)))
    finally:
        if agent is not None:
            agent.terminate()
            agent.wait(30)
        stop_group(job)
        coll.terminate()
        coll.wait(30)
        os.unlink(log.name)
        if os.path.exists(raw):
            os.unlink(raw)


if __name__ == "__main__":
    main()
