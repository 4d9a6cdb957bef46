"""Kineto traces (`ccld diagnose|report|export --kineto`): real torch.profiler traces of a 4-rank gloo
job (tests/data/kineto/, made by its make_traces.py) read and judged by the unchanged detectors, damaged
inputs said and survived, and NCCL kernels joined to their collective on a hand-built GPU trace laid
out as torch.profiler writes one (record_param_comms -> cudaLaunchKernel -> kernel, External id and
correlation)."""
import collections
import gzip
import json
import os
import shutil

import pytest

from ccld import cli
from ccld.diagnose.kineto import KinetoError, format_set, read_trace, read_traces

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(ROOT, "tests", "data", "kineto")
PIPELINE = os.path.join(ROOT, "tests", "data", "kineto-pipeline")
STEPS = 167   # make_traces.py's all_reduces per rank
PIPE_STEPS = 131  # kineto-pipeline/make_traces.py's steps
BASE_NS = 1_790_000_000_000_000_000


def test_real_traces_read_ranks_world_and_every_collective():
    ks = read_traces([DATA])
    assert [t.rank for t in ks.traces] == [0, 1, 2, 3] and ks.world == 4 and not ks.errors
    for t in ks.traces:
        assert (t.backend, t.clock, t.source) == ("gloo", "base", "annotations")
        assert len(t.rows) == STEPS  # count-exact: none lost, none doubled
        assert {(r.op, r.kind, r.group, r.nbytes, r.seq) for r in t.rows} == {
            ("allreduce", "collective", "world", 4096, None)}  # gloo traces: no record_param_comms, no seq
        assert all(r.start > 1.7e9 and 0 <= r.duration < 1.0 for r in t.rows)  # Unix seconds
    # on one wall clock: an all_reduce ends on every rank at about the same time (ranks start it when
    # their profiler is up, at different times; it ends when the last one joined)
    for i in (0, STEPS // 2, STEPS - 1):
        ends = [t.rows[i].start + t.rows[i].duration for t in ks.traces]
        assert max(ends) - min(ends) < 0.02, ends


def test_diagnose_names_the_slow_rank(capsys):
    assert cli.main(["diagnose", "--kineto", DATA]) == 0
    out = capsys.readouterr().out
    assert "kineto traces" in out and "ranks 0-3 of world size 4" in out and "baseTimeNanoseconds" in out
    assert "group world: members 0-3, 167 collectives" in out
    slow = [ln for ln in out.splitlines() if ln.startswith("SLOW")]
    assert len(slow) == 1 and "comp-slow [2]" in slow[0], out


def test_files_given_one_by_one_and_report_export(tmp_path, capsys):
    files = [os.path.join(DATA, f"rank{r}.json.gz") for r in range(4)]
    assert cli.main(["diagnose", "--kineto", *files, "--json"]) == 0
    found = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert [(f["class"], f["ranks"]) for f in found] == [("comp-slow", [2])]
    assert cli.main(["export", "--kineto", DATA, "--perfetto", str(tmp_path / "t.json")]) == 0
    assert cli.main(["report", "--kineto", DATA, "-o", str(tmp_path / "r.html")]) == 0
    assert os.path.getsize(tmp_path / "t.json") > 0 and "--kineto" in (tmp_path / "r.html").read_text()
    assert cli.main(["diagnose", str(tmp_path), "--kineto", DATA]) == 1
    assert "give one of" in capsys.readouterr().err


def test_a_missing_rank_is_said_and_the_others_are_judged(tmp_path, capsys):
    for r in (0, 1, 2):
        shutil.copy(os.path.join(DATA, f"rank{r}.json.gz"), tmp_path)
    assert cli.main(["diagnose", "--kineto", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "ranks 0-2 of world size 4 (no trace from rank 3)" in out
    assert "no trace from rank 3: the default group is judged among ranks 0-2 (group traced)" in out
    slow = [ln for ln in out.splitlines() if ln.startswith("SLOW")]
    assert len(slow) == 1 and "comp-slow [2] ops:traced" in slow[0], out


def test_truncated_gzip_is_one_line_naming_the_file(tmp_path, capsys):
    for r in (0, 1, 3):
        shutil.copy(os.path.join(DATA, f"rank{r}.json.gz"), tmp_path)
    data = open(os.path.join(DATA, "rank2.json.gz"), "rb").read()
    cut = tmp_path / "rank2.json.gz"
    cut.write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match="truncated"):
        read_trace(str(cut))
    assert cli.main(["diagnose", "--kineto", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert f"ccld: {cut}: truncated: the compressed data ends early" in err and "skipped" in err
    assert "no trace from rank 2" in out and "no findings" in out  # the slow rank's trace is the one cut
    assert cli.main(["diagnose", "--kineto", str(cut)]) == 1  # nothing else: the command ends with that line
    assert str(cut) in capsys.readouterr().err


def test_trace_without_distributed_info_is_named(tmp_path, capsys):
    doc = json.load(gzip.open(os.path.join(DATA, "rank0.json.gz"), "rt"))
    del doc["distributedInfo"]
    path = tmp_path / "single.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(KinetoError, match=f"{path}: no distributedInfo"):
        read_traces([str(path)])
    assert cli.main(["diagnose", "--kineto", str(path)]) == 1
    assert f"ccld: {path}: no distributedInfo (rank, world size)" in capsys.readouterr().err
    (tmp_path / "junk.json").write_text("[1, 2]")
    with pytest.raises(KinetoError, match="no collectives in any of 2 traces"):
        read_traces([str(tmp_path)])


# ---- GPU traces: NCCL kernels joined to their collective ----------------------------------------

def gpu_trace(rank, world=2, late_us=0.0, seqs=(1, 2, 3)):
    """One rank's trace laid out as torch.profiler writes a CUDA + NCCL job: per collective a
    record_param_comms cpu_op (its args), the cudaLaunchKernel inside it (same External id, its own
    correlation), the kernel on the GPU's pid/stream (External id, correlation) and the ac2g flow.
    Collective 1 joins by External id; 2's kernel has only its correlation (older traces); 3 is
    coalesced into two kernels. One more kernel belongs to no collective."""
    pid, tid, stream = 4000 + rank, 4000 + rank, 7
    evs = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": "python"}},
           {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "python"}},
           {"ph": "M", "name": "process_labels", "pid": 0, "tid": 0, "args": {"labels": "GPU 0"}}]
    for i, seq in enumerate(seqs):
        ext, corr = 100 + i, 9000 + 10 * i
        t = 1_000.0 + 10_000.0 * i + late_us  # us from baseTimeNanoseconds
        evs.append({"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": pid, "tid": tid, "ts": t,
                    "dur": 40.0, "args": {"External id": ext, "Record function id": 0, "Collective name": "allreduce",
                                          "dtype": "Float", "In msg nelems": 1024, "Out msg nelems": 1024,
                                          "Group size": world, "In split size": "[]", "Out split size": "[]",
                                          "Global rank start": 0, "Global rank stride": 1,
                                          "Process Group Name": "0", "Process Group Description": "default_pg",
                                          "Process Group Ranks": json.dumps(list(range(world))), "Rank": rank,
                                          "Seq": seq}})
        evs.append({"ph": "X", "cat": "user_annotation", "name": "nccl:all_reduce", "pid": pid, "tid": tid,
                    "ts": t + 2.0, "dur": 30.0, "args": {"External id": ext + 50}})
        launches = 2 if i == 2 else 1
        for k in range(launches):
            kt = t + 500.0 + 300.0 * k
            evs.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernelExC", "pid": pid, "tid": tid,
                        "ts": t + 5.0 + 10.0 * k, "dur": 4.0,
                        "args": {"External id": ext + 50, "cbid": 430, "correlation": corr + k}})
            kargs = {"queued": 0, "device": 0, "context": 1, "stream": stream, "correlation": corr + k,
                     "registers per thread": 96, "grid": [8, 1, 1], "block": [544, 1, 1]}
            if i != 1:
                kargs["External id"] = ext
            evs.append({"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, "
                        "unsigned long, ncclWork*)", "pid": 0, "tid": stream, "ts": kt, "dur": 200.0, "args": kargs})
            evs.append({"ph": "s", "id": corr + k, "pid": pid, "tid": tid, "ts": t + 5.0 + 10.0 * k,
                        "cat": "ac2g", "name": "ac2g"})
            evs.append({"ph": "f", "id": corr + k, "pid": 0, "tid": stream, "ts": kt, "cat": "ac2g", "name": "ac2g",
                        "bp": "e"})
    evs.append({"ph": "X", "cat": "kernel", "name": "ncclDevKernel_SendRecv(ncclDevComm*, unsigned long, ncclWork*)",
                "pid": 0, "tid": stream, "ts": 50_000.0, "dur": 10.0,
                "args": {"device": 0, "stream": stream, "correlation": 99_999}})
    return {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA H100"}],
            "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": world, "pg_count": 1,
                                "pg_config": [{"pg_name": "0", "pg_desc": "default_pg", "backend_config": "cuda:nccl",
                                               "pg_size": world, "ranks": list(range(world))}],
                                "nccl_version": "2.21.5"},
            "displayTimeUnit": "ms", "baseTimeNanoseconds": BASE_NS, "traceEvents": evs,
            "traceName": f"rank{rank}.json"}


