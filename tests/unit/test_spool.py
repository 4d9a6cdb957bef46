"""The agent's spool (ccld/tracer/spool.py, spool_segment.py, spool_dir.py, spool_records.py): order,
bounds, acknowledged release, replay, reading back a spool left by an earlier run, damaged or not, and
the files it holds open. Real files in tmp_path; no sockets."""
import errno
import os
import resource

import pytest

from ccld import wire as ev
from ccld.tracer import spool as sp
from ccld.tracer.spool_segment import TAIL_CACHE_FRAMES

pytestmark = pytest.mark.unit

COLLECTOR = "tcp://127.0.0.1:5555"


def frame(i, agent="a1", pad=0):
    """A real frame of batch i: a rank state (and padding in its wchan, to size it)."""
    evs = [ev.RankState(pid=1, rank=0, ts_ns=i, state="S", wchan="x" * pad), ev.ClockSample(mono_ns=i, wall_ns=i)]
    return ev.encode_batch(agent, "n1", i, evs, resend=True)


def open_spool(d, lines=None, **kw):
    kw.setdefault("collector", COLLECTOR)
    return sp.Spool(str(d) if d is not None else None, say=(lines.append if lines is not None else None), **kw).open()


def fill(s, batches, agent="a1", pad=0):
    for i in batches:
        s.append(agent, i, 2, frame(i, agent, pad))


def drain(s):
    """Every frame from the cursor on, marked sent; their batch numbers."""
    out = []
    while True:
        got = s.peek()
        if got is None:
            return out
        out.append(ev.decode_batch(got[0]).batch)
        s.sent()


def segments(d):
    return sorted(n for n in os.listdir(d) if n.endswith(".spool"))


def open_fds():
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("where", ["disk", "memory"])
def test_frames_come_out_in_order_and_are_let_go_when_acknowledged(tmp_path, where):
    s = open_spool(tmp_path / "spool" if where == "disk" else None)
    assert s.on_disk == (where == "disk")
    s.retain = True
    fill(s, range(1, 24))
    assert drain(s) == list(range(1, 24))
    assert (s.held(), s.unacked(), s.unsent()) == (23, 23, 0)
    s.ack("a1", 10)
    assert (s.held(), s.unacked()) == (13, 13)
    assert s.floors() == {"a1": 11}
    assert s.rewind() == 13 and drain(s) == list(range(11, 24))  # a replay: the unacknowledged, in order
    assert s.replayed_frames == 13 and s.replays == 1
    s.ack("a1", 23)
    assert s.held() == 0 and s.floors() == {}
    s.close()
    if where == "disk":
        assert segments(tmp_path / "spool") == []  # everything acknowledged: nothing left on disk


def test_without_acks_a_frame_is_let_go_once_sent(tmp_path):
    s = open_spool(tmp_path / "spool")
    fill(s, range(1, 6))
    assert drain(s) == [1, 2, 3, 4, 5] and s.held() == 0 and s.rewind() == 0
    s.close()


@pytest.mark.parametrize("where", ["disk", "memory"])
def test_overflow_drops_the_oldest_whole_frames_and_counts_them(tmp_path, where):
    bound = 64 * 1024
    kw = {"max_bytes": bound} if where == "disk" else {"memory_bytes": bound}
    s = open_spool(tmp_path / "spool" if where == "disk" else None, **kw)
    s.retain = True
    fill(s, range(1, 11), pad=1000)
    assert drain(s) == list(range(1, 11))  # 10 sent, none acknowledged
    assert s.rewind() == 10                # the connection dropped: they are to be sent again
    fill(s, range(11, 201), pad=1000)      # ~1.1 KB each: 200 frames are ~3.5x the bound
    assert s.disk_bytes + s.mem_bytes <= bound
    kept = drain(s)
    assert kept == list(range(kept[0], 201)) and kept[0] > 11  # the newest, in order, no hole
    assert s.unacked_evicted_frames == 10                       # sent once, never acknowledged
    assert s.dropped_frames == kept[0] - 11                     # never sent: lost, counted
    assert s.dropped_events == 2 * s.dropped_frames
    assert s.loss()["spool_dropped_frames"] == s.dropped_frames
    if where == "disk":
        on_disk = sum(os.path.getsize(tmp_path / "spool" / n) for n in segments(tmp_path / "spool"))
        assert on_disk == s.disk_bytes <= bound
    s.close()


