"""The collector's time service: agents measure their clock against the collector's by round trips.

A ZeroMQ ROUTER on its own port (by default the collector's port + 1; `ccld collector --time-listen`).
Request: MessagePack [seq, t1] (the agent's own numbers, echoed); reply: [seq, t1, t2, t3, epoch]
(ccld/wire/protocol.py), where t2 is when the request was read and t3 when the reply is sent, in the
collector's timebase:
Unix ns = CLOCK_MONOTONIC + an anchor (CLOCK_REALTIME - CLOCK_MONOTONIC read once at start), so a
step of this machine's wall clock while it runs does not break the agents' fits. `epoch` is random
per start: an agent that sees it change starts its fit over.
One thread answers at once (t2 and t3 are read around nothing but the reply's packing). Bad requests
(not a 2-int list, too big) are counted and dropped. With CurveZMQ keys it authenticates as the
event socket does, on a context of its own (one ZAP handler per context).
It also answers the agents' "ack?" requests (["ack", seq, [[agent, floor], ...]], see
ccld/tracer/ackclient.py) from the collector's AckBook (acks.py), with this same epoch: the agent
that sees it change knows the collector restarted and replays what was not acknowledged.
Caveat: the reply's timestamps are taken in Python, after ZeroMQ's I/O thread handed the request
over; that delay is part of the measured round trip, which is why agents keep the fastest exchanges.
"""
from __future__ import annotations

import logging
import re
import secrets
import threading
import time
from typing import Callable, Optional

import zmq

from ccld.errors import CcldError
from ccld.wire import protocol

log = logging.getLogger("ccld.timesvc")

POLL_MS = 100             # the thread notices stop() within this


class TimeServiceError(CcldError):
    pass


class TimeService:
    def __init__(self, listen: str, keys=None, on_refused: Callable[[str], None] = print, acks=None):
        self.listen = listen
        self.acks = acks  # acks.AckBook: answers "ack?" requests (None: they are bad requests)
        self.keys = keys
        self.on_refused = on_refused
        self.epoch = secrets.randbits(31) | 1
        mono, wall = time.monotonic_ns(), time.time_ns()
        self.anchor_ns = wall - mono   # collector timebase = CLOCK_MONOTONIC + anchor_ns (Unix ns)
        self.endpoint: Optional[str] = None
        self.answered = 0
        self.answered_acks = 0
        self.bad_requests = 0
        self._ctx: Optional[zmq.Context] = None
        self._sock = None
        self._guard = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def now_ns(self) -> int:
        return time.monotonic_ns() + self.anchor_ns

    def start(self) -> "TimeService":
        from ccld.security import check_listen, secure_server
        check_listen(self.listen, self.keys)
        self._ctx = zmq.Context()
        try:
            self._sock = self._ctx.socket(zmq.ROUTER)
            if self.keys is not None:
                self._guard = secure_server(self._ctx, self._sock, self.keys, self.on_refused)
            self._sock.setsockopt(zmq.LINGER, 0)
            # requests are ~20 bytes, but the limit applies to the CURVE handshake too (~350 bytes)
            self._sock.setsockopt(zmq.MAXMSGSIZE, 4096)
            self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a peer gone before its reply: drop it
            try:
                self._sock.bind(self.listen)
            except zmq.ZMQError as e:
                raise TimeServiceError(f"cannot listen for clock sync on {self.listen}: {e} "
                                       "(choose another with --time-listen)") from None
            self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException:
            self.close()
            raise
        self._thread = threading.Thread(target=self._loop, name="ccld-timesvc", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        sock = self._sock
        sock.setsockopt(zmq.RCVTIMEO, POLL_MS)  # a blocking recv: t2 is read the moment it returns
        while not self._stop.is_set():
            try:
                try:
                    parts = sock.recv_multipart()
                except zmq.Again:
                    continue
                t2 = self.now_ns()
                self._answer(sock, parts, t2)
            except zmq.ZMQError as e:
                if self._stop.is_set():
                    return
                log.warning("time service: %s", e)
                time.sleep(POLL_MS / 1000)

    def _answer(self, sock, parts, t2: int) -> None:
        req = protocol.read_request(parts[1]) if len(parts) == 2 else None
        if req is None:
            self.bad_requests += 1
            return
        if not isinstance(req, protocol.TimeRequest):  # an ack request: the AckBook checks it
            reply = self.acks.answer(req) if self.acks is not None else None
            if reply is None:
                self.bad_requests += 1
                return
            sock.send_multipart([parts[0], protocol.encode_ack_reply(reply[0], self.epoch, reply[1])], zmq.NOBLOCK)
            self.answered_acks += 1
            return
        t3 = self.now_ns()
        sock.send_multipart([parts[0], protocol.encode_time_reply(req.seq, req.t1, t2, t3, self.epoch)], zmq.NOBLOCK)
        self.answered += 1

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
            if self._thread.is_alive():  # never close a socket under the thread using it
                log.warning("time service thread did not stop; leaving its socket open")
                return
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._guard is not None:
            self._guard.stop()
            self._guard = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def stats(self) -> dict:
        return {"endpoint": self.endpoint, "epoch": self.epoch, "anchor_ns": self.anchor_ns,
                "answered": self.answered, "answered_acks": self.answered_acks, "bad_requests": self.bad_requests}


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A free TCP port p on `host` whose successor is free too: a collector's events port and its time
    service's default (p + 1). For tests and benchmarks; another process may take either port later."""
    import socket
    for _ in range(50):
        with socket.socket() as s:
            s.bind((host, 0))
            p = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind((host, p + 1))
            return p
        except OSError:
            continue
    raise TimeServiceError(f"no two consecutive free ports on {host} in 50 tries")


def start_time_service(events_endpoint: str, time_listen: Optional[str], keys,
                       say: Callable[[str], None], wildcard: bool = False, acks=None) -> Optional[TimeService]:
    """The collector's time service, or None. time_listen: "auto" (the events port + 1, where agents
    look by default; when that is taken, any free port, said once, since agents then need
    --time-service, unless the events port was itself chosen by the system: `wildcard`, as `ccld run`
    does, which hands the endpoint to its agent), "off", or an endpoint (an error when it cannot be bound)."""
    if not time_listen or time_listen == "off":
        return None
    if time_listen != "auto":
        return TimeService(time_listen, keys, say, acks).start()
    want = protocol.default_time_endpoint(events_endpoint)
    if want is not None:
        try:
            return TimeService(want, keys, say, acks).start()
        except TimeServiceError:
            pass
    host = re.match(r"^(tcp://.+):[^:]+$", events_endpoint or "")
    if host is None:  # ipc:// or inproc://: agents on this machine share its clock anyway
        return None
    svc = TimeService(f"{host.group(1)}:*", keys, say, acks).start()
    if not wildcard:
        say(f"ccld: note: the time service is on {svc.endpoint} ({want or 'the events port + 1'} was not "
            f"free); start agents with --time-service {svc.endpoint}")
    return svc
