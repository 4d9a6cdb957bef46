"""comp-slow on synthetic jobs: a rank late step after step is named with its lag and the likely
cause; noisy healthy runs, one-off lateness and rare lateness are not findings."""
import random

import pytest

from ccld import wire as ev
from ccld.timeline.timeline import Timeline
from ccld.diagnose import Diagnoser, commslow, slow
from ccld.diagnose.findings import Finding, format_line
from ccld.diagnose.tracker import FindingTracker

from ccld_synth import T0, SynthJob

pytestmark = pytest.mark.unit

OPS = ("allreduce", "broadcast", "barrier")  # one training step: the late rank shows at the first


def run(seconds=40.0, world=4, late=None, noise=0.002, spikes=0.02, seed=1, step_s=0.06, tl=None, job=None,
        t0=None, seq0=1, every=1, sched=None, feed_every=10):
    """Steps of OPS every step_s for `seconds`. late: {rank: s} added to that rank's arrival at the
    first op of every `every`-th step. noise: exponential jitter (mean, s) on every arrival; spikes:
    probability that a random rank is 30 ms late at a random collective (scheduling hiccups)."""
    rnd = random.Random(seed)
    if job is None:
        job, tl = SynthJob(world=world), Timeline()
        job.announce(T0)
    t = T0 + 1 if t0 is None else t0
    seq, step = seq0, 0
    cpu = {r: 0 for r in range(world)}
    last_state = t
    while t < (T0 + 1 if t0 is None else t0) + seconds:
        for i, op in enumerate(OPS):
            extra = {r: rnd.expovariate(1 / noise) for r in range(world)}
            if rnd.random() < spikes:
                extra[rnd.randrange(world)] += 0.030
            if i == 0 and late and step % every == 0:
                for r, x in late.items():
                    extra[r] += x
            end = job.collective(seq, t, op=op, spread=0.0, dur=0.002, late=extra)
            seq += 1
            t = end + 0.001
        if step % feed_every == 0:
            for r in range(world):  # /proc now and then: a late rank is busier (90 % vs 40 % of a CPU)
                cpu[r] += int((0.9 if late and r in late else 0.4) * (t - last_state) * 1e9)
                job.state(r, t, "R" if late and r in late else "S", "", cpu_ns=cpu[r])
                if sched is not None:
                    job._put(r, ev.SchedStats(pid=job.pid[r], rank=r, ts_ns=job.ts(r, t),
                                              runq_ns=int(sched.get(r, 0.005) * (t - T0) * 1e9), runq_waits=step))
            job.feed(tl, t)
            last_state = t
        t += step_s
        step += 1
    job.feed(tl, t)
    return job, tl, t, seq


def comp_slow(found):
    return [f for f in found if f.cls == "comp-slow" and not f.evidence.get("informational")]


def test_noisy_healthy_runs_are_never_comp_slow():
    for seed in range(5):
        job, tl, t, _ = run(seconds=60, seed=seed, noise=0.003, spikes=0.05)
        d = Diagnoser(tl)
        for now in (t - 30, t - 10, t):
            assert d.find_slow(now) == [], (seed, now)


def test_a_rank_late_every_step_is_named_with_its_lag():
    job, tl, t, _ = run(seconds=20, late={2: 0.050})
    (f,) = held(Diagnoser(tl), t)
    assert (f.kind, f.cls, f.ranks, f.op, f.seq, f.comm) == ("slow", "comp-slow", [2], "allreduce", -1, "job/gloo:0")
    (d,) = f.evidence["ranks"]
    assert d["rank"] == 2 and d["median_lag_s"] == pytest.approx(0.050, abs=0.006)
    assert d["late_in"] >= 0.9 * d["of"] and d["of"] >= slow.MIN_COLLS
    assert 0.25 < d["waited_fraction"] < 1.0
    assert f.evidence["threshold_s"] < 0.050 and f.evidence["noise_sigma_s"] > 0
    assert d["cause"] == "busy-compute"  # no scheduler data; it used more CPU than the others
    assert "late at allreduce" in f.evidence["summary"] and "~50 ms" in f.evidence["summary"]
    assert T0 + 1 <= f.onset_at <= T0 + 2
    line = format_line(f)
    assert line.startswith("SLOW comp-slow [2] gloo:0 allreduce: rank 2 ~50 ms late") and len(line) <= 100


