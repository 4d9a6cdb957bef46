"""NCCL's proxy progress per link (NetProgress, from ccld's profiler plugin): the timeline's table, the
stalled-link fault and the slow link found by network wait per step, on synthetic jobs sent as real frames."""
import pytest

from ccld import wire as ev
from ccld.diagnose import Diagnoser, commslow, hang, nccllinks
from ccld.timeline.timeline import Timeline
from ccld_synth import T0, SynthJob

pytestmark = pytest.mark.unit

COMM = "job/nccl:00000000c0ffee00"
STEP_BYTES = 1 << 19


class NcclJob(SynthJob):
    """A SynthJob whose communicator is an NCCL one with group ranks = global ranks + 0 (the world)
    reversed, so a mix-up of group and global ranks shows."""

    def __init__(self, world=4, nodes=2):
        super().__init__(world=world, nodes=nodes)
        self.comm = COMM
        self.group = {r: world - 1 - r for r in range(world)}   # global -> group rank
        self.glob = {g: r for r, g in self.group.items()}

    def announce(self, t, group_size=None):
        super().announce(t)
        for a in self.agents:  # replace the gloo CommInit SynthJob queued with NCCL's, group ranks reversed
            a.pending = [e for e in a.pending if not isinstance(e, ev.CommInit)]
        for r in range(self.world):
            self._put(r, ev.CommInit(pid=self.pid[r], rank=r, ts_ns=self.ts(r, t), backend="nccl", comm=COMM,
                                     group_rank=self.group[r], group_size=self.world, seq_source="library"))

    def progress(self, r, peer_global, send, t, steps=0, wait_s=0.0, in_flight=0, moved=None, gpu_wait_s=0.0):
        """Rank r's report for its link with peer_global over the interval ending at t."""
        self._put(r, ev.NetProgress(pid=self.pid[r], rank=r, ts_ns=self.ts(r, t), comm=COMM,
                                    peer=self.group[peer_global], send=send, channel=0, nbytes=steps * STEP_BYTES,
                                    steps=steps, net_wait_ns=int(wait_s * 1e9), gpu_wait_ns=int(gpu_wait_s * 1e9),
                                    in_flight=in_flight, last_ns=0 if moved is None else self.ts(r, moved)))

    def ring_progress(self, t, steps=4, wait_s=0.0004, slow=None, stalled=None, since=None):
        """Every rank reports its ring send to r+1 and receive from r-1 for the interval ending at t.
        `slow`: {(src, dst): network wait per step, s} for a crawling link; `stalled`: (src, dst)
        whose sender has 2 steps in flight that never complete (nothing moves after `since`)."""
        slow = slow or {}
        for r in range(self.world):
            nxt, prv = (r + 1) % self.world, (r - 1) % self.world
            if since is not None and t > since:  # after the stall: nothing completes anywhere
                self.progress(r, nxt, True, t, in_flight=2 if (r, nxt) == stalled else 0, moved=since)
                self.progress(r, prv, False, t, in_flight=2, moved=since)
                continue
            w = slow.get((r, nxt), wait_s)
            self.progress(r, nxt, True, t, steps=steps, wait_s=w * steps, moved=t - 0.01)
            self.progress(r, prv, False, t, steps=steps, wait_s=w * steps, moved=t - 0.01)


def new_job():
    tl, job = Timeline(), NcclJob()
    job.announce(T0)
    job.feed(tl, T0)
    return tl, job


def test_reports_sum_per_directed_link_in_global_ranks_where_the_finding_is_made():
    tl, job = new_job()
    job.progress(0, 1, True, T0 + 1, steps=4, wait_s=0.002, in_flight=1, moved=T0 + 0.99)
    job.progress(0, 1, True, T0 + 1.1, steps=2, wait_s=0.001, in_flight=3, moved=T0 + 1.09)
    job.progress(1, 0, False, T0 + 1.1, steps=6, wait_s=0.0, in_flight=1, moved=T0 + 1.05)
    job.feed(tl, T0 + 1.2)
    links = tl.progress.links_of(COMM)
    src, dst = job.group[0], job.group[1]
    assert set(links) == {(src, dst)}  # both ends' reports land on one directed link (group ranks)
    lp = links[(src, dst)]
    assert (lp.tx_bytes, lp.tx_steps, lp.rx_steps) == (6 * STEP_BYTES, 6, 6)
    assert lp.tx_in_flight == 3 and lp.rx_in_flight == 1  # the latest report per side, not a sum of reports
    assert lp.net_wait_s == pytest.approx(0.003)
    assert lp.last_moved == pytest.approx(T0 + 1.09, abs=1e-6)
    w = tl.progress.window(COMM, T0 + 1.05, T0 + 1.2)[(src, dst)]
    assert (w.steps, w.reports) == (2, 1)


