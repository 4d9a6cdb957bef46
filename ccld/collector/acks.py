"""Which frames of each agent the collector holds: resent frames dropped, and the agents' "ack?" answered.

Agents that keep frames until they are acknowledged (ccld/tracer/spool.py) mark them `"resend": true`
in the envelope (ccld/wire/codec.py) and number them 1, 2, 3... per agent id (one id per agent process start).
For those frames, per agent id:
  seen   every batch this collector stored, or found in the store when it started: a frame sent again
         after a collector restart is dropped (frames_duplicate), so the store holds each one once;
  acked  the same, but only once the store has handed the record to the OS (durable_records when the
         store fsyncs, as by default; flushed_records when it does not): what survives a killed
         collector, and what the agent may forget. Without a store: once the timeline has the frame.
Both are a watermark (every batch <= upto) and a bounded set of batches above it. An ack request names,
per agent id, the lowest batch the agent may still send (its "floor"): nothing below is sent again, so
gaps down there (frames the agent dropped on overflow) close in `acked`. Not in `seen`: a frame the
agent sent and then evicted unacknowledged may still be on its way (the ingest thread behind the time
service that answers), and it is stored when it comes; a gap in `seen` closes when it is filled, or
is given up after MAX_ABOVE later frames (frames of one agent arrive in the order they were sent).
`rebuild` reads every envelope of the store at start (not the events: ~1 us a frame), so a restarted
collector knows what it holds before the first replayed frame arrives.
Threads: the ingest thread adds, the time service thread answers (timesvc.py); one lock, held briefly.
Caveat: a frame that could not be stored (disk full) is neither seen nor acked, so the agent sends it
again after its stall timeout; the timeline, which did get it, then gets it twice.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from ccld import wire as ev
from ccld.wire import protocol

log = logging.getLogger("ccld.acks")

MAX_ABOVE = 4096          # batches remembered above an agent's watermark; beyond, the oldest gap is given up
MAX_AGENTS = 100_000      # agent ids remembered (one per agent start); beyond, the longest unheard is forgotten
DUPLICATE = object()      # admit()'s answer for a frame the store already holds


class Marks:
    """A set of batch numbers: all of 1..upto, plus `above` (at most MAX_ABOVE of them)."""
    __slots__ = ("upto", "above", "gaps_skipped")

    def __init__(self) -> None:
        self.upto = 0
        self.above: set = set()
        self.gaps_skipped = 0

    def __contains__(self, b: int) -> bool:
        return b <= self.upto or b in self.above

    def add(self, b: int) -> None:
        if b <= self.upto:
            return
        if b != self.upto + 1:
            self.above.add(b)
            if len(self.above) > MAX_ABOVE:  # a gap that never closes: give up the lowest one
                self.gaps_skipped += 1
                b = min(self.above)
                self.above.discard(b)
            else:
                return
        self.upto = b
        self._absorb()

    def floor(self, f: int) -> None:
        """Nothing below f will come: count it as present."""
        if f - 1 > self.upto:
            self.upto = f - 1
            self.above = {b for b in self.above if b > self.upto}
            self._absorb()

    def _absorb(self) -> None:
        while self.upto + 1 in self.above:
            self.upto += 1
            self.above.discard(self.upto)


class _Agent:
    __slots__ = ("seen", "acked")

    def __init__(self) -> None:
        self.seen, self.acked = Marks(), Marks()


class AckBook:
    def __init__(self, durable: Optional[Callable[[], int]] = None):
        self._durable = durable   # records of the store on the OS so far; None: no store
        self._agents: "collections.OrderedDict[str, _Agent]" = collections.OrderedDict()
        self._pending: Deque[Tuple[int, _Agent, int]] = collections.deque()  # (store record no, agent, batch)
        self._lock = threading.Lock()
        self.frames_duplicate = 0
        self.frames_tracked = 0
        self.agents_forgotten = 0
        self.rebuilt_frames = 0
        self.rebuild_s = 0.0
        self.requests = 0
        self.bad_requests = 0

    # ---- the store -------------------------------------------------------------------------------

    def use_store(self, store, store_dir: str) -> None:
        """Acknowledge what `store` (a StoreWriter) has on the OS, and learn what `store_dir` already
        holds. Called once, by the collector's start(), before any frame is received."""
        self._durable = (lambda: store.durable_records) if store.fsync else (lambda: store.flushed_records)
        self.rebuild(store_dir)

    def rebuild(self, store_dir: str) -> None:
        from ccld.store import read_store
        t0 = time.monotonic()
        n = 0
        for _, frame in read_store(store_dir, []):
            got = ev.peek_resend(frame)
            if got is not None:
                a = self._agent(got[0])
                a.seen.add(got[1])
                a.acked.add(got[1])  # on the OS: it was read back from there
                n += 1
        self.rebuilt_frames = n
        self.rebuild_s = time.monotonic() - t0
        if n:
            log.info("acks: %d resendable frames of %d agents found in %s in %.2f s",
                     n, len(self._agents), store_dir, self.rebuild_s)

    # ---- ingest thread ---------------------------------------------------------------------------

    def admit(self, frame: bytes):
        """None for a frame not marked resend; DUPLICATE for one already held (drop it); else a
        ticket for stored()."""
        got = ev.peek_resend(frame)
        if got is None:
            return None
        with self._lock:
            a = self._agent(got[0])
            if got[1] in a.seen:
                self.frames_duplicate += 1
                return DUPLICATE
        return a, got[1]

    def stored(self, ticket, record_no: Optional[int]) -> None:
        """The frame of `ticket` is in the store as record `record_no` of this writer (None: no store)."""
        if ticket is None or ticket is DUPLICATE:
            return
        a, b = ticket
        with self._lock:
            a.seen.add(b)
            self.frames_tracked += 1
            if self._durable is None or record_no is None:
                a.acked.add(b)
            else:
                self._pending.append((record_no, a, b))
                self._promote()

    def _promote(self) -> None:
        if not self._pending:
            return
        upto = self._durable()
        while self._pending and self._pending[0][0] <= upto:
            _, a, b = self._pending.popleft()
            a.acked.add(b)

    def _agent(self, agent: str) -> _Agent:
        a = self._agents.get(agent)
        if a is None:
            if len(self._agents) >= MAX_AGENTS:
                self._agents.popitem(last=False)
                self.agents_forgotten += 1
            a = self._agents[agent] = _Agent()
        else:
            self._agents.move_to_end(agent)
        return a

    # ---- time service thread ---------------------------------------------------------------------

    def answer(self, req: Any) -> Optional[List[Any]]:
        """The reply to ["ack", seq, [[agent, floor], ...]] (wire/protocol.py) without its epoch:
        [seq, [[agent, acked], ...]]; None for a malformed request (counted)."""
        got = protocol.read_ack_request(req)
        if got is None:
            self.bad_requests += 1
            return None
        out = []
        with self._lock:
            self._promote()
            for agent, floor in got.floors:
                a = self._agents.get(agent)
                if a is None:
                    # nothing stored for it: everything below its floor is as good as acknowledged. No
                    # entry made: a request must not push the agents that did send frames out (MAX_AGENTS)
                    out.append([agent, max(0, floor - 1)])
                    continue
                a.acked.floor(floor)  # not seen.floor: see the module's docstring
                out.append([agent, a.acked.upto])
        self.requests += 1
        return [got.seq, out]

    def counters(self) -> Dict[str, Any]:
        with self._lock:
            skipped = sum(a.seen.gaps_skipped + a.acked.gaps_skipped for a in self._agents.values())
            return {"frames_duplicate": self.frames_duplicate, "ack_agents": len(self._agents),
                    "ack_requests": self.requests, "ack_bad_requests": self.bad_requests,
                    "ack_pending_records": len(self._pending), "ack_gaps_skipped": skipped,
                    "ack_agents_forgotten": self.agents_forgotten, "ack_rebuilt_frames": self.rebuilt_frames,
                    "ack_rebuild_s": round(self.rebuild_s, 3)}
