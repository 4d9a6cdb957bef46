"""Hang detection on synthetic 4-rank runs: exactly the right finding, or none."""
import json

import pytest

from ccld import wire as ev

from ccld.timeline.timeline import Timeline
from ccld.diagnose import Diagnoser, hang
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


def test_a_rank_killed_then_the_rest_stopped_by_the_launcher_is_named_at_once():
    # torchrun stops the others ~0.1 s after one rank is SIGKILLed, before gloo reports an error and
    # long before any threshold: the killed rank is named from its exit, not the ranks stopped after it.
    job, tl, t = run_to(56)
    for r in (1, 3):
        job.enter(r, 57, t)
    job.exit(2, t + 0.2, exact=True, signal=9)
    for r in (0, 1, 3):
        job.exit(r, t + 0.3, exact=True, signal=15, by_launcher=True)
    job.feed(tl, t + 0.4)
    (f,) = hangs(tl, t + 0.5)
    assert (f.cls, f.ranks, f.evidence["reason"]) == ("fault", [2], "exited")
    # a job whose launcher stopped every rank (an elastic restart) is nobody's fault
    job, tl, t = run_to(56)
    for r in (1, 3):
        job.enter(r, 57, t)
    for r in range(4):
        job.exit(r, t + 0.3, exact=True, signal=15, by_launcher=True)
    job.feed(tl, t + 0.4)
    assert hangs(tl, t + 10) == []


def test_a_source_without_completions_is_not_called_stuck_inside():
    # NCCL's API probes alone say when ranks called a collective, never when it ended: a healthy job
    # that pauses after its last call must not look stuck inside it. A real not-entered hang still is one.
    job, tl = SynthJob(), Timeline()
    job.announce(T0)
    t = T0 + 1
    for seq in range(20):
        job.collective(seq, t + 0.1 * seq, finish=False)
    job.feed(tl, t + 2.1)
    job.feed(tl, t + 29.9)  # the agents keep sending (a silent agent would make it unjudgeable)
    assert hangs(tl, t + 30) == []
    job.collective(20, t + 30, ranks=[0, 1, 3], finish=False)
    job.feed(tl, t + 30.1)
    job.feed(tl, t + 39.9)
    (f,) = hangs(tl, t + 40)
    assert (f.cls, f.ranks) == ("not-entered", [2])


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


# ---- what the missing rank is doing instead -------------------------------------------------------

def subgroups(job, t, names=("job/gloo:1", "job/gloo:2"), ranks=(0, 1)):
    """Ranks `ranks` build the subgroups `names` (group size len(ranks)), as new_group does."""
    for name in names:
        for gr, r in enumerate(ranks):
            job._put(r, ev.CommInit(pid=job.pid[r], rank=r, ts_ns=job.ts(r, t), backend="gloo", comm=name,
                                    group_rank=gr, group_size=len(ranks)))


def sub_collective(job, name, seq, t, ranks=(0, 1), finish=True):
    for r in ranks:
        job.enter(r, seq, t, comm=name)
    if finish:
        for r in ranks:
            job._put(r, ev.WorkEnd(pid=job.pid[r], rank=r, ts_ns=job.ts(r, t + 0.002), comm=name, seq=seq))


