"""The collector's acknowledgement book (ccld/collector/acks.py): deduplication of resent frames, the
answers to "ack?", and what it learns from an existing store. No sockets."""
import msgpack
import pytest

from ccld import wire as ev
from ccld.collector import acks
from ccld.collector.acks import DUPLICATE, AckBook, Marks
from ccld.store import StoreWriter

pytestmark = pytest.mark.unit


def frame(agent, batch, resend=True, n=1):
    evs = [ev.RankState(pid=1, rank=0, ts_ns=i, state="S") for i in range(n)]
    return ev.encode_batch(agent, "n1", batch, evs, resend=resend)


def test_marks_are_a_watermark_and_a_set_above_it():
    m = Marks()
    for b in (1, 2, 4, 5):
        m.add(b)
    assert (m.upto, m.above) == (2, {4, 5}) and 4 in m and 3 not in m
    m.add(3)
    assert (m.upto, m.above) == (5, set())
    m.add(9)
    m.floor(8)   # the agent will never send 6 or 7, but may still send 8
    assert (m.upto, m.above) == (7, {9})
    m.floor(9)   # nor 8: the gap closes
    assert (m.upto, m.above) == (9, set())
    m.floor(3)   # a floor never lowers it
    assert m.upto == 9


def test_a_gap_that_never_closes_is_given_up_when_too_much_sits_above_it(monkeypatch):
    monkeypatch.setattr(acks, "MAX_ABOVE", 4)
    m = Marks()
    m.add(1)
    for b in range(3, 8):  # 2 never comes
        m.add(b)
    assert m.upto == 7 and m.gaps_skipped == 1 and m.above == set()


def test_peek_reads_only_marked_envelopes():
    assert ev.peek_resend(frame("host:12:ab12cd", 7)) == ("host:12:ab12cd", 7)
    assert ev.peek_resend(frame("a", 7, resend=False)) is None
    big = frame("a" * 255, 3, n=2000)  # the marker still found in the first bytes of a big frame
    assert len(big) > 10_000 and ev.peek_resend(big) == ("a" * 255, 3)
    late = msgpack.packb({"v": [1, 4], "agent": "a", "node": "n", "batch": 3, "events": [], "resend": True})
    assert ev.peek_resend(late) is None  # after "events": not ccld's layout, not deduplicated
    for junk in (b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"resend": True, "agent": 1, "batch": 2}),
                 frame("a", 7)[:20]):
        assert ev.peek_resend(junk) is None
    # the key spelled as str8 rather than fixstr (another encoder may): still found past the quick search
    str8 = frame("a", 5).replace(b"\xa6resend", b"\xd9\x06resend")
    assert str8 != frame("a", 5) and ev.peek_resend(str8) == ("a", 5)
    # "resend" inside the data of an unmarked frame: the quick search passes it to the full reading
    tricky = msgpack.packb({"v": [1, 4], "agent": "resend", "node": "n", "batch": 3, "events": []})
    assert ev.peek_resend(tricky) is None


def test_resent_frames_are_dropped_and_acks_wait_for_the_store():
    durable = [0]
    book = AckBook(durable=lambda: durable[0])
    for b in (1, 2, 3):
        t = book.admit(frame("a1", b))
        assert t is not None and t is not DUPLICATE
        book.stored(t, record_no=b)
    assert book.admit(frame("a1", 2)) is DUPLICATE and book.frames_duplicate == 1
    assert book.admit(frame("a1", 2, resend=False)) is None  # unmarked: never deduplicated
    assert book.answer(["ack", 5, [["a1", 1]]]) == [5, [["a1", 0]]]  # nothing on the OS yet
    durable[0] = 2
    assert book.answer(["ack", 6, [["a1", 1]]]) == [6, [["a1", 2]]]
    durable[0] = 3
    assert book.answer(["ack", 7, [["a1", 1], ["other", 1]]]) == [7, [["a1", 3], ["other", 0]]]


def test_a_floor_closes_the_gaps_of_frames_an_agent_dropped():
    book = AckBook()  # no store: acknowledged once ingested
    for b in (1, 2, 9, 10):
        book.stored(book.admit(frame("a1", b)), None)
    assert book.answer(["ack", 1, [["a1", 3]]]) == [1, [["a1", 2]]]
    assert book.answer(["ack", 2, [["a1", 9]]]) == [2, [["a1", 10]]]  # 3..8 were dropped by the agent
    # ... or sent, then evicted unacknowledged while still on their way: never stored, so kept if they come
    t = book.admit(frame("a1", 5))
    assert t not in (None, DUPLICATE) and book.frames_duplicate == 0
    book.stored(t, None)
    assert book.admit(frame("a1", 5)) is DUPLICATE
    assert book.answer(["ack", 3, [["a1", 11]]]) == [3, [["a1", 10]]]


