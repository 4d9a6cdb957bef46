"""Hang detection on synthetic 4-rank runs: exactly the right finding, or none."""
import json

import pytest

from ccld import events as ev

from ccld.collector.timeline import Timeline
from ccld.diagnose import Diagnoser
from ccld.diagnose.findings import Finding, format_line

from ccld_synth import T0, SynthJob

pytestmark = pytest.mark.unit


def run_to(n_healthy=56, **kw):
    """Ranks announce, run collectives 1..n_healthy; returns (job, timeline, time after the last)."""
    job, tl = SynthJob(), Timeline()
    job.announce(T0)
    end = job.steps(1, n_healthy, T0 + 1, period=0.1, **kw)
    job.feed(tl, end + 0.01)
    return job, tl, end + 0.1


def hangs(tl, now, **kw):
    return Diagnoser(tl, **kw).find_hangs(now)


def test_healthy_run_has_no_findings():
    job, tl, t = run_to(23)
    for now in (t, t + 1, t + 6, t + 60, t + 3600):
        assert hangs(tl, now) == []


def test_everyone_pausing_between_collectives_is_not_a_hang():
    job, tl, t = run_to(56)
    for r in range(4):
        job.state(r, t + 10, "S", "hrtimer_nanosleep")
    job.feed(tl, t + 10)
    assert hangs(tl, t + 20) == []  # a 20 s checkpoint pause: nobody entered 57
    end = job.collective(57, t + 20)
    job.feed(tl, end + 0.01)
    assert hangs(tl, end + 20) == []


def rank2_missing_57(state="S", wchan="hrtimer_nanosleep"):
    job, tl, t = run_to(56)
    for r in (0, 1, 3):
        job.enter(r, 57, t + 0.001 * r)
    job.state(2, t + 1, state, wchan, cpu_ns=10**9)
    job.state(2, t + 3, state, wchan, cpu_ns=10**9)
    job.feed(tl, t + 3)
    return job, tl, t


def test_rank_that_never_enters_is_named():
    job, tl, t = rank2_missing_57()
    assert hangs(tl, t + 4.0) == []  # under the 5 s floor: the others may just be early
    found = hangs(tl, t + 6.2)
    assert len(found) == 1
    f = found[0]
    assert (f.kind, f.cls, f.ranks, f.seq, f.op, f.comm, f.job) == ("hang", "not-entered", [2], 57, "allreduce",
                                                                     "job/gloo:0", "job")
    assert f.onset_at == pytest.approx(t, abs=1e-5) and f.detected_at == t + 6.2
    ev = f.evidence
    assert ev["reason"] == "not-entered" and ev["waiting"] == [0, 1, 3] and ev["threshold_s"] == 5.0
    (r2,) = ev["ranks"]
    assert r2["rank"] == 2 and r2["last_entered"]["seq"] == 56 and r2["last_entered"]["op"] == "allreduce"
    assert (r2["state"], r2["state_name"], r2["wchan"], r2["cpu_busy"]) == ("S", "sleeping", "hrtimer_nanosleep", 0.0)
    assert r2["pid"] == 1002 and r2["node"] == "node1" and r2["stopped"] is False
    line = format_line(f)
    assert len(line) <= 100
    for part in ("HANG not-entered", "[2]", "gloo:0", "seq 57", "allreduce", "6.2 s", "rank 2 S",
                 "hrtimer_nanosleep", "seq 56"):
        assert part in line, (part, line)


def test_finding_json_shape():
    job, tl, t = rank2_missing_57()
    f = hangs(tl, t + 6.2)[0]
    d = json.loads(f.json_line())
    assert list(d) == ["kind", "class", "ranks", "link", "comm", "seq", "op", "onset_at", "detected_at",
                       "evidence", "stack", "id", "job"]
    assert d["class"] == "not-entered" and d["link"] is None and d["stack"] is None and d["ranks"] == [2]
    assert d == f.to_json()
    assert hangs(tl, t + 9)[0].id == f.id  # same hang, same id (live and replay agree)


def test_stopped_rank_is_a_fault():
    job, tl, t = rank2_missing_57(state="T", wchan="do_signal_stop")
    (f,) = hangs(tl, t + 6)
    assert f.cls == "fault" and f.ranks == [2] and f.seq == 57
    assert f.evidence["reason"] == "stopped" and f.evidence["ranks"][0]["stopped"] is True
    assert "T (stopped)" in format_line(f) or "rank 2 T" in format_line(f)


def test_exited_rank_is_a_fault():
    job, tl, t = run_to(56)
    for r in (0, 1, 3):
        job.enter(r, 57, t)
    job.exit(2, t + 0.5)
    job.feed(tl, t + 1)
    (f,) = hangs(tl, t + 6)
    assert f.cls == "fault" and f.ranks == [2] and f.evidence["reason"] == "exited"
    assert "rank 2 exited" in format_line(f)