def test_nccl_kernels_join_their_collective_by_external_id_or_correlation(tmp_path):
    path = tmp_path / "rank1.json"
    path.write_text(json.dumps(gpu_trace(1)))
    t = read_trace(str(path))
    assert (t.rank, t.world, t.backend, t.source) == (1, 2, "nccl", "record_param_comms")
    assert (t.kernels, t.joined) == (5, 4)  # the SendRecv kernel launched from no collective stays unjoined
    assert [(r.seq, r.group, r.nbytes) for r in t.rows] == [(1, "world", 4096), (2, "world", 4096), (3, "world", 4096)]
    base = BASE_NS / 1e9
    # device time: the kernel's start and end, not the CPU op's (1000 us + 500 us launch delay)
    assert t.rows[0].start == pytest.approx(base + 1_500e-6, abs=1e-6)
    assert t.rows[0].duration == pytest.approx(200e-6, abs=1e-9)
    assert t.rows[1].start == pytest.approx(base + 11_500e-6, abs=1e-6)  # joined by correlation alone
    # coalesced: from its first kernel's start to its last one's end
    assert t.rows[2].start == pytest.approx(base + 21_500e-6, abs=1e-6)
    assert t.rows[2].duration == pytest.approx(500e-6, abs=1e-9)


def test_gpu_traces_through_diagnose_say_the_join(tmp_path, capsys):
    for r in range(2):
        (tmp_path / f"rank{r}.json").write_text(json.dumps(gpu_trace(r)))
    assert cli.main(["diagnose", "--kineto", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "NCCL kernels: 8 of 10 joined to their collective (device time used)" in out
    assert "2 traces: collectives from record_param_comms" in out and "seq from the table" in out


def test_traces_without_base_time_are_on_their_own_clocks(tmp_path, capsys):
    doc = gpu_trace(0, world=1)
    del doc["baseTimeNanoseconds"]
    (tmp_path / "rank0.json").write_text(json.dumps(doc))
    assert read_trace(str(tmp_path / "rank0.json")).clock == "own"
    assert cli.main(["diagnose", "--kineto", str(tmp_path)]) == 0
    assert "each rank's own clock" in capsys.readouterr().out


# ---- a pipeline x data-parallel gloo job: p2p, three process groups, compute ranges ----------------

def test_pipeline_traces_read_p2p_each_group_and_compute():
    ks = read_traces([PIPELINE])
    assert [t.rank for t in ks.traces] == [0, 1, 2, 3] and not ks.errors and not ks.notes
    for t in ks.traces:
        stage = t.rank // 2
        assert t.mapped and t.groups.startswith("2 gloo process groups told apart by their worker threads")
        got = collections.Counter((r.kind, r.op, r.group, r.peer) for r in t.rows)
        p2p = ("p2p", "send", "world", t.rank + 2) if stage == 0 else ("p2p", "recv", "world", t.rank - 2)
        assert got == {("compute", "forward", "world", None): PIPE_STEPS, p2p: PIPE_STEPS,
                       ("collective", "allreduce", str(stage + 1), None): PIPE_STEPS,
                       ("collective", "allreduce", "world", None): PIPE_STEPS}, got  # count-exact
        assert (t.p2p, t.p2p_unread, t.compute) == (PIPE_STEPS, 0, PIPE_STEPS)
        sizes = {r.group: r.nbytes for r in t.rows if r.kind == "collective"}
        assert sizes == {str(stage + 1): 1024, "world": 4}  # the group's 256 floats, the loss's one
    # a send and its recv are one transfer: rank 2's recv ends after rank 0's send began
    send = next(r for r in ks.traces[0].rows if r.kind == "p2p")
    recv = next(r for r in ks.traces[2].rows if r.kind == "p2p")
    assert recv.start + recv.duration >= send.start


def test_pipeline_diagnose_names_the_slow_stage_together(capsys):
    assert cli.main(["diagnose", "--kineto", PIPELINE]) == 0
    out = capsys.readouterr().out
    for line in ("2 gloo process groups told apart by their worker threads (2 each, in creation order)",
                 f"p2p ops: {4 * PIPE_STEPS} read (send/recv with their peer)",
                 f"group 1: members 0,1, {PIPE_STEPS} collectives", f"group 2: members 2,3, {PIPE_STEPS} collectives",
                 f"group world: members 0-3, {PIPE_STEPS} collectives (seq counted per rank and op), "
                 f"{4 * PIPE_STEPS} p2p rows",
                 f"compute: {4 * PIPE_STEPS} rows of 1 op (forward)"):
        assert line in out, (line, out)
    found = [ln for ln in out.splitlines() if ln.startswith(("SLOW", "HANG", "INFO"))]
    assert found == ["SLOW comp-slow [2,3] ops:world forward: ranks 2, 3 slow together: ~30 ms longer than the others"]
    assert cli.main(["diagnose", "--kineto", PIPELINE, "--json"]) == 0
    (f,) = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert f["evidence"]["reason"] == "compute-duration" and f["evidence"]["together"] is True
    for d in f["evidence"]["ranks"]:
        assert d["median_s"] == pytest.approx(0.035, abs=0.004)
        assert d["others_median_s"] == pytest.approx(0.010, abs=0.003)
        assert d["longer_in"] >= 0.9 * d["of"]


def _swap_worker_threads(doc):
    """The default group's worker threads renumbered above the data-parallel group's: the thread order
    no longer follows the groups' creation order."""
    tids = sorted({e["tid"] for e in doc["traceEvents"] if e.get("name", "").startswith("gloo:all_reduce")})
    swap = dict(zip(tids, tids[2:] + tids[:2]))
    for e in doc["traceEvents"]:
        if e.get("tid") in swap:
            e["tid"] = swap[e["tid"]]


def test_gloo_groups_that_cannot_be_told_apart_are_said(tmp_path, capsys):
    for r in range(4):
        doc = json.load(gzip.open(os.path.join(PIPELINE, f"rank{r}.json.gz"), "rt"))
        if r == 1:
            _swap_worker_threads(doc)  # its groups' collectives land in each other's group: caught across ranks
        if r == 3:  # a third group in pg_config: four worker threads do not split in three
            doc["distributedInfo"]["pg_config"].append({"pg_name": "3", "pg_desc": "undefined", "ranks": [3]})
        (tmp_path / f"rank{r}.json").write_text(json.dumps(doc))
    ks = read_traces([str(tmp_path)])
    assert ks.traces[3].groups.startswith("3 gloo process groups but 4 worker threads with collectives: the groups "
                                          "cannot be told apart") and not ks.traces[3].mapped
    assert ks.notes == ["gloo group 1: members ran different collectives (counts, ops or sizes), so the worker "
                        "threads were not told apart right; all taken as the default group"]
    assert {r.group for r in ks.table.rows if r.kind == "collective"} == {"world"}
    assert cli.main(["diagnose", "--kineto", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "cannot be told apart, all taken as the default group" in out and "gloo group 1: members ran" in out


def nccl_p2p_trace(rank, steps=3):
    """Two ranks of an NCCL job as torch.profiler writes their sends and recvs: record_param_comms with
    "Collective name" send/recv and the peer's global rank ("Dst Rank"/"Src Rank"), or only "Rank"
    (the peer's group rank) and "Process Group Ranks"."""
    pid = tid = 5000 + rank
    evs = []
    for i in range(steps):
        args = {"External id": 10 + i, "Collective name": "send" if rank == 0 else "recv", "dtype": "Float",
                "In msg nelems": 64, "Out msg nelems": 64, "Group size": 2, "Process Group Name": "0",
                "Process Group Description": "default_pg", "Process Group Ranks": "[0, 1]", "Rank": 1 - rank,
                "Seq": i + 1}
        if i != 1:
            args["Dst Rank" if rank == 0 else "Src Rank"] = 1 - rank
        evs.append({"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": pid, "tid": tid,
                    "ts": 1000.0 + 5000.0 * i, "dur": 300.0, "args": args})
    return {"schemaVersion": 1, "traceEvents": evs, "baseTimeNanoseconds": BASE_NS,
            "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": 2}}


def test_nccl_record_param_comms_sends_and_recvs_are_p2p_rows(tmp_path, capsys):
    for r in range(2):
        (tmp_path / f"rank{r}.json").write_text(json.dumps(nccl_p2p_trace(r)))
    ks = read_traces([str(tmp_path)])
    rows = {t.rank: [(r.kind, r.op, r.peer, r.group, r.seq, r.nbytes) for r in t.rows] for t in ks.traces}
    assert rows == {0: [("p2p", "send", 1, "world", None, 256)] * 3, 1: [("p2p", "recv", 0, "world", None, 256)] * 3}
    assert "  p2p ops: 6 read (send/recv with their peer)" in format_set(ks)
    assert cli.main(["diagnose", "--kineto", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "group world: members 0,1, 6 p2p rows" in out and "no findings" in out
