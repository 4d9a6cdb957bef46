"""ccld's NCCL profiler plugin loaded by a real NCCL (torch's) on one GPU. Run by bench/gpu_check.sh on a
machine with a GPU; skipped, with the reason, elsewhere (and where no C compiler can build the plugin).

The job (tests/workloads/ncclprof_gpu_job.py) runs torch.distributed over NCCL with the plugin named by
absolute path in NCCL_PROFILER_PLUGIN and an NcclProfSink here as its endpoint: two communicators, on
each 23 all-reduces and a broadcast, then 7 all_to_all (the list form: ncclSend + ncclRecv to every
rank, this one included). What one GPU allows, from NCCL's source (2.23 .. 2.30):
  - one rank per GPU before NCCL 2.30 ("Duplicate GPU detected"); 2.30 allows more with
    NCCL_MULTI_RANK_GPU_ENABLE=1, and then the two-rank test below sees real collectives;
  - a one-rank communicator runs its collectives without a kernel plan (enqueue.cc, taskAppend:
    nRanks == 1 -> ncclLaunchOneRank) and calls the profiler for none of them; its init, finalize and
    sends/receives to self (a plan with p2p tasks, but no proxy op, hence no kernel-channel events) are real.
So with one rank: NCCL loads the plugin by path and picks the ncclProfiler_vN its version implies, both
communicators are announced at init (v4+), every send and receive to self arrives numbered, "bye" comes
at the last finalize, and nothing is lost; collectives arrive all, exactly, or (as NCCL's source says)
not at all. Everything seen goes to $OUT/ncclprof_gpu.json before any assertion, so a failed device run
still brings the evidence back.
"""
import collections
import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from ccld import wire as ev
from ccld.bpf.rows import Rows
from ccld.ncclprof import build
from ccld.tracer.ncclprof_sink import NcclProfSink

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = os.path.join(ROOT, "tests", "workloads", "ncclprof_gpu_job.py")
N = 23          # all-reduces per communicator (then one broadcast): a prime, so a lost or doubled one shows
P2P_ROUNDS = 7  # all_to_all rounds on the default group
JOB_TIMEOUT_S = 240
BYE_WAIT_S = 15  # after the job exits: its last datagrams are already queued here; this only bounds a miss
NCCL_PATH_MAX = 255  # NCCL copies NCCL_PROFILER_PLUGIN into a 256-byte buffer (plugin_open.cc, MAX_STR_LEN)
OUT_FILE = "ncclprof_gpu.json"
sys.path.insert(0, os.path.join(ROOT, "bench"))
from ncclprof_overhead import nccl_gpu_missing  # noqa: E402  (the bench's own check: one place)
_saved = {}


@pytest.fixture(scope="module")
def plugin():
    reason = nccl_gpu_missing()
    if reason:
        pytest.skip(reason)
    d = tempfile.mkdtemp(prefix="ccld-np-gpu-")  # short: NCCL truncates the path at 255 bytes
    got = build.build(d)
    if got.path is None:
        pytest.skip(f"the NCCL profiler plugin cannot be built here: {got.reason}")
    assert len(got.path) < NCCL_PATH_MAX, got.path
    return got.path


def save(part, data):
    """Merge one part into $OUT/ncclprof_gpu.json (when OUT is set): one file for all these tests."""
    _saved[part] = data
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, OUT_FILE), "w") as f:
            json.dump(_saved, f, indent=1, default=str)


class Got(list):
    """The sink's emit: events, the column rows expanded."""
    def __call__(self, item):
        self.extend(item.events() if isinstance(item, Rows) else [item])

    def of(self, cls):
        return [e for e in self if isinstance(e, cls)]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def expected_api(version):
    """The ncclProfiler_vN NCCL picks from ccld's plugin (which offers v1..v5): profiler.cc tries the
    newest it knows first. 2.23 v1, 2.24 v2, 2.25-2.26 v3, 2.27 v4, 2.28+ v5 (2.29's v6 is not offered)."""
    v = tuple(version[:2])
    if v < (2, 23):
        return None
    return {(2, 23): 1, (2, 24): 2, (2, 25): 3, (2, 26): 3, (2, 27): 4}.get(v, 5)


