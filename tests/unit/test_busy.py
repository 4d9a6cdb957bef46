"""Blocked time and the own-work slowdown detector, on synthetic pipelines (stage = rank) and DDP-style
jobs: a stage whose compute grows is named alone (the stages after it wait in recv, the ones before
it in the loss all-reduce); a batch-size change that grows every stage's work names nobody; a
healthy pipeline names nobody; the baseline holds while the slowdown lasts; blocked time of one
rank counts overlapping intervals once.
"""
import random

import pytest

from ccld.timeline.blocked import BUCKET_S, BlockedTable
from ccld.timeline.timeline import Timeline
from ccld.diagnose import Diagnoser, busy

from ccld_synth import T0, SynthJob

pytestmark = pytest.mark.unit


def test_blocked_time_counts_overlaps_once_and_windows_are_snapshot_differences():
    import collections
    t = BlockedTable(collections.Counter())
    base = 1000 * BUCKET_S
    t.add("j", 0, base - 1.0, base - 0.5)
    rows = t.job("j")
    rows.snapshot(base - 0.1)                   # bucket 999: the first snapshot
    t.add("j", 1, base + 0.5, base + 1.0)
    t.add("j", 1, base + 0.8, base + 1.2)       # overlaps the first by 0.2 s: counted once
    t.add("j", 1, base + 0.9, base + 1.1)       # inside what is counted: nothing
    t.add("j", 0, base + 1.9, base + 1.95)      # ends come in any order: an earlier one after
    t.add("j", 0, base + 1.0, base + 1.5)
    rows.snapshot(base + BUCKET_S - 0.01)       # bucket 1000
    got = rows.window(1000, 1000)
    assert got[1] == pytest.approx(0.7 / BUCKET_S) and got[0] == pytest.approx(0.55 / BUCKET_S)
    assert rows.window(999, 1000) is None       # before the first snapshot: unknown, not zero
    rows.snapshot(base + 6 * BUCKET_S)          # buckets without a tick: nothing seen to end in them
    assert list(rows.window(1001, 1006)[:2]) == [0.0, 0.0]
    t.add("j", 0, 5.0, 4.0)                     # an end before its start: dropped, counted
    assert t.anomalies["blocked-interval-dropped"] == 1


def run(steps_before=1800, steps_after=700, slow=None, slow_all=None, stage_ms=10.0):
    """A 4-stage pipeline: `steps_before` healthy steps, then `steps_after` with stage compute grown
    (slow: {rank: extra ms}; slow_all: extra ms on every stage); detection ticks every 0.5 s."""
    job, tl = SynthJob(world=4), Timeline()
    job.announce(T0)
    t = T0 + 1
    d = Diagnoser(tl)
    found, feed_every = [], 0.5
    next_feed = t + feed_every
    fault_at = None
    for i in range(steps_before + steps_after):
        if i == steps_before:
            fault_at = t
        extra = {}
        if i >= steps_before:
            extra = dict(slow or {})
            if slow_all:
                extra = {r: slow_all for r in range(4)}
        t = job.pipeline(1, t, first_seq=i + 1, first_n=i + 1, stage_ms=stage_ms, slow=extra)
        if t >= next_feed:
            job.feed(tl, t)
            found += [(t, f) for f in d.find_slow(t)]
            next_feed = t + feed_every
    return found, fault_at, tl



def _counted_by_pieces(intervals, kept_n):
    """Blocked seconds the plain way: each interval minus every piece of the newest kept_n counted
    intervals (the rule JobBlocked.add keeps), by cutting it into the pieces they leave uncovered."""
    kept, total, newest = [], 0.0, None
    for start, end in intervals:
        pieces = [(start, end)]
        if newest is not None and start < newest:
            for a, b in kept[-kept_n:]:
                pieces = [q for lo, hi in pieces for q in ((lo, min(hi, a)), (max(lo, b), hi)) if q[1] > q[0]]
        if not pieces:
            continue
        kept.append((start, end))
        newest = end if newest is None else max(newest, end)
        total += sum(hi - lo for lo, hi in pieces)
    return total


def test_overlapping_waits_of_one_rank_count_once_in_any_order():
    from ccld.timeline.blocked import KEPT_INTERVALS, JobBlocked
    rnd = random.Random(7)
    for trial in range(300):
        intervals, t = [], 0.0
        for _ in range(rnd.randint(1, 60)):  # two communicators' waits and p2p ops, out of order
            t += rnd.choice((0.0, 0.001, 0.01, 0.05))
            start = t - rnd.random() * 0.05
            intervals.append((start, start + rnd.choice((0.0, 0.002, 0.02, 0.1)) * rnd.random()))
        if trial % 3 == 0:
            rnd.shuffle(intervals)
        jb = JobBlocked()
        for a, b in intervals:
            jb.add(0, a, b)
        assert jb.total[0] == pytest.approx(_counted_by_pieces(intervals, KEPT_INTERVALS), abs=1e-12), trial


def _union(intervals):
    total, reach = 0.0, -float("inf")
    for a, b in sorted(intervals):
        total += max(0.0, b - max(a, reach))
        reach = max(reach, b)
    return total


