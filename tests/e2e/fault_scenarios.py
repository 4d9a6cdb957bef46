"""Fault-injection scenarios: a real 4-rank gloo job (ccld/workloads/gloo_job.py) under `ccld run`,
one fault each, and what ccld said about it. Shared by tests/e2e/test_faults.py (one assertion set
per scenario) and bench/accuracy.py (the same scenarios N times, scored).

Each scenario returns a Result: the findings JSONL as read back, when the fault began (`onset`, Unix
seconds: the job's own "... t UNIX" line, or the moment the injector acted) and the expected class
and culprit ranks. Every process started carries a tag in its environment; `Session.cleanup` kills
whatever still carries it (SIGCONT first: a stopped rank cannot die), so nothing outlives a scenario.
Budget on 2 vCPUs: a 4-rank torchrun starts in ~10-20 s; most scenarios take 25-45 s in all.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GLOO_JOB = os.path.join(ROOT, "ccld", "workloads", "gloo_job.py")
CCLD = [sys.executable, "-m", "ccld.cli"]
START_TIMEOUT_S = 120.0   # torchrun + import torch on a loaded 2-core box
HANG_DEADLINE_S = 15.0    # hangs are named within 15 s of the fault (the goal, asserted here)
SLOW_DEADLINE_S = 60.0    # slowdowns within 60 s
OPS = "allreduce,broadcast,barrier"
OPS_PER_STEP = 3
FIRST_SEQ = 1             # c10d's per-group seq starts at 1
HOG_NICE = -8             # the CPU hog's priority: ~15 % of the core is left to the rank pinned with it
                          # (at -15, ~3 %, the rank stalls for seconds at a time: a hang, not a slowdown)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_cmd(*args, nproc: int = 4) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), GLOO_JOB] + [str(a) for a in args]


def read_findings(path) -> List[Dict[str, Any]]:
    try:
        text = open(path).read()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line being written right now
    return out


@dataclass
class Result:
    name: str
    expect_class: Optional[str]          # None: nothing may be found
    culprits: List[int]
    onset: Optional[float] = None
    findings: List[Dict[str, Any]] = field(default_factory=list)
    ran_s: float = 0.0
    log: str = ""
    notes: Dict[str, Any] = field(default_factory=dict)

    def of(self, kind: Optional[str] = None, cls: Optional[str] = None) -> List[Dict[str, Any]]:
        return [f for f in self.findings if (kind is None or f.get("kind") == kind)
                and (cls is None or f.get("class") == cls)]

    def first(self) -> Optional[Dict[str, Any]]:
        """The first finding of the expected class (the one a person on call reads)."""
        got = [f for f in self.findings if f.get("class") == self.expect_class and f.get("kind") in ("hang", "slow")
               and not (f.get("evidence") or {}).get("informational")]
        return min(got, key=lambda f: f["detected_at"]) if got else None

    def latency(self) -> Optional[float]:
        f = self.first()
        return None if f is None or self.onset is None else f["detected_at"] - self.onset

    def false_findings(self) -> List[Dict[str, Any]]:
        """Findings that are neither the expected one nor informational."""
        return [f for f in self.findings if f.get("kind") in ("hang", "slow")
                and not (f.get("evidence") or {}).get("informational")
                and not (f.get("class") == self.expect_class and set(f.get("ranks") or []) & set(self.culprits))]


class Session:
    """Starts processes tagged with a unique env var in `tmp`; cleanup kills every tagged process."""

    def __init__(self, tmp):
        self.tag = uuid.uuid4().hex
        self.tmp = str(tmp)
        self.env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CCLD_TEST_TAG=self.tag)
        self.started: List[subprocess.Popen] = []

    def start(self, name: str, cmd: List[str], env: Optional[Dict[str, str]] = None):
        log = os.path.join(self.tmp, f"{name}.log")
        p = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env or self.env,
                             start_new_session=True, cwd=self.tmp)
        self.started.append(p)
        return p, log

    def ccld_run(self, name: str, *job_args):
        """`ccld run` of the 4-rank workload: (process, combined log, findings path)."""
        fpath = os.path.join(self.tmp, f"{name}-findings.jsonl")
        cmd = CCLD + ["run", "--findings", fpath, "--store", os.path.join(self.tmp, f"{name}-store"), "--"] + \
            job_cmd(*job_args)
        p, log = self.start(name, cmd)
        return p, log, fpath

    def tagged(self) -> List[int]:
        needle = f"CCLD_TEST_TAG={self.tag}".encode()
        out = []
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        out.append(int(d))
            except OSError:
                pass
        return out

    def rank_pid(self, rank: int) -> Optional[int]:
        from ccld.tracer import discover
        for pid in self.tagged():
            ident = discover.identify(pid)
            if ident is not None and ident.rank == rank:
                return pid
        return None

    def cleanup(self) -> None:
        for pid in self.tagged():
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        for p in self.started:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass


def wait_for(log: str, pattern: str, timeout: float, proc=None):
    """The match of `pattern` in the file, polling every 50 ms (AssertionError with its tail if not)."""
    rx = re.compile(pattern, re.M)
    deadline = time.time() + timeout
    text = ""
    while time.time() < deadline:
        try:
            text = open(log, errors="replace").read()
        except OSError:
            text = ""
        m = rx.search(text)
        if m:
            return m
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.05)
    raise AssertionError(f"{pattern!r} not seen in {os.path.basename(log)} within {timeout} s; tail:\n{text[-3000:]}")


def wait_findings(fpath: str, until: Callable[[List[Dict[str, Any]]], bool], timeout: float, proc=None) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if until(read_findings(fpath)):
            return True
        if proc is not None and proc.poll() is not None:
            time.sleep(0.5)  # the final tick runs at exit: read once more
            return until(read_findings(fpath))
        time.sleep(0.1)
    return False


def interrupt(p, timeout: float = 60) -> int:
    """Ctrl-C to ccld run: it stops the job's process group, flushes, and exits."""
    if p.poll() is None:
        p.send_signal(signal.SIGINT)
    try:
        return p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        return p.wait()


