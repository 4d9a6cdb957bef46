"""Per-op tables (`ccld diagnose|report|export --ops`): each format read, damaged inputs said and
survived, and the findings the unchanged detectors make once the rows went through a store."""
import csv
import gzip
import json
import os
import random
import sys

import pytest

from ccld import cli
from ccld.diagnose import opframes
from ccld.diagnose.opframes import events, frames, make_job, table_store
from ccld.diagnose.optable import OpsTableError, guess_kind, normalize_op, read_table
from ccld.diagnose.findings import format_line
from ccld.diagnose.replay import replay

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "docs", "examples", "ops.csv")
COLS = ["rank", "op", "start", "duration", "step", "bytes"]
P2P_COLS = ["rank", "op", "start", "duration", "peer"]


def synth(ranks=4, steps=200, late=None, late_s=0.03, skip_last=None, mismatch=None, jitter=0.0, spread=False,
          seq=False, wait_last=30.0, open_last=False, absent=(), seed=7):
    """One row per op: each step every rank computes ("forward", 60 ms) then all-reduces; a collective
    ends for everyone 10 ms after the last rank entered. `late`: that rank (or those ranks) computes
    `late_s` longer, every step. `skip_last`: that rank never enters the last all-reduce, which the others wait in for
    `wait_last` s (or, with `open_last`, are still inside when the table ends). `mismatch`: (step, rank)
    calls broadcast there. `jitter`: random per-rank compute noise (s); `spread`: a random rank is
    50 ms slow each step. `absent`: ranks with no rows at all."""
    rnd = random.Random(seed)
    late = {late} if isinstance(late, int) else set(late or ())
    rows, t = [], 0.0
    for step in range(1, steps + 1):
        slow = rnd.randrange(ranks) if spread else None
        arrive = {}
        for r in range(ranks):
            c = 0.06 + abs(rnd.gauss(0, jitter)) + (late_s if r in late else 0.0) + (0.05 if r == slow else 0.0)
            arrive[r] = t + c
            rows.append({"rank": r, "op": "forward", "start": round(t, 6), "duration": round(c, 6), "step": step})
        end = max(arrive.values()) + 0.01
        last = step == steps
        for r in range(ranks):
            if last and r == skip_last:
                continue
            row = {"rank": r, "op": "broadcast" if mismatch == (step, r) else "all_reduce",
                   "start": round(arrive[r], 6), "duration": round(end - arrive[r], 6), "step": step, "bytes": 4096}
            if last and skip_last is not None:
                row["duration"] = "" if open_last else wait_last
            if seq:
                row["seq"] = step
            rows.append(row)
        t = end
    return [r for r in rows if r["rank"] not in absent]


