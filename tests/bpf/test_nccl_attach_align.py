"""Mid-run attach on the real libnccl.so.2's uprobes, no GPU: two ranks first seen at different points
of one job's collectives are aligned by the collector (ccld/timeline/align.py).

Two tests/workloads/nccl_calls.py processes (--stream) call collective k of one mixed stream at the same
CLOCK_MONOTONIC instant, rank 1 only from collective FIRST_1 on: what the agent sees of a job it
attached to when rank 0 was at collective 0 and rank 1 at FIRST_1. Their communicators were never
init'ed under the probes, so each process names its own (`handle-r<rank>-...`) and counts from 0.
The records go through the real translator into frames and a Timeline, which must join the two with
offset FIRST_1 exactly.
"""
import json
import os
import subprocess
import sys
import time

import pytest

from recorder import Recorder, rows_of
from test_nccl_probes import _libnccl

from ccld import wire as ev
from ccld.bpf import nccl
from ccld.bpf.progcache import bpf_available
from ccld.timeline.timeline import Timeline

pytestmark = pytest.mark.bpf

WORKLOAD = os.path.join(os.path.dirname(__file__), "..", "workloads", "nccl_calls.py")
READY_TIMEOUT_S = 60
RUN_TIMEOUT_S = 60
N, FIRST_1, PERIOD_MS = 90, 9, 20.0  # collectives of the stream; where rank 1 is first seen; one every 20 ms
LEAD_S = 1.0                          # from the go-file to collective 0: both processes are waiting by then
EVENTS_PER_FRAME = 16                 # frames of the shipped events, half a second of receive time apart


def _ready(proc) -> dict:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("ready "):
            return json.loads(line[len("ready "):])
    proc.kill()
    raise AssertionError(f"workload printed no ready line: {proc.stderr.read()[-2000:]}")


def _drive(fam, procs, go, lead_s: float, timeout_s: float) -> None:
    """Start the workloads (the go-file names the CLOCK_MONOTONIC ns they start at, lead_s from now),
    drain the family until they exit (each with status 0), then drain what they left."""
    tmp = go.with_name(go.name + ".tmp")
    tmp.write_text(str(time.monotonic_ns() + int(lead_s * 1e9)))
    tmp.rename(go)  # whole, at once: the workloads read the start time from it
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        fam.poll(50)
    for p in procs:
        assert p.wait(timeout=5) == 0, p.stderr.read()[-2000:]
    for _ in range(6):
        fam.poll(50)


def test_two_ranks_attached_at_different_points_are_aligned(tmp_path):
    problem = bpf_available()
    if problem is not None:
        pytest.skip(f"{problem} ({problem.hint})")
    lib = _libnccl()
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, WORKLOAD, "--lib", lib, "--go-file", str(go), "--stream", str(N),
                               "--first", str(first), "--period-ms", str(PERIOD_MS)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for first in (0, FIRST_1)]
    out = []
    tr = nccl.NcclTranslator(rows_of(out))
    fam = nccl.NcclFamily(Recorder(nccl.NcclFamily.KINDS, forward=tr))
    try:
        ready = [_ready(p) for p in procs]
        fam.load()
        for rank, (p, r) in enumerate(zip(procs, ready)):
            tr.add_process(p.pid, rank, "j")
            fam.attach(p.pid, fam.find_lib(p.pid))
        _drive(fam, procs, go, LEAD_S, RUN_TIMEOUT_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        fam.close()

    colls = [e for e in out if isinstance(e, ev.CollEnter)]
    assert [sum(e.rank == r for e in colls) for r in (0, 1)] == [N, N - FIRST_1]  # no call lost
    names = [f"j/nccl:handle-r{r}-{ready[r]['comm']:x}" for r in (0, 1)]
    assert {e.comm for e in colls} == set(names)

    tl = Timeline()
    mono, wall = time.monotonic_ns(), time.time_ns()
    head = [ev.RankInfo(pid=p.pid, rank=r, world_size=2, local_rank=r, node="n", job="j", ts_ns=0)
            for r, p in enumerate(procs)]
    shipped = head + [e for e in out if isinstance(e, (ev.CommInit, ev.CollEnter))]
    recv = wall / 1e9
    for i in range(0, len(shipped), EVENTS_PER_FRAME):
        clock = ev.ClockSample(mono_ns=mono, wall_ns=wall, ts_ns=mono)
        frame = ev.encode_batch("agent", "n", i // EVENTS_PER_FRAME + 1, shipped[i:i + EVENTS_PER_FRAME] + [clock])
        recv += 0.5
        tl.ingest(ev.decode_batch(frame), recv)
    aligned = names[0].replace("handle-", "aligned-")
    assert {n: v[:2] for n, v in tl.align.rewrites.items()} == {names[0]: (aligned, 0), names[1]: (aligned, FIRST_1)}
    start = tl.align.rewrites[names[0]][2]
    g = tl.comms[aligned]
    assert all(set(g.colls[k].enter) == {0, 1} for k in range(start, N))
    assert all(len(set(g.colls[k].sizes.values())) == 1 for k in range(start, N))  # one op and size per collective
