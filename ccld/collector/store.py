"""The append-only store: every good frame the collector received, raw, in the order received.

Layout of a store directory:
    store.json              {"format": "ccld-store", "version": 1, "created_at": ..., ...}
    segment-000001.ccld     records: [u32 big-endian frame length][f64 big-endian recv Unix s][frame]
    segment-000002.ccld     ... a new segment every SEGMENT_BYTES
    stats.json              counters the collector rewrites now and then (atomically)

Times: `recv_unix` is the collector's wall clock when the frame arrived (Unix seconds); event times
inside the frames stay in their nodes' monotonic clocks, as sent.
Caveat: data is flushed to the OS at least every FLUSH_INTERVAL_S and on close (fsync on close only),
so a collector crash loses at most that much; a power cut may lose more. A truncated last record
(crash mid-write) is reported by `read_store` and everything before it is kept.
"""
from __future__ import annotations

import json
import logging
import os
import re
import struct
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

from ccld.errors import CcldError

log = logging.getLogger("ccld.store")

STORE_FORMAT = "ccld-store"
STORE_VERSION = 1
STORE_FILE = "store.json"
STATS_FILE = "stats.json"
SEGMENT_BYTES = 64 * 1024 * 1024   # small enough to copy/attach to a ticket, large enough to be few
FLUSH_INTERVAL_S = 0.5             # bounds what a collector crash can lose to half a second
RECORD_HEADER = struct.Struct(">Id")  # frame length (u32), recv time (f64 Unix seconds)
MAX_RECORD_FRAME = 1 << 30         # sanity bound when reading: a length beyond it means corruption
_SEGMENT_RE = re.compile(r"^segment-(\d{6,})\.ccld$")


class StoreError(CcldError):
    """The store directory cannot be read or written (missing, wrong format, unknown version)."""


def segment_name(n: int) -> str:
    return f"segment-{n:06d}.ccld"


def list_segments(store_dir: str) -> List[Tuple[int, str]]:
    out = []
    for name in os.listdir(store_dir):
        m = _SEGMENT_RE.match(name)
        if m:
            out.append((int(m.group(1)), os.path.join(store_dir, name)))
    return sorted(out)


