"""Store durability: what is flushed/fsynced is counted and acknowledged, a SIGKILLed writer loses only
its unflushed tail (and that is reported), a failing disk loses no accepted frame, and a sweep of
corruptions never raises and keeps every record the corruption did not touch."""
import errno
import json
import os
import random
import signal
import struct
import subprocess
import sys
import textwrap

import pytest

from ccld import store as st
from ccld import wire as ev
from ccld.store import writer as store_writer
from ccld.store.layout import RECORD_HEADER, RECORD_MAGIC

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "bench"))
from store_bench import corrupt  # noqa: E402  (the same corruption generator as the benchmark's sweep)

pytestmark = pytest.mark.unit

HDR = RECORD_HEADER.size  # 20


def frame(i):
    return ev.encode_batch("agent-0", "node-0", i, [ev.ClockSample(mono_ns=i, wall_ns=10 + i, ts_ns=i)])


def test_counters_follow_flush_and_fsync(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    now = [0.0]
    d = str(tmp_path / "s")
    w = st.StoreWriter(d, clock=lambda: now[0])
    n_meta = len(synced)  # store.json and the directory, at open
    for i in range(3):
        w.append(frame(i), 1.0 + i)
    assert (w.records, w.flushed_records, w.durable_records) == (3, 0, 0)
    now[0] = 0.6
    w.maybe_flush()
    assert (w.records, w.flushed_records, w.durable_records) == (3, 3, 3)
    assert w.fsyncs == 1
    now[0] = 1.2
    w.maybe_flush()  # nothing new: no fsync
    assert w.fsyncs == 1
    w.append(frame(3), 4.0)
    w.write_stats({"frames_ok": 4})  # flushes first: stats.json acknowledges what is on disk now
    s = st.read_stats(d)
    assert s["frames_ok"] == 4 and s["store_records"] == 4 and s["store_durable_records"] == 4
    assert s["store_flushed_records"] == 4 and s["store_fsync"] is True and s["store_fsyncs"] == 2
    w.close()
    assert len(synced) > n_meta + 2
    meta = json.load(open(os.path.join(d, "store.json")))
    assert meta["fsync"] is True and meta["flush_interval_s"] == 0.5


def test_without_fsync_only_close_makes_records_durable(tmp_path):
    now = [0.0]
    w = st.StoreWriter(str(tmp_path / "s"), fsync=False, clock=lambda: now[0])
    w.append(frame(1), 1.0)
    now[0] = 1.0
    w.maybe_flush()
    assert (w.flushed_records, w.durable_records, w.fsyncs) == (1, 0, 0)
    w.close()
    assert (w.flushed_records, w.durable_records, w.fsyncs) == (1, 1, 1)


def test_pending_bytes_are_bounded_between_flushes(tmp_path, monkeypatch):
    monkeypatch.setattr(store_writer, "WRITE_CHUNK_BYTES", 1000)
    now = [0.0]
    d = str(tmp_path / "s")
    w = st.StoreWriter(d, clock=lambda: now[0])  # the clock never moves: no interval flush
    for i in range(50):
        w.append(b"x" * 80, float(i))  # 100-byte records
        assert len(w._buf) <= 1000
    assert w.flushed_records == 40 and os.path.getsize(os.path.join(d, "segment-000001.ccld")) == 4000
    w.close()


def test_a_failing_disk_loses_no_accepted_frame(tmp_path, monkeypatch):
    """write() fails (ENOSPC) after a partial write: the frame that needed the room is refused (the
    collector counts it), the partial bytes are completed later, so the segment stays clean."""
    monkeypatch.setattr(store_writer, "WRITE_CHUNK_BYTES", 1000)
    real_write = os.write
    plan = []

    def write(fd, data):
        step = plan.pop(0) if plan else None
        if step == "partial":
            return real_write(fd, bytes(data[:33]))  # a short write: the disk is filling up
        if step == "fail":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    d = str(tmp_path / "s")
    w = st.StoreWriter(d, clock=lambda: 0.0)
    accepted = []
    for i in range(30):  # 100-byte records: a write() every 10th append (i = 10, 20, 21, 22 here)
        if i == 20:  # the write-out before frame 20 gets 33 bytes out, then fails; its retry too
            plan[:] = ["partial", "fail", "fail"]
        try:
            w.append(b"%03d" % i + b"y" * 77, float(i))
            accepted.append(i)
        except OSError:
            pass
    assert accepted == [i for i in range(30) if i not in (20, 21)]
    w.close()
    problems = []
    got = [f[:3] for _, f in st.read_store(d, problems)]
    assert got == [b"%03d" % i for i in accepted] and problems == []
    assert w.records == w.durable_records == len(accepted)


CHILD = textwrap.dedent("""
    import os, signal, sys
    from ccld import store as st
    from ccld import wire as ev
    d, n, m = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    def frame(i):
        return ev.encode_batch("agent-0", "node-0", i, [ev.ClockSample(mono_ns=i, wall_ns=10 + i, ts_ns=i)])
    w = st.StoreWriter(d, clock=lambda: 0.0)   # flushes only when told
    for i in range(n):
        w.append(frame(i), 1000.0 + i)
    w.flush()
    print(w.durable_records, flush=True)       # the acknowledgement
    for i in range(n, n + m):
        w.append(frame(i), 1000.0 + i)         # received, not flushed
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_sigkilled_writer_keeps_all_it_flushed_and_the_loss_is_reported(tmp_path):
    d = str(tmp_path / "s")
    n, m = 23, 5
    p = subprocess.run([sys.executable, "-c", CHILD, d, str(n), str(m)], capture_output=True, text=True,
                       timeout=30)
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert p.stdout.split() == [str(n)]  # acknowledged 23 records as durable
    problems = []
    got = list(st.read_store(d, problems))
    assert [f for _, f in got] == [frame(i) for i in range(n)]
    assert [t for t, _ in got] == [1000.0 + i for i in range(n)]
    # the 5 unflushed frames are gone; the reader says so: the writer never closed and holds no lock
    assert [x.kind for x in problems] == ["unclean-end"]
    assert "segment-000001.ccld: collector killed or crashed (opened " in problems[0]
    assert "store never closed); up to 0.5 s of unflushed frames lost" in problems[0]

    # a kill in the middle of a write() leaves half a record: a torn tail
    seg1 = os.path.join(d, "segment-000001.ccld")
    size1 = os.path.getsize(seg1)
    rec = open(seg1, "rb").read()[:HDR + len(frame(0))]
    with open(seg1, "ab") as f:
        f.write(rec[:HDR + 9])

    # the collector restarts on the same store: it continues in segment 2
    w = st.StoreWriter(d)
    for i in range(100, 111):
        w.append(frame(i), 2000.0 + i)
    w.close()
    assert sorted(x for x in os.listdir(d) if x.endswith(".ccld")) == ["segment-000001.ccld",
                                                                       "segment-000002.ccld"]
    meta = json.load(open(os.path.join(d, "store.json")))
    assert len(meta["unclean_ends"]) == 1 and meta["unclean_ends"][0]["last_segment"] == 1
    problems = []
    got = [f for _, f in st.read_store(d, problems)]
    assert got == [frame(i) for i in range(n)] + [frame(i) for i in range(100, 111)]
    assert [(x.kind, x.segment, x.offset, x.length) for x in problems] == [
        ("torn-tail", "segment-000001.ccld", size1, HDR + 9),
        ("unclean-end", "segment-000001.ccld", None, None)]
    assert f"truncated record at offset {size1} (9 of {len(frame(0))} frame bytes)" in problems[0]
    assert "recovered 23 records" in problems[0]


# ---- corruption sweep ---------------------------------------------------------------------------

def sweep_store(d):
    """One segment of 40 records of mixed sizes; two frames carry the record marker inside."""
    w = st.StoreWriter(d)
    frames = []
    for i in range(40):
        f = frame(i) + b"p" * (i * 7 % 50)
        if i in (9, 27):
            f = b"\x00" + RECORD_MAGIC + struct.pack(">Id", 3, 1.0) + b"\x00" * 24 + f
        frames.append(f)
        w.append(f, 500.0 + i)
    w.close()
    seg = os.path.join(d, "segment-000001.ccld")
    spans, off = [], 0
    for f in frames:
        spans.append((off, off + HDR + len(f)))
        off += HDR + len(f)
    return frames, spans, open(seg, "rb").read()


def test_corruption_sweep_never_raises_and_keeps_every_untouched_record(tmp_path):
    d = str(tmp_path / "s")
    frames, spans, raw = sweep_store(d)
    seg = os.path.join(d, "segment-000001.ccld")
    rng = random.Random(8)
    lost_reported = 0
    for trial in range(200):
        kind, bad, touched = corrupt(rng, raw, spans)
        with open(seg, "wb") as f:
            f.write(bad)
        problems = []
        got = list(st.read_store(d, problems))  # anything raised here fails the test
        want = [(500.0 + i, f) for i, f in enumerate(frames) if i not in touched]
        assert got == want, (trial, kind, sorted(touched))
        for p in problems:
            assert p.kind in ("damaged", "torn-tail") and p.segment == "segment-000001.ccld"
            assert 0 <= p.offset < len(bad) and 0 < p.length <= len(bad) - p.offset
        if kind != "truncate":
            # every touched record sits inside a reported region; nothing else does
            regions = [(p.offset, p.offset + p.length) for p in problems]
            covered = sum(e - s for s, e in regions)
            assert covered == len(bad) - sum(HDR + len(f) for _, f in got), (trial, kind)
            assert bool(problems) == (bad != raw), (trial, kind)
        elif touched and spans[min(touched)][0] < len(bad):
            # a cut inside a record: that torn tail is reported at its start
            assert [(p.kind, p.offset) for p in problems] == [("torn-tail", spans[min(touched)][0])]
        lost_reported += bool(touched) and bool(problems)
    assert lost_reported > 150  # (a cut exactly at a record boundary leaves nothing to report)
