"""bench/burst.py's arithmetic without root or torch: a rank's count line, the node's offered rate,
and the verdict of whether every call reached the collector."""
import os
import sys

import pytest

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import burst  # noqa: E402

LOG = """[W init] gloo: some warning
burst rank 1: 23 calls in 0.001150 s from 1796200000.500000
burst rank 0: 23 calls in 0.001000 s from 1796200000.400000
"""


def test_rank_lines_read_count_span_and_rate():
    got = burst.rank_lines(LOG)
    assert sorted(got) == [0, 1]
    assert got[0]["calls"] == 23 and got[0]["span_s"] == pytest.approx(0.001)
    assert got[0]["rate"] == pytest.approx(23_000)
    assert got[1]["rate"] == pytest.approx(20_000)
    assert burst.rank_lines("no count here\n") == {}


def test_offered_sums_ranks_side_by_side():
    jobs = [burst.rank_lines(LOG), {0: {"calls": 7, "rate": 1000.0}}]
    rate, calls = burst.offered(jobs)
    assert rate == pytest.approx(44_000) and calls == 53


def test_verdict_every_call_arrived_only_when_all_counts_match():
    jobs = [burst.rank_lines(LOG), {0: {"calls": 7, "rate": 1.0}}]
    ok = burst.verdict(jobs, [23, 7], enters=53, ends=53)
    assert ok["all_arrived"] and [j["missing"] for j in ok["jobs"]] == [0, 0] and ok["calls"] == 53
    short = burst.verdict(jobs, [23, 6], enters=52, ends=52)
    assert not short["all_arrived"] and short["jobs"][1]["missing"] == 1
    # every collective complete, but an enter counted twice elsewhere is not "every call, once"
    assert not burst.verdict(jobs, [23, 7], enters=54, ends=53)["all_arrived"]


def test_verdict_ranks_disagreeing_on_their_count_is_no_verdict():
    jobs = [{0: {"calls": 5, "rate": 1.0}, 1: {"calls": 4, "rate": 1.0}}]
    v = burst.verdict(jobs, [4], enters=9, ends=9)
    assert v["jobs"][0]["missing"] is None and not v["all_arrived"]


def test_job_line_bare_rank_or_torchrun():
    one = burst.job_line(1, 1234, ["--seconds", "1"])
    assert "MASTER_PORT=1234" in one and "WORLD_SIZE=1" in one and one[-3:] == ["--rank", "--seconds", "1"]
    two = burst.job_line(2, 1234, [])
    assert "torch.distributed.run" in two and two[two.index("--nproc-per-node") + 1] == "2"
