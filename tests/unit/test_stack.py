"""Python stacks for findings: py-spy is run once per finding, bounded, and every reason it cannot
be (not installed, no ptrace, timed out, another node, the process gone) is said in the evidence."""
import socket
import subprocess
import sys
import time

import pytest

from ccld.diagnose import stack
from ccld.diagnose.findings import Finding

pytestmark = pytest.mark.unit

DUMP = """Process 4242: python train.py --secret-token abc
Python v3.11.7 (/usr/bin/python3.11)

Thread 4242 (idle): "MainThread"
    all_reduce (torch/distributed/distributed_c10d.py:3252)
    step (train.py:40)
    <module> (train.py:77)
"""


def finding(ranks=((2, 4242, "n1", "S"),)):
    details = [{"rank": r, "pid": pid, "node": node, "state": st, "seen": True} for r, pid, node, st in ranks]
    return Finding(kind="hang", cls="not-entered", ranks=[d["rank"] for d in details], comm="j/gloo:0", seq=7,
                   op="allreduce", onset_at=1.0, detected_at=7.0, evidence={"ranks": details})


class FakeRun:
    def __init__(self, out=DUMP, rc=0, raises=None):
        self.out, self.rc, self.raises, self.calls = out, rc, raises, []

    def __call__(self, cmd, **kw):
        self.calls.append((cmd, kw))
        if self.raises is not None:
            raise self.raises
        return subprocess.CompletedProcess(cmd, self.rc, stdout=self.out.encode())


def taker(run, node="n1", exe="/opt/py-spy", **kw):
    return stack.StackTaker(node=node, exe=exe, run=run, check=lambda pid, rank: True, **kw)


def test_the_stack_lands_in_the_finding_without_the_command_line():
    run = FakeRun()
    f = finding()
    taker(run).add_stacks([f])
    assert f.stack.startswith("rank 2 (pid 4242 on n1):\nThread 4242 (idle)")
    assert "all_reduce (torch/distributed/distributed_c10d.py:3252)" in f.stack
    assert "secret-token" not in f.stack  # the dump's header (cmdline) is dropped
    assert f.evidence["stack"]["ranks"]["2"]["ok"] is True and "skipped" not in f.evidence["stack"]
    (cmd, kw), = run.calls
    assert cmd == ["/opt/py-spy", "dump", "--pid", "4242"] and kw["timeout"] == stack.TIMEOUT_S


def test_a_stopped_rank_is_read_without_pausing_it_and_only_max_ranks_are_dumped():
    run = FakeRun()
    f = finding(ranks=[(1, 11, "n1", "T"), (2, 12, "n1", "S"), (3, 13, "n1", "S")])
    taker(run, max_ranks=2).add_stacks([f])
    assert [c[0] for c in run.calls] == [["/opt/py-spy", "dump", "--pid", "11", "--nonblocking"],
                                         ["/opt/py-spy", "dump", "--pid", "12"]]
    assert f.stack.count("Thread 4242") == 2 and set(f.evidence["stack"]["ranks"]) == {"1", "2"}


def test_py_spy_missing_is_skipped_with_the_fix():
    f = finding()
    t = taker(FakeRun())
    t.exe = None
    t.add_stacks([f])
    assert f.stack is None and "pip install py-spy" in f.evidence["stack"]["skipped"]


def test_timeout_no_ptrace_and_a_vanished_process_are_reasons_not_errors():
    f = finding()
    taker(FakeRun(raises=subprocess.TimeoutExpired(["py-spy"], 3.0))).add_stacks([f])
    assert f.stack is None and f.evidence["stack"]["skipped"] == "py-spy timed out after 3 s"
    f = finding()
    taker(FakeRun(out="Error: Failed to get process executable name.\nCaused by:\n  0: Permission denied (os error 13)",
                  rc=1)).add_stacks([f])
    assert f.stack is None and "ptrace" in f.evidence["stack"]["skipped"]
    f = finding()
    taker(FakeRun(out="Error: Failed to get process executable name. Check that the process is running.\n"
                      "  0: No such file or directory (os error 2)", rc=1)).add_stacks([f])
    assert f.evidence["stack"]["skipped"] == "the process is gone"
    f = finding()
    taker(FakeRun(raises=FileNotFoundError(2, "No such file or directory"))).add_stacks([f])
    assert "cannot run /opt/py-spy" in f.evidence["stack"]["skipped"]


def test_ranks_elsewhere_exited_or_reused_pids_are_not_touched():
    run = FakeRun()
    f = finding(ranks=[(1, 11, "other-node", "S")])
    taker(run).add_stacks([f])
    assert run.calls == [] and "runs on other-node" in f.evidence["stack"]["skipped"]
    f = finding()
    f.evidence["ranks"][0]["exited_at"] = 5.0
    taker(run).add_stacks([f])
    assert run.calls == [] and f.evidence["stack"]["skipped"] == "the process has exited"
    f = finding()
    stack.StackTaker(node="n1", exe="/opt/py-spy", run=run, check=lambda pid, rank: False).add_stacks([f])
    assert run.calls == [] and "no longer rank 2" in f.evidence["stack"]["skipped"]


def test_output_is_bounded_and_the_time_budget_is_shared():
    long_dump = "Thread 1 (idle): \"MainThread\"\n" + "".join(f"    f{i} (x.py:{i})\n" for i in range(2000))
    f = finding()
    taker(FakeRun(out=long_dump), max_bytes=1000).add_stacks([f])
    assert len(f.stack.encode()) < 1100 and "more lines cut" in f.stack

    class Slow(FakeRun):
        def __call__(self, cmd, **kw):
            time.sleep(0.2)
            return super().__call__(cmd, **kw)
    run = Slow()
    fs = [finding(), finding(), finding()]
    taker(run, budget_s=0.3).add_stacks(fs)
    assert len(run.calls) == 2  # the third finding found the budget spent
    assert fs[2].stack is None and "spent" in fs[2].evidence["stack"]["skipped"]


def test_findings_without_rank_processes_are_left_alone():
    f = Finding(kind="slow", cls="comm-slow", ranks=[0, 1], comm="j/gloo:0", seq=-1, op="allreduce",
                onset_at=0, detected_at=1, evidence={"pairs": []})
    run = FakeRun()
    taker(run).add_stacks([f])
    assert run.calls == [] and f.evidence["stack"]["skipped"] == "the finding names no rank process"


def test_a_real_dump_of_a_sleeping_python_process():
    exe = stack.find_py_spy()
    if exe is None:
        pytest.skip("py-spy is not installed (pip install py-spy)")
    code = "import time\ndef wait_here():\n    time.sleep(60)\nwait_here()\n"
    p = subprocess.Popen([sys.executable, "-c", code])
    try:
        time.sleep(0.5)
        f = finding(ranks=[(0, p.pid, socket.gethostname(), "S")])
        stack.StackTaker(exe=exe, check=lambda pid, rank: pid == p.pid).add_stacks([f])
        if f.stack is None and "ptrace" in f.evidence["stack"].get("skipped", ""):
            pytest.skip(f"this machine forbids ptrace: {f.evidence['stack']['skipped']}")
        assert f.stack is not None, f.evidence["stack"]
        assert "wait_here (<string>:3)" in f.stack and f.evidence["stack"]["ranks"]["0"]["took_s"] < stack.TIMEOUT_S
        assert p.poll() is None  # the process was only looked at
    finally:
        p.kill()
        p.wait()