def write_csv(path, rows, cols=None, opener=open):
    cols = cols or COLS + (["seq"] if any("seq" in r for r in rows) else [])
    with opener(path, "wt", newline="") as f:
        w = csv.DictWriter(f, cols, extrasaction="ignore", lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    return str(path)


def write_jsonl(path, rows, opener=open):
    with opener(path, "wt") as f:
        for r in rows:
            f.write(json.dumps({k: (None if v == "" else v) for k, v in r.items()}) + "\n")
    return str(path)


def diagnose(path):
    """(job, findings, recoveries, timeline) of a table, through a store as the CLI does it."""
    with table_store(str(path)) as (store, job):
        tl, findings, recoveries, _report = replay(store)
    return job, findings, recoveries, tl


def judged(findings):
    return [(f.kind, f.cls, f.ranks) for f in findings]


# ---- formats ------------------------------------------------------------------------------------

SMALL = dict(steps=23)  # a prime number of collectives: a lost or doubled event shows in the counts


def _counts(tl):
    return dict(tl.enter_counts), dict(tl.end_counts)


def test_csv_happy_path_every_collective_reaches_the_timeline(tmp_path):
    path = write_csv(tmp_path / "ops.csv", synth(**SMALL))
    job, findings, _, tl = diagnose(path)
    assert job.table.fmt == "csv" and job.table.bad_rows == 0
    assert job.world == 4 and job.ranks == [0, 1, 2, 3]
    assert list(job.groups) == ["world"] and job.groups["world"].collectives == 23
    assert _counts(tl) == ({(r, "allreduce"): 23 for r in range(4)}, {(r, "allreduce"): 23 for r in range(4)})
    assert all(c.completed_at is not None for c in tl.comms[job.groups["world"].comm].colls.values())
    assert findings == []


@pytest.mark.parametrize("fmt", ["csv.gz", "jsonl", "jsonl.gz"])
def test_other_formats_read_the_same_rows(tmp_path, fmt):
    rows = synth(**SMALL)
    base = read_table(write_csv(tmp_path / "base.csv", rows))
    opener = gzip.open if fmt.endswith(".gz") else open
    writer = write_jsonl if fmt.startswith("jsonl") else write_csv
    t = read_table(writer(tmp_path / f"ops.{fmt}", rows, opener=opener))
    assert t.fmt == fmt and t.bad_rows == 0
    assert [(r.rank, r.op, r.kind, r.start, r.duration, r.step, r.nbytes) for r in t.rows] == \
           [(r.rank, r.op, r.kind, r.start, r.duration, r.step, r.nbytes) for r in base.rows]


def test_format_is_told_by_content_when_the_name_does_not_say(tmp_path):
    rows = synth(steps=3)
    assert read_table(write_jsonl(tmp_path / "table", rows, opener=gzip.open)).fmt == "jsonl.gz"
    assert read_table(write_csv(tmp_path / "table2", rows)).fmt == "csv"


def test_parquet_with_pyarrow_or_a_clear_error_without(tmp_path, monkeypatch):
    # Not a skip without pyarrow: `make test` requires the unit tier, where a skip fails the run, and
    # pyarrow is no dependency of ccld; without it, what a user gets is the error, checked here either
    # way (with pyarrow installed, by hiding it).
    rows = synth(**SMALL)
    path = str(tmp_path / "ops.parquet")
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        pa = pq = None
    if pq is None:
        with open(path, "wb") as f:
            f.write(b"PAR1" + b"\0" * 64 + b"PAR1")
    else:
        pq.write_table(pa.Table.from_pylist([{c: r.get(c) for c in COLS} for r in rows]), path)
        t = read_table(path)
        assert t.fmt == "parquet" and t.bad_rows == 0 and len(t.rows) == len(rows)
        assert [(r.rank, r.op, r.kind, r.step) for r in t.rows] == \
               [(r.rank, r.op, r.kind, r.step) for r in read_table(write_csv(tmp_path / "ops.csv", rows)).rows]
    with monkeypatch.context() as m:  # as on a machine without pyarrow
        m.setitem(sys.modules, "pyarrow", None)
        m.setitem(sys.modules, "pyarrow.parquet", None)
        with pytest.raises(OpsTableError, match=r"ops.parquet: reading Parquet needs pyarrow.*pip install pyarrow"):
            read_table(path)
    if pq is None:
        return
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(OpsTableError, match="not a readable Parquet file"):
        read_table(path)


def test_op_names_and_kinds():
    for name in ("all_reduce", "AllReduce", "nccl:all_reduce", "ncclAllReduce", "all-reduce", "gloo:allreduce"):
        assert normalize_op(name) == "allreduce"
    assert normalize_op("ReduceScatter") == normalize_op("reduce-scatter") == "reduce_scatter"
    assert [guess_kind(normalize_op(n)) for n in ("barrier", "_allgather_base", "isend", "Recv", "forward",
                                                  "optimizer.step")] == \
           ["collective", "collective", "p2p", "p2p", "compute", "compute"]


# ---- damaged inputs -----------------------------------------------------------------------------

def test_truncated_gzip_keeps_the_rows_before_the_cut(tmp_path):
    rows = synth(steps=200)
    path = write_csv(tmp_path / "ops.csv.gz", rows, opener=gzip.open)
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) * 2 // 3])
    t = read_table(path)
    assert 0 < len(t.rows) < len(rows)
    assert t.bad_rows == 1 and t.bad[0] == (f"{path}: truncated after row {len(t.rows)}: the compressed data "
                                            "ends early; the rows before it are read")
    assert [(r.rank, r.start) for r in t.rows] == [(r["rank"], r["start"]) for r in rows[:len(t.rows)]]


