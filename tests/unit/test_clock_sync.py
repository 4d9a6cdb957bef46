"""The collector's conversion with round-trip estimates (ClockSync) and its refinement from the job's
collectives (ranks leave one collective together), and the helpers detectors use."""
import random

import pytest

from ccld import wire as ev
from ccld.timeline import clockrefine
from ccld.timeline.clock import (WALL_UNCERTAINTY_NS, ClockTable, clock_evidence, format_clock_lines,
                                  ranks_clock_evidence)
from ccld.timeline.timeline import Timeline

pytestmark = pytest.mark.unit

UNIX = 1_764_400_000_000_000_000


def sync(offset_ns, ref_ns=0, drift_ppb=0, unc=50_000, ts_ns=None, samples=30):
    return ev.ClockSync(ts_ns=ref_ns if ts_ns is None else ts_ns, ref_ns=ref_ns, offset_ns=offset_ns,
                        drift_ppb=drift_ppb, uncertainty_ns=unc, rtt_min_ns=2 * unc, samples=samples, epoch=1)


def test_a_round_trip_estimate_replaces_the_wall_pair_and_follows_the_drift():
    c = ClockTable()
    c.update("a", mono_ns=10_000_000_000, wall_ns=UNIX + 3_000_000_000)  # a wall clock 3 s off
    assert c.source("a") == "wall" and c.uncertainty_ns("a") == WALL_UNCERTAINTY_NS
    assert c.update_sync("a", sync(UNIX - 10_000_000_000, ref_ns=20_000_000_000, drift_ppb=-30_000, unc=40_000))
    assert c.source("a") == "sync" and c.uncertainty_s("a") == pytest.approx(40e-6)
    # at ref: offset; 100 s later: 3 ms less (-30 ppm)
    assert c.to_unix_ns("a", 20_000_000_000) == UNIX + 10_000_000_000
    assert c.to_unix_ns("a", 120_000_000_000) == UNIX + 110_000_000_000 - 3_000_000
    o = c.offset("a")
    assert (o.source, o.drift_ppb, o.uncertainty_ns) == ("sync", -30_000, 40_000)
    assert o.offset_ns == c.to_unix_ns("a", o.sampled_mono_ns) - o.sampled_mono_ns


def test_a_clock_sync_alone_is_enough_to_convert_and_bad_ones_are_counted():
    c = ClockTable()
    assert c.update_event("a", sync(UNIX))
    assert c.has("a") and c.to_unix("a", 1_000) == pytest.approx((UNIX + 1_000) / 1e9)
    assert not c.update_sync("b", sync(UNIX, unc=-1))
    assert not c.update_sync("b", sync(UNIX, drift_ppb=2_000_000))
    assert c.rejected == 2 and not c.has("b")


def test_pair_uncertainty_and_evidence():
    c = ClockTable()
    c.update_sync("a", sync(UNIX, unc=30_000))
    c.update_sync("b", sync(UNIX, unc=50_000))
    assert c.pair_uncertainty_s("a", "a") == 0.0  # one node, one clock
    assert c.pair_uncertainty_s("a", "b") == pytest.approx(80e-6)
    assert clock_evidence(c, ["a", "b"], 50e-6) == {"clock_uncertainty_s": 8e-05, "below_clock_uncertainty": True}
    assert clock_evidence(c, ["a", "b"], 2e-3) == {"clock_uncertainty_s": 8e-05}
    assert clock_evidence(c, ["a", "a"], 1e-9) == {"clock_uncertainty_s": 0.0}


class Job:
    """Three nodes x two ranks; true end times equal to within `spread_ns`; each node's round-trip
    estimate off by err_ns[node] (what the refinement has to find)."""

    def __init__(self, err_ns, unc_ns, wall=()):
        self.err, self.unc = err_ns, unc_ns
        self.tl = Timeline()
        self.clock = self.tl.clock
        self.boot = {a: 1_000_000_000_000 * (i + 1) for i, a in enumerate(err_ns)}  # node epochs differ
        for a in err_ns:
            if a in wall:  # no time service: the wall pair, err_ns off
                self.clock.update(a, 0, UNIX - self.boot[a] + err_ns[a])
            else:
                self.clock.update_sync(a, sync(UNIX - self.boot[a] + err_ns[a], unc=unc_ns[a]))
        self.rng = random.Random(5)

    def mono(self, a, t_true):
        return t_true - UNIX + self.boot[a]

    def collective(self, seq, t_true, spread_ns=3_000, late=None):
        for a in self.err:
            for r in range(2):
                t = t_true + self.rng.randint(0, spread_ns)
                if late == a and r == 0:
                    t += 5_000_000  # a rank descheduled at the end: 5 ms late to leave
                self.clock.observe_end(a, ev.WorkEnd(pid=r, rank=r, ts_ns=self.mono(a, t), comm="j/gloo:0", seq=seq))

    def error_ns(self, a, t_true):
        return self.clock.to_unix_ns(a, self.mono(a, t_true)) - t_true


