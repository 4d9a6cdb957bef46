"""The shipper against a real in-process collector: frames wait in the spool until the store has
them, a collector restart on the same store gets the unacknowledged frames again and keeps each
once, and an outage longer than the spool's bound costs the oldest frames, counted. Real ZeroMQ on
127.0.0.1 (the events port and the time service on the next one)."""
import collections
import time

import pytest

from ccld import wire as ev
from ccld.collector.server import Collector
from ccld.store import read_store
from ccld.tracer import shipper as sh
from ccld.tracer.spool import Spool
from ccld.collector.timesvc import free_port_pair

pytestmark = pytest.mark.unit

AGENT = "node-t:4242:abc123"




def wait(cond, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def state(i, pad=0):
    return ev.RankState(pid=1, rank=0, ts_ns=i, state="S", wchan="w" * pad)


def collector(port, store):
    return Collector(listen=f"tcp://127.0.0.1:{port}", store_dir=str(store), stacks=False,
                     on_line=lambda line: None).start()


def stored_states(store):
    """ts_ns of every RankState in the store, and the frames of AGENT by batch number."""
    got, batches = [], collections.Counter()
    for _, frame in read_store(str(store), []):
        b = ev.decode_batch(frame)
        if b.agent == AGENT:
            batches[b.batch] += 1
        got += [e.ts_ns for e in b.events if e.KIND == "proc"]
    return got, batches


def acked_all(s, events, timeout_s=10.0):
    """Wait until `events` events were sent, everything put was framed, and every frame is acknowledged
    (framed first: on a loaded box the sender may not yet have framed the last events put)."""
    assert wait(lambda: s.sent_events >= events, timeout_s), s.stats()
    assert wait(lambda: s.queued == 0, timeout_s), s.stats()
    last = s.last_batch
    assert wait(lambda: s.spool.acked(AGENT) >= last, timeout_s), (last, s.stats())


def shipper(port, spool):
    return sh.Shipper(f"tcp://127.0.0.1:{port}", AGENT, "node-t", spool=spool,
                      acks=f"tcp://127.0.0.1:{port + 1}").start()


def test_frames_wait_in_the_spool_until_the_store_has_them(tmp_path):
    port = free_port_pair()
    c = collector(port, tmp_path / "store")
    s = shipper(port, Spool(str(tmp_path / "spool"), collector=f"tcp://127.0.0.1:{port}").open())
    try:
        for i in range(23):
            s.put(state(i))
        acked_all(s, 23)
        assert c.time_service.answered_acks > 0 and s.spool.held() <= 15  # ~1 s of heartbeat frames
    finally:
        s.close()
        c.stop()
    got, batches = stored_states(tmp_path / "store")
    assert sorted(got) == list(range(23)) and set(batches.values()) == {1}
    assert c.stats["frames_duplicate"] == 0 and s.stats()["spool_replayed_frames"] == 0


def test_a_restarted_collector_gets_what_it_lost_and_keeps_each_frame_once(tmp_path):
    port = free_port_pair()
    store = tmp_path / "store"
    c1 = collector(port, store)
    # Collector 1 acknowledges nothing (the agent keeps every frame) and, after 5 frames, loses what
    # it receives, as a killed collector loses what it had not flushed.
    c1.acks.answer = lambda req: [req[1], [[a, 0] for a, _ in req[2]]]
    kept, real = [0], c1._take  # what the ingest loop does with each frame before the timeline

    def lossy(frame, recv):
        if kept[0] < 5:
            kept[0] += 1
            return real(frame, recv)
        return None

    c1._take = lossy
    lines = []
    s = sh.Shipper(f"tcp://127.0.0.1:{port}", AGENT, "node-t", acks=f"tcp://127.0.0.1:{port + 1}",
                   say=lines.append).start()
    c2 = None
    try:
        for i in range(12):
            s.put(state(i))
            time.sleep(0.05)
        assert wait(lambda: s.sent_events >= 12 and kept[0] == 5), s.stats()
        assert s.spool.held() == s.last_batch  # nothing acknowledged
        sent_to_c1 = s.sent_frames
        c1.stop()
        for i in range(12, 23):  # while no collector runs
            s.put(state(i))
        time.sleep(0.3)
        c2 = collector(port, store)
        acked_all(s, 23, 15)
    finally:
        s.close()
        if c2 is not None:
            c2.stop()
    got, batches = stored_states(store)
    assert sorted(got) == list(range(23)), sorted(got)      # every event, once
    assert set(batches.values()) == {1} and sorted(batches) == list(range(1, max(batches) + 1))
    st = s.stats()
    assert st["collector_restarts"] == 1 and st["disconnects"] >= 1
    assert st["spool_replayed_frames"] >= sent_to_c1 >= 5  # all it sent there, none acknowledged
    assert c2.stats["frames_duplicate"] >= 5   # what collector 1 stored came again and was dropped
    assert c2.stats["ack_rebuilt_frames"] == 5
    assert st["queue_dropped"] == st["spool_dropped_frames"] == st["spool_unacked_evicted_frames"] == 0
    assert any("collector restarted" in x for x in lines), lines


def test_an_outage_beyond_the_bound_costs_the_oldest_frames_counted(tmp_path):
    port = free_port_pair()
    store = tmp_path / "store"
    c1 = collector(port, store)
    s = shipper(port, Spool(None, memory_bytes=64 * 1024).open())
    c2 = None
    try:
        s.put(state(0))
        acked_all(s, 1)
        c1.stop()
        t0 = time.monotonic()
        for i in range(1, 601):  # ~600 x 1 KB over ~1.5 s: ~10x the 64 KiB bound
            s.put(state(i, pad=1000))
            if i % 40 == 0:
                time.sleep(0.1)
        put_s = time.monotonic() - t0
        assert wait(lambda: s.spool.dropped_frames > 0 and s.spool.unsent() > 0)
        c2 = collector(port, store)
        time.sleep(sh.LOSS_EVERY_S)  # the loss counters ride in a later frame
        # the newest events reach the new collector, unless they were handed to the dead connection
        # before the sender knew (then the spool evicted them as sent-but-unacknowledged, counted apart:
        # lost only if the collector lost them too, which it did); then everything is acknowledged
        assert wait(lambda: 600 in stored_states(store)[0] or s.spool.unacked_evicted_frames > 0, 15), \
            stored_states(store)[0][-5:]
        acked_all(s, 0, 15)
    finally:
        s.close()
        if c2 is not None:
            c2.stop()
    assert put_s < 5  # never blocked (the sleeps are 1.5 s of it); not a speed check
    got, _ = stored_states(store)
    st = s.stats()
    assert len(got) == len(set(got)) and 0 in got  # no duplicate; the first arrived
    lost = 600 - (len(got) - 1)
    if st["spool_unacked_evicted_frames"] == 0:  # nothing was lost on the dead connection: the newest came,
        assert 600 in got                          # and every lost event is counted as dropped
        assert lost > 0 and st["spool_dropped_events"] >= lost
    else:
        assert lost > 0 and st["spool_dropped_events"] > 0
    with c2.lock:
        reported = c2.timeline.agent_loss[AGENT]
    assert reported["spool_dropped_frames"] == st["spool_dropped_frames"] > 0  # and the collector was told


def test_close_has_the_last_frames_acknowledged_before_its_deadline(tmp_path):
    """Idle, "ack?" goes once a second (with the heartbeat, no timer of its own); the frames sent at
    close() are still acknowledged within its 2 s (stopping, it is asked every FINISH_ACK_S), so a
    spool in memory counts none of them as lost."""
    port = free_port_pair()
    c = collector(port, tmp_path / "store")
    s = shipper(port, Spool(None, collector=f"tcp://127.0.0.1:{port}"))
    try:
        for i in range(5):
            s.put(state(i))
        acked_all(s, 5)
        time.sleep(0.3)  # an "ack?" just went: the next one would be ~1 s away
        for i in range(5, 12):
            s.put(state(i))
        s.kick()
        t0 = time.monotonic()
    finally:
        s.close()
        took = time.monotonic() - t0
        c.stop()
    assert s.spool.acked(AGENT) >= s.last_batch, s.stats()
    assert took < 2.0, took
    got, _ = stored_states(tmp_path / "store")
    assert sorted(got) == list(range(12))