def test_missing_column_names_it(tmp_path):
    rows = synth(steps=3)
    with pytest.raises(OpsTableError, match=r"ops.csv: missing column 'start' \(found: rank, op, duration, step, "
                                            r"bytes\)"):
        read_table(write_csv(tmp_path / "ops.csv", rows, cols=["rank", "op", "duration", "step", "bytes"]))
    for r in rows:
        del r["duration"]
    with pytest.raises(OpsTableError, match="ops.jsonl: missing column 'duration'"):
        read_table(write_jsonl(tmp_path / "ops.jsonl", rows))


def test_wrong_types_in_one_row_is_one_line_and_the_rest_is_read(tmp_path, capsys):
    rows = synth(**SMALL)
    rows[5]["start"] = "soon"
    rows[9]["rank"] = "two"
    rows[11]["kind"] = "gpu"
    path = write_csv(tmp_path / "ops.csv", rows, cols=COLS + ["kind"])
    t = read_table(path)
    assert t.bad == [f"{path}: row 6: column 'start': expected seconds (a number), found 'soon'",
                     f"{path}: row 10: column 'rank': expected an integer, found 'two'",
                     f"{path}: row 12: column 'kind': expected one of collective, p2p, compute, found 'gpu'"]
    assert len(t.rows) == len(rows) - 3
    assert cli.main(["diagnose", "--ops", path]) == 0
    out, err = capsys.readouterr()
    assert err.splitlines() == [f"ccld: {line}" for line in t.bad]
    assert "(3 bad, skipped)" in out.splitlines()[0]


def test_seq_column_problems_are_bad_rows(tmp_path):
    rows = synth(steps=30, seq=True)
    colls = [r for r in rows if r["op"] == "all_reduce"]
    colls[4]["seq"] = ""  # row 13 (rank 0, step 2): no seq where the group has them
    colls[8]["seq"] = 1   # row 21 (rank 0, step 3): rank 0's seq 1 again (row 5)
    t = read_table(write_csv(tmp_path / "ops.csv", rows))
    job = make_job(t)
    assert [b.split(": ", 2)[1:] for b in t.bad] == [
        ["row 13", "column 'seq': empty, where group world numbers its collectives (give every one its seq, or "
                   "leave the column out)"],
        ["row 21", "column 'seq': rank 0 already ran seq 1 of group world (row 5)"]]
    assert len([r for r in job.rows if r.kind == "collective"]) == len(colls) - 2


def test_a_lost_collective_row_shifts_nothing_beyond_its_step(tmp_path):
    rows = synth(steps=80, late=2, skip_last=1)
    first = next(r for r in rows if r["rank"] == 2 and r["op"] == "all_reduce")
    first["start"] = "soon"  # rank 2's first all-reduce is lost: counted per step, its later ones still match
    job, findings, _, _ = diagnose(write_csv(tmp_path / "ops.csv", rows))
    assert job.table.bad_rows == 1 and job.groups["world"].numbered == "counted per step"
    assert judged(findings) == [("slow", "comp-slow", [2]), ("hang", "not-entered", [1])]


def test_a_rank_with_no_rows_is_expected_in_the_default_group(tmp_path):
    path = write_csv(tmp_path / "ops.csv", synth(steps=30, skip_last=1, absent=(2,)))
    job, findings, _, _ = diagnose(path)
    assert job.world == 4 and job.ranks == [0, 1, 3] and job.groups["world"].members == [0, 1, 2, 3]
    assert "ranks 0,1,3 (no rows from 2)" in opframes.format_job(job)[0]
    assert judged(findings) == [("hang", "not-entered", [1, 2])]
    two = next(d for d in findings[0].evidence["ranks"] if d["rank"] == 2)
    assert two["seen"] is False  # never announced: "not reported", not a made-up process


# ---- frames -------------------------------------------------------------------------------------