def test_collectives_align_the_nodes_within_the_round_trip_bounds():
    job = Job({"n0": 30_000, "n1": -20_000, "n2": 5_000}, {"n0": 60_000, "n1": 60_000, "n2": 60_000})
    for seq in range(400):
        job.collective(seq, UNIX + seq * 10_000_000, late=["n1", None, None, "n2", None][seq % 5])
    t = UNIX + 4_000_000_000
    errs = {a: job.error_ns(a, t) for a in job.err}
    # relative: the nodes now agree to a few us (they were 50 us apart), stragglers notwithstanding
    assert max(errs.values()) - min(errs.values()) < 6_000, errs
    # absolute: the common part is the weighted mean of the round trips' errors (+5 us here)
    assert all(abs(e - 5_000) < 6_000 for e in errs.values()), errs
    s = job.clock.summary()
    assert all(d["source"] == "sync+job" and d["job_collectives"] >= clockrefine.MIN_GROUPS for d in s.values())
    assert job.clock.pair_uncertainty_s("n0", "n1") < 30e-6  # relative, from the job: tighter than 120 us
    assert all(job.clock.uncertainty_ns(a) <= 60_000 for a in job.err)


def test_a_correction_never_leaves_the_round_trip_bound():
    # n1's path is so asymmetric that its estimate is 300 us off while claiming +-100 us
    job = Job({"n0": 0, "n1": 300_000, "n2": 0}, {"n0": 100_000, "n1": 100_000, "n2": 100_000})
    for seq in range(200):
        job.collective(seq, UNIX + seq * 10_000_000)
    corr = job.clock.summary()["n1"]
    assert corr["job_clamped"] and abs(corr["job_correction_ns"]) <= 100_000


def test_a_node_without_time_service_is_aligned_by_the_job():
    job = Job({"n0": 0, "n1": 2_000_000_000, "n2": -3_000}, {"n0": 40_000, "n1": 40_000, "n2": 40_000},
              wall=("n1",))
    for seq in range(200):
        job.collective(seq, UNIX + seq * 10_000_000)
    t = UNIX + 2_000_000_000
    assert abs(job.error_ns("n1", t)) < 30_000  # was 2 s off
    assert job.clock.source("n1") == "wall"


def test_few_shared_collectives_change_nothing():
    job = Job({"n0": 30_000, "n1": -20_000, "n2": 0}, {"n0": 60_000, "n1": 60_000, "n2": 60_000})
    for seq in range(clockrefine.SETTLE_GROUPS + clockrefine.MIN_GROUPS - 5):
        job.collective(seq, UNIX + seq * 10_000_000)
    assert job.error_ns("n0", UNIX) == 30_000 and job.clock.source("n0") == "sync"


def test_the_timeline_converts_with_the_estimate_and_feeds_the_refinement():
    tl = Timeline()
    boots = {"a0": 10**12, "a1": 2 * 10**12}
    t0 = UNIX + 100 * 10**9
    for i, (agent, boot) in enumerate(boots.items()):
        # each frame: the estimate first, then the events, then a wall pair that is 3 s off
        evs = [sync(UNIX - boot, ref_ns=boot, unc=20_000),
               ev.RankInfo(pid=10 + i, rank=i, world_size=2, local_rank=0, node=f"n{i}", job="j",
                           ts_ns=t0 - UNIX + boot),
               ev.CollEnter(pid=10 + i, rank=i, ts_ns=t0 - UNIX + boot + i * 1_000_000, backend="gloo",
                            comm="j/gloo:0", seq=1, op="allreduce"),
               ev.WorkEnd(pid=10 + i, rank=i, ts_ns=t0 - UNIX + boot + 5_000_000, comm="j/gloo:0", seq=1),
               ev.ClockSample(mono_ns=boot, wall_ns=UNIX + 3_000_000_000, ts_ns=boot)]
        tl.ingest(ev.decode_batch(ev.encode_batch(agent, f"n{i}", 1, evs)), t0 / 1e9)
    view = tl.comms["j/gloo:0"].colls[1]
    assert view.enter[1] - view.enter[0] == pytest.approx(1e-3, abs=1e-6)  # the estimate, not the 3 s wall pair
    assert view.enter[0] == pytest.approx(t0 / 1e9, abs=1e-6)
    assert ("j/gloo:0", 1) in tl.clock.refiner.groups  # a synchronization point, waiting to be read
    c = tl.counters()["clock"]
    assert c["a0"]["source"] == "sync" and c["a0"]["uncertainty_us"] == 20.0
    assert ranks_clock_evidence(tl, "j", [0, 1], 30e-6)["below_clock_uncertainty"] is True


def test_diagnose_lines():
    job = Job({"n0": 10_000, "n1": -10_000, "n2": 0}, {"n0": 60_000, "n1": 60_000, "n2": 60_000})
    for seq in range(200):
        job.collective(seq, UNIX + seq * 10_000_000)
    job.clock.update("w", 5, UNIX)
    lines = format_clock_lines(job.clock.summary())
    assert len(lines) == 4
    assert lines[0].startswith("clock n0: sync+job ") and " +0.00 ppm +-" in lines[0], lines
    assert "(rtt 120 us; job " in lines[0] and " over " in lines[0]
    assert lines[3].startswith("clock w: wall ") and lines[3].endswith("+-1000 us")
    assert all(len(ln) <= 100 for ln in lines)


