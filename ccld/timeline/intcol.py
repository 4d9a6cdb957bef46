"""One int field of the collective rows an ingest gathers (collrows.py), in order, as the chunks it came in.

Agents send a block's int columns packed (schema 1.8: n little-endian ints of 4 or 8 bytes; ccld/wire/
blocks.py), and a field shared by a block's rows is its value's 8 bytes repeated: joined, a flush reads
a field of every frame with one np.frombuffer per run of one width. Older senders' list columns and single events come as lists of
Python ints, converted with the rest. Caveat: a list may hold an int no int64 holds (the schema's ints
are unbounded): array() then raises OverflowError, and collapply drops and counts those rows.
"""
from __future__ import annotations

import struct
from typing import Iterator, List, Optional, Tuple, Union

import numpy as np

from ccld.wire.blocks import WIDTHS

_Q = struct.Struct("<q")  # a packed value (little-endian int64)


class IntColumn:
    """The field's values in order: `parts` are (width, bytes) (packed: little-endian ints of `width`
    bytes) or lists of Python ints."""
    __slots__ = ("parts", "_mine")

    def __init__(self) -> None:
        self.parts: List[Union[Tuple[int, bytes], List[int]]] = []
        self._mine = False  # the last part is a list made here (single values go on it), not a block's

    def packed(self, raw: bytes, n: int) -> None:
        """n values packed in `raw` (its length n times a width: ccld/wire/blocks.py checked it)."""
        self.parts.append((len(raw) // n, raw))
        self._mine = False

    def block(self, raw: Optional[bytes], col: Optional[List[int]], shared: int, n: int) -> None:
        """A block's n values of this field: its packed column `raw`, else its list column `col`, else
        its one shared value."""
        if raw is not None:
            self.packed(raw, n)
        elif col is not None:
            self.values(col)
        else:
            self.same(shared, n)

    def values(self, col: List[int]) -> None:
        self.parts.append(col)  # the block's own list: read only (readers replace lists, never edit them)
        self._mine = False

    def same(self, v: int, n: int) -> None:
        try:
            self.parts.append((8, _Q.pack(v) * n))
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
        return sum(len(p[1]) // p[0] if type(p) is tuple else len(p) for p in self.parts)

    def __iter__(self) -> Iterator[int]:
        for p in self.parts:
            yield from (np.frombuffer(p[1], WIDTHS[p[0]]).tolist() if type(p) is tuple else p)

    def array(self) -> np.ndarray:
        """Every value as one int64 array (writable): each run of packed parts of one width joined and
        read at once (agents keep a field's width from frame to frame, so runs are long)."""
        out: List[np.ndarray] = []
        run: List[bytes] = []
        width = 0
        for p in self.parts:
            if type(p) is tuple and p[0] == width:
                run.append(p[1])
                continue
            if run:
                out.append(np.frombuffer(b"".join(run), WIDTHS[width]))
                run = []
            if type(p) is tuple:
                width = p[0]
                run.append(p[1])
            else:
                width = 0
                out.append(np.array(p, dtype=np.int64))
        if run:
            out.append(np.frombuffer(b"".join(run), WIDTHS[width]))
        if not out:
            return np.zeros(0, np.int64)
        if len(out) == 1:
            return out[0].astype(np.int64)  # a copy: frombuffer's view of bytes is read-only
        return np.concatenate([a.astype(np.int64, copy=False) for a in out])
