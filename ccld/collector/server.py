"""The live collector: receive frames over ZeroMQ, store them, build the timeline, report hangs.

Two threads: the ingest thread owns the PULL socket and the store (recv with a poll timeout ->
decode -> append raw to the store -> timeline), and the detection thread runs the detectors every
TICK_S and prints each new finding or recovery as one line and one JSON line in the findings file
(flushed at once). A lock serialises the timeline between them. A third thread, the time service
(timesvc.py, by default on the events port + 1), answers the agents' clock round trips.
Times: `recv_unix` and detection `now` are this machine's wall clock (Unix seconds); event times
are converted from the agents' clocks by the timeline. Bounds: ZeroMQ holds at most RCVHWM frames
per agent connection (beyond that agents queue and count their own drops); stop() ingests what is
queued for STOP_DRAIN_S and counts the rest (frames_dropped_at_stop); bad frames are counted
by reason and logged at most once per LOG_EVERY_S per reason; nothing received stops the collector.
Frames an agent may send again (marked "resend") are stored once: acks.py drops the copies and
answers the agents' "ack?" on the time service with what the store has flushed.
Caveat: frames larger than MAXMSGSIZE_BYTES make ZeroMQ drop the sender's connection (it reconnects);
that protects our memory and is far above any real frame (events.MAX_FRAME_BYTES).
"""
from __future__ import annotations

import json
import os
import logging
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import zmq

from ccld import wire as ev
from ccld.collector.acks import DUPLICATE, AckBook
from ccld.collector.timesvc import start_time_service
from ccld.diagnose import Diagnoser
from ccld.diagnose.findings import Finding, format_line
from ccld.diagnose.tracker import FindingTracker
from ccld.diagnose.thresholds import AGENT_LAG_S, AGENT_SILENT_S
from ccld.diagnose.stack import StackTaker
from ccld.errors import CcldError
from ccld.security import ServerKeys, check_listen, secure_server
from ccld.store import StoreWriter
from ccld.timeline.ingest import IngestCounters, decode_frame, restore_gc, tune_gc
from ccld.timeline.timeline import Timeline
from ccld.tracer.discover import is_rank

log = logging.getLogger("ccld.collector")

DEFAULT_LISTEN = "tcp://127.0.0.1:5555"
TICK_S = 0.5              # detection period: findings within seconds need sub-second ticks
POLL_MS = 100             # ingest wakes at least this often to flush the store and notice stop()
MAX_BURST = 256           # frames handled per wake before flushing/checking stop again
GROUP_FRAMES = 256        # frames whose collective rows the timeline applies together (one lock hold) ...
GROUP_EVENTS = 16_384     # ... or fewer, to hold this many events at most: the lock and a stop wait on it
STOP_DRAIN_S = 2.0        # on stop, ingest what is already queued for this long (< JOIN_TIMEOUT_S) ...
STOP_COUNT_S = 1.0        # ... then receive the rest unread for this long, to count it (frames_dropped_at_stop)
# Frames queued per agent connection in ZeroMQ, the collector's only receive queue: <= ~30 MiB per agent
# at the shipper's largest frames (~300 KiB). It was 1000: a flood of 4 agents then held 540 MiB here
# (bench/flood_collector.py). Beyond it senders get zmq.Again and their bounded queue counts the drops.
RCVHWM = 100
MAXMSGSIZE_BYTES = ev.MAX_FRAME_BYTES  # bigger than this cannot be a frame; ZeroMQ drops the peer instead of allocating it
STATS_INTERVAL_S = 2.0    # stats.json is for humans and `ccld diagnose`; every 2 s is plenty
LOG_EVERY_S = 10.0        # a flood of bad frames prints one line per reason per 10 s, with a count
MAX_FINDINGS_KEPT = 10_000  # in memory; the findings file keeps everything
JOIN_TIMEOUT_S = 20.0     # the drain budget is ~3 s; under a flood on 2 busy cores one frame alone can take seconds


class CollectorError(CcldError):
    """The collector cannot start (address in use, store unusable, findings file not writable)."""


class _RateLimitedLog:
    def __init__(self, every_s: float = LOG_EVERY_S):
        self.every_s = every_s
        self._last: Dict[str, float] = {}
        self._suppressed: Dict[str, int] = {}

    def __call__(self, reason: str, message: str) -> None:
        now = time.monotonic()
        last = self._last.get(reason)
        if last is not None and now - last < self.every_s:
            self._suppressed[reason] = self._suppressed.get(reason, 0) + 1
            return
        more = self._suppressed.pop(reason, 0)
        self._last[reason] = now
        log.warning("%s%s", message, f" ({more} more like it since the last report)" if more else "")