def test_a_rank_waiting_in_another_communicator_says_where_and_for_whom():
    job, tl = SynthJob(), Timeline()
    job.announce(T0)
    subgroups(job, T0)
    t = job.steps(1, 20, T0 + 1)
    for i in range(1, 11):
        sub_collective(job, "job/gloo:1", i, T0 + 0.1 * i)
    # rank 1 enters gloo:1 seq 11 and waits there for rank 0, which never comes; ranks 0, 2, 3 wait in gloo:0
    sub_collective(job, "job/gloo:1", 11, t + 0.05, ranks=(1,), finish=False)
    for r in (0, 2, 3):
        job.enter(r, 21, t + 0.1)
    job.state(0, t + 1, "S", "hrtimer_nanosleep", cpu_ns=10**9)
    job.feed(tl, t + 1)
    # gloo:0 seq 21 waits for rank 1, which waits in gloo:1 seq 11 for rank 0, which waits in gloo:0:
    # a cycle of waits with no head (a cross-communicator deadlock), so the finding names the cycle
    # ranks; gloo:1's own finding names the same ranks and is folded into it (one problem, one line)
    by_comm = {f.comm: f for f in hang.check_all(tl, t + 6.5)}
    f, g = by_comm["job/gloo:0"], by_comm["job/gloo:1"]
    assert (f.cls, f.ranks, f.comm, f.seq) == ("not-entered", [0, 1], "job/gloo:0", 21)
    assert (g.cls, g.ranks, g.seq) == ("not-entered", [0, 1], 11) and g.evidence["deadlock"] is True
    (kept,) = hangs(tl, t + 6.5)
    assert kept.comm == "job/gloo:1" and kept.evidence["also_waiting"][0]["comm"] == "job/gloo:0"
    d = {x["rank"]: x for x in f.evidence["ranks"]}
    assert d[1]["doing"] == "in-collective" and d[1]["doing_text"] == "in gloo:1 seq 11 allreduce"
    hop, back = f.evidence["wait_chains"]["1"]["hops"]
    assert (hop["rank"], hop["comm"], hop["seq"], hop["waits_for"]) == (1, "job/gloo:1", 11, [0])
    assert (back["rank"], back["comm"], back["seq"], back["waits_for"]) == (0, "job/gloo:0", 21, [1])
    assert f.evidence["deadlock"] is True  # rank 0, which gloo:1 waits for, waits here in gloo:0
    assert "in gloo:1 seq 11 allreduce" in format_line(f) and "deadlock" in format_line(f)


def test_two_subgroups_waiting_on_each_other_is_a_deadlock_on_both():
    job, tl = SynthJob(), Timeline()
    job.announce(T0)
    subgroups(job, T0)
    t = job.steps(1, 20, T0 + 1)
    for i in range(1, 6):
        sub_collective(job, "job/gloo:1", i, T0 + 0.1 * i)
        sub_collective(job, "job/gloo:2", i, T0 + 0.1 * i + 0.01)
    job.enter(0, 6, t, comm="job/gloo:1")   # rank 0: gloo:1 first, then gloo:2
    job.enter(1, 6, t, comm="job/gloo:2")   # rank 1: the other way round
    job.feed(tl, t + 1)
    got = {f.comm: f for f in hang.check_all(tl, t + 6)}
    assert set(got) == {"job/gloo:1", "job/gloo:2"}
    for f in got.values():  # each side names the cycle: ranks 0 and 1 wait for each other
        assert (f.cls, f.ranks) == ("not-entered", [0, 1]) and f.evidence["deadlock"] is True
        assert {d["doing"] for d in f.evidence["ranks"]} == {"in-collective", "inside"}  # one each side
    (kept,) = hangs(tl, t + 6)  # one finding for the one deadlock
    assert kept.ranks == [0, 1] and len(kept.evidence["also_waiting"]) == 1


def test_what_a_missing_rank_does_io_and_sleeping():
    from ccld.diagnose import thresholds
    job, tl, t = rank2_missing_57(state="D", wchan="folio_wait_bit")
    # disk I/O is work (a checkpoint to slow storage looks like this): a pause first ...
    assert hangs(tl, t + 6.2) == []
    (p,) = Diagnoser(tl).find_slow(t + 6.2)
    assert p.evidence["informational"] and p.evidence["ranks"][0]["doing"] == "io"
    # ... a hang when it lasts far longer than the job has ever waited
    for i in range(4, int(thresholds.BUSY_FLOOR_S) + 2):  # agents keep sending (heartbeat frames)
        job.feed(tl, t + i)
    (f,) = hangs(tl, t + thresholds.BUSY_FLOOR_S + 1)
    d = f.evidence["ranks"][0]
    assert (f.cls, d["doing"], d["doing_text"]) == ("not-entered", "io", "blocked in I/O (folio_wait_bit)")
    assert "wait_chains" not in f.evidence
    job, tl, t = rank2_missing_57()
    d = hangs(tl, t + 6.2)[0].evidence["ranks"][0]
    assert d["doing"] == "sleeping" and "hrtimer_nanosleep" in d["doing_text"]


