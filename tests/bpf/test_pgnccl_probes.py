"""The ProcessGroupNCCL probes (ccld/bpf/pgnccl.bpf.c) on a library with torch's own symbols and calling
convention (tests/workloads/fake_torch_cuda.cpp, built here as libtorch_cuda.so; no CUDA torch runs
without a GPU), in two real processes attached mid-run at different points of one job.

Rank 1 had made EARLY collectives of the default group before the probes came, rank 0 none, and
rank 0 also makes p2p ops (a pipeline stage's): c10d's collective numbers must still be the same on
both ranks for every collective, with no alignment step in the collector; the p2p works must not
become collectives; the group made after the attach must carry its size, the one made before -1.
"""
import json
import os
import subprocess
import sys
import time

import pytest

from recorder import Recorder, rows_of
from test_nccl_attach_align import _drive, _ready

from ccld import wire as ev
from ccld.bpf import pgnccl
from ccld.bpf.progcache import bpf_available
from ccld.timeline.timeline import Timeline

pytestmark = pytest.mark.bpf

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "..", "workloads", "fake_torch_cuda.cpp")
WORKLOAD = os.path.join(HERE, "..", "workloads", "pgnccl_calls.py")
N, EARLY, PERIOD_MS = 31, 7, 20.0  # collectives of group "0" after the go; made by rank 1 before the attach
LEAD_S = 1.0
RUN_TIMEOUT_S = 60


def build_fake(directory) -> str:
    """tests/workloads/fake_torch_cuda.cpp as DIR/libtorch_cuda.so (the name the family looks for)."""
    os.makedirs(directory, exist_ok=True)
    out = os.path.join(directory, "libtorch_cuda.so")
    subprocess.run(["g++", "-shared", "-fPIC", "-O1", "-o", out, SOURCE], check=True, capture_output=True)
    return out


def test_ranks_attached_at_different_points_share_c10ds_collective_numbers(tmp_path):
    problem = bpf_available()
    if problem is not None:
        pytest.skip(f"{problem} ({problem.hint})")
    lib = build_fake(str(tmp_path / "lib"))
    go = tmp_path / "go"
    args = [[], ["--early", str(EARLY)]]
    procs = [subprocess.Popen([sys.executable, WORKLOAD, "--lib", lib, "--go-file", str(go), "--rank", str(r),
                               "--n", str(N), "--period-ms", str(PERIOD_MS)] + (["--p2p"] if r == 0 else []) + extra,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r, extra in enumerate(args)]
    out = []
    tr = pgnccl.PgncclTranslator(rows_of(out))
    fam = pgnccl.PgncclFamily(Recorder(pgnccl.PgncclFamily.KINDS, forward=tr))
    try:
        for p in procs:
            _ready(p)
        fam.load()
        for rank, p in enumerate(procs):
            tr.add_process(p.pid, rank, "j")
            att = fam.attach(p.pid, fam.find_lib(p.pid))
            assert not att.missing, att.missing  # all three functions found by their torch names
        _drive(fam, procs, go, LEAD_S, RUN_TIMEOUT_S)
        done = [json.loads(next(ln for ln in p.stdout.read().splitlines() if ln.startswith("done "))[5:])
                for p in procs]
        assert fam.lost() == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        fam.close()

    pids = [p.pid for p in procs]
    colls = [e for e in out if isinstance(e, ev.CollEnter)]
    for rank, pid in enumerate(pids):
        mine = [e for e in colls if e.pid == pid]
        world = [e for e in mine if e.comm == "j/nccl-pg:0"]
        sub = [e for e in mine if e.comm == "j/nccl-pg:1"]
        # every collective seen, numbered as c10d numbered it in the process (its own account)
        assert [e.seq for e in world] == done[rank]["0"]
        assert [e.seq for e in sub] == done[rank]["1"]
        assert len(mine) == len(world) + len(sub)  # no p2p work became a collective
        assert all(e.rank == rank and e.backend == "nccl" and e.lib_seq == e.seq for e in mine)
    # the same collective has the same number on both ranks, though rank 1 had made EARLY more
    assert done[0]["0"] == list(range(1, N + 1)) and done[1]["0"] == list(range(EARLY + 1, EARLY + N + 1))
    ops = {pid: {e.seq: e.op for e in colls if e.pid == pid and e.comm == "j/nccl-pg:0"} for pid in pids}
    both = set(ops[pids[0]]) & set(ops[pids[1]])
    assert both == set(range(EARLY + 1, N + 1))
    assert all(ops[pids[0]][s] == ops[pids[1]][s] for s in both)  # and the same op
    assert tr.counters["p2p_left_to_api"] == len(done[0]["p2p"]) > 0
    inits = {(e.pid, e.comm): e for e in out if isinstance(e, ev.CommInit)}
    assert set(inits) == {(pid, c) for pid in pids for c in ("j/nccl-pg:0", "j/nccl-pg:1")}
    for rank, pid in enumerate(pids):
        before, after = inits[(pid, "j/nccl-pg:0")], inits[(pid, "j/nccl-pg:1")]
        assert (before.group_rank, before.group_size, before.seq_source) == (rank, -1, ev.SEQ_LIBRARY)
        assert (after.group_rank, after.group_size, after.seq_source) == (rank, 2, ev.SEQ_LIBRARY)

    # the collector joins them as they are: every collective both made has both ranks entered
    tl = Timeline()
    mono, wall = time.monotonic_ns(), time.time_ns()
    head = [ev.RankInfo(pid=p, rank=r, world_size=2, local_rank=r, node="n", job="j", ts_ns=0)
            for r, p in enumerate(pids)]
    clock = ev.ClockSample(mono_ns=mono, wall_ns=wall, ts_ns=mono)
    frame = ev.encode_batch("agent", "n", 1, head + [e for e in out if isinstance(e, (ev.CommInit, ev.CollEnter))]
                            + [clock])
    tl.ingest(ev.decode_batch(frame), wall / 1e9)
    g = tl.comms["j/nccl-pg:0"]
    shared = [s for s in range(EARLY + 1, N + 1) if s in g.colls]
    assert len(shared) == N - EARLY and all(set(g.colls[s].enter) == {0, 1} for s in shared)
    assert not tl.align.rewrites  # nothing needed aligning
