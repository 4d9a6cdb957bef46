"""`ccld run`: start a collector (unless one is named) and an agent, run the command, trace every rank
it spawns, and stop everything when it exits. Exit status = the command's.

The command gets its own process group, so Ctrl-C reaches ccld first; ccld then stops that group
(SIGTERM, then SIGKILL after STOP_GRACE_S), flushes findings and the store, and exits.
BPF programs are compiled before the command starts (about 1-2 s), so the first collectives and
the process-group constructors are seen.
"""
from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, List, Optional

from ccld.errors import CcldError

STOP_GRACE_S = 10.0   # torchrun forwards SIGTERM to its workers and waits for them; give it time
DRAIN_S = 0.5         # after the command exits: let the last frames reach the collector


@dataclass
class Session:
    """A collector (maybe) + an agent, for one traced command."""
    collector: object
    agent: object
    endpoint: str


def open_session(collector_addr: Optional[str], store: Optional[str], findings: Optional[str],
                 hang_after: float, use_bpf: bool, say: Callable[[str], None]) -> Session:
    from ccld.tracer.agent import Agent
    collector = None
    endpoint = collector_addr
    if not endpoint:
        from ccld.collector.server import Collector
        collector = Collector(listen="tcp://127.0.0.1:*", store_dir=store, findings_path=findings,
                              on_line=say, floor_s=hang_after)
        collector.start()
        endpoint = collector.endpoint
    elif store or findings:
        say("ccld: note: --store/--findings belong to the collector at " + endpoint + "; ignored here")
    svc = collector.time_service if collector is not None else None  # on a random port: tell the agent
    agent = Agent(endpoint, root_pid=-1, use_bpf=use_bpf, say=say,
                  time_service=svc.endpoint if svc is not None else None)
    agent.load()
    return Session(collector, agent, endpoint)


def close_session(s: Session) -> None:
    s.agent.stop()
    if s.collector is not None:
        time.sleep(DRAIN_S)
        s.collector.stop()


def stop_group(proc: subprocess.Popen) -> None:
    """Stop the command and everything it started: SIGCONT (a stopped rank cannot die), SIGTERM,
    then SIGKILL after STOP_GRACE_S. torchrun puts each worker in a session of its own, so the
    command's process group is not enough: every descendant is signalled too."""
    from ccld.tracer.discover import descendants
    family = descendants(proc.pid) | {proc.pid}

    def signal_all(sig):
        for pid in family:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    signal_all(signal.SIGCONT)
    try:
        os.kill(proc.pid, signal.SIGTERM)  # torchrun forwards it to its workers and reports
    except ProcessLookupError:
        pass
    try:
        proc.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    family |= descendants(proc.pid)
    signal_all(signal.SIGKILL)
    proc.wait()


def exit_status(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def run(cmd: List[str], collector_addr: Optional[str], store: Optional[str], findings: Optional[str],
        hang_after: float, use_bpf: bool, say: Callable[[str], None] = print,
        perfetto: Optional[str] = None, metrics: Optional[str] = None) -> int:
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise CcldError("nothing to run: give a command after --, e.g. ccld run -- torchrun --nproc-per-node 4 train.py")
    tmp_store = None
    if perfetto and collector_addr:
        say(f"ccld: note: --perfetto belongs to the collector at {collector_addr}; ignored here")
        perfetto = None
    elif perfetto and not store:  # the trace is made from a store: keep a temporary one for it
        store = tmp_store = tempfile.mkdtemp(prefix="ccld-run-store-")
    try:
        session = open_session(collector_addr, store, findings, hang_after, use_bpf, say)
    except BaseException:
        if tmp_store:
            shutil.rmtree(tmp_store, ignore_errors=True)
        raise
    served = None
    if metrics and session.collector is None:
        say(f"ccld: note: --metrics belongs to the collector at {session.endpoint}; ignored here")
    elif metrics:
        from ccld.collector.metrics import MetricsServer
        try:
            served = MetricsServer(session.collector, metrics).start()
        except BaseException:
            close_session(session)
            if tmp_store:
                shutil.rmtree(tmp_store, ignore_errors=True)
            raise
        say(f"ccld: metrics at {served.url}/metrics, live view: ccld top {served.host}:{served.port}")
    interrupted = []

    def on_signal(signum, _frame):
        interrupted.append(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        from ccld.cupti.inject import job_env
        env = job_env(session.agent, say)  # says once whether CUPTI is on; None: the job's env unchanged
        try:
            proc = subprocess.Popen(cmd, start_new_session=True, env=env)
        except OSError as e:
            raise CcldError(f"cannot start {cmd[0]!r}: {e.strerror}") from None
        session.agent.root_pid = proc.pid
        session.agent.start()
        shown = shlex.join([os.path.basename(cmd[0])] + cmd[1:])
        shown = shown if len(shown) <= 48 else shown[:47] + "…"
        say(f"ccld: tracing `{shown}` (pid {proc.pid}); sources: {', '.join(session.agent.sources)}. "
            "Ctrl-C to end")
        while proc.poll() is None and not interrupted:
            time.sleep(0.1)
        if interrupted:
            say("ccld: interrupted; stopping the command")
            if session.collector is not None:
                session.collector.quiesce()  # ranks our SIGTERM catches mid-step are not a hang
            session.agent.stop()  # before the ranks die: our own SIGTERM is not a finding
            stop_group(proc)
        return exit_status(proc.returncode)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if served is not None:
            served.stop()
        close_session(session)
        if session.collector is not None:
            n = len(getattr(session.collector, "findings", []))
            say(f"ccld: done; {n} finding{'s' if n != 1 else ''}" +
                (f" in {findings}" if findings and n else ""))
            if perfetto:
                from ccld.export import export_at_stop
                export_at_stop(store, perfetto, session.collector.findings, say, remove_store=tmp_store is not None)
