"""Which ranks a communicator expects: one rule (timeline/members.py) for the live timeline and the
trace export, which each keep their own inputs. Both sides are fed the same RankInfo and CommInit facts
over a grid of worlds, group sizes, subgroup marks, per-process NCCL names and announced ranks, and
must agree; then, through a store, the case the export got wrong before it asked the shared rule: a
per-process NCCL communicator (named by one rank's handle) waited for the whole world."""
import itertools

import pytest

from ccld import wire as ev
from ccld.export.collectives import Collectives
from ccld.export.perfetto import export_perfetto
from ccld.store import StoreWriter
from ccld.timeline import members
from ccld.timeline.timeline import Timeline

from ccld_synth import T0, SynthJob
from test_export_perfetto import parse

pytestmark = pytest.mark.unit

MEMBERS = (1, 3)                  # the ranks that announce the communicator
ANNOUNCED = (4, 17, 18, 467, 468)  # ranks 0..n-1 of the job announced: 18 backs a world of 100, 468 one of 1000


class Model:  # what Collectives reads of the export's TraceModel
    ranks = None


def comm_name(per_process):
    return "j/nccl:handle-r1-ab" if per_process else "j/nccl-pg:3"


def timeline(world, gs, sub, pp, announced):
    evs = [ev.ClockSample(mono_ns=0, wall_ns=10 ** 18, ts_ns=0)]
    evs += [ev.RankInfo(pid=100 + r, rank=r, world_size=world, local_rank=r, node="n", job="j", ts_ns=1)
            for r in range(announced)]
    evs += [ev.CommInit(pid=100 + r, rank=r, ts_ns=2, backend="nccl", comm=comm_name(pp), group_rank=-1,
                        group_size=gs, subgroup=sub, seq_source=ev.SEQ_FROM_ATTACH if pp else ev.SEQ_FROM_INIT)
            for r in MEMBERS]
    tl = Timeline()
    tl.ingest(ev.decode_batch(ev.encode_batch("a", "n", 1, evs)), 1e9)
    return tl


def export_side(world, gs, sub, pp, announced, ranks=None):
    model = Model()
    model.ranks = ranks
    c = Collectives(model)
    for r in range(announced):
        c.note_rank("j", r, world)
    for r in MEMBERS:
        c.note_comm(comm_name(pp), "nccl", gs, r, "j", sub, ev.SEQ_FROM_ATTACH if pp else ev.SEQ_FROM_INIT)
    return c


@pytest.mark.parametrize("world", [-1, 8, 100, 1000])
def test_the_timeline_and_the_export_expect_the_same_ranks(world):
    for gs, sub, pp, announced in itertools.product((-1, 0, 2, world), (False, True), (False, True), ANNOUNCED):
        case = dict(world=world, gs=gs, sub=sub, pp=pp, announced=announced)
        got = timeline(world, gs, sub, pp, announced).expected_members(comm_name(pp))
        spans = members.spans_world(world, gs, sub, announced, pp)
        assert got == (set(range(world)) if spans else set(MEMBERS)), case
        assert export_side(world, gs, sub, pp, announced).want(comm_name(pp)) == len(got), case


def test_the_export_counts_only_the_selected_ranks_of_what_the_rule_expects():
    selected = frozenset({3, 5, 200})
    assert export_side(8, -1, False, False, 4, selected).want("j/nccl-pg:3") == 2        # the world: 3 and 5
    assert export_side(1000, 1000, False, False, 4, selected).want("j/nccl-pg:3") == 1   # members: 3
    assert export_side(1000, 1000, False, False, 468, selected).want("j/nccl-pg:3") == 3  # the world, backed


def test_the_exports_expectation_follows_the_ranks_announced_later():
    """A world of 100 is believed once 18 of its ranks announced themselves, as in the timeline."""
    c = export_side(100, 100, False, False, 17)
    assert c.want("j/nccl-pg:3") == 2
    c.note_rank("j", 17, 100)
    assert c.want("j/nccl-pg:3") == 100
    c.note_rank("j", 17, 100)  # the same rank again: nothing new
    assert c.want("j/nccl-pg:3") == 100


def test_a_per_process_nccl_communicators_collectives_are_whole_in_the_export(tmp_path):
    """`agent --pid` on an NCCL job: each rank's communicator made before the attach is named by its
    handle (one member). The export waited for the job's 4 ranks and wrote every collective partial."""
    job = SynthJob(world=4, nodes=2)
    job.announce(T0)
    name = {r: f"job/nccl:handle-r{r}-7f00" for r in range(4)}
    for r in range(4):
        job._put(r, ev.CommInit(pid=job.pid[r], rank=r, ts_ns=job.ts(r, T0), backend="nccl", comm=name[r],
                                group_rank=-1, group_size=-1, seq_source=ev.SEQ_FROM_ATTACH))
    for seq in range(1, 24):
        t = T0 + 0.1 * seq
        for r in range(4):
            job.enter(r, seq, t + 0.001 * r, comm=name[r])
            job._put(r, ev.WorkEnd(pid=job.pid[r], rank=r, ts_ns=job.ts(r, t + 0.002 + 0.001 * r), comm=name[r],
                                   seq=seq, ok=True, error=""))
    w = StoreWriter(str(tmp_path / "s"))
    frames = job.frames(T0 + 3)
    for f in frames:
        w.append(f, T0 + 3)
    w.close()
    stats = export_perfetto(str(tmp_path / "s"), str(tmp_path / "t.pftrace"), findings=[])
    tr = parse(tmp_path / "t.pftrace")
    per_comm = {r: [s for s in tr.slices if tr.track_name(s["track"]).startswith(name[r])] for r in range(4)}
    assert tr.errors == [] and all(len(v) == 23 for v in per_comm.values())
    assert not any(s["args"].get("partial") for v in per_comm.values() for s in v)
    assert stats["flows"] == 0  # one rank each: nothing to join

    tl = Timeline()  # the live timeline, from the same frames, expects the same one rank
    for f in frames:
        tl.ingest(ev.decode_batch(f), T0 + 3)
    assert [tl.expected_members(name[r]) for r in range(4)] == [{r} for r in range(4)]