def run_job(plugin, tmp, world, extra_env=None, timeout=JOB_TIMEOUT_S):
    """The job's `world` ranks, all on GPU 0, with the plugin and a sink here. Returns what was seen."""
    got = Got()
    pids = {}
    sink = NcclProfSink(got, ident_of=lambda pid: (pids[pid], "gpu") if pid in pids else None)
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("CCLD_", "NCCL_"))}
    base.update(PYTHONPATH=os.pathsep.join([ROOT] + [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p]),
                PYTHONUNBUFFERED="1", NCCL_PROFILER_PLUGIN=plugin, CCLD_NCCLPROF_ENDPOINT=sink.path,
                NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,ENV", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                WORLD_SIZE=str(world), LOCAL_RANK="0", **(extra_env or {}))
    procs, traces, outs = [], [], []
    try:
        for r in range(world):
            trace = os.path.join(tmp, f"trace{r}.json")
            p = subprocess.Popen([sys.executable, JOB, "--iters", str(N), "--p2p", str(P2P_ROUNDS), "--trace", trace],
                                 env=dict(base, RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, cwd=tmp)
            pids[p.pid] = r
            procs.append(p)
            traces.append(trace)
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                p.kill()
                outs.append(p.communicate()[0] + f"\n[test] killed after {timeout} s")
        deadline = time.monotonic() + BYE_WAIT_S
        ok = sum(p.returncode == 0 for p in procs)  # a rank that failed before NCCL's init sends nothing
        while time.monotonic() < deadline and sum(s == "bye" for s in sink.ranks_on.values()) < ok:
            if not sink.poll():
                time.sleep(0.05)
        sink.poll(1 << 30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        sink.close()
    return summarize(got, sink, procs, outs, traces, pids)


def _api_versions(statuses):
    return sorted({int(m.group(1)) for s in statuses for m in [re.search(r"ncclProfiler_v(\d+)", s.message)] if m})


def _load(path):
    if not os.path.exists(path):
        return None  # the rank failed before it wrote what it ran
    with open(path) as f:
        return json.load(f)


def summarize(got, sink, procs, outs, traces, pids):
    """Everything the assertions read, as JSON-able values (tuple keys as strings)."""
    ran = [_load(t) for t in traces]
    statuses = [e for e in got.of(ev.ProbeStatus) if e.family == "ncclprof"]
    count = collections.Counter
    enters = collections.defaultdict(list)  # (rank, comm) -> [(seq, op, lib_seq)]
    for e in got.of(ev.CollEnter):
        enters[(e.rank, e.comm)].append((e.seq, e.op, e.lib_seq))
    p2p = collections.defaultdict(list)     # (rank, op, peer) -> [seq]
    for e in got.of(ev.P2P):
        p2p[(e.rank, e.op, e.peer)].append(e.seq)
    first = ran[0] or {}
    return {
        "returncodes": [p.returncode for p in procs],
        "nccl_version": first.get("nccl_version"), "nccl_version_from": first.get("nccl_version_from"),
        "nccl_lib": first.get("nccl_lib"), "torch": first.get("torch"), "device": first.get("device"),
        "ran": [r and r["ran"] for r in ran], "alltoall_got": [r and r["alltoall_got"] for r in ran],
        "pids": {str(pid): r for pid, r in pids.items()},
        "api_versions": _api_versions(statuses),
        "statuses": [(s.pid, s.ok, s.message) for s in statuses],
        "ranks_on": {str(k): v for k, v in sink.ranks_on.items()},
        "comms": [(e.rank, e.comm, e.group_rank, e.group_size) for e in got.of(ev.CommInit)],
        "enters": {f"{r} {c}": v for (r, c), v in enters.items()},
        "starts": {f"{r} {c}": n for (r, c), n in count((e.rank, e.comm) for e in got.of(ev.WorkStart)).items()},
        "ends": {f"{r} {c}": n for (r, c), n in count((e.rank, e.comm) for e in got.of(ev.WorkEnd)).items()},
        "p2p": {f"{r} {op} {peer}": v for (r, op, peer), v in p2p.items()},
        "p2p_ends": {f"{r} {op} {peer}": n for (r, op, peer), n in
                     count((e.rank, e.op, e.peer) for e in got.of(ev.P2PEnd)).items()},
        "p2p_shapes": sorted({(e.op, e.count, e.dtype) for e in got.of(ev.P2P)}),
        "sink_counters": dict(sink.counters), "loss": sink.loss(),
        "events_by_kind": dict(count(type(e).__name__ for e in got)),
        "first_events": [dataclasses.asdict(e) for e in got[:12]],
        "nccl_log": [line for out in outs for line in out.splitlines()
                     if re.search(r"profiler|PROFILER|NCCL version|Duplicate GPU|Multiple Ranks", line)][:40],
        "ccld_lines": [line for out in outs for line in out.splitlines() if line.startswith("ccld:")],
        "output_tail": [out[-3000:] for out in outs],
    }


def summary_line(s):
    """One line for gpu_check.sh's table."""
    enters = sum(len(v) for v in s["enters"].values())
    ran = sum(len(v) for r in s["ran"] if r for v in r.values())
    p2p = sum(len(v) for v in s["p2p"].values())
    ends = sum(s["p2p_ends"].values())
    v = ".".join(map(str, s["nccl_version"] or [])) or "?"
    api = "/".join(f"ncclProfiler_v{a}" for a in s["api_versions"]) or "no ncclProfiler_vN (the plugin never went on)"
    lost = {k: n for k, n in s["loss"].items() if n and ("drop" in k or k.endswith(("lost", "orphans")))}
    return (f"NCCL {v} picked {api}; {len({c for _, c, _, _ in s['comms']})} communicators; "
            f"collectives seen {enters} of {ran}; p2p started {p2p}, ended {ends}; "
            f"losses {lost or 'none'}")


@pytest.fixture(scope="module")
def one_rank(plugin, tmp_path_factory):
    s = run_job(plugin, str(tmp_path_factory.mktemp("one")), world=1)
    s["summary"] = summary_line(s)
    save("one_rank", s)
    return s


def _output(s):
    return "\n---\n".join(s["output_tail"])


def test_nccl_loads_the_plugin_by_path_and_it_goes_on(one_rank):
    s = one_rank
    assert s["returncodes"] == [0], _output(s)
    assert [ok for _, ok, _ in s["statuses"]] == [True], (s["statuses"], s["ccld_lines"], _output(s))
    want = expected_api(s["nccl_version"])
    assert want is not None, f"NCCL {s['nccl_version']} predates profiler plugins (2.23)"
    assert s["api_versions"] == [want], (s["nccl_version"], s["api_versions"], s["nccl_log"])
    assert list(s["ranks_on"].values()) == ["bye"], s["ranks_on"]  # the last finalize said goodbye
    assert not [line for line in s["ccld_lines"] if "plugin off" in line], s["ccld_lines"]


def test_both_communicators_are_announced(one_rank):
    s = one_rank
    comms = {c for _, c, _, _ in s["comms"]}
    if s["api_versions"] and s["api_versions"][0] >= 4:  # v4+: at NCCL's init, with nranks
        assert len(comms) == 2, s["comms"]
        assert all((r, gr, gs) == (0, 0, 1) for r, _, gr, gs in s["comms"]), s["comms"]
    else:  # v1-v3: from a communicator's first op (rank only); one-rank collectives have none
        assert 1 <= len(comms) <= 2, s["comms"]
    used = {k.split(" ", 1)[1] for k in s["enters"]}  # every collective's communicator was announced
    assert used <= comms, (used, comms)


def check_collectives(s, world):
    """Every collective each rank ran, on each communicator: entered once, numbered 0..n-1 in call order
    with the job's ops; with kernel events (v3+) started on the GPU and ended completed, never launch-only."""
    api = s["api_versions"][0]
    for rank in range(world):
        mine = {k.split(" ", 1)[1]: v for k, v in s["enters"].items() if int(k.split(" ", 1)[0]) == rank}
        assert len(mine) == 2, (rank, sorted(mine))
        ran = sorted(s["ran"][rank].values())  # both communicators ran the same: which is which does not matter
        assert sorted([op for _, op, _ in v] for v in mine.values()) == ran, mine
        for comm, v in mine.items():
            assert [seq for seq, _, _ in v] == list(range(len(v))), (rank, comm, v)
            if api >= 3:
                assert s["starts"].get(f"{rank} {comm}") == len(v), (rank, comm, s["starts"])
            assert s["ends"].get(f"{rank} {comm}") == len(v), (rank, comm, s["ends"])
    if api >= 3:
        assert s["sink_counters"].get("ends_launch_only", 0) == 0, s["sink_counters"]
    assert s["sink_counters"].get("ends_never_started", 0) == 0, s["sink_counters"]


def test_one_rank_collectives_arrive_all_or_none(one_rank):
    s = one_rank
    if not s["enters"]:
        # NCCL's one-rank path (ncclLaunchOneRank) calls no profiler event: recorded, not a failure
        assert not s["starts"] and not s["ends"], (s["starts"], s["ends"])
        return
    check_collectives(s, world=1)


def test_every_send_and_receive_to_self_is_seen(one_rank):
    s = one_rank
    assert s["alltoall_got"] == [[0.0]], s["alltoall_got"]
    want = list(range(1, P2P_ROUNDS + 1))  # the n-th op of a direction with a peer, from 1
    assert s["p2p"] == {"0 send 0": want, "0 recv 0": want}, s["p2p"]
    assert s["p2p_shapes"] == [("recv", 256, "float32"), ("send", 256, "float32")], s["p2p_shapes"]
    # Their ends are recorded, not asserted: NCCL posts no proxy op for a send to self (enqueue.cc,
    # addP2pToPlan: selfSend -> nProxyOps 0), hence no kernel-channel event, and from v3 the plugin
    # waits for one (F_END_STALE after 3000 flushes); v1/v2 end them "launched" after 10 flushes.


def test_nothing_is_lost(one_rank):
    s = one_rank
    plugin = {k: n for k, n in s["loss"].items() if not k.startswith("ncclprof_sink_") and n}
    assert plugin == {}, plugin  # drop_* counters, orphans, unknown records: all 0
    bad = {k: n for k, n in s["sink_counters"].items()
           if n and (k.startswith("bad_datagram") or k in ("datagrams_lost", "inbox_dropped", "recv_errors",
                                                             "unknown_tasks"))}
    assert bad == {}, bad


def test_collectives_on_two_ranks_of_one_gpu(plugin, one_rank, tmp_path):
    """NCCL 2.30+ lets two ranks share a GPU (NCCL_MULTI_RANK_GPU_ENABLE=1): then every collective of
    both ranks is checked as check_collectives() says. Older NCCL refuses two ranks on one GPU; this
    checks that it does (the reason one GPU shows no collective events) and that nothing hangs."""
    version = tuple(one_rank["nccl_version"] or ())
    if version >= (2, 30):
        s = run_job(plugin, str(tmp_path), world=2, extra_env={"NCCL_MULTI_RANK_GPU_ENABLE": "1"})
        s["summary"] = summary_line(s)
        save("two_ranks", s)
        assert s["returncodes"] == [0, 0], _output(s)
        assert s["alltoall_got"] == [[0.0, 1.0], [0.0, 1.0]], s["alltoall_got"]
        assert [ok for _, ok, _ in s["statuses"]] == [True, True], s["statuses"]
        assert list(s["ranks_on"].values()) == ["bye", "bye"], s["ranks_on"]
        check_collectives(s, world=2)
        return
    s = run_job(plugin, str(tmp_path), world=2, timeout=120)
    save("two_ranks", {"refused_as_expected_before_2.30": s["returncodes"], "nccl_log": s["nccl_log"],
                       "output_tail": s["output_tail"]})
    assert all(rc not in (0, None) for rc in s["returncodes"]), _output(s)
    assert "killed after" not in _output(s), _output(s)
    assert any("Duplicate GPU" in line for line in s["nccl_log"]), (s["nccl_log"], _output(s))