def busy_rank0(seconds, cpu_share=0.95):
    """Rank 0 busy on CPU (a checkpoint) while ranks 1-3 wait in seq 57 for `seconds`."""
    job, tl, t = run_to(56)
    for r in (1, 2, 3):
        job.enter(r, 57, t)
    for i in range(int(seconds) + 1):
        job.state(0, t + i, "R" if cpu_share else "S", "", cpu_ns=int(cpu_share * i * 1e9))
        job.feed(tl, t + i)
    return job, tl, t


def test_a_checkpoint_that_alternates_cpu_disk_and_short_sleeps_stays_a_pause():
    # one /proc sample in three shows it asleep (between writes): judged over the wait, still working
    job, tl, t = run_to(56)
    for r in (1, 2, 3):
        job.enter(r, 57, t)
    d, kinds = Diagnoser(tl), set()
    for i in range(40):
        job.state(0, t + i, ("R", "D", "S")[i % 3], "", cpu_ns=int(0.4 * i * 1e9))
        job.feed(tl, t + i)
        kinds |= {(f.kind, f.cls) for f in d.find_hangs(t + i + 0.5) + d.find_slow(t + i + 0.5)}
    assert kinds == {("slow", "comp-slow")}


def test_a_busy_rank_is_a_pause_not_a_hang_until_far_beyond():
    from ccld.diagnose import thresholds
    job, tl, t = busy_rank0(20)
    d = Diagnoser(tl)
    assert d.find_hangs(t + 20) == []
    (p,) = d.find_slow(t + 20)
    assert (p.kind, p.cls, p.ranks, p.seq) == ("slow", "comp-slow", [0], 57)
    assert p.evidence["informational"] is True and p.evidence["reason"] == "pause"
    assert p.evidence["ranks"][0]["doing"] == "busy" and p.evidence["hang_after_s"] == thresholds.BUSY_FLOOR_S
    assert format_line(p).startswith("INFO comp-slow") and "not a hang" in format_line(p)
    job, tl, t = busy_rank0(thresholds.BUSY_FLOOR_S + 2)
    (f,) = hangs(tl, t + thresholds.BUSY_FLOOR_S + 2)
    assert (f.cls, f.ranks, f.evidence["ranks"][0]["doing"]) == ("not-entered", [0], "busy")
    # a sleeping rank is not given that grace
    job, tl, t = busy_rank0(8, cpu_share=0.0)
    assert hangs(tl, t + 8)[0].ranks == [0]


def test_a_collective_that_failed_is_a_fault_of_the_rank_that_died_at_once():
    job, tl, t = run_to(56)
    for r in range(4):
        job.enter(r, 57, t)
    for r in (0, 2, 3):  # they lost their peer: gloo errors out
        job.end(r, 57, t + 0.2, ok=False)
    job.exit(1, t + 0.9)
    job.feed(tl, t + 1)
    assert hangs(tl, t + 1.0) == []     # the other ends may still be on their way
    (f,) = hangs(tl, t + 1.5)           # no 5 s wait: an error is not a wait
    assert (f.cls, f.ranks, f.seq) == ("fault", [1], 57)
    assert f.evidence["reason"] == "exited" and f.evidence["failed_ranks"] == [0, 2, 3]
    assert f.evidence["never_ended"] == [1] and f.evidence["sizes_known"] is False
    assert f.onset_at == pytest.approx(t + 0.2, abs=1e-5)
    assert "errors on [0,2,3]" in format_line(f)


def test_failures_on_every_rank_blame_the_failed_ones():
    job, tl, t = run_to(56)
    for r in range(4):
        job.enter(r, 57, t)
    for r in range(4):
        job.end(r, 57, t + 0.2, ok=r not in (1, 2))
    job.feed(tl, t + 1)
    (f,) = hangs(tl, t + 2)
    assert (f.cls, f.ranks, f.evidence["reason"]) == ("fault", [1, 2], "failed")


