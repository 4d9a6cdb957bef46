"""The append-only store: write/read round trip, rotation, flushing, damage and version handling."""
import json
import os
import struct

import pytest

from ccld import events as ev
from ccld.collector import store as st
from ccld.errors import CcldError

pytestmark = pytest.mark.unit


def frames(n, size=None):
    """n distinct frames: real ones by default, or opaque blobs of `size` bytes (the store never decodes)."""
    if size is not None:
        return [bytes([i % 256]) * size for i in range(n)]
    return [ev.encode_batch("a", "n", i, [ev.ClockSample(mono_ns=i, wall_ns=1 + i, ts_ns=i)]) for i in range(1, n + 1)]


def test_round_trip(tmp_path):
    d = str(tmp_path / "s")
    w = st.StoreWriter(d)
    fs = frames(23)
    for i, f in enumerate(fs):
        w.append(f, 1000.0 + i / 8)
    w.close()
    meta = json.load(open(os.path.join(d, "store.json")))
    assert meta["format"] == "ccld-store" and meta["version"] == 1 and "closed_at" in meta
    got = list(st.read_store(d))
    assert [f for _, f in got] == fs
    assert [t for t, _ in got] == [1000.0 + i / 8 for i in range(23)]
    assert os.listdir(d).count("segment-000001.ccld") == 1
    # the record layout is the documented one
    raw = open(os.path.join(d, "segment-000001.ccld"), "rb").read()
    n, t = struct.unpack(">Id", raw[:12])
    assert n == len(fs[0]) and t == 1000.0 and raw[12:12 + n] == fs[0]


def test_rotation_and_reopen_never_overwrites(tmp_path):
    d = str(tmp_path / "s")
    w = st.StoreWriter(d, segment_bytes=1000)
    for i, f in enumerate(frames(50, size=100)):  # 112-byte records: 8 per segment
        w.append(f, float(i))
    w.close()
    segs = sorted(x for x in os.listdir(d) if x.endswith(".ccld"))
    assert segs[0] == "segment-000001.ccld" and len(segs) == 7
    assert all(os.path.getsize(os.path.join(d, s)) <= 1000 for s in segs)
    w2 = st.StoreWriter(d, segment_bytes=1000)  # a restarted collector continues the store
    w2.append(b"x" * 10, 99.0)
    w2.close()
    got = list(st.read_store(d))
    assert len(got) == 51 and got[-1] == (99.0, b"x" * 10)
    assert "segment-000008.ccld" in os.listdir(d)


def test_a_frame_bigger_than_a_segment_gets_its_own(tmp_path):
    d = str(tmp_path / "s")
    w = st.StoreWriter(d, segment_bytes=100)
    w.append(b"a" * 10, 1.0)
    w.append(b"b" * 500, 2.0)
    w.close()
    assert [f for _, f in st.read_store(d)] == [b"a" * 10, b"b" * 500]


def test_flushes_every_interval_and_on_close(tmp_path):
    now = [0.0]
    d = str(tmp_path / "s")
    w = st.StoreWriter(d, clock=lambda: now[0])
    w.append(b"x" * 10, 1.0)
    seg = os.path.join(d, "segment-000001.ccld")
    assert os.path.getsize(seg) == 0  # buffered
    now[0] = 0.6
    w.maybe_flush()  # what the collector calls when no frames arrive
    assert os.path.getsize(seg) == 22
    w.append(b"y" * 10, 2.0)
    w.close()
    assert os.path.getsize(seg) == 44


def test_truncated_last_record_keeps_everything_before(tmp_path):
    d = str(tmp_path / "s")
    w = st.StoreWriter(d)
    for i, f in enumerate(frames(5, size=40)):
        w.append(f, float(i))
    w.close()
    seg = os.path.join(d, "segment-000001.ccld")
    size = os.path.getsize(seg)
    with open(seg, "r+b") as f:
        f.truncate(size - 7)  # a crash in the middle of writing the last frame
    problems = []
    got = list(st.read_store(d, problems))
    assert len(got) == 4
    assert len(problems) == 1
    assert "segment-000001.ccld" in problems[0] and f"offset {4 * 52}" in problems[0]
    assert "recovered 4 records" in problems[0]


def test_truncated_header(tmp_path):
    d = str(tmp_path / "s")
    w = st.StoreWriter(d)
    w.append(b"abc", 1.0)
    w.close()
    with open(os.path.join(d, "segment-000001.ccld"), "ab") as f:
        f.write(b"\x00\x00\x00")
    problems = []
    assert list(st.read_store(d, problems)) == [(1.0, b"abc")]
    assert "truncated record header at offset 15" in problems[0]


def test_missing_store_json(tmp_path):
    (tmp_path / "segment-000001.ccld").write_bytes(b"")
    with pytest.raises(st.StoreError, match=r"store\.json: missing") as ei:
        st.read_store(str(tmp_path))
    assert isinstance(ei.value, CcldError)
    with pytest.raises(st.StoreError, match="no such store directory"):
        st.read_store(str(tmp_path / "nope"))


def test_unknown_store_version_names_file_and_version(tmp_path):
    (tmp_path / "store.json").write_text(json.dumps({"format": "ccld-store", "version": 7}))
    with pytest.raises(st.StoreError) as ei:
        st.read_store(str(tmp_path))
    msg = str(ei.value)
    assert "store.json" in msg and "version 7" in msg and "version 1" in msg
    with pytest.raises(st.StoreError, match="version 7"):
        st.StoreWriter(str(tmp_path))  # and the writer refuses to append to it


def test_not_a_store(tmp_path):
    (tmp_path / "store.json").write_text("[1, 2")
    with pytest.raises(st.StoreError, match="cannot be read as JSON"):
        st.read_store(str(tmp_path))
    (tmp_path / "store.json").write_text(json.dumps({"format": "other", "version": 1}))
    with pytest.raises(st.StoreError, match="'other'"):
        st.read_store(str(tmp_path))


def test_stats_json_is_rewritten(tmp_path):
    d = str(tmp_path / "s")
    w = st.StoreWriter(d)
    w.write_stats({"frames_ok": 1})
    w.write_stats({"frames_ok": 2, "frames_rejected": {"empty": 1}})
    w.close()
    s = st.read_stats(d)
    assert s["format"] == "ccld-stats" and s["frames_ok"] == 2 and s["frames_rejected"] == {"empty": 1}
    assert not [x for x in os.listdir(d) if x.endswith(".tmp")]
