"""How long `ccld run` keeps a job waiting before it starts, with the compiled-program cache warm
and cold, and how big its process is.

Each round runs `ccld run -- sh -c 'date +%s.%N'` twice: once with a fresh, empty cache directory
(CCLD_BPF_CACHE: every family compiled by bcc before the command starts) and once with a cache the
earlier rounds filled (programs loaded from it). The delay is the command's own clock reading minus
the time just before `ccld run` was executed (both CLOCK_REALTIME on this machine); the total is
until `ccld run` exited. Resident memory: `ccld run -- sleep S` (warm cache), VmRSS of ccld's
process (collector and agent together, as `ccld run` runs them) once the job has run a second.
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
CCLD = os.path.join(ROOT, ".venv", "bin", "ccld")


def one_start(cache: str) -> tuple:
    """(delay before the command ran, total wall time of ccld run), seconds."""
    env = dict(os.environ, CCLD_BPF_CACHE=cache)
    t0 = time.time()
    out = subprocess.run([CCLD, "run", "--", "sh", "-c", "date +CMDSTART%s.%N"], env=env,
                         capture_output=True, text=True, timeout=600)
    t1 = time.time()
    if out.returncode != 0:
        raise SystemExit(f"startup: ccld run failed ({out.returncode}): {out.stderr.strip()[-800:]}")
    stamp = [w for w in out.stdout.split() + out.stderr.split() if w.startswith("CMDSTART")]
    if not stamp:
        raise SystemExit(f"startup: the command's time stamp is missing from ccld run's output:\n{out.stdout}")
    return float(stamp[0][len("CMDSTART"):]) - t0, t1 - t0


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
    ])
    print(body)
    if args.write_results:
        from results import write_section
        write_section("startup", body)


if __name__ == "__main__":
    main()
