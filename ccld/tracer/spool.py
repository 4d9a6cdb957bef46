"""The agent's spool: every frame the shipper makes waits here until the collector acknowledges it.

A bounded FIFO of encoded frames, on disk (a directory of segment files: spool_dir.py, records in
them: spool_records.py, held as segments: spool_segment.py) or, with no directory or after a disk
error, in memory (a smaller bound). The shipper's sender thread is its only user, never the probe
path: frames are appended in batch order, sent from a cursor, released once acknowledged (or once
sent, while the collector does not acknowledge), and the cursor goes back to the oldest
unacknowledged frame to replay them after a collector restart.
Bounds: max_bytes of segment files on disk (DEFAULT_MAX_BYTES), MEMORY_BYTES in memory. Overflow
evicts the oldest segment whole (1/SEGMENTS_PER_BOUND of the bound): its frames that were never sent
are lost and counted (dropped_frames, dropped_events); those sent but not yet acknowledged are
counted apart (unacked_evicted_frames: lost only if the collector lost them too).
Start: an existing spool is read back in order, damage said and counted (spool_records.py); frames
spooled for another collector (spool.json) are discarded, said and counted.
Caveat: a disk error (full, read-only, removed) switches to memory for the rest of the run, said once;
frames already on disk are still sent from there, and while they are the oldest, a frame that finds
memory full is dropped (evicting them would free no memory). A frame that cannot be read back from
its segment (truncated or removed under us) is dropped, counted once, and let go without waiting for
an ack.
"""
from __future__ import annotations

import errno
import logging
import os
from typing import Callable, Dict, List, Optional, Tuple

from ccld.tracer import spool_records as records
from ccld.tracer.spool_dir import META_FILE, SpoolDir
from ccld.tracer.spool_segment import Segment, Segments

log = logging.getLogger("ccld.spool")

DEFAULT_MAX_BYTES = 256 * 1024 * 1024  # ~4 min of a busy node (1 MB/s of frames), ~days of an idle one
MEMORY_BYTES = 32 * 1024 * 1024        # in memory: the size of the shipper's event queue (QUEUE_LIMIT)
SEGMENTS_PER_BOUND = 16                # overflow evicts one segment: 1/16 of the bound at a time
MAX_SEGMENT_BYTES = 16 * 1024 * 1024   # ... and never more than this at once
MIN_SEGMENT_BYTES = 4096
PROBLEMS_SAID = 8                      # damaged regions said one by one at start; the rest are counted
LOST_BATCH = 0                         # batches count from 1: 0 marks a frame that could not be read back


