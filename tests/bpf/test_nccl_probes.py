"""NCCL probe family against the real libnccl.so.2, no GPU: exact call counts and decoded arguments.

tests/workloads/nccl_calls.py calls NCCL's API with known arguments and a fake (zeroed) communicator,
so every call fails fast with an error code; the uprobes fire at entry (and the init uretprobes at
return) all the same. We attach before the workload starts calling and count every record.
"""
import json
import os
import subprocess
import sys
import time
from collections import Counter

import pytest

from recorder import Recorder, rows_of

from ccld import wire as ev
from ccld.bpf import nccl
from ccld.bpf.progcache import bpf_available

pytestmark = pytest.mark.bpf

WORKLOAD = os.path.join(os.path.dirname(__file__), "..", "workloads", "nccl_calls.py")
READY_TIMEOUT_S = 60      # importing ctypes and dlopen of a 470 MB library, on a loaded 2-core box
RUN_TIMEOUT_S = 60
DRAIN_QUIET_MS = 300      # stop draining after this long without a new record

UNIQUE_ID = bytes(range(128))
NRANKS, RANK = 4, 1
# The workload's PLAN, restated so a change on one side only fails here.
FLOAT32, INT64, FLOAT16, BFLOAT16, FLOAT64, INT32, UINT8, INT8 = 7, 4, 6, 9, 8, 2, 1, 0
SUM, PROD, MAX, MIN = 0, 1, 2, 3
COLLS = {  # fn -> (calls, count, datatype, redop, root)
    nccl.FN_ALLREDUCE: (23, 1001, FLOAT32, MAX, -1),
    nccl.FN_BROADCAST: (7, 1003, INT64, -1, 2),
    nccl.FN_REDUCE: (11, 1005, FLOAT16, MIN, 3),
    nccl.FN_ALLGATHER: (13, 1007, BFLOAT16, -1, -1),
    nccl.FN_REDUCESCATTER: (17, 1009, FLOAT64, PROD, -1),
}
ALLREDUCE_CONFIG = (2, 1015, INT8, SUM, -1)  # ncclAllReduceConfig, where the library has it
P2PS = {nccl.FN_SEND: (5, 1011, INT32, 2), nccl.FN_RECV: (3, 1013, UINT8, 3)}  # fn -> (calls, count, dtype, peer)
GROUPS = 19
NCCL_UNHANDLED_CUDA_ERROR = 1


def fnv1a64(data: bytes) -> int:
    """Written out again here, not imported, so the test checks the BPF side against the definition."""
    h = 0xCBF29CE484222325
    for b in data:
        h ^= b
        h = (h * 0x100000001B3) % (1 << 64)
    return h


def _need_bpf():
    problem = bpf_available()
    if problem is not None:
        pytest.skip(f"{problem} ({problem.hint})")


