"""inconsistent: ranks at one (comm, seq) that called different collectives (or sizes) are named by
majority vote, before the hang they cause; a skipped collective is recognised as such."""
import pytest

from ccld import wire as ev
from ccld.timeline.timeline import Timeline
from ccld.diagnose import Diagnoser
from ccld.diagnose.findings import format_line
from ccld.diagnose.inconsistent import InconsistencyChecker

from ccld_synth import T0, SynthJob

pytestmark = pytest.mark.unit
STEP = ("allreduce", "broadcast", "barrier")


def job_with_steps(steps=20, world=4):
    job, tl = SynthJob(world=world), Timeline()
    job.announce(T0)
    t, seq = T0 + 1, 1
    for _ in range(steps):
        for op in STEP:
            t = job.collective(seq, t, op=op) + 0.001
            seq += 1
    job.feed(tl, t)
    return job, tl, t, seq


def test_healthy_jobs_are_consistent():
    job, tl, t, seq = job_with_steps(40)
    d = Diagnoser(tl)
    for now in (t, t + 2, t + 60):
        assert d.find_inconsistent(now) == [] and d.find_hangs(now) == []


def test_a_rank_calling_another_collective_is_named_before_the_hang():
    job, tl, t, seq = job_with_steps(20)   # seq is an allreduce step start
    for r in (0, 2, 3):
        job.enter(r, seq, t + 0.01, op="allreduce")
    job.enter(1, seq, t + 0.02, op="allgather")
    job.feed(tl, t + 0.1)
    d = Diagnoser(tl)
    (f,) = d.find_hangs(t + 0.2)          # all four entered: no need to wait for a timeout
    assert (f.kind, f.cls, f.ranks, f.seq, f.op) == ("hang", "inconsistent", [1], seq, "allreduce")
    e = f.evidence
    assert e["reason"] == "different-op" and e["majority"] == "allreduce" and e["tie"] is False
    assert e["calls"] == {"allgather": [1], "allreduce": [0, 2, 3]} and e["ranks"][0]["called"] == "allgather"
    assert f.onset_at == pytest.approx(t + 0.02, abs=1e-5)
    assert format_line(f) == f"HANG inconsistent [1] gloo:0 seq {seq}: rank 1 allgather where the others called allreduce"
    # later, the same collective is also stuck: still one finding, the inconsistent one explains the hang
    for i in range(1, 8):
        job.feed(tl, t + i)
    assert [g.cls for g in d.find_hangs(t + 7.5)] == ["inconsistent"]


def test_a_vote_waits_for_late_ranks_and_a_tie_blames_no_single_rank():
    job, tl, t, seq = job_with_steps(20)
    job.enter(0, seq, t, op="allreduce")
    job.enter(1, seq, t, op="allgather")
    job.feed(tl, t + 0.1)
    chk = InconsistencyChecker()
    assert chk.find(tl, t + 0.5) == []    # 1 vs 1 with two ranks still to come: no verdict yet
    (f,) = chk.find(tl, t + 1.5)          # they never come: a tie, everyone who called is listed
    assert f.ranks == [0, 1] and f.evidence["tie"] is True and f.evidence["missing"] == [2, 3]
    assert "no majority" in f.evidence["summary"]


def test_a_skipped_collective_is_recognised_from_the_step_pattern():
    job, tl, t, seq = job_with_steps(20)
    # rank 2 skips the broadcast of this step: its seq `seq+1` is the barrier, its `seq+2` the next
    # step's allreduce, while the others are in broadcast at seq+1.
    job.collective(seq, t, op="allreduce")
    for r in (0, 1, 3):
        job.enter(r, seq + 1, t + 0.01, op="broadcast")
    job.enter(2, seq + 1, t + 0.01, op="barrier")
    job.feed(tl, t + 0.1)
    (f,) = Diagnoser(tl).find_hangs(t + 0.2)
    assert (f.cls, f.ranks, f.seq) == ("inconsistent", [2], seq + 1)
    assert f.evidence["diverged"] == {"2": {"shift": 1, "period": 3, "compared": 1}}


def test_different_sizes_where_the_probes_report_them():
    job, tl, t, seq = job_with_steps(5)
    for r in range(4):
        job._put(r, ev.CollEnter(pid=job.pid[r], rank=r, ts_ns=job.ts(r, t), backend="nccl", comm=job.comm,
                                 seq=seq, op="allreduce", count=8192 if r == 3 else 4096, dtype="float32"))
    job.feed(tl, t + 0.1)
    (f,) = Diagnoser(tl).find_hangs(t + 0.2)
    assert (f.cls, f.ranks) == ("inconsistent", [3])
    assert f.evidence["reason"] == "different-size" and f.evidence["ranks"][0]["size"] == {"count": 8192,
                                                                                         "dtype": "float32"}
    assert f.evidence["sizes_known"] is True
    assert f.evidence["calls"] == {"4096 float32": [0, 1, 2], "8192 float32": [3]}
    assert f.evidence["summary"] == "rank 3 allreduce of 8192 float32 where the others passed 4096 float32"
    assert format_line(f).startswith(f"HANG inconsistent [3] gloo:0 seq {seq}: rank 3 allreduce of 8192 float32")


def test_a_size_known_for_too_few_ranks_names_nobody():
    """Two of four ranks with a size, and they differ: either could be the odd one (the others'
    sizes are unknown, e.g. an enter sent before its size came): no finding."""
    job, tl, t, seq = job_with_steps(5)
    for r in range(4):
        job._put(r, ev.CollEnter(pid=job.pid[r], rank=r, ts_ns=job.ts(r, t), backend="nccl", comm=job.comm,
                                 seq=seq, op="allreduce", count={0: 4096, 1: 8192}.get(r, -1),
                                 dtype="float32" if r < 2 else ""))
    job.feed(tl, t + 0.1)
    assert Diagnoser(tl).find_inconsistent(t + 2) == []


def test_an_inconsistency_that_completed_is_forgotten_once_the_job_moves_on():
    job, tl, t, seq = job_with_steps(5)
    for r in range(4):
        job.enter(r, seq, t, op="allreduce" if r else "reduce")
        job.end(r, seq, t + 0.01)
    job.feed(tl, t + 0.1)
    d = Diagnoser(tl)
    assert [f.ranks for f in d.find_inconsistent(t + 0.2)] == [[0]]
    t2 = t + 0.1
    for i in range(1, 12):
        t2 = job.collective(seq + i, t2 + 0.01, op=STEP[i % 3])
    job.feed(tl, t2 + 0.01)
    assert d.find_inconsistent(t2 + 0.1) == []


def test_gloo_tensor_bytes_name_the_odd_rank():
    """gloo's probes give the tensor's bytes (nbytes), not count and dtype (needs the timeline to
    keep nbytes in CollView.sizes)."""
    job, tl, t, seq = job_with_steps(5)
    for r in range(4):
        job._put(r, ev.CollEnter(pid=job.pid[r], rank=r, ts_ns=job.ts(r, t), backend="gloo", comm=job.comm,
                                 seq=seq, op="allreduce", nbytes=32768 if r == 1 else 16384))
    job.feed(tl, t + 0.1)
    (f,) = Diagnoser(tl).find_hangs(t + 0.2)
    assert (f.cls, f.ranks, f.op) == ("inconsistent", [1], "allreduce")
    assert f.evidence["calls"] == {"16384 B": [0, 2, 3], "32768 B": [1]}
    assert f.evidence["ranks"][0]["size"] == {"nbytes": 32768}
    assert f.evidence["summary"] == "rank 1 allreduce of 32768 B where the others passed 16384 B"
