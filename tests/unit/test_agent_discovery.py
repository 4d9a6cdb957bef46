"""The agent finds ranks from /proc alone: ranks that start later, ranks that exit, and forked
children of a rank (DataLoader workers) that are not ranks. Real processes, real ZeroMQ; no eBPF."""
import os
import subprocess
import sys
import time

import pytest
import zmq

from ccld import wire as ev
from ccld.tracer import discover
from ccld.tracer.agent import Agent

pytestmark = pytest.mark.unit

# A stand-in rank: sleeps; with FORK=1 it forks a child that inherits its environment (as a
# DataLoader worker does) before sleeping.
RANK_SRC = "import os, time\nif os.environ.get('FORK') == '1' and os.fork() == 0:\n    time.sleep(60)\ntime.sleep(60)\n"


class Sink:
    def __init__(self):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.events = []

    def drain(self, seconds):
        end = time.time() + seconds
        while time.time() < end:
            if self.sock.poll(50):
                self.events += ev.decode_batch(self.sock.recv()).events

    def wait(self, pred, timeout=10):
        end = time.time() + timeout
        while time.time() < end:
            self.drain(0.1)
            if pred(self.events):
                return True
        return False

    def close(self):
        self.sock.close()
        self.ctx.term()


def spawn_rank(rank, world=2, fork=False):
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
               MASTER_ADDR="127.0.0.1", MASTER_PORT="29999", FORK="1" if fork else "0")
    return subprocess.Popen([sys.executable, "-c", RANK_SRC], env=env)


def of(events, kind):
    return [e for e in events if e.KIND == kind]


def test_ranks_appear_exit_and_come_back_and_forks_are_not_ranks():
    sink = Sink()
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    procs = [launcher]
    agent = Agent(sink.endpoint, pids=[os.getpid()], use_bpf=False, say=lambda s: None)
    try:
        agent.start()
        r0, r1 = spawn_rank(0, fork=True), spawn_rank(1)
        procs += [r0, r1]
        assert sink.wait(lambda es: {e.rank for e in of(es, "rank")} >= {0, 1})
        infos = of(sink.events, "rank")
        assert {e.pid for e in infos} == {r0.pid, r1.pid}  # r0's forked child is not a rank
        assert all(e.job == "127.0.0.1:29999" and e.world_size == 2 for e in infos)
        assert sink.wait(lambda es: {e.rank for e in of(es, "proc")} >= {0, 1})  # liveness from /proc
        r1.kill()
        r1.wait()
        assert sink.wait(lambda es: [e.pid for e in of(es, "rank_exit")] == [r1.pid])
        r1b = spawn_rank(1)  # an elastic restart of rank 1
        procs.append(r1b)
        assert sink.wait(lambda es: r1b.pid in {e.pid for e in of(es, "rank")})
        assert set(agent.ranks) == {r0.pid, r1b.pid}
    finally:
        agent.stop()
        for p in procs:
            p.kill()
        for pid in discover.descendants(os.getpid()):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        sink.close()


def launched_by(env, src, *args):
    """(a stand-in for `ccld run` with environment `env`, the command it started: python -c src)."""
    outer = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; "
                              "subprocess.Popen([sys.executable, '-c'] + sys.argv[1:]).wait()", src] + list(args),
                             env=env)
    for _ in range(100):
        with open(f"/proc/{outer.pid}/task/{outer.pid}/children") as f:
            kids = f.read().split()
        if kids:
            return outer, int(kids[0])
        time.sleep(0.05)
    outer.kill()
    raise AssertionError("the ccld run stand-in started no command")


# The command sets RANK itself (as `env RANK=0 ... python` or a wrapper script does) before it sleeps.
SETS_RANK = ("import os, sys, time\n"
             "if len(sys.argv) > 1:\n"
             "    env = dict(os.environ, RANK='0', WORLD_SIZE='1', LOCAL_RANK='0', MASTER_ADDR='127.0.0.1',\n"
             "               MASTER_PORT='29998')\n"
             "    os.execve(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)'], env)\n"
             "time.sleep(60)\n")


@pytest.mark.parametrize("who", ["its command", "ccld's environment"])
def test_the_command_ccld_run_started_is_a_rank_when_it_and_not_ccld_holds_the_rank(who):
    # `ccld run -- env RANK=0 ... python train.py`: the command itself is the rank (it was never looked
    # at: only its descendants were). When ccld's own environment holds the same RANK (a pod's
    # `ccld run -- torchrun`, torchrun getting the pod's node rank), the command is a launcher, no rank.
    sink = Sink()
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    if who == "its command":
        outer, root = launched_by(base, SETS_RANK, "exec")
    else:
        outer, root = launched_by(dict(base, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT="29998"), SETS_RANK)
    agent = None
    try:
        agent = Agent(sink.endpoint, root_pid=root, use_bpf=False, say=lambda s: None)
        agent.start()
        if who == "its command":
            assert sink.wait(lambda es: of(es, "rank"))
            assert [e.pid for e in of(sink.events, "rank")] == [root]
        else:
            sink.drain(2.0)  # the agent scans every 0.2 s while ranks come and go
            assert of(sink.events, "rank") == []
    finally:
        if agent is not None:
            agent.stop()
        outer.kill()
        try:
            os.kill(root, 9)
        except ProcessLookupError:
            pass
        sink.close()


def test_identify_skips_processes_without_a_rank():
    assert discover.identify(os.getpid()) is None or "RANK" in os.environ
    assert discover.identify(999999999) is None


def test_is_rank_checks_the_environment():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                         env=dict(env, RANK="3", WORLD_SIZE="4", MASTER_ADDR="127.0.0.1", MASTER_PORT="1"))
    try:
        time.sleep(0.2)
        assert discover.is_rank(p.pid, 3) is True
        assert discover.is_rank(p.pid, 2) is False      # the pid now belongs to another rank
    finally:
        p.kill()
        p.wait()
    assert discover.is_rank(p.pid, 3) is False          # gone


def test_only_the_variables_ccld_needs_are_read_and_secrets_are_masked():
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29998",
               HF_TOKEN="hf_secret_value", AWS_SECRET_ACCESS_KEY="aws_secret_value")
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "--api-key=sk-123", "--lr", "3"],
                         env=env)
    try:
        deadline = time.time() + 5
        while time.time() < deadline and not discover.read_environ(p.pid):
            time.sleep(0.05)
        got = discover.read_environ(p.pid)
        assert set(got) <= discover.NEEDED_ENV and got["RANK"] == "0"
        ident = discover.identify(p.pid)
        assert "sk-123" not in ident.cmdline and "--api-key=***" in ident.cmdline and "--lr 3" in ident.cmdline
    finally:
        p.kill()
        p.wait()
