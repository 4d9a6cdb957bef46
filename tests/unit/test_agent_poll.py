"""The agent's drain period: every POLL_MS, and FAST_POLL_MS after a drain that took more than
FAST_SHARE of a ring buffer (a burst), back to POLL_MS once the drains are small again. The real agent
loop with a stand-in family (no eBPF); real ZeroMQ."""
import os
import subprocess
import threading
import time
import types

import pytest

from ccld.bpf import loader
from ccld.errors import CcldError
from ccld.tracer.agent import FAST_POLL_MS, FAST_SHARE, POLL_MS, Agent, drain_ms_from_env, poll_after

pytestmark = pytest.mark.unit


def test_poll_after_follows_the_fullest_ring_by_rate():
    assert POLL_MS > FAST_POLL_MS
    assert poll_after(0.0, POLL_MS) == POLL_MS
    assert poll_after(FAST_SHARE, POLL_MS) == POLL_MS  # at the bound: still the usual period
    assert poll_after(FAST_SHARE + 0.01, POLL_MS) == FAST_POLL_MS
    assert poll_after(1.0, POLL_MS) == FAST_POLL_MS
    # a burst that filled 40 % of a ring in 500 ms fills 10 % in the 125 ms after: still a burst
    assert poll_after(0.40 * FAST_POLL_MS / POLL_MS, FAST_POLL_MS) == FAST_POLL_MS
    # the same 10 % taking a whole period is no burst; nor is anything once the rate falls
    assert poll_after(0.10, POLL_MS) == POLL_MS
    assert poll_after(0.01, FAST_POLL_MS) == POLL_MS
    # a drain late by seconds (the loop held up) that still took a third of a ring: drain again soon
    assert poll_after(0.33, 5 * POLL_MS) == FAST_POLL_MS


def test_ring_share_is_records_times_slot_over_the_ring():
    fam = loader.Family(on_record=None)
    assert fam.ring_share(1000) == 0.0  # no ring buffer (not loaded, or a kernel family)
    fam.ring = types.SimpleNamespace(stride=208, data_size=16 << 20)
    assert fam.ring_share(0) == 0.0
    assert fam.ring_share(80_659) == pytest.approx(80_659 * 208 / (16 << 20))
    assert fam.ring_share(40_000) > FAST_SHARE > fam.ring_share(10_000)


class BurstyFamily(loader.Family):
    """A family whose ring buffer (16 MiB of 208-byte slots, gloo's) gets 80,000 records a second (40 %
    of the ring every 500 ms: a burst) for its first `burst` drains, then nothing; it notes when each
    drain came."""
    NAME = "bursty"

    def __init__(self, burst: int):
        super().__init__(on_record=None)
        self.ring = types.SimpleNamespace(stride=208, data_size=16 << 20)
        self.burst, self.times = burst, []
        self.lock = threading.Lock()

    def tick(self, now_ns):
        with self.lock:
            now = time.monotonic()
            since = now - self.times[-1] if self.times else POLL_MS / 1000
            self.times.append(now)
            return int(80_000 * since) if len(self.times) <= self.burst else 0


def test_the_loop_drains_sooner_while_a_burst_lasts_and_slows_after(monkeypatch):
    monkeypatch.delenv("CCLD_DRAIN_MS", raising=False)
    fam = BurstyFamily(burst=4)
    agent = Agent("tcp://127.0.0.1:9", pids=[os.getpid()], use_bpf=False, say=lambda s: None, time_service="off")
    try:
        agent.load()
        agent.families = [(fam, None)]
        agent.start()
        deadline = time.monotonic() + 15
        while len(fam.times) < 8 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        agent.stop()
    with fam.lock:
        t = list(fam.times)
    assert len(t) >= 8, t
    gaps = [b - a for a, b in zip(t, t[1:])]
    # after each drain of the burst, the fast period (the first gap also holds the agent's first /proc
    # scan: not judged; loose bounds for a loaded 2-CPU box); after the quiet ones, POLL_MS
    fast, slow = gaps[1:4], gaps[4:7]
    assert max(fast) < 0.9 * POLL_MS / 1000, gaps
    assert min(slow) > 0.8 * POLL_MS / 1000, gaps


def test_the_drain_period_can_be_set_and_a_bad_one_is_named(monkeypatch):
    monkeypatch.setenv("CCLD_DRAIN_MS", "250")
    assert drain_ms_from_env() == 250
    assert poll_after(0.9, 100, 100) == 100  # a period shorter than the fast one stays as it is
    for bad in ("fast", "0", "99999", "2.5"):
        monkeypatch.setenv("CCLD_DRAIN_MS", bad)
        with pytest.raises(CcldError, match="CCLD_DRAIN_MS"):
            Agent("tcp://127.0.0.1:9", pids=[os.getpid()], use_bpf=False, say=lambda s: None, time_service="off")
    monkeypatch.delenv("CCLD_DRAIN_MS")
    assert drain_ms_from_env() == POLL_MS


def test_a_stable_agent_walks_proc_for_ranks_only_after_a_new_pid_or_every_few_seconds(monkeypatch):
    from ccld.tracer import agent as agent_mod, discover
    agent = Agent("tcp://127.0.0.1:9", pids=[os.getpid()], use_bpf=False, say=lambda s: None, time_service="off")
    try:
        walks = []
        real = agent._candidates
        monkeypatch.setattr(agent, "_candidates", lambda: walks.append(1) or real())
        last = [1000]
        monkeypatch.setattr(discover, "last_pid", lambda proc="/proc": last[0])
        t = time.monotonic()
        agent._last_change = t - agent_mod.STABLE_S - 1  # the ranks' set has been stable

        def walked(at: float) -> bool:
            n = len(walks)
            agent._scan(at)
            return len(walks) > n
        # the first walk meets this test's process (no rank): it may still exec, so the next walks too
        assert walked(t) and walked(t + 1)
        assert not walked(t + 2) and not walked(t + 3)      # no pid given out since: nothing new to find
        last[0] += 1
        assert walked(t + 4) and not walked(t + 4.5)        # a process (or thread) was made
        assert walked(t + 4 + agent_mod.WALK_EVERY_S)       # an exec makes no pid: walked every few s
        last[0] = -1
        assert walked(t + 10) and walked(t + 10.5)          # loadavg unreadable: every scan, as before
        last[0] = 2000
        agent._last_change = t + 10                         # a rank came or went: not stable
        assert walked(t + 11) and walked(t + 11.2) and walked(t + 11.4)
    finally:
        agent.shipper.close()


def test_last_pid_moves_when_a_process_is_made(tmp_path):
    from ccld.tracer import discover
    before = discover.last_pid()
    assert before > 0
    subprocess.run(["true"], check=True)
    assert discover.last_pid() != before
    (tmp_path / "loadavg").write_text("0.50 0.40 0.30 2/345 67890\n")
    assert discover.last_pid(str(tmp_path)) == 67890
    (tmp_path / "loadavg").write_text("garbage")
    assert discover.last_pid(str(tmp_path)) == -1
    assert discover.last_pid(str(tmp_path / "nowhere")) == -1
