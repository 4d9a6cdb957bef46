"""Ship events to the collector: a bounded queue, batches, ZeroMQ PUSH, counted drops.

`put()` never blocks and never raises: when the queue is full the event is dropped and counted,
because the traced job (whose probes feed us) must never wait on the collector. A sender thread
sends a batch every FLUSH_INTERVAL_MS (or sooner when MAX_BATCH events are waiting), each with a
fresh ClockSample and, once clock sync has one, the newest ClockSync estimate first (timesync.py),
so the collector can convert this node's monotonic times; frames are held until clock sync settles.
Every event passes NodeClock.event here, the one place a test clock (CCLD_TEST_CLOCK) is applied.
ZeroMQ reconnects by itself when the collector goes away and comes back; batches that cannot be sent
while it is away wait in the queue (up to its bound) and are then dropped and counted.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Dict, List, Optional

import zmq

from ccld import events as ev
from ccld.tracer.nodeclock import NodeClock

log = logging.getLogger("ccld.shipper")

FLUSH_INTERVAL_MS = 100   # end-to-end latency budget is seconds; 100 ms keeps frames few and small
MAX_BATCH = 2048          # events per frame; ~150 B each -> ~300 KiB frames at most
QUEUE_LIMIT = 200_000     # ~30 MiB of events; minutes of a busy node's output while the collector is away
SNDHWM = 64               # frames ZeroMQ may hold per connection before send would block
LOSS_EVERY_S = 2.0        # how often the cumulative loss counters are shipped


def clock_sample() -> ev.ClockSample:
    mono = time.monotonic_ns()
    wall = time.time_ns()
    return ev.ClockSample(mono_ns=mono, wall_ns=wall, ts_ns=mono)


class Shipper:
    def __init__(self, endpoint: str, agent: str, node: str,
                 extra_loss: Optional[Callable[[], Dict[str, int]]] = None, keys=None,
                 clock: Optional[NodeClock] = None, sync=None):
        self.endpoint, self.agent, self.node = endpoint, agent, node
        self.clock = clock or NodeClock()
        self.sync = sync  # timesync.TimeSync (or None): its latest() estimate rides in every frame
        self.extra_loss = extra_loss or (lambda: {})
        self.queue: collections.deque = collections.deque()
        self.dropped = 0
        self.sent_events = 0
        self.sent_frames = 0
        self._batch_no = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 2000)
        self._sock.setsockopt(zmq.SNDHWM, SNDHWM)
        self._sock.setsockopt(zmq.RECONNECT_IVL, 200)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        if keys is not None:  # security.ClientKeys: CurveZMQ to a collector that lists our key
            from ccld.security import secure_client
            secure_client(self._sock, keys)
        self._sock.connect(endpoint)
        self._pending: Optional[bytes] = None
        self._pending_n = 0
        self._thread = threading.Thread(target=self._run, name="ccld-shipper", daemon=True)

    def start(self) -> "Shipper":
        self._thread.start()
        return self

    def put(self, event: ev.Event) -> None:
        with self._lock:
            if len(self.queue) >= QUEUE_LIMIT:
                self.dropped += 1
                return
            self.queue.append(event)
            if len(self.queue) >= MAX_BATCH:
                self._wake.set()

    def loss(self) -> Dict[str, int]:
        out = {"queue_dropped": self.dropped}
        out.update(self.extra_loss())
        return out

    def _take(self, n: int) -> List[ev.Event]:
        with self._lock:
            return [self.queue.popleft() for _ in range(min(n, len(self.queue)))]

    def _send_pending(self) -> bool:
        try:
            self._sock.send(self._pending, zmq.NOBLOCK)
        except zmq.Again:
            return False  # collector away or slow: keep the frame, try again next tick
        self.sent_frames += 1
        self.sent_events += self._pending_n
        self._pending, self._pending_n = None, 0
        return True

    def _run(self) -> None:
        last_loss = 0.0
        while True:
            stopping = self._stop.is_set()
            self._wake.wait(FLUSH_INTERVAL_MS / 1000)
            self._wake.clear()
            if self.sync is not None and not stopping and not self.sync.settled.is_set():
                self.sync.settled.wait(FLUSH_INTERVAL_MS / 1000)  # first estimate (or fallback) first
                continue
            while True:
                if self._pending is None:
                    batch = self._take(MAX_BATCH)
                    now = time.monotonic()
                    if now - last_loss >= LOSS_EVERY_S or stopping:
                        batch.append(ev.LossCounters(ts_ns=time.monotonic_ns(), counters=self.loss()))
                        last_loss = now
                    sync = self.sync.latest() if self.sync is not None else None
                    if sync is not None:
                        batch.insert(0, sync)  # first: this frame's events convert with the newest estimate
                    batch.append(clock_sample())
                    if not self.clock.identity:
                        batch = [self.clock.event(e) for e in batch]
                    self._batch_no += 1
                    self._pending = ev.encode_batch(self.agent, self.node, self._batch_no, batch)
                    self._pending_n = len(batch)
                if not self._send_pending():
                    with self._lock:  # while we cannot send, the queue bound is what limits memory
                        over = len(self.queue) - QUEUE_LIMIT
                        for _ in range(max(0, over)):
                            self.queue.popleft()
                            self.dropped += 1
                    break
                with self._lock:
                    if not self.queue:
                        break
            if stopping:
                return

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (for up to timeout_s), then close the socket."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        with self._lock:
            self.dropped += len(self.queue)
            self.queue.clear()
        self._sock.close(linger=int(timeout_s * 1000))
        self._ctx.term()
