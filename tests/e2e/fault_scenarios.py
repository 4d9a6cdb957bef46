"""The scenario harness and the DDP-style scenarios: a real gloo job under `ccld run`, one fault each,
and what ccld said about it. The registry (scenarios.py) holds them with the exact answer; the e2e
suite (test_shapes.py) runs each once, bench/accuracy.py N times.

Harness: `Session` starts processes tagged with a unique env var and `cleanup` kills whatever still
carries it (SIGCONT first: a stopped rank cannot die). `Job` is one `ccld run` of a workload: it
waits for the workload's lines ("... t UNIX" onsets, "rank R step N t UNIX" progress), for findings
of a class, and stops with Ctrl-C. `Job.result` cuts the findings at given times, so one job can
score a healthy phase and a later fault apart: what was found before the cut is the healthy
phase's, what came after is the fault's (a false finding there counts against the fault).
Onsets are Unix seconds: the workload's own "... t UNIX" line, or the moment the injector acted.

Timing: faults that rely on a baseline come after healthy running (hangs >= HANG_BASELINE_S,
slowdowns >= SLOW_BASELINE_S). A fault one rank injects is placed in time: the workload holds it
until its --fault-file exists, and the harness creates the file that long after the first progress
line (open_at), so the onset comes on time on a quiet box and a loaded one alike. Faults every rank
takes part in (a pause, a batch change) and the data loader's stall act at a step placed by the step
rates measured here (STEPS_PER_S, under `ccld run` on this 2-vCPU box) times RATE_MARGIN, so a
quieter box still runs that long first (a loaded one longer). `Result.baseline_s` is what it really
ran before the onset. bench/accuracy.py runs these same functions, so what is said here holds there.
Budget on 2 vCPUs: a 4-rank torchrun starts in ~10-15 s, `ccld run` stops in ~3 s (gloo's 44
uprobes are uprobe_multi links: ~0.2 s to detach, where a perf event each took ~0.1 s apiece); hang scenarios take ~45-75 s in all, slowdowns ~90-110 s.
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
from typing import Any, Callable, Dict, List, Optional, Sequence

import scenarios as sc
from scenarios import HANG_DEADLINE_S, SLOW_DEADLINE_S, Scenario, register, register_job

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKLOADS = os.path.join(ROOT, "ccld", "workloads")
GLOO_JOB = os.path.join(WORKLOADS, "gloo_job.py")
CCLD = [sys.executable, "-m", "ccld.cli"]
START_TIMEOUT_S = 150.0   # torchrun + import torch of 4-8 ranks on a loaded 2-core box, to the first fault line
WAIT_MARGIN_S = 5.0       # past a deadline, the findings file's flush and this harness's polling
SETTLE_S = 2.0            # after the expected finding: long enough to read what else ccld says about the fault
HANG_BASELINE_S = 20.0    # healthy running before a hang (hang thresholds learn the job's own waits)
SLOW_BASELINE_S = 60.0    # ... before a slowdown (own-work history ~40 s; the link localiser's baselines)
RATE_WINDOW_S = 20.0      # step rates (Result.notes["steps_per_s"]) are taken over this long before an onset
RATE_MARGIN = 1.3         # a quieter box runs steps up to ~1.3x faster than STEPS_PER_S says
STEPS_PER_S = {           # measured under `ccld run` here (2 vCPUs), with --progress-every lines
    "ddp-ops": 37.0,      # gloo_job --ops allreduce,broadcast,barrier --step-sleep-ms 10
    "gpipe": 20.0,        # pipeline_job (4 stages, 4 micro-batches, GPipe, blocking p2p)
}                         # (1F1B ~22, FSDP ~10, hybrid ~10: their faults are placed in time)
OPS = "allreduce,broadcast,barrier"
OPS_PER_STEP = 3
FIRST_SEQ = 1             # c10d's per-group seq starts at 1
HOG_NICE = -8             # the CPU hog's priority: ~15 % of the core is left to the rank pinned with it
                          # (at -15, ~3 %, the rank stalls for seconds at a time: a hang, not a slowdown)
PROGRESS = re.compile(r"^rank (\d+) step (\d+) t ([\d.]+)$", re.M)
TERMINAL = re.compile(r"^(HANG|SLOW|INFO|UPDATED|RECOVERED) .*$", re.M)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def step_at(seconds: float, rate: str) -> int:
    """The step a workload reaches after `seconds` of running at RATE_MARGIN x its measured rate."""
    return int(seconds * STEPS_PER_S[rate] * RATE_MARGIN)


def workload_cmd(script: str, nproc: int, *args) -> List[str]:
    """torchrun of a workload under ccld/workloads/ on this node."""
    path = script if os.path.isabs(script) else os.path.join(WORKLOADS, script)
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
            "127.0.0.1", "--master-port", str(free_port()), path] + [str(a) for a in args]


def job_cmd(*args, nproc: int = 4) -> List[str]:
    return workload_cmd(GLOO_JOB, nproc, *args)


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
    healthy_s: float = 0.0               # healthy running this result covers (false findings per hour)
    baseline_s: Optional[float] = None   # healthy running before the onset (first progress line -> onset)
    terminal: List[str] = field(default_factory=list)   # what ccld printed, HANG/SLOW/... lines, in order

    def of(self, kind: Optional[str] = None, cls: Optional[str] = None) -> List[Dict[str, Any]]:
        return [f for f in self.findings if (kind is None or f.get("kind") == kind)
                and (cls is None or f.get("class") == cls)]


class Session:
    """Starts processes tagged with a unique env var in `tmp`; cleanup kills every tagged process."""

    def __init__(self, tmp):
        self.tag = uuid.uuid4().hex
        self.tmp = str(tmp)
        self.env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CCLD_TEST_TAG=self.tag)
        self.started: List[subprocess.Popen] = []
        self.closers: List[Callable[[], None]] = []   # run first at cleanup (a FUSE mount, a test bed)

    def start(self, name: str, cmd: List[str], env: Optional[Dict[str, str]] = None):
        log = os.path.join(self.tmp, f"{name}.log")
        p = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env or self.env,
                             start_new_session=True, cwd=self.tmp)
        self.started.append(p)
        return p, log

    def ccld_run(self, name: str, *job_args):
        """`ccld run` of the 4-rank gloo workload: (process, combined log, findings path)."""
        j = Job(self, name, job_cmd(*job_args))
        return j.p, j.log, j.fpath

    def job(self, name: str, script: str, nproc: int, *args, env: Optional[Dict[str, str]] = None) -> "Job":
        return Job(self, name, workload_cmd(script, nproc, *args), env=env)

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
        for close in reversed(self.closers):
            try:
                close()
            except Exception as e:  # noqa: BLE001 - cleanup goes on; the next closer may free more
                print(f"cleanup: {e}", file=sys.stderr)
        self.closers.clear()
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


class Job:
    """One `ccld run` of a command (a workload under torchrun), its log and its findings file."""

    def __init__(self, s: Session, name: str, cmd: List[str], env: Optional[Dict[str, str]] = None):
        self.s, self.name = s, name
        self.fpath = os.path.join(s.tmp, f"{name}-findings.jsonl")
        self.store = os.path.join(s.tmp, f"{name}-store")
        self.t0 = time.time()
        self.p, self.log = s.start(name, CCLD + ["run", "--findings", self.fpath, "--store", self.store, "--"] + cmd,
                                   env)
        self.findings: List[Dict[str, Any]] = []
        self.rc: Optional[int] = None
        self.t_stop = float("inf")   # when stop() began; results end there
        self.stop_s = 0.0

    def text(self) -> str:
        try:
            return open(self.log, errors="replace").read()
        except OSError:
            return ""

    def wait(self, pattern: str, timeout: float = START_TIMEOUT_S):
        return wait_for(self.log, pattern, timeout, self.p)

    def onset(self, pattern: str, timeout: float = START_TIMEOUT_S) -> float:
        """The Unix time on the workload's line `pattern ... t UNIX`."""
        return fault_time(self.log, pattern, timeout, self.p)

    def started_at(self, timeout: float = START_TIMEOUT_S) -> float:
        """The time of the first progress line (the job is past init and stepping)."""
        return float(self.wait(PROGRESS.pattern, timeout).group(3))

    def run_until(self, t: float) -> None:
        """Let the job run until Unix time t (AssertionError if it ends first)."""
        while time.time() < t:
            if self.p.poll() is not None:
                raise AssertionError(f"{self.name}: the job ended at {time.time():.1f} before {t:.1f}; "
                                     f"tail:\n{self.text()[-3000:]}")
            time.sleep(0.1)

    def wait_step(self, rank: int, step: int, timeout: float = START_TIMEOUT_S) -> float:
        return float(self.wait(rf"^rank {rank} step {step} t ([\d.]+)$", timeout).group(1))

    def expect(self, cls: str, after: float, deadline_s: float, settle: bool = True) -> bool:
        """Wait until a real finding of class `cls` detected after `after` is in the file, or until
        `deadline_s` (+ WAIT_MARGIN_S) has passed since `after`; then SETTLE_S more, so what else ccld
        says about the same fault is read too. False when none came."""
        end = after + deadline_s + WAIT_MARGIN_S
        while time.time() < end:
            if any(sc.is_real(f) and f.get("class") == cls and f.get("detected_at", 0) >= after
                   for f in read_findings(self.fpath)):
                if settle:
                    time.sleep(SETTLE_S)
                return True
            if self.p.poll() is not None:
                time.sleep(0.5)  # the final tick runs at exit: read once more
                return any(sc.is_real(f) and f.get("class") == cls for f in read_findings(self.fpath))
            time.sleep(0.1)
        return False

    def rate(self, t0: float, t1: float) -> Optional[float]:
        """Rank 0's steps per second between Unix times t0 and t1 (its progress lines)."""
        pts = [(int(m.group(2)), float(m.group(3))) for m in PROGRESS.finditer(self.text())
               if m.group(1) == "0" and t0 <= float(m.group(3)) <= t1]
        if len(pts) < 2:
            return None
        return round((pts[-1][0] - pts[0][0]) / (pts[-1][1] - pts[0][1]), 2)

    def stop(self) -> None:
        """End the scenario: kill the ranks (SIGCONT first: a stopped rank cannot die; ccld run's own
        stop would give them STOP_GRACE_S), Ctrl-C to ccld run, read the findings back. What ccld
        says after `t_stop` is about the teardown, not the scenario: results are cut there."""
        self.t_stop = time.time()
        if self.p.poll() is None:
            from ccld.tracer import discover
            for pid in self.s.tagged():
                if discover.identify(pid) is not None:
                    for sig in (signal.SIGCONT, signal.SIGKILL):
                        try:
                            os.kill(pid, sig)
                        except ProcessLookupError:
                            pass
        self.rc = interrupt(self.p)
        self.findings = read_findings(self.fpath)
        self.stop_s = time.time() - self.t_stop

    def result(self, name: str, cls: Optional[str], culprits: Sequence[int], onset: Optional[float] = None,
               since: Optional[float] = None, until: Optional[float] = None, **notes) -> Result:
        """The findings detected in [since, until) (either end open), as one scenario's Result."""
        until = self.t_stop if until is None else min(until, self.t_stop)
        fs = [f for f in self.findings if (since is None or f.get("detected_at", 0) >= since)
              and f.get("detected_at", 0) < until]
        text = self.text()
        first = PROGRESS.search(text)
        started = float(first.group(3)) if first else None
        end = until if until != float("inf") else time.time()
        healthy = max(0.0, end - max(started or end, since or 0.0)) if cls is None else 0.0
        if onset is not None:  # did the fault bite? rank 0's step rate before it and after
            notes.setdefault("steps_per_s", (self.rate(onset - RATE_WINDOW_S, onset), self.rate(onset, end)))
        r = Result(name, cls, list(culprits), onset=onset, findings=fs, ran_s=time.time() - self.t0, log=self.log,
                   notes=dict(notes), healthy_s=healthy,
                   baseline_s=None if onset is None or started is None else onset - started,
                   terminal=[m.group(0) for m in TERMINAL.finditer(text)])
        return r


