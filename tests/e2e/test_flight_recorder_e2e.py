"""End to end: real Flight Recorder dumps from a real 4-rank gloo job under torchrun, read by
`ccld diagnose --flight-recorder` (the CLI, as a user runs it), pickle and JSON alike.

The job (tests/workloads/fr_dump_job.py) runs 20 collectives, then a fault at seq 21; when every
rank has reached it, the test asks each rank for its dump (torch's own _dump_fr_trace and
_dump_fr_trace_json, in a thread of the job) and ends the job. Budget: ~30 s per job on 2 vCPUs
(the first dump alone takes ~4 s in torch 2.13).
"""
import json
import os
import subprocess
import sys
import time

import pytest

from conftest import ROOT, free_port, torch_skip_reason
from test_run_e2e import Procs, wait_for

pytestmark = pytest.mark.e2e

JOB = os.path.join(ROOT, "tests", "workloads", "fr_dump_job.py")
CCLD = [sys.executable, "-m", "ccld.cli"]
HANG_AFTER_S = 5.0   # ccld's default floor: the dumps are taken after the others waited longer
START_TIMEOUT_S = 120.0


@pytest.fixture
def procs(tmp_path):
    reason = torch_skip_reason()
    if reason:
        pytest.skip(reason)
    p = Procs(tmp_path)
    p.env["TORCH_FR_BUFFER_SIZE"] = "2000"   # the default in 2.13 too; set as a user would
    yield p
    p.cleanup()


def dumps_of(procs, fault_args):
    """Run the job with a fault at seq 21, dump every rank's Flight Recorder once all four reached
    it and the others have waited HANG_AFTER_S, end the job; the dump directory."""
    out = procs.tmp / "fr"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), JOB, "--dir", str(out)] + fault_args
    p, log = procs.start("job", cmd)
    for r in range(4):
        wait_for(log, rf"^rank {r} at seq 21$", START_TIMEOUT_S, p)
    time.sleep(HANG_AFTER_S + 1)
    out.mkdir(exist_ok=True)
    (out / "dump-now").touch()
    for r in range(4):
        wait_for(log, rf"^rank {r} dumped$", 60, p)
    procs.cleanup()
    return out


def diagnose(directory, *extra):
    r = subprocess.run(CCLD + ["diagnose", "--flight-recorder", str(directory)] + list(extra),
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_a_hung_rank_is_named_from_real_gloo_dumps(procs):
    out = dumps_of(procs, ["--hang-rank", "3"])
    for fmt in ("pickle", "json"):
        found = [json.loads(line) for line in diagnose(out / fmt, "--json").splitlines()]
        assert [(f["kind"], f["class"], f["ranks"], f["comm"], f["seq"], f["op"]) for f in found] == \
            [("hang", "not-entered", [3], "gloo:0", 21, "allreduce")], fmt
        ev = found[0]["evidence"]
        assert ev["waiting"] == [0, 1, 2] and ev["source"] == "flight-recorder" and ev["waited_s"] >= HANG_AFTER_S
        assert ev["fr_ranks"][0]["last_seq"] == 20 and ev["fr_ranks"][0]["last_op"] == "barrier"
        text = diagnose(out / fmt)
        assert "flight recorder: 4 dumps (%s, version 2.10, gloo)" % fmt in text
        assert "pg 0 (default_pg): members 0-3, seqs 1..21" in text and "pg 1: members 0,1, seqs 1..1" in text
        assert "HANG not-entered ranks [3] gloo:0 seq 21 allreduce: waiting" in text
    # only the pickle has Python frames: the waiters' line and the culprit's last call site
    assert "wait in seq 21 allreduce at fr_dump_job.py:" in diagnose(out / "pickle")
    assert "rank 3 last entered seq 20 barrier at fr_dump_job.py:" in diagnose(out / "pickle")


def test_a_rank_calling_the_wrong_collective_is_named_from_real_gloo_dumps(procs):
    out = dumps_of(procs, ["--wrong-op-rank", "2"])
    found = [json.loads(line) for line in diagnose(out / "pickle", "--json").splitlines()]
    assert [(f["class"], f["ranks"], f["comm"], f["seq"], f["op"]) for f in found] == \
        [("inconsistent", [2], "gloo:0", 21, "allreduce")]
    assert found[0]["evidence"]["per_rank"]["2"]["op"] == "allgather"
    assert "fr_dump_job.py" in found[0]["stack"] and "all_gather" in found[0]["stack"]
    text = diagnose(out / "json")
    assert "HANG inconsistent [2] gloo:0 seq 21: different ops: rank 2 allgather where 3 ranks call allreduce" in text
