"""How long `ccld run` keeps a job waiting before it starts, with the compiled-program cache warm
and cold, and how big its process is.

Each round runs `ccld run -- sh -c 'date +%s.%N'` twice: once with a fresh, empty cache directory
(CCLD_BPF_CACHE: every family compiled by bcc before the command starts) and once with a cache the
earlier rounds filled (programs loaded from it). The delay is the command's own clock reading minus
the time just before `ccld run` was executed (both CLOCK_REALTIME on this machine); the total is
until `ccld run` exited. Resident memory: `ccld run -- sleep S` (warm cache), VmRSS of ccld's
process (collector and agent together, as `ccld run` runs them) once the job has run a second.
Stop: `ccld run` of a one-rank gloo job (torch, so the gloo family's uprobes sit on libtorch_cpu)
that prints its clock as it ends; the time from that to `ccld run`'s exit, with the uprobes held by
uprobe_multi links (kernel 6.6+, the default) and by one perf event each (CCLD_UPROBE_MULTI=0, as on
older kernels), alternating.
Writes the `startup` section of bench/RESULTS.md with --write-results (as root).

  .venv/bin/python bench/startup.py [--rounds 5] [--write-results]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, ROOT)
CCLD = os.path.join(ROOT, ".venv", "bin", "ccld")


def one_start(cache: str) -> tuple:
    """(delay before the command ran, total wall time of ccld run), seconds."""
    env = dict(os.environ, CCLD_BPF_CACHE=cache)
    t0 = time.time()
    out = subprocess.run([CCLD, "run", "--", "sh", "-c", "date +CMDSTART%s.%N"], env=env,
                         capture_output=True, text=True, timeout=600)
    t1 = time.time()
    return stamp(out, "CMDSTART", "the command") - t0, t1 - t0


def stamp(out: subprocess.CompletedProcess, prefix: str, what: str) -> float:
    """The time `what` printed after `prefix` in a `ccld run`'s output; the run failing, an error."""
    if out.returncode != 0:
        raise SystemExit(f"startup: ccld run of {what} failed ({out.returncode}): {out.stderr.strip()[-800:]}")
    words = [w for w in out.stdout.split() + out.stderr.split() if w.startswith(prefix)]
    if not words:
        raise SystemExit(f"startup: {what}'s time stamp is missing from ccld run's output:\n{out.stdout}")
    return float(words[0][len(prefix):])


GLOO_JOB = ("import sys, time, torch, torch.distributed as d; "
            "d.init_process_group('gloo', init_method='file://' + sys.argv[1], rank=0, world_size=1); "
            "d.all_reduce(torch.ones(4)); d.destroy_process_group(); print('JOBEND%.6f' % time.time(), flush=True)")


def one_stop(cache: str, multi: bool) -> float:
    """Seconds from a gloo job's end to `ccld run`'s exit (its probes detached, its outputs closed)."""
    env = dict(os.environ, CCLD_BPF_CACHE=cache, CCLD_UPROBE_MULTI="1" if multi else "0")
    with tempfile.TemporaryDirectory(prefix="ccld-stop-") as tmp:  # the command's RANK makes it a rank
        out = subprocess.run([CCLD, "run", "--", "env", "RANK=0", "WORLD_SIZE=1", "LOCAL_RANK=0", sys.executable,
                              "-c", GLOO_JOB, os.path.join(tmp, "rdv")],
                             env=env, capture_output=True, text=True, timeout=600)
        t1 = time.time()
    return t1 - stamp(out, "JOBEND", "the gloo job")


def rss_mib(cache: str, seconds: float = 3.0) -> float:
    env = dict(os.environ, CCLD_BPF_CACHE=cache)
    p = subprocess.Popen([CCLD, "run", "--", "sleep", str(seconds)], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(seconds - 1.0)
    try:
        with open(f"/proc/{p.pid}/status") as f:
            return [int(l.split()[1]) / 1024 for l in f if l.startswith("VmRSS:")][0]
    finally:
        p.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--write-results", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("startup: needs root (ccld run loads eBPF programs)")
    from ccld.bpf import sysbpf
    if not sysbpf.has_uprobe_multi():  # CCLD_UPROBE_MULTI=1 would fall back to perf events unsaid
        raise SystemExit("startup: this kernel has no uprobe_multi links (6.6+): the stop rows compare them")
    warm_dir = tempfile.mkdtemp(prefix="ccld-startup-warm-")
    os.chmod(warm_dir, 0o700)
    cold, warm = [], []
    try:
        one_start(warm_dir)  # fills the warm cache
        for i in range(args.rounds):
            cold_dir = tempfile.mkdtemp(prefix="ccld-startup-cold-")
            os.chmod(cold_dir, 0o700)
            try:
                cold.append(one_start(cold_dir))
            finally:
                shutil.rmtree(cold_dir, ignore_errors=True)
            warm.append(one_start(warm_dir))
            print(f"startup: round {i + 1}: cold {cold[-1][0]:.2f} s to the command, warm {warm[-1][0]:.2f} s",
                  flush=True)
        rss = rss_mib(warm_dir)
        stops: dict = {True: [], False: []}
        for i in range(args.rounds):
            for multi in (True, False):
                stops[multi].append(one_stop(warm_dir, multi))
            print(f"startup: round {i + 1}: stop {stops[True][-1]:.2f} s with uprobe_multi links, "
                  f"{stops[False][-1]:.2f} s with perf events", flush=True)
    finally:
        shutil.rmtree(warm_dir, ignore_errors=True)

    def cell(xs):
        return f"{statistics.median(xs):.2f} s ({min(xs):.2f}-{max(xs):.2f})"

    body = "\n".join([
        "### Start-up: `ccld run` before the job starts",
        "",
        f"`python bench/startup.py --rounds {args.rounds} --write-results` as root on {os.cpu_count()} CPUs, "
        f"{time.strftime('%Y-%m-%d', time.gmtime())}. Command: `ccld run -- sh -c 'date +%s.%N'`; delay = the "
        "command's clock reading minus the moment before `ccld run` was executed (Python's start-up "
        "included); cold = an empty compiled-program cache (every family compiled by bcc first), warm = "
        "programs loaded from the cache. Median (min-max) over the rounds, cold and warm alternating.",
        "",
        "| cache | delay before the command | ccld run, all told |",
        "|---|---:|---:|",
        f"| warm | {cell([d for d, _ in warm])} | {cell([t for _, t in warm])} |",
        f"| cold | {cell([d for d, _ in cold])} | {cell([t for _, t in cold])} |",
        "",
        f"Resident memory of `ccld run`'s own process (collector and agent in one process, every family "
        f"loaded, a job running): {rss:.0f} MiB. Goal: <= 0.5 s before the job starts (warm).",
        "",
        "Stop: from a one-rank gloo job's end to `ccld run`'s exit (the gloo family's uprobes on "
        "libtorch_cpu detached on the way), warm cache, median (min-max):",
        "",
        "| uprobes held by | stop |",
        "|---|---:|",
        f"| uprobe_multi links (kernel 6.6+, default) | {cell(stops[True])} |",
        f"| a perf event each (CCLD_UPROBE_MULTI=0; older kernels) | {cell(stops[False])} |",
    ])
    print(body)
    if args.write_results:
        from results import write_section
        write_section("startup", body)


if __name__ == "__main__":
    main()
