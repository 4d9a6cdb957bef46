"""RDMA probe family against Debian's real libibverbs.so.1, no RDMA device: every call decoded exactly.

tests/workloads/ibverbs_calls.py hands ibv_create_qp / ibv_modify_qp / ibv_destroy_qp objects built in
ctypes buffers (a fake device "ccld_fake0", two QPs, attrs full of 0xEE garbage outside the fields
the mask names). libibverbs jumps to the fake provider, which returns EOPNOTSUPP; the entry uprobes
have fired by then. We attach before the workload calls, and check each record field by field.
"""
import json
import os
import selectors
import subprocess
import sys
import time

import pytest

from recorder import Recorder

from ccld import wire as ev
from ccld.bpf import rdma
from ccld.bpf.progcache import bpf_available

pytestmark = pytest.mark.bpf

WORKLOAD = os.path.join(os.path.dirname(__file__), "..", "workloads", "ibverbs_calls.py")
READY_TIMEOUT_S = 60
RUN_TIMEOUT_S = 60
DRAIN_QUIET_MS = 300      # stop draining after this long without a new record
EOPNOTSUPP = 95

# The workload's PLAN, restated so a change on one side only fails here.
QP_A, QP_B = 0x000ABC, 0x123456
GID_A = "00000000000000000000ffff0a000207"
RC, UD = 2, 4
MASK_INIT = 1 | (1 << 4) | (1 << 5) | (1 << 3)
MASK_RTR = 1 | (1 << 7) | (1 << 8) | (1 << 20) | (1 << 12) | (1 << 17) | (1 << 15)
MASK_RTS = 1 | (1 << 9) | (1 << 10) | (1 << 11) | (1 << 16) | (1 << 13)
MASK_TIMEOUT = 1 << 9
# (qp, qp_num, attr_mask, state, dest_qp_num, dlid, port, ah_port, is_global, dgid) of each modify, in order
MODIFIES = [
    ("A", QP_A, MASK_INIT, 1, -1, -1, 1, -1, 0, "0" * 32),
    ("A", QP_A, MASK_RTR, 2, 0x0BEEF0, 0, -1, 1, 1, GID_A),
    ("A", QP_A, MASK_RTS, 3, -1, -1, -1, -1, 0, "0" * 32),
    ("B", QP_B, MASK_INIT, 1, -1, -1, 2, -1, 0, "0" * 32),
    ("B", QP_B, MASK_RTR, 2, 0x654321, 0x1234, -1, 2, 0, "0" * 32),
    ("B", QP_B, MASK_RTS, 3, -1, -1, -1, -1, 0, "0" * 32),
    ("B", QP_B, MASK_TIMEOUT, -1, -1, -1, -1, -1, 0, "0" * 32),
]


def _need_bpf():
    problem = bpf_available()
    if problem is not None:
        pytest.skip(f"{problem} ({problem.hint})")