def test_it_is_found_within_seconds_of_the_onset():
    job, tl, t, seq = run(seconds=30)
    onset = t
    job, tl, t, seq = run(seconds=30, late={1: 0.040}, job=job, tl=tl, t0=t, seq0=seq)
    d = Diagnoser(tl)
    first = None
    for i in range(60):
        now = onset + 0.5 * i
        if comp_slow(d.find_slow(now)):
            first = now
            break
    assert first is not None and first - onset <= 10.0, first and first - onset
    assert comp_slow(d.find_slow(t))[0].ranks == [1]


def test_one_off_and_rare_lateness_are_not_findings():
    # a 2 s checkpoint on rank 0, once, then healthy
    job, tl, t, seq = run(seconds=5)
    end = job.collective(seq, t, late={0: 2.0})
    job, tl, t, _ = run(seconds=20, job=job, tl=tl, t0=end + 0.01, seq0=seq + 1)
    assert comp_slow(held(Diagnoser(tl), t)) == []
    # rank 3 late by 100 ms every 10th step only (an occasional GC)
    job, tl, t, _ = run(seconds=40, late={3: 0.100}, every=10)
    assert comp_slow(held(Diagnoser(tl), t)) == []


def test_a_small_lag_on_a_long_step_is_not_worth_a_finding():
    # 6 ms late every step, but a step takes 1.5 s: the others wait < 1 % of the time
    job, tl, t, _ = run(seconds=120, late={2: 0.006}, step_s=1.5, noise=0.0005, spikes=0)
    assert comp_slow(held(Diagnoser(tl), t)) == []
    # the same lag on a short step is (others wait ~10 % of the time)
    job, tl, t, _ = run(seconds=30, late={2: 0.006}, step_s=0.03, noise=0.0005, spikes=0)
    assert comp_slow(held(Diagnoser(tl), t))[0].ranks == [2]


def test_cpu_contention_is_told_by_the_runqueue():
    job, tl, t, _ = run(seconds=20, late={2: 0.030}, sched={2: 0.35})
    (f,) = comp_slow(held(Diagnoser(tl), t))
    (d,) = f.evidence["ranks"]
    assert d["cause"] == "cpu-contended" and d["runq_share"] == pytest.approx(0.35, abs=0.05)
    assert "wait for a CPU 0.35 s per s" in d["cause_text"]
    # the same lateness with a quiet runqueue is not blamed on contention
    job, tl, t, _ = run(seconds=20, late={2: 0.030}, sched={})
    (f,) = comp_slow(held(Diagnoser(tl), t))
    assert f.evidence["ranks"][0]["cause"] == "busy-compute"


def test_two_rank_job_and_several_late_ranks_of_many():
    job, tl, t, _ = run(seconds=20, world=2, late={1: 0.030}, noise=0.001)
    assert [f.ranks for f in comp_slow(held(Diagnoser(tl), t))] == [[1]]
    job, tl, t, _ = run(seconds=20, world=64, late={5: 0.040, 40: 0.030}, noise=0.001, feed_every=20)
    (f,) = comp_slow(held(Diagnoser(tl), t))
    assert f.ranks == [5, 40] and [d["rank"] for d in f.evidence["ranks"]] == [5, 40]


def test_ranks_late_together_are_one_finding_that_says_so():
    # half the ranks 30 ms late every step: the median sits between them, so no rank is late by it; the
    # collectives' late clusters name them, as one finding
    job, tl, t, _ = run(seconds=20, late={2: 0.030, 3: 0.030}, noise=0.001, spikes=0)
    (f,) = comp_slow(held(Diagnoser(tl), t))
    assert f.ranks == [2, 3] and f.evidence["together"] is True and f.evidence["grouped"] is True
    assert f.evidence["summary"] == "ranks 2, 3 slow together: ~30 ms late at allreduce"
    assert [d["median_lag_s"] for d in f.evidence["ranks"]] == [pytest.approx(0.030, abs=0.004)] * 2
    # one late rank of eight reads as it always did: no "together"
    job, tl, t, _ = run(seconds=20, world=8, late={5: 0.040}, noise=0.001, spikes=0)
    (f,) = comp_slow(held(Diagnoser(tl), t))
    assert f.ranks == [5] and "together" not in f.evidence


