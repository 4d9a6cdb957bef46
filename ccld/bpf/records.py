"""Mirrors of the records the BPF programs write (see common.h and each *.bpf.c): ctypes classes, and
numpy dtypes made from them for reading a whole drain at once (ringbuf.py).

Sizes are asserted by unit tests against the C `_Static_assert`s, so a field added on one side only
fails a test instead of shifting every later field at run time. Every record of a family occupies the
same slot (the family's REC_SIZE = CCLD_REC_SIZE in C); a record's own size is in its header.
"""
import ctypes as ct
from typing import Dict, Tuple

import numpy as np

REC_VERSION = 1


class Header(ct.Structure):
    _fields_ = [("kind", ct.c_uint16), ("version", ct.c_uint16), ("size", ct.c_uint32),
                ("ts_ns", ct.c_uint64), ("tgid", ct.c_uint32), ("tid", ct.c_uint32)]


HEADER_SIZE = ct.sizeof(Header)


SMALL_SET = 16  # member(): up to this many values, one comparison each beats np.isin's setup


def member(values: np.ndarray, among) -> np.ndarray:
    """np.isin(values, among) for a drain's pids against the few processes traced (a sequence or array of
    ints): np.isin spends ~15-20 us choosing and setting up its method whatever the sizes (numpy 2.x),
    and the agent asks it of every drain of every family; one comparison per member is ~2 us here."""
    among = np.asarray(among).reshape(-1)
    if len(among) > SMALL_SET:
        return np.isin(values, among, kind="sort")
    out = np.zeros(values.shape, bool)
    for x in among.tolist():
        out |= values == x
    return out


HDR_DTYPE = np.dtype({"names": ["kind", "version", "size", "ts_ns", "tgid", "tid"],
                      "formats": ["<u2", "<u2", "<u4", "<u8", "<u4", "<u4"],
                      "offsets": [0, 2, 4, 8, 16, 20], "itemsize": HEADER_SIZE})
_SCALARS = {ct.c_uint8: "u1", ct.c_int8: "i1", ct.c_uint16: "<u2", ct.c_int16: "<i2", ct.c_uint32: "<u4",
            ct.c_int32: "<i4", ct.c_uint64: "<u8", ct.c_int64: "<i8"}


def _np_format(ctype):
    if ctype is Header:
        return HDR_DTYPE
    if isinstance(ctype, type) and issubclass(ctype, ct.Structure):  # a nested struct: its own fields
        return record_dtype(ctype, ct.sizeof(ctype))
    if ctype in _SCALARS:
        return _SCALARS[ctype]
    if issubclass(ctype, ct.Array):
        if ctype._type_ is ct.c_char:
            return f"S{ctype._length_}"
        return (_np_format(ctype._type_), (ctype._length_,))
    raise TypeError(f"no numpy form for {ctype!r}")


def record_dtype(cls, rec_size: int) -> np.dtype:
    """The numpy form of ctypes record `cls` in a slot of `rec_size` bytes: its fields at their offsets,
    the header as the nested field "hdr" (arr["hdr"]["tgid"])."""
    names, formats, offsets = [], [], []
    for name, ctype in cls._fields_:
        names.append(name)
        formats.append(_np_format(ctype))
        offsets.append(getattr(cls, name).offset)
    if ct.sizeof(cls) > rec_size:
        raise ValueError(f"{cls.__name__} ({ct.sizeof(cls)} bytes) does not fit a {rec_size}-byte slot")
    return np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": rec_size})


def view(rows: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """(n, rec_size) uint8 rows (C-contiguous) as n records of `dtype`, without a copy."""
    if rows.shape[0] == 0:
        return np.empty(0, dtype)
    return np.ascontiguousarray(rows).view(dtype).reshape(-1)


class Kinds:
    """A family's record kinds, worked out once: kind -> (ctypes class, its size, its numpy dtype)."""

    def __init__(self, kinds: Dict[int, type], rec_size: int):
        self.rec_size = rec_size
        self.classes = dict(kinds)
        self.dtypes = {k: record_dtype(cls, rec_size) for k, cls in kinds.items()}
        top = max(kinds) + 1 if kinds else 1
        self._size = np.full(top, -1, np.int64)  # kind -> its struct size; -1: unknown kind
        for k, cls in kinds.items():
            self._size[k] = ct.sizeof(cls)

    def check(self, rows: np.ndarray, bad: Dict[str, int]) -> Tuple[np.ndarray, np.ndarray]:
        """(good rows, their kinds) of a drain's (n, rec_size) rows; the others are counted in `bad`
        by reason, as decode() names them ("version", "unknown-kind", "size")."""
        if rows.shape[0] == 0:
            return rows, np.empty(0, np.uint16)
        hdr = view(rows[:, :HEADER_SIZE], HDR_DTYPE) if rows.shape[1] != HEADER_SIZE else view(rows, HDR_DTYPE)
        kind = hdr["kind"]
        version_ok = hdr["version"] == REC_VERSION
        known = kind < len(self._size)
        want = np.where(known, self._size[np.minimum(kind, len(self._size) - 1)], -1)
        known &= want >= 0
        size_ok = hdr["size"] == want
        good = version_ok & known & size_ok
        if good.all():
            return rows, kind
        for reason, mask in (("version", ~version_ok), ("unknown-kind", version_ok & ~known),
                             ("size", version_ok & known & ~size_ok)):
            n = int(np.count_nonzero(mask))
            if n:
                bad[reason] = bad.get(reason, 0) + n
        return rows[good], kind[good]

    def of(self, rows: np.ndarray, kinds: np.ndarray, kind: int) -> np.ndarray:
        """The rows of one kind, as records of its dtype (a copy)."""
        return view(rows[kinds == kind], self.dtypes[kind])

    def record(self, row: np.ndarray):
        """One row as its ctypes record (the per-record handlers of rare kinds read these)."""
        kind = int(row[:2].view(np.uint16)[0])
        return self.classes[kind].from_buffer_copy(row.tobytes()[:ct.sizeof(self.classes[kind])])
