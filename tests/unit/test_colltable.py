"""The collective store's indexes (ccld/timeline/colltable.py) and the completion of collectives of a
world whose ranks announce themselves over many frames: what a big job's first seconds look like."""
from __future__ import annotations

import random

import numpy as np
import pytest

from ccld import wire as ev
from ccld.timeline.colltable import CollStore
from ccld.timeline.timeline import Timeline

pytestmark = pytest.mark.unit

T0_NS = 5_000_000_000_000


def test_every_cell_made_between_lookups_is_found_and_no_other():
    rnd = random.Random(3)
    st = CollStore()
    comms = [st.new_comm() for _ in range(3)]
    made = {}
    pairs = [(c, r) for c in range(3) for r in rnd.sample(range(5000), 400)]
    rnd.shuffle(pairs)
    for k, (c, r) in enumerate(pairs):
        made[(c, r)] = st.cell(comms[c], r, node=0, pid=r, rec=None)
        if k % 97 == 0 or k == len(pairs) - 1:  # a lookup now and then, as flushes do
            asked = list(made) + [(c, r + 5000) for c, r in list(made)[:50]] + [(2, 1 << 21)]
            got = st.lookup(np.array([c for c, _ in asked], dtype=np.int64), np.array([r for _, r in asked], dtype=np.int64))
            want = [made.get(a, -1) for a in asked]
            assert got.tolist() == want
    assert sorted(made.values()) == list(range(len(pairs)))  # one cell each, numbered as made


def test_a_cell_asked_again_is_the_same_cell_and_takes_the_new_process():
    st = CollStore()
    c = st.new_comm()
    first = st.cell(c, 7, node=1, pid=100, rec=None)
    again = st.cell(c, 7, node=2, pid=200, rec=None)
    assert first == again
    assert (st.cell_node[first], st.cell_pid[first]) == (2, 200)
    assert st.lookup(np.array([c.code]), np.array([7])).tolist() == [first]


def frame(agent, node, batch, events):
    return ev.decode_batch(ev.encode_batch(agent, node, batch, events))


def test_a_collective_completes_only_once_the_last_rank_of_a_growing_world_entered_and_ended_it():
    """World 64 on two agents; the second agent's ranks announce themselves only in its second frame.
    Collective 1 is entered and ended by ranks 0-31 first: not complete (32 members of 64 have not
    reported). Once ranks 32-63 announce, enter and end it, it is; collective 2, entered by all, too."""
    world, t = 64, T0_NS
    clock = ev.ClockSample(mono_ns=t, wall_ns=t + 10 ** 18, ts_ns=t)

    def announce(ranks):
        out = []
        for r in ranks:
            out.append(ev.RankInfo(pid=100 + r, rank=r, world_size=world, local_rank=r % 32, node=f"n{r // 32}",
                                   job="j", ts_ns=t))
            out.append(ev.CommInit(pid=100 + r, rank=r, ts_ns=t, backend="gloo", comm="j/gloo:0", group_rank=r,
                                   group_size=world))
        return out

    def run(ranks, seq, dt):
        out = []
        for r in ranks:
            out.append(ev.CollEnter(pid=100 + r, rank=r, ts_ns=t + dt + r, backend="gloo", comm="j/gloo:0", seq=seq,
                                    op="allreduce"))
            out.append(ev.WorkStart(pid=100 + r, rank=r, ts_ns=t + dt + 100, comm="j/gloo:0", seq=seq))
            out.append(ev.WorkEnd(pid=100 + r, rank=r, ts_ns=t + dt + 200 + r, comm="j/gloo:0", seq=seq))
        return out

    low, high = range(32), range(32, 64)
    tl = Timeline()
    tl.ingest(frame("a0", "n0", 1, [clock] + announce(low) + run(low, 1, 1000)), 1.0)
    tl.ingest(frame("a1", "n1", 1, [clock]), 1.0)
    comm = tl.comms["j/gloo:0"]
    assert comm.completed == 0 and comm.colls[1].completed_at is None
    tl.ingest(frame("a1", "n1", 2, announce(high) + run(high, 1, 1000)), 1.0)
    assert comm.completed == 1
    assert comm.colls[1].completed_at == pytest.approx((t + 1000 + 200 + 63) / 1e9 + 1e9, abs=1e-6)
    tl.ingest_many([(frame("a0", "n0", 2, run(low, 2, 5000)), 1.0), (frame("a1", "n1", 3, run(high, 2, 5000)), 1.0)])
    assert comm.completed == 2 and comm.colls[2].completed_at is not None


def test_a_view_held_across_a_restart_keeps_the_old_communicators_collective():
    """Rank 1 restarts (a new pid announces the group again): the communicator is rebuilt and its slots
    go to the new one's collectives. A view of the old collective 3 that an analysis held still shows
    the old enters, not the new communicator's."""
    t = T0_NS
    clock = ev.ClockSample(mono_ns=t, wall_ns=t + 10 ** 18, ts_ns=t)

    def announce(pids):
        return [e for r, pid in enumerate(pids) for e in (
            ev.RankInfo(pid=pid, rank=r, world_size=2, local_rank=r, node="n0", job="j", ts_ns=t),
            ev.CommInit(pid=pid, rank=r, ts_ns=t, backend="gloo", comm="j/gloo:0", group_rank=r, group_size=2))]

    def run(pids, seqs, dt):
        return [e for s in seqs for r, pid in enumerate(pids) for e in (
            ev.CollEnter(pid=pid, rank=r, ts_ns=t + dt + 1000 * s + r, backend="gloo", comm="j/gloo:0", seq=s,
                         op="allreduce"),
            ev.WorkEnd(pid=pid, rank=r, ts_ns=t + dt + 1000 * s + 500, comm="j/gloo:0", seq=s))]

    tl = Timeline()
    tl.ingest(frame("a0", "n0", 1, [clock] + announce([100, 101]) + run([100, 101], range(1, 6), 0)), 1.0)
    held = tl.comms["j/gloo:0"].colls[3]
    before = dict(held.enter)
    assert before == {0: pytest.approx((t + 3000) / 1e9 + 1e9), 1: pytest.approx((t + 3001) / 1e9 + 1e9)}
    tl.ingest(frame("a0", "n0", 2, announce([100, 201]) + run([100, 201], range(1, 6), 10 ** 9)), 2.0)
    new = tl.comms["j/gloo:0"]
    assert new.resets == 1 and new.colls[3].enter[1] > before[1] + 0.5
    assert held.enter == before and held.ops == {0: "allreduce", 1: "allreduce"}
    assert held.entered() and held.uniform() and held.enter_span() == (2, before[0], before[1])


