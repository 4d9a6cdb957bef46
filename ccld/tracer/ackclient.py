"""Ask the collector which frames it has stored: the agent's half of acknowledged delivery.

A ZeroMQ DEALER to the collector's time service (ccld/collector/timesvc.py answers these beside its
clock round trips; the agent already talks to it). MessagePack request and reply (ccld/wire/protocol.py):

    ["ack", seq, [[agent, floor], ...]]          for each agent id whose frames the spool holds, the
                                                 lowest batch it may still send (nothing below comes)
    ["ack", seq, epoch, [[agent, acked], ...]]   every batch <= acked of that agent is in the store
                                                 (ccld/collector/acks.py says how far: on the OS) or
                                                 below its floor; epoch names the collector process

Non-blocking and owned by the shipper's sender thread: `request()` sends (dropped when the service is
not connected: ZMQ_IMMEDIATE), `replies()` takes what has come. A lost or late reply costs nothing;
a reply to an old request is still true (acks only grow within one epoch).
"""
from __future__ import annotations

import logging
from typing import Dict, List, Tuple

import zmq

from ccld.wire import protocol

log = logging.getLogger("ccld.ackclient")


class AckClient:
    def __init__(self, endpoint: str, keys=None):
        self.endpoint = endpoint
        self.requests = 0
        self.replies_taken = 0
        self.bad_replies = 0
        self._seq = 0
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 4)      # never a backlog of stale questions
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        self._sock.setsockopt(zmq.RECONNECT_IVL, 100)
        # a restarted collector is seen within ~0.5 s, not after ZeroMQ's usual backoff (one connection
        # attempt every 0.5 s while it is away costs nothing)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 500)
        self._sock.setsockopt(zmq.MAXMSGSIZE, protocol.ACK_REPLY_MAX_BYTES)
        if keys is not None:
            from ccld.security import secure_client
            secure_client(self._sock, keys)
        self._sock.connect(endpoint)

    def request(self, floors: Dict[str, int]) -> bool:
        self._seq += 1
        try:
            self._sock.send(protocol.encode_ack_request(self._seq, list(floors.items())), zmq.NOBLOCK)
        except zmq.Again:
            return False
        self.requests += 1
        return True

    def replies(self) -> List[Tuple[int, List[Tuple[str, int]]]]:
        """[(epoch, [(agent, acked), ...])] of the replies waiting, oldest first."""
        out = []
        while True:
            try:
                raw = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            got = protocol.read_ack_reply(raw)  # None: a clock reply (time service) or junk
            if got is None:
                self.bad_replies += 1
                continue
            self.replies_taken += 1
            out.append((got.epoch, got.acked))

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()

