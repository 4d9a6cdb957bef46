"""The live collector over real ZeroMQ sockets on 127.0.0.1 (random port)."""
import json
import threading
import time

import pytest
import zmq

from ccld.collector.server import Collector, CollectorError
from ccld.store import read_stats, read_store
from ccld.diagnose.replay import replay

from ccld_synth import SynthJob

pytestmark = pytest.mark.unit


def term(ctx, timeout_s=5.0):
    """Terminate a context without risking a hung test: term() blocks while messages linger."""
    t = threading.Thread(target=ctx.term, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), "zmq context did not terminate"


def wait_for(cond, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


@pytest.fixture
def push():
    ctx = zmq.Context()
    socks = []

    def connect(endpoint):
        s = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint)
        socks.append(s)
        return s

    yield connect
    for s in socks:
        s.close(linger=0)
    term(ctx)


def test_live_collector_finds_a_hang_and_survives_garbage(tmp_path, push):
    lines = []
    store, findings_path = tmp_path / "store", tmp_path / "findings.jsonl"
    col = Collector(listen="tcp://127.0.0.1:*", store_dir=str(store), findings_path=str(findings_path),
                    on_line=lines.append, floor_s=1.0)
    col.start()
    try:
        assert col.endpoint.startswith("tcp://127.0.0.1:") and not col.endpoint.endswith(":*")
        sock = push(col.endpoint)
        sock.send(b"\xc1garbage")                      # rejected, counted; the collector keeps going
        now = time.time()
        job = SynthJob(t0=now - 10)
        job.announce(now - 5)
        t = job.steps(1, 10, now - 2, period=0.05)
        for r in (0, 1, 3):
            job.enter(r, 11, t + 0.05)
        for f in job.frames(time.time()):
            sock.send(f)
        sent_at = time.monotonic()
        assert wait_for(lambda: col.stats["frames_ok"] == 2 and col.stats["frames_rejected"])
        assert wait_for(lambda: len(lines) == 1), lines   # floor 1 s, ticks every 0.5 s
        assert lines[0].startswith("HANG not-entered ranks [2]") and "seq 11" in lines[0]
        assert [(f.cls, f.ranks, f.seq) for f in col.findings] == [("not-entered", [2], 11)]
        # rank 2 arrives: the collective completes, the finding recovers. Not before the replay below
        # ticks once between the two sends (it ticks every 0.5 s of recorded time, from the first frame):
        # the live tick may have come within milliseconds of the first frames.
        time.sleep(max(0.0, sent_at + 0.7 - time.monotonic()))
        job.enter(2, 11, time.time())
        for r in range(4):
            job.end(r, 11, time.time())
        for f in job.frames(time.time()):
            sock.send(f)
        assert wait_for(lambda: len(lines) == 2), lines
        assert lines[1].startswith("RECOVERED not-entered ranks [2]")
        stats = col.stats
        assert stats["frames_rejected"] == {"not-msgpack": 1} and stats["frames_ok"] == 4
        assert stats["events_by_kind"]["coll"] == 44 and stats["internal_errors"] == 0
    finally:
        col.stop()
    col.stop()  # idempotent
    recs = [json.loads(x) for x in findings_path.read_text().splitlines()]
    assert [r["kind"] for r in recs] == ["hang", "recovered"] and recs[0]["id"] == recs[1]["id"]
    assert recs[0]["class"] == "not-entered" and recs[0]["ranks"] == [2] and recs[0]["seq"] == 11
    assert len(list(read_store(str(store)))) == 4           # good frames only, raw
    s = read_stats(str(store))
    assert s["frames_ok"] == 4 and s["frames_rejected"] == {"not-msgpack": 1}
    # offline replay of what was stored finds the same hang (same id) and its recovery
    _, found, recovered, report = replay(str(store), floor_s=1.0)
    assert [f.id for f in found] == [recs[0]["id"]] and [r["id"] for r in recovered] == [recs[0]["id"]]
    assert report["recorded_stats"]["frames_rejected"] == {"not-msgpack": 1}


def test_a_quiesced_collector_reports_nothing_new(push):
    """`ccld run` interrupted quiesces its collector before stopping the job: ranks its SIGTERM catches
    between two collectives must not become a hang, however long the shutdown takes."""
    lines = []
    col = Collector(listen="tcp://127.0.0.1:*", on_line=lines.append, floor_s=1.0)
    col.start()
    try:
        sock = push(col.endpoint)
        now = time.time()
        job = SynthJob(t0=now - 10)
        job.announce(now - 5)
        t = job.steps(1, 10, now - 2, period=0.05)
        col.quiesce()
        for r in (0, 1, 3):
            job.enter(r, 11, t + 0.05)
        for f in job.frames(time.time()):
            sock.send(f)
        assert wait_for(lambda: col.stats["frames_ok"] == 2)
        time.sleep(2.0)  # 4 ticks past the 1 s floor
        col.tick(time.time())
        assert lines == [] and col.findings == []
    finally:
        col.stop()
    assert col.findings == []  # nor at the final tick


def test_address_in_use_is_a_clear_error():
    a = Collector(listen="tcp://127.0.0.1:*", on_line=lambda s: None).start()
    try:
        b = Collector(listen=a.endpoint, on_line=lambda s: None)
        with pytest.raises(CollectorError, match="cannot listen on"):
            b.start()
    finally:
        a.stop()


def test_bad_on_line_and_no_store_do_not_stop_it(push, caplog):
    def boom(line):
        raise RuntimeError("callback bug")

    col = Collector(listen="tcp://127.0.0.1:*", on_line=boom, floor_s=0.5).start()
    try:
        job = SynthJob(t0=time.time() - 10)
        job.announce(time.time() - 2)
        job.enter(0, 1, time.time() - 1)
        sock = push(col.endpoint)
        for f in job.frames(time.time()):
            sock.send(f)
        # on_line raises before the finding is kept (the file and the callback come first): wait for both
        assert wait_for(lambda: col.stats["internal_errors"] >= 1 and col.findings)
        assert col.findings[0].ranks == [1, 2, 3]
        for _ in range(3):
            sock.send(b"")
        assert wait_for(lambda: col.stats["frames_rejected"] == {"empty": 3})
        rejects = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]
        assert rejects == ["rejected a 0-byte frame (empty): empty frame"]  # one line per reason, not a flood
    finally:
        col.stop()


def test_a_running_collector_collects_young_garbage_less_often_and_puts_the_setting_back():
    """Python's default young-generation threshold (700) cost ~25 % of ingest; the collector raises it
    while it runs and restores it when the last collector of the process stops, unless something else
    changed it meanwhile; a process with automatic collection off keeps it off."""
    import gc
    from ccld.timeline.ingest import GC_YOUNG
    was = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        a = Collector(listen="tcp://127.0.0.1:*").start()
        assert gc.get_threshold() == (GC_YOUNG, 10, 10)
        b = Collector(listen="tcp://127.0.0.1:*").start()
        a.stop()
        assert gc.get_threshold() == (GC_YOUNG, 10, 10)  # b still runs
        b.stop()
        assert gc.get_threshold() == (700, 10, 10)
        c = Collector(listen="tcp://127.0.0.1:*").start()
        gc.set_threshold(1234, 10, 10)  # somebody else's choice while it ran: left alone
        c.stop()
        assert gc.get_threshold() == (1234, 10, 10)
        gc.set_threshold(0)
        c = Collector(listen="tcp://127.0.0.1:*").start()
        assert gc.get_threshold()[0] == 0
        c.stop()
        assert gc.get_threshold()[0] == 0
    finally:
        gc.set_threshold(*was)
