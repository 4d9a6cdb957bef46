"""The spool's on-disk record format: one frame per record, records back to back in a segment file.

A record, big-endian: magic c1 cc 5b 01, u32 crc32 of everything after this field, u32 frame length,
u64 batch, u32 events in the frame, u16 agent id length, the agent id (UTF-8), then the frame exactly
as sent (events.encode_batch). Records are written, not fsynced: the spool survives a killed agent
(the page cache has it), not a power cut.
Reading a segment back: a damaged record is reported with its segment and offset and skipped (reading
resumes at the next record that checks out), a torn tail likewise; never fatal.
"""
from __future__ import annotations

import os
import struct
import zlib
from typing import Callable, List, NamedTuple, Optional, Tuple, Union

# The collector acknowledges agent ids of up to 256 characters (protocol.ACK_MAX_AGENT_ID): up to 4 bytes each in
# UTF-8. A longer id is cut at a character (it gets no acknowledgement anyway): cut inside one, its records
# would read back as damage.
MAX_AGENT_ID_BYTES = 1024
MAX_RECORD_FRAME = 64 * 1024 * 1024    # sanity bound when reading back: a larger length is damage
MAGIC = b"\xc1\xcc\x5b\x01"            # 0xc1 is never a MessagePack type byte, as in the store
HEAD = struct.Struct(">4sIIQIH")       # magic, crc, frame length, batch, events, agent id length


class Record(NamedTuple):
    """A good record read back: whose frame, which batch, and where the frame's bytes lie in the file."""
    agent: str
    batch: int
    events: int
    offset: int  # of the frame bytes
    length: int


def agent_bytes(agent: str) -> bytes:
    """The agent id as recorded: UTF-8, cut at a character to MAX_AGENT_ID_BYTES."""
    b = agent.encode()
    if len(b) > MAX_AGENT_ID_BYTES:
        b = b[:MAX_AGENT_ID_BYTES].decode(errors="ignore").encode()
    return b


def record_size(agent_b: bytes, frame: bytes) -> int:
    return HEAD.size + len(agent_b) + len(frame)


def encode(agent_b: bytes, batch: int, events: int, frame: bytes) -> bytes:
    """One record; the frame is its last len(frame) bytes."""
    rest = HEAD.pack(MAGIC, 0, len(frame), batch, events, len(agent_b))[8:] + agent_b
    crc = zlib.crc32(frame, zlib.crc32(rest))
    return MAGIC + crc.to_bytes(4, "big") + rest + frame


def read_segment(path: str, problem: Callable[[str, int], None]) -> Tuple[List[Record], int]:
    """The good records of one segment file and its size in bytes. Each damaged region is passed to
    `problem` (a line naming the file and offset, the bytes skipped), in file order."""
    name = os.path.basename(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        problem(f"ccld: spool {name}: cannot be read, skipped: {e}", 0)
        return [], 0
    records: List[Record] = []
    off, end = 0, len(data)
    while off < end:
        got = _check(data, off, end)
        if isinstance(got, Record):
            records.append(got)
            off = got.offset + got.length
            continue
        nxt = _resync(data, off + 1, end)
        if nxt is None:
            problem(f"ccld: spool {name}: torn tail at offset {off} ({end - off} bytes, {got}); "
                    f"kept the {len(records)} records before it", end - off)
            break
        problem(f"ccld: spool {name}: damaged record at offset {off} ({got}); skipped {nxt - off} "
                f"bytes, resumed at offset {nxt}", nxt - off)
        off = nxt
    return records, end


def _check(data: bytes, off: int, end: int) -> Union[Record, str]:
    """The record when a good one starts at `off`, else why not."""
    if end - off < HEAD.size:
        return "short header"
    magic, crc, n, batch, events, alen = HEAD.unpack_from(data, off)
    if magic != MAGIC:
        return "no record marker"
    if n > MAX_RECORD_FRAME or alen > MAX_AGENT_ID_BYTES:
        return f"impossible length {n}"
    frame_off = off + HEAD.size + alen
    if frame_off + n > end:
        return f"length {n} runs past the end"
    mv = memoryview(data)
    if zlib.crc32(mv[off + 8:frame_off + n]) != crc:
        return "checksum mismatch"
    try:
        agent = bytes(mv[off + HEAD.size:frame_off]).decode()
    except UnicodeDecodeError:
        return "agent id is not UTF-8"
    return Record(agent, batch, events, frame_off, n)


def _resync(data: bytes, start: int, end: int) -> Optional[int]:
    """Offset of the next good record at or after `start`, or None."""
    pos = data.find(MAGIC, start)
    while pos != -1:
        if isinstance(_check(data, pos, end), Record):
            return pos
        pos = data.find(MAGIC, pos + 1)
    return None
