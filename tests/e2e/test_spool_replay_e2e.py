"""End to end: `ccld agent --spool` on a real 4-rank gloo job while its `ccld collector` is SIGKILLed
and restarted on the same store.

Within the spool's bound, the store must end with every collective event of every rank exactly once
(enter, start and end of seq 1..N: no gap, no duplicate), and the agent must say it replayed frames
and lost none. Beyond the bound (a 64 KiB spool, the collector away for seconds), the oldest frames
go, counted by the agent and reported to the collector, the rest arrive once, and the job runs on.
Every process carries the session's tag and is killed at teardown (fault_scenarios.Session).
Budget on 2 vCPUs: ~40-60 s a test (torchrun start, gloo probes compiled, the job's ~20 s).
"""
import collections
import re
import signal
import time

import pytest

from ccld import wire as ev
from ccld.store import read_store
from ccld.collector.timesvc import free_port_pair
from conftest import gloo_job_cmd
from test_collector_restart import CCLD, wait_for as wait_until
from test_deploy_e2e import procs  # noqa: F401  (the fixture: real eBPF and torch, or skip)
from test_run_e2e import wait_for

pytestmark = pytest.mark.e2e

STEPS = 601                  # prime: a lost or doubled collective cannot hide in a round number
OPS = "allreduce,broadcast,barrier"
START_TIMEOUT_S = 150.0      # torchrun + import torch + compiling the gloo probes, on 2 busy vCPUs
KIND = {"coll": "enter", "start": "start", "end": "end"}




def store_events(store, problems=None):
    """{(kind, rank): Counter(seq)} of every collective event in the store, the agent's latest loss
    counters, and the ranks' pids with gloo probes attached."""
    seen = collections.defaultdict(collections.Counter)
    loss, attached = {}, set()
    for _, frame in read_store(str(store), problems if problems is not None else []):
        b = ev.decode_batch(frame)
        for e in b.events:
            if e.KIND in KIND:
                seen[(e.KIND, e.rank)][e.seq] += 1
            elif e.KIND == "loss":
                loss = e.counters
            elif e.KIND == "probe" and e.family == "gloo" and e.ok:
                attached.add(e.pid)
    return seen, loss, attached


def start_collector(procs, name, port, store):
    p, log = procs.start(name, CCLD + ["collector", "--listen", f"tcp://127.0.0.1:{port}", "--store", str(store)])
    wait_for(log, r"listening on", 60, p)
    return p


def run_with_outage(procs, away_s, spool_max_mb=None):
    """Collector, job (held at its start), agent with a spool in tmp; release the job, SIGKILL the
    collector at step 100 of rank 0, restart it `away_s` later; the job ends; the agent and collector
    stop on SIGINT. Returns (store, agent log text, job log text, kill time, restart time)."""
    port, store, go = free_port_pair(), procs.tmp / "store", procs.tmp / "go"
    c1 = start_collector(procs, "collector-1", port, store)
    job, job_log = procs.start("job", gloo_job_cmd(4, "--steps", STEPS, "--ops", OPS, "--step-sleep-ms", 10,
                                                   "--progress-every", 25, "--wait-file", go))
    cmd = CCLD + ["agent", "--pid", str(job.pid), "--collector", f"tcp://127.0.0.1:{port}", "--probes", "gloo",
                  "--spool", str(procs.tmp / "spool")]
    if spool_max_mb is not None:
        cmd += ["--spool-max-mb", str(spool_max_mb)]
    agent, agent_log = procs.start("agent", cmd)
    wait_for(agent_log, r"ccld agent: tracing .*; spool " + re.escape(str(procs.tmp / "spool")), START_TIMEOUT_S, agent)
    assert wait_until(lambda: len(store_events(store)[2]) == 4, START_TIMEOUT_S), "gloo probes not on all 4 ranks"
    go.touch()
    wait_for(job_log, r"^rank 0 step 100 ", 60, job)
    c1.send_signal(signal.SIGKILL)
    t_kill = time.time()
    assert c1.wait(10) == -signal.SIGKILL
    time.sleep(away_s)
    c2 = start_collector(procs, "collector-2", port, store)
    t_back = time.time()
    assert job.wait(300) == 0, job_log.read_text()[-3000:]
    time.sleep(2)  # the last frames, and their acknowledgement
    agent.send_signal(signal.SIGINT)
    assert agent.wait(60) == 0, agent_log.read_text()[-3000:]
    c2.send_signal(signal.SIGINT)
    assert c2.wait(60) == 0
    return store, agent_log.read_text(), job_log.read_text(), t_kill, t_back


