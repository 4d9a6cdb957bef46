"""Clock sync over real ZeroMQ on 127.0.0.1: the collector's time service and the agent's TimeSync,
with a shifted, drifting test clock; fallback when nobody answers; a restarted service."""
import socket
import time

import msgpack
import pytest
import zmq

from ccld.collector import timesvc
from ccld.collector.server import Collector
from ccld.collector.timesvc import TimeService
from ccld.tracer import timesync
from ccld.tracer.nodeclock import NodeClock
from ccld.tracer.timesync import TimeSync
from ccld.wire.protocol import default_time_endpoint

pytestmark = pytest.mark.unit


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_default_endpoint_is_the_next_port():
    assert default_time_endpoint("tcp://10.0.0.5:5555") == "tcp://10.0.0.5:5556"
    assert default_time_endpoint("tcp://[::1]:7000") == "tcp://[::1]:7001"
    assert default_time_endpoint("tcp://127.0.0.1:*") is None
    assert default_time_endpoint("ipc:///tmp/x") is None


def test_an_agent_measures_its_shifted_clock_against_the_service():
    svc = TimeService("tcp://127.0.0.1:*").start()
    clock = NodeClock(-2_500_000_000, 30_000)  # 2.5 s behind, 30 ppm fast
    sync = TimeSync(svc.endpoint, clock, interval_s=0.05, say=lambda s: None).start()
    try:
        assert wait(lambda: sync.settled.is_set() and sync.bursts >= 6)
        est = sync.latest()
        t = clock.now_ns()
        got = t + est.offset_ns + est.drift_ppb * (t - est.ref_ns) / 1e9
        truth = clock.invert(t) + svc.anchor_ns
        # 2.5 s (and a day of uptime's drift) recovered to well under a millisecond
        assert abs(got - truth) < 1_000_000, (got - truth, est)
        assert 0 < est.uncertainty_ns < 1_000_000 and est.rtt_min_ns > 0 and est.epoch == svc.epoch
        assert svc.answered >= 6 * timesync.BURST * 0.5
    finally:
        sync.close()
        svc.close()


def test_once_the_fit_is_full_bursts_get_smaller_and_sparser(monkeypatch):
    monkeypatch.setattr(timesync, "STEADY_AFTER", 4)
    monkeypatch.setattr(timesync, "STEADY_INTERVAL_S", 0.2)
    svc = TimeService("tcp://127.0.0.1:*").start()
    sync = TimeSync(svc.endpoint, NodeClock(), interval_s=0.02, say=lambda s: None).start()
    try:
        assert wait(lambda: sync.steady())
        at, n0, b0 = time.monotonic(), svc.answered, sync.bursts
        assert wait(lambda: sync.bursts >= b0 + 5)
        per_burst = (svc.answered - n0) / (sync.bursts - b0)
        per_s = (sync.bursts - b0) / (time.monotonic() - at)
        assert per_burst <= timesync.STEADY_BURST + 1, per_burst  # +1: a burst in flight at the start
        assert per_s < 1 / 0.2 * 1.5, per_s  # a burst every 0.2 s, not every 0.02 s
        # the fit keeps its best exchanges: on a loaded box a burst's may all be dropped for a while
        assert wait(lambda: sync.latest() is not None and sync.latest().samples >= 4)
    finally:
        sync.close()
        svc.close()


def test_bad_requests_are_counted_and_good_ones_still_answered():
    svc = TimeService("tcp://127.0.0.1:*").start()
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(svc.endpoint)
    try:
        for junk in (b"", b"\xc1", msgpack.packb([1, "x"]), msgpack.packb({"a": 1}), b"x" * 100):
            s.send(junk)
        s.send(msgpack.packb([7, 123]))
        assert s.poll(5000)
        seq, t1, t2, t3, epoch = msgpack.unpackb(s.recv())
        assert (seq, t1, epoch) == (7, 123, svc.epoch) and t3 >= t2 > 0
        assert abs(t2 / 1e9 - time.time()) < 1.0  # the collector's timebase is Unix ns
        assert wait(lambda: svc.bad_requests == 5)
    finally:
        s.close()
        ctx.term()
        svc.close()


