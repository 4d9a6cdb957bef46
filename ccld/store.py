"""The append-only store: every good frame the collector received, raw, in the order received.

Layout of a store directory:
    store.json              {"format": "ccld-store", "version": 2, "created_at": ..., ...}
    segment-000001.ccld     records back to back (below); a new segment every SEGMENT_BYTES
    stats.json              counters the collector rewrites now and then (atomically)
    writer.lock             flock()ed by the one writer while it runs (its pid inside)

A version 2 record: a 20-byte header, then the frame (MessagePack, as received). Big-endian:
    magic  4 bytes  RECORD_MAGIC c1 cc 1d 02: the resync marker (0xc1 is never a MessagePack type byte)
    length u32      frame bytes
    recv   f64      the collector's wall clock when the frame arrived, Unix seconds
    crc    u32      zlib.crc32 over magic, length, recv and the frame
Version 1 records ([u32 length][f64 recv][frame], no marker, no checksum) are still read, not written.

Times: `recv` is the collector's wall clock; event times inside frames stay in their nodes' clocks.
Durability: appended records wait in memory and go to the OS in one write() at least every
FLUSH_INTERVAL_S, when WRITE_CHUNK_BYTES are pending, and on close; a flush then fsync()s (unless
fsync=False). `durable_records` counts what is fsynced (survives a power cut), `flushed_records`
what the OS has (survives a killed collector); stats.json carries both: that is what is acknowledged.
A collector killed between flushes loses what it received since the last one, at record boundaries;
`read_store` reports that unclean end (the lock is free but store.json has no closed_at; the next
writer records it in store.json), so the loss is never silent. One writer per store (writer.lock).
Damage: `read_store` checks every record. A bad one starts a damaged region that ends at the next
record that checks out (scan for the marker, then verify length and checksum): the region is
reported with segment, offset and length and skipped; the records on both sides are kept. A region
that runs to the end of its segment is a torn tail (a crash mid-write). Caveats: a damaged frame is
lost whole; a frame that itself contains a whole valid record would be read as one if its own header
were damaged (agents' MessagePack frames never do); the reader holds one segment in memory.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import struct
import time
import zlib
from typing import Any, Dict, Iterator, List, Optional, Tuple

from ccld.errors import CcldError

log = logging.getLogger("ccld.store")

STORE_FORMAT = "ccld-store"
STORE_VERSION = 2                  # what this ccld writes
READ_VERSIONS = (1, 2)             # what it reads
STORE_FILE = "store.json"
STATS_FILE = "stats.json"
LOCK_FILE = "writer.lock"
SEGMENT_BYTES = 64 * 1024 * 1024   # small enough to copy/attach to a ticket, large enough to be few
FLUSH_INTERVAL_S = 0.5             # bounds what a collector crash can lose to half a second
FSYNC_ON_FLUSH = True              # 1-10 ms per flush at 1-10 MB/s (bench/RESULTS.md): worth it
WRITE_CHUNK_BYTES = 1 << 20        # pending bytes that force a write() between flushes: bounds memory
RECORD_MAGIC = b"\xc1\xcc\x1d\x02"
RECORD_HEADER = struct.Struct(">4sIdI")  # magic, frame length, recv Unix s, crc32
_HEAD = struct.Struct(">4sId")     # the header bytes under the crc: magic, length, recv
V1_RECORD_HEADER = struct.Struct(">Id")  # frame length, recv time (version 1: no marker, no crc)
MAX_RECORD_FRAME = 1 << 30         # sanity bound when reading: a length beyond it means corruption
_SEGMENT_RE = re.compile(r"^segment-(\d{6,})\.ccld$")


class StoreError(CcldError):
    """The store directory cannot be read or written (missing, wrong format, unknown version, busy)."""


class StoreProblem(str):
    """One damage or loss found while reading: a readable line (it is a str, so reports and JSON keep
    working) with the facts as attributes. kind: "damaged" (skipped region inside a segment),
    "torn-tail" (skipped region at a segment's end), "missing-segments", "unreadable", "unclean-end"."""

    def __new__(cls, msg: str, kind: str, segment: Optional[str] = None,
                offset: Optional[int] = None, length: Optional[int] = None) -> "StoreProblem":
        self = super().__new__(cls, msg)
        self.kind, self.segment, self.offset, self.length = kind, segment, offset, length
        return self


def segment_name(n: int) -> str:
    return f"segment-{n:06d}.ccld"


def list_segments(store_dir: str) -> List[Tuple[int, str]]:
    out = []
    for name in os.listdir(store_dir):
        m = _SEGMENT_RE.match(name)
        if m:
            out.append((int(m.group(1)), os.path.join(store_dir, name)))
    return sorted(out)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)  # makes a new or renamed entry in it survive a power cut
    finally:
        os.close(fd)


def _write_json_atomic(path: str, obj: Dict[str, Any], durable: bool = False) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        _fsync_dir(os.path.dirname(path))