def shipped(agent_text):
    m = re.search(r"ccld agent: shipped (\d+) frames \((\d+) events\); replayed (\d+) after (\d+) collector "
                  r"restarts and (\d+) disconnects; lost (\d+) events \(queue (\d+), spool (\d+) frames\); "
                  r"(\d+) unacknowledged frames evicted", agent_text)
    assert m, agent_text[-3000:]
    keys = ("frames", "events", "replayed", "restarts", "disconnects", "lost", "queue", "spool_frames", "evicted")
    return dict(zip(keys, map(int, m.groups())))


def ops_done(job_text):
    """Collectives each rank says it ran: {rank: total}."""
    out = {}
    for rank, ops in re.findall(r"^rank (\d) done: \d+ steps, ops (\{.*\})$", job_text, re.M):
        out[int(rank)] = sum(int(n) for n in re.findall(r": (\d+)", ops))
    assert sorted(out) == [0, 1, 2, 3], job_text[-3000:]
    return out


def test_a_collector_killed_and_restarted_within_the_bound_loses_nothing_and_stores_each_event_once(procs):
    store, agent_text, job_text, _, _ = run_with_outage(procs, away_s=4.0)
    done = ops_done(job_text)
    problems = []
    seen, loss, _ = store_events(store, problems)
    assert {p.kind for p in problems} <= {"unclean-end", "torn-tail"}, problems  # the SIGKILL, said
    for rank in range(4):
        n = done[rank]
        assert n == 3 * STEPS
        for kind, what in KIND.items():
            got = seen[(kind, rank)]
            dup = {s: c for s, c in got.items() if c > 1}
            missing = sorted(set(range(1, n + 1)) - set(got))
            assert not dup and not missing, f"rank {rank} {what}: duplicated {dup}, missing {missing[:20]}"
            assert max(got) == n
    s = shipped(agent_text)
    assert s["restarts"] >= 1 and s["replayed"] > 0, s   # frames the killed collector had not flushed came again
    assert s["lost"] == s["queue"] == s["spool_frames"] == s["evicted"] == 0, s
    assert loss.get("spool_dropped_frames") == loss.get("queue_dropped") == loss.get("gloo_ringbuf_lost") == 0, loss


def test_an_outage_beyond_the_spool_bound_is_counted_and_the_job_runs_on(procs):
    store, agent_text, job_text, t_kill, t_back = run_with_outage(procs, away_s=8.0, spool_max_mb=0.0625)
    done = ops_done(job_text)
    seen, loss, _ = store_events(store)
    s = shipped(agent_text)
    assert s["spool_frames"] > 0 and s["lost"] > 0, s   # the oldest frames went, counted by the agent ...
    assert loss["spool_dropped_frames"] > 0 and loss["spool_dropped_events"] > 0, loss  # ... and reported
    for rank in range(4):
        got = seen[("coll", rank)]
        assert all(c == 1 for c in got.values())           # what arrived, arrived once
        assert max(got) == done[rank] == 3 * STEPS         # the newest got through
        assert len(got) < done[rank]                       # a part of the outage is gone
        held = sorted(set(range(1, done[rank] + 1)) - set(got))
        assert held == list(range(held[0], held[-1] + 1))  # one hole: the oldest of the outage, nothing after
    times = [float(t) for t in re.findall(r"^rank 0 step \d+ t ([\d.]+)$", job_text, re.M)]
    during = [t for t in times if t_kill <= t <= t_back]
    assert len(during) >= 2, "the job made no progress while the collector was away"
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert max(gaps) < 10, f"the job stalled {max(gaps):.1f} s"
