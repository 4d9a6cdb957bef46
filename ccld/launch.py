"""`ccld run`: start a collector (unless one is named) and an agent, run the command, trace every rank
it spawns, and stop everything when it exits. Exit status = the command's.

The command gets its own process group, so Ctrl-C reaches ccld first; ccld then stops that group
(SIGTERM, then SIGKILL after STOP_GRACE_S), flushes findings and the store, and exits.
Start-up: the command starts as soon as the probe programs are in the kernel (from the compiled-
program cache, ~0.05 s; the first run on a kernel compiles them, ~1 s a family, and keeps them:
ccld/bpf/progcache.py). The collector and the agent's threads come up while the command starts:
the programs are loaded and waiting for its ranks before it runs, and a rank is attached within the
agent's first scans, seconds before a torch job can reach its first collective (importing torch
alone takes longer), so the process-group constructors and the first collectives are seen.
"""
from __future__ import annotations

import os
import select
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
WAIT_SLICE_S = 5.0    # the longest a stop could wait were its signal's wake-up byte lost
NAP_S = 0.1           # `ccld run`'s wait for its command where the kernel has no pidfd (before 5.3)


class StopFlag:
    """Set by SIGINT/SIGTERM, read by the main loop. Lock-free on purpose: a threading.Event's set()
    takes the lock its wait() holds between bytecodes, so a signal landing there deadlocked the main
    thread in its own handler (the collector then never stopped: seen twice in CI). The waiter sleeps
    in poll() on a pipe that the interpreter's C-level signal handler writes to (signal.set_wakeup_fd):
    a stop ends the wait at once, also when the signal came just before poll() began (the byte is
    already there), and a waiting agent or collector does not wake ten times a second to look."""

    def __init__(self) -> None:
        self._got: list = []  # list.append is atomic and takes no lock a waiter could hold
        self._r, self._w = os.pipe()
        for fd in (self._r, self._w):
            os.set_blocking(fd, False)
        self._poll = select.poll()  # not select(): no FD_SETSIZE limit on a collector with many sockets
        self._poll.register(self._r, select.POLLIN)

    def wake_on_signals(self) -> int:
        """Main thread only: every signal with a Python handler writes a byte to this flag's pipe.
        Returns the wake-up fd it replaces (signal.set_wakeup_fd(old) puts it back)."""
        return signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)

    def watch(self, fd: int) -> None:
        """wait() also ends when `fd` is readable (a job's pidfd: readable once it exited)."""
        self._poll.register(fd, select.POLLIN)

    def is_set(self) -> bool:
        return bool(self._got)

    def close(self) -> None:
        for fd in (self._r, self._w):
            os.close(fd)

    def set(self) -> None:
        self._got.append(True)

    def wait(self, timeout: float) -> bool:
        """True once set; else sleeps up to `timeout` (less when a signal comes) and says whether it
        is set now."""
        if not self._got and timeout > 0:
            if self._poll.poll(timeout * 1000):  # drained: a signal that set no flag must not keep waking us
                try:
                    os.read(self._r, 512)
                except OSError:
                    pass
        return bool(self._got)


@dataclass
class Session:
    """A collector (maybe) + an agent, for one traced command."""
    collector: object
    agent: object
    endpoint: str


def open_session(collector_addr: Optional[str], store: Optional[str], findings: Optional[str],
                 hang_after: float, use_bpf: bool, say: Callable[[str], None], preloaded=None,
                 cupti_sink=None, ncclprof_sink=None) -> Session:
    """A collector (unless one is named) and an agent for it; the agent adopts probe families already
    loaded (load_families) and a CUPTI sink already made, when given."""
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
                  time_service=svc.endpoint if svc is not None else None, preloaded=preloaded,
                  cupti_sink=cupti_sink, ncclprof_sink=ncclprof_sink)
    agent.load()
    return Session(collector, agent, endpoint)


