"""Writing a store: StoreWriter appends the frames the collector receives, one writer per store.

Durability: appended records wait in memory and go to the OS in one write() at least every
FLUSH_INTERVAL_S, when WRITE_CHUNK_BYTES are pending, and on close; a flush then fsync()s (unless
fsync=False). `durable_records` counts what is fsynced (survives a power cut), `flushed_records`
what the OS has (survives a killed collector); stats.json carries both: that is what is acknowledged.
A collector killed between flushes loses what it received since the last one, at record boundaries;
`read_store` (reader.py) reports that unclean end (the lock is free but store.json has no closed_at;
the next writer records it in store.json), so the loss is never silent. One writer per store
(writer.lock, flock()ed: the kernel frees it however the writer dies). The layout: layout.py.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import time
import zlib
from typing import Any, Dict, Optional

from ccld.store.layout import (CRC_HEAD, LOCK_FILE, MAX_RECORD_FRAME, RECORD_HEADER, RECORD_MAGIC, STATS_FILE,
                               STORE_FILE, STORE_FORMAT, STORE_VERSION, StoreError, fsync_dir, list_segments,
                               read_meta, segment_name, write_json_atomic)

log = logging.getLogger("ccld.store")

SEGMENT_BYTES = 64 * 1024 * 1024   # small enough to copy/attach to a ticket, large enough to be few
FLUSH_INTERVAL_S = 0.5             # bounds what a collector crash can lose to half a second
FSYNC_ON_FLUSH = True              # 1-10 ms per flush at 1-10 MB/s (bench/RESULTS.md): worth it
WRITE_CHUNK_BYTES = 1 << 20        # pending bytes that force a write() between flushes: bounds memory


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
            write_json_atomic(os.path.join(store_dir, STORE_FILE), self.meta, durable=fsync)
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
            fsync_dir(self.dir)
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
        head = CRC_HEAD.pack(RECORD_MAGIC, n, recv_unix)
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
        write_json_atomic(os.path.join(self.dir, STATS_FILE), doc)

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
            write_json_atomic(os.path.join(self.dir, STORE_FILE), self.meta, durable=True)
        finally:
            self._unlock()