def fault_time(log: str, pattern: str, timeout: float, proc) -> float:
    return float(wait_for(log, pattern + r".* t ([\d.]+)$", timeout, proc).group(1))


def _finish(r: Result, p, fpath: str, log: str, t0: float) -> Result:
    interrupt(p)
    r.findings = read_findings(fpath)
    r.ran_s = time.time() - t0
    r.log = log
    return r


# ---- hangs -----------------------------------------------------------------------------------

def sleeping_rank(s: Session, rank: int = 2, step: int = 60) -> Result:
    """Rank sleeps forever before a step: not-entered, that rank."""
    t0 = time.time()
    r = Result("sleeping rank", "not-entered", [rank])
    p, log, fpath = s.ccld_run("sleep", "--steps", 100000, "--ops", OPS, "--step-sleep-ms", 10,
                               "--hang-rank", rank, "--hang-step", step)
    wait_for(log, rf"^rank {rank}: hanging before step {step}$", START_TIMEOUT_S, p)
    r.onset = time.time()  # the line is printed just before the sleep; a 50 ms poll
    wait_findings(fpath, lambda fs: any(f.get("kind") == "hang" for f in fs), HANG_DEADLINE_S + 5, p)
    return _finish(r, p, fpath, log, t0)


def stopped_rank(s: Session, rank: int = 1) -> Result:
    """SIGSTOP: fault, that rank."""
    t0 = time.time()
    r = Result("SIGSTOPped rank", "fault", [rank])
    p, log, fpath = s.ccld_run("stop", "--steps", 100000, "--ops", OPS, "--step-sleep-ms", 10, "--progress-every", 50)
    wait_for(log, rf"^rank {rank} step 200 ", START_TIMEOUT_S, p)
    os.kill(s.rank_pid(rank), signal.SIGSTOP)
    r.onset = time.time()
    wait_findings(fpath, lambda fs: any(f.get("kind") == "hang" for f in fs), HANG_DEADLINE_S + 5, p)
    return _finish(r, p, fpath, log, t0)


