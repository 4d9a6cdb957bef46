"""The append-only store: write/read round trip, rotation, flushing, damage and version handling.
(Corruption sweeps, SIGKILL recovery and the durability counters: test_store_durability.py.)"""
import json
import os
import struct
import zlib

import pytest

from ccld import store as st
from ccld import wire as ev
from ccld.errors import CcldError
from ccld.store.layout import RECORD_MAGIC

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
    assert meta["format"] == "ccld-store" and meta["version"] == 2 and "closed_at" in meta
    got = list(st.read_store(d))
    assert [f for _, f in got] == fs
    assert [t for t, _ in got] == [1000.0 + i / 8 for i in range(23)]
    assert os.listdir(d).count("segment-000001.ccld") == 1
    # the record layout is the documented one: magic, u32 length, f64 recv, u32 crc32, frame
    raw = open(os.path.join(d, "segment-000001.ccld"), "rb").read()
    magic, n, t, crc = struct.unpack(">4sIdI", raw[:20])
    assert magic == b"\xc1\xcc\x1d\x02" and n == len(fs[0]) and t == 1000.0 and raw[20:20 + n] == fs[0]
    assert crc == zlib.crc32(raw[:16] + fs[0])
    assert len(raw) == sum(20 + len(f) for f in fs)


def test_rotation_and_reopen_never_overwrites(tmp_path):
    d = str(tmp_path / "s")
    w = st.StoreWriter(d, segment_bytes=1000)
    for i, f in enumerate(frames(50, size=100)):  # 120-byte records: 8 per segment
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
    assert os.path.getsize(seg) == 30
    w.append(b"y" * 10, 2.0)
    w.close()
    assert os.path.getsize(seg) == 60


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
    assert "segment-000001.ccld" in problems[0] and f"truncated record at offset {4 * 60}" in problems[0]
    assert "recovered 4 records" in problems[0]
    p = problems[0]
    assert (p.kind, p.segment, p.offset, p.length) == ("torn-tail", "segment-000001.ccld", 240, 53)


def test_truncated_header(tmp_path):
    d = str(tmp_path / "s")
    w = st.StoreWriter(d)
    w.append(b"abc", 1.0)
    w.close()
    with open(os.path.join(d, "segment-000001.ccld"), "ab") as f:
        f.write(b"\x00\x00\x00")
    problems = []
    assert list(st.read_store(d, problems)) == [(1.0, b"abc")]
    assert "truncated record header at offset 23 (3 of 20 bytes)" in problems[0]


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
    assert "store.json" in msg and "version 7" in msg and "version 1 and 2" in msg
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


def records_at(d):
    """[(offset, length)] of each record of segment 1, walking the documented layout."""
    raw = open(os.path.join(d, "segment-000001.ccld"), "rb").read()
    out, off = [], 0
    while off < len(raw):
        n = struct.unpack_from(">I", raw, off + 4)[0]
        out.append((off, 20 + n))
        off += 20 + n
    return out


def small_store(d, n=13):
    w = st.StoreWriter(d)
    fs = frames(n)
    for i, f in enumerate(fs):
        w.append(f, 100.0 + i)
    w.close()
    return fs


def poke(d, offset, xor=0x01):
    seg = os.path.join(d, "segment-000001.ccld")
    with open(seg, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ xor]))


@pytest.mark.parametrize("where, why", [(30, "checksum mismatch"),    # a frame byte
                                        (10, "checksum mismatch"),    # recv time
                                        (0, "no record marker"),      # the marker
                                        (7, "checksum mismatch")])    # length, off by one: still inside
def test_damage_in_the_middle_skips_that_record_only(tmp_path, where, why):
    d = str(tmp_path / "s")
    fs = small_store(d)
    at = records_at(d)
    off, size = at[6]
    poke(d, off + where)
    problems = []
    got = list(st.read_store(d, problems))
    assert [f for _, f in got] == fs[:6] + fs[7:]            # the 6 before and the 6 after are kept
    assert [t for t, _ in got] == [100.0 + i for i in range(13) if i != 6]
    assert len(problems) == 1
    p = problems[0]
    assert (p.kind, p.segment, p.offset, p.length) == ("damaged", "segment-000001.ccld", off, size)
    assert f"damaged record at offset {off} ({why}); skipped {size} bytes" in p
    assert f"resumed at the good record at offset {at[7][0]}" in p


