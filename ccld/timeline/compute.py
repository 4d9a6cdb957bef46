"""Compute spans per rank: how long each rank took for each run of each named compute op.

The source is the ComputeSpan event: a compute span of a per-op table or a trace
(ccld/diagnose/opframes.py writes them: its `compute` rows, Kineto's record_function ranges), `name`
the op, `ts_ns`/`end_ns` its span. CUPTI's compute kernels (GpuKernel) are not kept here: one kernel name runs at many shapes, so their durations do not compare across
ranks without the shapes (timeline/gpu.py counts them).
Per job and op, each rank's spans in the order they ended, numbered from 1 on that rank: the n-th run
of an op on one rank is compared with the n-th on the others (diagnose/compute.py). Times: Unix s.
Bounds: MAX_SPANS spans per (job, op, rank), MAX_OPS op names per job; beyond them, counted.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Deque, Dict, Tuple

COMPUTE_DEVICE = -1   # the device the export draws compute spans under (their own track, no GPU)
MAX_SPANS = 4096      # per (job, op, rank): minutes of a step-per-100-ms job, more than the detector's window
MAX_OPS = 256         # op names per job (a trace's record_function names); more are counted, not kept


@dataclass
class ComputeOp:
    """One op's spans: rank -> (run number, start, end), oldest first; `count` runs seen per rank."""
    spans: Dict[int, Deque[Tuple[int, float, float]]] = field(default_factory=dict)
    count: Dict[int, int] = field(default_factory=dict)
    added: int = 0        # spans added in all: unchanged means nothing new to look at


class ComputeTable:
    def __init__(self, anomalies: collections.Counter) -> None:
        self.jobs: Dict[str, Dict[str, ComputeOp]] = {}
        self.anomalies = anomalies
        self.spans = 0

    def add(self, job: str, rank: int, op: str, start: float, end: float) -> None:
        ops = self.jobs.setdefault(job, {})
        o = ops.get(op)
        if o is None:
            if len(ops) >= MAX_OPS:
                self.anomalies["compute-ops-over-bound"] += 1
                return
            o = ops[op] = ComputeOp()
        q = o.spans.get(rank)
        if q is None:
            q = o.spans[rank] = collections.deque(maxlen=MAX_SPANS)
        n = o.count[rank] = o.count.get(rank, 0) + 1
        q.append((n, start, max(start, end)))
        o.added += 1
        self.spans += 1
