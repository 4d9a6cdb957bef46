"""The timeline joins 4 ranks on 2 nodes (own monotonic epochs) into collectives, with exact counts."""
import pytest

from ccld import wire as ev
from ccld.timeline import comms
from ccld.timeline.timeline import Timeline

from ccld_synth import T0, FakeAgent, SynthJob

pytestmark = pytest.mark.unit


def healthy(n=23):
    job, tl = SynthJob(), Timeline()
    job.announce(T0)
    end = job.steps(1, n, T0 + 1, period=0.1, spread=0.004, dur=0.002)
    job.feed(tl, end + 0.05)
    return job, tl


def test_matching_across_4_ranks_and_2_clocks():
    job, tl = healthy()
    comm = tl.comms["job/gloo:0"]
    assert comm.backend == "gloo" and comm.group_size == 4 and comm.job == "job"
    assert comm.members == {0, 1, 2, 3} and tl.expected_members("job/gloo:0") == {0, 1, 2, 3}
    assert sorted(comm.colls) == list(range(1, 24)) and comm.max_seq == 23 and comm.completed == 23
    v = comm.colls[5]
    t = T0 + 1 + 4 * 0.1
    # ranks 0,1 are on node0 and 2,3 on node1, whose monotonic clocks differ by 1000 s: all joined
    for r in range(4):
        assert v.enter[r] == pytest.approx(t + 0.004 * r / 3, abs=1e-5)
        assert v.start[r] == pytest.approx(t + 0.004, abs=1e-5)
        assert v.end[r] == pytest.approx(t + 0.006, abs=1e-5)
    assert v.op == "allreduce" and v.ops == {r: "allreduce" for r in range(4)}
    assert v.completed_at == pytest.approx(t + 0.006, abs=1e-5)
    assert v.last_enter() - v.first_enter() == pytest.approx(0.004, abs=1e-5)
    assert tl.recent_peaks("job/gloo:0", T0 + 10) == (pytest.approx(0.004, abs=1e-5), pytest.approx(0.002, abs=1e-5))


def test_exact_counts():
    job, tl = healthy(23)
    for r in range(4):
        assert tl.enter_counts[(r, "allreduce")] == 23
        assert tl.end_counts[(r, "allreduce")] == 23
    assert sum(tl.enter_counts.values()) == 92 and sum(tl.end_counts.values()) == 92
    assert tl.events_by_kind["coll"] == 92 and tl.events_by_kind["end"] == 92
    assert tl.events_by_kind["rank"] == 4 and tl.events_by_kind["clock"] == 2
    assert not tl.anomalies


def test_ranks_and_proc_state():
    job, tl = SynthJob(), Timeline()
    job.announce(T0)
    job.state(2, T0 + 1, "R", "", cpu_ns=1_000_000_000)
    job.state(2, T0 + 3, "S", "hrtimer_nanosleep", cpu_ns=1_500_000_000)
    job.exit(3, T0 + 4)
    job.feed(tl, T0 + 5)
    rec = tl.rank_record("job", 2)
    assert (rec.node, rec.pid, rec.rank, rec.world_size, rec.job) == ("node1", 1002, 2, 4, "job")
    assert (rec.state, rec.wchan, rec.cpu_ns) == ("S", "hrtimer_nanosleep", 1_500_000_000)
    assert rec.state_at == pytest.approx(T0 + 3, abs=1e-5)
    assert rec.cpu_busy == pytest.approx(0.25, abs=1e-4)
    assert tl.rank_record("job", 3).exited_at == pytest.approx(T0 + 4, abs=1e-5)
    assert tl.rank_record("job", 3).exited() and not rec.exited()
    assert tl.jobs == {"job": 4}
    assert tl.agent_silent_s("agent-1", T0 + 7) == pytest.approx(2.0)


def test_p2p_probe_and_loss():
    job, tl = SynthJob(), Timeline()
    job.announce(T0)
    a = job.agent_of[0]
    a.pending += [ev.P2P(pid=1000, rank=0, ts_ns=a.mono(T0 + 1), backend="gloo", comm=job.comm, op="send", peer=1)
                  for _ in range(5)]
    a.pending.append(ev.ProbeStatus(pid=1000, family="gloo", ok=False, ts_ns=a.mono(T0), message="no symbol"))
    a.pending.append(ev.LossCounters(ts_ns=a.mono(T0 + 1), counters={"ringbuf_lost": 2}))
    a.pending.append(ev.LossCounters(ts_ns=a.mono(T0 + 2), counters={"ringbuf_lost": 7}))
    job.feed(tl, T0 + 3)
    assert tl.p2p_counts == {(0, "send"): 5}
    assert tl.rank_record("job", 0).last_p2p[:2] == ("send", 1)
    assert tl.probes[("node0", 1000, "gloo")]["ok"] is False
    assert tl.agent_loss == {"agent-0": {"ringbuf_lost": 7}}  # cumulative: latest wins


