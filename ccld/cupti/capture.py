"""In-process CUPTI activity capture: which kinds are on, and the buffer callbacks that copy records out.

`cupti` is passed in (the real `from cupti import cupti`, or a fake with the same names and record
shapes), so everything here runs in unit tests without a GPU. Enabled: CONCURRENT_KERNEL always; the
launch API records (runtime and driver `*Launch*`, so a kernel's correlation id names the host
thread and time that launched it); MEMCPY/MEMSET when asked. Only launch call ids are switched on
(`activity_enable_runtime_api`/`_driver_api`); where that is missing or refused, the whole RUNTIME and
DRIVER kinds are, and only launch records are kept.

The completed-buffer callback runs on a CUPTI thread (or in whoever calls `flush`). The record
objects it is handed wrap CUPTI's buffer, which is freed when it returns: fields are copied into
plain tuples at once, filtered (NCCL kernels only by default), and appended to a bounded queue.
The callback never blocks and never raises into CUPTI: a full queue drops and counts, an exception
is kept in `error` for the shim to act on. Timestamps stay CUPTI ns here (see clock.py).
"""
from __future__ import annotations

import collections
import ctypes
import dataclasses
import threading
from dataclasses import dataclass
from typing import Any, Deque, Dict, Iterable, List, Optional, Set, Tuple

from ccld.cupti.names import NCCL_PREFIX_SPAN

BUFFER_BYTES = 4 * 1024 * 1024   # per CUPTI host buffer: ~16k kernel records (248 B each); freed on completion
MAX_QUEUED = 200_000             # copied records waiting for the sender (~25 MiB); beyond: dropped, counted
MAX_NAME_CHARS = 256             # NCCL names are < 100 chars; templated compute kernels can be thousands

# Record tuples put on the queue (first item is the tag).
REC_KERNEL = 1  # (tag, start, end, device_id, stream_id, correlation_id, name)
REC_API = 2     # (tag, correlation_id, thread_id, start, end, cbid)
REC_MEMCPY = 3  # (tag, start, end, device_id, stream_id, correlation_id, bytes, copy_kind)
REC_MEMSET = 4  # (tag, start, end, device_id, stream_id, correlation_id, bytes, 0)

KERNEL_MODES = ("nccl", "all")


@dataclass(frozen=True)
class CaptureConfig:
    kernels: str = "nccl"        # "nccl": NCCL kernels only; "all": every kernel
    memcpy: bool = False
    memset: bool = False
    buffer_bytes: int = BUFFER_BYTES
    max_queued: int = MAX_QUEUED


def _is_launch(name: str) -> bool:
    return "Launch" in name and "HostFunc" not in name


def _is_memop(name: str) -> bool:
    return name.startswith(("cudaMemcpy", "cudaMemset", "cuMemcpy", "cuMemset"))


def _cbids(enum: Any, want) -> Set[int]:
    """Call ids of an enum (runtime_api_trace_cbid / driver_api_trace_cbid) whose names `want` accepts."""
    members = getattr(enum, "__members__", {})
    return {int(v) for n, v in members.items() if want(n)}


class RecordQueue:
    """Bounded FIFO of record tuples between the CUPTI callback and the sender thread."""

    def __init__(self, limit: int):
        self.limit = limit
        self._q: Deque[tuple] = collections.deque()
        self.dropped = 0

    def put(self, rec: tuple) -> None:
        if len(self._q) >= self.limit:
            self.dropped += 1
        else:
            self._q.append(rec)

    def drain(self, most: int = 1 << 62) -> List[tuple]:
        out, q = [], self._q
        while q and len(out) < most:
            out.append(q.popleft())
        return out

    def __len__(self) -> int:
        return len(self._q)