def killed_inside(t, error_text=None):
    """Rank 2 is SIGKILLed inside collective 57; its ring neighbours 1 and 3 fail on the broken
    connection, rank 0 waits inside without noticing; then the launcher stops 0, 1 and 3. The agent
    sees 0 and 2 gone in one /proc scan."""
    job, tl, _ = run_to(56)
    for r in range(4):
        job.enter(r, 57, t + 0.001 * r)
        job.start(r, 57, t + 0.004)
    for r in (1, 3):
        job._put(r, ev.WorkEnd(pid=job.pid[r], rank=r, ts_ns=job.ts(r, t + 0.05), comm=job.comm, seq=57, ok=False,
                               error=error_text or "gloo reported an error (finishWorkGlooError)"))
    job.exit(0, t + 0.3)
    job.exit(2, t + 0.3 + 1e-5)
    job.exit(1, t + 0.5)
    job.exit(3, t + 0.5)
    job.feed(tl, t + 0.6)
    return job, tl


def test_a_rank_killed_inside_is_the_one_its_peers_lost_the_connection_to():
    t = T0 + 100
    text = ("gloo reported an error (finishWorkGlooError); connection to group rank 2 broke: "
            "Read error [127.0.0.1]:65238: Connection reset by peer")
    job, tl = killed_inside(t, text)
    (f,) = hangs(tl, t + 2)
    assert (f.cls, f.ranks, f.evidence["reason"]) == ("fault", [2], "exited"), f.evidence
    assert f.evidence["never_ended"] == [0, 2] and f.evidence["death_order"] is None
    assert f.evidence["outlived_fault"] == {"peers_lost_connection_to": {"2": 2}}


def test_without_the_broken_connection_a_kill_inside_stays_unordered_and_says_so():
    t = T0 + 100
    job, tl = killed_inside(t)
    (f,) = hangs(tl, t + 2)
    assert f.ranks == [0, 2] and f.evidence["death_order"].startswith("unknown")


def test_a_rank_that_failed_the_collective_before_is_a_victim_not_the_first_death():
    job, tl, t = run_to(56)
    # rank 2 dies inside 57; ranks 1 and 3 finish 57 and enter 58; rank 0 fails 57 on the broken
    # connection and never gets to 58; ranks 1 and 3 then fail 58
    for r in range(4):
        job.enter(r, 57, t)
        job.start(r, 57, t + 0.002)
    for r in (1, 3):
        job.end(r, 57, t + 0.01)
        job.enter(r, 58, t + 0.02)
        job.end(r, 58, t + 0.06, ok=False)
    job.end(0, 57, t + 0.07, ok=False)
    job.exit(0, t + 0.3)
    job.exit(2, t + 0.3)
    job.feed(tl, t + 0.6)
    (f,) = hangs(tl, t + 2)
    assert (f.cls, f.ranks, f.seq) == ("fault", [2], 58), f.evidence
    assert f.evidence["outlived_fault"] == {"active_after_fault": [0]}


def two_gone_two_failed():
    """Collective 57: every rank in; ranks 1 and 3 fail it (they lost a peer); 0 and 2 vanish."""
    job, tl, t = run_to(56)
    for r in range(4):
        job.enter(r, 57, t)
        job.start(r, 57, t + 0.002)
    for r in (1, 3):
        job.end(r, 57, t + 0.05, ok=False)
    return job, tl, t


def test_the_rank_whose_exit_was_seen_first_died_first():
    job, tl, t = two_gone_two_failed()
    job.exit(2, t + 0.2)  # one scan ...
    job.exit(0, t + 1.2)  # ... and the next
    job.feed(tl, t + 1.3)
    (f,) = hangs(tl, t + 2.5)
    assert f.ranks == [2] and f.evidence["outlived_fault"] == {"exited_later": [0], "exit_times": "agent scans"}


