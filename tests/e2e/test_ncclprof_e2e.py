"""ccld's NCCL profiler plugin end to end, without a GPU: `ccld run` injects the real plugin into a
4-rank job (torchrun) whose ranks play NCCL against it (tests/workloads/fake_nccl_job.py: the plugin's
published ABI, a ring all-reduce every 40 ms with kernel channels and proxy steps); the plugin's
datagrams reach the agent's sink, the collector's timeline and detectors, and the findings file.

1. A link whose sender's steps stop completing (rank 1 -> 2) while every rank waits inside the
   collective: `fault` naming exactly that link, from NCCL's own proxy progress (no TCP involved).
2. A rank whose kernel never starts (rank 2) while the others' kernels wait: `fault` naming rank 2.
3. A slow link (rank 3 -> 0: each of its send steps waits 5 ms longer on the network) while every
   rank enters on time and every all-reduce gets slower: `comm-slow` naming exactly that directed
   link, localised from NCCL's proxy progress (no TCP link to judge: `--no-bpf`, as over InfiniBand).
Healthy running before each fault must raise nothing, and every collective must arrive numbered
alike on every rank (NCCL's communicator hash and ccld's per-communicator numbering).
"""
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from ccld import wire as ev
from ccld.diagnose import nccllinks
from ccld.ncclprof import build
from ccld.store import read_store

pytestmark = pytest.mark.e2e

CCLD = [sys.executable, "-m", "ccld.cli"]
JOB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "workloads", "fake_nccl_job.py")
PERIOD_MS = 40
FAULT_AT = 250           # 10 s of healthy collectives first
START_IN_S = 8.0         # ccld run and torchrun start the ranks within this
HANG_DEADLINE_S = 15.0
# slow-link: the link's own baseline of network wait per step ends nccllinks.GUARD_S before the
# slowdown and needs nccllinks.MIN_STEPS steps (4 a collective): 3 s more than the guard is ample
SLOW_FAULT_AT = int((nccllinks.GUARD_S + 3.0) * 1000 / PERIOD_MS)
SLOW_FOR = 300           # collectives run slow (12 s: comm-slow holds 5 s before it is said), then
                         # the job finalizes
SLOW_STEP_MS = 5         # a step's extra wait: 4 steps a collective make it ~20 ms slower, ~15x
SLOW_DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    got = build.build(str(tmp_path_factory.mktemp("plugin")))
    assert got.path is not None, got.reason  # gcc is installed by setup; no skip
    return got.path


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(plugin, tmp_path, *fault, fault_at=FAULT_AT, collectives=100000, extra=()):
    store, findings = tmp_path / "store", tmp_path / "findings.jsonl"
    start = time.time() + START_IN_S
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CCLD_", "NCCL_", "RANK", "WORLD_SIZE"))}
    env.update(PYTHONUNBUFFERED="1", CCLD_NCCLPROF_FORCE="1", CCLD_NCCLPROF_LIB=plugin)
    cmd = CCLD + ["run", "--no-bpf", "--store", str(store), "--findings", str(findings), "--",
                  sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr",
                  "127.0.0.1", "--master-port", str(free_port()), JOB, "--start-at", f"{start:.3f}",
                  "--collectives", str(collectives), "--period-ms", str(PERIOD_MS), "--fault", *fault,
                  "--fault-at", str(fault_at), "--hold-s", "14", *extra]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, cwd=str(tmp_path))
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert out.count("ccld: NCCL profiler plugin: offered to the job's NCCL") == 1, out
    rows = [json.loads(line) for line in findings.read_text().splitlines()] if findings.exists() else []
    onset = start + fault_at * PERIOD_MS / 1000
    return out, rows, onset, store


def real(rows):
    return [f for f in rows if f.get("kind") in ("hang", "slow") and not (f.get("evidence") or {}).get("informational")]


