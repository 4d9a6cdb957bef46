"""NCCL Inspector logs (`ccld diagnose|report|export --nccl-inspector DIR`): logs built to the format the
plugin's JSON writer has (NVIDIA/nccl plugins/profiler/inspector/inspector_json.cc: one object a line,
header/metadata/coll_perf, event_trace_ts in verbose mode) read, joined across ranks by (communicator,
coll, coll_sn), and judged by the unchanged detectors; damaged inputs said and survived. No real
Inspector output was available: these logs are built from the source, not recorded."""
import json
import os

import pytest

from ccld import cli
from ccld.diagnose.inspector import InspectorError, read_logs

pytestmark = pytest.mark.unit

T0_US = 1_790_000_000_000_000   # Unix us
STEP_US = 100_000               # one all_reduce per 100 ms
LATE_US = 30_000
WORLD_ID = "0x7f8c496ae9f661"


def record(rank, n_ranks, sn, start_us, exec_us, comm=WORLD_ID, coll="AllReduce", size=1 << 20, pid=None,
           verbose=True):
    """One line as the plugin writes it (inspectorCommInfoDumpColl)."""
    perf = {"coll": coll, "coll_sn": sn, "coll_msg_size_bytes": size, "coll_exec_time_us": exec_us,
            "coll_timing_source": "kernel_gpu", "coll_algobw_gbs": 1.0, "coll_busbw_gbs": 1.5}
    if verbose:
        perf["event_trace_sn"] = {"coll_start_sn": 1, "coll_stop_sn": 2, "kernel_events": [
            {"channel_id": 0, "kernel_start_sn": 3, "kernel_stop_sn": 4, "kernel_record_sn": 4}]}
        perf["event_trace_ts"] = {"coll_start_ts": start_us - 50, "coll_stop_ts": start_us - 40, "kernel_events": [
            {"channel_id": 0, "kernel_start_ts": start_us, "kernel_stop_ts": start_us + exec_us,
             "kernel_record_ts": start_us + exec_us},
            {"channel_id": 1, "kernel_start_ts": start_us + 3, "kernel_stop_ts": start_us + exec_us,
             "kernel_record_ts": start_us + exec_us}]}
    return {"header": {"id": comm, "comm_name": "unknown", "rank": rank, "n_ranks": n_ranks, "nnodes": 1},
            "metadata": {"inspector_output_format_version": "v4.0", "git_rev": "", "rec_mechanism":
                         "nccl_profiler_interface", "dump_timestamp_us": start_us + 500_000,
                         "hostname": "node0", "pid": pid or 4000 + rank},
            "coll_perf": perf}


def job(steps=200, world=4, late=2, verbose=True):
    """{rank: records}: `steps` all_reduces; `late`'s kernel starts LATE_US after the others', and the others
    wait for it inside theirs (their exec time is LATE_US longer)."""
    out = {}
    for r in range(world):
        recs = []
        for sn in range(1, steps + 1):
            t = T0_US + sn * STEP_US
            start = t + (LATE_US if r == late else 0)
            recs.append(record(r, world, sn, start, 2_000 + (0 if r == late else LATE_US), verbose=verbose))
        out[r] = recs
    return out


def write_logs(d, logs):
    os.makedirs(d, exist_ok=True)
    for r, recs in logs.items():
        with open(os.path.join(d, f"node0-pid{4000 + r}.log"), "w") as f:
            for rec in recs:
                f.write(json.dumps(rec, separators=(",", ":")) + "\n")
    return str(d)


def test_logs_read_and_joined_across_ranks(tmp_path):
    ks = read_logs(write_logs(tmp_path / "logs", job(steps=23)))
    assert [p.rank for p in ks.procs] == [0, 1, 2, 3] and ks.world == 4 and not ks.errors
    rows = ks.table.rows
    assert len(rows) == 4 * 23  # count-exact
    assert {(r.op, r.group, r.nbytes) for r in rows} == {("allreduce", WORLD_ID, 1 << 20)}
    assert sorted({r.seq for r in rows}) == list(range(1, 24))
    r2 = next(r for r in rows if r.rank == 2 and r.seq == 1)  # the first channel's kernel start, exec time
    assert r2.start == pytest.approx((T0_US + STEP_US + LATE_US) / 1e6) and r2.duration == pytest.approx(0.002)
    assert ks.sources == {"kernel_gpu": 92}


