"""The agent's end of the CUPTI shim: a ZeroMQ PULL socket on a private ipc path, messages -> wire events.

Ranks started by `ccld run` push MessagePack messages (ccld/cupti/shim.py, v1) here; each one
becomes GpuKernel / GpuMemop events (NCCL kernel names parsed), a ProbeStatus of family "cupti"
when a rank's capture goes on or off, and GpuLoss (the shim's cumulative loss counters) when those
change, at most every LOSS_EVERY_S per rank. The rank comes from the agent's own discovery (pid ->
rank), else from the RANK the shim read in its environment. Times are already this node's
CLOCK_MONOTONIC (the shim converted them); nothing is re-stamped, except the receipt time of the
status and loss events, which are facts about now.

The socket is bound in a fresh 0700 directory, so only this user's processes can reach it; it is
bounded (RCVHWM, MAXMSGSIZE) and every message or row that does not parse is counted by reason,
never fatal. `poll()` never blocks; the agent's loop calls it every POLL_MS.
"""
from __future__ import annotations

import collections
import shutil
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional

import msgpack
import zmq

from ccld import wire as ev
from ccld.cupti import names

MSG_VERSION = 1
RCVHWM = 1000                  # messages queued for us; the shims then drop (and count) on their side
MAX_MSG_BYTES = 8 * 1024 * 1024  # a shim sends <= 4096 records (~500 KiB) a message
MAX_PER_POLL = 256             # messages handled per poll, so one flood cannot starve the BPF drain
LOSS_EVERY_S = 2.0             # a rank's GpuLoss at most this often (its counters ride on every message)
MAX_PIDS = 65_536              # per-process bookkeeping; cleared when exceeded (pids are reused, forgotten)

_KERNEL_TYPES = (int, int, int, int, int, str, int, int)
_MEMOP_TYPES = (str, int, int, int, int, int, int, int, int, int)


def _row_ok(row: Any, types: tuple) -> bool:
    return (isinstance(row, list) and len(row) == len(types)
            and all(isinstance(v, t) and not isinstance(v, bool) for v, t in zip(row, types)))


