"""The export's C accelerator (ccld/export/_hotpath.c) writes the same trace as the Python loops it
mirrors, byte for byte, with the same counts: on healthy jobs, on odd ones (async collectives that
overlap, ranks that never end, duplicate and orphan events, failed collectives, several
communicators, numbers past 64 bits, clock steps), with a time window and a rank subset, for the
Perfetto and the Chrome JSON sinks. And it is built wherever a C compiler is."""
from __future__ import annotations

import os
import random
import shutil

import msgpack
import pytest

from ccld import events as ev
from ccld.collector.store import StoreWriter
from ccld.export import accel, export_trace

from ccld_synth import T0, FakeAgent

pytestmark = pytest.mark.unit

WORLD, NODES = 6, 2


def odd_job(path, seed: int, n_colls: int = 120) -> None:
    """A store of WORLD ranks on NODES nodes with every oddity the row loops branch on, each at random."""
    rnd = random.Random(seed)
    agents = [FakeAgent(f"agent-{n}", f"node{n}", boot_unix=T0 - 1000.0 * (n + 1)) for n in range(NODES)]
    node_of = {r: r % NODES for r in range(WORLD)}
    comms = ["job/nccl:0", "job/nccl:1"]
    pending = [[] for _ in range(NODES)]
    for r in range(WORLD):
        a = agents[node_of[r]]
        pending[node_of[r]] += [ev.RankInfo(pid=100 + r, rank=r, world_size=WORLD, local_rank=r // NODES,
                                            node=a.node, job="job", ts_ns=a.mono(T0))]
        pending[node_of[r]] += [ev.CommInit(pid=100 + r, rank=r, ts_ns=a.mono(T0), backend="nccl", comm=c,
                                            group_rank=r, group_size=WORLD) for c in comms]
    w = StoreWriter(str(path))
    t = T0 + 1
    seqs = {c: 0 for c in comms}
    batch = 0
    for i in range(n_colls):
        comm = comms[rnd.random() < 0.3]
        seqs[comm] += 1
        seq = seqs[comm]
        count = 1024 * (1 + (rnd.random() < 0.1))  # now and then a rank with another size
        for r in range(WORLD):
            a, n = agents[node_of[r]], node_of[r]
            b = t + rnd.random() * 0.002
            e = b + 0.001 + rnd.random() * (0.02 if rnd.random() < 0.1 else 0.001)  # some overlap the next
            if rnd.random() < 0.02:
                continue  # this rank never takes part
            mono_b = a.mono(b)
            if rnd.random() < 0.01:
                mono_b += 2 ** 63  # past int64: the C loops hand such rows to Python
            pending[n].append(ev.CollEnter(pid=100 + r, rank=r, ts_ns=mono_b, backend="nccl", comm=comm, seq=seq,
                                           op=rnd.choice(["allreduce", "allgather"]) if r == 0 else "allreduce",
                                           tid=100 + r, count=count if r == 1 else 1024, dtype="float32",
                                           nbytes=4 * (count if r == 1 else 1024)))
            if rnd.random() < 0.02:
                pending[n].append(ev.CollEnter(pid=100 + r, rank=r, ts_ns=mono_b, backend="nccl", comm=comm,
                                               seq=seq, op="allreduce"))  # a duplicate
            if rnd.random() < 0.9:
                pending[n].append(ev.WorkStart(pid=100 + r, rank=r, ts_ns=a.mono(b + rnd.random() * 0.003),
                                               comm=comm, seq=seq))
            if rnd.random() < 0.03:
                continue  # never ends: drawn to the end, unfinished
            end = a.mono(e) - (10**7 if rnd.random() < 0.02 else 0)  # a clock step: end before enter
            ok = rnd.random() > 0.03
            pending[n].append(ev.WorkEnd(pid=100 + r, rank=r, ts_ns=end, comm=comm, seq=seq, ok=ok,
                                         error="" if ok else "connection reset by peer"))
        if rnd.random() < 0.03:
            pending[0].append(ev.WorkEnd(pid=100, rank=0, ts_ns=agents[0].mono(t), comm=comm, seq=10**6))
        t += 0.004
        if i % 10 == 9 or i == n_colls - 1:
            for n in range(NODES):
                batch += 1
                evs = pending[n] + [agents[n].clock(t)]
                rnd.shuffle(evs) if rnd.random() < 0.1 else None  # rows out of order now and then
                w.append(ev.encode_batch(agents[n].agent, agents[n].node, batch, evs,
                                         columns=rnd.random() < 0.85), t)
                pending[n] = []
    w.close()


