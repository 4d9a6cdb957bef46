"""Findings are reported once, and their end is reported as a recovery."""
import pytest

from ccld.timeline.timeline import Timeline
from ccld.diagnose import Diagnoser
from ccld.diagnose.findings import Finding, format_line
from ccld.diagnose.tracker import FindingTracker

from ccld_synth import T0, SynthJob

pytestmark = pytest.mark.unit


def finding(ranks=(2,), seq=57, cls="not-entered", detected=10.0):
    return Finding(kind="hang", cls=cls, ranks=list(ranks), comm="job/gloo:0", seq=seq, op="allreduce",
                   onset_at=1.0, detected_at=detected)


def test_same_finding_is_reported_once():
    tr = FindingTracker()
    assert tr.update([finding()], 10.0) == ([finding()], [])
    assert tr.update([finding(detected=10.5)], 10.5) == ([], [])
    assert tr.update([finding(detected=11.0), finding(detected=11.0)], 11.0) == ([], [])


def test_recovery_when_it_no_longer_holds():
    tr = FindingTracker()
    f = finding()
    tr.update([f], 10.0)
    new, rec = tr.update([], 12.5)
    assert new == []
    assert rec == [{"kind": "recovered", "id": f.id, "class": "not-entered", "ranks": [2], "comm": "job/gloo:0",
                    "seq": 57, "recovered_at": 12.5}]
    assert format_line(rec[0]).startswith("RECOVERED not-entered ranks [2] gloo:0 seq 57")
    assert tr.update([], 13.0) == ([], [])
    assert tr.update([f], 14.0) == ([f], [])  # it came back: say so again


def test_changed_ranks_is_a_new_finding():
    tr = FindingTracker()
    tr.update([finding(ranks=(1, 2))], 10.0)
    new, rec = tr.update([finding(ranks=(2,))], 11.0)
    assert [f.ranks for f in new] == [[2]] and [r["ranks"] for r in rec] == [[1, 2]]


def test_end_to_end_with_the_detector():
    job, tl = SynthJob(), Timeline()
    job.announce(T0)
    t = job.steps(1, 56, T0 + 1) + 0.1
    for r in (0, 1, 3):
        job.enter(r, 57, t)
    job.feed(tl, t + 1)
    d, tr = Diagnoser(tl), FindingTracker()
    reported, recovered = [], []
    for i in range(40):  # 20 s of 0.5 s ticks
        now = t + 0.5 * i
        if i == 20:  # rank 2 finally arrives at t+10 and the collective completes
            job.enter(2, 57, now)
            for r in range(4):
                job.end(r, 57, now + 0.01)
            job.feed(tl, now + 0.02)
        new, rec = tr.update(d.find_hangs(now), now)
        reported += new
        recovered += rec
    assert [(f.cls, f.ranks, f.seq) for f in reported] == [("not-entered", [2], 57)]
    assert reported[0].detected_at == pytest.approx(t + 5.5)
    assert [(r["id"], r["recovered_at"]) for r in recovered] == [(reported[0].id, pytest.approx(t + 10))]


def test_class_change_on_the_same_ranks_supersedes_without_recovery():
    # the hung rank is later stopped or dies: not-entered -> fault, same collective, same ranks
    tr = FindingTracker()
    tr.update([finding(ranks=(1,))], 10.0)
    f2 = finding(ranks=(1,), cls="fault")
    new, rec = tr.update([f2], 11.0)
    assert [f.cls for f in new] == ["fault"] and rec == []
    new, rec = tr.update([], 12.0)
    assert new == [] and [r["class"] for r in rec] == ["fault"]


def slow_finding(ranks=(2,), cls="comp-slow", summary="rank 2 ~50 ms late", comm="job/gloo:0", seq=-1):
    return Finding(kind="slow", cls=cls, ranks=list(ranks), comm=comm, seq=seq, op="allreduce",
                   onset_at=1.0, detected_at=10.0, evidence={"summary": summary})


def test_a_slowdown_whose_story_changes_is_updated_not_repeated():
    tr = FindingTracker(min_update_gap_s=5.0)
    first = tr.step([slow_finding()], 10.0).new[0]
    assert tr.step([slow_finding()], 11.0).updated == []                      # same story: silence
    assert tr.step([slow_finding(summary="rank 2 ~100 ms late")], 12.0).updated == []  # too soon after
    (u,) = tr.step([slow_finding(summary="rank 2 ~100 ms late")], 15.5).updated
    assert (u["kind"], u["id"], u["summary"]) == ("updated", first.id, "rank 2 ~100 ms late")
    assert format_line(u) == "UPDATED comp-slow [2] gloo:0: rank 2 ~100 ms late"
    # the localiser names other ranks now: the same slowdown, updated; its id and onset stay
    (u,) = tr.step([slow_finding(ranks=(2, 3), summary="rank 2 ~100 ms late")], 21.0).updated
    assert u["ranks"] == [2, 3] and u["id"] == first.id and tr.active[("comp-slow", "job/gloo:0", -1, ())].onset_at == 1.0


def test_a_slowdown_is_over_only_after_it_stayed_away():
    tr = FindingTracker(slow_clear_s=10.0)
    tr.step([slow_finding()], 10.0)
    for now in (11.0, 15.0):
        assert tr.step([], now).recovered == []
    assert tr.step([slow_finding()], 16.0).new == []      # back before the clear time: the same one
    assert tr.step([], 17.0).recovered == []
    (r,) = tr.step([], 27.5).recovered
    assert r["class"] == "comp-slow" and r["recovered_at"] == 27.5


def test_a_pause_that_becomes_a_hang_is_superseded_silently():
    tr = FindingTracker()
    pause = Finding(kind="slow", cls="comp-slow", ranks=[0], comm="job/gloo:0", seq=57, op="allreduce",
                    onset_at=1.0, detected_at=7.0, evidence={"informational": True, "summary": "pause"})
    tr.step([pause], 7.0)
    ch = tr.step([finding(ranks=(0,), seq=57)], 130.0)
    assert [f.cls for f in ch.new] == ["not-entered"] and ch.recovered == []
    ch = tr.step([], 131.0)   # and a pause that simply ends is over at once (it has a seq)
    assert [r["class"] for r in ch.recovered] == ["not-entered"]
    tr.step([pause], 140.0)
    assert [r["class"] for r in tr.step([], 141.0).recovered] == ["comp-slow"]


def test_comp_slow_growing_into_mixed_slow_is_superseded():
    tr = FindingTracker(slow_clear_s=0.0)
    tr.step([slow_finding()], 10.0)
    ch = tr.step([slow_finding(ranks=(1, 2), cls="mixed-slow")], 11.0)
    assert [f.cls for f in ch.new] == ["mixed-slow"] and ch.recovered == []
