"""Read a BPF ring buffer in place: one drain's records as one numpy array, no Python per record.

The kernel's BPF_MAP_TYPE_RINGBUF is mapped into this process (kernel/bpf/ringbuf.c, the layout
libbpf's ring_buffer__consume reads): page 0 holds the consumer position (ours to write), page 1 the
producer position, then the data area, mapped twice in a row so that a record wrapping around its end
reads as one piece. Each record is an 8-byte header {u32 len | BUSY (1<<31) | DISCARD (1<<30), u32
pg_off} and `len` bytes, rounded up to 8. Every ccld family reserves the same size for each of its
records (CCLD_REC_SIZE in common.h), so the records between the consumer and producer positions are
slots of one stride: their headers are checked as an array (a BUSY one ends the drain there: the
kernel has not finished writing it; libbpf stops there too), the slots are copied out in one go, and
then the consumer position moves past them, which hands the room back to the kernel.
A slot of another length (a program that reserved a different size) is skipped by its own length and
counted, never fatal. Positions are byte counters that only grow (u64); the data area is a power of
two, so `pos & mask` is the offset.
Minimum kernel: 5.8 (ring buffer maps, mmap-able).
"""
from __future__ import annotations

import mmap
from typing import Dict, Optional, Tuple

import numpy as np

BUSY = 1 << 31
DISCARD = 1 << 30
HDR = 8  # struct bpf_ringbuf_hdr


class RingReader:
    """The records of one ring buffer map (fd `map_fd`, data area of `data_size` bytes) whose every
    record is `rec_size` bytes. `read()` returns the drain's records as an (n, rec_size) uint8 array."""

    def __init__(self, map_fd: int, data_size: int, rec_size: int, bad: Optional[Dict[str, int]] = None):
        if data_size <= 0 or data_size & (data_size - 1):
            raise ValueError(f"ring buffer size {data_size} is not a power of two")
        if rec_size <= 0 or rec_size % 8:
            raise ValueError(f"record size {rec_size} is not a positive multiple of 8")
        page = mmap.PAGESIZE
        self.data_size, self.rec_size, self.stride = data_size, rec_size, HDR + rec_size
        self.mask = data_size - 1
        self._cons_map = mmap.mmap(map_fd, page, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
        self._data_map = mmap.mmap(map_fd, page + 2 * data_size, mmap.MAP_SHARED, mmap.PROT_READ, offset=page)
        self._cons = np.frombuffer(self._cons_map, np.uint64, 1)
        self._prod = np.frombuffer(self._data_map, np.uint64, 1)
        self._data = np.frombuffer(self._data_map, np.uint8, offset=page)
        self.bad = bad if bad is not None else {}  # slots skipped, by reason (the family's bad_records)
        self.discarded = 0              # records a program discarded (ccld's never do)

    def pending(self) -> int:
        """Bytes written by the kernel and not consumed yet (0: nothing to read)."""
        return int(self._prod[0]) - int(self._cons[0])

    def read(self) -> np.ndarray:
        """Every complete record up to the first one still being written, as an (n, rec_size) array
        (a copy: the room goes back to the kernel before this returns)."""
        cons = int(self._cons[0])
        prod = int(self._prod[0])
        if prod == cons:
            return np.empty((0, self.rec_size), np.uint8)
        parts = []
        while cons < prod:
            got, cons, stop = self._slots(cons, prod)
            if got is not None:
                parts.append(got)
            if stop:
                break
        self._cons[0] = cons  # after the copies: x86 keeps stores after the loads before them
        if not parts:
            return np.empty((0, self.rec_size), np.uint8)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _slots(self, cons: int, prod: int) -> Tuple[np.ndarray, int, bool]:
        """(records copied, new consumer position, stop?) for the run of well-formed slots at `cons`;
        one odd slot after the run is skipped (counted) so that the next call goes on past it."""
        stride = self.stride
        start = cons & self.mask
        n = (prod - cons) // stride
        copied = None
        if n:
            lens = np.ndarray((n,), np.uint32, self._data, start, (stride,))
            ok = (lens & ~np.uint32(DISCARD)) == self.rec_size  # also false for a BUSY slot
            k = n if ok.all() else int(np.argmin(ok))
            if k:
                slots = np.ndarray((k, stride), np.uint8, self._data, start, (stride, 1))
                keep = (lens[:k] & DISCARD) == 0
                copied = slots[:, HDR:].copy() if keep.all() else slots[keep][:, HDR:].copy()
                self.discarded += int(k - np.count_nonzero(keep))
                cons += k * stride
            if k == n and (prod - cons) == 0:
                return copied, cons, True
        # The slot at `cons` is odd (busy, another length) or shorter than a stride remains.
        if prod - cons < HDR:
            return copied, cons, True
        head = int(np.ndarray((1,), np.uint32, self._data, cons & self.mask)[0])
        if head & BUSY:
            return copied, cons, True  # not committed yet: the next drain takes it
        size = head & ~(BUSY | DISCARD)
        step = (HDR + size + 7) & ~7
        if cons + step > prod:
            return copied, cons, True
        self.bad["slot-size"] = self.bad.get("slot-size", 0) + 1
        return copied, cons + step, False

    def close(self) -> None:
        del self._cons, self._prod, self._data
        self._cons_map.close()
        self._data_map.close()