def test_ranks_late_together_that_share_a_subgroup_are_not_named_together():
    # ranks 0 and 1 run a subgroup's all-reduces every step and reach the world's ~30 ms after the
    # others: their communication, not their compute (the deadlock scenario's healthy part)
    job, tl = SynthJob(world=4), Timeline()
    job.announce(T0)
    for r in (0, 1):
        job._put(r, ev.CommInit(pid=job.pid[r], rank=r, ts_ns=job.ts(r, T0), backend="gloo", comm="job/gloo:1",
                                group_rank=r, group_size=2))
    job.feed(tl, T0)
    job, tl, t, _ = run(seconds=20, late={0: 0.030, 1: 0.030}, noise=0.001, spikes=0, tl=tl, job=job)
    assert comp_slow(held(Diagnoser(tl), t)) == []


def test_random_lateness_that_costs_time_is_spread_not_a_culprit():
    # every collective, a random rank is 30 ms late: the others wait a third of the time, for anyone
    job, tl, t, _ = run(seconds=20, noise=0.001, spikes=1.0)
    found = held(Diagnoser(tl), t)
    assert [(f.kind, f.cls, f.ranks) for f in found] == [("info", "spread", [])]
    f = found[0]
    assert f.evidence["informational"] and f.evidence["ranks_last"] == 4 and f.evidence["most_last_share"] < 0.5
    assert format_line(f) == "INFO spread gloo:0 allreduce: no culprit: 4 ranks take turns arriving last, ~30 ms behind"
    # its lifecycle: held like a slowdown, and silently superseded once a culprit is named
    tr = FindingTracker()
    assert [g.cls for g in tr.step(found, t).new] == ["spread"]
    culprit = Finding(kind="slow", cls="comp-slow", ranks=[1], comm=f.comm, seq=-1, op="allreduce", onset_at=t,
                      detected_at=t + 1, job=f.job)
    changes = tr.step([culprit], t + 1)
    assert [g.cls for g in changes.new] == ["comp-slow"] and changes.recovered == []


def test_lateness_in_a_pair_subgroup_points_at_nobody():
    # A 4-rank job with a two-rank subgroup {0, 1} (a dp group of a 3-D job) where rank 1 arrives
    # 30 ms after rank 0 every time: in a pair that says only that 0 came first (its pipeline ran
    # ahead), not that 1 is slow. The same lateness in a two-rank world is a finding (above).
    job, tl = SynthJob(world=4), Timeline()
    job.announce(T0)
    pair = "job/gloo:5"
    for r in (0, 1):
        job._put(r, ev.CommInit(pid=job.pid[r], rank=r, ts_ns=job.ts(r, T0), backend="gloo", comm=pair,
                                group_rank=r, group_size=2))
    job.comm = pair
    t, seq = T0 + 1, 1
    while t < T0 + 41:
        t = job.collective(seq, t, ranks=[0, 1], spread=0.0, dur=0.002, late={1: 0.030}) + 0.06
        seq += 1
        if seq % 10 == 0:
            job.feed(tl, t)
    job.feed(tl, t)
    assert sorted(tl.expected_members(pair)) == [0, 1] and tl.comms[pair].completed > 400
    assert comp_slow(held(Diagnoser(tl), t)) == []