def test_a_noisy_job_barely_moves_a_good_round_trip_estimate():
    # ranks leave collectives milliseconds apart (busy CPUs): the job's word is weak, the round trips' strong
    job = Job({"n0": 10_000, "n1": -10_000, "n2": 0}, {"n0": 40_000, "n1": 40_000, "n2": 40_000})
    for seq in range(600):
        job.collective(seq, UNIX + seq * 10_000_000, spread_ns=3_000_000)
    t = UNIX + 6_000_000_000
    errs = {a: job.error_ns(a, t) for a in job.err}
    assert all(abs(e) <= 12_000 for e in errs.values()), errs  # no worse than before (10 us)
    assert job.clock.source("n0") == "sync+job"
    assert all(job.clock.uncertainty_ns(a) <= 40_000 for a in job.err)


def test_collectives_faster_than_the_frames_still_refine_the_clocks():
    """2,000 collectives a second, node b's frames 100 ms behind node a's: a collective waits for every
    agent's ends by receive time (clockrefine.SETTLE_S), not a count of collectives (64 of them pass in
    32 ms here, before b's ends of them arrive: the refinement never saw both nodes and did nothing),
    and the corrections are recomputed at most every UPDATE_MIN_S however fast collectives come."""
    job = Job({"n0": 30_000, "n1": -20_000}, {"n0": 60_000, "n1": 60_000})
    per_frame = 200
    updates = []
    job.clock.refiner.update = (lambda orig: lambda: (updates.append(job.clock.refiner.now), orig())[1])(
        job.clock.refiner.update)
    for k in range(40):  # 4 s of receive time
        job.clock.arrived(k * 0.1)
        for a, frame in (("n0", k), ("n1", k - 1)):  # n1's frame holds what n0 sent a frame ago
            for seq in range(frame * per_frame, (frame + 1) * per_frame) if frame >= 0 else ():
                t = UNIX + seq * 500_000
                for r in range(2):
                    job.clock.observe_end(a, ev.WorkEnd(pid=r, rank=r, ts_ns=job.mono(a, t + job.rng.randint(0, 3_000)),
                                                        comm="j/gloo:0", seq=seq))
    refiner = job.clock.refiner
    # every collective read had both nodes, but for some of the first frame's: read by count (until
    # receive time moves, the refiner cannot tell frames stamped alike from a live job), and n1's late
    # ends of those, read alone a second later
    assert refiner.used >= 5_000 and refiner.read - refiner.used <= 2 * (per_frame - clockrefine.SETTLE_GROUPS)
    errs = {a: job.error_ns(a, UNIX + 2_000_000_000) for a in job.err}
    assert abs(errs["n0"] - errs["n1"]) < 6_000, errs  # were 50 us apart
    assert len(updates) <= 4 / clockrefine.UPDATE_MIN_S + 1


def test_a_nodes_ends_from_before_its_first_round_trip_estimate_are_not_used_after_it():
    """A node converting with its wall clock (5 ms off) until its first round-trip estimate: its ends
    still waiting in collectives when the estimate comes were measured on the old timebase; at a high
    rate they would be the whole window of residuals after the switch and pull it 5 ms off."""
    job = Job({"n0": 0, "n1": 5_000_000}, {"n0": 40_000, "n1": 40_000}, wall=("n1",))
    refiner = job.clock.refiner
    job.clock.arrived(0.0)
    job.clock.arrived(0.01)  # receive time moves: collectives settle by it (1 s), so these all wait
    for seq in range(300):
        job.collective(seq, UNIX + seq * 500_000)
    assert sum("n1" in g for _, g in refiner.groups.values()) == 300
    job.clock.update_sync("n1", sync(UNIX - job.boot["n1"], unc=40_000))  # a good estimate at last
    job.collective(300, UNIX + 300 * 500_000)
    assert [k for k, (_, g) in refiner.groups.items() if "n1" in g] == [("j/gloo:0", 300)]
    assert refiner.entries == sum(len(g) for _, g in refiner.groups.values())


def test_the_refinements_receive_time_moves_on_across_a_wall_clock_step_back():
    """The collector's wall clock stepping back 60 s must not hold every collective waiting for 60 s
    (with max() of receive times it did: the refinement stood still that long)."""
    tl = Timeline()
    seen = []
    for k, recv in enumerate([100.0, 100.5, 40.0, 40.5, 41.0], start=1):
        tl.ingest(ev.decode_batch(ev.encode_batch("a0", "n0", k, [ev.ClockSample(mono_ns=k, wall_ns=UNIX, ts_ns=k)])),
                  recv)
        seen.append(tl.clock.refiner.now)
    assert seen == [0.0, 0.5, 0.5, 1.0, 1.5] and tl.clock.refiner.moving
