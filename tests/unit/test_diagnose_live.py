"""The collector's diagnosis tick: hangs and slowdowns, stacks taken once per new finding (outside the
timeline lock), update lines, and one last tick at stop for a job that failed between two ticks."""
import json
import subprocess

import pytest

from ccld.collector.server import Collector
from ccld.diagnose.stack import StackTaker

from ccld_synth import T0, SynthJob

pytestmark = pytest.mark.unit


def lines_of(path):
    return [json.loads(x) for x in open(path).read().splitlines() if x.strip()]


def feed(col, job, t):
    for f in job.frames(t):
        col.handle_frame(f, t)


def test_a_collective_that_failed_just_before_stop_is_still_reported(tmp_path):
    fpath = tmp_path / "findings.jsonl"
    col = Collector(listen="tcp://127.0.0.1:*", findings_path=str(fpath), on_line=lambda s: None,
                    tick_s=3600, stacks=False)  # no periodic tick in this test: only the final one
    col.start()
    job = SynthJob()
    job.announce(T0)
    t = job.steps(1, 30, T0 + 1)
    for r in range(4):
        job.enter(r, 31, t)
    for r in (0, 1, 3):
        job.end(r, 31, t + 0.1, ok=False)
    job.exit(2, t + 0.2)
    feed(col, job, t + 0.3)
    # the job dies and `ccld run` stops the collector within a second: the final tick runs at the
    # wall clock, far past the synthetic times, so the failure is old enough to be judged
    col.stop()
    (f,) = lines_of(fpath)
    assert (f["kind"], f["class"], f["ranks"], f["seq"]) == ("hang", "fault", [2], 31)
    assert f["evidence"]["failed_ranks"] == [0, 1, 3]


def test_stacks_are_taken_once_per_new_finding_and_changes_are_update_lines(tmp_path):
    fpath, said = tmp_path / "findings.jsonl", []
    col = Collector(listen="tcp://127.0.0.1:*", findings_path=str(fpath), on_line=said.append, stacks=False,
                    tick_s=3600)  # ticks are driven by the test, at the synthetic job's times
    col.start()
    calls = []

    def fake_py_spy(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout=b'Thread 1 (idle): "MainThread"\n    sleep (job.py:9)\n')
    col.diagnoser.stacks = StackTaker(node="node1", exe="py-spy", run=fake_py_spy, check=lambda pid, rank: True)
    job = SynthJob()
    job.announce(T0)
    t = job.steps(1, 56, T0 + 1)
    for r in (0, 1, 3):
        job.enter(r, 57, t)
    job.state(2, t + 0.5, "S", "hrtimer_nanosleep", cpu_ns=10**9)
    feed(col, job, t + 1)
    for i in range(2, 16):  # rank 2 sleeps, then is blocked in I/O; /proc every second; a tick each
        job.state(2, t + i, "S" if i < 10 else "D", "hrtimer_nanosleep" if i < 10 else "folio_wait_bit",
                  cpu_ns=10**9)
        feed(col, job, t + i)
        col.tick(t + i + 0.5)
    got = lines_of(fpath)
    col.stop()
    assert [(x["kind"], x["class"]) for x in got] == [("hang", "not-entered"), ("updated", "not-entered")]
    f, u = got
    assert f["ranks"] == [2] and f["stack"].startswith("rank 2 (pid 1002 on node1):") and len(calls) == 1
    assert calls[0][:3] == ["py-spy", "dump", "--pid"]
    assert u["id"] == f["id"] and "io" in u["summary"] and u["evidence"]["stack"]["ranks"]["2"]["ok"]
    assert any(s.startswith("HANG not-entered [2] gloo:0 seq 57 allreduce") for s in said)
    assert any(s.startswith("UPDATED not-entered [2] gloo:0 seq 57: not-entered: rank 2 io") for s in said)
    assert col.stats["updates"] == 1
