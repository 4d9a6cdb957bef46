"""`ccld demo`: a 4-rank gloo job on the CPU, traced by ccld, with one injected fault.

  hang  one random rank sleeps forever before a random step (a "not-entered" hang)
  stop  one random rank is SIGSTOPped a few seconds in (a stopped process)
  none  a healthy job: ccld should find nothing
The demo shows what ccld reports, then stops the job, cleans up, and exits 0 when ccld named the
faulty rank (1 when it did not). Needs torch in the same Python (the README's setup installs it).
"""
from __future__ import annotations

import importlib.util
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional

from ccld import launch
from ccld.errors import CcldError

WORKLOAD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workloads", "gloo_job.py")
FIND_TIMEOUT_S = 90.0    # the job starts in ~10 s on 2 vCPUs; detection takes seconds after the fault
HEALTHY_STEPS = 400      # fault "none": about 10 s of steps


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_command(ranks: int, port: int, extra) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
            "--master-addr", "127.0.0.1", "--master-port", str(port), WORKLOAD,
            "--ops", "allreduce,broadcast,barrier", "--compute-ms", "5", "--step-sleep-ms", "10"] + list(extra)


def run(fault: str, ranks: int, seed: Optional[int], keep: Optional[str], say: Callable[[str], None]) -> int:
    if importlib.util.find_spec("torch") is None:
        raise CcldError("the demo needs torch in this Python: pip install torch==2.13.0 (scripts/setup.sh does it)")
    if ranks < 2:
        raise CcldError("--ranks must be at least 2")
    rng = random.Random(seed)
    bad_rank = rng.randrange(ranks)
    out_dir = keep or tempfile.mkdtemp(prefix="ccld-demo-")
    os.makedirs(out_dir, exist_ok=True)
    store, findings = os.path.join(out_dir, "store"), os.path.join(out_dir, "findings.jsonl")
    extra = ["--steps", str(HEALTHY_STEPS)] if fault == "none" else ["--steps", "1000000"]
    if fault == "hang":
        step = rng.randrange(100, 300)
        extra += ["--hang-rank", str(bad_rank), "--hang-step", str(step)]
        say(f"demo: {ranks} ranks; rank {bad_rank} will hang before step {step}")
    elif fault == "stop":
        say(f"demo: {ranks} ranks; rank {bad_rank} will be SIGSTOPped a few seconds in")
    else:
        say(f"demo: {ranks} healthy ranks, {HEALTHY_STEPS} steps")

    session = launch.open_session(None, store, findings, hang_after=None, use_bpf=True, say=say)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(job_command(ranks, free_port(), extra), start_new_session=True, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    session.agent.root_pid = proc.pid
    session.agent.start()
    say(f"demo: job started (torchrun pid {proc.pid}); ccld sources: {', '.join(session.agent.all_sources)}")
    found = None
    stopper = _Stopper(session, bad_rank) if fault == "stop" else None
    try:
        deadline = time.monotonic() + FIND_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            if stopper:
                stopper.tick()
            hits = [f for f in session.collector.findings if getattr(f, "kind", "") == "hang"]
            if hits:
                found = hits[0]
                time.sleep(1.0)  # let any companion findings arrive before we stop the job
                break
    finally:
        # Stop tracing first: the job's ranks dying under our own SIGTERM is not a finding. Nor is
        # what the collector would see while the agent detaches its probes (seconds): no RankStates
        # from ranks still waiting, so "records behind its heartbeats" and a RECOVERED for a hang
        # that still held. A job stopped on purpose is quiesced first, as `ccld run` does on Ctrl-C.
        if proc.poll() is None and session.collector is not None:
            session.collector.quiesce()
        launch.close_session(session)
        launch.stop_group(proc)
    named = found is not None and found.ranks == [bad_rank]
    if fault == "none":
        n = len(session.collector.findings)
        say(f"demo: healthy job finished; ccld reported {n} finding{'s' if n != 1 else ''}")
        ok = n == 0
    elif found is None:
        say(f"demo: ccld did not report the fault within {FIND_TIMEOUT_S:.0f} s")
        ok = False
    else:
        lag = found.detected_at - found.onset_at
        say(f"demo: ccld named rank{'s' if len(found.ranks) != 1 else ''} {found.ranks} "
            f"({found.kind}/{found.cls}) "
            f"{lag:.1f} s after the wait began; the injected fault was on rank {bad_rank}: "
            f"{'correct' if named else 'WRONG'}")
        ok = named
    say(f"demo: findings in {findings}, store in {store}" if keep else "demo: cleaned up")
    if not keep:
        shutil.rmtree(out_dir, ignore_errors=True)
    return 0 if ok else 1


class _Stopper:
    """SIGSTOPs the bad rank once it has been traced for STOP_AFTER_S (so the job is in its loop)."""
    STOP_AFTER_S = 4.0

    def __init__(self, session, rank: int):
        self.session, self.rank = session, rank
        self.ready_at: Optional[float] = None
        self.done = False

    def tick(self) -> None:
        if self.done:
            return
        agent = self.session.agent
        need = [f.NAME for f, _ in agent.families][:1]  # gloo, when eBPF is on
        mine = [r for r in list(agent.ranks.values())
                if r.ident.rank == self.rank and all(n in r.attached for n in need)]
        if not mine:
            return
        if self.ready_at is None:
            self.ready_at = time.monotonic()
        elif time.monotonic() - self.ready_at >= self.STOP_AFTER_S:
            os.kill(mine[0].ident.pid, signal.SIGSTOP)
            self.done = True
