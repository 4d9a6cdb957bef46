"""The README's first quick-start command, `make demo` (`ccld demo --fault hang`): a real 4-rank job
under ccld, one rank hung, named; and nothing said while the demo tears the job down (the agent
detaching its probes for seconds once made the collector print "records behind its heartbeats" and a
RECOVERED for the hang that still held, in every run)."""
import subprocess
import sys

import pytest

from conftest import bpf_skip_reason, torch_skip_reason

pytestmark = pytest.mark.e2e


def test_the_demo_names_the_hung_rank_and_says_nothing_false_while_it_stops_the_job():
    reason = bpf_skip_reason() or torch_skip_reason()
    if reason:
        pytest.skip(reason)
    r = subprocess.run([sys.executable, "-m", "ccld.cli", "demo", "--fault", "hang"], capture_output=True,
                       text=True, timeout=240)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "HANG not-entered" in out and ": correct" in out, out[-3000:]
    assert "RECOVERED" not in out and "behind its heartbeats" not in out, out[-3000:]
