"""ccld.wire: what agents and the collector say to each other, and the only code that reads it.

    schema.py    one frozen class per event kind, their fields and the schema version
    validate.py  the one validator (types, bounds on hostile input, rejected events counted)
    blocks.py    column blocks: the hot collective kinds, batched (the second encoding of the schema)
    table.py     tables (1.9): a frame's blocks as one, and the reader of a frame's "blocks" list
    codec.py     frames: the envelope, events as MessagePack maps, decode_batch / encode_batch
    protocol.py  the time service's messages (clock round trips, frame acknowledgements)

Callers spell it `from ccld import wire as ev` and use the names below (ev.CollEnter,
ev.decode_batch, ...); column blocks and the time service's messages are their own modules
(`from ccld.wire import blocks`, `from ccld.wire import protocol`).
Layering: this package imports nothing of ccld but ccld.errors (an import contract in pyproject.toml,
checked by `lint-imports` in .ci/run), so every other layer may depend on it.
"""
from ccld.wire.codec import Batch, decode_batch, encode_batch, event_from_wire, peek_resend
from ccld.wire.schema import (
    EVENT_TYPES,
    P2P,
    SCHEMA_MAJOR,
    SCHEMA_MINOR,
    SEQ_FROM_ATTACH,
    SEQ_FROM_INIT,
    SEQ_LIBRARY,
    AgentHello,
    ClockSample,
    ClockSync,
    CollEnter,
    CommInit,
    ComputeSpan,
    Event,
    GpuKernel,
    GpuLoss,
    GpuMemop,
    LinkStats,
    LossCounters,
    NetProgress,
    NicCounters,
    P2PEnd,
    ProbeStatus,
    QpInfo,
    RankExit,
    RankInfo,
    RankState,
    SchedStats,
    WorkEnd,
    WorkStart,
)
from ccld.wire.validate import MAX_ERRORS_KEPT, MAX_EVENTS_PER_FRAME, MAX_FRAME_BYTES, FrameError

__all__ = [
    "EVENT_TYPES", "MAX_ERRORS_KEPT", "MAX_EVENTS_PER_FRAME", "MAX_FRAME_BYTES", "P2P",
    "SCHEMA_MAJOR", "SCHEMA_MINOR", "SEQ_FROM_ATTACH", "SEQ_FROM_INIT", "SEQ_LIBRARY",
    "AgentHello", "Batch", "ClockSample", "ClockSync", "CollEnter", "CommInit", "ComputeSpan", "Event", "FrameError",
    "GpuKernel", "GpuLoss", "GpuMemop", "LinkStats", "LossCounters", "NetProgress", "NicCounters", "P2PEnd",
    "ProbeStatus", "QpInfo", "RankExit", "RankInfo", "RankState", "SchedStats", "WorkEnd", "WorkStart",
    "decode_batch", "encode_batch", "event_from_wire", "peek_resend",
]
