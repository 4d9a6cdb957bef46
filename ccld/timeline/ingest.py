"""Ingest one received frame: decode, count what is wrong with it, hand the good part to the timeline.

Shared by the live collector and offline replay, so both count rejects the same way. Times:
`recv_unix` is the collector's wall clock at receipt (Unix seconds). Caveat: a rejected frame is
dropped whole (counted by reason); a frame with some bad events keeps its good ones.
"""
from __future__ import annotations

import collections
import gc
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from ccld import wire as ev
from ccld.timeline.timeline import Timeline

LOAD_GROUP = 256  # frames of a store applied together when nothing needs to look in between
GC_YOUNG = 50_000  # allocations between young-generation collections while frames are ingested (tune_gc)


class _Tuning:
    users = 0                                      # ingests running with tune_gc's thresholds
    found: Tuple[int, int, int] = (700, 10, 10)    # what the first of them found


def tune_gc() -> None:
    """Fewer young-generation collections while frames are ingested (process-wide, like the export's),
    until restore_gc. A frame's decode makes a few hundred short-lived objects, so at
    Python's default (700) a young collection ran every frame or two and the older generations' passes
    walked the timeline's objects: ~25 % of the collector's ingest (bench/RESULTS.md, collector_scale).
    Nested or overlapping users (two collectors in one process) share one setting: the last one out
    restores. A process that turned automatic collection off (threshold 0) is left as it is."""
    was = gc.get_threshold()
    if _Tuning.users == 0:
        _Tuning.found = was
        if was[0] != 0:
            gc.set_threshold(max(was[0], GC_YOUNG), *was[1:])
    _Tuning.users += 1


def restore_gc() -> None:
    """The end of one tune_gc: the last one out puts back what the first found, unless something else
    changed the young threshold meanwhile."""
    _Tuning.users = max(0, _Tuning.users - 1)
    if _Tuning.users == 0:
        first = _Tuning.found
        if first[0] != 0 and gc.get_threshold()[0] == max(first[0], GC_YOUNG):
            gc.set_threshold(*first)


@dataclass
class IngestCounters:
    frames_ok: int = 0
    frames_rejected: collections.Counter = field(default_factory=collections.Counter)  # reason -> n
    bad_events: collections.Counter = field(default_factory=collections.Counter)       # reason -> n
    skipped_events: int = 0  # events of kinds newer than this collector (newer minor version)
    bytes_ok: int = 0

    def to_dict(self) -> Dict[str, Any]:
        return {"frames_ok": self.frames_ok, "frames_rejected": dict(self.frames_rejected),
                "bad_events": dict(self.bad_events), "skipped_events": self.skipped_events,
                "bytes_ok": self.bytes_ok}


def decode_frame(frame: bytes, counters: IngestCounters) -> Tuple[Optional[ev.Batch], Optional[ev.FrameError]]:
    """(batch, None) for a readable frame, (None, error) for a rejected one; counts either way."""
    try:
        batch = ev.decode_batch(frame)
    except ev.FrameError as e:
        counters.frames_rejected[e.reason] += 1
        return None, e
    except Exception as e:  # a decoder bug: still count the frame (never lose it silently), say what broke
        err = ev.FrameError("decoder-error", f"decoder failed on a {len(frame)}-byte frame: "
                                             f"{type(e).__name__}: {e}")
        counters.frames_rejected[err.reason] += 1
        return None, err
    counters.frames_ok += 1
    counters.bytes_ok += len(frame)
    counters.skipped_events += batch.skipped
    for reason, n in batch.bad_counts.items():  # all bad events; batch.errors keeps only the first few
        counters.bad_events[reason] += n
    return batch, None


def ingest_frame(frame: bytes, recv_unix: float, timeline: Timeline,
                 counters: IngestCounters) -> Tuple[Optional[ev.Batch], Optional[ev.FrameError]]:
    batch, err = decode_frame(frame, counters)
    if batch is not None:
        timeline.ingest(batch, recv_unix)
    return batch, err


def load_timeline(store_dir: str) -> Timeline:
    """A store's frames, in stored order, into a fresh Timeline (no detectors). Raises StoreError when
    the store cannot be read at all; damaged records are skipped (replay.replay reports them)."""
    from ccld.store import read_store
    tl, counters = Timeline(), IngestCounters()
    group: List[Tuple[ev.Batch, float]] = []
    tune_gc()
    try:
        for recv, frame in read_store(store_dir, []):  # nothing ticks in between: frames go in together
            batch, _ = decode_frame(frame, counters)
            if batch is not None:
                group.append((batch, recv))
                if len(group) >= LOAD_GROUP:
                    tl.ingest_many(group)
                    group = []
        tl.ingest_many(group)
    finally:
        restore_gc()
    return tl