def _libnccl() -> str:
    try:
        import nvidia.nccl
    except ImportError:
        pytest.fail("the nvidia-nccl-cu12 wheel is not installed in this environment; the setup installs it")
    for d in nvidia.nccl.__path__:
        p = os.path.join(d, "lib", "libnccl.so.2")
        if os.path.exists(p):
            return p
    pytest.fail("nvidia.nccl has no lib/libnccl.so.2")


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """Run the workload under NcclFamily; return (ready info, done info, attachment, records, family stats)."""
    _need_bpf()
    lib = _libnccl()
    go = tmp_path_factory.mktemp("nccl") / "go"
    proc = subprocess.Popen([sys.executable, WORKLOAD, "--lib", lib, "--go-file", str(go)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rec = Recorder(nccl.NcclFamily.KINDS)
    records = rec.recs
    fam = nccl.NcclFamily(rec)
    try:
        line = _read_line(proc, "ready ", READY_TIMEOUT_S)
        ready = json.loads(line[len("ready "):])
        assert ready["pid"] == proc.pid
        fam.load()
        mapped = fam.find_lib(proc.pid)
        assert mapped is not None, "libnccl is not in the workload's /proc/PID/maps after `ready`"
        att = fam.attach(proc.pid, mapped)
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
        yield ready, done, att, records, stats
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        fam.close()


def _read_line(proc, prefix: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    import selectors
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
    raise AssertionError(f"workload printed no {prefix!r} line within {timeout_s}s: {proc.stderr.read()[-2000:]}")


def _of(records, kind):
    return [r for k, r in records if k == kind]


def test_required_probes_attached(traced):
    _, _, att, _, stats = traced
    syms = {s for s, _ in att.points}
    for p in nccl.NcclFamily.PROBES:
        if p.required and not p.ret:
            assert p.prefix in syms
    assert {s for s, _ in att.ret_points} >= {"ncclCommInitRank"}
    assert not any(s.endswith(".cold") for s in syms)
    assert stats == {"lost": 0, "bad": {}}


def test_every_record_is_from_the_workload(traced):
    ready, _, _, records, _ = traced
    assert records, "no records at all"
    assert {r.hdr.tgid for _, r in records} == {ready["pid"]}
    ts = [r.hdr.ts_ns for _, r in records]
    assert ts == sorted(ts), "one thread's records arrive in call order"


def test_collectives_exact_counts_and_arguments(traced):
    ready, done, att, records, _ = traced
    colls = _of(records, nccl.COLL)
    have_config = "ncclAllReduceConfig" in {s for s, _ in att.points}
    assert have_config == ("allreduce_config" in done["called"])
    expect = Counter({(fn, c[1]): c[0] for fn, c in COLLS.items()})
    if have_config:
        expect[(nccl.FN_ALLREDUCE, ALLREDUCE_CONFIG[1])] = ALLREDUCE_CONFIG[0]
    assert Counter((r.fn, r.count) for r in colls) == expect
    for r in colls:
        calls, count, dtype, redop, root = ALLREDUCE_CONFIG if r.count == ALLREDUCE_CONFIG[1] else COLLS[r.fn]
        assert (r.datatype, r.redop, r.root) == (dtype, redop, root), f"fn {r.fn}"
        assert r.comm == ready["comm"]
        assert r.stream == ready["stream"], f"fn {r.fn}: stream (8th argument of ncclReduce is on the stack)"
        assert (r.sendbuff, r.recvbuff) == (ready["sendbuff"], ready["recvbuff"])


def test_p2p_exact_counts_and_arguments(traced):
    ready, _, _, records, _ = traced
    p2ps = _of(records, nccl.P2P_REC)
    assert Counter(r.fn for r in p2ps) == {fn: v[0] for fn, v in P2PS.items()}
    for r in p2ps:
        _, count, dtype, peer = P2PS[r.fn]
        assert (r.count, r.datatype, r.root, r.redop) == (count, dtype, peer, -1)
        assert (r.comm, r.stream) == (ready["comm"], ready["stream"])
        assert r.sendbuff == (ready["sendbuff"] if r.fn == nccl.FN_SEND else ready["recvbuff"])


def test_groups(traced):
    _, _, _, records, _ = traced
    assert Counter(r.fn for r in _of(records, nccl.GROUP)) == {nccl.FN_GROUP_START: GROUPS,
                                                               nccl.FN_GROUP_END: GROUPS}


def test_init_records_carry_the_unique_id_hash(traced):
    ready, done, att, records, _ = traced
    inits = _of(records, nccl.COMM_INIT)
    ident = fnv1a64(UNIQUE_ID)
    assert nccl.unique_id_identity(UNIQUE_ID) == ident
    by_fn = Counter(r.fn for r in inits)
    assert by_fn[nccl.FN_INIT_RANK] == 1
    assert by_fn[nccl.FN_INIT_RANK_CONFIG] == done["called"].get("init_rank_config", 0)
    assert by_fn[nccl.FN_SPLIT] == done["called"].get("split", 0)
    label = {nccl.FN_INIT_RANK: "init_rank", nccl.FN_INIT_RANK_CONFIG: "init_rank_config", nccl.FN_SPLIT: "split"}
    seen = Counter()
    for r in inits:
        # No GPU: NCCL fails with ncclUnhandledCudaError before it writes the out-parameter, so the
        # uretprobe must read back what the workload put there (its fake comm for the inits, NULL for split).
        assert r.ret == NCCL_UNHANDLED_CUDA_ERROR and done["rcs"][label[r.fn]] == [r.ret]
        assert r.comm == done["outs"][label[r.fn]][seen[r.fn]]
        seen[r.fn] += 1
        assert 0 < r.enter_ns <= r.hdr.ts_ns
        if r.fn == nccl.FN_INIT_RANK:
            assert (r.idhash, r.nranks, r.rank, r.parent, r.color, r.key) == (ident, NRANKS, RANK, 0, -1, -1)
        elif r.fn == nccl.FN_INIT_RANK_CONFIG:
            assert (r.idhash, r.nranks, r.rank, r.parent) == (ident, NRANKS + 4, RANK + 4, 0)
        else:
            assert (r.parent, r.color, r.key, r.idhash, r.nranks, r.rank) == (ready["comm"], 5, 9, 0, -1, -1)


def test_destroy_and_abort(traced):
    _, _, _, records, _ = traced
    ends = _of(records, nccl.COMM_END)
    assert Counter(r.fn for r in ends) == {nccl.FN_DESTROY: 2, nccl.FN_ABORT: 1}
    assert all(r.comm == 0 for r in ends)


def test_translator_on_real_records(traced):
    ready, done, _, records, _ = traced
    out = []
    tr = nccl.NcclTranslator(rows_of(out))
    tr.add_process(ready["pid"], rank=7, job="j")
    for what, (rows, kinds) in records.drains:
        tr.records(rows, kinds)
    name = f"j/nccl:handle-r7-{ready['comm']:x}"  # the init failed, so the handle was never named
    inits = [e for e in out if isinstance(e, ev.CommInit)]
    assert [(e.comm, e.handle, e.group_rank) for e in inits] == [(name, ready["comm"], -1)]
    assert tr.counters["unknown_handles"] == 1
    assert tr.counters["init_failed"] == sum(done["called"].get(k, 0)
                                             for k in ("init_rank", "init_rank_config", "split"))
    colls = [e for e in out if isinstance(e, ev.CollEnter)]
    assert [e.seq for e in colls] == list(range(len(colls)))
    assert all(e.comm == name and e.backend == "nccl" and e.rank == 7 for e in colls)
    ops = Counter(e.op for e in colls)
    assert ops["broadcast"] == 7 and ops["reduce"] == 11 and ops["allgather"] == 13 and ops["reduce_scatter"] == 17
    ar = [e for e in colls if e.op == "allreduce" and e.count == 1001]
    assert len(ar) == 23 and {(e.dtype, e.nbytes, e.root) for e in ar} == {("float32", 4004, -1)}
    assert {(e.dtype, e.nbytes, e.root) for e in colls if e.op == "reduce"} == {("float16", 2010, 3)}
    assert {(e.dtype, e.nbytes) for e in colls if e.op == "allgather"} == {("bfloat16", 2014)}
    p2p = [e for e in out if isinstance(e, ev.P2P)]
    assert Counter((e.op, e.peer, e.count, e.dtype) for e in p2p) == {("send", 2, 1011, "int32"): 5,
                                                                     ("recv", 3, 1013, "uint8"): 3}
    assert tr.counters["groups"] == 2 * GROUPS