def test_a_frame_bigger_than_the_spool_is_dropped_and_counted(tmp_path):
    s = open_spool(None, memory_bytes=4096)
    s.append("a1", 1, 2, frame(1, pad=10_000))
    fill(s, [2])
    assert (s.dropped_frames, drain(s)) == (1, [2])


def kill(s):
    """What SIGKILL leaves: the files as written, no spool.json update; the kernel drops the lock."""
    for seg in s._segs:
        if seg.fd is not None:
            os.close(seg.fd)
    s._release_lock()


@pytest.mark.parametrize("how", ["stopped", "killed"])
def test_a_restart_reads_the_spool_back_in_order_and_replays_it(tmp_path, how):
    d = tmp_path / "spool"
    base = open_fds()
    s = open_spool(d, max_bytes=16 * 4096)  # small segments: the frames span several files
    s.retain = True
    fill(s, range(1, 41), pad=300)
    assert open_fds() - base <= 2  # the lock and the segment being written, not the ones before it
    assert drain(s)[:5] == [1, 2, 3, 4, 5]
    s.ack("a1", 5)       # 35 frames not acknowledged when the agent ends
    s.close() if how == "stopped" else kill(s)
    assert len(segments(d)) > 1
    lines = []
    s2 = open_spool(d, lines, max_bytes=16 * 4096)
    # A stopped agent wrote down what was acknowledged; after a kill, the acknowledged frames of a
    # segment not yet wholly released come back too (the first ack lets them go; the collector would
    # drop them as duplicates anyway).
    first = 6 if how == "stopped" else 1
    assert s2.restored_frames == 41 - first, lines
    assert any(f"{41 - first} frames from an earlier run" in x for x in lines), lines
    assert s2.floors() == {"a1": first}
    s2.ack("a1", 5)
    assert s2.floors() == {"a1": 6} and s2.held() == 35
    s2.retain = True
    fill(s2, [1, 2], agent="a2")  # this run's agent id numbers from 1 again
    assert s2.floors() == {"a1": 6, "a2": 1}
    got = []
    while (f := s2.peek()) is not None:
        b = ev.decode_batch(f[0])
        got.append((b.agent, b.batch))
        s2.sent()
    assert got == [("a1", i) for i in range(6, 41)] + [("a2", 1), ("a2", 2)]
    assert s2.replayed_frames == 35  # from the earlier run: possibly sent before
    s2.ack("a1", 40)
    s2.ack("a2", 2)
    assert s2.held() == 0
    s2.close()
    assert segments(d) == []


