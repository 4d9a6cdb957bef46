"""The frames a spool holds, as segments: each segment's index (Segment: agent runs, batches, events,
where each frame's bytes lie) over a file of the spool's directory or a list in memory, and the
segments together (Segments): appending to the newest, finding a frame by its global position and
reading it back, dropping a segment whole, and the bytes they take. Spool (spool.py) decides what
comes in and what goes out, and counts what is lost; this keeps the frames.

Files: every start writes a new segment, so a crash loop leaves many: at most two segment files are
open at a time (the one being written, the one being read back), the others only by name. Frames
just written are kept in memory too (TailCache), to be sent without reading them back.
"""
from __future__ import annotations

import array
import bisect
import collections
import errno
import logging
import os
from typing import Callable, Deque, Iterator, List, Optional, Tuple

from ccld.tracer import spool_records as records
from ccld.tracer.spool_dir import SpoolDir

log = logging.getLogger("ccld.spool")

TAIL_CACHE_FRAMES = 256                # frames just written, kept to be sent without reading them back
TAIL_CACHE_BYTES = 8 * 1024 * 1024


class Segment:
    """One segment: frames at global positions [start, start + len). On disk (path, offsets of the frame
    bytes; fd only while it is written or read back) or in memory (data). Agents come in runs:
    run_starts[k] is the first local index of run k."""
    __slots__ = ("no", "path", "fd", "start", "offsets", "lengths", "batches", "events", "run_starts",
                 "run_agents", "data", "size")

    def __init__(self, no: int, start: int, path: Optional[str] = None, fd: Optional[int] = None):
        self.no, self.start, self.path, self.fd = no, start, path, fd
        self.offsets = array.array("Q")
        self.lengths = array.array("I")
        self.batches = array.array("Q")
        self.events = array.array("I")
        self.run_starts: List[int] = []
        self.run_agents: List[int] = []
        self.data: Optional[List[bytes]] = None if path else []
        self.size = 0  # bytes it takes: file bytes on disk, frame bytes in memory

    def __len__(self) -> int:
        return len(self.batches)

    def add(self, agent: int, batch: int, events: int, offset: int, length: int) -> None:
        if not self.run_agents or self.run_agents[-1] != agent:
            self.run_starts.append(len(self.batches))
            self.run_agents.append(agent)
        self.offsets.append(offset)
        self.lengths.append(length)
        self.batches.append(batch)
        self.events.append(events)

    def agent_at(self, i: int) -> int:
        return self.run_agents[bisect.bisect_right(self.run_starts, i) - 1]

    def read(self, i: int) -> bytes:
        """Frame i, read back from the file (its fd open). OSError when it cannot be read whole."""
        frame = os.pread(self.fd, self.lengths[i], self.offsets[i])
        if len(frame) != self.lengths[i]:
            raise OSError(errno.EIO, f"short read ({len(frame)} of {self.lengths[i]} bytes)")
        return frame


class TailCache:
    """The frames last written to disk, by global position: the newest TAIL_CACHE_FRAMES, at most
    TAIL_CACHE_BYTES of them."""

    def __init__(self):
        self._frames: "collections.OrderedDict[int, bytes]" = collections.OrderedDict()
        self._bytes = 0

    def __contains__(self, pos: int) -> bool:
        return pos in self._frames

    def get(self, pos: int) -> Optional[bytes]:
        return self._frames.get(pos)

    def add(self, pos: int, frame: bytes) -> None:
        self._frames[pos] = frame
        self._bytes += len(frame)
        while len(self._frames) > TAIL_CACHE_FRAMES or self._bytes > TAIL_CACHE_BYTES:
            self._bytes -= len(self._frames.popitem(last=False)[1])

    def pop(self, pos: int) -> None:
        frame = self._frames.pop(pos, None)
        if frame is not None:
            self._bytes -= len(frame)

    def drop_below(self, stop: int) -> None:
        for p in [p for p in self._frames if p < stop]:
            self._bytes -= len(self._frames.pop(p))

    def clear(self) -> None:
        self._frames.clear()
        self._bytes = 0