def test_frames_cover_the_table_like_an_agent(tmp_path):
    rows = synth(steps=40, skip_last=1)  # ends with a 30 s wait in which nothing happens
    job = make_job(read_table(write_csv(tmp_path / "ops.csv", rows)))
    got = list(frames(job))
    recv = [t for t, _ in got]
    assert recv == sorted(recv) and recv[-1] == pytest.approx(job.t_end + job.shift)
    assert max(b - a for a, b in zip(recv, recv[1:])) <= opframes.HEARTBEAT_S + 1e-9  # never a silent agent
    assert len(got) < (job.t_end - job.t_first) / opframes.SHIP_S + 2
    kinds = [e.KIND for _, e in events(job)]
    assert kinds.count("coll") == 40 * 4 - 1 and kinds.count("end") == 40 * 4 - 1
    assert kinds.count("rank") == 4 and kinds.count("comm") == 4 and "start" not in kinds


def test_relative_times_end_when_the_file_was_written(tmp_path):
    path = write_csv(tmp_path / "ops.csv", synth(steps=3))
    os.utime(path, (1_800_000_000, 1_800_000_000))
    job = make_job(read_table(path))
    assert job.shift + job.t_end == 1_800_000_000
    unix = [dict(r, start=r["start"] + 1_700_000_000) for r in synth(steps=3)]
    job = make_job(read_table(write_csv(tmp_path / "unix.csv", unix)))
    assert job.shift == 0


# ---- findings, through the unchanged detectors --------------------------------------------------

def test_rank_late_step_after_step_is_comp_slow(tmp_path):
    _, findings, _, _ = diagnose(write_csv(tmp_path / "ops.csv", synth(late=2)))
    assert judged(findings) == [("slow", "comp-slow", [2])]
    ev = findings[0].evidence
    assert ev["reason"] == "late-arrival" and ev["ranks"][0]["median_lag_s"] == pytest.approx(0.03, abs=0.002)


def test_rank_missing_the_last_collective_is_not_entered(tmp_path):
    _, findings, recoveries, _ = diagnose(write_csv(tmp_path / "ops.csv", synth(skip_last=1)))
    assert judged(findings) == [("hang", "not-entered", [1])]
    assert findings[0].seq == 200 and recoveries == []
    assert findings[0].evidence["ranks"][0]["last_entered"]["seq"] == 199


def test_the_tables_end_is_now_an_open_collective_just_entered_is_in_flight(tmp_path):
    _, findings, _, _ = diagnose(write_csv(tmp_path / "ops.csv", synth(skip_last=1, open_last=True)))
    assert findings == []  # the others entered it as the table ended: nobody has waited yet


def test_op_mismatch_at_one_seq_is_inconsistent(tmp_path):
    _, findings, _, _ = diagnose(write_csv(tmp_path / "ops.csv", synth(mismatch=(200, 3), seq=True)))
    assert judged(findings) == [("hang", "inconsistent", [3])]
    assert findings[0].seq == 200 and findings[0].evidence["reason"] == "different-op"


def test_size_mismatch_at_one_seq_is_inconsistent(tmp_path):
    rows = synth(seq=True)
    next(r for r in rows if r.get("seq") == 200 and r["rank"] == 1)["bytes"] = 8192
    _, findings, _, _ = diagnose(write_csv(tmp_path / "ops.csv", rows))
    assert judged(findings) == [("hang", "inconsistent", [1])] and findings[0].seq == 200


def test_healthy_table_has_no_culprit(tmp_path):
    _, findings, _, _ = diagnose(write_csv(tmp_path / "ops.csv", synth(jitter=0.01)))
    assert findings == []
    _, findings, _, _ = diagnose(write_csv(tmp_path / "compute.csv", compute_only(synth(jitter=0.01))))
    assert findings == []


def compute_only(rows):
    return [r for r in rows if r["op"] == "forward"]