def pin_with_hog(s: Session, rank: int, nproc: int, cpu: Optional[int] = None) -> subprocess.Popen:
    """Pin `rank` and a CPU hog (at HOG_NICE, a higher-priority neighbour: a rank that sleeps between
    steps gets the CPU back at once from an equal-priority hog, so the scheduler would all but hide
    the contention) to one core, every other rank off it (else they share the hog too)."""
    cpu = (os.cpu_count() or 2) - 1 if cpu is None else cpu
    others = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)) if c != cpu)
    for q in range(nproc):
        pid = s.rank_pid(q)
        if pid is None:
            raise AssertionError(f"rank {q} not found to pin")
        subprocess.run(["taskset", "-a", "-p", "-c", str(cpu) if q == rank else others, str(pid)],
                       check=True, capture_output=True)
    hog, _ = s.start("hog", ["nice", "-n", str(HOG_NICE), "taskset", "-c", str(cpu), sys.executable, "-c",
                             "while True: pass"])
    try:  # with autogroups (the default), nice counts only within a session: give the hog's its weight
        with open(f"/proc/{hog.pid}/autogroup", "w") as f:
            f.write(str(HOG_NICE))
    except OSError:
        pass  # no autogroups here: the process's nice is what counts
    return hog


def fault_file(s: Session, name: str) -> str:
    """The --fault-file of a job (see open_at)."""
    return os.path.join(s.tmp, f"{name}-fault-now")


