"""launch._wait_job: `ccld run` waits for its command asleep (its pidfd and the signal wake-up pipe in
one poll), not in 0.1 s naps, and still ends at once when the command exits or a stop signal comes."""
import signal
import subprocess
import threading
import time

import pytest

from ccld.launch import WAIT_SLICE_S, StopFlag, _wait_job

pytestmark = pytest.mark.unit


def test_the_wait_ends_when_the_command_exits_without_polling_for_it():
    done = StopFlag()
    waits = []
    real = done.wait
    done.wait = lambda timeout: waits.append(timeout) or real(timeout)
    try:
        proc = subprocess.Popen(["sleep", "1"])
        t0 = time.monotonic()
        _wait_job(proc, done)
        took = time.monotonic() - t0
    finally:
        done.close()
    assert proc.returncode == 0 and not done.is_set()
    assert took < WAIT_SLICE_S - 1, took   # the pidfd woke it, not the slice
    assert len(waits) <= 3, waits           # a 0.1 s nap loop would have looked ~10 times


def test_a_stop_signal_ends_the_wait_while_the_command_runs():
    done = StopFlag()
    old = signal.signal(signal.SIGTERM, lambda *_: done.set())
    proc = subprocess.Popen(["sleep", "30"])
    try:
        threading.Timer(0.3, lambda: signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)).start()
        t0 = time.monotonic()
        _wait_job(proc, done)
        assert done.is_set() and proc.poll() is None
        assert time.monotonic() - t0 < WAIT_SLICE_S - 1
        assert signal.set_wakeup_fd(-1) == -1  # the wake-up fd it set is put back (pytest had none)
    finally:
        signal.signal(signal.SIGTERM, old)
        proc.kill()
        proc.wait()
        done.close()