def test_length_blown_up_in_the_middle_resyncs(tmp_path):
    d = str(tmp_path / "s")
    fs = small_store(d)
    at = records_at(d)
    poke(d, at[3][0] + 4, xor=0x80)  # length now ~2 GiB: impossible; or past the end
    problems = []
    assert [f for _, f in st.read_store(d, problems)] == fs[:3] + fs[4:]
    assert [(p.kind, p.offset, p.length) for p in problems] == [("damaged", at[3][0], at[3][1])]
    assert "impossible length" in problems[0]


def test_a_frame_that_contains_the_marker_is_not_mistaken_for_a_record(tmp_path):
    d = str(tmp_path / "s")
    fake = b"\x00" * 7 + RECORD_MAGIC + b"\x00\x00\x00\x05" + b"\x01" * 30
    w = st.StoreWriter(d)
    for i in range(5):
        w.append(fake if i == 2 else b"frame %d" % i, float(i))
    w.close()
    at = records_at(d)
    poke(d, at[2][0] + 2)  # break the real record around the fake marker
    problems = []
    assert [f for _, f in st.read_store(d, problems)] == [b"frame 0", b"frame 1", b"frame 3", b"frame 4"]
    assert [(p.offset, p.length) for p in problems] == [at[2]]


def test_garbage_between_records_is_skipped_and_reported(tmp_path):
    d = str(tmp_path / "s")
    fs = small_store(d, 5)
    at = records_at(d)
    seg = os.path.join(d, "segment-000001.ccld")
    raw = open(seg, "rb").read()
    cut = at[2][0]
    open(seg, "wb").write(raw[:cut] + b"\xff" * 37 + raw[cut:])  # e.g. a half-written record, then a restart
    problems = []
    assert [f for _, f in st.read_store(d, problems)] == fs
    assert [(p.kind, p.offset, p.length) for p in problems] == [("damaged", cut, 37)]


def write_v1_store(d, records, closed=True):
    """A store as ccld 0.1 wrote it: version 1, [u32 len][f64 recv][frame] records."""
    os.makedirs(d)
    meta = {"format": "ccld-store", "version": 1, "created_at": 1.0, "opened_at": 1.0}
    if closed:
        meta["closed_at"] = 2.0
    with open(os.path.join(d, "store.json"), "w") as f:
        json.dump(meta, f)
    with open(os.path.join(d, "segment-000001.ccld"), "wb") as f:
        for t, fr in records:
            f.write(struct.pack(">Id", len(fr), t) + fr)


def test_version_1_store_is_still_read(tmp_path):
    d = str(tmp_path / "v1")
    recs = [(10.0 + i, f) for i, f in enumerate(frames(7))]
    write_v1_store(d, recs, closed=False)  # a v1 store has no writer.lock: not reported as killed
    problems = []
    assert list(st.read_store(d, problems)) == recs and problems == []
    with open(os.path.join(d, "segment-000001.ccld"), "ab") as f:
        f.write(struct.pack(">Id", 50, 99.0) + b"z" * 10)  # torn tail
    assert list(st.read_store(d, problems)) == recs
    assert len(problems) == 1 and problems[0].kind == "torn-tail"
    assert "truncated record at offset" in problems[0] and "recovered 7 records" in problems[0]


def test_writer_refuses_to_append_to_a_version_1_store(tmp_path):
    d = str(tmp_path / "v1")
    write_v1_store(d, [(1.0, b"abc")])
    with pytest.raises(st.StoreError, match=r"store\.json: store version 1 .*new --store directory"):
        st.StoreWriter(d)
    assert list(st.read_store(d)) == [(1.0, b"abc")]  # untouched
    assert json.load(open(os.path.join(d, "store.json")))["version"] == 1


def test_one_writer_per_store(tmp_path):
    d = str(tmp_path / "s")
    w = st.StoreWriter(d)
    with pytest.raises(st.StoreError, match=rf"another collector \(pid {os.getpid()}\) is writing"):
        st.StoreWriter(d)
    w.append(b"a", 1.0)
    w.close()
    w2 = st.StoreWriter(d)  # the lock went with close()
    w2.close()
    assert "unclean_ends" not in json.load(open(os.path.join(d, "store.json")))