class Capture:
    def __init__(self, cupti: Any, config: CaptureConfig = CaptureConfig(), queue: Optional[RecordQueue] = None):
        if config.kernels not in KERNEL_MODES:
            raise ValueError(f"CaptureConfig.kernels must be one of {KERNEL_MODES}, not {config.kernels!r}")
        self.cupti, self.config = cupti, config
        self.queue = queue if queue is not None else RecordQueue(config.max_queued)
        K = cupti.ActivityKind
        self.kind_kernel = {int(K.CONCURRENT_KERNEL), int(K.KERNEL)}
        self.kind_api = {int(K.RUNTIME), int(K.DRIVER)}
        self.kind_memcpy, self.kind_memset = int(K.MEMCPY), int(K.MEMSET)
        self.runtime_launch = _cbids(cupti.runtime_api_trace_cbid, _is_launch)
        self.driver_launch = _cbids(cupti.driver_api_trace_cbid, _is_launch)
        if config.memcpy or config.memset:
            self.runtime_launch |= _cbids(cupti.runtime_api_trace_cbid, _is_memop)
            self.driver_launch |= _cbids(cupti.driver_api_trace_cbid, _is_memop)
        self.wanted_cbids = self.runtime_launch | self.driver_launch
        self.enabled: List[Any] = []      # activity kinds switched on, to switch off in stop()
        self.api_mode = ""                # "selective" (launch call ids only) or "all" (whole kinds)
        self.thread_ids = ""              # "system" (gettid, matches BPF) or "default" (pthread ids)
        self.error: Optional[BaseException] = None  # first exception inside a callback
        self._lock = threading.Lock()
        self.counters: Dict[str, int] = collections.Counter(  # type: ignore[assignment]
            dict.fromkeys(("records", "kernels", "kernels_filtered", "api", "cupti_dropped", "callback_errors"), 0))
        self._cupti_dropped = ctypes.c_size_t(0)

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Register the callbacks and switch the kinds on. Raises what CUPTI raises (no GPU, no driver)."""
        c, K = self.cupti, self.cupti.ActivityKind
        try:  # CUPTI's default thread id is pthread_self(); SYSTEM is gettid(), what BPF's tid is
            c.set_thread_id_type(c.ActivityThreadIdType.SYSTEM)
            self.thread_ids = "system"
        except Exception:
            self.thread_ids = "default"
        c.activity_register_callbacks(self._requested, self._completed)
        self._enable(K.CONCURRENT_KERNEL)
        if self.config.memcpy:
            self._enable(K.MEMCPY)
        if self.config.memset:
            self._enable(K.MEMSET)
        try:
            for cbid in sorted(self.runtime_launch):
                c.activity_enable_runtime_api(cbid, 1)
            for cbid in sorted(self.driver_launch):
                c.activity_enable_driver_api(cbid, 1)
            self.api_mode = "selective"
        except Exception:
            self.widen_launch_api()

    def widen_launch_api(self) -> None:
        """Switch on the whole RUNTIME and DRIVER kinds (launch records are still the only ones kept)."""
        if self.api_mode == "all":
            return
        K = self.cupti.ActivityKind
        self._enable(K.RUNTIME)
        self._enable(K.DRIVER)
        self.api_mode = "all"

    def pause(self) -> None:
        """Switch every kind (and the launch call ids) off, keep the callbacks: resume() turns them on again.
        For alternating on/off windows in one process (bench/cupti_overhead.py)."""
        c = self.cupti
        for kind in reversed(self.enabled):
            c.activity_disable(kind)
        if self.api_mode == "selective":
            for cbid in sorted(self.runtime_launch):
                c.activity_enable_runtime_api(cbid, 0)
            for cbid in sorted(self.driver_launch):
                c.activity_enable_driver_api(cbid, 0)
        self.flush(forced=True)

    def resume(self, kernels: Optional[str] = None) -> None:
        """Switch back on what start() (and widen_launch_api()) had on; `kernels` changes the filter."""
        if kernels is not None:
            if kernels not in KERNEL_MODES:
                raise ValueError(f"kernels must be one of {KERNEL_MODES}, not {kernels!r}")
            self.config = dataclasses.replace(self.config, kernels=kernels)
        c = self.cupti
        for kind in self.enabled:
            c.activity_enable(kind)
        if self.api_mode == "selective":
            for cbid in sorted(self.runtime_launch):
                c.activity_enable_runtime_api(cbid, 1)
            for cbid in sorted(self.driver_launch):
                c.activity_enable_driver_api(cbid, 1)

    def _enable(self, kind: Any) -> None:
        self.cupti.activity_enable(kind)
        self.enabled.append(kind)

    def flush(self, forced: bool = True) -> None:
        """Have CUPTI hand over its buffers now; forced also hands over partly filled ones."""
        self.cupti.activity_flush_all(int(self.cupti.ActivityFlag.FLUSH_FORCED) if forced else 0)

    def stop(self, finalize: bool = True) -> None:
        """Switch every kind off, hand over the last records, detach CUPTI. Each step is tried even
        when an earlier one fails; the first failure is raised at the end."""
        first: Optional[BaseException] = None
        steps = [lambda k=k: self.cupti.activity_disable(k) for k in reversed(self.enabled)]
        steps.append(lambda: self.flush(forced=True))
        if finalize:
            steps.append(self.cupti.finalize)  # no buffer callback into Python after this (interpreter exit)
        self.enabled = []
        for step in steps:
            try:
                step()
            except Exception as e:
                first = first or e
        if first is not None:
            raise first

    def cupti_dropped(self) -> int:
        """Records CUPTI dropped for want of buffer space, cumulative (it reports them since last asked).
        The binding takes a pointer to a size_t for the out-value (see docs/cupti.md). A counter must
        not cost the capture: if the query fails, it is counted (dropped_query_errors) and not asked again."""
        if self.counters.get("dropped_query_errors"):
            return self.counters["cupti_dropped"]
        self._cupti_dropped.value = 0
        try:
            got = self.cupti.activity_get_num_dropped_records(0, 0, ctypes.addressof(self._cupti_dropped))
        except Exception:
            with self._lock:
                self.counters["dropped_query_errors"] += 1
            return self.counters["cupti_dropped"]
        n = got if isinstance(got, int) and not isinstance(got, bool) and got > 0 else self._cupti_dropped.value
        if n:
            with self._lock:
                self.counters["cupti_dropped"] += n
        return self.counters["cupti_dropped"]

    # -- the two CUPTI callbacks -----------------------------------------------------------------
    def _requested(self) -> Tuple[int, int]:
        """An empty buffer: (size in bytes, max records; 0 = as many as fit)."""
        with self._lock:
            self.counters["buffers_requested"] += 1
        return self.config.buffer_bytes, 0

    def _completed(self, activities: Iterable[Any]) -> None:
        try:
            with self._lock:
                self._copy(activities)
        except BaseException as e:  # never into CUPTI's thread; the shim sees `error` and turns capture off
            self.counters["callback_errors"] += 1
            if self.error is None:
                self.error = e

    def _copy(self, activities: Iterable[Any]) -> None:
        put, cnt = self.queue.put, self.counters
        nccl_only = self.config.kernels == "nccl"
        k_kernel, k_api, k_memcpy, k_memset = self.kind_kernel, self.kind_api, self.kind_memcpy, self.kind_memset
        wanted = self.wanted_cbids
        cnt["buffers"] += 1
        n = 0
        for a in activities:
            n += 1
            kind = a.kind
            if kind in k_kernel:
                name = a.name or ""
                if nccl_only and "nccl" not in name[:NCCL_PREFIX_SPAN]:
                    cnt["kernels_filtered"] += 1
                    continue
                cnt["kernels"] += 1
                put((REC_KERNEL, a.start, a.end, a.device_id, a.stream_id, a.correlation_id, name[:MAX_NAME_CHARS]))
            elif kind in k_api:
                cbid = a.cbid
                if cbid not in wanted:
                    cnt["api_ignored"] += 1
                    continue
                cnt["api"] += 1
                put((REC_API, a.correlation_id, a.thread_id, a.start, a.end, cbid))
            elif kind == k_memcpy:
                cnt["memcpy"] += 1
                put((REC_MEMCPY, a.start, a.end, a.device_id, a.stream_id, a.correlation_id, a.bytes, a.copy_kind))
            elif kind == k_memset:
                cnt["memset"] += 1
                put((REC_MEMSET, a.start, a.end, a.device_id, a.stream_id, a.correlation_id, a.bytes, 0))
            else:
                cnt["other_kinds"] += 1
        cnt["records"] += n

    def snapshot(self) -> Dict[str, int]:
        """Cumulative counters (queue drops included), for shipping."""
        with self._lock:
            out = dict(self.counters)
        out["queue_dropped"] = self.queue.dropped
        return out