def read_meta(store_dir: str) -> Dict[str, Any]:
    """Read and check store.json. Raises StoreError naming the file and what is wrong with it."""
    path = os.path.join(store_dir, STORE_FILE)
    if not os.path.isdir(store_dir):
        raise StoreError(f"{store_dir}: no such store directory")
    try:
        with open(path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise StoreError(f"{path}: missing; {store_dir} is not a ccld store "
                         f"(a store has {STORE_FILE} and segment-NNNNNN.ccld files)") from None
    except (OSError, ValueError) as e:
        raise StoreError(f"{path}: cannot be read as JSON: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != STORE_FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise StoreError(f"{path}: format is {got!r}, not {STORE_FORMAT!r}")
    version = meta.get("version")
    if version not in READ_VERSIONS or isinstance(version, bool):
        raise StoreError(f"{path}: store version {version!r} is not supported (this ccld reads "
                         f"version {' and '.join(map(str, READ_VERSIONS))}); use the ccld that wrote it")
    return meta


def read_stats(store_dir: str) -> Optional[Dict[str, Any]]:
    """The collector's last stats.json, or None when there is none (or it cannot be read)."""
    try:
        with open(os.path.join(store_dir, STATS_FILE)) as f:
            got = json.load(f)
        return got if isinstance(got, dict) else None
    except (OSError, ValueError):
        return None


def _lock_for_writing(store_dir: str) -> int:
    """flock writer.lock (released by the kernel however the writer dies); StoreError if held."""
    path = os.path.join(store_dir, LOCK_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise StoreError(f"{store_dir}: another collector (pid {holder}) is writing this store; "
                         "give each collector its own --store directory") from None
    except OSError:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


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


class StoreWriter:
    """Appends records to a store directory; owned by one thread (the collector's ingest thread).

    Opening an existing version 2 store continues it in a new segment; nothing is overwritten. A
    store of another version, or one another process is writing, raises StoreError. A store whose
    previous writer never closed it (killed) gets an `unclean_ends` entry in store.json.
    """

    def __init__(self, store_dir: str, segment_bytes: int = SEGMENT_BYTES,
                 flush_interval_s: float = FLUSH_INTERVAL_S, fsync: bool = FSYNC_ON_FLUSH,
                 clock=time.monotonic):
        self.dir = store_dir = os.path.abspath(store_dir)  # bcc chdir()s while compiling: never rely on cwd
        self.segment_bytes = segment_bytes
        self.flush_interval_s = flush_interval_s
        self.fsync = fsync
        self._clock = clock
        os.makedirs(store_dir, exist_ok=True)
        self._lock_fd: Optional[int] = _lock_for_writing(store_dir)
        try:
            existing = list_segments(store_dir)
            self._seg_no = existing[-1][0] if existing else 0
            self.meta = self._open_meta()
            _write_json_atomic(os.path.join(store_dir, STORE_FILE), self.meta, durable=fsync)
        except BaseException:
            self._unlock()
            raise
        self._fd: Optional[int] = None
        self._seg_size = 0
        self._buf = bytearray()   # records not yet handed to the OS
        self._buf_records = 0
        self._last_flush = self._clock()
        self.records = 0          # appended by this writer
        self.flushed_records = 0  # handed to the OS: survive a killed collector
        self.durable_records = 0  # fsynced: survive a power cut
        self.bytes = 0
        self.segments_written = 0
        self.fsyncs = 0
        self.fsync_max_s = 0.0    # the longest the owner's thread stalled in fsync()
        self.fsync_total_s = 0.0
        self.flush_errors = 0     # flushes that failed inside append() (the frame stayed buffered)
        self.closed = False

    def _open_meta(self) -> Dict[str, Any]:
        path = os.path.join(self.dir, STORE_FILE)
        now = time.time()
        if not os.path.exists(path):
            return {"format": STORE_FORMAT, "version": STORE_VERSION, "created_at": now, "opened_at": now,
                    "segment_bytes": self.segment_bytes, "flush_interval_s": self.flush_interval_s,
                    "fsync": self.fsync,
                    "record": "magic c1cc1d02, u32be frame length, f64be recv unix seconds, "
                              "u32be crc32(magic..recv + frame), frame (MessagePack)"}
        meta = read_meta(self.dir)
        if meta["version"] != STORE_VERSION:
            raise StoreError(f"{path}: store version {meta['version']} was written by an older ccld; this "
                             f"ccld appends only to version {STORE_VERSION} stores: give the collector a new "
                             "--store directory (`ccld diagnose` still reads this one)")
        if "closed_at" not in meta:  # we hold the lock, so its writer is gone: it was killed
            meta.setdefault("unclean_ends", []).append(
                {"opened_at": meta.get("opened_at"), "last_segment": self._seg_no, "found_at": now,
                 "flush_interval_s": meta.get("flush_interval_s")})
        meta.pop("closed_at", None)
        meta.update(opened_at=now, flush_interval_s=self.flush_interval_s, fsync=self.fsync)
        return meta

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _rotate(self) -> None:
        if self._fd is not None:
            self._write_out()
            if self.fsync:
                self._sync()
            os.close(self._fd)
            self._fd = None
        path = os.path.join(self.dir, segment_name(self._seg_no + 1))
        # O_EXCL: never overwrite a segment
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        self._seg_no += 1  # only now: a failed open is retried under the same number, leaving no gap
        if self.fsync:
            _fsync_dir(self.dir)
        self._seg_size = 0
        self.segments_written += 1

    def append(self, frame: bytes, recv_unix: float) -> None:
        """Add one record. OSError (disk full, store removed) means this frame was not stored."""
        if self.closed:
            raise StoreError(f"{self.dir}: store is closed")
        n = len(frame)
        if n > MAX_RECORD_FRAME:
            raise StoreError(f"{self.dir}: frame of {n} bytes is too large to store")
        rec = RECORD_HEADER.size + n
        if self._fd is None or (self._seg_size > 0 and self._seg_size + rec > self.segment_bytes):
            self._rotate()
        elif self._buf and len(self._buf) + rec > WRITE_CHUNK_BYTES:
            self._write_out()  # before taking the frame: if this fails, the frame is not in the store
        head = _HEAD.pack(RECORD_MAGIC, n, recv_unix)
        crc = zlib.crc32(frame, zlib.crc32(head))
        self._buf += head
        self._buf += crc.to_bytes(4, "big")
        self._buf += frame
        self._buf_records += 1
        self._seg_size += rec
        self.records += 1
        self.bytes += rec
        try:
            self.maybe_flush()
        except OSError as e:  # the frame is buffered; the owner's next maybe_flush() retries and raises
            self.flush_errors += 1
            log.debug("store flush failed, will retry: %s", e)

    def _write_out(self) -> None:
        """Hand the pending records to the OS; on error keep what was not written, for the next try."""
        done = 0
        try:
            while done < len(self._buf):
                with memoryview(self._buf) as mv, mv[done:] as chunk:  # released here: the buffer can shrink
                    k = os.write(self._fd, chunk)
                if k <= 0:
                    raise OSError(errno.EIO, f"write to {segment_name(self._seg_no)} returned {k}")
                done += k
        finally:
            del self._buf[:done]  # a short write is completed by the next one: the bytes stay contiguous
        self.flushed_records += self._buf_records
        self._buf_records = 0

    def _sync(self) -> None:
        t = time.monotonic()
        os.fsync(self._fd)
        dt = time.monotonic() - t
        self.fsyncs += 1
        self.fsync_max_s = max(self.fsync_max_s, dt)
        self.fsync_total_s += dt
        self.durable_records = self.flushed_records

    def maybe_flush(self) -> None:
        """Flush if FLUSH_INTERVAL_S has passed; the owner calls this also when no frames arrive."""
        if self._clock() - self._last_flush >= self.flush_interval_s:
            self.flush()

    def flush(self) -> None:
        """Write pending records to the OS and, with fsync on, to disk. Raises OSError on failure."""
        self._last_flush = self._clock()  # also after a failure: retry next interval, not in a tight loop
        if self._fd is None:
            return
        self._write_out()
        if self.fsync and self.durable_records < self.flushed_records:
            self._sync()

    def counters(self) -> Dict[str, Any]:
        """What stats.json says about the store: records appended, in the OS, on disk (acknowledged)."""
        return {"store_records": self.records, "store_flushed_records": self.flushed_records,
                "store_durable_records": self.durable_records, "store_fsync": self.fsync,
                "store_fsyncs": self.fsyncs, "store_fsync_max_ms": round(self.fsync_max_s * 1000, 3),
                "store_fsync_total_ms": round(self.fsync_total_s * 1000, 3),
                "store_flush_errors": self.flush_errors, "store_segments_written": self.segments_written}

    def write_stats(self, stats: Dict[str, Any]) -> None:
        """Flush, then rewrite stats.json atomically (readers never see half a file); the store's own
        counters are added, so stats.json acknowledges what is on disk as of now."""
        if not self.closed:
            try:
                self.flush()
            except OSError as e:
                self.flush_errors += 1
                log.warning("cannot flush store %s: %s", self.dir, e)
        doc = {"format": "ccld-stats", "version": 1, "updated_at": time.time()}
        doc.update(stats)
        doc.update(self.counters())
        _write_json_atomic(os.path.join(self.dir, STATS_FILE), doc)

    def close(self, closed_at: Optional[float] = None) -> None:
        """Flush, fsync and record closed_at: now, or the end of what the frames describe when they are
        made offline (a per-op table's last time: diagnose/optable.py)."""
        if self.closed:
            return
        self.closed = True
        try:
            if self._fd is not None:
                try:
                    self._write_out()
                    self._sync()  # on close even with fsync off: a stopped collector leaves it all on disk
                finally:
                    os.close(self._fd)
                    self._fd = None
            # closed_at lets replay run the detectors up to the moment the collector stopped.
            self.meta["closed_at"] = time.time() if closed_at is None else closed_at
            _write_json_atomic(os.path.join(self.dir, STORE_FILE), self.meta, durable=True)
        finally:
            self._unlock()


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
    if zlib.crc32(mv[body:body + n], zlib.crc32(mv[off:off + _HEAD.size])) != crc:
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