def test_waits_added_in_batches_count_each_second_once_per_rank():
    """add_many (the collective ends of a flush) counts each rank's union of waits, whatever the batch
    boundaries and the order within a batch: here against the union computed plainly (overlaps stay
    within the kept intervals' reach), and against add() one at a time."""
    import numpy as np
    from ccld.timeline.blocked import JobBlocked
    rnd = random.Random(11)
    for trial in range(200):
        rows = []
        for rank in range(rnd.randint(1, 5)):
            t = rnd.random()
            for _ in range(rnd.randint(1, 40)):  # at most a few waits overlap: sequential, or two comms at once
                t += rnd.choice((0.0, 0.001, 0.01))
                start = t - rnd.random() * 0.005
                rows.append((rank, start, start + rnd.choice((0.0, 0.002, 0.02)) * rnd.random()))
        if trial % 2:  # out of order as frames of several agents interleave: within a few rows, per rank
            rows = [x for k in range(0, len(rows), 6) for x in rnd.sample(rows[k:k + 6], len(rows[k:k + 6]))]
        batched, single = JobBlocked(), JobBlocked()
        i = 0
        while i < len(rows):
            j = i + rnd.randint(1, 12)
            chunk = rows[i:j]
            batched.add_many(np.array([r for r, _, _ in chunk]), np.array([a for _, a, _ in chunk]),
                             np.array([b for _, _, b in chunk]))
            i = j
        for r, a, b in rows:
            single.add(r, a, b)
        for rank in {r for r, _, _ in rows}:
            mine = [(a, b) for r, a, b in rows if r == rank]
            assert batched.total[rank] == pytest.approx(_union(mine), abs=1e-9), (trial, rank)
            assert single.total[rank] == pytest.approx(_union(mine), abs=1e-9), (trial, rank)
            assert batched.ended[rank] == single.ended[rank] == len(mine)


def test_a_stage_whose_compute_grew_is_named_alone():
    found, fault_at, _ = run(slow={2: 15.0})
    slow = [(t, f) for t, f in found if f.cls == "comp-slow" and not f.evidence.get("informational")]
    assert slow, "no comp-slow finding"
    first_t, f = slow[0]
    assert f.ranks == [2] and f.evidence["reason"] == "own-work", f.evidence
    assert first_t - fault_at <= 30.0, first_t - fault_at
    assert all(g.ranks == [2] for _, g in slow)
    (d,) = f.evidence["ranks"]
    assert d["own_work_grew"] >= busy.MIN_DELTA and f.op == "p2p"
    assert not [(t, g) for t, g in found if t < fault_at], "a finding before the fault"


def test_every_stage_working_more_is_no_culprit():
    """A bigger batch: every stage computes more; everyone's own work grows, nobody waits more."""
    found, fault_at, _ = run(slow_all=10.0)
    assert [f for _, f in found if not f.evidence.get("informational")] == []


def test_a_healthy_pipeline_is_never_slow():
    found, _, _ = run(steps_before=1500, steps_after=0)
    assert found == []


def test_the_baseline_holds_while_the_slowdown_lasts():
    """Ten minutes of a slowed stage: still named at the end (its own slow normal is not learned)."""
    found, fault_at, _ = run(steps_before=400, steps_after=3200, slow={1: 75.0}, stage_ms=50.0)
    late = [f for t, f in found if t > fault_at + 300 and f.cls == "comp-slow"]
    assert late and all(f.ranks == [1] for f in late)


def drive(steps_before, steps_after, after, each_step=None):
    """A 4-stage pipeline (10 ms stages): `steps_before` healthy steps, then `steps_after` with
    job.pipeline's keywords `after` (slow, link_ms); each_step(job, t, faulty) after every step;
    detection ticks every 0.5 s. Returns (found, fault_at)."""
    job, tl = SynthJob(world=4), Timeline()
    job.announce(T0)
    t = T0 + 1
    d = Diagnoser(tl)
    found, next_feed, fault_at = [], t + 0.5, None
    for i in range(steps_before + steps_after):
        if i == steps_before:
            fault_at = t
        kw = after if i >= steps_before else {}
        t = job.pipeline(1, t, first_seq=i + 1, first_n=i + 1, stage_ms=10.0, **kw)
        if each_step is not None:
            each_step(job, t, i >= steps_before)
        if t >= next_feed:
            job.feed(tl, t)
            found += [(t, f) for f in d.find_slow(t)]
            next_feed = t + 0.5
    return found, fault_at


def run_link(steps_before=1800, steps_after=700, link_ms=None):
    return drive(steps_before, steps_after, {"link_ms": link_ms})


def test_a_slow_link_between_two_stages_is_comm_slow_on_that_link():
    found, fault_at = run_link(link_ms={(1, 2): 20.0})
    real = [(t, f) for t, f in found if not f.evidence.get("informational")]
    assert real, "nothing found"
    t, f = real[0]
    assert (f.cls, f.ranks, f.link, f.op) == ("comm-slow", [1, 2], [1, 2], "p2p"), (f.cls, f.ranks, f.evidence)
    assert t - fault_at <= 30 and f.evidence["reason"] == "p2p-transfers"
    assert {(s["src"], s["dst"]) for s in f.evidence["streams"]} == {(1, 2)}
    assert all((g.cls, g.link) == ("comm-slow", [1, 2]) for _, g in real), [(g.cls, g.ranks) for _, g in real]


