"""Authentication: loopback by default; beyond it CurveZMQ, with only listed agents accepted and
every refusal logged. Real ZeroMQ sockets on 127.0.0.1."""
import os
import stat
import time

import pytest
import zmq

from ccld import wire as ev
from ccld.collector.server import Collector
from ccld.errors import CcldError
from ccld.security import ClientKeys, ServerKeys, is_loopback, make_keypair
from ccld.tracer.shipper import Shipper

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("endpoint,loop", [
    ("tcp://127.0.0.1:5555", True), ("tcp://127.3.4.5:1", True), ("tcp://localhost:5555", True),
    ("tcp://[::1]:5555", True), ("ipc:///tmp/x", True), ("tcp://0.0.0.0:5555", False),
    ("tcp://*:5555", False), ("tcp://10.1.2.3:5555", False), ("tcp://eth0:5555", False)])
def test_loopback(endpoint, loop):
    assert is_loopback(endpoint) is loop


def test_listening_beyond_loopback_needs_keys():
    with pytest.raises(CcldError, match="without authentication"):
        Collector(listen="tcp://0.0.0.0:*", on_line=lambda s: None).start()


def test_keys_are_owner_only(tmp_path):
    pub, sec = make_keypair(str(tmp_path / "keys"), "collector")
    assert stat.S_IMODE(os.stat(sec).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "keys").st_mode) == 0o700
    with pytest.raises(CcldError):
        make_keypair(str(tmp_path / "keys"), "../evil")


def _wait_events(coll, n, timeout=5.0):
    end = time.time() + timeout
    while time.time() < end:
        if coll.stats.get("frames_ok", 0) >= n:
            return True
        time.sleep(0.05)
    return False


def test_only_listed_agents_get_in_and_refusals_are_logged(tmp_path):
    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    make_keypair(str(keys), "collector")
    make_keypair(str(keys), "good")
    make_keypair(str(keys), "stranger")
    allowed.mkdir()
    (allowed / "good.key").write_bytes((keys / "good.key").read_bytes())
    lines = []
    coll = Collector(listen="tcp://127.0.0.1:*", on_line=lines.append,
                     keys=ServerKeys(str(keys / "collector.key_secret"), str(allowed)))
    coll.start()
    shippers = []
    try:
        good = Shipper(coll.endpoint, "good-agent", "n1",
                       keys=ClientKeys(str(keys / "good.key_secret"), str(keys / "collector.key"))).start()
        bad = Shipper(coll.endpoint, "bad-agent", "n2",
                      keys=ClientKeys(str(keys / "stranger.key_secret"), str(keys / "collector.key"))).start()
        plain = Shipper(coll.endpoint, "plain-agent", "n3").start()  # no CURVE at all
        shippers = [good, bad, plain]
        for s in shippers:
            s.put(ev.RankState(pid=1, rank=0, ts_ns=1, state="S"))
        assert _wait_events(coll, 1)
        time.sleep(1.5)
        agents = set(coll.timeline.agents)
        assert agents == {"good-agent"}, agents
        text = "\n".join(lines)
        assert "refused an agent with an unlisted key" in text
        assert "failed the CURVE handshake" in text
    finally:
        for s in shippers:
            s.close(timeout_s=0.2)
        coll.stop()


def test_acknowledgements_go_over_curve_too_and_only_to_listed_agents(tmp_path):
    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    for name in ("collector", "good", "stranger"):
        make_keypair(str(keys), name)
    allowed.mkdir()
    (allowed / "good.key").write_bytes((keys / "good.key").read_bytes())
    coll = Collector(listen="tcp://127.0.0.1:*", on_line=lambda s: None,
                     keys=ServerKeys(str(keys / "collector.key_secret"), str(allowed))).start()
    acks = coll.time_service.endpoint
    good = Shipper(coll.endpoint, "good-agent", "n1", acks=acks,
                   keys=ClientKeys(str(keys / "good.key_secret"), str(keys / "collector.key"))).start()
    bad = Shipper(coll.endpoint, "bad-agent", "n2", acks=acks,
                  keys=ClientKeys(str(keys / "stranger.key_secret"), str(keys / "collector.key"))).start()
    try:
        for s in (good, bad):
            s.put(ev.RankState(pid=1, rank=0, ts_ns=1, state="S"))
        end = time.time() + 10
        while good.spool.acked("good-agent") < 1 and time.time() < end:
            time.sleep(0.05)
        assert good.spool.acked("good-agent") >= 1 and good.stats()["acks_on"] == 1
        assert bad._acker.replies_taken == 0 and bad.spool.acked("bad-agent") == 0
    finally:
        good.close(timeout_s=0.2)
        bad.close(timeout_s=0.2)
        coll.stop()