class Collector:
    def __init__(self, listen: str = DEFAULT_LISTEN, store_dir: Optional[str] = None,
                 findings_path: Optional[str] = None, on_line: Callable[[str], Any] = print,
                 floor_s: Optional[float] = None, k: float = 4.0, tick_s: float = TICK_S,
                 keys: Optional["ServerKeys"] = None, stacks: bool = True, time_listen: Optional[str] = "auto"):
        self.listen = listen
        self.time_listen = time_listen  # the agents' clock sync (timesvc.py): "auto" = events port + 1
        self.time_service = None
        self.keys = keys          # CurveZMQ server keys; required to listen beyond loopback
        self._auth = None
        # absolute now: bcc chdir()s while it compiles, and the ingest thread may write meanwhile
        self.store_dir = os.path.abspath(store_dir) if store_dir else None
        self.findings_path = os.path.abspath(findings_path) if findings_path else None
        self.on_line = on_line
        self.tick_s = tick_s
        self.timeline = Timeline()
        self.counters = IngestCounters()
        self.acks = AckBook()  # resent frames dropped, agents' "ack?" answered (acks.py)
        self.diagnoser = Diagnoser(self.timeline, floor_s=floor_s, k=k,
                                   stacks=StackTaker(is_rank) if stacks else None)
        self.tracker = FindingTracker()
        self._silent_agents: set = set()
        self._lagging_agents: set = set()
        self.findings: List[Finding] = []
        self.recoveries: List[Dict[str, Any]] = []
        self.updates = 0
        self.endpoint: Optional[str] = None
        self.internal_errors = 0
        self.frames_dropped_at_stop = 0  # queued in ZeroMQ when stop() ran out of drain time: counted, not read
        self.findings_not_kept = 0
        self.store_errors = 0
        self._lock = threading.Lock()       # timeline + counters
        self._out_lock = threading.Lock()   # findings file + on_line + lists
        self._stop = threading.Event()
        self._log_reject = _RateLimitedLog()
        self._ctx: Optional[zmq.Context] = None
        self._sock = None
        self._store: Optional[StoreWriter] = None
        self._findings_file = None
        self._threads: List[threading.Thread] = []
        self._started_at: Optional[float] = None
        self._stopped = False
        self._gc_tuned = False
        self.quiesced = False  # the job is being stopped on purpose (quiesce): no detection from then on

    # ---- lifecycle ------------------------------------------------------------------------------

    def start(self) -> "Collector":
        if self._threads:
            raise CollectorError("collector already started")
        try:
            if self.store_dir:
                self._store = StoreWriter(self.store_dir)
                self.acks.use_store(self._store, self.store_dir)  # what it holds: replays are deduplicated
            if self.findings_path:
                try:
                    self._findings_file = open(self.findings_path, "a", encoding="utf-8")
                except OSError as e:
                    raise CollectorError(f"cannot write findings to {self.findings_path}: {e}") from None
            check_listen(self.listen, self.keys)
            self._ctx = zmq.Context()
            self._sock = self._ctx.socket(zmq.PULL)
            if self.keys is not None:
                self._auth = secure_server(self._ctx, self._sock, self.keys, self._say)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.RCVHWM, RCVHWM)
            self._sock.setsockopt(zmq.MAXMSGSIZE, MAXMSGSIZE_BYTES)
            try:
                self._sock.bind(self.listen)
            except zmq.ZMQError as e:
                raise CollectorError(f"cannot listen on {self.listen}: {e}") from None
            self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self.time_service = start_time_service(self.endpoint, self.time_listen, self.keys, self._say,
                                                   wildcard=self.listen.endswith(":*"), acks=self.acks)
        except BaseException:
            self._close_resources()
            raise
        self._started_at = time.time()
        tune_gc()
        self._gc_tuned = True
        self._threads = [threading.Thread(target=self._ingest_loop, name="ccld-ingest", daemon=True),
                         threading.Thread(target=self._tick_loop, name="ccld-detect", daemon=True)]
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        """Drain what is already received, flush store, stats and findings, close the socket."""
        if self._stopped:
            return
        self._stopped = True
        self._stop.set()
        for t in self._threads:
            t.join(JOIN_TIMEOUT_S)
            if t.is_alive():
                log.warning("collector thread %s did not stop within %.0f s", t.name, JOIN_TIMEOUT_S)
        if self._threads and not any(t.is_alive() for t in self._threads):
            self._final_tick()
        if self._store is not None:
            try:
                self._store.write_stats(self.stats)
            except OSError as e:
                log.warning("cannot write %s/stats.json: %s", self.store_dir, e)
        self._close_resources(socket_in_use=any(t.is_alive() for t in self._threads if t.name == "ccld-ingest"))
        if self._gc_tuned:
            restore_gc()

    def _close_resources(self, socket_in_use: bool = False) -> None:
        if self.time_service is not None:
            self.time_service.close()
            self.time_service = None
        if self._store is not None:
            try:
                self._store.close()
            except OSError as e:
                log.warning("cannot close store %s: %s", self.store_dir, e)
        with self._out_lock:
            if self._findings_file is not None:
                self._findings_file.close()
                self._findings_file = None
        if socket_in_use:  # closing a ZeroMQ socket under the thread using it can abort the process
            log.warning("collector ingest thread still busy: leaving its socket and context open")
            return
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def __enter__(self) -> "Collector":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- ingest ---------------------------------------------------------------------------------

    def _ingest_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        last_stats = time.monotonic()
        drain_until = None
        while True:
            stopping = self._stop.is_set()
            if stopping and drain_until is None:
                drain_until = time.monotonic() + STOP_DRAIN_S
            try:
                if stopping or poller.poll(POLL_MS):
                    taken: List[Tuple[ev.Batch, float]] = []
                    events = 0
                    for _ in range(MAX_BURST):
                        if stopping and time.monotonic() >= drain_until:
                            self._count_left_at_stop()
                            break
                        if not stopping and self._stop.is_set():
                            break  # stop() came during the burst: start its drain clock now
                        try:
                            frame = self._sock.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        got = self._take(frame, time.time())
                        if got is not None:
                            taken.append(got)
                            events += len(got[0])
                            if len(taken) >= GROUP_FRAMES or events >= GROUP_EVENTS:
                                self._ingest(taken)
                                events = 0
                    else:
                        self._ingest(taken)
                        if stopping:
                            continue  # more was waiting: keep draining (for STOP_DRAIN_S) before the final flush
                    self._ingest(taken)
                if self._store is not None:
                    self._store.maybe_flush()
                    if time.monotonic() - last_stats >= STATS_INTERVAL_S:
                        last_stats = time.monotonic()
                        self._store.write_stats(self.stats)
                        self._store.flush()
            except Exception:  # a bug or a full disk must not take the collector down; count and go on
                self.internal_errors += 1
                log.exception("collector ingest error (%d so far); continuing", self.internal_errors)
                time.sleep(POLL_MS / 1000)
            if stopping:
                return

    def _count_left_at_stop(self) -> None:
        """Count, unread, what is still queued when the stop drain runs out of time (never chase a
        sender forever: this too stops after STOP_COUNT_S)."""
        deadline = time.monotonic() + STOP_COUNT_S
        while time.monotonic() < deadline:
            try:
                self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            self.frames_dropped_at_stop += 1
        if self.frames_dropped_at_stop:
            log.warning("collector stopped with %d queued frames not ingested (counted in frames_dropped_at_stop)",
                        self.frames_dropped_at_stop)

    def handle_frame(self, frame: bytes, recv_unix: float) -> None:
        """Decode, count, store and ingest one frame (the ingest thread's job; public for tests)."""
        got = self._take(frame, recv_unix)
        if got is not None:
            self._ingest([got])

    def _ingest(self, taken: List[Tuple[ev.Batch, float]]) -> None:
        """Frames taken (decoded and stored), into the timeline together (their rows in one pass)."""
        if not taken:
            return
        with self._lock:
            self.timeline.ingest_many(taken)
        for batch, _ in taken:
            for e in batch.errors:
                self._log_reject("event:" + e.reason, f"dropped a bad event ({e.reason}): {e}")
        taken.clear()

    def _take(self, frame: bytes, recv_unix: float) -> Optional[Tuple[ev.Batch, float]]:
        """Decode, count and store one frame: (its batch, recv_unix) for the timeline, None when it was
        a duplicate or rejected (counted, said)."""
        ticket = self.acks.admit(frame)  # from the envelope's first bytes: a replay costs no decode
        if ticket is DUPLICATE:
            return None  # an agent sent it again after a restart, and it is stored already (counted)
        with self._lock:
            batch, err = decode_frame(frame, self.counters)
        if batch is None:
            reason = err.reason if err is not None else "decoder-error"
            self._log_reject(reason, f"rejected a {len(frame)}-byte frame ({reason}): {err}")
            return None
        if self._store is not None:
            try:
                self._store.append(frame, recv_unix)
                self.acks.stored(ticket, self._store.records)
            except OSError as e:  # disk full, store removed: keep diagnosing live, say what is not stored
                self.store_errors += 1
                self._log_reject("store", f"cannot append to store {self.store_dir} "
                                          f"({self.store_errors} frames not stored): {e}")
        else:
            self.acks.stored(ticket, None)
        return batch, recv_unix

    # ---- detection ------------------------------------------------------------------------------

    def _tick_loop(self) -> None:
        while not self._stop.wait(self.tick_s):
            try:
                self.tick(time.time())
            except Exception:
                self.internal_errors += 1
                log.exception("collector detection error (%d so far); continuing", self.internal_errors)

    def _final_tick(self) -> None:
        """One last look after the final frames were ingested: a job that failed fast (a rank killed,
        the others erroring out, torchrun exiting) may end between two ticks. No stacks: the
        processes are going away."""
        try:
            self.tick(time.time(), stacks=False)
        except Exception:
            self.internal_errors += 1
            log.exception("collector final detection failed")

    def quiesce(self) -> None:
        """The job is about to be stopped on purpose (`ccld run` interrupted): from now on no detection
        runs, so ranks that our own SIGTERM catches between two collectives are not reported as a hang.
        Frames are still received and stored; the store remembers when (quiesced_at), so a replay stops
        its detectors there too."""
        self.quiesced = True
        if self._store is not None:
            self._store.meta.setdefault("quiesced_at", time.time())  # written to store.json at close

    def tick(self, now: float, stacks: bool = True) -> None:
        """Run the detectors at Unix time `now`; report what is new, what changed and what recovered."""
        if self.quiesced:
            return
        with self._lock:
            found = self.diagnoser.diagnose(now)
            changes = self.tracker.step(found, now)
            silent = {a for a in self.timeline.agents if self.timeline.agent_is_silent(a, now, AGENT_SILENT_S)}
            lagging = {a: self.timeline.agent_lag_s(a, now) for a in self.timeline.agents
                       if a not in silent and self.timeline.agent_is_lagging(a, now, AGENT_LAG_S)}
        if stacks:
            self.diagnoser.add_stacks(changes.new)  # py-spy, tens of ms per rank: not under the lock
        for a in sorted(silent - self._silent_agents):
            self._say(f"ccld: agent {a} has been silent for {AGENT_SILENT_S:.0f} s: hang detection for its "
                      "ranks is paused until it is back")
        for a in sorted(self._silent_agents - silent):
            self._say(f"ccld: agent {a} is back")
        self._silent_agents = silent
        for a in sorted(set(lagging) - self._lagging_agents):
            self._say(f"ccld: agent {a}'s ranks' records are {lagging[a]:.0f} s behind its heartbeats (its drains "
                      "stalled, or the node was frozen): hang detection for its ranks is paused until they come")
        for a in sorted(self._lagging_agents - set(lagging) - silent):
            self._say(f"ccld: agent {a} has caught up")
        self._lagging_agents = set(lagging)
        for f in changes.new:
            self._emit(format_line(f), f.json_line())
            with self._out_lock:
                if len(self.findings) < MAX_FINDINGS_KEPT:
                    self.findings.append(f)
                else:
                    self.findings_not_kept += 1
        for u in changes.updated:
            self._emit(format_line(u), json.dumps(u, default=str))
            self.updates += 1
        for r in changes.recovered:
            self._emit(format_line(r), json.dumps(r))
            with self._out_lock:
                if len(self.recoveries) < MAX_FINDINGS_KEPT:
                    self.recoveries.append(r)

    def _say(self, line: str) -> None:
        try:
            self.on_line(line)
        except Exception:
            self.internal_errors += 1
            log.exception("on_line callback failed")

    def _emit(self, line: str, json_line: str) -> None:
        with self._out_lock:
            if self._findings_file is not None:
                try:
                    self._findings_file.write(json_line + "\n")
                    self._findings_file.flush()
                except OSError as e:
                    self.internal_errors += 1
                    log.warning("cannot write findings to %s: %s", self.findings_path, e)
        try:
            self.on_line(line)
        except Exception:
            self.internal_errors += 1
            log.exception("on_line callback failed")

    # ---- state ----------------------------------------------------------------------------------

    @property
    def lock(self) -> threading.Lock:
        """Held while the timeline, counters and tracker change; readers (metrics, /snapshot) take it.
        Not reentrant: read `stats` before taking it."""
        return self._lock

    @property
    def out_lock(self) -> threading.Lock:
        """Held while `findings` and `recoveries` grow."""
        return self._out_lock

    @property
    def stats(self) -> Dict[str, Any]:
        with self._lock:
            d = self.counters.to_dict()
            d.update(self.timeline.counters())
        d.update(endpoint=self.endpoint, started_at=self._started_at, findings=len(self.findings),
                 recoveries=len(self.recoveries), updates=self.updates, active_findings=len(self.tracker.active),
                 findings_not_kept=self.findings_not_kept, internal_errors=self.internal_errors,
                 store_errors=self.store_errors, frames_dropped_at_stop=self.frames_dropped_at_stop,
                 store_records=self._store.records if self._store else None, **self.acks.counters(),
                 time_service=self.time_service.stats() if self.time_service else None)
        return d