class _EarlySink:
    """What the CUPTI check (cupti/inject.job_env) asks of an agent before the agent exists: a sink
    for the shim's records, made now (its endpoint goes in the job's environment), adopted by the
    agent when it comes (nothing reads the sink before that; the shim's records wait in it)."""

    def __init__(self, relay):
        self.relay, self.sink, self.ncclprof = relay, None, None

    def open_cupti_sink(self) -> str:
        from ccld.tracer.cupti_sink import CuptiSink
        if self.sink is None:
            self.sink = CuptiSink(self.relay)
        return self.sink.endpoint

    def open_ncclprof_sink(self) -> str:
        from ccld.tracer.ncclprof_sink import NcclProfSink
        if self.ncclprof is None:
            self.ncclprof = NcclProfSink(self.relay)
        return self.ncclprof.path

    def close(self) -> None:
        for s in (self.sink, self.ncclprof):
            if s is not None:
                s.close()


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
    from ccld.tracer.agent import drain_ms_from_env
    drain_ms_from_env()  # a bad CCLD_DRAIN_MS is named before the job starts, not after
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # a pod's env (PyTorchJob): discover.runs_training
        say(f"ccld: note: this environment sets RANK={os.environ['RANK']} WORLD_SIZE={os.environ['WORLD_SIZE']}; "
            "a Python command that keeps them is traced as that rank, a launcher (torchrun, deepspeed, "
            "accelerate) is not (its workers are)")
    tmp_store = None
    if perfetto and collector_addr:
        say(f"ccld: note: --perfetto belongs to the collector at {collector_addr}; ignored here")
        perfetto = None
    elif perfetto and not store:  # the trace is made from a store: keep a temporary one for it
        store = tmp_store = tempfile.mkdtemp(prefix="ccld-run-store-")
    # The programs first, then the command, then the rest: the command does not wait for the
    # collector's start, and its ranks find the programs loaded. From the cache that needs no bcc
    # (~0.1 s); where the cache lacks one (the first run on a kernel), every family is compiled first
    # (bcc, in a child process per family: ccld/bpf/compile.py).
    from ccld.bpf import progcache
    programs = progcache.preload(tuple(progcache.PROGRAMS)) if use_bpf and progcache.bpf_available() is None else {}
    pre = None
    if use_bpf and len(programs) < len(progcache.PROGRAMS):
        from ccld.tracer.families import load_families
        pre = load_families(use_bpf=use_bpf, programs=programs)
    done = StopFlag()

    def on_signal(signum, _frame):
        done.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    from ccld.tracer.relay import Relay
    relay = pre.relay if pre is not None else Relay()
    early = _EarlySink(relay)
    try:
        from ccld.cupti.inject import job_env
        env = job_env(early, say)  # says once whether CUPTI is on; None: the job's env unchanged
        from ccld.tracer import ncclprof_sink
        env = ncclprof_sink.job_env(early, say, env) or env  # the NCCL profiler plugin, where NCCL can be
        try:
            proc = subprocess.Popen(cmd, start_new_session=True, env=env)
        except OSError as e:
            raise CcldError(f"cannot start {cmd[0]!r}: {e.strerror}") from None
    except BaseException:
        for s_, h in old.items():
            signal.signal(s_, h)
        done.close()
        for fam, _ in (pre.families if pre is not None else []):
            fam.close()
        for prog in programs.values():
            prog.cleanup()
        early.close()
        if tmp_store:
            shutil.rmtree(tmp_store, ignore_errors=True)
        raise
    try:
        if pre is None:  # the cached programs are in the kernel: now their families and translators
            from ccld.tracer.families import load_families
            pre = load_families(use_bpf=use_bpf, programs=programs)
            pre.relay = relay
            for _, tr in pre.families:
                tr.emit = relay
        session = open_session(collector_addr, store, findings, hang_after, use_bpf, say, preloaded=pre,
                               cupti_sink=early.sink, ncclprof_sink=early.ncclprof)
        session.agent.root_pid = proc.pid
        session.agent.start()
    except BaseException:
        stop_group(proc)
        for s_, h in old.items():
            signal.signal(s_, h)
        done.close()
        for fam, _ in (pre.families if pre is not None else []):
            fam.close()
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
            stop_group(proc)
            for s_, h in old.items():
                signal.signal(s_, h)
            done.close()
            close_session(session)
            if tmp_store:
                shutil.rmtree(tmp_store, ignore_errors=True)
            raise
        say(f"ccld: metrics at {served.url}/metrics, live view: ccld top {served.host}:{served.port}")
    try:
        shown = shlex.join([os.path.basename(cmd[0])] + cmd[1:])
        shown = shown if len(shown) <= 48 else shown[:47] + "…"
        say(f"ccld: tracing `{shown}` (pid {proc.pid}); sources: {', '.join(session.agent.all_sources)}. "
            "Ctrl-C to end")
        _wait_job(proc, done)
        if done.is_set():
            say("ccld: interrupted; stopping the command")
            if session.collector is not None:
                session.collector.quiesce()  # ranks our SIGTERM catches mid-step are not a hang
            session.agent.stop()  # before the ranks die: our own SIGTERM is not a finding
            stop_group(proc)
        return exit_status(proc.returncode)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        done.close()
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


def _wait_job(proc: subprocess.Popen, done: StopFlag) -> None:
    """Until the command exits or a stop signal came, asleep in poll() on the command's pidfd and the
    signal wake-up pipe (the same StopFlag as `ccld agent` and `ccld collector`): no waking ten times a
    second to look. Without pidfds (a kernel before 5.3), naps of NAP_S."""
    try:
        pidfd: Optional[int] = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        pidfd = None
    old = done.wake_on_signals()
    try:
        if pidfd is not None:
            done.watch(pidfd)
        while proc.poll() is None and not done.is_set():
            done.wait(WAIT_SLICE_S if pidfd is not None else NAP_S)
    finally:
        signal.set_wakeup_fd(old)
        if pidfd is not None:
            os.close(pidfd)