def open_at(j: Job, path: str, t: float) -> None:
    """Let the job run until Unix time t, then create its --fault-file: the one-rank fault it holds acts
    at its next step (its line gives the onset). In time rather than at a step from STEPS_PER_S x
    RATE_MARGIN: that step came 20-50 % late (the margin, and a loaded box steps slower than
    measured; slowdowns 70-95 s in instead of 60), each second of it a second of CI and of
    bench/accuracy.py, for no more history than the detectors use."""
    j.run_until(t)
    open(path, "w").close()


def begin_slowdown(j: Job, path: str, rank: int) -> float:
    """Let the job run SLOW_BASELINE_S from its first progress line, then have `rank` slow down: the
    onset, from its "slowed by" line."""
    open_at(j, path, j.started_at() + SLOW_BASELINE_S)
    return j.onset(rf"^rank {rank}: slowed by", 60)


def stop_hog(hog: subprocess.Popen) -> None:
    if hog.poll() is None:
        hog.kill()
    hog.wait()


# ---- DDP-style scenarios (gloo_job.py, 4 ranks) ------------------------------------------------

BARE = ["--steps", 100000, "--ops", OPS, "--step-sleep-ms", 10, "--progress-every", 50]


def ddp_pause_then_sleep(s: Session, rank: int = 2) -> Dict[str, Result]:
    """Every rank pauses 15 s for an evaluation (healthy: nothing may be found), then, >= 20 s later,
    a rank sleeps forever before a step: not-entered, that rank."""
    pause_step = step_at(HANG_BASELINE_S / 2, "ddp-ops")
    hang_step = pause_step + step_at(HANG_BASELINE_S, "ddp-ops")
    j = s.job("pause-sleep", "gloo_job.py", 4, *BARE, "--pause-step", pause_step, "--pause-s", 15,
              "--hang-rank", rank, "--hang-step", hang_step)
    j.wait(rf"^rank {rank}: hanging before step {hang_step}$")
    onset = time.time()  # the line is printed just before the sleep; a 50 ms poll
    j.expect("not-entered", onset, HANG_DEADLINE_S)
    j.stop()
    return {"ddp-eval-pause": j.result("every rank pauses 15 s (DDP)", None, [], until=onset),
            "ddp-sleep": j.result("rank sleeps before a collective (DDP)", "not-entered", [rank], onset, since=onset,
                                  seq=FIRST_SEQ + OPS_PER_STEP * hang_step)}


