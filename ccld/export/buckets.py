"""Counter buckets that are written once recorded time has passed them: the one mechanism behind the
TCP link counters (netcounters.py) and NCCL's proxy progress (netprog.py).

An owner (a link, a pair of ranks) holds its open buckets in `owner.buckets` (bucket index -> the
values being summed). `Closing.open` gives an owner's bucket i, making it from `empty()` and scheduling
it to close at the bucket's end plus `close_after_ns` (reports arrive that much late); `Closing.due`
yields every (owner, i, values) that closed by a recorded time, in closing order, taking each out of
its owner. Which bucket a late report goes to is the caller's rule.
"""
from __future__ import annotations

import heapq
from typing import Any, Callable, Iterator, List, Tuple


class Closing:
    def __init__(self, bucket_ns: int, close_after_ns: int):
        self.bucket_ns, self.close_after_ns = bucket_ns, close_after_ns
        self.heap: List[tuple] = []   # (close at ns, n, owner, bucket)
        self.n = 0                    # ties close in the order opened

    def open(self, owner: Any, i: int, empty: Callable[[], list]) -> list:
        b = owner.buckets.get(i)
        if b is None:
            b = owner.buckets[i] = empty()
            self.n += 1
            heapq.heappush(self.heap, ((i + 1) * self.bucket_ns + self.close_after_ns, self.n, owner, i))
        return b

    def due(self, now: int) -> Iterator[Tuple[Any, int, list]]:
        heap = self.heap
        while heap and heap[0][0] <= now:
            _, _, owner, i = heapq.heappop(heap)
            b = owner.buckets.pop(i, None)
            if b is not None:
                yield owner, i, b