def test_asking_for_no_slots_takes_none():
    st = CollStore()
    c = st.new_comm()
    got = st.take_slots([c, c, c])
    st.release(c, got[0])
    st.settle()
    free = list(st.free_slots)
    assert st.take_slots([]) == [] and st.free_slots == free
    assert len(st.take_slots([c])) == 1


@pytest.mark.parametrize("n", [3, 32, 33, 300])  # both sides of SMALL_ROW
def test_array_reads_answer_as_the_mappings_would(n):
    """span, uniform, entered and last_entered_cell, read from the arrays, against what the mappings
    (row, ops_row, sizes_row, last_entered) built from the same slot say: random slots with ranks
    missing, ops or sizes differing, and none reported at all."""
    from ccld.timeline.colltable import code_of
    rnd = random.Random(n)
    st = CollStore()
    cols = st.new_comm()
    ranks = rnd.sample(range(10_000), n)
    cells = [st.cell(cols, r, node=0, pid=r, rec=None) for r in ranks]
    ops = [code_of("allreduce"), code_of("broadcast")]
    dts = [code_of("float32"), code_of("bfloat16")]
    for trial in range(60):
        slot = st.take_slots([cols])[0]
        base = int(st.base[slot])
        report = rnd.choice([0.0, 0.5, 1.0])
        odd_op, odd_size = rnd.random() < 0.3, rnd.random() < 0.3
        for col in range(n):
            if rnd.random() < report:
                st.enter[base + col] = 1000.0 + rnd.random()
                st.op[base + col] = ops[1] if odd_op and rnd.random() < 0.2 else ops[0]
                big = odd_size and rnd.random() < 0.2
                st.count[base + col], st.dtype[base + col] = (8 if big else 4), dts[0]
                st.nbytes[base + col] = -1 if trial % 2 else (32 if big else 16)
                st.n_entered[slot] += 1
        enter = st.row(st.enter, slot, cols)
        k, lo, hi = st.span(st.enter, slot, cols)
        assert k == len(enter)
        if enter:
            assert (lo, hi) == (min(enter.values()), max(enter.values()))
        want = len(set(st.ops_row(slot, cols).values())) <= 1 and len(set(st.sizes_row(slot, cols).values())) <= 1
        assert st.uniform(slot, cols) == want
        st.last_seq[cells[trial % n]], st.last_op[cells[trial % n]], st.last_t[cells[trial % n]] = trial, ops[0], 5.0
        last = st.last_entered(cols)
        assert [st.last_entered_cell(c) for c in cells] == [last.get(r) for r in ranks]
        st.release(cols, slot)
        st.settle()


def test_the_collectives_past_the_bound_that_go_are_the_oldest_even_when_a_frame_lists_them_op_by_op(monkeypatch):
    """A frame's column blocks go one per op: all of its all-reduces (odd seqs), then its barriers (even
    seqs). With room for 8 collectives, seqs 13-20 stay and everything up to 12 is gone, as when the
    collectives came one at a time (the views were made in the rows' order: all-reduce 19 before
    barrier 2, so barriers 2-12 stayed and newer all-reduces went)."""
    from ccld.timeline import comms
    monkeypatch.setattr(comms, "MAX_COLLS_PER_COMM", 8)
    monkeypatch.setattr(comms, "MIN_COLLS_PER_COMM", 8)
    t = T0_NS
    clock = ev.ClockSample(mono_ns=t, wall_ns=t + 10 ** 18, ts_ns=t)
    evs = [clock]
    for r in range(2):
        evs += [ev.RankInfo(pid=100 + r, rank=r, world_size=2, local_rank=r, node="n0", job="j", ts_ns=t),
                ev.CommInit(pid=100 + r, rank=r, ts_ns=t, backend="gloo", comm="j/gloo:0", group_rank=r,
                            group_size=2)]
    for s in range(1, 21):
        for r in range(2):
            evs += [ev.CollEnter(pid=100 + r, rank=r, ts_ns=t + 1000 * s, backend="gloo", comm="j/gloo:0", seq=s,
                                 op="allreduce" if s % 2 else "barrier"),
                    ev.WorkEnd(pid=100 + r, rank=r, ts_ns=t + 1000 * s + 500, comm="j/gloo:0", seq=s)]
    batch = frame("a0", "n0", 1, evs)
    assert [b.same.get("op") for b in batch.blocks if b.kind == "coll"] == ["allreduce", "barrier"]
    tl = Timeline()
    tl.ingest(batch, 1.0)
    comm = tl.comms["j/gloo:0"]
    assert sorted(comm.colls) == list(range(13, 21)) and comm.evicted_upto == 12
