"""Which ranks a communicator expects in each of its collectives: the one rule, for the live timeline
(Timeline.expected_members, a set of global ranks) and the trace export (export/collectives.py, a count
of the selected ranks). Each side keeps its own inputs (the timeline's Comm records; the export's
RankInfo and CommInit facts, read in store order) and asks `spans_world`.

A communicator spans its job's whole world (ranks 0..world-1 are expected) when its group size is the
world's, or is unknown (the agent attached after the group was built) and no CommInit marked it a
subgroup (wire 1.8: pgnccl marks PyTorch's groups other than the default one so), and the agents
announced enough of that world to believe it (at least half of it, or it is small), and it is not a
per-process NCCL communicator (align.py: named by one process's handle, judged as its own members).
Otherwise it expects the ranks seen in it. A world no agent backs (a frame claiming 2^17 ranks, a job
traced on a few of its nodes) would make every collective wait for ranks nobody reports.
"""
from __future__ import annotations

SMALL_WORLD = 64  # a world this small is believed before its ranks are announced (tests, small jobs)


def spans_world(world: int, group_size: int, subgroup: bool, announced: int, members_only: bool = False) -> bool:
    """Whether a communicator's expected ranks are its job's world (else: the ranks seen in it).
    `world`: the job's world size (<= 0: unknown); `group_size`: the communicator's (< 0: unknown);
    `announced`: distinct ranks of the job that announced themselves (RankInfo)."""
    return world > 0 and (group_size == world or group_size < 0 and not subgroup) \
        and world <= 2 * announced + SMALL_WORLD and not members_only
