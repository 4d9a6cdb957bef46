"""The time service's messages (ccld/wire/protocol.py): their bytes, and that readers refuse what is
not theirs (a clock reply is not an ack reply, junk is nothing) without raising. No sockets."""
import msgpack
import pytest

from ccld.wire import protocol

pytestmark = pytest.mark.unit


def test_clock_round_trip():
    assert protocol.encode_time_request(7) == msgpack.packb([7, 0])
    assert protocol.read_request(protocol.encode_time_request(7, 5)) == protocol.TimeRequest(7, 5)
    reply = protocol.encode_time_reply(7, 5, 10, 11, 3)
    assert msgpack.unpackb(reply) == [7, 5, 10, 11, 3]
    assert protocol.read_time_reply(reply) == protocol.TimeReply(7, 5, 10, 11, 3)
    assert protocol.read_ack_reply(reply) is None  # one socket carries both: each reader takes its own


def test_ack_round_trip():
    floors = [(f"agent-{i}", i) for i in range(20)]
    raw = protocol.encode_ack_request(4, floors)
    assert msgpack.unpackb(raw) == ["ack", 4, [[a, f] for a, f in floors[:protocol.ACK_MAX_AGENTS]]]
    msg = protocol.read_request(raw)
    assert msg == ["ack", 4, [[a, f] for a, f in floors[:protocol.ACK_MAX_AGENTS]]]
    assert protocol.read_ack_request(msg) == protocol.AckRequest(4, floors[:protocol.ACK_MAX_AGENTS])
    reply = protocol.encode_ack_reply(4, 9, [["agent-1", 3]])
    assert protocol.read_ack_reply(reply) == protocol.AckReply(4, 9, [("agent-1", 3)])
    assert protocol.read_time_reply(reply) is None


@pytest.mark.parametrize("raw", [
    b"", b"\xc1", msgpack.packb([1]), msgpack.packb([1, True]), msgpack.packb([1, 2, 3]),
    msgpack.packb({"seq": 1}), msgpack.packb([1, 2]) + b"x",
    msgpack.packb(["ack", 1, [["a" * 5000, 1]]]),  # an ack request over its size
])
def test_requests_that_are_not_ours_read_as_none(raw):
    assert protocol.read_request(raw) is None


@pytest.mark.parametrize("msg", [
    ["ack"], ["ack", "1", []], ["ack", 1, {}], ["ack", 1, [["a", -1]]], ["ack", 1, [[1, 2]]],
    ["ack", 1, [["a", 1]] * 17], ["ack", 1, [["x" * 300, 1]]], ["ack", 1, [["a", True]]], ["nak", 1, []],
])
def test_malformed_ack_requests_read_as_none(msg):
    assert protocol.read_ack_request(msg) is None


@pytest.mark.parametrize("raw", [b"\xc1", msgpack.packb(["ack", 1, 2, [["a", "3"]]]), msgpack.packb([1, 2, 3, 4, "5"]),
                                 msgpack.packb(["ack", 1, "2", []])])
def test_malformed_replies_read_as_none(raw):
    assert protocol.read_time_reply(raw) is None and protocol.read_ack_reply(raw) is None
