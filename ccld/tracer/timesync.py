"""Clock sync with the collector: round trips to its time service, fitted into offset and drift.

A thread sends a burst of BURST requests every INTERVAL_S (STEADY_BURST every STEADY_INTERVAL_S once the
fit is full enough) to the collector's time service (ccld/collector/timesvc.py; the messages are
ccld/wire/protocol.py's) over a ZeroMQ DEALER, stamping t1 and t4 with this node's clock
(NodeClock.now_ns(), the clock of every event the agent sends); the fastest exchange of each burst
goes into a clockfit.OffsetFit. `latest()` is the newest estimate as a ClockSync event, which the
shipper puts in every frame; the collector converts with it (ccld/timeline/clock.py).
Fallback: until the first estimate, and for good when no reply comes within FALLBACK_AFTER_S, the
collector converts with the node's wall clock (the ClockSample pair); that is said once, and so is
a time service that answers later. `settled` is set at the first estimate or at the fallback: the
shipper holds frames until then, so a job's first events are not converted with a clock the next
second replaces.
Caveat: a reply lost in the network costs one exchange (the DEALER does not wait for it forever);
a reply arriving after REPLY_TIMEOUT_MS is discarded by its sequence number.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, List, Optional

import zmq

from ccld import wire as ev
from ccld.wire import protocol
from ccld.tracer.clockfit import Exchange, OffsetFit, best_of
from ccld.tracer.nodeclock import NodeClock

log = logging.getLogger("ccld.timesync")

INTERVAL_S = 1.0          # one burst a second: a 50 ppm drift moves the offset 50 us between bursts,
                          # which the fit's line follows; the cost is BURST tiny messages a second
BURST = 12                # exchanges per burst; the fastest one is kept (a descheduled one is not)
BURST_GAP_S = 0.002       # between the exchanges of a burst: not all of them behind one hiccup
REPLY_TIMEOUT_MS = 200    # a reply later than this is lost (and its round trip useless anyway)
FALLBACK_AFTER_S = 3.0    # no reply for this long after start: say so, convert with the wall clock
FIRST_ESTIMATE_BURSTS = 2  # settle after this many bursts (16 exchanges: a first offset to ~RTT/2)
# Once the fit holds STEADY_AFTER samples (20 s at a burst a second), bursts get smaller and sparser:
# the drift is known by then, and the time service answers every agent of the job (2,048 agents at
# 12 requests a second were ~25 k requests/s, a quarter of the collector's core at ~10 us each).
STEADY_AFTER = 20
STEADY_BURST = 4
STEADY_INTERVAL_S = 2.0   # 2 requests a second per agent; a 50 ppm drift moves 100 us between bursts,
                          # which the fitted line follows (its residual is what the uncertainty counts)


class TimeSync:
    def __init__(self, endpoint: str, clock: NodeClock, keys=None, say: Callable[[str], None] = print,
                 interval_s: float = INTERVAL_S):
        self.endpoint = endpoint
        self.clock = clock
        self.say = say
        self.interval_s = interval_s
        self.fit = OffsetFit()
        self.settled = threading.Event()
        self.exchanges = 0        # replies received in time
        self.timeouts = 0         # requests without a reply in REPLY_TIMEOUT_MS
        self.bursts = 0           # bursts with at least one reply
        self.epoch: Optional[int] = None
        self.epoch_changes = 0
        self.fallback_said = False
        self._latest: Optional[ev.ClockSync] = None
        self._lock = threading.Lock()
        self._seq = 0
        self._stop = threading.Event()
        self._keys = keys
        self._ctx = self._sock = None
        self._thread = threading.Thread(target=self._run, name="ccld-timesync", daemon=True)

    def start(self) -> "TimeSync":
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, BURST * 2)  # never queue more than a burst or two for a dead peer
        self._sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing for a service not (yet) connected: stale stamps
        self._sock.setsockopt(zmq.RECONNECT_IVL, 200)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        if self._keys is not None:
            from ccld.security import secure_client
            secure_client(self._sock, self._keys)
        self._sock.connect(self.endpoint)
        self._started = time.monotonic()
        self._thread.start()
        return self

    def latest(self) -> Optional[ev.ClockSync]:
        with self._lock:
            return self._latest

    def counters(self) -> dict:
        return {"clock_sync_timeouts": self.timeouts, "clock_sync_rejected": self.fit.rejected,
                "clock_sync_epoch_changes": self.epoch_changes}

    # -- the thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            try:
                got = self._burst()
            except zmq.ZMQError as e:
                if self._stop.is_set():
                    return
                log.warning("clock sync: %s", e)
                got = []
            self._use(got)
            if not self.settled.is_set() and time.monotonic() - self._started >= FALLBACK_AFTER_S:
                self._fallback()
            interval = self.interval_s if not self.steady() else max(self.interval_s, STEADY_INTERVAL_S)
            next_at += interval
            self._stop.wait(max(0.0, next_at - time.monotonic()))
            # after a long stall (a suspended agent): no burst of catch-up bursts
            next_at = max(next_at, time.monotonic() - interval)

    def steady(self) -> bool:
        """The fit has enough samples for smaller, sparser bursts (a restarted collector starts it over)."""
        return len(self.fit.samples) >= STEADY_AFTER

    def _burst(self) -> List[tuple]:
        """BURST exchanges; returns [(Exchange, epoch)] of those answered in time."""
        out = []
        for i in range(STEADY_BURST if self.steady() else BURST):
            if self._stop.is_set():
                break
            if i:
                time.sleep(BURST_GAP_S)
            self._seq += 1
            seq = self._seq
            msg = protocol.encode_time_request(seq)  # t1 stays here: stamped after packing, nothing between it and send
            t1 = self.clock.now_ns()
            try:
                self._sock.send(msg, zmq.NOBLOCK)
            except zmq.Again:
                self.timeouts += 1  # not connected (yet): no peer to queue for
                continue
            deadline = time.monotonic() + REPLY_TIMEOUT_MS / 1000
            while True:
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0:
                    self.timeouts += 1
                    break
                self._sock.setsockopt(zmq.RCVTIMEO, left_ms)
                try:
                    reply = self._sock.recv()  # blocking: t4 is read the moment it returns
                except zmq.Again:
                    self.timeouts += 1
                    break
                t4 = self.clock.now_ns()
                x = self._parse(reply, seq, t1, t4)
                if x is not None:
                    out.append(x)
                    self.exchanges += 1
                    break
                # an older request's late reply: keep waiting for ours
        return out

    @staticmethod
    def _parse(reply: bytes, seq: int, t1: int, t4: int):
        r = protocol.read_time_reply(reply)
        if r is None or r.seq != seq:
            return None
        return Exchange(t1, r.t2, r.t3, t4), r.epoch

    def _use(self, got: List[tuple]) -> None:
        if not got:
            return
        epoch = got[-1][1]
        if self.epoch is not None and epoch != self.epoch:
            self.epoch_changes += 1  # the collector restarted: a new timebase anchor, a new fit
            self.fit.reset()
        self.epoch = epoch
        best = best_of(x for x, e in got if e == epoch)
        if best is None or not self.fit.add(best):
            return
        self.bursts += 1
        est = self.fit.estimate()
        if est is None:
            return
        msg = ev.ClockSync(ts_ns=self.clock.now_ns(), ref_ns=est.ref_ns, offset_ns=est.offset_ns,
                           drift_ppb=est.drift_ppb, uncertainty_ns=est.uncertainty_ns,
                           rtt_min_ns=est.rtt_min_ns, residual_ns=est.residual_ns, samples=est.samples,
                           epoch=epoch)
        with self._lock:
            self._latest = msg
        if self.bursts >= FIRST_ESTIMATE_BURSTS and not self.settled.is_set():
            self.settled.set()
            log.info("clock sync: offset %+.6f s, +-%.0f us", est.offset_ns / 1e9, est.uncertainty_ns / 1e3)
        elif self.fallback_said and self.bursts == FIRST_ESTIMATE_BURSTS:
            self.say(f"ccld: clock sync with the collector's time service at {self.endpoint} established "
                     f"(+-{est.uncertainty_ns / 1e3:.0f} us); converting with it from now on")

    def _fallback(self) -> None:
        if not self.fallback_said:
            self.fallback_said = True
            self.say(f"ccld: warning: no reply from the collector's time service at {self.endpoint} in "
                     f"{FALLBACK_AFTER_S:g} s; this node's times are converted with its wall clock (as "
                     "accurate as its NTP/PTP) until it answers")
        self.settled.set()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2 + REPLY_TIMEOUT_MS / 1000 * BURST)
        if self._ctx is not None and not self._thread.is_alive():
            self._sock.close(linger=0)
            self._ctx.term()