def test_frames_evicted_on_their_way_are_stored_when_they_arrive_after_the_floor():
    """A full spool evicts frames it sent and the collector has not acknowledged: the collector's ingest
    thread is behind, and they are still queued for it. The agent's next "ack?" (answered at once by the
    time service thread) carries a floor above them; they must still be stored when the ingest thread
    gets to them, not dropped as duplicates of frames the store never had."""
    from ccld.tracer.spool import Spool
    frames = {b: ev.encode_batch("a1", "n1", b, [ev.ClockSample(mono_ns=b, wall_ns=b, ts_ns=b)] * 40, resend=True)
              for b in range(1, 40)}
    spool = Spool(None, memory_bytes=16 * len(frames[1]), say=lambda line: None).open()
    spool.retain = True
    book = AckBook()
    on_the_way = []
    for b in range(1, 40):
        spool.append("a1", b, 40, frames[b])
        while (got := spool.peek()) is not None:
            spool.sent()
            on_the_way.append(got[0])
        if b == 3:  # the ingest thread stores 1..3, then falls behind
            for f in on_the_way:
                book.stored(book.admit(f), None)
            on_the_way.clear()
    assert spool.unacked_evicted_frames > 10
    floor = spool.floors()["a1"]
    assert book.answer(["ack", 1, [["a1", floor]]]) == [1, [["a1", floor - 1]]]
    admitted = [book.admit(f) for f in on_the_way]
    assert DUPLICATE not in admitted and book.frames_duplicate == 0


@pytest.mark.parametrize("req", [
    ["ack"], ["ack", "1", []], ["ack", 1, {}], ["ack", 1, [["a", -1]]], ["ack", 1, [["a"]]], ["ack", 1, [[1, 2]]],
    ["ack", 1, [["a", 1]] * 17], ["ack", 1, [["x" * 300, 1]]], ["ack", 1, [["a", True]]], ["ack", 1, [["a", 2**62]]],
])
def test_malformed_requests_are_counted(req):
    book = AckBook()
    assert book.answer(req) is None and book.bad_requests == 1


def test_a_restarted_collector_learns_what_its_store_holds(tmp_path):
    store = tmp_path / "store"
    w = StoreWriter(str(store))
    for b in (1, 2, 3, 5):
        w.append(frame("a1", b), 1.0)
    w.append(frame("a2", 1, resend=False), 1.0)
    w.close()
    w = StoreWriter(str(store))  # the next collector on this store
    book = AckBook()
    book.use_store(w, str(store))
    assert book.rebuilt_frames == 4
    assert book.admit(frame("a1", 2)) is DUPLICATE and book.admit(frame("a1", 5)) is DUPLICATE
    t = book.admit(frame("a1", 4))
    assert t not in (None, DUPLICATE)
    w.append(frame("a1", 4), 2.0)
    book.stored(t, w.records)
    assert book.answer(["ack", 1, [["a1", 4]]]) == [1, [["a1", 3]]]  # 4 is not on the OS yet
    w.flush()
    assert book.answer(["ack", 2, [["a1", 4]]]) == [2, [["a1", 5]]]
    w.close()
    assert book.counters()["ack_rebuilt_frames"] == 4


def test_asking_about_agents_that_sent_nothing_makes_no_entry(monkeypatch):
    """Anyone who reaches the time service may ask "ack?" about made-up agent ids: that must not push the
    agents that sent frames out of the book (MAX_AGENTS), or their replays would be stored twice."""
    monkeypatch.setattr(acks, "MAX_AGENTS", 4)
    book = AckBook()
    book.stored(book.admit(frame("real", 7)), None)
    for k in range(10):
        assert book.answer(["ack", k, [[f"made-up-{k}", 5], ["never-sent", 1]]]) == [k, [[f"made-up-{k}", 4],
                                                                                       ["never-sent", 0]]]
    assert book.counters()["ack_agents"] == 1 and book.agents_forgotten == 0
    assert book.admit(frame("real", 7)) is DUPLICATE
