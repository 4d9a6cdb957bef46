"""Matching on a job with three kinds of process groups: the 8-rank tensor x pipeline x data job
(ccld/workloads/hybrid_job.py, 2 x 2 x 2) under `ccld run --store`, its store read back.

Each rank belongs to four gloo groups (the world, its tp, dp and pp group) and builds them in the
same order, so rank 0's second group ({0,1}) and rank 2's ({2,3}) are different groups built in the
same place. The store must show every group as one communicator with exactly its members (c10d's
group names, not the order of building, join them), every collective (comm, seq) entered by exactly
those members with one op, and every send paired with a recv. The counts follow from the flags
alone: per step, 2 * layers * microbatches tp all-reduces, one dp all-reduce, microbatches sends and
recvs between the two stages of each pp group.
Budget on 2 vCPUs: ~1 minute (8 ranks importing torch, 3 steps).
"""
import collections
import os
import subprocess
import sys

import pytest

import fault_scenarios as fs
from conftest import bpf_skip_reason, torch_skip_reason

pytestmark = pytest.mark.e2e

STEPS, LAYERS, MICRO = 3, 2, 3
RUN_TIMEOUT_S = 240.0


def group(ranks):
    return frozenset(ranks)


# rank = stage * 4 + d * 2 + t (hybrid_job.py's layout)
TP = {group(g) for g in ([0, 1], [2, 3], [4, 5], [6, 7])}
DP = {group(g) for g in ([0, 2], [1, 3], [4, 6], [5, 7])}
PP = {group(g) for g in ([0, 4], [1, 5], [2, 6], [3, 7])}
WORLD = group(range(8))


def read_events(store):
    from ccld import wire as ev
    from ccld.store import read_store
    problems = []
    out = [e for _, frame in read_store(store, problems) for e in ev.decode_batch(frame).events]
    assert not problems, problems
    return out


def test_every_group_of_a_tp_pp_dp_job_is_one_communicator_with_exactly_its_members(tmp_path):
    reason = bpf_skip_reason() or torch_skip_reason()
    if reason:
        pytest.skip(reason)
    from ccld import wire as ev
    store = str(tmp_path / "store")
    cmd = fs.CCLD + ["run", "--store", store, "--findings", str(tmp_path / "f.jsonl"), "--"] + fs.workload_cmd(
        "hybrid_job.py", 8, "--steps", STEPS, "--layers", LAYERS, "--microbatches", MICRO, "--compute-ms", 0.3)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    events = read_events(store)

    members = collections.defaultdict(set)       # comm -> ranks with a CommInit for it
    group_ranks = collections.defaultdict(dict)  # comm -> {global rank: group rank}
    for e in events:
        if isinstance(e, ev.CommInit):
            members[e.comm].add(e.rank)
            group_ranks[e.comm][e.rank] = e.group_rank
    got = {group(m) for m in members.values()}
    assert got == TP | DP | PP | {WORLD}, {c: sorted(m) for c, m in members.items()}
    assert len(members) == 13, sorted(members)  # one communicator per group: none shared, none split
    for comm, gr in group_ranks.items():  # group ranks follow the global order, as new_group gives them
        assert sorted(gr.values()) == list(range(len(gr))) and \
            [gr[r] for r in sorted(gr)] == list(range(len(gr))), (comm, gr)

    colls = collections.defaultdict(lambda: collections.defaultdict(set))  # comm -> seq -> {(rank, op)}
    for e in events:
        if isinstance(e, ev.CollEnter):
            colls[e.comm][e.seq].add((e.rank, e.op))
    per_group = {}
    for comm, by_seq in colls.items():
        g = group(members[comm])
        assert sorted(by_seq) == list(range(1, len(by_seq) + 1)), (comm, sorted(by_seq)[:10])  # no gaps
        for seq, entries in by_seq.items():
            assert {r for r, _ in entries} == g and len({op for _, op in entries}) == 1 and len(entries) == len(g), \
                (comm, seq, sorted(entries))
        per_group[g] = len(by_seq)
    for g in TP:
        assert per_group.get(g) == 2 * LAYERS * MICRO * STEPS, (sorted(g), per_group.get(g))
    for g in DP:
        assert per_group.get(g) == STEPS, (sorted(g), per_group.get(g))
    for g in PP:
        assert g not in per_group, sorted(g)  # p2p only

    sends, recvs = collections.Counter(), collections.Counter()
    for e in events:
        if isinstance(e, ev.P2P):
            g = group(members[e.comm])
            assert g in PP, (e.comm, sorted(g))
            peer = next(r for r, gr in group_ranks[e.comm].items() if gr == e.peer)
            (sends if e.op == "send" else recvs)[(e.comm, e.rank, peer) if e.op == "send" else
                                                 (e.comm, peer, e.rank)] += 1
    assert sends == recvs and len(sends) == 8 and set(sends.values()) == {MICRO * STEPS}, (sends, recvs)
