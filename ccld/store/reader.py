"""Reading a store back: read_store yields every good record, in the order written, and reports
every damage and loss it finds instead of failing.

Damage: `read_store` checks every record. A bad one starts a damaged region that ends at the next
record that checks out (scan for the marker, then verify length and checksum): the region is
reported with segment, offset and length and skipped; the records on both sides are kept. A region
that runs to the end of its segment is a torn tail (a crash mid-write). A writer killed between
flushes (writer.py) is reported as an unclean end: the lock is free but store.json has no closed_at.
Caveats: a damaged frame is lost whole; a frame that itself contains a whole valid record would be
read as one if its own header were damaged (agents' MessagePack frames never do); the reader holds
one segment in memory. The layout: layout.py.
"""
from __future__ import annotations

import fcntl
import logging
import os
import time
import zlib
from typing import Any, Dict, Iterator, List, Optional, Tuple

from ccld.store.layout import (CRC_HEAD, LOCK_FILE, MAX_RECORD_FRAME, RECORD_HEADER, RECORD_MAGIC,
                               V1_RECORD_HEADER, list_segments, read_meta, segment_name)

log = logging.getLogger("ccld.store")


class StoreProblem(str):
    """One damage or loss found while reading: a readable line (it is a str, so reports and JSON keep
    working) with the facts as attributes. kind: "damaged" (skipped region inside a segment),
    "torn-tail" (skipped region at a segment's end), "missing-segments", "unreadable", "unclean-end"."""

    def __new__(cls, msg: str, kind: str, segment: Optional[str] = None,
                offset: Optional[int] = None, length: Optional[int] = None) -> "StoreProblem":
        self = super().__new__(cls, msg)
        self.kind, self.segment, self.offset, self.length = kind, segment, offset, length
        return self


def _writer_alive(store_dir: str) -> Optional[bool]:
    """True while a process holds writer.lock (a live collector), False when none does, None when
    there is no writer.lock (the store was never written by this ccld version, or was copied without it)."""
    try:
        fd = os.open(os.path.join(store_dir, LOCK_FILE), os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)  # drops our shared lock too


def read_store(store_dir: str, problems: Optional[List[str]] = None) -> Iterator[Tuple[float, bytes]]:
    """Yield (recv_unix, frame) for every good record, segment by segment, in the order written.

    store.json is checked at once (StoreError if missing or of an unknown version). Damage inside
    segments is never fatal: each damaged region is skipped and reported (a StoreProblem naming the
    segment, the offset and the bytes skipped is logged and appended to `problems`), and reading
    resumes at the next good record (version 2) or the next segment (version 1: no marker to find).
    A writer that ended without closing the store (killed) is reported too: what it had not
    flushed is lost.
    """
    meta = read_meta(store_dir)
    return _records(store_dir, meta, problems if problems is not None else [])


def _records(store_dir: str, meta: Dict[str, Any], problems: List[str]) -> Iterator[Tuple[float, bytes]]:
    segs = list_segments(store_dir)
    ends = [e for e in meta.get("unclean_ends") or [] if isinstance(e, dict)]
    if "closed_at" not in meta and meta["version"] >= 2 and _writer_alive(store_dir) is False:
        ends.append({"opened_at": meta.get("opened_at"), "last_segment": segs[-1][0] if segs else 0,
                     "flush_interval_s": meta.get("flush_interval_s"), "now": True})
    read_segment = _segment_v2 if meta["version"] >= 2 else _segment_v1
    for i, (no, path) in enumerate(segs):
        if i > 0 and no != segs[i - 1][0] + 1:
            _problem(problems, StoreProblem(
                f"{store_dir}: segments {segs[i - 1][0] + 1}..{no - 1} are missing", "missing-segments"))
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:  # an unreadable segment (EIO, permissions) costs that segment, not the store
            _problem(problems, StoreProblem(f"{os.path.basename(path)}: cannot be read, skipped: {e}",
                                            "unreadable", os.path.basename(path)))
            continue
        yield from read_segment(os.path.basename(path), data, problems)
        for e in [e for e in ends if e.get("last_segment") == no]:
            ends.remove(e)
            _problem(problems, _unclean_end(segment_name(no), e))
    for e in ends:  # the killed writer's last segment is gone (or it wrote none)
        _problem(problems, _unclean_end(store_dir, e))