def check_store(store, ranks=4, first=FAULT_AT):
    """Every rank's collectives arrived through the plugin, numbered alike: seq n is one collective;
    the first `first` of them on every rank (those before the fault, or all of a job that finishes)."""
    enters = {}
    statuses = []
    for _, frame in read_store(str(store)):
        for e in ev.decode_batch(frame).events:
            if isinstance(e, ev.CollEnter):
                enters.setdefault(e.rank, []).append((e.seq, e.lib_seq, e.comm, e.op))
            elif isinstance(e, ev.ProbeStatus) and e.family == "ncclprof":
                statuses.append((e.pid, e.ok))
    assert sorted(enters) == list(range(ranks))
    assert len({ok for _, ok in statuses}) == 1 and statuses[0][1] and len({p for p, _ in statuses}) == ranks
    for r, got in enters.items():
        assert [s for s, _, _, _ in got[:first]] == list(range(first)), r
        assert {c for _, _, c, _ in got} == {got[0][2]} and got[0][2].endswith("/nccl:5eed0000cafe0042")
        assert all(s == ls and op == "allreduce" for s, ls, _, op in got)  # one function: NCCL's number agrees


def test_a_stalled_nccl_link_is_named_from_the_plugins_proxy_progress(plugin, tmp_path):
    out, rows, onset, store = run_job(plugin, tmp_path, "stall-link", "1", "2")
    found = real(rows)
    assert found, out
    first = found[0]
    assert (first["kind"], first["class"], first["ranks"], first.get("link")) == ("hang", "fault", [1, 2], [1, 2]), \
        json.dumps(first)[:2000]
    assert first["evidence"]["reason"] == "proxy-stalled"
    assert onset <= first["detected_at"] <= onset + HANG_DEADLINE_S
    assert all(f["detected_at"] >= onset for f in found), "a finding before the fault"
    check_store(store)


def test_a_rank_whose_kernel_never_starts_is_named(plugin, tmp_path):
    out, rows, onset, store = run_job(plugin, tmp_path, "no-kernel", "2")
    found = real(rows)
    assert found, out
    first = found[0]
    assert (first["kind"], first["class"], first["ranks"]) == ("hang", "fault", [2]), json.dumps(first)[:2000]
    assert first["evidence"]["reason"] == "not-started"
    queued = first["evidence"]["queued"]  # the kernel's launch wait, from the plugin's first kernel channel
    assert list(queued["not_started_for_s"]) == ["2"] and queued["n_started"] == 3, queued
    assert queued["usual_s"] is not None and queued["usual_s"] < PERIOD_MS / 1000, queued
    assert onset <= first["detected_at"] <= onset + HANG_DEADLINE_S
    assert all(f["detected_at"] >= onset for f in found), "a finding before the fault"
    check_store(store)


def test_a_slow_nccl_link_is_named_from_the_plugins_proxy_progress(plugin, tmp_path):
    t0 = time.monotonic()
    out, rows, onset, store = run_job(plugin, tmp_path, "slow-link", "3", "0", fault_at=SLOW_FAULT_AT,
                                      collectives=SLOW_FAULT_AT + SLOW_FOR,
                                      extra=("--slow-step-ms", str(SLOW_STEP_MS)))
    print(f"slow-link job under ccld run: {time.monotonic() - t0:.1f} s")
    found = real(rows)
    assert found, out
    print(f"first finding {found[0]['detected_at'] - onset:.1f} s after the fault")
    assert all(f["detected_at"] >= onset for f in found), "a finding before the fault"
    first = found[0]
    assert (first["kind"], first["class"], first["ranks"], first.get("link")) == ("slow", "comm-slow", [0, 3], [3, 0]), \
        json.dumps(first)[:2000]
    evidence = first["evidence"]
    assert evidence["localised_by"] == "nccl-proxy", json.dumps(evidence)[:2000]
    judged = evidence["nccl_links"]  # every link judged, the slow one far out of its baseline
    assert judged["3->0"]["x"] >= nccllinks.WAIT_FACTOR and len(judged) == 4, judged
    assert onset <= first["detected_at"] <= onset + SLOW_DEADLINE_S
    assert len(found) == 1, json.dumps(found[1:])[:3000]
    check_store(store, first=SLOW_FAULT_AT + SLOW_FOR)  # a slow job loses nothing