def test_without_a_service_it_falls_back_once_and_says_when_one_answers(monkeypatch):
    monkeypatch.setattr(timesync, "FALLBACK_AFTER_S", 0.3)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    lines = []
    sync = TimeSync(endpoint, NodeClock(), interval_s=0.05, say=lines.append).start()
    svc = None
    try:
        assert wait(lambda: sync.settled.is_set(), 5)
        assert sync.latest() is None
        assert len(lines) == 1 and "no reply from the collector's time service" in lines[0] and endpoint in lines[0]
        svc = TimeService(endpoint).start()
        assert wait(lambda: sync.latest() is not None and len(lines) == 2, 10), lines
        assert "established" in lines[1]
        epoch = sync.epoch
        svc.close()  # the collector restarts: a new epoch, the fit starts over
        svc = TimeService(endpoint).start()
        assert wait(lambda: sync.epoch_changes == 1 and sync.epoch != epoch, 10)
        assert sync.latest().epoch == svc.epoch
    finally:
        sync.close()
        if svc is not None:
            svc.close()


def two_free_ports():
    for _ in range(50):
        p = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
        return p
    raise RuntimeError("no two free ports in a row")


def test_the_collector_serves_time_on_the_next_port_or_says_where():
    port = two_free_ports()
    c = Collector(listen=f"tcp://127.0.0.1:{port}", on_line=lambda s: None, stacks=False).start()
    try:
        assert c.time_service.endpoint == f"tcp://127.0.0.1:{port + 1}"  # where agents look by default
        assert c.stats["time_service"]["endpoint"] == c.time_service.endpoint
    finally:
        c.stop()
    port = two_free_ports()
    lines = []
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 1))
        taken.listen()
        c = Collector(listen=f"tcp://127.0.0.1:{port}", on_line=lines.append, stacks=False).start()
        try:
            other = c.time_service.endpoint
            assert other != f"tcp://127.0.0.1:{port + 1}"
            assert len(lines) == 1 and f"--time-service {other}" in lines[0]
        finally:
            c.stop()
    off = Collector(listen="tcp://127.0.0.1:*", on_line=lambda s: None, stacks=False, time_listen="off").start()
    try:
        assert off.time_service is None
    finally:
        off.stop()


def test_an_explicit_time_listen_that_cannot_be_bound_is_an_error():
    svc = TimeService("tcp://127.0.0.1:*").start()
    try:
        with pytest.raises(timesvc.TimeServiceError, match="--time-listen"):
            TimeService(svc.endpoint).start()
    finally:
        svc.close()


def test_with_curve_keys_only_listed_agents_are_answered(tmp_path):
    from ccld.security import ClientKeys, ServerKeys, make_keypair
    make_keypair(str(tmp_path), "collector")
    make_keypair(str(tmp_path / "allow"), "n0")
    make_keypair(str(tmp_path / "other"), "n1")
    refused = []
    svc = TimeService("tcp://127.0.0.1:*", ServerKeys(str(tmp_path / "collector.key_secret"),
                                                      str(tmp_path / "allow")), refused.append).start()
    good = TimeSync(svc.endpoint, NodeClock(), interval_s=0.05, say=lambda s: None,
                    keys=ClientKeys(str(tmp_path / "allow" / "n0.key_secret"), str(tmp_path / "collector.key")))
    bad = TimeSync(svc.endpoint, NodeClock(), interval_s=0.05, say=lambda s: None,
                   keys=ClientKeys(str(tmp_path / "other" / "n1.key_secret"), str(tmp_path / "collector.key")))
    good.start()
    bad.start()
    try:
        assert wait(lambda: good.latest() is not None)  # the CURVE handshake fits the socket's size limit
        assert wait(lambda: any("unlisted key" in r for r in refused))
        assert bad.latest() is None and bad.exchanges == 0
    finally:
        good.close()
        bad.close()
        svc.close()