def stop_rank(s: Session, j: Job, rank: int) -> float:
    """SIGSTOP a rank of the job; its onset."""
    os.kill(s.rank_pid(rank), signal.SIGSTOP)
    onset = time.time()
    j.expect("fault", onset, HANG_DEADLINE_S)
    return onset


def checkpoint_then_kill(s: Session, rank: int = 2) -> Dict[str, Result]:
    """Rank 0 writes checkpoints for 20 s from 20 s in while the others wait (healthy: at most an
    informational pause), then, 10 s after, `rank` is SIGKILLed: fault, exactly that rank (not the
    ranks the launcher stops after it)."""
    go = fault_file(s, "ckpt-kill")
    j = s.job("ckpt-kill", "gloo_job.py", 4, *BARE, "--ckpt-rank", 0, "--ckpt-step", 0, "--ckpt-s", 20,
              "--fault-file", go)
    open_at(j, go, j.started_at() + HANG_BASELINE_S)
    t_ckpt = j.onset(r"^rank 0: checkpointing for", 60)
    t_done = j.onset(r"^rank 0: checkpoint done", 60)
    j.run_until(t_done + 10)
    os.kill(s.rank_pid(rank), signal.SIGKILL)
    onset = time.time()
    j.expect("fault", onset, HANG_DEADLINE_S)
    j.stop()
    return {"ddp-checkpoint": j.result("rank 0 checkpoints 20 s (DDP)", None, [], until=onset,
                                       pause=(t_ckpt, t_done)),
            "ddp-killed": j.result("rank SIGKILLed mid-run (DDP)", "fault", [rank], onset, since=onset)}


