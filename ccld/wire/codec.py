"""Frames: the envelope of a batch of events, and its events as MessagePack maps.

A frame is one MessagePack map (an *envelope*) holding a batch of events:

    {"v": [MAJOR, MINOR], "agent": str, "node": str, "batch": int, "events": [{"k": KIND, ...}, ...],
     "blocks": [...]}

Any MessagePack reader can decode a frame; every event is a plain map whose "k" names its kind
(schema.py), except the hot collective kinds, which travel as column blocks (optional key "blocks",
since 1.4; blocks.py): two encodings of one schema, checked by one validator (validate.py).
Optional "resend": true, before "events" (also 1.4): the sender numbers its batches 1, 2, 3... per
agent id and may send a frame again (its spool replays what the collector did not acknowledge), so
the collector keeps one copy per (agent, batch) (collector/acks.py, with peek_resend); unmarked
frames are never deduplicated.
Compatibility: a frame with a newer MAJOR is rejected with a clear error; a newer MINOR is read,
unknown fields are ignored, and events of an unknown kind are skipped and counted.
Caveat: one bad event (or block) is dropped and counted, never the frame around it (validate.Rejects).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import msgpack

from ccld.wire.blocks import Block, in_order, run_rows, split
from ccld.wire.table import as_blocks, read_blocks
from ccld.wire.schema import EVENT_TYPES, SCHEMA_MAJOR, SCHEMA_MINOR, Event
from ccld.wire.validate import (MAX_EVENTS_PER_FRAME, MAX_FRAME_BYTES, FrameError, Rejects, check_type, read_spec,
                                show, type_problem)

PEEK_BYTES = 512  # the envelope's keys before "events" fit in this (an agent id is <= 255 bytes)
ENVELOPE_FIELDS = (("agent", str), ("node", str), ("batch", int), ("events", list))  # checked in this order


def event_from_wire(d: Any) -> Event:
    """Build one event from its wire map. Raises FrameError (reason 'unknown-kind' for kinds newer than us)."""
    if type(d) is not dict:
        raise FrameError("bad-event", f"event is a {type(d).__name__}, not a map")
    if "k" not in d:
        raise FrameError("missing-field", "event has no kind (field 'k')")
    kind = d["k"]
    if type(kind) is not str:  # also keeps unhashable kinds (lists, maps) out of the dict lookup
        raise FrameError("bad-field", f"event kind (field 'k') should be str, got {type(kind).__name__}")
    cls = EVENT_TYPES.get(kind)
    if cls is None:
        raise FrameError("unknown-kind", f"unknown event kind {show(kind)}")
    cls, req, opt, defaults, factories = read_spec(cls)
    args = dict(defaults)
    for name, exact, declared in req:
        if name not in d:
            raise FrameError("missing-field", f"event {kind!r}: missing field {name!r}")
        v = d[name]
        # type(v) is int: exact types, so True is not an int and a subclass cannot sneak in
        if type(v) is not exact and (exact is not None or type_problem(declared, v) is not None):
            check_type(kind, name, declared, v)
        args[name] = v
    for name, exact, declared in opt:
        if name in d:
            v = d[name]
            if type(v) is not exact and (exact is not None or type_problem(declared, v) is not None):
                check_type(kind, name, declared, v)
            args[name] = v
    for name, factory in factories:
        if name not in args:
            args[name] = factory()
    # Not cls(**args): a frozen dataclass's __init__ sets each field through object.__setattr__, which
    # was a third of the decode. Every field is set here, validated, so the instance is the same.
    e = object.__new__(cls)
    e.__dict__.update(args)
    return e  # unknown fields are ignored on purpose: a newer minor version may add some


class Batch:
    """One decoded frame. `plain` holds the events that came as maps, `parts` the column blocks and
    tables (blocks.py, table.py) as read, `blocks` those as Blocks only (a table's groups, made on first
    use); `events` is every event in frame order, built from the blocks on first use (the timeline
    reads `plain` and `parts` directly and never pays for either)."""
    __slots__ = ("agent", "node", "batch", "version", "plain", "parts", "skipped", "errors", "bad_counts", "_all",
                 "_blocks")

    def __init__(self, agent: str, node: str, batch: int, version: Tuple[int, int], events: List[Event],
                 skipped: int = 0, errors: Optional[List[FrameError]] = None,
                 bad_counts: Optional[Dict[str, int]] = None, blocks: Optional[List[Any]] = None):
        self.agent, self.node, self.batch, self.version = agent, node, batch, version
        self.plain = events
        self.parts = blocks or []
        self.skipped = skipped  # events of kinds this reader does not know (newer minor versions)
        self.errors = errors if errors is not None else []  # bad events dropped; the rest of the frame is kept
        self.bad_counts = bad_counts if bad_counts is not None else {}  # every bad event by reason (errors keeps the first few)
        self._all: Optional[List[Event]] = None
        self._blocks: Optional[List[Block]] = None

    @property
    def blocks(self) -> List[Block]:
        if self._blocks is None:
            self._blocks = as_blocks(self.parts)
        return self._blocks

    @property
    def events(self) -> List[Event]:
        if not self.parts:
            return self.plain
        if self._all is None:
            out: List[Event] = []
            for item in in_order(self.plain, self.blocks):
                if type(item) is tuple:
                    out.extend(run_rows(*item))
                else:
                    out.append(item)
            self._all = out
        return self._all

    def __len__(self) -> int:
        """Events in the frame (without building them)."""
        rows: int = sum(b.n for b in self.parts)
        return len(self.plain) + rows


def encode_batch(agent: str, node: str, batch: int, events: List[Event], columns: bool = True,
                 resend: bool = False) -> bytes:
    """One frame. With `columns` (the default) the hot collective kinds go as column blocks (1.4);
    `resend` marks a frame its sender may send again (deduplicated by the collector)."""
    if columns:
        plain, blocks = split(events)
    else:
        plain, blocks = [e.to_wire() for e in events], []
    env: Dict[str, Any] = {"v": [SCHEMA_MAJOR, SCHEMA_MINOR], "agent": agent, "node": node, "batch": batch}
    if resend:
        env["resend"] = True  # before "events": the collector reads it without walking the events
    env["events"] = plain
    if blocks:
        env["blocks"] = blocks
    frame: bytes = msgpack.packb(env, use_bin_type=True)
    return frame


def decode_batch(frame: bytes) -> Batch:
    """Decode and validate one frame. Raises FrameError naming what was wrong; never anything else."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise FrameError("bad-frame", f"frame is a {type(frame).__name__}, not bytes")
    if len(frame) == 0:
        raise FrameError("empty", "empty frame")
    if len(frame) > MAX_FRAME_BYTES:
        raise FrameError("too-large", f"frame of {len(frame)} bytes is over the {MAX_FRAME_BYTES}-byte limit")
    try:
        env = msgpack.unpackb(frame, raw=False, strict_map_key=False, max_array_len=MAX_EVENTS_PER_FRAME)
    except msgpack.exceptions.ExtraData:
        raise FrameError("trailing-bytes", "frame has bytes after its MessagePack map") from None
    except (ValueError, msgpack.exceptions.UnpackException) as e:
        if "max_array_len" in str(e):
            raise FrameError("too-many-items", f"frame has an array of more than {MAX_EVENTS_PER_FRAME} items "
                                               f"(the most events a frame may carry): {e}") from None
        reason = "truncated" if "incomplete" in str(e).lower() or isinstance(
            e, msgpack.exceptions.OutOfData) else "not-msgpack"
        detail = str(e) or type(e).__name__  # StackError (nesting too deep) has no message of its own
        raise FrameError(reason, f"frame is not valid MessagePack ({reason}): {detail}") from None
    except Exception as e:  # msgpack raises a few other types on hostile input (e.g. TypeError for bad keys)
        raise FrameError("not-msgpack", f"frame is not valid MessagePack: {type(e).__name__}: {e}") from None
    if not isinstance(env, dict):
        raise FrameError("bad-envelope", f"frame is a MessagePack {type(env).__name__}, not a map")
    v = env.get("v")
    # Each check below first tries the exact types MessagePack gives (cheap, and they always pass the
    # full check), then the full check, which decides and names what is wrong.
    if not (type(v) is list and len(v) == 2 and type(v[0]) is int and type(v[1]) is int) and (
            not isinstance(v, (list, tuple)) or len(v) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in v)):
        raise FrameError("no-version", f"frame has no valid schema version 'v' (got {show(v)})")
    if v[0] > SCHEMA_MAJOR:
        raise FrameError("newer-major",
                         f"frame has schema version {v[0]}.{v[1]}, newer than this collector's "
                         f"{SCHEMA_MAJOR}.{SCHEMA_MINOR}; upgrade the collector")
    if v[0] < SCHEMA_MAJOR:
        raise FrameError("older-major", f"frame has schema version {v[0]}.{v[1]}, no longer supported "
                                        f"(this collector reads {SCHEMA_MAJOR}.x)")
    if not (type(env.get("agent")) is str and type(env.get("node")) is str and type(env.get("batch")) is int
            and type(env.get("events")) is list):
        for key, typ in ENVELOPE_FIELDS:
            got = env.get(key)
            if not isinstance(got, typ) or isinstance(got, bool):
                raise FrameError("bad-envelope", f"frame envelope field {key!r} is missing or not a {typ.__name__} "
                                                 f"(got {type(got).__name__})")
    events: List[Event] = []
    skipped = 0
    rejects = Rejects(env["agent"], env["batch"], v[1])
    for i, raw in enumerate(env["events"]):
        try:
            events.append(event_from_wire(raw))
        except FrameError as e:
            skipped += rejects.drop(e, f"event #{i}")
    blocks: List[Any] = []
    if "blocks" in env:
        blocks, more = read_blocks(env["blocks"], len(env["events"]), rejects)
        skipped += more
    return Batch(env["agent"], env["node"], env["batch"], (v[0], v[1]), events, skipped, rejects.errors, rejects.counts,
                 blocks)


def peek_resend(frame: bytes) -> Optional[Tuple[str, int]]:
    """(agent, batch) of a frame marked "resend", from the envelope keys before "events"; None when it
    is not marked (or is not an envelope). Never raises."""
    if type(frame) is bytes and b"resend" not in frame:
        return None  # the key is not there, however encoded: not marked (a search in C, no Unpacker)
    for data in (frame[:PEEK_BYTES], frame) if len(frame) > PEEK_BYTES else (frame,):
        u = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(len(data), 1))
        u.feed(data)
        agent = batch = None
        resend = False
        try:
            for _ in range(min(u.read_map_header(), 16)):
                k = u.unpack()
                if k in ("events", "blocks"):
                    break  # encode_batch writes "resend" before the events: a frame without it there is not marked
                if k == "agent":
                    agent = u.unpack()
                elif k == "batch":
                    batch = u.unpack()
                elif k == "resend":
                    resend = u.unpack() is True
                else:
                    u.skip()
        except msgpack.OutOfData:
            continue  # the first PEEK_BYTES were not enough: read the whole frame
        except Exception:
            return None
        if resend and type(agent) is str and type(batch) is int and batch > 0:
            return agent, batch
        return None
    return None
