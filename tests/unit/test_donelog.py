"""The completion log (timeline/donelog.py) and comm-slow's array reading of it (commslow._newest,
_baselines, _any_slow): the same collectives as the walk over the communicator's views newest first
that they replace (written out here as the reference), on random histories; and the log holds exactly
the collectives the timeline still holds after eviction and a rebuilt group."""
import random

import numpy as np
import pytest

from ccld import wire as ev
from ccld.diagnose import commslow
from ccld.timeline import comms
from ccld.timeline.donelog import MAX_PENDING, DoneLog
from ccld.timeline.records import Comm
from ccld.timeline.timeline import Timeline

from ccld_synth import T0, SynthJob

pytestmark = pytest.mark.unit


def walk_newest(items, now):
    """The walk comm-slow did over comm.colls reversed (items: (seq, op, done, first, last), newest
    made first, completed only): per op, newest first."""
    out = {}
    for seq, op, done, _, _ in items:
        if done < now - commslow.RECENT_S and out and all(len(x) >= commslow.RECENT_N for x in out.values()):
            break
        got = out.setdefault(op, [])
        if len(got) < commslow.RECENT_N or done >= now - commslow.RECENT_S:
            got.append(seq)
    return out


def walk_baselines(items, newest):
    skip = {s for seqs in newest.values() for s in seqs}
    durs = {}
    for seq, op, done, _, last in items:
        if seq not in skip:
            durs.setdefault(op, []).append(max(0.0, done - last))
    return {op: (sorted(d)[len(d) // 4], len(d)) for op, d in durs.items()}


def random_log(rnd):
    """A log of a random history: collectives made in seq order, completing out of order, some evicted."""
    log = DoneLog()
    ops = [f"op{i}" for i in range(rnd.randint(1, 4))]
    n = rnd.randint(1, 300)
    t = T0
    done = []
    for made in range(n):
        t += rnd.choice([0.001, 0.05, 0.5, 2.0])
        if rnd.random() < 0.9:  # some never complete
            first = t + rnd.random() * 0.01
            last = first + rnd.random() * 0.01
            done.append((made, made + 100, rnd.choice(ops), last + rnd.random() * 0.1, first, last))
    rnd.shuffle(done)
    done.sort(key=lambda x: x[0] + rnd.randint(0, 5))  # roughly in order of making
    for x in done:
        log.add(*x, gone=0)
    gone = rnd.randint(0, n // 3 if rnd.random() < 0.7 else n)  # sometimes most are evicted: trimmed
    held = sorted((x for x in done if x[0] >= gone), key=lambda x: -x[0])
    return log, gone, [(x[1], x[2], x[3], x[4], x[5]) for x in held], t


def test_newest_and_baselines_match_the_walk_over_views():
    rnd = random.Random(7)
    for _ in range(400):
        log, gone, items, t = random_log(rnd)
        now = t + rnd.choice([0.0, 1.0, 5.0, 12.0, 60.0])
        d = log.window(gone)
        assert d.seq.tolist() == [x[0] for x in items]
        got = commslow._newest(d, now)
        want = walk_newest(items, now)
        assert {log.names[c]: d.seq[idx].tolist() for c, idx in got.items()} == want
        assert [log.names[c] for c in got] == list(want)  # ops in the order the walk met them
        assert commslow._baselines(d, log.names, got) == walk_baselines(items, want)


def test_screen_sees_each_completion_once():
    log = DoneLog()
    st = commslow._CommState(base={"allreduce": (0.001, 50)})
    for i in range(5):
        log.add(i, i, "allreduce", T0 + i + 0.0015, T0 + i, T0 + i + 0.0005, 0)  # 1 ms: at its baseline
    assert not commslow._any_slow(log, st)
    log.add(5, 5, "allreduce", T0 + 5.01, T0 + 5, T0 + 5, 0)  # 10 ms: slow
    log.window(0)  # merged into the arrays: the screen reads them there
    assert commslow._any_slow(log, st)
    assert not commslow._any_slow(log, st)  # screened already
    log.add(6, 6, "barrier", T0 + 6.001, T0 + 6, T0 + 6, 0)  # an op without a baseline: look
    assert commslow._any_slow(log, st)


def test_log_holds_what_the_timeline_holds(monkeypatch):
    monkeypatch.setattr(comms, "MAX_COLLS_PER_COMM", 40)
    monkeypatch.setattr(comms, "MIN_COLLS_PER_COMM", 40)
    job, tl = SynthJob(world=3), Timeline()
    job.announce(T0)
    t = T0 + 1
    for seq in range(1, 301):
        job.collective(seq, t, "allreduce" if seq % 2 else "broadcast", finish=seq % 7 != 0)
        t += 0.01
        if seq % 10 == 0:
            job.feed(tl, t)
    comm = tl.comms[job.comm]
    assert len(comm.colls) == 40 and comm.gone == comm.made - 40
    d = comm.done.window(comm.gone)
    assert d.seq.tolist() == [s for s in reversed(comm.colls) if comm.colls[s].completed_at is not None]
    for seq, done, first, last in zip(d.seq.tolist(), d.done.tolist(), d.first.tolist(), d.last.tolist()):
        v = comm.colls[seq]
        n, lo, hi = v.enter_span()
        assert (done, first, last) == (v.completed_at, lo, hi)
    assert len(comm.done._rows) <= 2 * 40 + 64  # evicted entries dropped
    # the rank restarts and rebuilds the group: a new communicator, a new log
    job.pid[0] = 9999
    job._put(0, ev.CommInit(pid=9999, rank=0, ts_ns=job.ts(0, t), backend="gloo", comm=job.comm, group_rank=0,
                            group_size=3))
    job.feed(tl, t + 0.1)
    fresh = tl.comms[job.comm]
    assert fresh is not comm and fresh.done is not comm.done and fresh.done.total == 0


def test_fresh_reads_pending_and_merged_entries_alike():
    log = DoneLog()
    for i in range(6):
        log.add(i, i, "x" if i % 2 else "y", 10.0 + i, 0.0, 9.0 + i / 2, 0)
        if i == 3:
            log.window(0)
    ops, durs = log.fresh(2)
    assert [log.names[c] for c in ops] == ["y", "x", "y", "x"]
    assert durs == [10.0 + i - (9.0 + i / 2) for i in range(2, 6)]
    assert log.fresh(6) == ([], [])


def test_fresh_after_a_trim_reads_what_is_left_and_what_is_pending():
    log = DoneLog()
    for i in range(200):
        log.add(i, i, "x", 10.0 + i, 0.0, 10.0, 0)
    assert log.window(150).seq.tolist() == list(range(199, 149, -1))
    assert len(log._rows) == 50  # 150 of 200 evicted: dropped for good
    for i in range(200, 210):
        log.add(i, i, "x", 10.0 + i, 0.0, 10.0, 150)
    assert log.fresh(120)[1] == [float(i) for i in range(150, 210)]
    assert log.fresh(180)[1] == [float(i) for i in range(180, 210)]


def test_a_log_nobody_reads_stays_bounded():
    log = DoneLog()
    for i in range(20_000):
        log.add(i, i, f"op{i % 3}", 1.0, 0.0, 0.0, max(0, i - 100))
    assert len(log._pending) < MAX_PENDING and len(log._rows) <= 200 + MAX_PENDING
    assert log.window(20_000 - 100).seq.tolist() == list(range(19_999, 19_899, -1))


def test_a_rebuilt_group_is_screened_and_rebaselined_from_its_own_log():
    st = commslow._CommState()
    t = [T0]

    def complete(comm, n, dur):
        for _ in range(n):
            comm.done.add(comm.made, comm.made + 1, "allreduce", t[0] + dur, t[0], t[0], comm.gone)
            comm.made += 1
            comm.completed += 1
            t[0] += 0.1

    old = Comm(id="job/gloo:0")
    complete(old, 3000, 0.001)
    commslow._slow_ops(old, t[0], st)
    assert st.base["allreduce"][0] == pytest.approx(0.001, abs=1e-6)
    new = Comm(id="job/gloo:0")  # its ranks restarted: seqs and counts start over
    complete(new, 300, 0.002)
    for _ in range(3):
        commslow._slow_ops(new, t[0], st)
    assert st.log is new.done and st.base["allreduce"][0] == pytest.approx(0.002, abs=1e-6)
    assert len(old.done._pending) == 0 and len(new.done._pending) == 0  # both read


def test_window_order_is_made_order_not_completion_order():
    log = DoneLog()
    log.add(2, 12, "x", 3.0, 0.0, 0.0, 0)
    log.add(0, 10, "x", 5.0, 0.0, 0.0, 0)
    log.add(1, 11, "x", 4.0, 0.0, 0.0, 0)
    d = log.window(1)
    assert d.seq.tolist() == [12, 11] and d.appended.tolist() == [0, 2]
    assert np.allclose(d.duration, [3.0, 4.0])