def wrong_op(s: Session, rank: int = 1) -> Result:
    """A rank calls all_gather where the others all_reduce: inconsistent, that rank."""
    go = fault_file(s, "wrongop")
    j = s.job("wrongop", "gloo_job.py", 4, *BARE, "--wrong-op-rank", rank, "--wrong-op-step", 0, "--fault-file", go)
    open_at(j, go, j.started_at() + HANG_BASELINE_S)
    m = j.wait(rf"^rank {rank}: calling all_gather instead of \w+ at step (\d+) t ([\d.]+)$", 60)
    step, onset = int(m.group(1)), float(m.group(2))
    j.expect("inconsistent", onset, HANG_DEADLINE_S)
    j.stop()
    return j.result("all_gather vs all_reduce (DDP)", "inconsistent", [rank], onset,
                    seq=FIRST_SEQ + OPS_PER_STEP * step)


def wrong_size(s: Session, rank: int = 1) -> Result:
    """A rank all_reduces twice the elements of the others: inconsistent, that rank (the gloo probes
    give every rank's tensor bytes). Gloo then aborts a rank that receives more bytes than it expects
    and the others fail: notes["aborted"] is the rank torchrun reports as the first failure, a
    consequence that must not be named instead."""
    go = fault_file(s, "wrongsize")
    j = s.job("wrongsize", "gloo_job.py", 4, *BARE, "--wrong-size-rank", rank, "--wrong-size-step", 0,
              "--fault-file", go)
    open_at(j, go, j.started_at() + HANG_BASELINE_S)
    m = j.wait(rf"^rank {rank}: all_reduce of \d+ elements instead of \d+ at step (\d+) t ([\d.]+)$", 60)
    step, onset = int(m.group(1)), float(m.group(2))
    j.expect("inconsistent", onset, HANG_DEADLINE_S)
    try:
        j.p.wait(30)  # the job fails by itself: torchrun's summary names the first rank that died
    except subprocess.TimeoutExpired:
        pass
    text = j.text()
    m = re.search(r"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+)", text, re.S)
    j.stop()
    return j.result("a rank's tensor twice the size (DDP)", "inconsistent", [rank], onset,
                    seq=FIRST_SEQ + OPS_PER_STEP * step, aborted=int(m.group(1)) if m else None)


def subgroup_deadlock(s: Session) -> Result:
    """Two subgroups of ranks 0 and 1, taken in opposite orders by the two ranks at one step; ranks
    2 and 3 then wait in the default group. Culprits: 0 and 1 (each waits for the other)."""
    go = fault_file(s, "deadlock")
    j = s.job("deadlock", "gloo_job.py", 4, "--steps", 100000, "--ops", "allreduce,broadcast", "--step-sleep-ms", 10,
              "--progress-every", 50, "--deadlock-step", 0, "--fault-file", go)
    open_at(j, go, j.started_at() + HANG_BASELINE_S)
    onset = j.onset(r"^rank 1: taking the subgroups in the opposite order", 60)
    j.expect("not-entered", onset, HANG_DEADLINE_S)
    j.stop()
    return j.result("subgroups deadlocked (DDP)", "not-entered", [0, 1], onset)


def slow_then_stop(s: Session, rank: int = 2, ms: float = 40, stopped: int = 1) -> Dict[str, Result]:
    """A rank computes `ms` more every step (after 60 s), in a DDP model: comp-slow, that rank;
    then (once found, or its deadline passed) another rank is SIGSTOPped: fault, that rank."""
    go = fault_file(s, "slow-stop")
    j = s.job("slow-stop", "gloo_job.py", 4, "--steps", 1000000, "--ddp", "--step-sleep-ms", 10, "--progress-every", 20,
              "--slow-rank", rank, "--slow-ms", ms, "--fault-file", go)
    onset = begin_slowdown(j, go, rank)
    j.expect("comp-slow", onset, SLOW_DEADLINE_S)
    t_stop = stop_rank(s, j, stopped)
    j.stop()
    return {"ddp-slow": j.result(f"+{ms:g} ms compute per step (DDP)", "comp-slow", [rank], onset, until=t_stop),
            "ddp-stop": j.result("rank SIGSTOPped (DDP)", "fault", [stopped], t_stop, since=t_stop)}