def test_fault_names_the_dead_rank_and_lists_the_other_missing():
    job, tl, t = run_to(56)
    for r in (0, 3):
        job.enter(r, 57, t)
    job.state(2, t + 1, "T", "do_signal_stop")
    job.feed(tl, t + 1)
    (f,) = hangs(tl, t + 6)
    assert f.cls == "fault" and f.ranks == [2] and f.evidence["also_missing"] == [1]


def test_long_arrival_spread_learned_earlier_raises_the_threshold():
    job, tl = SynthJob(), Timeline()
    job.announce(T0)
    t = job.steps(1, 9, T0 + 1)
    t = job.collective(10, t + 0.1, late={3: 20.0})  # rank 3 checkpoints: the others wait 20 s
    t = job.steps(11, 9, t + 0.1)
    for r in (0, 1, 2):
        job.enter(r, 20, t + 0.1)
    job.feed(tl, t + 1)
    onset = t + 0.1
    assert hangs(tl, onset + 30) == []          # 30 s is normal for this job now
    (f,) = hangs(tl, onset + 81)                # but not 4 x 20 s
    assert f.cls == "not-entered" and f.ranks == [3] and f.seq == 20
    assert f.evidence["threshold_s"] == pytest.approx(80.0, abs=0.01)
    assert hangs(tl, onset + 30, k=1.0)[0].ranks == [3]   # K and the floor are parameters
    assert hangs(tl, onset + 2, floor_s=1.0, k=0.0)[0].ranks == [3]


def test_stuck_inside_names_the_rank_that_never_started():
    job, tl, t = run_to(56)
    for r in range(4):
        job.enter(r, 57, t + 0.001 * r)
    for r in (0, 1, 3):
        job.start(r, 57, t + 0.01)
    job.feed(tl, t + 1)
    assert hangs(tl, t + 4) == []
    (f,) = hangs(tl, t + 6)
    assert f.cls == "fault" and f.ranks == [2] and f.evidence["reason"] == "not-started"
    assert f.onset_at == pytest.approx(t + 0.003, abs=1e-5)
    assert "never started it" in format_line(f) and "inside for" in format_line(f)


def test_stuck_inside_without_start_events_names_who_did_not_finish():
    job, tl, t = run_to(56)
    for r in range(4):
        job.enter(r, 57, t)
    for r in (1, 2):
        job.end(r, 57, t + 0.01)
    job.feed(tl, t + 1)
    (f,) = hangs(tl, t + 6)
    assert f.cls == "fault" and f.ranks == [0, 3] and f.evidence["reason"] == "not-finished"
    assert f.evidence["finished"] == [1, 2]


def test_stuck_inside_with_a_stopped_member():
    job, tl, t = run_to(56)
    for r in range(4):
        job.enter(r, 57, t)
    job.state(1, t + 1, "t", "ptrace_stop")
    job.feed(tl, t + 1)
    (f,) = hangs(tl, t + 6)
    assert f.cls == "fault" and f.ranks == [1] and f.evidence["reason"] == "stopped"


def test_long_collectives_learned_earlier_raise_the_inside_threshold():
    job, tl, t = run_to(20, dur=3.0)  # every allreduce takes 3 s (big tensors, slow network)
    for r in range(4):
        job.enter(r, 21, t)
    for i in range(1, 13):  # agents keep sending while the ranks are inside (heartbeat frames)
        job.feed(tl, t + i)
    assert hangs(tl, t + 11) == []
    assert hangs(tl, t + 12.5)[0].evidence["threshold_s"] == pytest.approx(12.0, abs=0.01)


def test_group_of_one_and_unknown_comms_are_quiet():
    job, tl = SynthJob(world=1, nodes=1), Timeline()
    job.announce(T0)
    job.enter(0, 1, T0 + 1)
    job.feed(tl, T0 + 2)
    assert hangs(tl, T0 + 100) == []


def test_format_line_stays_within_100_columns():
    f = Finding(kind="hang", cls="not-entered", ranks=list(range(40)), comm="a-very-long-job-name-" * 3 + "/gloo:0",
                seq=123456, op="reduce_scatter_tensor_coalesced", onset_at=0.0, detected_at=7.25,
                evidence={"reason": "not-entered", "ranks": [{"rank": 0, "state": "D", "wchan": "x" * 60,
                                                              "last_entered": {"seq": 123455}}] * 40})
    assert len(format_line(f)) <= 100


def test_ranks_of_a_silent_agent_are_not_judged():
    # rank 2's agent (agent-1) dies while ranks 0, 1, 3 wait: "not entered" or "its events cannot
    # reach us"? ccld cannot tell, so it says nothing until that agent speaks again.
    job, tl, t = run_to(56)
    for r in (0, 1, 3):
        job.enter(r, 57, t)
    for i in range(1, 4):
        job.feed(tl, t + 0.1 * i)
    for i in range(1, 80):  # only agent-0 (ranks 0, 1) keeps sending
        now = t + 0.3 + 0.1 * i
        tl.ingest(ev.decode_batch(job.agents[0].frame(now)), now)
    assert hangs(tl, t + 8) == []
    job.feed(tl, t + 8.1)  # agent-1 is back (rank 2 still has not entered)
    assert [f.ranks for f in hangs(tl, t + 8.2)] == [[2]]
