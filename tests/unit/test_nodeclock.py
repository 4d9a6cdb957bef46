"""The test clock transform (CCLD_TEST_CLOCK): parsed strictly, applied to every monotonic field of
every event kind, once, by the shipper; ClockSync (already in that clock) is left alone."""
import dataclasses
import socket
import time

import pytest
import zmq

from ccld import wire as ev
from ccld.errors import CcldError
from ccld.tracer import shipper as sh
from ccld.tracer.nodeclock import ENV, MONO_FIELDS, NOT_MONO_FIELDS, NodeClock

pytestmark = pytest.mark.unit

from test_events_schema import ONE_OF_EACH  # noqa: E402  (tests/unit is on sys.path under pytest)


def test_parse():
    c = NodeClock.from_env({ENV: "-2.5,30"})
    assert (c.offset_ns, c.drift_ppb) == (-2_500_000_000, 30_000) and not c.identity
    assert NodeClock.from_env({}).identity and NodeClock.from_env({ENV: " "}).identity
    for bad in ("2.5", "a,b", "1,2,3", "1e9,0", "0,5000"):
        with pytest.raises(CcldError, match=ENV):
            NodeClock.from_env({ENV: bad})


def test_apply_invert_and_now():
    c = NodeClock(3_000_000_000, -40_000)
    t = 86_400_000_000_000  # a day of uptime
    assert c.apply(t) == t + 3_000_000_000 - 3_456_000_000  # 40 ppm of a day is 3.456 s
    assert c.invert(c.apply(t)) == pytest.approx(t, abs=2)
    before = c.apply(time.monotonic_ns())
    assert before <= c.now_ns() <= c.apply(time.monotonic_ns())
    assert c.apply(0) == 0  # "no time" stays "no time"


def test_every_ns_field_of_the_schema_is_classified():
    """A new *_ns field must be declared a monotonic time (transformed) or not: none escapes."""
    for kind, cls in ev.EVENT_TYPES.items():
        for f in dataclasses.fields(cls):
            if f.name.endswith("_ns"):
                assert f.name in MONO_FIELDS or f.name in NOT_MONO_FIELDS, (kind, f.name)


def test_every_kind_has_its_monotonic_fields_shifted():
    c = NodeClock(-7_000_000_000, 25_000)
    for e in ONE_OF_EACH:
        got = c.event(e)
        if isinstance(e, ev.ClockSync):
            assert got is e  # stamped with now_ns(): already in this clock
            continue
        for name in MONO_FIELDS:
            if hasattr(e, name):
                v = getattr(e, name)
                assert getattr(got, name) == (c.apply(v) if v else 0), (e.KIND, name)
        for f in dataclasses.fields(e):
            if f.name not in MONO_FIELDS and f.name != "wall_ns":
                assert getattr(got, f.name) == getattr(e, f.name), (e.KIND, f.name)
    s = ev.ClockSample(mono_ns=10_000_000_000, wall_ns=1_764_400_000_000_000_000, ts_ns=10_000_000_000)
    g = c.event(s)
    # the node's wall clock is off as much as its monotonic one: the wall pair cannot repair it
    assert g.wall_ns - s.wall_ns == g.mono_ns - s.mono_ns == c.shift(s.mono_ns)
    assert NodeClock().event(s) is s


def _free_port():
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        return so.getsockname()[1]


def test_the_shipper_applies_it_to_everything_it_sends():
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.bind(endpoint)
    c = NodeClock(5_000_000_000, -20_000)

    class Sync:  # a settled time sync with one estimate
        settled = type("E", (), {"is_set": staticmethod(lambda: True), "wait": staticmethod(lambda t: True)})()
        est = ev.ClockSync(ts_ns=123, ref_ns=100, offset_ns=9, drift_ppb=1, uncertainty_ns=2)

        def latest(self):
            return self.est

    s = sh.Shipper(endpoint, "a", "n", clock=c, sync=Sync()).start()
    try:
        mono = time.monotonic_ns()
        s.put(ev.WorkEnd(pid=1, rank=0, ts_ns=mono, comm="c", seq=1))
        got = []
        deadline = time.time() + 5
        while time.time() < deadline and not any(e.KIND == "end" for e in got):
            if pull.poll(100):
                got = ev.decode_batch(pull.recv()).events
        kinds = [e.KIND for e in got]
        assert kinds[0] == "clock_sync" and kinds[-1] == "clock"  # the estimate first, the wall pair last
        assert got[0] == Sync.est
        end = next(e for e in got if e.KIND == "end")
        assert end.ts_ns == c.apply(mono)
        clk = got[-1]
        assert clk.ts_ns == clk.mono_ns and abs(c.invert(clk.mono_ns) - time.monotonic_ns()) < 5e9
        # converted with this wall pair, the end lands 5 s (and the drift) away from when it happened
        wall_unix = end.ts_ns + clk.wall_ns - clk.mono_ns
        true_unix = mono + time.time_ns() - time.monotonic_ns()
        assert (wall_unix - true_unix) == pytest.approx(c.shift(mono), abs=1e6)
    finally:
        s.close(timeout_s=0.5)
        pull.close()
        ctx.term()


def test_frames_wait_until_clock_sync_settles():
    """A job's first events must not be converted with the wall pair the next second replaces."""
    import threading
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.bind(endpoint)

    class Sync:
        settled = threading.Event()

        def latest(self):
            return None

    s = sh.Shipper(endpoint, "a", "n", sync=Sync()).start()
    try:
        s.put(ev.RankState(pid=1, rank=0, ts_ns=5, state="S"))
        assert not pull.poll(700)  # held
        Sync.settled.set()
        assert pull.poll(5000)
        got = ev.decode_batch(pull.recv()).events
        assert [e.KIND for e in got][0] == "proc" and got[-1].KIND == "clock"
    finally:
        s.close(timeout_s=0.5)
        pull.close()
        ctx.term()