def test_one_rank_computing_longer_is_comp_slow_by_its_durations(tmp_path):
    """Compute rows alone (no collective to arrive late at) name the rank by its durations; with the
    collectives too, the late-arrival finding names it and carries the durations beside."""
    _, findings, _, _ = diagnose(write_csv(tmp_path / "compute.csv", compute_only(synth(late=2, jitter=0.002))))
    assert judged(findings) == [("slow", "comp-slow", [2])]
    f = findings[0]
    (d,) = f.evidence["ranks"]
    assert (f.op, f.evidence["reason"], d["op"]) == ("forward", "compute-duration", "forward")
    assert d["median_s"] == pytest.approx(0.092, abs=0.004) and d["others_median_s"] == pytest.approx(0.062, abs=0.004)
    assert d["median_extra_s"] == pytest.approx(0.03, abs=0.004) and d["longer_in"] >= 0.9 * d["of"]
    assert "together" not in f.evidence
    assert format_line(f).startswith("SLOW comp-slow [2] compute.csv forward: rank 2 forward ~30 ms longer than the")
    _, findings, _, _ = diagnose(write_csv(tmp_path / "ops.csv", synth(late=2, jitter=0.002)))
    assert judged(findings) == [("slow", "comp-slow", [2])]
    ev = findings[0].evidence
    assert ev["reason"] == "late-arrival" and ev["compute"]["reason"] == "compute-duration"
    assert ev["summary"] == "rank 2 ~30 ms late at allreduce (forward ~30 ms longer)"


def test_two_ranks_slow_together_are_one_finding_that_says_so(tmp_path):
    """Ranks 2 and 3 (one pipeline stage) compute 30 ms longer every step: as many late as on time, so
    the median sits between them; each all-reduce's late cluster names them, together."""
    _, findings, _, _ = diagnose(write_csv(tmp_path / "ops.csv", synth(late=(2, 3), jitter=0.002)))
    assert judged(findings) == [("slow", "comp-slow", [2, 3])]
    ev = findings[0].evidence
    assert (ev["reason"], ev["together"], ev["grouped"]) == ("late-arrival", True, True)
    assert [d["median_lag_s"] for d in ev["ranks"]] == [pytest.approx(0.03, abs=0.004)] * 2
    assert ev["summary"].startswith("ranks 2, 3 slow together: ~30 ms late at allreduce")
    assert ev["compute"]["together"] is True
    assert ev["compute"]["ranks"][1]["median_extra_s"] == pytest.approx(0.03, abs=0.004)
    assert format_line(findings[0]) == \
        "SLOW comp-slow [2,3] ops:world allreduce: ranks 2, 3 slow together: ~30 ms late at allreduce"
    _, findings, _, _ = diagnose(write_csv(tmp_path / "compute.csv", compute_only(synth(late=(2, 3), jitter=0.002))))
    assert judged(findings) == [("slow", "comp-slow", [2, 3])]
    assert findings[0].evidence["summary"] == "ranks 2, 3 slow together: ~30 ms longer than the others"
    # two of eight slowed by different amounts: each named, not "together"
    rows = synth(ranks=8, late=(2, 5), jitter=0.002)
    for r in rows:
        if r["rank"] == 5 and r["op"] == "forward":
            r["duration"] = round(r["duration"] + 0.03, 6)
    _, findings, _, _ = diagnose(write_csv(tmp_path / "apart.csv", compute_only(rows)))
    assert judged(findings) == [("slow", "comp-slow", [2, 5])] and "together" not in findings[0].evidence


def test_random_stragglers_are_spread_not_a_culprit(tmp_path):
    """A random rank of eight is 50 ms slow each step: the job waits, nobody is the culprit; diagnose
    says so once (kind info, class spread), from the collectives or, without them, the compute rows."""
    rows = synth(ranks=8, steps=300, jitter=0.02, spread=True)
    _, findings, _, _ = diagnose(write_csv(tmp_path / "ops.csv", rows))
    assert judged(findings) == [("info", "spread", [])]
    f = findings[0]
    ev = f.evidence
    assert ev["informational"] and ev["ranks_last"] == 8 and ev["most_last_share"] < 0.5
    assert ev["waited_fraction"] > 0.2 and f.op == "allreduce"
    assert format_line(f) == \
        "INFO spread ops:world allreduce: no culprit: 8 ranks take turns arriving last, ~50 ms behind"
    _, findings, _, _ = diagnose(write_csv(tmp_path / "compute.csv", compute_only(rows)))
    assert judged(findings) == [("info", "spread", [])] and findings[0].op == "forward"
    assert findings[0].evidence["summary"] == "no culprit: 8 ranks take turns finishing forward last, ~50 ms behind"