def test_a_report_about_oneself_is_an_anomaly_not_a_link():
    tl, job = new_job()
    job.progress(2, 2, True, T0 + 1, steps=1)
    job.feed(tl, T0 + 1.1)
    assert tl.progress.links_of(COMM) == {} and tl.anomalies["net-progress-bad-peer"] == 1


def stalled_job(stalled=(1, 2)):
    tl, job = new_job()
    t, seq = T0 + 1, 0
    while t < T0 + 21:
        job.collective(seq, t, dur=0.003)
        job.ring_progress(t + 0.05)
        seq, t = seq + 1, t + 0.1
        if seq % 10 == 0:
            job.feed(tl, t)
    onset = t
    job.collective(seq, onset, finish=False)  # everyone enters, nobody finishes
    for i in range(1, 80):
        job.ring_progress(onset + 0.1 * i, stalled=stalled, since=onset + 0.01)
    now = onset + 8
    job.feed(tl, now)
    return tl, now


def test_a_hang_where_one_senders_steps_never_complete_is_that_link():
    tl, now = stalled_job(stalled=(1, 2))
    hangs = hang.find_hangs(tl, now)
    assert [h.evidence["reason"] for h in hangs] == ["not-finished"]
    (f,) = nccllinks.find_proxy_faults(tl, now, hangs)
    assert (f.kind, f.cls, f.ranks, f.link) == ("hang", "fault", [1, 2], [1, 2])
    assert f.evidence["reason"] == "proxy-stalled" and f.evidence["stalled"][0]["tx_in_flight"] == 2
    assert f.evidence["links_reporting"] == 4
    # The facade puts it in place of the hang it explains.
    found = Diagnoser(tl).find_hangs(now)
    assert [(x.cls, x.ranks, x.link) for x in found] == [("fault", [1, 2], [1, 2])]


def test_a_hang_with_no_sender_in_flight_names_no_link():
    tl, now = stalled_job(stalled=None)
    hangs = hang.find_hangs(tl, now)
    assert nccllinks.find_proxy_faults(tl, now, hangs) == []
    assert Diagnoser(tl).find_hangs(now)[0].evidence["reason"] == "not-finished"


def slow_job(slow=None, slow_dur=0.060, healthy_s=30.0, slow_s=12.0):
    tl, job = new_job()
    t, seq = T0 + 1, 0
    while t < T0 + 1 + healthy_s:
        job.collective(seq, t, dur=0.003)
        job.ring_progress(t + 0.003)
        seq, t = seq + 1, t + 0.1
        if seq % 20 == 0:
            job.feed(tl, t)
    stop = t + slow_s
    while t < stop:
        job.collective(seq, t, dur=slow_dur)
        job.ring_progress(t + slow_dur, slow=slow)
        seq, t = seq + 1, t + 0.1 + slow_dur
        if seq % 5 == 0:
            job.feed(tl, t)
    job.feed(tl, t)
    return tl, t


def test_a_crawling_nccl_link_is_named_by_its_network_wait_per_step():
    tl, now = slow_job(slow={(2, 3): 0.014})
    (f,) = commslow.find_comm_slow(tl, now)
    assert (f.cls, f.ranks, f.link) == ("comm-slow", [2, 3], [2, 3])
    assert f.evidence["localised_by"] == "nccl-proxy"
    assert f.evidence["nccl_links"]["2->3"]["x"] >= nccllinks.WAIT_FACTOR
    assert "network" in f.evidence["summary"]


def test_every_link_waiting_longer_alike_names_none():
    tl, now = slow_job(slow={(r, (r + 1) % 4): 0.014 for r in range(4)})
    (f,) = commslow.find_comm_slow(tl, now)
    assert f.ranks == [] and f.link is None and f.evidence["localised_by"] is None
