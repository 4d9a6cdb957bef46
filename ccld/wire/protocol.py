"""The time service's messages: clock round trips and frame acknowledgements, as MessagePack arrays.

The collector's time service (ccld/collector/timesvc.py) answers two requests on one ZeroMQ socket;
the agent's ccld/tracer/timesync.py and ccld/tracer/ackclient.py ask them:

    [seq, t1]                                    clock request; t1 is the agent's to keep (it sends 0)
    [seq, t1, t2, t3, epoch]                     clock reply: t2 when the request was read, t3 when the
                                                 reply was sent, collector Unix ns; epoch names the
                                                 collector process (a new one: a new fit)
    ["ack", seq, [[agent, floor], ...]]          for each agent id whose frames the spool holds, the
                                                 lowest batch it may still send (nothing below comes)
    ["ack", seq, epoch, [[agent, acked], ...]]   every batch <= acked of that agent is in the store
                                                 (ccld/collector/acks.py says how far: on the OS) or
                                                 below its floor

Readers return None for anything else, and never raise: a bad message is the caller's to count.
Where the service listens by default (the events port + 1: default_time_endpoint) is here too, since
both sides must agree on it. Only the encoding and that address live here; the sockets, and what an
answer says, stay with their owners.
"""
from __future__ import annotations

import re
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple, Union

import msgpack

TIME_REQUEST_MAX_BYTES = 64   # [seq, t1] packs into < 20 bytes; anything bigger is not ours ...
ACK_REQUEST_MAX_BYTES = 4096  # ... but an ack request: 16 agent ids of <= 256 characters, said in < 4 KiB
ACK_REPLY_MAX_BYTES = 8192
ACK_MAX_AGENTS = 16           # agent ids in one ack request (a spool holds one or two: this run's, the last)
ACK_MAX_AGENT_ID = 256        # characters


def default_time_endpoint(endpoint: str) -> Optional[str]:
    """tcp://HOST:PORT -> tcp://HOST:PORT+1 (the time service's default); None when it has no port
    (ipc://, a wildcard port)."""
    m = re.match(r"^(tcp://.+):(\d+)$", endpoint or "")
    if not m or not 0 < int(m.group(2)) < 65535:
        return None
    return f"{m.group(1)}:{int(m.group(2)) + 1}"


class TimeRequest(NamedTuple):
    seq: int
    t1: int


class TimeReply(NamedTuple):
    seq: int
    t1: int
    t2: int
    t3: int
    epoch: int


class AckRequest(NamedTuple):
    seq: int
    floors: List[Tuple[str, int]]   # (agent id, lowest batch it may still send)


class AckReply(NamedTuple):
    seq: Any                        # the request's, echoed (not checked: nothing reads it)
    epoch: int
    acked: List[Tuple[str, int]]    # (agent id, every batch <= this is held)


def _pack(msg: List[Any]) -> bytes:
    raw: bytes = msgpack.packb(msg)
    return raw


def _unpack(raw: bytes) -> Any:
    try:
        return msgpack.unpackb(raw, raw=False)
    except Exception:
        return None


def _ints(msg: Any, n: int) -> bool:
    return isinstance(msg, list) and len(msg) == n and all(type(x) is int for x in msg)


def encode_time_request(seq: int, t1: int = 0) -> bytes:
    return _pack([seq, t1])


def encode_time_reply(seq: int, t1: int, t2: int, t3: int, epoch: int) -> bytes:
    return _pack([seq, t1, t2, t3, epoch])


def read_time_reply(raw: bytes) -> Optional[TimeReply]:
    r = _unpack(raw)
    return TimeReply(*r) if _ints(r, 5) else None


def encode_ack_request(seq: int, floors: Sequence[Tuple[str, int]]) -> bytes:
    """At most ACK_MAX_AGENTS of `floors` (the collector answers no more)."""
    return _pack(["ack", seq, [[a, int(f)] for a, f in floors[:ACK_MAX_AGENTS]]])


def read_ack_request(msg: Any) -> Optional[AckRequest]:
    """An ack request from its decoded message (read_request's answer)."""
    if (not isinstance(msg, list) or len(msg) != 3 or msg[0] != "ack" or type(msg[1]) is not int
            or not isinstance(msg[2], list) or len(msg[2]) > ACK_MAX_AGENTS):
        return None
    for p in msg[2]:
        if not (isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and len(p[0]) <= ACK_MAX_AGENT_ID
                and type(p[1]) is int and 0 <= p[1] < 1 << 62):
            return None
    return AckRequest(msg[1], [(p[0], p[1]) for p in msg[2]])


def read_request(raw: bytes) -> Union[TimeRequest, List[Any], None]:
    """What the time service was asked: a TimeRequest; an ack request's decoded message (a list that
    starts with "ack": its owner checks the rest with read_ack_request, and counts the bad ones); None."""
    if len(raw) > ACK_REQUEST_MAX_BYTES:
        return None
    msg = _unpack(raw)
    if isinstance(msg, list) and msg and msg[0] == "ack":
        return msg
    if len(raw) > TIME_REQUEST_MAX_BYTES or not _ints(msg, 2):
        return None
    return TimeRequest(*msg)


def encode_ack_reply(seq: int, epoch: int, acked: Sequence[Sequence[Any]]) -> bytes:
    return _pack(["ack", seq, epoch, acked])


def read_ack_reply(raw: bytes) -> Optional[AckReply]:
    """None for a clock reply or junk."""
    r = _unpack(raw)
    if (not isinstance(r, list) or len(r) != 4 or r[0] != "ack" or type(r[2]) is not int
            or not isinstance(r[3], list)):
        return None
    pairs = []
    for p in r[3]:
        if not (isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and type(p[1]) is int):
            return None
        pairs.append((p[0], p[1]))
    return AckReply(r[1], r[2], pairs)
