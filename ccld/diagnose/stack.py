"""Python stacks of culprit ranks, from `py-spy dump --pid`, for Finding.stack.

Taken once per finding (the collector calls `StackTaker.add_stacks` for each new finding, outside its
lock), for at most MAX_RANKS of the finding's ranks, each dump bounded in time (TIMEOUT_S: py-spy is
killed after it) and in size (MAX_BYTES, cut at a line). Only processes on this machine can be
dumped: a rank on another node (the collector may run elsewhere) is skipped, as is one that has
exited. Every skip or failure is said in evidence["stack"] with its reason (py-spy not installed,
no permission to ptrace, timed out, ...), never raised. A stopped rank is read without pausing it
(--nonblocking: py-spy cannot suspend a process that is already stopped); others are paused for the
few milliseconds the dump takes, which gives a consistent stack.
The dump's header (the process's command line, which may hold secrets) is dropped.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from ccld.diagnose.findings import Finding

# A blocking dump stops the process to read it: a stopped one (T/t) cannot be stopped again, and one in
# uninterruptible sleep (D: stuck I/O) never reaches the stop, so py-spy waits forever. Read those live.
NONBLOCKING_STATES = ("T", "t", "D")

TIMEOUT_S = 3.0       # a dump takes ~0.05 s (1 s with --native); 3 s means py-spy is stuck
MAX_BYTES = 8192      # per rank: deep stacks of many threads are cut here (the main thread comes first)
MAX_RANKS = 2         # ranks dumped per finding: the first culprits say what the others are doing too
BUDGET_S = 6.0        # time one add_stacks call may spend on dumps, all ranks together


def find_py_spy() -> Optional[str]:
    """py-spy on PATH, or next to this Python (a virtualenv's bin/, where `pip install py-spy` puts it)."""
    found = shutil.which("py-spy")
    if found:
        return found
    local = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return local if os.access(local, os.X_OK) else None


def _problem(output: str) -> str:
    """py-spy's error output -> a short reason with a fix where there is one."""
    low = output.lower()
    if "permission denied" in low or "operation not permitted" in low:
        return ("no permission to ptrace the process (run ccld as root, or give py-spy CAP_SYS_PTRACE, "
                "or sysctl kernel.yama.ptrace_scope=0)")
    if "no such file" in low or "not running" in low or "no such process" in low:
        return "the process is gone"
    if "failed to find python version" in low or "python interpreter" in low:
        return "not a Python process py-spy can read"
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    error = next((line for line in lines if line.startswith("Error")), lines[0] if lines else "no output")
    return "py-spy failed: " + error[:200]


def clip(text: str, max_bytes: int = MAX_BYTES) -> str:
    """`text` without py-spy's header, cut at a line boundary to at most max_bytes (UTF-8)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("Thread ")), 0)
    out: List[str] = []
    size = 0
    for line in lines[start:]:
        n = len(line.encode()) + 1
        if size + n > max_bytes:
            out.append(f"... ({len(lines) - start - len(out)} more lines cut)")
            break
        out.append(line)
        size += n
    return "\n".join(out).rstrip()


def dump(pid: int, exe: str, timeout_s: float = TIMEOUT_S, nonblocking: bool = False,
         run: Callable[..., Any] = subprocess.run) -> Tuple[Optional[str], Optional[str], float]:
    """(stack text or None, problem or None, seconds taken) of one `py-spy dump`."""
    cmd = [exe, "dump", "--pid", str(pid)] + (["--nonblocking"] if nonblocking else [])
    t0 = time.monotonic()
    try:
        p = run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None, f"py-spy timed out after {timeout_s:g} s", time.monotonic() - t0
    except OSError as e:
        return None, f"cannot run {exe}: {e.strerror or e}", time.monotonic() - t0
    took = time.monotonic() - t0
    out = p.stdout.decode(errors="replace") if isinstance(p.stdout, bytes) else (p.stdout or "")
    if p.returncode != 0 or "Thread " not in out:
        return None, _problem(out), took
    return out, None, took


class StackTaker:
    """Adds py-spy stacks to findings. `check(pid, rank)` says whether `pid` is still that rank's
    process, so a reused pid is never paused (the collector passes tracer.discover.is_rank; tests pass
    fakes); `node` is this machine's name as agents report it (they use socket.gethostname()); `exe`
    None means find py-spy; `run` is subprocess.run."""

    def __init__(self, check: Callable[[int, int], bool], node: Optional[str] = None, exe: Optional[str] = None,
                 timeout_s: float = TIMEOUT_S, max_bytes: int = MAX_BYTES, max_ranks: int = MAX_RANKS,
                 budget_s: float = BUDGET_S, run: Callable[..., Any] = subprocess.run):
        self.node = node if node is not None else socket.gethostname()
        self.exe = exe if exe is not None else find_py_spy()
        self.timeout_s, self.max_bytes, self.max_ranks, self.budget_s = timeout_s, max_bytes, max_ranks, budget_s
        self.run, self.check = run, check

    def add_stacks(self, findings: List[Finding]) -> None:
        """Set `stack` and evidence["stack"] on each finding (in place), within budget_s overall."""
        spent = 0.0
        for f in findings:
            spent += self.add_stack(f, self.budget_s - spent)

    def add_stack(self, f: Finding, budget_s: Optional[float] = None) -> float:
        """Dump the finding's first culprits; returns the seconds spent."""
        budget = self.budget_s if budget_s is None else budget_s
        details = [d for d in (f.evidence or {}).get("ranks") or [] if isinstance(d, dict)]
        report: Dict[str, Any] = {"source": "py-spy"}
        if not details:
            report["skipped"] = "the finding names no rank process"
        elif self.exe is None:
            report["skipped"] = "py-spy is not installed (pip install py-spy)"
        if "skipped" in report:
            f.evidence["stack"] = report
            return 0.0
        texts, per_rank, spent = [], {}, 0.0
        for d in details[:self.max_ranks]:
            why = self._cannot(d)
            if why is None and spent >= budget:
                why = "the time for stacks in this round is spent"
            if why is not None:
                per_rank[str(d.get("rank"))] = {"skipped": why}
                continue
            text, problem, took = dump(int(d["pid"]), self.exe, min(self.timeout_s, max(0.5, budget - spent)),
                                       nonblocking=d.get("state") in NONBLOCKING_STATES, run=self.run)
            spent += took
            entry: Dict[str, Any] = {"took_s": round(took, 3)}
            if problem:
                entry["skipped"] = problem
            else:
                texts.append(f"rank {d.get('rank')} (pid {d['pid']} on {d.get('node')}):\n"
                             f"{clip(text, self.max_bytes)}")
                entry["ok"] = True
            per_rank[str(d.get("rank"))] = entry
        report["ranks"] = per_rank
        if texts:
            f.stack = "\n\n".join(texts)
        else:
            report["skipped"] = "; ".join(sorted({e["skipped"] for e in per_rank.values() if "skipped" in e}))
        f.evidence["stack"] = report
        return spent

    def _cannot(self, d: Dict[str, Any]) -> Optional[str]:
        if not d.get("seen", True) or d.get("pid") is None:
            return "no process known for this rank"
        if d.get("exited_at") is not None or d.get("state") in ("Z", "X"):
            return "the process has exited"
        if d.get("node") != self.node:
            return f"the rank runs on {d.get('node')}, this collector on {self.node}"
        if not self.check(int(d["pid"]), int(d.get("rank", -1))):
            return f"pid {d['pid']} is no longer rank {d.get('rank')} (it exited, or the pid was reused)"
        return None
