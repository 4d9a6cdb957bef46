"""`ccld export STORE --failure-trace OUT`: one record per finding, CSV / JSON / JSONL (docs/failure-trace.md)."""
import csv
import json

import pytest

from ccld import cli
from ccld.export.failures import FIELDS, failure_records
from ccld_synth import T0, SynthJob
from test_replay import write_store

pytestmark = pytest.mark.unit


def recording():
    """A 4-rank job on 2 nodes: rank 2 (node1) is 8 s late to seq 31 (a hang that recovers), then
    rank 1 (node0) never enters seq 41 and the recording ends 40 s later (still open)."""
    job = SynthJob(world=4, nodes=2)
    job.announce(T0)
    out = []
    t = T0 + 1

    def ship(now):
        out.extend((now, f) for f in job.frames(now))

    for seq in range(1, 31):
        t = job.collective(seq, t + 0.1)
        ship(t + 0.01)
    onset1 = t + 0.1
    for r in (0, 1, 3):
        job.enter(r, 31, onset1)
    for i in range(1, 17):
        ship(onset1 + 0.5 * i)
    arrive = onset1 + 8.05
    t = job.collective(31, arrive, ranks=[2], finish=False)
    for r in range(4):
        job.start(r, 31, arrive)
        job.end(r, 31, arrive + 0.003)
    ship(arrive + 0.01)
    t = arrive + 0.01
    for seq in range(32, 41):
        t = job.collective(seq, t + 0.1)
        ship(t + 0.01)
    onset2 = t + 0.1
    for r in (0, 2, 3):
        job.enter(r, 41, onset2)
    for i in range(1, 81):  # 40 s: after an 8 s wait that recovered, the threshold is 4 x 8 s
        ship(onset2 + 0.5 * i)
    return out, onset1, arrive, onset2


@pytest.fixture
def store(tmp_path):
    records, onset1, arrive, onset2 = recording()
    path = tmp_path / "store"
    write_store(path, records, closed_at=records[-1][0] + 0.2)
    return path, records, onset1, arrive, onset2


def test_records_say_when_which_ranks_on_which_nodes_failed_and_for_how_long(store):
    path, records, onset1, arrive, onset2 = store
    recs = failure_records(str(path))
    assert [(r["kind"], r["class"], r["ranks"], r["nodes"], r["seq"], r["open"]) for r in recs] == \
        [("hang", "not-entered", [2], ["node1"], 31, False), ("hang", "not-entered", [1], ["node0"], 41, True)]
    first, second = recs
    began, closed = records[0][0], records[-1][0] + 0.2
    assert first["start"] == pytest.approx(onset1, abs=1e-6) and second["start"] == pytest.approx(onset2, abs=1e-6)
    assert first["start_offset_s"] == pytest.approx(onset1 - began, abs=1e-6)
    assert arrive <= first["end"] <= arrive + 0.5 + 0.02     # the first replay tick after rank 2 arrived
    assert first["duration_s"] == pytest.approx(first["end"] - first["start"], abs=1e-6)
    assert first["detected"] - first["start"] == pytest.approx(5.0, abs=0.5 + 1e-6)   # the 5 s floor, ticked
    assert second["end"] is None and second["duration_s"] == pytest.approx(closed - onset2, abs=1e-6)
    assert first["job"] == "job" and first["world_size"] == 4 and first["comm"] == "job/gloo:0"
    assert first["op"] == "allreduce" and first["link"] is None and first["id"].startswith("hang-")


def test_csv_json_and_jsonl_from_the_cli(store, tmp_path, capsys):
    path = store[0]
    out_csv, out_json, out_jsonl = tmp_path / "f.csv", tmp_path / "f.json", tmp_path / "f.jsonl"
    assert cli.main(["export", str(path), "--failure-trace", str(out_csv)]) == 0
    assert capsys.readouterr().out.strip() == (f"ccld export: {out_csv}: 2 failure records (2 not-entered; "
                                               "1 still open at the end of the recording)")
    rows = list(csv.DictReader(out_csv.open()))
    assert list(rows[0].keys()) == FIELDS
    assert [(r["class"], r["ranks"], r["nodes"], r["open"], r["end"] == "") for r in rows] == \
        [("not-entered", "2", "node1", "false", False), ("not-entered", "1", "node0", "true", True)]
    assert cli.main(["export", str(path), "--failure-trace", str(out_json)]) == 0
    doc = json.loads(out_json.read_text())
    assert doc["format"] == "ccld-failure-trace" and doc["version"] == 1
    assert [r["ranks"] for r in doc["records"]] == [[2], [1]]
    assert cli.main(["export", str(path), "--failure-trace", str(out_jsonl)]) == 0
    lines = [json.loads(x) for x in out_jsonl.read_text().splitlines()]
    assert lines == doc["records"] and float(rows[0]["start"]) == lines[0]["start"]
    capsys.readouterr()
    assert cli.main(["export", str(path), "--failure-trace", str(tmp_path / "f.txt")]) == 1
    assert "say the format with the extension: .csv, .json or .jsonl" in capsys.readouterr().err
    assert cli.main(["export", str(path)]) == 1
    assert "--perfetto OUT.pftrace or --failure-trace OUT.csv" in capsys.readouterr().err


def test_the_collectors_findings_file_with_its_recovered_lines(store, tmp_path):
    path = store[0]
    fpath = tmp_path / "findings.jsonl"
    f = {"kind": "slow", "class": "comm-slow", "ranks": [0, 3], "link": [0, 3], "comm": "job/gloo:0", "seq": -1,
         "op": "allreduce", "onset_at": T0 + 10, "detected_at": T0 + 12, "evidence": {"summary": "link 0->3 slow"},
         "stack": None, "id": "slow-abc", "job": "job"}
    fpath.write_text(json.dumps(f) + "\n" + json.dumps({"kind": "recovered", "id": "slow-abc", "class": "comm-slow",
                                                         "recovered_at": T0 + 25}) + "\n")
    (rec,) = failure_records(str(path), findings_path=str(fpath))
    assert (rec["class"], rec["ranks"], rec["nodes"], rec["link"], rec["duration_s"], rec["open"], rec["summary"]) == \
        ("comm-slow", [0, 3], ["node0", "node1"], [0, 3], 15.0, False, "link 0->3 slow")
