"""A fake `cupti.cupti` for tests without a GPU: the same names, call shapes and record fields.

What it copies from cupti-python 13.x (checked against the installed module by
tests/unit/test_cupti_fake_matches.py): enums ActivityKind, ActivityFlag, ActivityThreadIdType,
runtime_api_trace_cbid, driver_api_trace_cbid (launch ids with their real values); the functions
ccld calls; records carrying the real attribute names of ActivityKernel13, ActivityAPI,
ActivityMemcpy7 and ActivityMemset4; callbacks called as `requested() -> (size, max_records)` and
`completed(activities)`. A simulated GPU: `launch()` makes a launch API record (in the calling
thread, like CUPTI) and the kernel's record; `activity_flush_all()` hands them over, in buffers of
`buffer_size // RECORD_BYTES` records, optionally out of order or with the launch records one flush
late; records beyond `device_capacity` between flushes are dropped and reported by
`activity_get_num_dropped_records`, as CUPTI does when its buffers are full. Faults: `fail_at`
("start", "flush", "exit", "callback", "hang-exit") makes that step raise or hang.

The fake clock is CLOCK_MONOTONIC + `offset_ns` (+ `drift_ppm`), so tests can check the conversion.
Used as a module too (CCLD_CUPTI_MODULE=fake_cupti in a child process): the module's attributes are
those of one FakeCupti configured from FAKE_CUPTI_* environment variables.
"""
from __future__ import annotations

import ctypes
import enum
import os
import random
import threading
import time
from typing import Any, Callable, List, Optional


class NotSupportedError(RuntimeError):
    """Same name and base as cupti._internal.utils.NotSupportedError (raised without a driver)."""


class ActivityKind(enum.IntEnum):
    INVALID = 0
    MEMCPY = 1
    MEMSET = 2
    KERNEL = 3
    DRIVER = 4
    RUNTIME = 5
    CONCURRENT_KERNEL = 10
    OVERHEAD = 17
    EXTERNAL_CORRELATION = 39


class ActivityFlag(enum.IntEnum):
    NONE = 0
    FLUSH_FORCED = 1


class ActivityThreadIdType(enum.IntEnum):
    DEFAULT = 0
    SYSTEM = 1


class runtime_api_trace_cbid(enum.IntEnum):  # noqa: N801 (the real enum's alias is lower case)
    cudaLaunch_v3020 = 13
    cudaMemcpy_v3020 = 31
    cudaMemcpyAsync_v3020 = 41
    cudaMemsetAsync_v3020 = 51
    cudaLaunchKernel_v7000 = 211
    cudaLaunchKernel_ptsz_v7000 = 214
    cudaLaunchHostFunc_v10000 = 284
    cudaGraphLaunch_v10000 = 311
    cudaLaunchKernelExC_v11060 = 430
    cudaStreamSynchronize_v3020 = 131


class driver_api_trace_cbid(enum.IntEnum):  # noqa: N801
    cuLaunchKernel = 307
    cuLaunchKernel_ptsz = 442
    cuLaunchHostFunc = 527
    cuLaunchKernelEx = 652
    cuCtxSynchronize = 17


RECORD_BYTES = 248  # sizeof(CUpti_ActivityKernel13), the real activity_kernel13_dtype.itemsize


class ActivityKernel13:
    FIELDS = ("kind", "start", "end", "completed", "queued", "submitted", "device_id", "context_id",
              "stream_id", "correlation_id", "grid_id", "name", "graph_id", "channel_id")
    __slots__ = FIELDS

    def __init__(self, **kw):
        for f in self.FIELDS:
            setattr(self, f, kw.get(f, "" if f == "name" else 0))


class ActivityAPI:
    FIELDS = ("kind", "cbid", "start", "end", "process_id", "thread_id", "correlation_id", "return_value")
    __slots__ = FIELDS

    def __init__(self, **kw):
        for f in self.FIELDS:
            setattr(self, f, kw.get(f, 0))


class ActivityMemcpy7:
    FIELDS = ("kind", "copy_kind", "src_kind", "dst_kind", "bytes", "start", "end", "device_id", "context_id",
              "stream_id", "correlation_id", "runtime_correlation_id", "graph_id", "channel_id")
    __slots__ = FIELDS

    def __init__(self, **kw):
        for f in self.FIELDS:
            setattr(self, f, kw.get(f, 0))


class ActivityMemset4:
    FIELDS = ("kind", "value", "bytes", "start", "end", "device_id", "context_id", "stream_id",
              "correlation_id", "memory_kind", "graph_id", "channel_id")
    __slots__ = FIELDS

    def __init__(self, **kw):
        for f in self.FIELDS:
            setattr(self, f, kw.get(f, 0))


