"""Read a whole BPF map in a few syscalls into buffers kept between reads, as numpy arrays.

bcc's items_lookup_batch (the API this replaced) allocates buffers for the map's max_entries on every call (10 MiB for the
net family's 65,536 connections) and makes a ctypes object per entry; a drain every 0.5 s then costs
more than everything else the agent does when the job is quiet. BatchReader keeps one buffer of
CHUNK entries per map and returns the keys and the values as arrays (bytes per entry), which the
families compare with the last drain and decode with array operations. BPF_MAP_LOOKUP_BATCH (5.6+):
for a hash map the batch token is a bucket number, for an array an index (a u32 either way; 8 bytes
are kept for it). A concurrent update can make the kernel report no progress: the read ends there
(the next drain sees the rest).
"""
from __future__ import annotations

import ctypes as ct
import errno
import os
from typing import Optional, Tuple

import numpy as np

from ccld.bpf import sysbpf

CHUNK = 4096  # entries per syscall


class BatchReader:
    def __init__(self, table, chunk: int = CHUNK):
        self.fd = table.map_fd
        self.ksize, self.vsize = ct.sizeof(table.Key), ct.sizeof(table.Leaf)
        self.chunk = chunk
        self._keys = ct.create_string_buffer(self.ksize * chunk)
        self._vals = ct.create_string_buffer(self.vsize * chunk)
        self._in, self._out = ct.c_uint64(0), ct.c_uint64(0)

    def read(self, limit: Optional[int] = None) -> Tuple[np.ndarray, np.ndarray]:
        """(keys, values) of every entry (of the first `limit`, for an array): (n, key size) and
        (n, value size) uint8 arrays, copies."""
        keys, vals = [], []
        first, total = True, 0
        while True:
            want = self.chunk if limit is None else min(self.chunk, limit - total)
            if want <= 0:
                break
            err, n = sysbpf.lookup_batch(self.fd, None if first else self._in, self._out, self._keys, self._vals, want)
            if n:
                keys.append(np.frombuffer(self._keys, np.uint8, n * self.ksize).reshape(n, self.ksize).copy())
                vals.append(np.frombuffer(self._vals, np.uint8, n * self.vsize).reshape(n, self.vsize).copy())
                total += n
            if err != 0:
                if err != errno.ENOENT:
                    raise OSError(err, f"BPF_MAP_LOOKUP_BATCH failed: {os.strerror(err)}")
                break  # ENOENT: the whole map was read
            if n == 0:
                break  # no progress (a concurrent update): the next drain reads the rest
            first = False
            self._in.value = self._out.value
        if not keys:
            return np.zeros((0, self.ksize), np.uint8), np.zeros((0, self.vsize), np.uint8)
        return (keys[0], vals[0]) if len(keys) == 1 else (np.concatenate(keys), np.concatenate(vals))