@pytest.mark.parametrize("exact", [True, False])
def test_exits_timed_by_the_kernel_are_ordered_to_the_millisecond(exact):
    # The agent's last look at `ccld run`'s end found both gone: with the kernel's exit times (sched)
    # the killed rank died 30 ms before the one torchrun stopped; scan times that close say nothing.
    job, tl, t = two_gone_two_failed()
    job.exit(2, t + 0.20, exact=exact)
    job.exit(0, t + 0.23, exact=exact)
    job.feed(tl, t + 1.3)
    (f,) = hangs(tl, t + 2.5)
    if exact:
        assert f.ranks == [2] and f.evidence["outlived_fault"] == {"exited_later": [0], "exit_times": "kernel"}
    else:
        assert f.ranks == [0, 2] and f.evidence["death_order"].startswith("unknown")


def test_a_job_its_launcher_stopped_is_not_hung():
    # An elastic restart: torchrun SIGTERMs its ranks 1 ms apart; rank 1 entered collective 57 just
    # before its turn. Nobody waits on anybody: no finding, however long the collective stays open.
    job, tl, t = run_to(56)
    job.enter(1, 57, t)
    for r in range(4):
        job.exit(r, t + 0.001 * (r + 1), exact=True, signal=15, by_launcher=True)
    job.feed(tl, t + 0.5)
    assert hangs(tl, t + 10) == []


def test_a_rank_killed_from_outside_is_the_fault_not_those_its_launcher_stopped():
    # Rank 2 SIGKILLed (by someone else: the OOM killer, an operator); torchrun stops the others 1 ms
    # later, too close for even the kernel's exit times to order: the launcher's signal says it.
    job, tl, t = two_gone_two_failed()
    job.exit(2, t + 0.200, exact=True, signal=9)
    job.exit(0, t + 0.201, exact=True, signal=15, by_launcher=True)
    job.feed(tl, t + 1.3)
    (f,) = hangs(tl, t + 2.5)
    assert f.ranks == [2] and f.evidence["outlived_fault"] == {"stopped_by_launcher": [0]}


def test_a_world_no_agent_backs_is_not_a_crowd_of_missing_ranks():
    """A frame claims a world of 2^17 ranks where agents announce 4: the hang names the one announced
    rank that is missing, not 131,068 ranks nobody reports (that made every tick build and print them
    all: bench/fuzz_collector.py measures the collector under such frames)."""
    job, tl = SynthJob(), Timeline()
    job.announce(T0)
    t = job.steps(1, 20, T0 + 1)
    a = job.agents[0]
    a.pending.append(ev.RankInfo(pid=999, rank=0, world_size=1 << 17, local_rank=0, node=a.node, job="job",
                                 ts_ns=a.mono(t)))
    for r in (0, 1, 3):
        job.enter(r, 21, t + 0.1)
    job.feed(tl, t + 1)
    assert tl.jobs["job"] == 1 << 17
    assert tl.expected_members(job.comm) == frozenset(range(4))
    (f,) = hangs(tl, t + 6.5)
    assert f.ranks == [2] and len(f.json_line()) < 20_000, f.ranks[:10]


def test_a_rank_stuck_in_io_is_a_hang_but_one_writing_is_a_pause():
    """Sampled over the wait (one Diagnoser ticking, as the collector's): in D in one wait channel with
    no CPU used all along is stuck I/O (a dead FUSE or NFS server): a hang at the normal threshold;
    in D but using CPU and moving between wait channels is a checkpoint being written: a pause."""
    for stuck in (True, False):
        job, tl, t = run_to(56)
        for r in (0, 1, 3):
            job.enter(r, 57, t + 0.001 * r)
        d = Diagnoser(tl)
        found = []
        for i in range(1, 14):
            wchan = "folio_wait_bit_common" if stuck or i % 2 else "jbd2_log_wait_commit"
            job.state(2, t + i * 0.5, "D", wchan, cpu_ns=10**9 if stuck else 10**9 + i * 10**8)
            job.feed(tl, t + i * 0.5)
            found += d.find_hangs(t + i * 0.5 + 0.01)
        if stuck:
            assert found and (found[0].cls, found[0].ranks) == ("not-entered", [2])
            assert found[0].evidence["ranks"][0]["doing"] == "io"
        else:
            assert found == []
            (p,) = d.find_slow(t + 6.6)
            assert p.evidence["informational"] and p.evidence["reason"] == "pause"