def test_p2p_stream_that_slows_is_comm_slow_on_its_link(tmp_path):
    rows = []
    for i in range(600):  # a 4-stage pipeline: stage r sends to r+1; link 1->2 turns 6x slower at 30 s
        t = 0.1 * i
        for r in range(1, 4):
            xfer = 0.004 * (6 if i >= 300 and r == 2 else 1)
            rows += [{"rank": r - 1, "op": "isend", "peer": r, "start": t, "duration": xfer},
                     {"rank": r, "op": "irecv", "peer": r - 1, "start": t, "duration": xfer}]
            t += xfer + 0.02
    _, findings, _, _ = diagnose(write_csv(tmp_path / "ops.csv", rows, cols=P2P_COLS))
    assert [(f.cls, f.ranks, tuple(f.link)) for f in findings] == [("comm-slow", [1, 2], (1, 2))]


def test_a_pipeline_stage_whose_compute_grows_is_comp_slow_by_its_own_work(tmp_path):
    """A stage that computes longer makes the others wait longer in their recvs and sends: its compute
    rows name it (compute.py); without them, busy.py names it from the time each rank spends outside
    communication."""
    rows, t, free = [], 0.0, {}
    for i in range(1500):  # stage 2's forward goes from 20 to 50 ms at 90 s
        x = t
        for r in range(4):
            if r > 0:
                posted = min(x, free.get(r, t))
                rows += [{"rank": r - 1, "op": "send", "peer": r, "start": x, "duration": 0.004},
                         {"rank": r, "op": "recv", "peer": r - 1, "start": posted, "duration": x + 0.004 - posted}]
                x += 0.004
            c = 0.05 if r == 2 and i >= 900 else 0.02
            rows.append({"rank": r, "op": "forward", "start": x, "duration": c})
            x = free[r] = x + c
        t = max(t + 0.1, x)
    _, findings, _, _ = diagnose(write_csv(tmp_path / "ops.csv", rows, cols=P2P_COLS))
    assert judged(findings) == [("slow", "comp-slow", [2])] and findings[0].evidence["reason"] == "compute-duration"
    (d,) = findings[0].evidence["ranks"]
    assert (d["op"], d["median_s"], d["others_median_s"]) == ("forward", pytest.approx(0.05), pytest.approx(0.02))
    comm_only = [r for r in rows if r["op"] != "forward"]
    _, findings, _, _ = diagnose(write_csv(tmp_path / "comm.csv", comm_only, cols=P2P_COLS))
    assert judged(findings) == [("slow", "comp-slow", [2])] and findings[0].evidence["reason"] == "own-work"


# ---- the command and the documented example ------------------------------------------------------

def test_cli_report_and_export_take_the_table(tmp_path, capsys):
    path = write_csv(tmp_path / "ops.csv", synth(steps=60, late=2))
    assert cli.main(["export", "--ops", path, "--perfetto", str(tmp_path / "t.json")]) == 0
    evs = json.load(open(tmp_path / "t.json"))["traceEvents"]
    compute = {(e["pid"], e["tid"]) for e in evs if e.get("name") == "thread_name" and e["args"]["name"] == "compute"}
    spans = [e for e in evs if e.get("ph") == "X" and (e["pid"], e["tid"]) in compute]
    assert len(compute) == 4 and len(spans) == 4 * 60 and {e["name"] for e in spans} == {"forward"}
    assert cli.main(["export", "--ops", path, "--failure-trace", str(tmp_path / "f.csv")]) == 0
    assert cli.main(["report", "--ops", path, "-o", str(tmp_path / "r.html")]) == 0
    page = open(tmp_path / "r.html").read()
    assert f"ccld export --ops {path} --perfetto" in page and "ccld-ops-" not in page
    out = capsys.readouterr().out
    assert "1 finding" in out and "failure record" in out and "(240 compute)" in out
    assert cli.main(["diagnose", str(tmp_path), "--ops", path]) == 1
    assert "not both" in capsys.readouterr().err


def test_documented_example(capsys):
    """docs/ops-table.md shows `ccld diagnose --ops docs/examples/ops.csv`: the same findings."""
    assert cli.main(["diagnose", "--ops", EXAMPLE]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [ln.split(":")[0] for ln in out if ln.startswith(("SLOW", "HANG"))] == \
           ["SLOW comp-slow [2] ops", "HANG not-entered ranks [1] ops"]