def test_lifecycle_open_update_and_recover():
    job, tl, t, seq = run(seconds=20, late={2: 0.020})
    d, tr = Diagnoser(tl), FindingTracker()
    ch = tr.step(d.find_slow(t), t)
    assert [f.ranks for f in ch.new] == [[2]] and "~20 ms" in ch.new[0].evidence["summary"]
    # it gets worse: one update line, same finding (id, onset)
    job, tl, t2, seq = run(seconds=35, late={2: 0.100}, job=job, tl=tl, t0=t, seq0=seq)
    ch2 = tr.step(d.find_slow(t2), t2)
    assert ch2.new == [] and len(ch2.updated) == 1 and ch2.updated[0]["id"] == ch.new[0].id
    assert "~100 ms" in ch2.updated[0]["summary"] and format_line(ch2.updated[0]).startswith("UPDATED comp-slow [2]")
    # healthy again: after the window slides past, it is over (once absent for SLOW_CLEAR_S)
    job, tl, t3, seq = run(seconds=60, job=job, tl=tl, t0=t2, seq0=seq)
    rec = []
    for i in range(30):
        rec += tr.step(d.find_slow(t3 + i), t3 + i).recovered
    assert [r["class"] for r in rec] == ["comp-slow"] and rec[0]["id"] == ch.new[0].id


def held(d, t):
    """find_slow at `t` after a first look COMM_SLOW_HOLD_S earlier: comm-slow findings are held."""
    from ccld.diagnose import COMM_SLOW_HOLD_S
    d.find_slow(t - COMM_SLOW_HOLD_S)
    return d.find_slow(t)


def test_comp_and_comm_slow_on_one_comm_are_mixed_slow(monkeypatch):
    job, tl, t, _ = run(seconds=20, late={2: 0.050})

    def fake_comm_slow(tl_, now):
        return [Finding(kind="slow", cls="comm-slow", ranks=[0, 1], link=[0, 1], comm="job/gloo:0", seq=-1,
                        op="allreduce", onset_at=now - 5, detected_at=now, job="job",
                        evidence={"slowdown": 4.0, "summary": "link 0->1 rtt 25 ms"})]
    monkeypatch.setattr(commslow, "find_comm_slow", fake_comm_slow)
    (f,) = held(Diagnoser(tl), t)
    assert (f.cls, f.ranks, f.link) == ("mixed-slow", [0, 1, 2], [0, 1])
    assert f.evidence["comp_ranks"] == [2] and f.evidence["comm_ranks"] == [0, 1]
    assert f.evidence["comm"]["slowdown"] == 4.0 and f.evidence["comp"]["reason"] == "late-arrival"
    # a comm-slow on another communicator stays what it is
    monkeypatch.setattr(commslow, "find_comm_slow", lambda tl_, now: [
        Finding(kind="slow", cls="comm-slow", ranks=[], comm="job/gloo:7", seq=-1, op="allreduce",
                onset_at=now, detected_at=now, job="job")])
    assert sorted(f.cls for f in held(Diagnoser(tl), t)) == ["comm-slow", "comp-slow"]


def test_summaries_kept_between_ticks_give_the_same_answer_as_a_fresh_look():
    job, tl, t, seq = run(seconds=20, late={2: 0.050})
    kept = slow.LatenessDetector()
    first = kept.find(tl, t)
    job, tl, t2, _ = run(seconds=20, late={3: 0.050}, job=job, tl=tl, t0=t, seq0=seq)
    again, fresh = kept.find(tl, t2), slow.LatenessDetector().find(tl, t2)
    assert [f.ranks for f in first] == [[2]] and [f.ranks for f in again] == [f.ranks for f in fresh] == [[3]]
    assert again[0].evidence["ranks"][0]["late_in"] == fresh[0].evidence["ranks"][0]["late_in"]


def test_a_rebuilt_communicator_does_not_reuse_old_collectives():
    # rank 2 restarts and rebuilds the group (new pid): seqs start over and the old lateness is gone
    job, tl, t, _ = run(seconds=20, late={2: 0.050})
    det = slow.LatenessDetector()
    assert [f.ranks for f in det.find(tl, t)] == [[2]]
    job.pid[2] = 5002
    job.announce(t + 0.1)
    job.feed(tl, t + 0.1)
    job, tl, t2, _ = run(seconds=8, job=job, tl=tl, t0=t + 0.2, seq0=1)
    assert det.find(tl, t2) == []


