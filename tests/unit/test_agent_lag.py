"""An agent whose heartbeats come but whose ranks' records do not (its drain stalled, or the node or
the collector was frozen for seconds): its ranks are not judged until its records catch up, because
until then "not entered" and "not yet delivered" look the same. The horizon is the agent's latest
RankState (the agent sends one per rank every scan, after the drain before it: tracer/agent.py)."""
import time

import pytest

from ccld import wire as ev
from ccld.collector.server import Collector
from ccld.diagnose import Diagnoser, hang
from ccld.timeline.timeline import Timeline
from ccld_synth import T0, SynthJob

pytestmark = pytest.mark.unit


def scans(job, tl, t0, n, ranks=range(4), every=1.0):
    """n scans of the agents, `every` s apart from t0, each a RankState per rank and a frame of each
    agent received right after; returns the time of the last."""
    t = t0
    for i in range(n):
        t = t0 + i * every
        for r in ranks:
            job.state(r, t, "S", "futex_wait_queue")
        job.feed(tl, t + 0.05)
    return t


def healthy(job, tl):
    """56 healthy collectives with the agents scanning each second, then ranks 0 and 1 (agent-0)
    enter collective 57; returns the time they did."""
    job.announce(T0)
    end = job.steps(1, 56, T0 + 1, period=0.1)
    for i in range(6):  # scans during the healthy steps
        for r in range(4):
            job.state(r, T0 + 1 + i, "S", "futex_wait_queue")
    job.feed(tl, end + 0.01)
    t = end + 0.1
    for r in (0, 1):
        job.enter(r, 57, t)
    job.feed(tl, t + 0.05)
    return t


def heartbeat(job, tl, agent, t):
    a = job.agents[agent]
    tl.ingest(ev.decode_batch(a.frame(t, events=[])), t)  # a clock sample only: the shipper's thread


def test_a_lagging_agents_ranks_are_not_judged_until_its_records_come():
    job, tl = SynthJob(), Timeline()
    t = healthy(job, tl)
    # ranks 2 and 3 entered too, but agent-1's records of it (and its scans) are held for 10 s;
    # agent-0 scans on, and agent-1's shipper keeps sending heartbeats
    for r in (2, 3):
        job.enter(r, 57, t + 0.01)
    held = job.agents[1].pending
    job.agents[1].pending = []
    for i in range(1, 11):
        for r in (0, 1):
            job.state(r, t + i, "S", "futex_wait_queue")
        tl.ingest(ev.decode_batch(job.agents[0].frame(t + i + 0.05)), t + i + 0.05)
        heartbeat(job, tl, 1, t + i + 0.05)
        assert tl.agent_is_lagging("agent-1", t + i + 0.1, 3.0) == (i >= 3)
        assert hang.check_all(tl, t + i + 0.1) == [], i  # without the horizon: not-entered [2, 3] from 5 s
    assert not tl.agent_is_lagging("agent-0", t + 10.1, 3.0)
    # the records come: the collective had every rank; it finishes; nothing is or was hung
    job.agents[1].pending = held
    for r in range(4):
        job.start(r, 57, t + 10.2)
        job.end(r, 57, t + 10.21)
    for r in (2, 3):
        job.state(r, t + 10.3, "S", "futex_wait_queue")
    job.feed(tl, t + 10.35)
    assert not tl.agent_is_lagging("agent-1", t + 10.4, 3.0)
    assert hang.check_all(tl, t + 10.4) == []


def test_a_rank_that_never_enters_is_still_named_while_its_agent_scans():
    job, tl = SynthJob(), Timeline()
    t = healthy(job, tl)
    job.enter(3, 57, t + 0.01)  # rank 2 never enters; both agents scan every second
    last = scans(job, tl, t + 1, 8)
    assert not tl.agent_is_lagging("agent-1", last + 0.1, 3.0)
    (f,) = Diagnoser(tl).find_hangs(last + 0.1)
    assert (f.cls, f.ranks) == ("not-entered", [2])


def test_a_source_without_a_scan_cadence_is_never_lagging():
    # one RankState per rank (a synthetic or imported source): no cadence, so no horizon is inferred
    job, tl = SynthJob(), Timeline()
    t = healthy(job, tl)
    heartbeat(job, tl, 0, t + 30)
    tl2 = Timeline()
    job2 = SynthJob()
    job2.announce(T0)
    for r in range(4):
        job2.state(r, T0 + 1, "R")
    job2.feed(tl2, T0 + 1.05)
    assert tl2.agent_lag_s("agent-0", T0 + 60) == pytest.approx(59.0)
    assert not tl2.agent_is_lagging("agent-0", T0 + 60, 3.0)
    assert tl.agent_is_lagging("agent-0", t + 30, 3.0)  # the same rule, with a cadence seen


def test_the_collector_says_when_an_agent_lags_and_when_it_caught_up():
    lines = []
    col = Collector(listen="tcp://127.0.0.1:*", on_line=lines.append)
    try:
        now = time.time()
        job = SynthJob(t0=now - 30)
        job.announce(now - 25)
        scans(job, col.timeline, now - 20, 5)  # scans at -20 .. -16: agent-1 then falls silent on records
        for i in range(15):
            job.state(0, now - 15 + i, "S")
            job.state(1, now - 15 + i, "S")
            col.timeline.ingest(ev.decode_batch(job.agents[0].frame(now - 15 + i)), now - 15 + i)
            heartbeat(job, col.timeline, 1, now - 15 + i + 0.5)
        col.tick(now)
        lagging = [x for x in lines if "agent-1" in x and "behind" in x]
        assert len(lagging) == 1 and "hang detection for its ranks is paused" in lagging[0], lines
        assert not any("agent-0" in x for x in lines), lines
        scans(job, col.timeline, now + 0.5, 1)
        col.tick(now + 0.6)
        assert [x for x in lines if "caught up" in x] == ["ccld: agent agent-1 has caught up"], lines
    finally:
        col.stop()


def test_an_agent_whose_ranks_all_exited_is_not_lagging():
    # the job ended: its ranks' exits came, and no RankState is due any more
    job, tl = SynthJob(), Timeline()
    t = healthy(job, tl)
    last = scans(job, tl, t + 1, 4)
    for r in (2, 3):
        job.exit(r, last + 0.5)
    job.feed(tl, last + 0.55)
    for i in range(1, 20):
        heartbeat(job, tl, 1, last + 0.55 + i)
    assert not tl.agent_is_lagging("agent-1", last + 20, 3.0)
    assert tl.agent_is_lagging("agent-0", last + 20, 3.0)  # its ranks 0 and 1 are alive, and silent on records
    job.state(2, last + 21, "R")  # a rank of that agent again (a restart): lagging is judged again
    job.exit(2, last + 21.1)
    job.feed(tl, last + 21.2)
    assert not tl.agent_is_lagging("agent-1", last + 40, 3.0)
