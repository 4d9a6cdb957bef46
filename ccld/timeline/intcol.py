"""One int field of the collective rows an ingest gathers (collrows.py), in order, as the chunks it came in.

Agents send a block's int columns packed (schema 1.8: n little-endian int64 as bytes; ccld/wire/blocks.py),
and a field shared by a block's rows is its value's 8 bytes repeated: joined, a flush reads a field of
every frame with one np.frombuffer. Older senders' list columns and single events come as lists of
Python ints, converted with the rest. Caveat: a list may hold an int no int64 holds (the schema's ints
are unbounded): array() then raises OverflowError, and collapply drops and counts those rows.
"""
from __future__ import annotations

import struct
from typing import Iterator, List, Union

import numpy as np

_Q = struct.Struct("<q")  # a packed value (little-endian int64)


class IntColumn:
    """The field's values in order: `parts` are bytes (packed) or lists of Python ints."""
    __slots__ = ("parts", "_mine")

    def __init__(self) -> None:
        self.parts: List[Union[bytes, List[int]]] = []
        self._mine = False  # the last part is a list made here (single values go on it), not a block's

    def packed(self, raw: bytes) -> None:
        self.parts.append(raw)
        self._mine = False

    def values(self, col: List[int]) -> None:
        self.parts.append(col)  # the block's own list: read only (readers replace lists, never edit them)
        self._mine = False

    def same(self, v: int, n: int) -> None:
        try:
            self.parts.append(_Q.pack(v) * n)
            self._mine = False
        except struct.error:  # past int64: as values (dropped as out of range when applied)
            self.values([v] * n)

    def one(self, v: int) -> None:
        if self._mine:
            self.parts[-1].append(v)  # type: ignore[union-attr]
        else:
            self.parts.append([v])
            self._mine = True

    def __len__(self) -> int:
        return sum(len(p) // 8 if type(p) is bytes else len(p) for p in self.parts)

    def __iter__(self) -> Iterator[int]:
        for p in self.parts:
            yield from (np.frombuffer(p, "<i8").tolist() if type(p) is bytes else p)

    def array(self) -> np.ndarray:
        """Every value as one int64 array (writable): each run of packed parts joined and read at once."""
        out, run = [], []
        for p in self.parts:
            if type(p) is bytes:
                run.append(p)
                continue
            if run:
                out.append(np.frombuffer(b"".join(run), "<i8"))
                run = []
            out.append(np.array(p, dtype=np.int64))
        if run:
            out.append(np.frombuffer(b"".join(run), "<i8"))
        if not out:
            return np.zeros(0, np.int64)
        return np.concatenate(out) if len(out) > 1 else out[0].copy()