def _unclean_end(where: str, e: Dict[str, Any]) -> StoreProblem:
    at = e.get("opened_at")
    opened = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at)) if isinstance(at, (int, float)) else "?"
    interval = e.get("flush_interval_s")
    bound = f"up to {interval} s of" if isinstance(interval, (int, float)) else "its last"
    return StoreProblem(f"{where}: collector killed or crashed (opened {opened}, store never closed); "
                        f"{bound} unflushed frames lost", "unclean-end",
                        segment=where if where.endswith(".ccld") else None)


def _check_v2(data: bytes, off: int, end: int) -> Tuple[Optional[str], int, float]:
    """(None, frame length, recv) when a good record starts at `off`, else (why not, length, recv)."""
    if end - off < RECORD_HEADER.size:
        return "short", 0, 0.0
    magic, n, recv, crc = RECORD_HEADER.unpack_from(data, off)
    if magic != RECORD_MAGIC:
        return "no record marker", n, recv
    if n > MAX_RECORD_FRAME:
        return f"impossible length {n}", n, recv
    body = off + RECORD_HEADER.size
    if body + n > end:
        return f"length {n} runs past the segment end", n, recv
    mv = memoryview(data)
    if zlib.crc32(mv[body:body + n], zlib.crc32(mv[off:off + CRC_HEAD.size])) != crc:
        return "checksum mismatch", n, recv
    return None, n, recv


def _resync(data: bytes, start: int, end: int) -> Optional[int]:
    """Offset of the next good record at or after `start`, or None. Only offsets holding the marker
    are verified, so this costs a memchr-speed scan plus one crc per false marker."""
    pos = data.find(RECORD_MAGIC, start)
    while pos != -1:
        if _check_v2(data, pos, end)[0] is None:
            return pos
        pos = data.find(RECORD_MAGIC, pos + 1)
    return None


def _segment_v2(name: str, data: bytes, problems: List[str]) -> Iterator[Tuple[float, bytes]]:
    off, end, count = 0, len(data), 0
    while off < end:
        why, n, recv = _check_v2(data, off, end)
        if why is None:
            body = off + RECORD_HEADER.size
            yield recv, bytes(data[body:body + n])
            count += 1
            off = body + n
            continue
        nxt = _resync(data, off + 1, end)
        if nxt is None:
            if why == "short":
                what = f"truncated record header at offset {off} ({end - off} of {RECORD_HEADER.size} bytes)"
            elif why.startswith("length"):
                what = (f"truncated record at offset {off} "
                        f"({end - off - RECORD_HEADER.size} of {n} frame bytes)")
            else:
                what = f"damaged tail at offset {off} ({end - off} bytes, {why})"
            _problem(problems, StoreProblem(f"{name}: {what}; recovered {count} records of this segment before it",
                                            "torn-tail", name, off, end - off))
            return
        _problem(problems, StoreProblem(
            f"{name}: damaged record at offset {off} ({why}); skipped {nxt - off} bytes, resumed at the "
            f"good record at offset {nxt}", "damaged", name, off, nxt - off))
        off = nxt


def _segment_v1(name: str, data: bytes, problems: List[str]) -> Iterator[Tuple[float, bytes]]:
    """Version 1 records have no marker: damage ends the segment (everything before it is kept)."""
    hs = V1_RECORD_HEADER.size
    off, end, count = 0, len(data), 0
    while off < end:
        what = None
        if end - off < hs:
            what = f"truncated record header at offset {off} ({end - off} of {hs} bytes)"
        else:
            n, recv = V1_RECORD_HEADER.unpack_from(data, off)
            if n > MAX_RECORD_FRAME or recv != recv:  # recv != recv: NaN, never written by us
                what = f"corrupt record header at offset {off} (length {n})"
            elif off + hs + n > end:
                what = f"truncated record at offset {off} ({end - off - hs} of {n} frame bytes)"
        if what is not None:
            _problem(problems, StoreProblem(
                f"{name}: {what}; recovered {count} records of this segment before it "
                "(version 1 store: the rest of the segment is skipped)", "torn-tail", name, off, end - off))
            return
        yield recv, bytes(data[off + hs:off + hs + n])
        count += 1
        off += hs + n


def _problem(problems: List[str], p: StoreProblem) -> None:
    log.warning("%s", p)
    problems.append(p)
