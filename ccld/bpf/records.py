"""ctypes mirrors of the records the BPF programs write (see common.h and each *.bpf.c).

Sizes are asserted by unit tests against the C `_Static_assert`s, so a field added on one side only
fails a test instead of shifting every later field at run time.
"""
import ctypes as ct
import struct

REC_VERSION = 1


class Header(ct.Structure):
    _fields_ = [("kind", ct.c_uint16), ("version", ct.c_uint16), ("size", ct.c_uint32),
                ("ts_ns", ct.c_uint64), ("tgid", ct.c_uint32), ("tid", ct.c_uint32)]


HEADER_SIZE = ct.sizeof(Header)


_HEADER = struct.Struct("=HHI")   # kind, version, size: the start of Header, read without a ctypes object
_SIZES: dict = {}                 # id(kinds) -> (kinds, {kind: (class, its size)}); holding kinds keeps its id ours


def decode(data: bytes, kinds: dict):
    """Return (kind, record) for one raw ring-buffer record, or (None, reason) when it is bad.

    `kinds` maps kind -> ctypes class. A bad record is reported, never raised: the caller counts it.
    This runs once per probe hit in the agent: the header is read with struct (a few hundred ns less
    than a ctypes Header), and the record is copied straight from `data`, with no slice first.
    """
    if len(data) < HEADER_SIZE:
        return None, "short"
    kind, version, size = _HEADER.unpack_from(data)
    if version != REC_VERSION:
        return None, "version"
    cached = _SIZES.get(id(kinds))
    if cached is None or cached[0] is not kinds or len(cached[1]) != len(kinds):
        cached = _SIZES[id(kinds)] = (kinds, {k: (cls, ct.sizeof(cls)) for k, cls in kinds.items()})
    got = cached[1].get(kind)
    if got is None:
        return None, "unknown-kind"
    cls, want = got
    if size != want or len(data) < want:
        return None, "size"
    return kind, cls.from_buffer_copy(data)