def test_one_rank_late_is_comp_slow(tmp_path, capsys):
    d = write_logs(tmp_path / "logs", job())
    assert cli.main(["diagnose", "--nccl-inspector", d]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"nccl inspector logs {d}: 4 processes, ranks 0-3 of world size 4; 800 collectives")
    slow = [ln for ln in out.splitlines() if ln.startswith("SLOW")]
    assert len(slow) == 1 and "comp-slow [2]" in slow[0], out
    assert cli.main(["diagnose", "--json", "--nccl-inspector", d]) == 0
    found = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert [(f["class"], f["ranks"]) for f in found] == [("comp-slow", [2])]


def test_report_and_export_take_the_logs(tmp_path, capsys):
    d = write_logs(tmp_path / "logs", job(steps=120))
    assert cli.main(["export", "--nccl-inspector", d, "--perfetto", str(tmp_path / "t.json")]) == 0
    assert json.load(open(tmp_path / "t.json"))["traceEvents"]
    assert cli.main(["report", "--nccl-inspector", d, "-o", str(tmp_path / "r.html")]) == 0
    assert f"--nccl-inspector {d}" in open(tmp_path / "r.html").read()
    assert "1 finding" in capsys.readouterr().out


def test_sequence_numbers_are_per_collective_type(tmp_path):
    """NCCL's coll_sn counts each function apart: AllReduce 1 and AllGather 1 are two collectives."""
    logs = {r: [record(r, 2, 1, T0_US, 100), record(r, 2, 1, T0_US + 1000, 100, coll="AllGather"),
                record(r, 2, 2, T0_US + 2000, 100)] for r in range(2)}
    ks = read_logs(write_logs(tmp_path / "logs", logs))
    assert sorted((r.seq, r.op) for r in ks.table.rows if r.rank == 0) == [
        (1, "allreduce"), (2, "allgather"), (3, "allreduce")]


def test_truncated_line_is_one_error_and_the_rest_is_read(tmp_path, capsys):
    d = write_logs(tmp_path / "logs", job())
    path = os.path.join(d, "node0-pid4001.log")
    text = open(path).read()
    open(path, "w").write(text[:-200])  # the dump cut inside its last line
    assert cli.main(["diagnose", "--nccl-inspector", d]) == 0
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and f"ccld: {path}: line 200: not a JSON object" in err, err
    assert "799 collectives" in out and "comp-slow [2]" in out


def test_missing_field_names_file_line_and_field(tmp_path, capsys):
    logs = job()
    del logs[3][9]["coll_perf"]["coll_exec_time_us"]
    d = write_logs(tmp_path / "logs", logs)
    assert cli.main(["diagnose", "--nccl-inspector", d]) == 0
    out, err = capsys.readouterr()
    path = os.path.join(d, "node0-pid4003.log")
    assert err == f"ccld: {path}: line 10: field 'coll_perf.coll_exec_time_us': missing\n"
    assert "comp-slow [2]" in out


def test_a_missing_rank_is_said_and_the_others_are_judged(tmp_path, capsys):
    logs = job()
    del logs[1]
    d = write_logs(tmp_path / "logs", logs)
    assert cli.main(["diagnose", "--nccl-inspector", d]) == 0
    out = capsys.readouterr().out
    assert "ranks 0,2,3 of world size 4 (no log from rank 1)" in out
    assert f"group {WORLD_ID}: members 0,2,3" in out
    slow = [ln for ln in out.splitlines() if ln.startswith("SLOW")]
    assert len(slow) == 1 and "comp-slow [2]" in slow[0], out


def test_logs_without_start_times_are_an_error_that_says_why(tmp_path, capsys):
    d = write_logs(tmp_path / "logs", job(steps=5, verbose=False))
    with pytest.raises(InspectorError, match="none with a start time.*NCCL_INSPECTOR_DUMP_VERBOSE=1"):
        read_logs(d)
    assert cli.main(["diagnose", "--nccl-inspector", d]) == 1
    assert "NCCL_INSPECTOR_DUMP_VERBOSE=1" in capsys.readouterr().err


def test_an_empty_directory_is_one_line(tmp_path, capsys):
    assert cli.main(["diagnose", "--nccl-inspector", str(tmp_path)]) == 1
    assert "no NCCL Inspector logs" in capsys.readouterr().err


def test_documented_example(capsys):
    """docs/nccl-inspector.md shows `ccld diagnose --nccl-inspector docs/examples/nccl-inspector`."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    d = os.path.join(root, "docs", "examples", "nccl-inspector")
    assert cli.main(["diagnose", "--nccl-inspector", d]) == 0
    out = capsys.readouterr().out
    assert [ln.split(":")[0] for ln in out.splitlines() if ln.startswith("SLOW")] == ["SLOW comp-slow [2] ops"]