def test_a_torn_tail_is_reported_with_its_offset_and_the_records_before_it_kept(tmp_path):
    d = tmp_path / "spool"
    s = open_spool(d)
    fill(s, range(1, 8))
    s.close()
    (seg,) = segments(d)
    path = d / seg
    size = path.stat().st_size
    rec = size // 7
    with open(path, "r+b") as f:
        f.truncate(size - rec // 2)  # the agent died in the middle of writing record 7
    lines = []
    s2 = open_spool(d, lines)
    assert drain(s2) == [1, 2, 3, 4, 5, 6]
    torn = [x for x in lines if "torn tail" in x]
    assert len(torn) == 1 and f"{seg}: torn tail at offset {6 * rec}" in torn[0], lines
    assert s2.damaged_regions == 1 and s2.damaged_bytes == size - rec // 2 - 6 * rec
    s2.close()


def test_a_corrupt_record_in_the_middle_is_skipped_and_the_rest_kept(tmp_path):
    d = tmp_path / "spool"
    s = open_spool(d)
    fill(s, range(1, 11))
    s.close()
    (seg,) = segments(d)
    path = d / seg
    rec = path.stat().st_size // 10
    data = bytearray(path.read_bytes())
    data[4 * rec + rec // 2] ^= 0xFF  # a flipped bit inside record 5's frame
    path.write_bytes(bytes(data))
    lines = []
    s2 = open_spool(d, lines)
    assert drain(s2) == [1, 2, 3, 4, 6, 7, 8, 9, 10]
    bad = [x for x in lines if "damaged record" in x]
    assert len(bad) == 1 and f"at offset {4 * rec} (checksum mismatch); skipped {rec} bytes, resumed at offset " \
        f"{5 * rec}" in bad[0], lines
    s2.close()


def test_frames_spooled_for_another_collector_are_discarded_and_counted(tmp_path):
    d = tmp_path / "spool"
    s = open_spool(d)
    fill(s, range(1, 4))
    s.close()
    lines = []
    s2 = open_spool(d, lines, collector="tcp://10.0.0.9:5555")
    assert s2.held() == 0 and s2.discarded_frames == 3 and s2.loss()["spool_discarded_frames"] == 3
    assert any("held 3 frames for collector tcp://127.0.0.1:5555" in x for x in lines), lines
    s2.close()


def test_one_agent_per_spool_directory(tmp_path):
    d = tmp_path / "spool"
    s = open_spool(d)
    lines = []
    s2 = open_spool(d, lines)
    assert s.on_disk and not s2.on_disk
    assert len(lines) == 1 and "in use by another agent" in lines[0] and f"pid {os.getpid()}" in lines[0]
    s2.close()
    s.close()
    assert open_spool(d).on_disk  # the lock goes with its holder


def test_an_unusable_directory_falls_back_to_memory_said_once(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    lines = []
    s = open_spool(tmp_path / "file" / "spool", lines)
    assert not s.on_disk and len(lines) == 1 and "keeping unacknowledged frames in memory" in lines[0]
    fill(s, [1, 2])
    assert drain(s) == [1, 2]
    assert "spool in memory" in s.describe()


def test_a_full_disk_falls_back_to_memory_and_keeps_every_frame(tmp_path, monkeypatch):
    s = open_spool(tmp_path / "spool")
    s.retain = True
    fill(s, [1, 2, 3])
    real_write = os.write

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sp.os, "write", full)
    lines = []
    s.say = lines.append
    fill(s, [4, 5, 6])
    monkeypatch.setattr(sp.os, "write", real_write)
    fill(s, [7])
    assert not s.on_disk and s.disk_errors == 1 and len(lines) == 1 and "No space left" in lines[0]
    assert drain(s) == [1, 2, 3, 4, 5, 6, 7]  # the first three from disk, the rest from memory
    s.ack("a1", 7)
    assert s.held() == 0
    s.close()


def test_a_symlink_is_not_used_and_a_loose_directory_is_made_owner_only(tmp_path):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    lines = []
    assert not open_spool(tmp_path / "link", lines).on_disk and "symlink" in lines[0]
    loose = tmp_path / "loose"
    loose.mkdir()
    os.chmod(loose, 0o777)
    open_spool(loose).close()
    assert (os.stat(loose).st_mode & 0o777) == 0o700


def test_a_directory_another_user_owns_is_not_used(tmp_path, monkeypatch):
    other = tmp_path / "other"
    other.mkdir()
    me = os.geteuid()
    monkeypatch.setattr(sp.os, "geteuid", lambda: me + 4242)  # as if this agent ran as another user
    lines = []
    assert not open_spool(other, lines).on_disk and f"owned by uid {me}, not this user" in lines[0]


def test_memory_full_after_a_disk_error_drops_the_new_frame_not_the_disk_backlog(tmp_path):
    s = open_spool(tmp_path / "spool", memory_bytes=4 * len(frame(1, pad=1000)))
    s.retain = True
    fill(s, range(1, 41), pad=1000)  # the collector is away: all of it waits on disk
    s._to_memory("simulated disk error")
    fill(s, range(41, 46), pad=1000)  # memory holds four of these: the fifth finds it full
    # evicting the disk segments would free no memory: the frame that does not fit is the one lost
    assert (s.dropped_frames, s.dropped_events) == (1, 2)
    assert drain(s) == list(range(1, 45))
    s.close()


def test_a_frame_that_cannot_be_read_back_is_counted_once_and_let_go(tmp_path):
    s = open_spool(tmp_path / "spool")
    s.retain = True
    n = TAIL_CACHE_FRAMES + 5  # the oldest five are read back from the file, not from the tail cache
    fill(s, range(1, n + 1))
    seg = s._segs[0]
    os.truncate(seg.path, seg.offsets[2])  # frames 3 on cut off under the agent
    assert drain(s)[:2] == [1, 2] and s.dropped_frames == 3
    s.ack("a1", 2)
    assert s.floors() == {"a1": 6} and s.held() == n - 5  # never sent, never acknowledged: let go anyway
    s.rewind()
    drain(s)  # a replay reads the rest from the file, and cannot either
    s.rewind()
    drain(s)
    assert s.dropped_frames == n - 2  # each lost frame counted once, however often the cursor passes it
    s.ack("a1", 2)
    assert s.held() == 0
    s.close()


def test_a_long_non_ascii_agent_id_reads_back_whole(tmp_path):
    agent = "ü" * 130 + ":1234:abcdef"  # 142 characters (the collector acknowledges up to 256), 272 bytes
    s = open_spool(tmp_path / "spool")
    fill(s, [1, 2, 3], agent=agent)
    s.close()
    s2 = open_spool(tmp_path / "spool")
    assert s2.damaged_bytes == 0 and s2.restored_frames == 3 and s2.floors() == {agent: 1}
    s2.retain = True
    drain(s2)
    s2.ack(agent, 3)
    assert s2.held() == 0
    s2.close()


def test_a_crash_loop_holds_no_file_open_per_old_segment(tmp_path):
    """Every start writes a new segment, so an agent killed and restarted 250 times finds 250 of them.
    Only the lock, the segment being written and the one being read may hold a file descriptor open:
    with one per old segment, a 256-fd limit ran out and the spool fell back to memory. Run in a child
    process of its own: it counts the process's descriptors and lowers its limit, which threads other
    tests left in this one (their collectors, agents) would change or suffer from."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), root, os.environ.get("PYTHONPATH", "")]))
    env.pop("PYTHONOPTIMIZE", None)  # its checks are asserts
    p = subprocess.run([sys.executable, "-c", "import sys, test_spool; test_spool._crash_loop(sys.argv[1])",
                        str(tmp_path / "spool")], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert p.stdout.strip() == "ok", p.stdout


def _crash_loop(d: str) -> None:
    restarts = 250
    base = open_fds()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(base + 64, hard), hard))  # far fewer than 250 spare
    for i in range(1, restarts + 1):
        lines = []
        s = open_spool(d, lines)
        assert s.on_disk and s.restored_frames == i - 1, (i, lines)
        fill(s, [i])
        assert open_fds() - base <= 2, (i, os.listdir("/proc/self/fd"))  # the lock, the segment being written
        kill(s)
    assert len(segments(d)) == restarts
    s = open_spool(d)
    s.retain = True
    got, most = [], 0
    while (f := s.peek()) is not None:  # a replay reads back every old segment, one at a time
        got.append(ev.decode_batch(f[0]).batch)
        s.sent()
        most = max(most, open_fds() - base)
    want = list(range(1, restarts + 1))
    assert got == want, (f"missing {sorted(set(want) - set(got))[:20]}, extra {sorted(set(got) - set(want))[:20]}, "
                         f"{len(got)} read; open errors {s.open_errors}, disk errors {s.disk_errors}, "
                         f"dropped {s.dropped_frames}")
    assert most <= 2, most  # the lock, the segment being read
    fill(s, [restarts + 1])
    assert open_fds() - base <= 3  # ... and the one being written
    s.ack("a1", restarts + 1)
    assert s.held() == 0
    s.close()
    assert open_fds() == base and segments(d) == []
    print("ok")


def test_no_descriptor_to_spare_for_a_replay_loses_nothing_and_a_removed_file_is_counted_once(tmp_path):
    """Old segments are opened only to read a frame back. With no fd to spare at that moment (EMFILE),
    nothing is lost: the replay waits and goes on once one is free (it used to mark every frame of
    every closed segment lost, one failed open each). A segment removed under the agent loses its own
    frames, counted once, and the replay goes on with the next."""
    d = tmp_path / "spool"
    for i in range(1, 6):  # five starts: five segments of three frames
        s = open_spool(d)
        fill(s, [3 * i - 2, 3 * i - 1, 3 * i])
        kill(s)
    s = open_spool(d)
    s.retain = True
    real_open = os.open
    sp.os.open = lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EMFILE, "Too many open files"))
    try:
        assert s.peek() is None and s.peek() is None
    finally:
        sp.os.open = real_open
    assert (s.dropped_frames, s.disk_errors, s.open_errors) == (0, 0, 2)
    os.unlink(s._segs[1].path)  # frames 4-6 gone under the agent
    got = drain(s)
    assert got == [1, 2, 3] + list(range(7, 16)) and s.dropped_frames == 3
    s.rewind()
    assert drain(s) == [1, 2, 3] + list(range(7, 16)) and s.dropped_frames == 3  # counted once
    s.close()