def killed_rank(s: Session, rank: int = 2, after_checkpoint: bool = False) -> Result:
    """SIGKILL mid-run (the others are in or entering a collective): fault, that rank. With
    after_checkpoint, rank 0 first writes checkpoints for 20 s while the others wait (must not be a
    hang), and the kill comes after it: one job, two checks (notes["pause"] holds the first)."""
    t0 = time.time()
    r = Result("SIGKILLed rank" + (" after a checkpoint" if after_checkpoint else ""), "fault", [rank])
    extra = ["--ckpt-rank", 0, "--ckpt-step", 300, "--ckpt-s", 20] if after_checkpoint else []
    p, log, fpath = s.ccld_run("kill", "--steps", 100000, "--ops", OPS, "--step-sleep-ms", 10,
                               "--progress-every", 50, *extra)
    if after_checkpoint:
        t_ckpt = fault_time(log, r"^rank 0: checkpointing for", START_TIMEOUT_S, p)
        t_done = fault_time(log, r"^rank 0: checkpoint done", 60, p)
        wait_for(log, r"^rank 0 step 400 ", 30, p)
        r.notes["pause"] = {"from": t_ckpt, "to": t_done, "findings": read_findings(fpath)}
    else:
        wait_for(log, rf"^rank {rank} step 200 ", START_TIMEOUT_S, p)
    os.kill(s.rank_pid(rank), signal.SIGKILL)
    r.onset = time.time()
    wait_findings(fpath, lambda fs: any(f.get("kind") == "hang" for f in fs), HANG_DEADLINE_S + 5, p)
    return _finish(r, p, fpath, log, t0)


def wrong_op(s: Session, rank: int = 1, step: int = 150) -> Result:
    """A rank calls all_gather where the others all_reduce: inconsistent, that rank."""
    t0 = time.time()
    r = Result("different collective", "inconsistent", [rank])
    p, log, fpath = s.ccld_run("wrongop", "--steps", 100000, "--ops", OPS, "--step-sleep-ms", 10,
                               "--wrong-op-rank", rank, "--wrong-op-step", step)
    r.onset = fault_time(log, rf"^rank {rank}: calling all_gather", START_TIMEOUT_S, p)
    r.notes["seq"] = FIRST_SEQ + OPS_PER_STEP * step
    wait_findings(fpath, lambda fs: any(f.get("kind") == "hang" for f in fs), HANG_DEADLINE_S + 5, p)
    return _finish(r, p, fpath, log, t0)


def wrong_size(s: Session, rank: int = 1, step: int = 150) -> Result:
    """A rank all_reduces twice the elements of the others: inconsistent, that rank (the gloo probes
    give every rank's tensor bytes). Gloo then aborts a rank that receives more bytes than it expects
    (a neighbour of the odd rank, or the odd rank itself) and the others fail: notes["aborted"] is the
    rank torchrun reports as the first failure, a consequence that must not be named instead."""
    t0 = time.time()
    r = Result("different tensor size", "inconsistent", [rank])
    p, log, fpath = s.ccld_run("wrongsize", "--steps", 100000, "--ops", OPS, "--step-sleep-ms", 10,
                               "--wrong-size-rank", rank, "--wrong-size-step", step)
    r.onset = fault_time(log, rf"^rank {rank}: all_reduce of \d+ elements", START_TIMEOUT_S, p)
    r.notes.update(odd_rank=rank, seq=FIRST_SEQ + OPS_PER_STEP * step)
    wait_findings(fpath, lambda fs: any(f.get("kind") == "hang" for f in fs), HANG_DEADLINE_S + 5, p)
    try:
        p.wait(30)  # the job fails by itself: torchrun's summary names the first rank that died
    except subprocess.TimeoutExpired:
        pass
    text = open(log, errors="replace").read()
    m = re.search(r"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+)", text, re.S)
    r.notes["aborted"] = int(m.group(1)) if m else None
    r.notes["exitcode"] = (re.search(r"Root Cause.*?exitcode\s*:\s*(-?\d+)", text, re.S) or [None, None])[1]
    return _finish(r, p, fpath, log, t0)


def subgroup_deadlock(s: Session, step: int = 100) -> Result:
    """Two subgroups of ranks 0 and 1, taken in opposite orders by the two ranks at one step; ranks
    2 and 3 then wait in the default group. Culprits: 0 and 1 (each waits for the other)."""
    t0 = time.time()
    r = Result("cross-communicator deadlock", "not-entered", [0, 1])
    p, log, fpath = s.ccld_run("deadlock", "--steps", 100000, "--ops", "allreduce,broadcast", "--step-sleep-ms", 10,
                               "--deadlock-step", step)
    r.onset = fault_time(log, r"^rank 1: taking the subgroups in the opposite order", START_TIMEOUT_S, p)
    wait_findings(fpath, lambda fs: len([f for f in fs if f.get("kind") == "hang"]) >= 3, HANG_DEADLINE_S + 5, p)
    return _finish(r, p, fpath, log, t0)