def export_both(store, tmp_path, fmt, **kw):
    """The trace's bytes and the export's counts, with the accelerator and without."""
    got = {}
    hot = accel.hot
    try:
        for name, h in (("c", hot), ("python", None)):
            accel.hot = h
            out = tmp_path / f"{name}.{fmt}"
            stats = export_trace(str(store), str(out), fmt, findings=[], **kw)
            for k in ("seconds", "events_per_s", "write_s", "replay_s", "out"):
                stats.pop(k, None)
            got[name] = (out.read_bytes(), stats)
    finally:
        accel.hot = hot
    return got


needs_hot = pytest.mark.skipif(accel.hot is None, reason="the C accelerator is not built here "
                               "(no C compiler at install, or CCLD_PURE_PYTHON=1)")


def test_the_accelerator_is_built_where_a_compiler_is():
    if os.environ.get("CCLD_PURE_PYTHON", "") not in ("", "0"):
        pytest.skip("CCLD_PURE_PYTHON=1: the Python loops on purpose")
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler here: the export runs in Python")
    assert accel.hot is not None, "ccld/export/_hotpath.c was not built: run `make setup` (pip install -e .)"


@needs_hot
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
@pytest.mark.parametrize("fmt", ["perfetto", "json"])
def test_c_and_python_write_the_same_trace(tmp_path, seed, fmt):
    odd_job(tmp_path / "s", seed)
    got = export_both(tmp_path / "s", tmp_path, fmt)
    (c, c_stats), (py, py_stats) = got["c"], got["python"]
    assert c_stats == py_stats
    assert c == py
    # the job's oddities were there to take: partial and failed collectives, extra lanes, dropped rows
    assert py_stats["slices"] > 1000 and py_stats["flows"] > 100
    assert py_stats["anomalies"].get("end-without-enter", 0) > 0


@needs_hot
@pytest.mark.parametrize("kw", [dict(ranks=[0, 3, 4]), dict(t_from=T0 + 1.1,
                                                              t_to=T0 + 1.3)],
                         ids=["ranks", "window"])
def test_c_and_python_agree_with_filters(tmp_path, kw):
    odd_job(tmp_path / "s", 7)
    got = export_both(tmp_path / "s", tmp_path, "perfetto", **kw)
    assert got["c"] == got["python"] and got["c"][1]["slices"] > 50


@needs_hot
def test_hostile_blocks_are_counted_alike(tmp_path):
    """Blocks whose columns hold floats, strings, bools or huge ints: dropped or handed to Python alike."""
    a = FakeAgent("agent-0", "node0", boot_unix=T0 - 1000.0)
    t = a.mono(T0 + 1)
    base = {"k": "coll", "n": 2, "at": 0, "same": {"backend": "gloo", "comm": "c", "op": "allreduce"}}
    cols = {"seq": [1, 1], "pid": [1, 2], "rank": [0, 1], "ts_ns": [t, t + 5]}
    blocks = [dict(base, cols=dict(cols, ts_ns=[t, 1.5])),
              dict(base, cols=dict(cols, seq=[True, True])),
              dict(base, cols=dict(cols, seq=[2, 2], ts_ns=[t, 2 ** 64 - 1])),
              dict(base, cols=dict(cols, seq=[3, 3], pid=[2 ** 64 - 5, 1])),
              {"k": "end", "n": 2, "at": 0, "same": {"comm": "c"},
               "cols": {"seq": [1, 3], "pid": [1, 2 ** 64 - 5], "rank": [0, 0], "ts_ns": [t + 9, t + 9]}},
              {"k": "start", "n": 2, "at": 0, "same": {"comm": "c"},
               "cols": {"seq": [1, 2], "pid": [2, 1], "rank": [1, 0], "ts_ns": [t + 2, "x"]}}]
    w = StoreWriter(str(tmp_path / "s"))
    w.append(msgpack.packb({"v": [1, 4], "agent": a.agent, "node": a.node, "batch": 1,
                            "events": [a.clock(T0 + 1).to_wire()], "blocks": blocks}), T0 + 1)
    w.close()
    got = export_both(tmp_path / "s", tmp_path, "perfetto")
    assert got["c"] == got["python"] and got["c"][1]["bad_events"] >= 2
