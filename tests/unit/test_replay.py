"""Replay: a recorded hang is found offline as live; store damage and rejects end up in the report."""
import json
import os

import pytest

from ccld import wire as ev
from ccld.store import StoreError, StoreWriter
from ccld.timeline.timeline import Timeline
from ccld.diagnose import Diagnoser
from ccld.diagnose.replay import format_report, replay
from ccld.diagnose.tracker import FindingTracker

from ccld_synth import T0, SynthJob

pytestmark = pytest.mark.unit


def recorded_hang():
    """[(recv_unix, frame)] of a job whose rank 2 never enters seq 57; agents keep shipping every 0.5 s."""
    job = SynthJob()
    job.announce(T0)
    out = []
    t = T0 + 1
    for seq in range(1, 57):
        t = job.collective(seq, t + 0.1)
        out += [(t + 0.01, f) for f in job.frames(t + 0.01)]
    onset = t + 0.1
    for r in (0, 1, 3):
        job.enter(r, 57, onset)
    for i in range(1, 21):  # 10 s of batches with proc states while ranks 0,1,3 wait
        now = onset + 0.5 * i
        job.state(2, now - 0.01, "S", "hrtimer_nanosleep", cpu_ns=5 * 10**8)
        out += [(now, f) for f in job.frames(now)]
    return out, onset


def write_store(path, records, garbage_at=None, closed_at=None):
    w = StoreWriter(str(path))
    for i, (t, f) in enumerate(records):
        if i == garbage_at:
            w.append(b"\xc1 not a frame", t)
        w.append(f, t)
    w.close()
    # the writer stamps closed_at with the real clock; these recordings live at T0, so set it
    meta = json.loads((path / "store.json").read_text())
    meta["closed_at"] = records[-1][0] + 0.2 if closed_at is None else closed_at
    (path / "store.json").write_text(json.dumps(meta))


def live(records, step=0.5):
    """What the live collector does, without sockets: ingest in order, detect every `step` s."""
    tl, tr = Timeline(), FindingTracker()
    d = Diagnoser(tl)
    found, tick = [], records[0][0] + step
    for t, f in records:
        while tick <= t:
            found += tr.update(d.find_hangs(tick), tick)[0]
            tick += step
        tl.ingest(ev.decode_batch(f), t)
    return found


def test_recorded_hang_is_found_like_live(tmp_path):
    records, onset = recorded_hang()
    write_store(tmp_path / "s", records, garbage_at=30)
    tl, findings, recoveries, report = replay(str(tmp_path / "s"))
    assert [(f.cls, f.ranks, f.seq, f.op) for f in findings] == [("not-entered", [2], 57, "allreduce")]
    f = findings[0]
    assert f.onset_at == pytest.approx(onset, abs=1e-5)
    assert onset + 5 < f.detected_at <= onset + 5.6
    assert recoveries == []
    want = live(records)
    assert [(x.id, x.onset_at) for x in want] == [(f.id, f.onset_at)]
    assert tl.enter_counts[(2, "allreduce")] == 56 and tl.enter_counts[(0, "allreduce")] == 57
    assert report["records"] == len(records) + 1 and report["frames_ok"] == len(records)
    assert report["frames_rejected"] == {"not-msgpack": 1} and report["reject_examples"]
    assert report["problems"] == [] and report["findings"] == 1 and report["active"] == 1
    json.dumps(report)  # `ccld diagnose --json` prints it


def test_replay_reports_truncated_tail_and_loss(tmp_path):
    records, onset = recorded_hang()
    write_store(tmp_path / "s", records[:40])
    seg = tmp_path / "s" / "segment-000001.ccld"
    with open(seg, "r+b") as fh:
        fh.truncate(os.path.getsize(seg) - 3)
    tl, findings, recoveries, report = replay(str(tmp_path / "s"))
    assert report["records"] == 39 and len(report["problems"]) == 1
    assert "segment-000001.ccld" in report["problems"][0] and "recovered 39 records" in report["problems"][0]
    assert findings == []
    # the lost frame held agent-1's (ranks 2, 3) half of the last collective; after the recording
    # ends both agents are silent, so nothing is judged on the stale picture however long it runs
    meta = json.loads((tmp_path / "s" / "store.json").read_text())
    meta["closed_at"] = onset + 60
    (tmp_path / "s" / "store.json").write_text(json.dumps(meta))
    assert replay(str(tmp_path / "s"))[1] == []


def test_replay_of_unknown_version_is_a_clear_error(tmp_path):
    (tmp_path / "store.json").write_text(json.dumps({"format": "ccld-store", "version": 99}))
    with pytest.raises(StoreError, match="version 99"):
        replay(str(tmp_path))


def test_replay_runs_detection_up_to_close_but_not_on_silent_agents(tmp_path):
    records, onset = recorded_hang()
    cut = [r for r in records if r[0] < onset + 6]  # recording stops 6 s into the hang ...
    write_store(tmp_path / "s", cut, closed_at=onset + 30)  # ... the collector ran on, agents silent
    _, findings, _, _ = replay(str(tmp_path / "s"))
    assert [(f.cls, f.ranks) for f in findings] == [("not-entered", [2])]  # found while agents spoke
    cut = [r for r in records if r[0] < onset + 0.6]  # stops 0.6 s in: silent before the threshold
    write_store(tmp_path / "t", cut, closed_at=onset + 30)
    assert replay(str(tmp_path / "t"))[1] == []  # blind: no verdict on a picture that went stale


def test_format_report_names_every_loss(tmp_path):
    records, onset = recorded_hang()
    write_store(tmp_path / "s", records, garbage_at=3)
    seg = tmp_path / "s" / "segment-000001.ccld"
    with open(seg, "ab") as fh:
        fh.write(b"\x00\x00\x10\x00")
    _, _, _, report = replay(str(tmp_path / "s"))
    report["agent_loss"] = {"agent-0": {"ringbuf_lost": 4, "queue_dropped": 0}}
    lines = format_report(report)
    text = "\n".join(lines)
    assert lines[0].startswith(f"store {tmp_path / 's'}: {len(records) + 1} frames in 1 segments")
    assert "2 agents, 4 ranks, 1 communicators" in lines[0]
    assert "store problem: segment-000001.ccld: truncated record header" in text
    assert "frames rejected: not-msgpack 1" in text
    assert "agent agent-0 lost: ringbuf_lost 4" in text and "queue_dropped" not in text
    assert all(len(x) <= 160 for x in lines)