class FakeCupti:
    NotSupportedError = NotSupportedError
    ActivityKind = ActivityKind
    ActivityFlag = ActivityFlag
    ActivityThreadIdType = ActivityThreadIdType
    runtime_api_trace_cbid = runtime_api_trace_cbid
    driver_api_trace_cbid = driver_api_trace_cbid
    ActivityKernel13, ActivityAPI = ActivityKernel13, ActivityAPI
    ActivityMemcpy7, ActivityMemset4 = ActivityMemcpy7, ActivityMemset4

    def __init__(self, *, no_gpu: bool = False, offset_ns: int = 7_000_000_000_000, drift_ppm: float = 0.0,
                 buffer_records: Optional[int] = None, device_capacity: int = 1 << 30, order: str = "in-order",
                 api_late: bool = False, fail_at: str = "", selective_api: bool = True,
                 selective_effective: bool = True, seed: int = 1,
                 record_factory: Optional[Callable[[str, dict], Any]] = None):
        self.no_gpu, self.offset_ns, self.drift_ppm = no_gpu, offset_ns, drift_ppm
        self.device_capacity, self.order, self.api_late = device_capacity, order, api_late
        self.fail_at, self.selective_api = fail_at, selective_api
        self.selective_effective = selective_effective  # False: per-call-id enabling is accepted but yields nothing
        self.buffer_records = buffer_records
        self.record_factory = record_factory
        self.rng = random.Random(seed)
        self.t0 = time.monotonic_ns()
        self.enabled: set = set()
        self.runtime_ids: set = set()
        self.driver_ids: set = set()
        self.tid_type = ActivityThreadIdType.DEFAULT
        self.requested = self.completed = None
        self.pending: List[Any] = []
        self.late_api: List[Any] = []
        self.dropped_since = 0
        self.next_corr = 1
        self.finalized = False
        self.calls: List[str] = []
        self.lock = threading.Lock()

    @classmethod
    def from_env(cls, env=os.environ) -> "FakeCupti":
        return cls(no_gpu=env.get("FAKE_CUPTI_NO_GPU") == "1", fail_at=env.get("FAKE_CUPTI_FAIL", ""),
                   selective_api=env.get("FAKE_CUPTI_SELECTIVE", "1") == "1")

    # -- the CUPTI calls ccld makes ---------------------------------------------------------------
    def _gate(self, call: str) -> None:
        self.calls.append(call)
        if self.no_gpu:
            raise NotSupportedError("CUDA driver is not found (libcuda.so.1: cannot open shared object file: "
                                    "No such file or directory)")

    def get_timestamp(self) -> int:
        self._gate("get_timestamp")
        return self._now()

    def _now(self) -> int:
        mono = time.monotonic_ns()
        return mono + self.offset_ns + int((mono - self.t0) * self.drift_ppm / 1e6)

    def set_thread_id_type(self, t) -> None:
        self._gate("set_thread_id_type")
        self.tid_type = ActivityThreadIdType(int(t))

    def activity_register_callbacks(self, requested, completed) -> None:
        self._gate("activity_register_callbacks")
        if self.fail_at == "start":
            raise RuntimeError("fake CUPTI: CUPTI_ERROR_NOT_INITIALIZED at start")
        self.requested, self.completed = requested, completed

    def activity_enable(self, kind) -> None:
        self._gate("activity_enable")
        self.enabled.add(int(kind))

    def activity_disable(self, kind) -> None:
        self._gate("activity_disable")
        if self.fail_at == "exit":
            raise RuntimeError("fake CUPTI: CUPTI_ERROR_UNKNOWN at disable")
        self.enabled.discard(int(kind))

    def activity_enable_runtime_api(self, cbid, enable) -> None:
        self._gate("activity_enable_runtime_api")
        if not self.selective_api:
            raise RuntimeError("fake CUPTI: CUPTI_ERROR_NOT_SUPPORTED")
        (self.runtime_ids.add if enable else self.runtime_ids.discard)(int(cbid))

    def activity_enable_driver_api(self, cbid, enable) -> None:
        self._gate("activity_enable_driver_api")
        if not self.selective_api:
            raise RuntimeError("fake CUPTI: CUPTI_ERROR_NOT_SUPPORTED")
        (self.driver_ids.add if enable else self.driver_ids.discard)(int(cbid))

    def activity_flush_all(self, flag) -> None:
        self._gate("activity_flush_all")
        if self.fail_at == "flush":
            raise RuntimeError("fake CUPTI: CUPTI_ERROR_UNKNOWN in flush")
        if self.fail_at == "hang-exit" and not self.enabled:
            threading.Event().wait()  # the exit flush never returns (a wedged driver)
        with self.lock:
            recs, self.pending = self.pending, []
            if not self.api_late:
                recs += self.late_api
                self.late_api = []
        if self.order == "reversed":
            recs.reverse()
        elif self.order == "shuffled":
            self.rng.shuffle(recs)
        if self.api_late:  # this flush's launch records arrive with the next flush
            is_api = [int(r.kind) in (ActivityKind.RUNTIME, ActivityKind.DRIVER) for r in recs]
            with self.lock:
                recs, self.late_api = ([r for r, a in zip(recs, is_api) if not a] + self.late_api,
                                       [r for r, a in zip(recs, is_api) if a])
        while recs:
            size, _max = self.requested()
            cap = self.buffer_records or max(1, size // RECORD_BYTES)
            chunk, recs = recs[:cap], recs[cap:]
            if self.fail_at == "callback":
                chunk = chunk + [object()]  # a record without the fields: the callback must not raise
            self.completed(chunk)

    def activity_get_num_dropped_records(self, context, stream_id, dropped_ptr) -> None:
        self._gate("activity_get_num_dropped_records")
        with self.lock:
            n, self.dropped_since = self.dropped_since, 0
        ctypes.c_size_t.from_address(dropped_ptr).value = n

    def finalize(self) -> None:
        self._gate("finalize")
        if self.fail_at == "exit":
            raise RuntimeError("fake CUPTI: CUPTI_ERROR_UNKNOWN in finalize")
        self.finalized = True

    # -- the simulated GPU ------------------------------------------------------------------------
    def _record(self, cls_name: str, **fields) -> Any:
        if self.record_factory is not None:
            return self.record_factory(cls_name, fields)
        return globals()[cls_name](**fields)

    def _tid(self) -> int:
        if self.tid_type == ActivityThreadIdType.SYSTEM:
            return threading.get_native_id()
        return threading.get_ident() & 0xFFFFFFFF  # pthread_self(), as CUPTI's default reports it

    def _queue(self, rec) -> None:
        with self.lock:
            if len(self.pending) >= self.device_capacity:
                self.dropped_since += 1
            else:
                self.pending.append(rec)

    def launch(self, name: str, stream: int = 7, duration_ns: int = 50_000, device: int = 0,
               api: str = "runtime", gpu_delay_ns: int = 20_000, memop: str = "", nbytes: int = 0) -> int:
        """A launch from the calling thread: its API record now, its GPU record after gpu_delay_ns.
        Returns the correlation id. Nothing is recorded for kinds that are not enabled."""
        corr, self.next_corr = self.next_corr, self.next_corr + 1
        start = self._now()
        cb = {"runtime": (runtime_api_trace_cbid.cudaLaunchKernel_v7000, ActivityKind.RUNTIME, self.runtime_ids),
              "driver": (driver_api_trace_cbid.cuLaunchKernelEx, ActivityKind.DRIVER, self.driver_ids),
              "memcpy": (runtime_api_trace_cbid.cudaMemcpyAsync_v3020, ActivityKind.RUNTIME, self.runtime_ids),
              "memset": (runtime_api_trace_cbid.cudaMemsetAsync_v3020, ActivityKind.RUNTIME, self.runtime_ids)}[api]
        cbid, akind, selected = cb
        if int(akind) in self.enabled or (self.selective_effective and int(cbid) in selected):
            self._queue(self._record("ActivityAPI", kind=int(akind), cbid=int(cbid), start=start, end=start + 3_000,
                                     process_id=os.getpid(), thread_id=self._tid(), correlation_id=corr))
        g0 = start + gpu_delay_ns
        if memop == "memcpy" and int(ActivityKind.MEMCPY) in self.enabled:
            self._queue(self._record("ActivityMemcpy7", kind=int(ActivityKind.MEMCPY), copy_kind=8, bytes=nbytes,
                                     start=g0, end=g0 + duration_ns, device_id=device, stream_id=stream,
                                     correlation_id=corr))
        elif memop == "memset" and int(ActivityKind.MEMSET) in self.enabled:
            self._queue(self._record("ActivityMemset4", kind=int(ActivityKind.MEMSET), bytes=nbytes, start=g0,
                                     end=g0 + duration_ns, device_id=device, stream_id=stream, correlation_id=corr))
        elif not memop and int(ActivityKind.CONCURRENT_KERNEL) in self.enabled:
            self._queue(self._record("ActivityKernel13", kind=int(ActivityKind.CONCURRENT_KERNEL), start=g0,
                                     end=g0 + duration_ns, device_id=device, stream_id=stream, correlation_id=corr,
                                     name=name))
        return corr


_default: Optional[FakeCupti] = None


def default() -> FakeCupti:
    global _default
    if _default is None:
        _default = FakeCupti.from_env()
    return _default


def __getattr__(name: str):  # the module stands for one FakeCupti (CCLD_CUPTI_MODULE=fake_cupti)
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(default(), name)