class Spool:
    def __init__(self, directory: Optional[str] = None, max_bytes: int = DEFAULT_MAX_BYTES,
                 collector: str = "", say: Optional[Callable[[str], None]] = None,
                 memory_bytes: int = MEMORY_BYTES):
        self.directory = os.path.abspath(directory) if directory else None
        self.max_bytes = max(1, int(max_bytes))
        self.memory_bytes = max(1, min(int(memory_bytes), self.max_bytes))
        self.collector = collector
        self.say = say or (lambda line: log.warning("%s", line))
        self.retain = False   # keep sent frames until acknowledged (the shipper turns it on at the first ack)
        self.on_disk = False
        self.head = 0         # global position of the oldest frame still held
        self.send = 0         # ... of the next frame to send
        self.end = 0          # ... after the newest
        self._high_sent = 0   # positions below it were sent before: sending them again is a replay
        self._segs = Segments(self._agent_index)  # the frames held, on disk or in memory
        self._agents: List[str] = []
        self._agent_no: Dict[str, int] = {}
        self._acked: Dict[int, int] = {}  # agent index -> every batch <= this is acknowledged
        self._dir: Optional[SpoolDir] = None
        # counters (cumulative)
        self.dropped_frames = 0           # never sent, evicted (overflow), unreadable, or left in memory at close
        self.dropped_events = 0
        self.unacked_evicted_frames = 0   # sent, not acknowledged yet, evicted
        self.replayed_frames = 0          # sent again (after a restart of the collector, or of this agent)
        self.replays = 0                  # times the cursor went back
        self.restored_frames = 0          # found in the directory at start
        self.discarded_frames = 0         # found at start, but spooled for another collector
        self.damaged_bytes = 0            # skipped at start: damaged records and torn tails
        self.damaged_regions = 0
        self.disk_errors = 0
        self.open_errors = 0              # a segment could not be opened to read back (no fd to spare): retried
        self._problems_said = 0

    @property
    def disk_bytes(self) -> int:
        return self._segs.disk_bytes

    @property
    def mem_bytes(self) -> int:
        return self._segs.mem_bytes

    # ---- open / close ------------------------------------------------------------------------------

    def open(self) -> "Spool":
        """Take the directory (lock, read back what is there) or stay in memory. Never raises."""
        if self.directory is not None:
            try:
                self._open_dir()
            except OSError as e:
                self._release_lock()
                self._to_memory(f"cannot use spool directory {self.directory}: {e.strerror or e}")
        return self

    def _open_dir(self) -> None:
        d = self._dir = self._segs.dir = SpoolDir(self.directory)
        d.take()
        meta = d.read_meta()
        found = d.segments()
        other = meta.get("collector")
        if found and other is not None and other != self.collector:
            n = sum(self._read_segment(no, path, keep=False) for no, path in found)
            for _, path in found:
                os.unlink(path)
            self.discarded_frames += n
            self.say(f"ccld: spool {d.path} held {n} frames for collector {other}, not {self.collector}: "
                     "discarded (counted as spool_discarded_frames)")
        else:
            for no, path in found:
                self._read_segment(no, path, keep=True)
            acked = meta.get("acked")
            for agent, upto in (acked.items() if isinstance(acked, dict) else ()):
                if agent in self._agent_no and type(upto) is int:
                    self._acked[self._agent_no[agent]] = upto  # acknowledged before a clean stop
            self._release()
            self.restored_frames = self.held()
        self._segs.next_no = found[-1][0] + 1 if found else 1
        self._high_sent = self.end  # restored frames may have been sent: sending them is a replay
        self._write_meta()
        self.on_disk = True
        if self.restored_frames:
            self.say(f"ccld: spool {d.path}: {self.restored_frames} frames from an earlier run, to be sent first")

    def _write_meta(self) -> None:
        """spool.json: whose frames these are, and (at a clean stop) what the collector acknowledged,
        so the next start does not send those again (after a killed agent, the collector drops them)."""
        acked = {self._agents[k]: v for k, v in self._acked.items() if self.held()}
        self._dir.write_meta(self.collector, acked)

    def _read_segment(self, no: int, path: str, keep: bool) -> int:
        """Index the good records of one segment file (keep: as a segment of this spool, not held open);
        returns how many. Damage is said (the first PROBLEMS_SAID) and counted, never fatal."""
        seg = self._segs.index_file(no, path, self.end, self._problem)
        if not keep or not len(seg):
            if keep:
                os.unlink(path)
            return len(seg)
        self._segs.adopt(seg)
        self.end += len(seg)
        return len(seg)

    def _problem(self, line: str, nbytes: int) -> None:
        self.damaged_regions += 1
        self.damaged_bytes += nbytes
        self._problems_said += 1
        if self._problems_said <= PROBLEMS_SAID:
            self.say(line)
        else:
            log.warning("%s", line)

    def close(self) -> None:
        """Close the files and the lock. What is on disk stays for the next start (removed when all of
        it was released); frames held only in memory and never sent are counted as dropped."""
        for seg in self._segs:
            if seg.data is not None and self._high_sent < seg.start + len(seg):
                a = max(0, self._high_sent - seg.start)
                self.dropped_frames += len(seg) - a
                self.dropped_events += sum(seg.events[a:])
        everything_released = self.head >= self.end
        if self.on_disk and self._dir is not None and self._dir.lock_fd is not None:
            try:
                self._write_meta()
            except OSError as e:
                log.warning("spool: cannot write %s: %s", META_FILE, e)
        self._segs.close_all(unlink=everything_released)
        self._release_lock()

    def _release_lock(self) -> None:
        if self._dir is not None:
            self._dir.release()

    # ---- the FIFO ----------------------------------------------------------------------------------

    def _agent_index(self, agent: str) -> int:
        k = self._agent_no.get(agent)
        if k is None:
            k = self._agent_no[agent] = len(self._agents)
            self._agents.append(agent)
        return k

    def append(self, agent: str, batch: int, events: int, frame: bytes) -> None:
        """Add one frame (never raises: a disk error moves the spool to memory; no room, the oldest go,
        or this one, when the oldest are on disk and memory is full)."""
        agent_b = records.agent_bytes(agent)
        disk = self.on_disk
        size = records.record_size(agent_b, frame) if disk else len(frame)
        limit = self.max_bytes if disk else self.memory_bytes
        if size > limit:
            self.dropped_frames += 1  # bigger than the whole spool: cannot be kept
            self.dropped_events += events
            return
        while (self._segs.disk_bytes if disk else self._segs.mem_bytes) + size > limit and self._segs:
            if not disk and self._segs[0].data is None:
                break  # the oldest are on disk (from before a disk error): evicting them frees no memory
            self._evict_oldest()
        if not disk and self._segs.mem_bytes + size > limit:
            self.dropped_frames += 1
            self.dropped_events += events
            return
        if disk:
            try:
                self._segs.add_disk(self.end, agent, agent_b, batch, events, frame,
                                    self._segment_bytes(self.max_bytes))
                self.end += 1
                return
            except OSError as e:
                self.disk_errors += 1
                self._to_memory(f"cannot write spool {self.directory}: {e.strerror or e}")
                self.append(agent, batch, events, frame)
                return
        self._segs.add_memory(self.end, agent, batch, events, frame, size, self._segment_bytes(limit))
        self.end += 1

    def _segment_bytes(self, limit: int) -> int:
        return max(MIN_SEGMENT_BYTES, min(MAX_SEGMENT_BYTES, limit // SEGMENTS_PER_BOUND))

    def _to_memory(self, why: str) -> None:
        if self._segs.cur is not None and self._segs.cur.data is None:
            self._segs.end_cur()
        self.on_disk = False
        self.say(f"ccld: warning: {why}; keeping unacknowledged frames in memory instead "
                 f"(up to {self.memory_bytes / 2**20:.0f} MiB)")

    def peek(self) -> Optional[Tuple[bytes, int]]:
        """(frame, events in it) at the send cursor, or None when everything was sent."""
        while self.send < self.end:
            seg, i = self._segs.locate(self.send)
            frame = self._segs.tail.get(self.send)
            if frame is None:
                if seg.data is not None:
                    frame = seg.data[i]
                elif seg.batches[i] == LOST_BATCH:
                    self.send += 1  # could not be read before: counted then
                    continue
                else:
                    try:
                        self._segs.reader(seg)
                    except OSError as e:
                        if e.errno != errno.ENOENT:  # no fd (or memory) to spare for now: lose nothing, retry
                            self.open_errors += 1
                            if self.open_errors == 1 or self.open_errors % 1000 == 0:
                                log.warning("spool: cannot open %s to read it back (%s); trying again "
                                            "(%d times so far)", seg.path, e, self.open_errors)
                            return None
                        log.warning("spool: %s was removed under the agent: its %d unsent frames are lost",
                                    seg.path, len(seg) - i)
                        for k in range(i, len(seg)):  # the whole file, once: not an open per frame
                            if seg.start + k not in self._segs.tail:
                                self._lose(seg, k)
                        continue
                    try:
                        frame = seg.read(i)
                    except OSError as e:  # the file was truncated under us: that frame is lost
                        log.warning("spool: cannot read back frame %d of %s: %s", i, seg.path, e)
                        self._lose(seg, i)
                        continue
            return frame, seg.events[i]
        return None

    def _lose(self, seg: Segment, i: int) -> None:
        """Frame i of `seg` cannot be read back: counted once, and let go like an acknowledged one (never
        sent, so never acknowledged); the cursor passes it by, uncounted, when it comes back (a replay)."""
        if seg.batches[i] == LOST_BATCH:
            return
        self.disk_errors += 1
        self.dropped_frames += 1
        self.dropped_events += seg.events[i]
        seg.batches[i] = LOST_BATCH

    def sent(self) -> bool:
        """The frame at the cursor went out; True when it had been sent before (a replay)."""
        replay = self.send < self._high_sent
        if replay:
            self.replayed_frames += 1
        self._segs.tail.pop(self.send)
        self.send += 1
        self._high_sent = max(self._high_sent, self.send)
        if not self.retain:
            self._release()
        return replay

    def set_retain(self, on: bool) -> None:
        """Keep sent frames until acknowledged (on), or let them go once sent (off: from now)."""
        self.retain = on
        if not on:
            self._release()

    def rewind(self) -> int:
        """Send again from the oldest frame not acknowledged; returns how many will be resent."""
        n = self.send - self.head
        if n > 0:
            self.replays += 1
            self.send = self.head
        return max(n, 0)

    def acked(self, agent: str) -> int:
        k = self._agent_no.get(agent)
        return self._acked.get(k, 0) if k is not None else 0

    def ack(self, agent: str, upto: int) -> None:
        """Every batch <= upto of `agent` is in the collector's store: release those frames."""
        k = self._agent_index(agent)
        if upto > self._acked.get(k, 0):
            self._acked[k] = upto
        self._release()

    def _release(self) -> None:
        while self._segs:
            seg = self._segs[0]
            i = self.head - seg.start
            if i >= len(seg):
                if seg is self._segs.cur:
                    break
                self._segs.close(self._segs.popleft(), unlink=True)
                continue
            sent_unretained = self.head < self.send and not self.retain
            if not sent_unretained and seg.batches[i] > self._acked.get(seg.agent_at(i), 0):
                break
            self.head += 1
            if seg.data is not None:
                self._segs.free(seg, i)
        self.send = max(self.send, self.head)

    def _evict_oldest(self) -> None:
        seg = self._segs.popleft()
        first, stop = max(self.head, seg.start), seg.start + len(seg)
        unsent = min(max(first, self._high_sent), stop)  # below it: sent at least once (maybe stored)
        self.unacked_evicted_frames += max(0, unsent - first)
        self.dropped_frames += stop - unsent
        self.dropped_events += sum(seg.events[unsent - seg.start:])
        self.head = stop
        self.send = max(self.send, stop)
        self._segs.tail.drop_below(stop)
        if seg is self._segs.cur:
            self._segs.cur = None
        self._segs.close(seg, unlink=True)

    # ---- what is held ------------------------------------------------------------------------------

    def floors(self) -> Dict[str, int]:
        """For each agent id with frames held: its lowest batch held (nothing below it will be sent)."""
        out: Dict[str, int] = {}
        for seg in self._segs:
            lo = max(0, self.head - seg.start)
            for k, start in enumerate(seg.run_starts):
                stop = seg.run_starts[k + 1] if k + 1 < len(seg.run_starts) else len(seg)
                if stop > lo:
                    out.setdefault(self._agents[seg.run_agents[k]], seg.batches[max(start, lo)])
        return out

    def unsent(self) -> int:
        return self.end - self.send

    def unacked(self) -> int:
        """Frames sent and held for an acknowledgement."""
        return self.send - self.head

    def held(self) -> int:
        return self.end - self.head

    def loss(self) -> Dict[str, int]:
        """What the spool lost, for the shipper's LossCounters (every value is a loss)."""
        return {"spool_dropped_frames": self.dropped_frames, "spool_dropped_events": self.dropped_events,
                "spool_unacked_evicted_frames": self.unacked_evicted_frames,
                "spool_damaged_bytes": self.damaged_bytes, "spool_discarded_frames": self.discarded_frames}

    def stats(self) -> Dict[str, int]:
        out = self.loss()
        out.update(spool_on_disk=int(self.on_disk), spool_bytes=self.disk_bytes + self.mem_bytes,
                   spool_frames=self.held(), spool_unsent_frames=self.unsent(),
                   spool_replayed_frames=self.replayed_frames, spool_replays=self.replays,
                   spool_restored_frames=self.restored_frames, spool_damaged_regions=self.damaged_regions,
                   spool_disk_errors=self.disk_errors)
        return out

    def describe(self) -> str:
        """One phrase for the agent's start line."""
        if self.on_disk:
            return f"spool {self.directory} ({self.max_bytes / 2**20:g} MiB)"
        return f"spool in memory ({self.memory_bytes / 2**20:g} MiB)"