def cpu_contention(s: Session, rank: int = 3) -> Result:
    """The rank and a CPU hog pinned to one core after >= 60 s, the other ranks to the other cores,
    the work per step fixed (--compute-work): comp-slow, that rank, with runqueue evidence."""
    j = s.job("contention", "gloo_job.py", 4, "--steps", 1000000, "--ops", OPS, "--compute-ms", 10, "--compute-work",
              "--step-sleep-ms", 10, "--progress-every", 100)
    j.run_until(j.started_at() + SLOW_BASELINE_S)
    hog = pin_with_hog(s, rank, 4)
    onset = time.time()
    try:
        j.expect("comp-slow", onset, SLOW_DEADLINE_S)
    finally:
        stop_hog(hog)
    j.stop()
    return j.result("CPU hog on the rank's core (DDP)", "comp-slow", [rank], onset)


def healthy_run(s: Session, name: str, script: str, nproc: int, args: Sequence, seconds: float) -> Result:
    """A workload that runs `seconds` and exits 0: nothing may be found (healthy_s: that long)."""
    j = s.job(name, script, nproc, "--seconds", seconds, "--progress-every", 200, *args)
    rc = j.p.wait(seconds + START_TIMEOUT_S + 60)
    j.stop()
    steps = re.findall(r"^rank \d+ done: (\d+) steps", j.text(), re.M)
    return j.result(f"healthy {name}", None, [], rc=rc, steps=steps)


def _register() -> None:
    register_job("ddp-pause-sleep", ddp_pause_then_sleep,
                 Scenario("ddp-eval-pause", "healthy: every rank pauses 15 s for an evaluation (DDP)", "ddp", None, [],
                          kind="healthy"),
                 Scenario("ddp-sleep", "not-entered: a rank sleeps before a collective (DDP)", "ddp", "not-entered",
                          [2]))
    register_job("ddp-ckpt-kill", checkpoint_then_kill,
                 Scenario("ddp-checkpoint", "healthy: rank 0 checkpoints 20 s (DDP)", "ddp", None, [], kind="healthy"),
                 Scenario("ddp-killed", "fault: a rank SIGKILLed mid-run (DDP)", "ddp", "fault", [2]))
    register(Scenario("ddp-wrong-op", "inconsistent: all_gather vs all_reduce (DDP)", "ddp", "inconsistent", [1],
                      run=wrong_op))
    register(Scenario("ddp-wrong-size", "inconsistent: a rank's tensor twice the size (DDP)", "ddp", "inconsistent",
                      [1], run=wrong_size))
    register(Scenario("ddp-deadlock", "not-entered: two subgroups deadlocked (DDP)", "ddp", "not-entered", [0, 1],
                      run=subgroup_deadlock))
    register_job("ddp-slow-stop", slow_then_stop,
                 Scenario("ddp-slow", "comp-slow: +40 ms compute per step (DDP model)", "ddp", "comp-slow", [2],
                          deadline_s=SLOW_DEADLINE_S, kind="slow"),
                 Scenario("ddp-stop", "fault: a rank SIGSTOPped (DDP)", "ddp", "fault", [1]))
    register(Scenario("ddp-cpu-hog", "comp-slow: a CPU hog on the rank's core (DDP)", "ddp", "comp-slow", [3],
                      run=cpu_contention, deadline_s=SLOW_DEADLINE_S, kind="slow"))
    register(Scenario("healthy-ddp", "healthy: a DDP model, no fault", "ddp", None, [], kind="healthy", ci=False,
                      run=lambda s, seconds=120: healthy_run(s, "ddp", "gloo_job.py", 4,
                                                             ["--ddp", "--step-sleep-ms", 5], seconds),
                      long_run=True))
    register(Scenario("healthy-ddp-ops", "healthy: bare collectives, no fault", "ddp", None, [], kind="healthy",
                      ci=False, long_run=True,
                      run=lambda s, seconds=120: healthy_run(s, "ddp-ops", "gloo_job.py", 4,
                                                             ["--ops", OPS, "--step-sleep-ms", 10], seconds)))


_register()