def test_a_comm_slow_caused_by_one_ranks_cpu_is_that_ranks_comp_slow(monkeypatch):
    # arrivals line up (no lateness), the links localiser says allreduce is slow on link 1-3, and
    # rank 3 waits for a CPU far more than the others: its starved threads are the cause
    job, tl, t, _ = run(seconds=20, sched={0: 0.02, 1: 0.03, 2: 0.02, 3: 0.6})
    slow_link = Finding(kind="slow", cls="comm-slow", ranks=[1, 3], link=[1, 3], comm="job/gloo:0", seq=-1,
                        op="allreduce", onset_at=t - 10, detected_at=t, job="job",
                        evidence={"slowdown": 3.5, "localised_by": "rtt"})
    monkeypatch.setattr(commslow, "find_comm_slow", lambda tl_, now: [slow_link])
    (f,) = held(Diagnoser(tl), t)
    assert (f.cls, f.ranks, f.link) == ("comp-slow", [3], None)
    assert f.evidence["reason"] == "cpu-contended-inside" and f.evidence["link"] == [1, 3]
    assert f.evidence["comm_slow"]["localised_by"] == "rtt" and f.evidence["ranks"][0]["cause"] == "cpu-contended"
    # every rank equally contended (a busy host): the link finding stands
    job, tl, t, _ = run(seconds=20, sched={r: 0.4 for r in range(4)})
    assert [g.cls for g in held(Diagnoser(tl), t)] == ["comm-slow"]


def test_a_late_cpu_contended_rank_whose_own_link_is_slow_is_one_comp_slow(monkeypatch):
    # rank 2 is late and waits for a CPU far more than the others; the link localiser sees its link
    # crawl too: one cause (its CPU), reported as its comp-slow with the link evidence, not mixed-slow
    job, tl, t, _ = run(seconds=20, late={2: 0.030}, sched={0: 0.05, 1: 0.05, 2: 0.5, 3: 0.05})
    monkeypatch.setattr(commslow, "find_comm_slow", lambda tl_, now: [
        Finding(kind="slow", cls="comm-slow", ranks=[1, 2], link=[1, 2], comm="job/gloo:0", seq=-1, op="allreduce",
                onset_at=now - 5, detected_at=now, job="job", evidence={"slowdown": 5.0})])
    (f,) = held(Diagnoser(tl), t)
    assert (f.cls, f.ranks) == ("comp-slow", [2]) and f.evidence["comm_slow_link"] == [1, 2]
    assert f.evidence["ranks"][0]["cause"] == "cpu-contended" and "transfers are slow too" in f.evidence["note"]
    # the same late rank and slow link, but its CPU no busier than the others': two things, mixed-slow
    job, tl, t, _ = run(seconds=20, late={2: 0.030}, sched={0: 0.05, 1: 0.05, 2: 0.05, 3: 0.05})
    (f,) = held(Diagnoser(tl), t)
    assert (f.cls, f.ranks, f.link) == ("mixed-slow", [1, 2], [1, 2])


def test_a_comm_slow_is_held_before_it_is_reported(monkeypatch):
    """A link that slows because one rank's CPU is starved shows in the link metrics first: comm-slow
    waits COMM_SLOW_HOLD_S, so the late rank's comp-slow (which folds the link in) comes first."""
    from ccld.diagnose import COMM_SLOW_HOLD_S
    job, tl, t, _ = run(seconds=20)
    monkeypatch.setattr(commslow, "find_comm_slow", lambda tl_, now: [
        Finding(kind="slow", cls="comm-slow", ranks=[0, 1], link=[0, 1], comm="job/gloo:0", seq=-1, op="allreduce",
                onset_at=now - 1, detected_at=now, job="job", evidence={"slowdown": 4.0})])
    d = Diagnoser(tl)
    assert d.find_slow(t) == [] and d.find_slow(t + COMM_SLOW_HOLD_S / 2) == []
    assert [f.cls for f in d.find_slow(t + COMM_SLOW_HOLD_S)] == ["comm-slow"]
