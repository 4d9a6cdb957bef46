"""Ship events to the collector: a bounded queue, batches, a spool, ZeroMQ PUSH, acknowledged replay.

`put()` never blocks and never raises: when the queue is full the event is dropped and counted,
because the traced job (whose probes feed us) must never wait on the collector. It takes an Event
or a drain's rows.Rows (a translator's collective events as columns, counted as that many events).
A sender thread turns the queue into frames (frames.py) every FLUSH_INTERVAL_MS (or sooner when
MAX_BATCH events are waiting),
each with a fresh ClockSample and, once clock sync has one, the newest ClockSync estimate first
(timesync.py), so the collector can convert this node's monotonic times; frames are held until clock
sync settles. Every event passes the node clock in frames.encode, the one place a test clock
(CCLD_TEST_CLOCK) is applied.
Every frame goes to the spool (spool.py: on disk with `ccld agent`, else in memory) and is sent from
there in order. The collector's "ack?" answers (ackclient.py, on its time service) say which batches
its store holds: frames stay in the spool until acknowledged, and the send cursor goes back to the
oldest unacknowledged frame (a replay, deduplicated by the collector) when the connection drops, when
the collector's epoch changes (it restarted), or when acks stop advancing for STALL_S while frames
are out. Without an ack channel (time service off), or when none is answered ACK_CONFIRM_S after
frames went out (an older collector), a frame is let go once ZeroMQ takes it, and the spool only
bridges the time the collector is away.
Only the sender thread touches the spool, the sockets and the ack client.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Dict, List, Optional

import zmq
from zmq.utils.monitor import recv_monitor_message

from ccld import wire as ev
from ccld.bpf.rows import Rows
from ccld.tracer import frames
from ccld.tracer.nodeclock import NodeClock
from ccld.tracer.spool import Spool

log = logging.getLogger("ccld.shipper")

FLUSH_INTERVAL_MS = 100   # end-to-end latency budget is seconds; 100 ms keeps frames few and small
HEARTBEAT_S = 1.0         # with nothing queued, a frame (its clock sample: the agent's heartbeat) this
                          # often, not every tick: the collector calls an agent silent after 3 s (two
                          # heartbeats may be late or lost before it does); each idle wakeup costs CPU
MAX_BATCH = 2048          # events per frame; ~25 B each as columns, ~150 B as maps -> ~300 KiB frames at most
QUEUE_LIMIT = 200_000     # ~30 MiB of events waiting to become frames (the sender drains it every tick)
SNDHWM = 64               # frames ZeroMQ may hold per connection before send would block
LOSS_EVERY_S = 2.0        # how often the cumulative loss counters are shipped
ACK_INTERVAL_S = 1.0      # "ack?" this often (the collector's store flushes every 0.5 s): frames wait in
                          # the spool up to ~1.5 s longer; asked as often as heartbeats go, no more
ACK_SLACK_S = 0.1         # ... sent with a wakeup that comes up to this much before it is due (wakeups
                          # HEARTBEAT_S apart would otherwise just miss it and ask every other one)
FINISH_ACK_S = 0.25       # ... but while stopping (close()'s deadline is 2 s) as often as this
STALL_S = 5.0             # acks answered but not advancing this long while frames are out: send them again
STALL_MAX_S = 60.0        # ... and again after twice as long each time (a slow collector is not flooded)
STOP_POLL_S = 0.02        # close(): how often the last sends and acks are tried
ACK_CONFIRM_S = 5.0       # frames sent this long without any "ack?" answered: the collector does not ack


def clock_sample() -> ev.ClockSample:
    mono = time.monotonic_ns()
    wall = time.time_ns()
    return ev.ClockSample(mono_ns=mono, wall_ns=wall, ts_ns=mono)


class Shipper:
    def __init__(self, endpoint: str, agent: str, node: str,
                 extra_loss: Optional[Callable[[], Dict[str, int]]] = None, keys=None,
                 clock: Optional[NodeClock] = None, sync=None, spool: Optional[Spool] = None,
                 acks: Optional[str] = None, say: Optional[Callable[[str], None]] = None):
        self.endpoint, self.agent, self.node = endpoint, agent, node
        self.clock = clock or NodeClock()
        self.sync = sync  # timesync.TimeSync (or None): its latest() estimate rides in every frame
        self.extra_loss = extra_loss or (lambda: {})
        self.say = say or (lambda line: log.warning("%s", line))
        self.spool = spool if spool is not None else Spool(None, collector=endpoint, say=self.say).open()
        self.queue: collections.deque = collections.deque()  # Events and Rows
        self.queued = 0               # events in the queue (a Rows counts its rows)
        self.dropped = 0
        self.sent_events = 0
        self.sent_frames = 0          # distinct frames sent (a replayed one counts once, here)
        self.disconnects = 0
        self.collector_restarts = 0   # epoch changes seen in the acks
        self.stall_replays = 0
        self.ack_regressions = 0
        self.internal_errors = 0
        self._batch_no = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._stop_by = 0.0
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 2000)
        self._sock.setsockopt(zmq.SNDHWM, SNDHWM)
        # Queue only to a live connection: frames waiting for a collector wait in the spool, and what
        # ZeroMQ held when a connection dropped is gone with it (replayed from the spool), not sent
        # later out of order.
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        self._sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 500)  # a restarted collector gets the spool within ~0.5 s
        if keys is not None:  # security.ClientKeys: CurveZMQ to a collector that lists our key
            from ccld.security import secure_client
            secure_client(self._sock, keys)
        self._mon = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sock.connect(endpoint)
        self._acker = None
        if acks:
            from ccld.tracer.ackclient import AckClient
            self._acker = AckClient(acks, keys)
        self._epoch: Optional[int] = None
        self._rewound: Optional[int] = None  # frames the cursor went back over at a disconnect since the last ack
        self._next_ack = 0.0
        self._stall_since = 0.0
        self._stall_after = STALL_S
        self._first_sent_at: Optional[float] = None
        self._last_frame_at = 0.0
        self._no_acks_said = False
        self.spool.retain = self._acker is not None  # until the collector turns out not to acknowledge
        self._thread = threading.Thread(target=self._run, name="ccld-shipper", daemon=True)

    def start(self) -> "Shipper":
        self._thread.start()
        return self

    def put(self, item) -> None:
        """Queue an Event or a Rows (never blocks: what does not fit is dropped and counted)."""
        n = len(item) if type(item) is Rows else 1
        with self._lock:
            if self.queued + n > QUEUE_LIMIT:
                self.dropped += n
                return
            self.queue.append(item)
            self.queued += n
            if self.queued >= MAX_BATCH:
                self._wake.set()

    def loss(self) -> Dict[str, int]:
        out = {"queue_dropped": self.dropped}
        out.update(self.spool.loss())
        out.update(self.extra_loss())
        return out

    def stats(self) -> Dict[str, int]:
        """What was shipped, replayed and lost so far (the agent prints it at exit)."""
        out = {"sent_frames": self.sent_frames, "sent_events": self.sent_events, "queue_dropped": self.dropped,
               "disconnects": self.disconnects, "collector_restarts": self.collector_restarts,
               "stall_replays": self.stall_replays, "ack_regressions": self.ack_regressions,
               "acks_on": int(self.spool.retain), "internal_errors": self.internal_errors}
        out.update(self.spool.stats())
        return out

    @property
    def last_batch(self) -> int:
        """The number of the newest frame made (frames are numbered 1, 2, 3... per agent id)."""
        return self._batch_no

    def _take(self, n: int) -> List:
        """Up to n events' worth of items from the queue's head (a Rows cut to fit)."""
        out = []
        with self._lock:
            room = n
            while room > 0 and self.queue:
                item = self.queue[0]
                k = len(item) if type(item) is Rows else 1
                if k > room:  # rows are in the order they were made: a prefix is a valid cut
                    item, self.queue[0] = item.split(room)
                    k = room
                else:
                    self.queue.popleft()
                out.append(item)
                room -= k
            self.queued -= n - room
        return out

    # ---- the sender thread ------------------------------------------------------------------------

    def kick(self) -> None:
        """Frame and send what is queued now (the agent calls this after a drain that queued events)."""
        self._wake.set()

    def _timeout(self, last_loss: float) -> float:
        """How long to sleep: a tick while there is something to frame or send; else until the next
        heartbeat, ack request or loss report is due (each wakeup of a Python thread costs ~0.1 ms of
        CPU here: an idle agent should not pay ten a second for nothing)."""
        if self.queued or self.spool.unsent() or (self.sync is not None and not self.sync.settled.is_set()):
            return FLUSH_INTERVAL_MS / 1000
        # No wakeup of its own for "ack?": it rides on the next one (at least every HEARTBEAT_S), see
        # _exchange_acks.
        now = time.monotonic()
        due = min(self._last_frame_at + HEARTBEAT_S, last_loss + LOSS_EVERY_S)
        return min(max(FLUSH_INTERVAL_MS / 1000, due - now), HEARTBEAT_S)

    def _run(self) -> None:
        last_loss = 0.0
        while True:
            stopping = self._stop.is_set()
            self._wake.wait(self._timeout(last_loss))
            self._wake.clear()
            try:
                self._watch()
                self._exchange_acks(time.monotonic())
                if self.sync is not None and not stopping and not self.sync.settled.is_set():
                    self.sync.settled.wait(FLUSH_INTERVAL_MS / 1000)  # first estimate (or fallback) first
                    continue
                last_loss = self._frame_queued(last_loss, stopping)
                self._send()
                if stopping:
                    self._finish()
            except Exception:  # a bug here must not end shipping, nor ever reach the job
                self.internal_errors += 1
                log.exception("shipper error (%d so far); continuing", self.internal_errors)
                if stopping:
                    return
            if stopping:
                return

    def _frame_queued(self, last_loss: float, stopping: bool) -> float:
        """Turn what is queued into frames in the spool (with nothing queued, one every HEARTBEAT_S:
        its clock sample is the agent's heartbeat). Bounded per tick, so a producer faster than us
        cannot starve the sends."""
        now = time.monotonic()
        with self._lock:
            queued = self.queued
            n_frames = max(1, -(-queued // MAX_BATCH))
        if not queued and not stopping and now - self._last_frame_at < HEARTBEAT_S and now - last_loss < LOSS_EVERY_S:
            return last_loss
        self._last_frame_at = now
        for i in range(n_frames):
            batch = self._take(MAX_BATCH)
            now = time.monotonic()
            if i == n_frames - 1 and (now - last_loss >= LOSS_EVERY_S or stopping):
                batch.append(ev.LossCounters(ts_ns=time.monotonic_ns(), counters=self.loss()))
                last_loss = now
            sync = self.sync.latest() if self.sync is not None else None
            if sync is not None:
                batch.insert(0, sync)  # first: this frame's events convert with the newest estimate
            batch.append(clock_sample())
            self._batch_no += 1
            frame = frames.encode(self.agent, self.node, self._batch_no, batch, self.clock)
            self.spool.append(self.agent, self._batch_no, sum(map(frames.count, batch)), frame)
        return last_loss

    def _send(self) -> None:
        while True:
            got = self.spool.peek()
            if got is None:
                return
            frame, n = got
            try:
                self._sock.send(frame, zmq.NOBLOCK, copy=len(frame) < 65536)
            except zmq.Again:
                return  # collector away or slow: the spool keeps it; try again next tick
            if not self.spool.sent():
                self.sent_frames += 1
                self.sent_events += n
            if self._first_sent_at is None:
                self._first_sent_at = time.monotonic()

    def _watch(self) -> None:
        """A dropped connection loses what ZeroMQ held for it: send from the oldest unacknowledged frame."""
        while self._mon.poll(0):
            try:
                msg = recv_monitor_message(self._mon, zmq.NOBLOCK)
            except zmq.Again:
                return
            if msg.get("event") == zmq.EVENT_DISCONNECTED:
                self.disconnects += 1
                if self.spool.retain:
                    self._rewound = self.spool.rewind()

    def _exchange_acks(self, now: float) -> None:
        if self._acker is None:
            return
        for epoch, pairs in self._acker.replies():
            self._on_ack(epoch, pairs, now)
        if (self._epoch is None and self.spool.retain and self._first_sent_at is not None
                and now - self._first_sent_at >= ACK_CONFIRM_S):
            self.spool.set_retain(False)  # nobody acknowledges: holding frames would only fill the spool
            if not self._no_acks_said:
                self._no_acks_said = True
                self.say(f"ccld: note: no acknowledgement from {self._acker.endpoint} (an older collector, "
                         "or its time service is off): frames sent before a collector restart are not replayed")
        if now >= self._next_ack - ACK_SLACK_S:
            self._next_ack = now + ACK_INTERVAL_S
            floors = self.spool.floors()
            floors.setdefault(self.agent, self._batch_no + 1)
            self._acker.request(floors)

    def _on_ack(self, epoch: int, pairs, now: float) -> None:
        if not self.spool.retain:
            self.spool.set_retain(True)  # the collector acknowledges (after all): keep frames until it does
        if self._epoch is None or epoch != self._epoch:
            self._stall_since = now  # a first answer, or a new collector: the stall clock starts now
        if self._epoch is not None and epoch != self._epoch:
            self.collector_restarts += 1
            n = self._rewound if self._rewound is not None else self.spool.rewind()
            self.say(f"ccld: the collector restarted; sending again the {n} frames it had not acknowledged")
        self._epoch = epoch
        self._rewound = None
        progressed = False
        for agent, upto in pairs:
            before = self.spool.acked(agent)
            if upto < before:
                self.ack_regressions += 1  # it lost frames it had acknowledged (a new store?): nothing to resend
                if self.ack_regressions == 1:
                    self.say(f"ccld: warning: the collector now acknowledges {agent} up to batch {upto}, "
                             f"after {before}: frames it had acknowledged are gone from its store")
            elif upto > before:
                progressed = True
            self.spool.ack(agent, upto)
        if progressed or self.spool.unacked() == 0:
            self._stall_since = now
            self._stall_after = STALL_S
        elif now - self._stall_since >= self._stall_after:
            self.stall_replays += 1
            log.info("shipper: no acknowledgement for %.0f s with %d frames out; sending them again",
                     now - self._stall_since, self.spool.unacked())
            self.spool.rewind()
            self._stall_since = now
            self._stall_after = min(self._stall_after * 2, STALL_MAX_S)

    def _finish(self) -> None:
        """Stopping: send what is left and wait for its acknowledgement, until close()'s deadline."""
        while time.monotonic() < self._stop_by:
            self._watch()
            now = time.monotonic()
            self._next_ack = min(self._next_ack, now + FINISH_ACK_S)  # the last frames' acks, soon
            self._exchange_acks(now)
            self._send()
            if self.spool.unsent() == 0 and (not self.spool.retain or self.spool.unacked() == 0):
                return
            time.sleep(STOP_POLL_S)

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued and have it acknowledged (for up to timeout_s), then close. A disk spool
        keeps what is left for the next start; in memory it is counted as dropped."""
        self._stop_by = time.monotonic() + timeout_s
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s + 1.0)
        with self._lock:
            self.dropped += self.queued
            self.queue.clear()
            self.queued = 0
        if self._thread.is_alive():  # never close sockets under the thread using them
            log.warning("shipper thread did not stop; leaving its sockets open")
            return
        self.spool.close()
        self._sock.disable_monitor()
        self._mon.close(linger=0)
        if self._acker is not None:
            self._acker.close()
        self._sock.close(linger=int(timeout_s * 1000))
        self._ctx.term()
