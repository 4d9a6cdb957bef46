"""The one validator of what a frame says, for both encodings (maps, column blocks) of the schema.

A value is checked against its field's declared type string (schema.field_types): exact types, so
True is not an int and a subclass cannot sneak in; the elements of lists and dicts are checked too
(they end up in stats.json and reports). read_spec works out once per kind how to read it: the
collector's hot path (~1 µs an event) runs on it.
Bounds on hostile input: at most MAX_FRAME_BYTES and MAX_EVENTS_PER_FRAME events per frame; every bad
event is counted by reason, the first MAX_ERRORS_KEPT with their message (Rejects); values shown in
messages are shortened (show).
"""
from __future__ import annotations

import dataclasses
import reprlib
from typing import Any, Callable, Dict, List, Optional, Tuple, Type

from ccld.errors import CcldError
from ccld.wire.schema import SCHEMA_MINOR, Event, field_types

MAX_FRAME_BYTES = 4 * 1024 * 1024  # agents send <= 2,048 events (~300 KiB) a frame; 4 MiB bounds a hostile one
# 32x the shipper's MAX_BATCH. Checked by the MessagePack reader before it allocates anything: a
# 16 MiB frame of 16M one-byte junk events once took 7 GiB and 80 s to reject.
MAX_EVENTS_PER_FRAME = 65_536
MAX_ERRORS_KEPT = 32  # bad events of one frame kept with their message; all of them are counted by reason


class FrameError(CcldError):
    """A frame that cannot be read. `reason` is a short stable tag used to count rejections."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


EXACT_TYPES: Dict[str, type] = {"int": int, "str": str, "bool": bool}
_TYPE_CHECKS: Dict[str, Callable[[Any], bool]] = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "bool": lambda v: isinstance(v, bool),
}


class _ShortRepr(reprlib.Repr):
    """repr() of hostile values for error messages: short, and safe on deeply nested ones."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother = 3, 60, 60
        self.maxlist = self.maxtuple = self.maxdict = 4

    def repr_bytes(self, x: bytes, level: int) -> str:
        return repr(x[:self.maxstring]) + ("..." if len(x) > self.maxstring else "")


show = _ShortRepr().repr


def type_problem(declared: str, value: Any) -> Optional[str]:
    """None when `value` matches the declared type string (e.g. "Dict[str, int]"), else what it is."""
    check = _TYPE_CHECKS.get(declared)
    if check is not None:
        return None if check(value) else type(value).__name__
    base, _, inner = declared.partition("[")
    inner = inner[:-1]
    if base == "List":
        if not isinstance(value, list):
            return type(value).__name__
        for x in value if inner else ():
            if type_problem(inner, x):
                return f"a list holding a {type(x).__name__}"
        return None
    if base == "Dict":
        if not isinstance(value, dict):
            return type(value).__name__
        kt, _, vt = inner.partition(", ")
        for k, v in value.items():  # elements are checked too: they end up in stats.json and reports
            if kt and type_problem(kt, k):
                return f"a dict with a {type(k).__name__} key"
            if vt and type_problem(vt, v):
                return f"a dict with a {type(v).__name__} value"
    return None


def column_problem(declared: str, col: List[Any]) -> Optional[str]:
    """None when every value of `col` has the declared type, else what the first odd one is."""
    exact = EXACT_TYPES.get(declared)
    if exact is not None:
        kinds = set(map(type, col))  # one C-level pass: exact types, so True is not an int
        if kinds <= {exact}:
            return None
        odd = next(t for t in kinds if t is not exact)
        return f"a {odd.__name__}"
    for v in col:
        got = type_problem(declared, v)
        if got is not None:
            return got
    return None


def check_type(kind: str, name: str, declared: str, value: Any) -> None:
    """Raise FrameError("bad-field") naming the kind and field when `value` is not of the declared type."""
    got = type_problem(declared, value)
    if got is not None:
        raise FrameError("bad-field", f"event {kind!r}: field {name!r} should be {declared}, got {got}")


FieldSpec = Tuple[str, Optional[type], str]  # (name, its exact type or None, its declared type string)
# (class, required fields, optional fields, defaults, (name, default factory) pairs)
ReadSpec = Tuple[Type[Event], Tuple[FieldSpec, ...], Tuple[FieldSpec, ...], Dict[str, Any],
                 Tuple[Tuple[str, Callable[[], Any]], ...]]
_SPECS: Dict[str, ReadSpec] = {}


def read_spec(cls: Type[Event]) -> ReadSpec:
    """How to read one kind, worked out once: the hot path of the collector (~1 µs an event) is here."""
    got = _SPECS.get(cls.KIND)
    if got is None:
        req, opt = field_types(cls)
        defaults: Dict[str, Any] = {}
        factories: List[Tuple[str, Callable[[], Any]]] = []
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                defaults[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                factories.append((f.name, f.default_factory))
        got = _SPECS[cls.KIND] = (cls, tuple((n, EXACT_TYPES.get(t), t) for n, t in req.items()),
                                  tuple((n, EXACT_TYPES.get(t), t) for n, t in opt.items()), defaults, tuple(factories))
    return got


class Rejects:
    """The events one frame loses: every bad one counted by reason (`counts`), the first MAX_ERRORS_KEPT
    kept with a message naming the agent, the batch and where in the frame (`errors`)."""
    __slots__ = ("agent", "batch", "minor", "errors", "counts")

    def __init__(self, agent: str, batch: int, minor: int):
        self.agent, self.batch, self.minor = agent, batch, minor  # minor: the frame's schema minor version
        self.errors: List[FrameError] = []
        self.counts: Dict[str, int] = {}

    def drop(self, e: FrameError, where: str, weight: int = 1) -> int:
        """Drop `weight` events (one event, or a block's rows) for `e`; returns how many of them are
        skipped instead, as of a kind newer than this reader (a newer minor version may add kinds)."""
        if e.reason == "unknown-kind" and self.minor > SCHEMA_MINOR:
            return weight
        # One bad event must not cost the good ones beside it: drop it, say which and why.
        self.counts[e.reason] = self.counts.get(e.reason, 0) + weight
        if len(self.errors) < MAX_ERRORS_KEPT:
            self.errors.append(FrameError(e.reason, f"agent {show(self.agent)} batch {self.batch} {where}: {e}"))
        return 0
