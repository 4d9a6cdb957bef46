"""End to end: a real `ccld collector --store DIR` process is SIGKILLed and restarted on the same store.

Everything it acknowledged (stats.json's store_durable_records) must come back, the unflushed tail it
lost must be reported (never silent), and the restarted collector must keep appending after it.
Needs no root: it only runs processes and talks ZeroMQ on 127.0.0.1. ~8 s on 2 vCPUs.
"""
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import zmq

from conftest import free_port
from ccld import wire as ev
from ccld.store import read_meta, read_stats, read_store

pytestmark = pytest.mark.e2e

CCLD = [sys.executable, "-m", "ccld.cli"]
START_TIMEOUT_S = 30.0   # python + zmq import on a loaded 2-core box
ACK_TIMEOUT_S = 15.0     # stats.json is rewritten every 2 s


def wait_for(cond, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def batch(i):
    """Batch i of agent-0: a clock sample and a rank state (a hello first), ~150 bytes."""
    evs = [ev.ClockSample(mono_ns=i * 10**6, wall_ns=1_700_000_000 * 10**9 + i * 10**6, ts_ns=i * 10**6),
           ev.RankState(pid=4242, rank=0, ts_ns=i * 10**6, state="S", wchan="futex_wait_queue", cpu_ns=i)]
    if i == 0:
        evs.insert(0, ev.AgentHello(agent="agent-0", node="node-0", pid=4242, version="test",
                                    sources=["proc"], ts_ns=0))
    return ev.encode_batch("agent-0", "node-0", i, evs)


class Run:
    """One collector process and one PUSH socket to it."""

    def __init__(self, store, port, log):
        self.log = log
        self.proc = subprocess.Popen(
            CCLD + ["collector", "--listen", f"tcp://127.0.0.1:{port}", "--store", str(store)],
            stdout=open(log, "w"), stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
            start_new_session=True)
        ok = wait_for(lambda: "listening on" in log.read_text() or self.proc.poll() is not None,
                      START_TIMEOUT_S)
        assert ok and self.proc.poll() is None, log.read_text()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")

    def send(self, frames):
        for f in frames:
            self.sock.send(f)

    def close_socket(self):
        self.sock.close(linger=0)
        t = threading.Thread(target=self.ctx.term, daemon=True)
        t.start()
        t.join(5.0)
        assert not t.is_alive(), "zmq context did not terminate"

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def acked(store):
    """Records the running collector acknowledges as fsynced (stats.json), 0 before its first stats."""
    s = read_stats(str(store)) or {}
    return s.get("store_durable_records") or 0


def test_sigkilled_collector_restarts_and_loses_only_its_unflushed_tail(tmp_path):
    store = tmp_path / "store"
    port = free_port()
    n, m, k = 23, 7, 11
    first = [batch(i) for i in range(n + m)]
    second = [batch(i) for i in range(n + m, n + m + k)]
    runs = []
    try:
        # run 1: 23 frames acknowledged as durable, 7 more in flight, then SIGKILL
        r1 = Run(store, port, tmp_path / "collector-1.log")
        runs.append(r1)
        r1.send(first[:n])
        assert wait_for(lambda: acked(store) >= n, ACK_TIMEOUT_S), read_stats(str(store))
        r1.send(first[n:])
        time.sleep(0.05)  # some of them are received, likely not flushed yet
        r1.proc.send_signal(signal.SIGKILL)
        assert r1.proc.wait(10) == -signal.SIGKILL
        r1.close_socket()

        problems = []
        got = [f for _, f in read_store(str(store), problems)]
        kept = len(got)
        assert n <= kept <= n + m and got == first[:kept]   # all acknowledged, in order, nothing invented
        kinds = [p.kind for p in problems]
        assert "unclean-end" in kinds and set(kinds) <= {"unclean-end", "torn-tail"}, problems
        assert [p for p in problems if p.kind == "unclean-end"][0].segment == "segment-000001.ccld"

        # run 2 on the same store: continues in a new segment; stopped cleanly with SIGINT
        r2 = Run(store, port, tmp_path / "collector-2.log")
        runs.append(r2)
        r2.send(second)
        assert wait_for(lambda: acked(store) >= k, ACK_TIMEOUT_S), read_stats(str(store))
        r2.proc.send_signal(signal.SIGINT)
        assert r2.proc.wait(15) == 0, (tmp_path / "collector-2.log").read_text()
        r2.close_socket()
    finally:
        for r in runs:
            r.kill()

    problems = []
    got = [f for _, f in read_store(str(store), problems)]
    assert got == first[:kept] + second  # at most the unflushed tail of run 1 is missing
    assert sorted(x for x in os.listdir(store) if x.endswith(".ccld")) == ["segment-000001.ccld",
                                                                           "segment-000002.ccld"]
    assert [(p.kind, p.segment) for p in problems if p.kind != "torn-tail"] == [
        ("unclean-end", "segment-000001.ccld")]   # run 1's loss stays reported; run 2 closed cleanly
    assert all(p.segment == "segment-000001.ccld" for p in problems)
    meta = read_meta(str(store))
    assert "closed_at" in meta and len(meta["unclean_ends"]) == 1
    s = read_stats(str(store))
    assert s["store_records"] == s["store_durable_records"] == k and s["frames_ok"] == k
