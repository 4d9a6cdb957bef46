"""Collective numbers for the NCCL profiler plugin's records: one dense sequence per communicator.

NCCL numbers collectives per communicator AND per function (comm->seqNumber[func]: the 5th
all-reduce and the 5th broadcast both carry 5), so NCCL's number alone does not say which collective
of a communicator a record is; ccld's timeline needs one number per collective, increasing in call
order, equal on every member (wire.CollEnter.seq). This numbers each process's collective starts per
communicator in the order the plugin saw them (NCCL requires every member to call the same
collectives in the same order, and the plugin is loaded at the communicator's creation, so the counts
agree from the first one), keeps NCCL's own number as lib_seq, and maps the plugin's task ids of
later records (first kernel, end) to those numbers. Array operations per datagram, not per record.
Bounded: at most MAX_OPEN collectives awaiting their end per process; beyond, the oldest are dropped
(counted by the caller as unknown tasks when their records come).
"""
from __future__ import annotations

from typing import Dict, Tuple

import numpy as np

from ccld.bpf.rows import group_keys

MAX_OPEN = 1 << 16  # collectives started and not ended, per process (a hang leaves a few; a leak is cut here)


class CollNumbering:
    def __init__(self) -> None:
        self.next: Dict[int, int] = {}              # commHash (as int64) -> next collective number
        self._ids = np.zeros(0, np.int64)           # open tasks' plugin ids, sorted
        self._seq = np.zeros(0, np.int64)           # their numbers, aligned with _ids
        self.dropped_open = 0

    def number(self, comm_hash: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Numbers for collective starts (in the order the plugin saw them); remembers their ids."""
        n = len(ids)
        if n == 0:
            return np.zeros(0, np.int64)
        hashes = comm_hash.view(np.int64) if comm_hash.dtype != np.int64 else comm_hash
        first, inv = group_keys(hashes)
        order = np.lexsort((np.arange(n), inv))
        starts = np.r_[0, np.flatnonzero(inv[order][1:] != inv[order][:-1]) + 1]
        nth = np.empty(n, np.int64)
        nth[order] = np.arange(n) - np.repeat(starts, np.diff(np.r_[starts, n]))
        base = np.empty(len(first), np.int64)
        counts = np.bincount(inv, minlength=len(first))
        for g, i in enumerate(first.tolist()):  # per communicator in the datagram, not per record
            h = int(hashes[i])
            base[g] = self.next.get(h, 0)
            self.next[h] = base[g] + int(counts[g])
        seq = base[inv] + nth
        ids64 = ids.view(np.int64) if ids.dtype != np.int64 else ids
        all_ids = np.concatenate([self._ids, ids64])
        all_seq = np.concatenate([self._seq, seq])
        if len(all_ids) > MAX_OPEN:
            self.dropped_open += len(all_ids) - MAX_OPEN
            all_ids, all_seq = all_ids[-MAX_OPEN:], all_seq[-MAX_OPEN:]
        o = np.argsort(all_ids, kind="stable")
        self._ids, self._seq = all_ids[o], all_seq[o]
        return seq

    def lookup(self, ids: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(numbers, found) for later records of started collectives; found False: no start seen."""
        ids64 = ids.view(np.int64) if ids.dtype != np.int64 else ids
        if len(self._ids) == 0:
            return np.zeros(len(ids64), np.int64), np.zeros(len(ids64), bool)
        i = np.clip(np.searchsorted(self._ids, ids64), 0, len(self._ids) - 1)
        found = self._ids[i] == ids64
        return self._seq[i], found

    def retire(self, ids: np.ndarray) -> None:
        """Forget ended collectives."""
        if len(ids) and len(self._ids):
            keep = ~np.isin(self._ids, ids.view(np.int64) if ids.dtype != np.int64 else ids)
            self._ids, self._seq = self._ids[keep], self._seq[keep]
