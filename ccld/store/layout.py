"""The store's on-disk layout: its files, its records, and reading and checking its metadata.

Layout of a store directory:
    store.json              {"format": "ccld-store", "version": 2, "created_at": ..., ...}
    segment-000001.ccld     records back to back (below); a new segment every SEGMENT_BYTES (writer.py)
    stats.json              counters the collector rewrites now and then (atomically)
    writer.lock             flock()ed by the one writer while it runs (its pid inside)

A version 2 record: a 20-byte header, then the frame (MessagePack, as received). Big-endian:
    magic  4 bytes  RECORD_MAGIC c1 cc 1d 02: the resync marker (0xc1 is never a MessagePack type byte)
    length u32      frame bytes
    recv   f64      the collector's wall clock when the frame arrived, Unix seconds
    crc    u32      zlib.crc32 over magic, length, recv and the frame
Version 1 records ([u32 length][f64 recv][frame], no marker, no checksum) are still read, not written.
Times: `recv` is the collector's wall clock; event times inside frames stay in their nodes' clocks.
"""
from __future__ import annotations

import json
import os
import re
import struct
from typing import Any, Dict, List, Optional, Tuple

from ccld.errors import CcldError

STORE_FORMAT = "ccld-store"
STORE_VERSION = 2                  # what this ccld writes
READ_VERSIONS = (1, 2)             # what it reads
STORE_FILE = "store.json"
STATS_FILE = "stats.json"
LOCK_FILE = "writer.lock"
RECORD_MAGIC = b"\xc1\xcc\x1d\x02"
RECORD_HEADER = struct.Struct(">4sIdI")  # magic, frame length, recv Unix s, crc32
CRC_HEAD = struct.Struct(">4sId")  # the header bytes under the crc: magic, length, recv
V1_RECORD_HEADER = struct.Struct(">Id")  # frame length, recv time (version 1: no marker, no crc)
MAX_RECORD_FRAME = 1 << 30         # sanity bound when reading: a length beyond it means corruption
_SEGMENT_RE = re.compile(r"^segment-(\d{6,})\.ccld$")


class StoreError(CcldError):
    """The store directory cannot be read or written (missing, wrong format, unknown version, busy)."""


def segment_name(n: int) -> str:
    return f"segment-{n:06d}.ccld"


def list_segments(store_dir: str) -> List[Tuple[int, str]]:
    out = []
    for name in os.listdir(store_dir):
        m = _SEGMENT_RE.match(name)
        if m:
            out.append((int(m.group(1)), os.path.join(store_dir, name)))
    return sorted(out)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)  # makes a new or renamed entry in it survive a power cut
    finally:
        os.close(fd)


def write_json_atomic(path: str, obj: Dict[str, Any], durable: bool = False) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        fsync_dir(os.path.dirname(path))


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