# ---- slowdowns -------------------------------------------------------------------------------

def slow_compute(s: Session, rank: int = 2, ms: float = 40, ddp: bool = True) -> Result:
    """A rank computes `ms` more every step (from step 100), in a DDP job: comp-slow, that rank."""
    t0 = time.time()
    r = Result("extra compute" + (" (DDP)" if ddp else ""), "comp-slow", [rank])
    p, log, fpath = s.ccld_run("slowcomp", "--steps", 100000, *(["--ddp"] if ddp else ["--ops", OPS]),
                               "--step-sleep-ms", 10, "--slow-rank", rank, "--slow-ms", ms, "--slow-step", 100)
    r.onset = fault_time(log, rf"^rank {rank}: slowed by", START_TIMEOUT_S, p)
    wait_findings(fpath, lambda fs: any(f.get("kind") == "slow" and f.get("class") in ("comp-slow", "mixed-slow")
                                        and not f["evidence"].get("informational") for f in fs),
                  SLOW_DEADLINE_S + 5, p)
    return _finish(r, p, fpath, log, t0)


def cpu_contention(s: Session, rank: int = 3, cpu: Optional[int] = None) -> Result:
    """The rank and a CPU hog pinned to one core, the other ranks to the other cores (the hog at
    HOG_NICE, a higher-priority neighbour:
    a rank that sleeps between steps gets the CPU back at once from an equal-priority hog, so the
    scheduler would all but hide the contention), the work per step fixed (--compute-work):
    comp-slow, that rank, with runqueue evidence when the sched probe is on."""
    cpu = (os.cpu_count() or 2) - 1 if cpu is None else cpu
    t0 = time.time()
    r = Result("CPU contention", "comp-slow", [rank])
    p, log, fpath = s.ccld_run("contention", "--steps", 100000, "--ops", OPS, "--compute-ms", 10, "--compute-work",
                               "--step-sleep-ms", 10, "--progress-every", 100)
    wait_for(log, rf"^rank {rank} step 300 ", START_TIMEOUT_S, p)
    others = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)) if c != cpu)
    for q in range(4):  # the rank on `cpu`, every other rank off it (else they share the hog too)
        subprocess.run(["taskset", "-a", "-p", "-c", str(cpu) if q == rank else others, str(s.rank_pid(q))],
                       check=True, capture_output=True)
    hog, _ = s.start("hog", ["nice", "-n", str(HOG_NICE), "taskset", "-c", str(cpu), sys.executable, "-c", "while True: pass"])
    try:  # with autogroups (the default), nice counts only within a session: give the hog's its weight
        with open(f"/proc/{hog.pid}/autogroup", "w") as f:
            f.write(str(HOG_NICE))
    except OSError:
        pass  # no autogroups here: the process's nice is what counts
    r.onset = time.time()
    r.notes["cpu"] = cpu
    try:
        wait_findings(fpath, lambda fs: any(f.get("kind") == "slow" and f.get("class") in ("comp-slow", "mixed-slow")
                                            and not f["evidence"].get("informational") for f in fs),
                      SLOW_DEADLINE_S + 5, p)
    finally:
        hog.kill()
        hog.wait()
    return _finish(r, p, fpath, log, t0)


# ---- healthy ---------------------------------------------------------------------------------

def healthy_ddp(s: Session, seconds: float = 120) -> Result:
    """A DDP job that runs `seconds` and exits 0: nothing may be found."""
    t0 = time.time()
    r = Result("healthy DDP", None, [])
    p, log, fpath = s.ccld_run("healthy", "--ddp", "--seconds", seconds, "--step-sleep-ms", 5)
    rc = p.wait(seconds + START_TIMEOUT_S + 60)
    r.notes.update(rc=rc, steps=re.findall(r"^rank \d done: (\d+) steps", open(log, errors="replace").read(), re.M))
    r.findings = read_findings(fpath)
    r.ran_s = time.time() - t0
    r.log = log
    return r


SCENARIOS: Dict[str, Callable[..., Result]] = {
    "not-entered": sleeping_rank, "stopped": stopped_rank, "killed": killed_rank, "inconsistent": wrong_op,
    "size": wrong_size, "deadlock": subgroup_deadlock, "comp-slow": slow_compute, "contention": cpu_contention,
    "checkpoint": lambda s: killed_rank(s, after_checkpoint=True), "healthy": healthy_ddp,
}