def test_odd_events_are_counted_never_fatal():
    job, tl = SynthJob(), Timeline()
    job.announce(T0)
    job.end(1, 9, T0 + 1)                       # end without enter
    job.start(1, 10, T0 + 1)                    # start without enter
    job.enter(0, 5, T0 + 1)
    job.enter(0, 5, T0 + 1.1)                   # duplicate enter
    a = job.agent_of[0]
    a.pending.append(ev.CollEnter(pid=4242, rank=0, ts_ns=a.mono(T0), backend="gloo", comm="other/gloo:0",
                                  seq=1, op="barrier"))   # a pid no RankInfo announced
    a.pending.append(ev.CollEnter(pid=4243, rank=-1, ts_ns=a.mono(T0), backend="gloo", comm="x", seq=1, op="x"))
    job.feed(tl, T0 + 2)
    an = tl.anomalies
    assert an["end-without-enter"] == 1 and an["start-without-enter"] == 1 and an["duplicate-enter"] == 1
    assert an["unknown-pid"] == 2 and an["no-rank"] == 1
    assert tl.enter_counts[(0, "allreduce")] == 1  # the duplicate is not counted twice
    assert tl.comms["other/gloo:0"].colls[1].enter  # still recorded under the rank the event names


def test_implausible_world_size_is_refused():
    job, tl = SynthJob(world=1, nodes=1), Timeline()
    a = job.agents[0]
    a.pending.append(ev.RankInfo(pid=9, rank=0, world_size=10**12, local_rank=0, node="node0", job="j",
                                 ts_ns=a.mono(T0)))
    job.feed(tl, T0)
    assert tl.anomalies["bad-world-size"] == 1 and "j" not in tl.jobs


def test_events_before_first_clock_sample_wait_for_it():
    tl = Timeline()
    a = FakeAgent("a", "n", boot_unix=T0 - 50)
    early = ev.RankInfo(pid=1, rank=0, world_size=1, local_rank=0, node="n", job="j", ts_ns=a.mono(T0))
    tl.ingest(ev.decode_batch(ev.encode_batch("a", "n", 1, [early])), T0)  # no clock sample in this frame
    assert not tl.ranks and tl.counters()["pending_no_clock"] == 1
    tl.ingest(ev.decode_batch(a.frame(T0 + 1, [])), T0 + 1)
    assert tl.rank_record("j", 0).last_event_at == pytest.approx(T0, abs=1e-5)


def test_batch_gaps_are_counted():
    job, tl = SynthJob(nodes=1), Timeline()
    a = job.agents[0]
    tl.ingest(ev.decode_batch(a.frame(T0, [])), T0)
    a.batch_no += 3  # three frames lost in transit
    tl.ingest(ev.decode_batch(a.frame(T0 + 1, [])), T0 + 1)
    assert tl.anomalies["batch-gap"] == 3


def test_subgroup_members_and_unknown_group_size():
    job, tl = SynthJob(), Timeline()
    job.announce(T0, group_size=-1)  # attached after init: size unknown -> whole world expected
    for r in (1, 3):
        a = job.agent_of[r]
        a.pending.append(ev.CommInit(pid=job.pid[r], rank=r, ts_ns=a.mono(T0), backend="gloo", comm="job/gloo:1",
                                     group_rank=r // 2, group_size=2))
    job.feed(tl, T0 + 1)
    assert tl.expected_members("job/gloo:0") == {0, 1, 2, 3}
    assert tl.expected_members("job/gloo:1") == {1, 3}


def test_collectives_per_comm_are_bounded(monkeypatch):
    monkeypatch.setattr(comms, "MAX_COLLS_PER_COMM", 10)
    job, tl = SynthJob(), Timeline()
    job.announce(T0)
    for seq in range(1, 31):  # shipped as they happen: agents are never 10 collectives apart
        job.feed(tl, job.collective(seq, T0 + 1 + seq * 0.01))
    comm = tl.comms[job.comm]
    assert sorted(comm.colls) == list(range(21, 31)) and comm.evicted_upto == 20
    job.end(0, 3, T0 + 2.5)  # a late event for an evicted collective
    job.feed(tl, T0 + 3)
    assert tl.anomalies["late-event"] == 1 and 3 not in comm.colls


def test_big_groups_keep_fewer_collectives(monkeypatch):
    # A collective holds an entry per member: the bound is on entries, so 16 ranks keep 64 / 16 = 4.
    monkeypatch.setattr(comms, "MAX_RANK_ENTRIES_PER_COMM", 64)
    monkeypatch.setattr(comms, "MIN_COLLS_PER_COMM", 2)
    job, tl = SynthJob(world=16, nodes=2), Timeline()
    job.announce(T0)
    for seq in range(1, 21):
        job.feed(tl, job.collective(seq, T0 + 1 + seq * 0.01))
    assert sorted(tl.comms[job.comm].colls) == [17, 18, 19, 20]


def test_restarted_rank_resets_its_comm():
    job, tl = SynthJob(), Timeline()
    job.announce(T0)
    job.steps(1, 5, T0 + 1)
    job.feed(tl, T0 + 2)
    job.pid = {r: 2000 + r for r in range(4)}  # torchrun restarted every rank: new pids, seq from 1 again
    job.announce(T0 + 3)
    job.steps(1, 2, T0 + 4)
    job.feed(tl, T0 + 5)
    comm = tl.comms[job.comm]
    assert comm.resets == 1 and sorted(comm.colls) == [1, 2] and comm.max_seq == 2
    assert tl.rank_record("job", 2).pid == 2002


def test_a_rank_of_an_unknown_job_is_found_when_one_job_has_it():
    job, tl = healthy(3)
    assert tl.rank_record("", 2) is tl.rank_record("job", 2) is not None
    other = SynthJob(job="other")
    other.pid = {r: 2000 + r for r in range(4)}
    other.announce(T0 + 5)
    other.feed(tl, T0 + 6)
    assert tl.rank_record("other", 2) is not tl.rank_record("job", 2)
    assert tl.rank_record("", 2) is None  # two jobs have a rank 2: not guessed
    assert tl.rank_record("", 7) is None
