"""ctypes mirrors of the records the BPF programs write (see common.h and each *.bpf.c).

Sizes are asserted by unit tests against the C `_Static_assert`s, so a field added on one side only
fails a test instead of shifting every later field at run time.
"""
import ctypes as ct

REC_VERSION = 1


class Header(ct.Structure):
    _fields_ = [("kind", ct.c_uint16), ("version", ct.c_uint16), ("size", ct.c_uint32),
                ("ts_ns", ct.c_uint64), ("tgid", ct.c_uint32), ("tid", ct.c_uint32)]


HEADER_SIZE = ct.sizeof(Header)


def decode(data: bytes, kinds: dict):
    """Return (kind, record) for one raw ring-buffer record, or (None, reason) when it is bad.

    `kinds` maps kind -> ctypes class. A bad record is reported, never raised: the caller counts it.
    """
    if len(data) < HEADER_SIZE:
        return None, "short"
    hdr = Header.from_buffer_copy(data[:HEADER_SIZE])
    if hdr.version != REC_VERSION:
        return None, "version"
    cls = kinds.get(hdr.kind)
    if cls is None:
        return None, "unknown-kind"
    if hdr.size != ct.sizeof(cls) or len(data) < ct.sizeof(cls):
        return None, "size"
    return hdr.kind, cls.from_buffer_copy(data[:ct.sizeof(cls)])