def test_hangs_behind_an_inconsistent_collective_of_another_group_are_that_one_problem():
    """In a 2-rank group of ranks 2 and 3, rank 3 calls all_gather where rank 2 all_reduces: both are
    stuck there, and ranks 0 and 1 wait in the default group for them. One finding: the mismatch."""
    job, tl = SynthJob(), Timeline()
    job.announce(T0)
    sub = "job/gloo:1"
    for r in (2, 3):
        job._put(r, ev.CommInit(pid=job.pid[r], rank=r, ts_ns=job.ts(r, T0), backend="gloo", comm=sub,
                                group_rank=r - 2, group_size=2))
    t = job.steps(1, 20, T0 + 1)
    for i in range(1, 11):
        sub_collective(job, sub, i, T0 + 0.1 * i, ranks=(2, 3))
    job.enter(2, 11, t + 0.01, comm=sub)
    job.enter(3, 11, t + 0.01, op="allgather", comm=sub)
    for r in (0, 1):
        job.enter(r, 21, t + 0.02)
    job.feed(tl, t + 1)
    for i in range(2, 8):
        job.feed(tl, t + i)
    got = hangs(tl, t + 6.5)
    assert [(f.cls, f.ranks, f.comm) for f in got] == [("inconsistent", [3], sub)], \
        [(f.cls, f.ranks, f.comm) for f in got]


def test_stuck_inside_says_how_long_each_call_waited_to_start_against_the_usual():
    job, tl, t = run_to(56)  # every healthy collective starts 10 ms after its enter (SynthJob.collective)
    for r in range(4):
        job.enter(r, 57, t + 0.001 * r)
    job.start(0, 57, t + 0.010)
    job.start(1, 57, t + 0.801)   # reached its work late
    job.start(3, 57, t + 0.013)
    job.feed(tl, t + 1)
    (f,) = hangs(tl, t + 6)
    q = f.evidence["queued"]
    assert f.evidence["reason"] == "not-started" and f.ranks == [2]
    assert list(q["started_after_s"]) == ["1", "0", "3"]  # the largest gap first
    assert q["started_after_s"]["1"] == pytest.approx(0.8, abs=1e-4)
    assert q["not_started_for_s"] == {"2": pytest.approx(6 - 0.002, abs=1e-3)}
    assert (q["n_started"], q["n_not_started"]) == (3, 1)
    assert q["usual_s"] == pytest.approx(0.001, abs=1e-6)  # all start when the last of 4 arrives: 2, 1.33, 0.67, 0 ms



def test_a_source_without_start_events_gives_no_queue_evidence():
    job, tl = SynthJob(), Timeline()
    job.announce(T0)
    t = T0 + 1
    for seq in range(1, 57):  # enters and ends only (an API-probe source)
        for r in range(4):
            job.enter(r, seq, t + 0.001 * r)
            job.end(r, seq, t + 0.01)
        t += 0.1
    for r in range(4):
        job.enter(r, 57, t)
    for r in (1, 2):
        job.end(r, 57, t + 0.01)
    job.feed(tl, t + 1)
    (f,) = hangs(tl, t + 6)
    assert f.evidence["reason"] == "not-finished" and "queued" not in f.evidence


def test_a_rank_over_without_a_start_event_is_not_waiting_to_start():
    job, tl, t = run_to(56)
    for r in range(4):
        job.enter(r, 57, t + 0.001 * r)
    for r in (0, 1):
        job.start(r, 57, t + 0.01)
    job.end(3, 57, t + 0.02)  # over, its start never reported
    job.feed(tl, t + 1)
    (f,) = hangs(tl, t + 6)
    q = f.evidence["queued"]
    assert list(q["not_started_for_s"]) == ["2"] and (q["n_started"], q["n_not_started"]) == (2, 1)