def test_every_link_slower_names_no_link():
    found, _ = run_link(link_ms={(0, 1): 20.0, (1, 2): 20.0, (2, 3): 20.0})
    assert [f for _, f in found if f.cls == "comm-slow"] == []


def test_one_rank_checkpointing_20_s_is_a_pause_not_a_slowdown():
    """Rank 0 writes a checkpoint for 20 s (no collective of its ends meanwhile) while the others wait
    in one all-reduce: their 20 s wait is counted when it ends, in one bucket. Rank 0's own work is
    100 % of every bucket of the checkpoint, but that is a pause (hang.py's informational finding),
    not work that grew step after step: no comp-slow (CI once named rank 0, +267 ms/s)."""
    job, tl = SynthJob(world=4), Timeline()
    job.announce(T0)
    d, found = Diagnoser(tl), []
    t, seq, next_feed = T0 + 1, 1, T0 + 1.5

    def tick(until):
        nonlocal next_feed
        while next_feed <= until:
            job.feed(tl, next_feed)
            found.extend((next_feed, f) for f in d.find_slow(next_feed))
            next_feed += 0.5

    def healthy(seconds):
        nonlocal t, seq
        for _ in range(int(seconds / 0.1)):
            end = job.collective(seq, t, dur=0.03)  # every rank waits ~30 % of its time
            seq, t = seq + 1, t + 0.1
            tick(end)

    healthy(150)
    ckpt = t
    for r in (1, 2, 3):  # the others enter and wait; rank 0 comes 20 s later
        job.enter(r, seq, t)
    tick(t + 20.0)
    job.enter(0, seq, t + 20.0)
    for r in range(4):
        job.start(r, seq, t + 20.0)
        job.end(r, seq, t + 20.03)
    seq, t = seq + 1, t + 20.1
    healthy(60)
    assert [(round(at - ckpt, 1), f.cls, f.ranks, f.evidence.get("reason")) for at, f in found
            if f.kind == "slow" and not f.evidence.get("informational")] == []


def run_starved(hog_runq=1.0, slower=True, steps_before=1800, steps_after=900):
    """Stage 1 gets a CPU hog after `steps_before` steps: its threads wait for a CPU `hog_runq` s per s
    (the others 0.15) and, when `slower`, its work and its transfers take longer (it waits for the CPU
    inside them too), so its blocked share grows with everyone's. SchedStats every 0.5 s, as the
    agent sends them."""
    import collections
    from ccld import wire as ev
    runq, next_sched = collections.Counter(), [T0 + 1]

    def sched(job, t, hog):
        while next_sched[0] <= t:
            for r in range(4):
                runq[r] += int(0.5e9 * (hog_runq if hog and r == 1 else 0.15))
                job._put(r, ev.SchedStats(pid=job.pid[r], rank=r, ts_ns=job.ts(r, next_sched[0]), runq_ns=runq[r]))
            next_sched[0] += 0.5

    after = {"slow": {1: 6.0}, "link_ms": {(0, 1): 6.0, (1, 2): 6.0}} if slower else {}
    return drive(steps_before, steps_after, after, sched)


def test_a_stage_starved_of_cpu_is_named_though_its_own_work_does_not_show_it():
    """A CPU hog on stage 1's core: it waits for the CPU inside its sends and receives too, so its
    blocked share grows like everyone's (own work cannot name it); its runqueue share can."""
    found, fault_at = run_starved()
    real = [(t, f) for t, f in found if not f.evidence.get("informational")]
    assert real, "nothing found"
    t, f = real[0]
    assert (f.cls, f.ranks, f.evidence["reason"]) == ("comp-slow", [1], "cpu-starved"), (f.cls, f.ranks, f.evidence)
    assert t - fault_at <= 30.0 and f.evidence["ranks"][0]["runq_s_per_s"] >= busy.STARVED_RUNQ
    assert not [g for at, g in found if at < fault_at]


def test_a_rank_waiting_for_a_cpu_that_slows_nobody_is_not_named():
    """Stage 1 waits for a CPU as much, but the job is no slower (the others do not wait more)."""
    found, _ = run_starved(slower=False)
    assert [(f.cls, f.ranks) for _, f in found if not f.evidence.get("informational")] == []


def test_the_median_of_the_others_is_each_ranks_leave_one_out_median():
    """busy._median_without_each (one sort for every rank) against numpy's median with that rank removed."""
    import numpy as np
    rnd = random.Random(3)
    for _ in range(2000):
        v = np.array([rnd.choice([0.1, 0.2, 0.3, rnd.random()]) for _ in range(rnd.randint(2, 9))])
        want = [np.median(np.delete(v, i)) for i in range(len(v))]
        assert busy._median_without_each(v).tolist() == pytest.approx(want)