def _write_json_atomic(path: str, obj: Dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


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
    if version != STORE_VERSION:
        raise StoreError(f"{path}: store version {version!r} is not supported "
                         f"(this ccld reads version {STORE_VERSION}); use the ccld that wrote it")
    return meta


def read_stats(store_dir: str) -> Optional[Dict[str, Any]]:
    """The collector's last stats.json, or None when there is none (or it cannot be read)."""
    try:
        with open(os.path.join(store_dir, STATS_FILE)) as f:
            got = json.load(f)
        return got if isinstance(got, dict) else None
    except (OSError, ValueError):
        return None


class StoreWriter:
    """Appends records to a store directory; owned by one thread (the collector's ingest thread).

    Opening an existing store of the same version continues it in a new segment; nothing is
    overwritten. Opening a store of another version raises StoreError.
    """

    def __init__(self, store_dir: str, segment_bytes: int = SEGMENT_BYTES,
                 flush_interval_s: float = FLUSH_INTERVAL_S, clock=time.monotonic):
        self.dir = store_dir = os.path.abspath(store_dir)  # bcc chdir()s while compiling: never rely on cwd
        self.segment_bytes = segment_bytes
        self.flush_interval_s = flush_interval_s
        self._clock = clock
        os.makedirs(store_dir, exist_ok=True)
        if os.path.exists(os.path.join(store_dir, STORE_FILE)):
            self.meta = read_meta(store_dir)
            self.meta.pop("closed_at", None)
        else:
            self.meta = {"format": STORE_FORMAT, "version": STORE_VERSION, "created_at": time.time(),
                         "segment_bytes": segment_bytes,
                         "record": "u32be frame length, f64be recv unix seconds, frame (MessagePack)"}
        self.meta["opened_at"] = time.time()
        _write_json_atomic(os.path.join(store_dir, STORE_FILE), self.meta)
        existing = list_segments(store_dir)
        self._seg_no = existing[-1][0] if existing else 0
        self._file = None
        self._seg_size = 0
        self._last_flush = self._clock()
        self.records = 0
        self.bytes = 0
        self.segments_written = 0
        self.closed = False

    def _rotate(self) -> None:
        if self._file is not None:
            self._file.close()
        self._seg_no += 1
        path = os.path.join(self.dir, segment_name(self._seg_no))
        self._file = open(path, "xb")  # "x": never overwrite a segment
        self._seg_size = 0
        self.segments_written += 1

    def append(self, frame: bytes, recv_unix: float) -> None:
        if self.closed:
            raise StoreError(f"{self.dir}: store is closed")
        n = len(frame)
        if n > MAX_RECORD_FRAME:
            raise StoreError(f"{self.dir}: frame of {n} bytes is too large to store")
        rec = RECORD_HEADER.size + n
        if self._file is None or (self._seg_size > 0 and self._seg_size + rec > self.segment_bytes):
            self._rotate()
        self._file.write(RECORD_HEADER.pack(n, recv_unix))
        self._file.write(frame)
        self._seg_size += rec
        self.records += 1
        self.bytes += rec
        self.maybe_flush()

    def maybe_flush(self) -> None:
        """Flush if FLUSH_INTERVAL_S has passed; the owner calls this also when no frames arrive."""
        if self._clock() - self._last_flush >= self.flush_interval_s:
            self.flush()

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()
        self._last_flush = self._clock()

    def write_stats(self, stats: Dict[str, Any]) -> None:
        """Rewrite stats.json atomically (readers never see half a file)."""
        doc = {"format": "ccld-stats", "version": 1, "updated_at": time.time()}
        doc.update(stats)
        _write_json_atomic(os.path.join(self.dir, STATS_FILE), doc)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None
        # closed_at lets replay run the detectors up to the moment the collector stopped.
        self.meta["closed_at"] = time.time()
        _write_json_atomic(os.path.join(self.dir, STORE_FILE), self.meta)


def read_store(store_dir: str, problems: Optional[List[str]] = None) -> Iterator[Tuple[float, bytes]]:
    """Yield (recv_unix, frame) for every record, segment by segment, in the order written.

    store.json is checked at once (StoreError if missing or of an unknown version). Damage inside
    segments is not fatal: a truncated or corrupt record ends its segment, a warning naming the
    segment, the offset and how many records were recovered is logged and appended to `problems`,
    and reading goes on with the next segment.
    """
    read_meta(store_dir)
    return _records(store_dir, problems if problems is not None else [])


def _records(store_dir: str, problems: List[str]) -> Iterator[Tuple[float, bytes]]:
    segs = list_segments(store_dir)
    for i, (no, path) in enumerate(segs):
        if i > 0 and no != segs[i - 1][0] + 1:
            _problem(problems, f"{store_dir}: segments {segs[i - 1][0] + 1}..{no - 1} are missing")
        name = os.path.basename(path)
        count = 0
        with open(path, "rb") as f:
            data = f.read()
        off, end = 0, len(data)
        while off < end:
            if end - off < RECORD_HEADER.size:
                _problem(problems, f"{name}: truncated record header at offset {off} "
                                   f"({end - off} of {RECORD_HEADER.size} bytes); "
                                   f"recovered {count} records of this segment before it")
                break
            n, recv = RECORD_HEADER.unpack_from(data, off)
            if n > MAX_RECORD_FRAME or recv != recv:  # recv != recv: NaN, never written by us
                _problem(problems, f"{name}: corrupt record header at offset {off} (length {n}); "
                                   f"recovered {count} records of this segment before it")
                break
            body = off + RECORD_HEADER.size
            if body + n > end:
                _problem(problems, f"{name}: truncated record at offset {off} "
                                   f"({end - body} of {n} frame bytes); "
                                   f"recovered {count} records of this segment before it")
                break
            yield recv, bytes(data[body:body + n])
            count += 1
            off = body + n


def _problem(problems: List[str], msg: str) -> None:
    log.warning("%s", msg)
    problems.append(msg)