class Segments:
    """A spool's segments, oldest first. `agent_index` numbers agent ids (Spool's table of them);
    `dir` is where new disk segments go, while the spool is on disk."""

    def __init__(self, agent_index: Callable[[str], int]):
        self.agent_index = agent_index
        self.dir: Optional[SpoolDir] = None
        self.cur: Optional[Segment] = None  # the segment being appended to
        self.next_no = 1
        self.tail = TailCache()
        self.disk_bytes = 0
        self.mem_bytes = 0
        self._q: Deque[Segment] = collections.deque()
        self._reading: Optional[Segment] = None  # the disk segment, other than cur, open to be read back

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Segment]:
        return iter(self._q)

    def __getitem__(self, k: int) -> Segment:
        return self._q[k]

    def popleft(self) -> Segment:
        return self._q.popleft()

    def locate(self, pos: int) -> Tuple[Segment, int]:
        for seg in self._q:
            if pos < seg.start + len(seg):
                return seg, pos - seg.start
        raise IndexError(pos)

    # ---- in ----------------------------------------------------------------------------------------

    def index_file(self, no: int, path: str, start: int, problem: Callable[[str, int], None]) -> Segment:
        """The good records of a segment file found at start, as a segment from position `start` (not
        held open, not yet one of these); each damaged region goes to `problem`."""
        found, size = records.read_segment(path, problem)
        seg = Segment(no, start, path)
        for r in found:
            seg.add(self.agent_index(r.agent), r.batch, r.events, r.offset, r.length)
        seg.size = size
        return seg

    def adopt(self, seg: Segment) -> None:
        """A segment file read back at start (index_file) becomes the newest segment."""
        self.disk_bytes += seg.size
        self._q.append(seg)

    def add_memory(self, pos: int, agent: str, batch: int, events: int, frame: bytes, size: int,
                   segment_bytes: int) -> None:
        """Append the frame at position `pos` in memory (a new segment past segment_bytes)."""
        seg = self.cur
        if seg is None or seg.data is None or (len(seg) and seg.size + size > segment_bytes):
            seg = self.cur = Segment(0, pos)
            self._q.append(seg)
        seg.data.append(frame)
        seg.add(self.agent_index(agent), batch, events, 0, len(frame))
        seg.size += size
        self.mem_bytes += size

    def add_disk(self, pos: int, agent: str, agent_b: bytes, batch: int, events: int, frame: bytes,
                 segment_bytes: int) -> None:
        """Append the frame at position `pos` to the newest segment file (a new file past segment_bytes).
        OSError: it is not in the spool (a torn record ends its file: a restart skips it)."""
        size = records.record_size(agent_b, frame)
        seg = self.cur
        if seg is None or seg.data is not None or (seg.size and seg.size + size > segment_bytes):
            self.end_cur()
            path, fd = self.dir.create_segment(self.next_no)
            self.next_no += 1
            seg = self.cur = Segment(self.next_no - 1, pos, path, fd)
            self._q.append(seg)
        rec = records.encode(agent_b, batch, events, frame)
        done = 0
        try:
            while done < len(rec):
                k = os.write(seg.fd, rec[done:])
                if k <= 0:
                    raise OSError(errno.EIO, f"write returned {k}")
                done += k
        finally:
            seg.size += done
            self.disk_bytes += done
            if done < len(rec):
                self.end_cur()  # a torn record: nothing more goes into this file (a restart skips it)
        seg.add(self.agent_index(agent), batch, events, seg.size - len(frame), len(frame))
        self.tail.add(pos, frame)

    def end_cur(self) -> None:
        """Append no more to the current segment; on disk, let go of its fd (it is read back by name)."""
        seg, self.cur = self.cur, None
        if seg is not None and seg.data is None:
            self.close_fd(seg)

    # ---- out ---------------------------------------------------------------------------------------

    def reader(self, seg: Segment) -> int:
        """An fd to read `seg` back with: its own while it is written, else one opened for it, closing
        the last one opened (a replay reads segments in order: one open each)."""
        if seg.fd is None:
            if self._reading is not None:
                self.close_fd(self._reading)
            seg.fd = os.open(seg.path, os.O_RDONLY)
            self._reading = seg
        return seg.fd

    def free(self, seg: Segment, i: int) -> None:
        """Frame i of a memory segment is released: its bytes go."""
        self.mem_bytes -= len(seg.data[i])
        seg.size -= len(seg.data[i])
        seg.data[i] = b""

    def close(self, seg: Segment, unlink: bool) -> None:
        if seg.data is not None:
            self.mem_bytes -= seg.size
            seg.data = []
            return
        self.disk_bytes -= seg.size
        self.close_fd(seg)
        if unlink:
            try:
                os.unlink(seg.path)
            except OSError as e:
                log.warning("spool: cannot remove %s: %s", seg.path, e)

    def close_all(self, unlink: bool) -> None:
        for seg in list(self._q):
            self.close(seg, unlink=unlink)
        self._q.clear()
        self.cur = None
        self.tail.clear()

    def close_fd(self, seg: Segment) -> None:
        """Let go of a disk segment's fd (appending or reading); it stays held, by name."""
        if seg is self._reading:
            self._reading = None
        if seg.fd is not None:
            os.close(seg.fd)
            seg.fd = None
