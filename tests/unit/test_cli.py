"""The command line: clear one-line errors for bad input and missing privileges, no tracebacks."""
import os
import re
import signal
import stat
import subprocess
import sys
import time

import pytest

from ccld.tracer.agent import Agent

pytestmark = pytest.mark.unit
CCLD = [sys.executable, "-m", "ccld.cli"]


def ccld(*args, timeout=60):
    return subprocess.run(CCLD + list(args), capture_output=True, text=True, timeout=timeout)


def test_run_without_a_command_says_what_to_do():
    r = ccld("run", "--")
    assert r.returncode == 1
    assert "nothing to run" in r.stderr and "Traceback" not in r.stderr


def test_a_bad_drain_period_is_named_before_the_job_starts(tmp_path):
    marker = tmp_path / "ran"
    env = dict(os.environ, CCLD_DRAIN_MS="soon")
    r = subprocess.run(CCLD + ["run", "--no-bpf", "--", "touch", str(marker)], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 1 and "CCLD_DRAIN_MS='soon'" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not marker.exists()  # the command never started
    r = subprocess.run(CCLD + ["agent", "--pid", str(os.getpid()), "--no-bpf", "--collector", "tcp://127.0.0.1:1"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 1 and "CCLD_DRAIN_MS='soon'" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_diagnose_of_a_missing_store_names_it(tmp_path):
    r = ccld("diagnose", str(tmp_path / "nope"))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert str(tmp_path / "nope") in r.stderr


def test_agent_for_a_vanished_pid_is_a_clear_error():
    r = ccld("agent", "--pid", "999999999", "--collector", "tcp://127.0.0.1:1")
    assert r.returncode == 1 and "no process with pid 999999999" in r.stderr


def test_agent_needs_a_target():
    r = ccld("agent", "--collector", "tcp://127.0.0.1:1")
    assert r.returncode == 1 and "--pid" in r.stderr and "--discover" in r.stderr


def test_without_root_the_agent_says_once_what_is_missing(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    lines = []
    a = Agent("tcp://127.0.0.1:1", pids=[os.getpid()], say=lines.append)
    try:
        a.load()
        assert a.sources == ["proc"] and a.families == []
        assert len(lines) == 1
        assert "eBPF probes are off" in lines[0] and "fix:" in lines[0] and "/proc only" in lines[0]
    finally:
        a.shipper.close(timeout_s=0)


def test_help_has_examples():
    r = ccld("--help")
    assert r.returncode == 0 and "examples:" in r.stdout and "ccld run -- torchrun" in r.stdout


def test_collector_refuses_to_listen_beyond_loopback_without_keys():
    r = ccld("collector", "--listen", "tcp://0.0.0.0:1")
    assert r.returncode == 1 and "without authentication" in r.stderr and "ccld keys" in r.stderr


def test_keys_verb_makes_an_owner_only_secret(tmp_path):
    r = ccld("keys", str(tmp_path / "k"), "collector")
    assert r.returncode == 0, r.stderr
    assert oct(os.stat(tmp_path / "k" / "collector.key_secret").st_mode & 0o777) == "0o600"


def test_agent_spools_to_an_owner_only_directory_and_says_what_it_shipped(tmp_path):
    """No collector at all: every frame stays in the spool, and the exit line says so."""
    spool = tmp_path / "spool"
    p = subprocess.Popen(CCLD + ["agent", "--pid", str(os.getpid()), "--no-bpf", "--collector",
                                 "tcp://127.0.0.1:1", "--time-service", "off", "--spool", str(spool),
                                 "--spool-max-mb", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not list(spool.glob("frames-*.spool")) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        p.send_signal(signal.SIGINT)
        out = p.communicate(timeout=60)[0]
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, out
    assert f"; spool {spool} (1 MiB). Ctrl-C to end" in out
    m = re.search(r"ccld agent: shipped 0 frames .* lost 0 events .* (\d+) frames left in the spool", out)
    assert m and int(m.group(1)) > 0, out
    assert stat.S_IMODE(spool.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in spool.iterdir())


def test_agent_spool_bound_must_be_positive():
    r = ccld("agent", "--pid", str(os.getpid()), "--spool-max-mb", "0")
    assert r.returncode == 1 and "--spool-max-mb must be positive" in r.stderr


def _signalled_child(wait, sig, delay_s: float) -> bool:
    """Fork a child that installs the stop handler, says it is ready, then exits 7 if wait(flag) says
    stop; send it `sig` `delay_s` after it is ready. True when it exited 7 within 5 s (else killed)."""
    from ccld.commands import _on_signal
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            done = _on_signal()
            os.write(w, b"r")
            os._exit(7 if wait(done) else 3)
        finally:
            os._exit(1)
    os.close(w)
    assert os.read(r, 1) == b"r"
    os.close(r)
    time.sleep(delay_s)
    os.kill(pid, sig)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got:
            assert os.waitstatus_to_exitcode(status) == 7
            return True
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return False


def test_a_stop_signal_ends_a_long_wait_at_once():
    """The waiting main thread sleeps in poll() on the signal wake-up pipe, not in 0.1 s naps: one
    wait of 30 s ends when SIGTERM comes (the old time.sleep slept it out), and it says stop."""
    assert _signalled_child(lambda done: done.wait(30), signal.SIGTERM, 0.2), \
        "a 30 s wait did not end when SIGTERM came"


def _spin(done) -> bool:
    while not done.wait(0):
        pass
    return True


def test_a_stop_signal_never_deadlocks_the_waiting_main_thread():
    """The collector's and agent's Ctrl-C handler ran threading.Event.set(), which takes the lock the
    main thread's Event.wait() holds between bytecodes: a signal landing there hung the process (CI,
    twice). Here a child polls the flag as fast as it can while SIGINT comes at varied moments; with
    the Event, about 2 in 3 children hung."""
    hung = sum(not _signalled_child(_spin, signal.SIGINT, 0.002 * (i % 5)) for i in range(40))
    assert hung == 0, f"{hung} of 40 children hung in their stop handler"