def _read_line(proc, prefix: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    while time.monotonic() < deadline:
        if sel.select(timeout=0.2):
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith(prefix):
                return line.strip()
    proc.kill()
    raise AssertionError(f"workload printed no {prefix!r} line within {timeout_s}s (is libibverbs1 installed? "
                         f"scripts/setup.sh installs it): {proc.stderr.read()[-2000:]}")


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """Run the workload under RdmaFamily; return (ready info, done info, library path, attachment,
    records, family stats)."""
    _need_bpf()
    go = tmp_path_factory.mktemp("rdma") / "go"
    proc = subprocess.Popen([sys.executable, WORKLOAD, "--go-file", str(go)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rec = Recorder(rdma.RdmaFamily.KINDS)
    records = rec.recs
    fam = rdma.RdmaFamily(rec)
    try:
        ready = json.loads(_read_line(proc, "ready ", READY_TIMEOUT_S)[len("ready "):])
        assert ready["pid"] == proc.pid
        fam.load()
        lib = fam.find_lib(proc.pid)
        assert lib is not None, "libibverbs.so.1 is not in the workload's /proc/PID/maps after `ready`"
        att = fam.attach(proc.pid, lib)
        go.touch()
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
        assert proc.returncode == 0, f"workload failed (rc {proc.returncode}):\n{out[-2000:]}\n{err[-2000:]}"
        done = json.loads(next(ln for ln in out.splitlines() if ln.startswith("done "))[len("done "):])
        last, quiet_since = -1, time.monotonic()
        while time.monotonic() - quiet_since < DRAIN_QUIET_MS / 1e3:
            fam.poll(50)
            if len(records) != last:
                last, quiet_since = len(records), time.monotonic()
        stats = {"lost": fam.lost(), "bad": dict(fam.bad_records)}
        fam.detach(proc.pid)
        yield ready, done, lib, att, records, stats
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        fam.close()


def _of(records, kind):
    return [r for k, r in records if k == kind]


def test_probes_on_the_default_symbol_versions_only(traced):
    _, _, lib, att, _, stats = traced
    assert os.path.basename(lib).startswith("libibverbs.so.1")
    assert sorted(s for s, _ in att.points) == ["ibv_create_qp", "ibv_destroy_qp", "ibv_modify_qp"]
    assert att.missing == [] and att.ret_points == []
    from ccld.bpf.elfver import default_symbol_addresses
    default = default_symbol_addresses(lib, ["ibv_create_qp", "ibv_modify_qp", "ibv_destroy_qp"])
    assert {s: {a} for s, a in att.points} == default
    assert stats == {"lost": 0, "bad": {}}


def test_calls_failed_safely_in_the_fake_provider(traced):
    _, done, _, _, _, _ = traced
    assert done["rcs"] == [EOPNOTSUPP] * 10
    assert done["provider_calls"] == 10
    assert done["qp_states"] == {"A": 0, "B": 0}  # a failed modify leaves qp->state alone


def test_every_record_is_from_the_workload_in_call_order(traced):
    ready, _, _, _, records, _ = traced
    assert [k for k, _ in records] == [rdma.QP_CREATE] * 2 + [rdma.QP_MODIFY] * 7 + [rdma.QP_DESTROY]
    assert {r.hdr.tgid for _, r in records} == {ready["pid"]}
    ts = [r.hdr.ts_ns for _, r in records]
    assert ts == sorted(ts)
    assert {r.dev for _, r in records} == {ready["device"].encode()}


def test_create_records(traced):
    ready, _, _, _, records, _ = traced
    creates = _of(records, rdma.QP_CREATE)
    assert [(r.pd, r.qp_type) for r in creates] == [(ready["pd"], RC), (ready["pd"], UD)]


def test_modify_records_exact_and_gated_by_the_mask(traced):
    ready, _, _, _, records, _ = traced
    got = [(r.qp, r.qp_num, r.attr_mask, r.state, r.dest_qp_num, r.dlid, r.port, r.ah_port, r.is_global,
            bytes(r.dgid).hex()) for r in _of(records, rdma.QP_MODIFY)]
    want = [(ready["qp"][m[0]],) + m[1:] for m in MODIFIES]
    assert got == want


def test_destroy_record(traced):
    ready, _, _, _, records, _ = traced
    assert [(r.qp, r.qp_num) for r in _of(records, rdma.QP_DESTROY)] == [(ready["qp"]["B"], QP_B)]


def test_translator_on_real_records(traced):
    ready, _, _, _, records, _ = traced
    out = []
    tr = rdma.RdmaTranslator(out.append)
    tr.add_process(ready["pid"], rank=5, job="j")
    for what, (rows, kinds) in records.drains:
        tr.records(rows, kinds)
    assert tr.unmatched == 0
    assert all(isinstance(e, ev.QpInfo) and e.pid == ready["pid"] and e.rank == 5 for e in out)
    got = [(e.call, e.qp_num, e.state, e.dest_qp_num, e.dgid, e.dlid, e.port) for e in out]
    assert got == [
        ("ibv_create_qp", -1, "", -1, "", -1, -1),
        ("ibv_create_qp", -1, "", -1, "", -1, -1),
        ("ibv_modify_qp", QP_A, "INIT", -1, "", -1, 1),
        ("ibv_modify_qp", QP_A, "RTR", 0x0BEEF0, GID_A, 0, 1),
        ("ibv_modify_qp", QP_A, "RTS", -1, "", -1, -1),
        ("ibv_modify_qp", QP_B, "INIT", -1, "", -1, 2),
        ("ibv_modify_qp", QP_B, "RTR", 0x654321, "", 0x1234, 2),
        ("ibv_modify_qp", QP_B, "RTS", -1, "", -1, -1),
        ("ibv_modify_qp", QP_B, "", -1, "", -1, -1),
        ("ibv_destroy_qp", QP_B, "", -1, "", -1, -1),
    ]
    # Round trip through the wire schema, as the shipper and the collector would.
    batch = ev.decode_batch(ev.encode_batch("a", "n", 1, out))
    assert batch.events == out and not batch.errors


AGENT_ATTACH_TIMEOUT_S = 60  # agent scan + symbol plan of libibverbs (small) on a loaded 2-core box
SETTLE_TIMEOUT_S = 15        # agent stopped -> its last frame reaches the collector


def test_agent_to_collector(tmp_path):
    """The whole path: the workload as a rank (RANK/WORLD_SIZE in its environment), the real Agent with
    only the rdma family, a Collector on a random 127.0.0.1 port; the timeline's RDMA table ends up
    holding exactly what the workload did."""
    _need_bpf()
    from ccld.collector.server import Collector
    from ccld.tracer.agent import Agent
    lines = []
    col = Collector(listen="tcp://127.0.0.1:*", on_line=lines.append).start()
    go = tmp_path / "go"
    env = dict(os.environ, RANK="3", WORLD_SIZE="4", LOCAL_RANK="3", CCLD_JOB="rdmajob")
    proc = subprocess.Popen([sys.executable, WORKLOAD, "--go-file", str(go)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    agent = None
    try:
        ready = json.loads(_read_line(proc, "ready ", READY_TIMEOUT_S)[len("ready "):])
        agent = Agent(col.endpoint, pids=[proc.pid], say=lines.append, probes=["rdma"])
        agent.load()
        assert agent.bpf_problem is None and [f.NAME for f, _ in agent.families] == ["rdma"], lines
        agent.start()
        deadline = time.monotonic() + AGENT_ATTACH_TIMEOUT_S
        while "rdma" not in getattr(agent.ranks.get(proc.pid), "attached", {}):
            assert time.monotonic() < deadline, f"rdma probes not attached to the workload: {lines}"
            time.sleep(0.05)
        go.touch()
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
        assert proc.returncode == 0, f"workload failed (rc {proc.returncode}):\n{out[-2000:]}\n{err[-2000:]}"
        agent.stop()
        sent, aid = agent.shipper.sent_frames, agent.agent_id
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        got = 0
        while time.monotonic() < deadline:
            with col._lock:  # the timeline belongs to the ingest thread while the collector runs
                got = col.timeline.agents.get(aid, {}).get("frames", 0)
            if got >= sent:
                break
            time.sleep(0.05)
        col.stop()
        assert got == sent, f"the collector got {got} of the agent's {sent} frames"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if agent is not None:
            agent.stop()
        col.stop()
    tl = col.timeline
    node = agent.node
    assert tl.events_by_kind["qp"] == 10
    assert not [k for k in tl.anomalies if k.startswith("unhandled-kind")], dict(tl.anomalies)
    rd = tl.rdma
    assert rd.creates == {(node, ready["pid"]): 2}
    assert list(rd.qps) == [(node, ready["pid"], QP_A)]  # B was destroyed
    a = rd.qps[(node, ready["pid"], QP_A)]
    assert (a.rank, a.job, a.state, a.dest_qp_num, a.dgid, a.dlid, a.port) == (
        3, "rdmajob", "RTS", 0x0BEEF0, GID_A, 0, 1)
    assert rd.peer_of(node, ready["pid"], QP_A) is None  # its peer is not a traced rank
