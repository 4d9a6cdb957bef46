"""`ccld top` in a real terminal: tmux runs it against a live collector (synthetic frames over
ZeroMQ, /snapshot over HTTP), the test reads the screen with capture-pane, changes the job, and
sees the same screen redrawn in place; `q` quits. Needs tmux (scripts/setup.sh installs it)."""
import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest

from ccld.collector.metrics import MetricsServer
from ccld.collector.server import Collector
from ccld.top import render
from ccld_synth import SynthJob, SynthLinks
from conftest import ROOT
from test_collector_live import push, wait_for  # noqa: F401 (push is a fixture)

pytestmark = pytest.mark.unit
COLS, ROWS = 100, 40


class Tmux:
    """A private tmux server (its own socket), killed at the end whatever happens."""

    def __init__(self):
        self.sock = f"ccld-test-{uuid.uuid4().hex[:8]}"

    def __call__(self, *args, check=True):
        return subprocess.run(["tmux", "-L", self.sock] + list(args), capture_output=True, text=True,
                              timeout=10, check=check)

    def screen(self):
        return self("capture-pane", "-p", "-t", "top").stdout

    def wait_screen(self, cond, timeout_s=20.0):
        deadline = time.monotonic() + timeout_s
        text = ""
        while time.monotonic() < deadline:
            text = self.screen()
            if cond(text):
                return text
            time.sleep(0.1)
        raise AssertionError(f"screen never matched; last screen:\n{text}")

    def kill(self):
        self("kill-server", check=False)


@pytest.fixture
def tmux():
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (scripts/setup.sh installs it: apt-get install tmux)")
    t = Tmux()
    yield t
    t.kill()


def test_top_shows_ranks_links_and_findings_and_redraws_in_place(tmux, push):  # noqa: F811
    col = Collector(listen="tcp://127.0.0.1:*", on_line=lambda line: None, floor_s=1.0, stacks=False)
    col.start()
    srv = MetricsServer(col, "127.0.0.1:0").start()
    try:
        sock = push(col.endpoint)
        now = time.time()
        job = SynthJob(t0=now - 60)
        job.announce(now - 30)
        job.steps(1, 10, now - 20, late={3: 0.05})
        SynthLinks(job).ring(now - 3, nbytes=1 << 20, retrans={(1, 2): 40})
        for r in (0, 1, 3):
            job.enter(r, 11, now - 2)
        for f in job.frames(now - 0.1):
            sock.send(f)
        assert wait_for(lambda: col.tracker.active)

        env = dict(os.environ, TERM="xterm-256color", PYTHONPATH=ROOT)
        cmd = f"{sys.executable} -m ccld.cli top 127.0.0.1:{srv.port} --interval 0.3"
        tmux("new-session", "-d", "-s", "top", "-x", str(COLS), "-y", str(ROWS), "-e", f"TERM={env['TERM']}", cmd)
        screen = tmux.wait_screen(lambda s: "HANG not-entered" in s)
        lines = screen.splitlines()
        assert lines[0].startswith(f"ccld top  127.0.0.1:{srv.port}  2 agents  2 frames")
        assert "job job  world 4  gloo:0 seq 11 allreduce: waiting for [2] for" in screen
        head = next(i for i, ln in enumerate(lines) if ln.split()[:3] == ["rank", "node", "pid"])
        end = next(i for i, ln in enumerate(lines) if ln.strip().startswith("links out of line"))
        rows = lines[head + 1:end]
        assert [ln.split()[0] for ln in rows] == ["!", "0", "1", "3"]          # the culprit first, marked
        assert rows[0].split()[1:5] == ["2", "node1", "1002", "-"]
        assert "gloo:0 seq 10 allreduce" in rows[0] and "gloo:0 seq 11 allreduce" in rows[1]
        assert "52.0 ms" in rows[3]                       # rank 3: 50 ms late, plus the 2 ms spread
        assert "links out of line (last 10 s): 1 of 8 rank pairs" in screen
        assert "1 -> 2" in screen and "40 retransmissions" in screen
        assert "findings (1 open)" in screen and "HANG not-entered ranks [2] gloo:0 seq 11 allreduce" in screen
        assert all(len(ln) <= COLS for ln in lines)

        # rank 2 arrives: the same screen (no scrolling, no new process) now shows seq 11 done, no finding
        t = time.time()
        job.enter(2, 11, t)
        for r in range(4):
            job.start(r, 11, t)
            job.end(r, 11, t + 0.001)
        for f in job.frames(t + 0.01):
            sock.send(f)
        screen = tmux.wait_screen(lambda s: "findings (0 open)" in s, timeout_s=30)
        assert "waiting for" not in screen and "HANG" not in screen
        assert tmux("display-message", "-p", "-t", "top", "#{history_size}").stdout.strip() == "0"  # in place
        tmux("send-keys", "-t", "top", "q")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and tmux("has-session", "-t", "top", check=False).returncode == 0:
            time.sleep(0.1)
        assert tmux("has-session", "-t", "top", check=False).returncode != 0, "ccld top did not quit on q"
    finally:
        srv.stop()
        col.stop()


def test_render_fits_small_terminals_and_says_what_is_cut():
    snap = {"at": 100.0, "collector": {"frames_ok": 5}, "agents": {"a": {"node": "n", "silent_s": 9.0}},
            "jobs": [{"job": "j", "world_size": 64, "main_comm": "j/gloo:0", "comms": [],
                      "ranks": [{"rank": r, "node": "n", "pid": r, "state": "S", "exited": False, "cpu_busy": None,
                                 "lag_s": 0.001, "blamed": False, "comm": "j/gloo:0", "seq": 3, "op": "allreduce",
                                 "inside": False, "for_s": None} for r in range(64)],
                      "ranks_omitted": 0, "links": [], "links_omitted": 0}],
            "findings": []}
    lines = render(snap, width=60, height=20, source="h:1")
    assert len(lines) == 20 and all(len(t) <= 60 for t, _ in lines)
    text = [t for t, _ in lines]
    assert text[1] == "! silent agents: a"
    assert any(t.startswith("... ") and "more lines" in t for t in text)
    assert text[-1] == "q quits; up/down scroll the ranks" and text[-3] == "findings (0 open)"


def test_an_unreachable_collector_is_one_clear_error_line(capsys):
    from ccld import cli
    from conftest import free_port
    port = free_port()
    assert cli.main(["top", "--once", f"127.0.0.1:{port}"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"ccld: cannot reach the collector at http://127.0.0.1:{port}") and err.count("\n") == 1
    assert f"start it with --metrics 127.0.0.1:{port}" in err