class CuptiSink:
    def __init__(self, emit: Callable[[ev.Event], None], rank_of: Callable[[int], Optional[int]] = lambda pid: None,
                 mono_ns: Callable[[], int] = time.monotonic_ns):
        self.emit, self.rank_of, self.mono_ns = emit, rank_of, mono_ns
        base = tempfile.gettempdir()
        if len(base) > 60:  # an ipc path must fit in sun_path (108 bytes)
            base = "/tmp"
        self._dir = tempfile.mkdtemp(prefix="ccld-cupti-", dir=base)  # mode 0700
        self.endpoint = f"ipc://{self._dir}/sink"
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, RCVHWM)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MSG_BYTES)
        self._sock.bind(self.endpoint)
        self.counters: Dict[str, int] = collections.Counter()  # type: ignore[assignment]
        self.ranks_on: Dict[int, str] = {}        # pid -> "on" / "off: why" / "bye" (exited)
        self._last_n: Dict[int, int] = {}
        self._loss_at: Dict[int, float] = {}
        self._loss_last: Dict[int, Dict[str, int]] = {}
        self._closed = False

    def poll(self, most: int = MAX_PER_POLL) -> int:
        """Handle what has arrived (up to `most` messages). Returns how many were handled."""
        n = 0
        while n < most and not self._closed:
            try:
                raw = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            n += 1
            self.handle(raw)
        return n

    def handle(self, raw: bytes) -> None:
        try:
            msg = msgpack.unpackb(raw, raw=False, strict_map_key=False, max_array_len=1 << 16)
        except Exception:
            self.counters["bad_msg_decode"] += 1
            return
        if not isinstance(msg, dict) or msg.get("v") != MSG_VERSION:
            self.counters["bad_msg_version"] += 1
            return
        pid, n = msg.get("pid"), msg.get("n")
        if not isinstance(pid, int) or pid <= 0 or not isinstance(n, int):
            self.counters["bad_msg_header"] += 1
            return
        self.counters["msgs"] += 1
        self._gap(pid, n)
        rank = self.rank_of(pid)
        if rank is None or rank < 0:
            env_rank = msg.get("rank")
            rank = env_rank if isinstance(env_rank, int) and not isinstance(env_rank, bool) else -1
            self.counters["rank_from_shim"] += 1
        now = self.mono_ns()
        status = msg.get("status")
        if isinstance(status, dict):
            self._status(pid, rank, status, now)
        for row in msg.get("kernels") or ():
            if not _row_ok(row, _KERNEL_TYPES):
                self.counters["bad_kernel_rows"] += 1
                continue
            start, end, dev, stream, corr, name, tid, lns = row
            k = names.parse(name)
            self.emit(ev.GpuKernel(pid=pid, rank=rank, ts_ns=start, end_ns=end, device=dev, stream=stream, corr=corr,
                                   name=name, launch_tid=tid, launch_ns=lns, nccl=k.nccl, op=k.op, redop=k.redop,
                                   dtype=k.dtype, algo=k.algo, proto=k.proto))
            self.counters["kernels"] += 1
        for row in msg.get("memops") or ():
            if not _row_ok(row, _MEMOP_TYPES) or row[0] not in ("memcpy", "memset"):
                self.counters["bad_memop_rows"] += 1
                continue
            op, start, end, dev, stream, corr, nbytes, copy_kind, tid, lns = row
            self.emit(ev.GpuMemop(pid=pid, rank=rank, ts_ns=start, end_ns=end, device=dev, stream=stream, corr=corr,
                                  op=op, nbytes=nbytes, copy_kind=copy_kind, launch_tid=tid, launch_ns=lns))
            self.counters["memops"] += 1
        counters = msg.get("counters")
        if isinstance(counters, dict):
            final = isinstance(status, dict) and status.get("state") in ("off", "bye")
            self._loss(pid, rank, counters, now, final)

    def _gap(self, pid: int, n: int) -> None:
        if len(self._last_n) >= MAX_PIDS and pid not in self._last_n:
            self._last_n.clear()
            self._loss_at.clear()
            self._loss_last.clear()
        last = self._last_n.get(pid)
        if last is not None and n > last + 1:
            self.counters["msgs_lost"] += n - last - 1  # dropped by the shim's bound or ZeroMQ's
        self._last_n[pid] = n  # n <= last: a new process that reused the pid; numbering starts over

    def announce(self) -> List[ev.ProbeStatus]:
        """The capture state of every rank whose shim is on, said again (the agent's periodic
        announcement): the shim says it once, at the rank's start, and a collector that restarted since
        (or lost that frame) would not keep the rank's NCCL enters for its kernels."""
        now = self.mono_ns()
        return [ev.ProbeStatus(pid=pid, family="cupti", ok=True, ts_ns=now, target="libcupti",
                               message="CUPTI capture on (said again)")
                for pid, state in list(self.ranks_on.items()) if state == "on"]

    def _status(self, pid: int, rank: int, status: Dict[str, Any], now: int) -> None:
        state = status.get("state")
        if state == "on":
            detail = ", ".join(f"{k} {status.get(k)}" for k in ("kernels", "api", "tids") if status.get(k))
            self.ranks_on[pid] = "on"
            self.emit(ev.ProbeStatus(pid=pid, family="cupti", ok=True, ts_ns=now, target="libcupti",
                                     message=f"CUPTI capture on ({detail})"))
        elif state == "bye":
            self.ranks_on[pid] = "bye"  # its exit flush arrived: nothing more will come from it
        elif state == "off":
            why = str(status.get("message", ""))[:300]
            self.ranks_on[pid] = f"off: {why}"
            self.emit(ev.ProbeStatus(pid=pid, family="cupti", ok=False, ts_ns=now, target="libcupti",
                                     message=f"CUPTI capture off: {why}"))

    def _loss(self, pid: int, rank: int, counters: Dict[Any, Any], now: int, final: bool) -> None:
        clean = {k: v for k, v in counters.items()
                 if isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)}
        if len(clean) != len(counters):
            self.counters["bad_counters"] += 1
        if clean == self._loss_last.get(pid):
            return
        at = self._loss_at.get(pid)
        if not final and at is not None and (now - at) / 1e9 < LOSS_EVERY_S:
            return
        self._loss_at[pid], self._loss_last[pid] = now, clean
        self.emit(ev.GpuLoss(pid=pid, rank=rank, ts_ns=now, counters=clean))

    def loss(self) -> Dict[str, int]:
        """The sink's own counters, named for the agent's LossCounters."""
        return {f"cupti_sink_{k}": int(v) for k, v in list(self.counters.items())}  # read from the shipper thread

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sock.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
