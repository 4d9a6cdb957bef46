"""The CUPTI shim inside a traced rank: capture, convert, and push records to the node agent.

Started by `ccld run`'s sitecustomize (ccld/cupti/site/) in each rank process of the job, before
the job's own code. Every FLUSH_INTERVAL_S a daemon thread forces CUPTI to hand over its buffers,
ties kernels to their launches, converts CUPTI ns to CLOCK_MONOTONIC ns (clock.py, the one place),
and sends MessagePack messages over a ZeroMQ PUSH socket (ipc, bounded, never blocking) to the
agent's CuptiSink. Cumulative counters (CUPTI drops, queue drops, send drops, filtered kernels)
ride on every message.

The job comes first: any error (no GPU, CUPTI refuses, a callback raises, a flush fails, the exit
flush fails or hangs) turns capture off with ONE warning line on stderr and the job goes on. At
exit the last flush runs in a helper thread bounded by EXIT_TIMEOUT_S. A forked child (DataLoader
worker) neither captures nor touches the parent's socket; a child process started later inherits
CCLD_CUPTI_OWNER and stays out, so each rank is captured once.

Message (v1): {"v": 1, "pid", "rank", "n": message number, "kernels": [[start, end, device, stream,
corr, name, launch_tid, launch_ns]...], "memops": [[op, start, end, device, stream, corr, bytes,
copy_kind, launch_tid, launch_ns]...], "counters": {...}, "status": {...} (first, failure, last)}.
"""
from __future__ import annotations

import atexit
import importlib
import os
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional

from ccld.cupti.capture import REC_KERNEL, REC_MEMCPY, Capture, CaptureConfig
from ccld.cupti.clock import CuptiClock
from ccld.cupti.correlate import LaunchCorrelator

MSG_VERSION = 1
FLUSH_INTERVAL_S = 0.5      # forced flush period: GPU times reach the collector within ~1 s
MAX_RECORDS_PER_MSG = 4096  # ~400 KiB messages at most; the sink refuses bigger than MAX_MSG_BYTES
SNDHWM = 32                 # messages ZeroMQ may hold for the agent; beyond: dropped and counted
EXIT_TIMEOUT_S = 3.0        # the exit flush may take this long before the job is let go without it
EXIT_LINGER_MS = 300        # not 0: linger 0 would throw away the exit flush; bounded, so exit cannot hang
FALLBACK_AFTER = 16         # kernels seen without a single launch record before the whole API kinds go on

ENV_ENDPOINT = "CCLD_CUPTI_ENDPOINT"  # ipc:// endpoint of the agent's sink; set by `ccld run`
ENV_MODE = "CCLD_CUPTI"               # "nccl" (default) | "all", "+memcpy", "+memset"; "off"
ENV_MODULE = "CCLD_CUPTI_MODULE"      # module to use as CUPTI (default cupti.cupti); tests name a fake
ENV_FORCE = "CCLD_CUPTI_FORCE"        # "1": skip the /dev/nvidia* check (tests, odd device paths)
ENV_OWNER = "CCLD_CUPTI_OWNER"        # pid of the process of this tree that captures


def parse_mode(text: str) -> Optional[CaptureConfig]:
    """"nccl", "all", "all+memcpy+memset", "nccl,memset" -> a config; "off" -> None. ValueError if odd."""
    toks = [t.strip().lower() for t in text.replace(",", "+").split("+") if t.strip()] or ["nccl"]
    if toks == ["off"]:
        return None
    kernels = "nccl"
    if toks[0] in ("nccl", "all"):
        kernels = toks.pop(0)
    bad = [t for t in toks if t not in ("memcpy", "memset")]
    if bad:
        raise ValueError(f"{ENV_MODE}={text!r}: unknown part {bad[0]!r} (use nccl|all, +memcpy, +memset, or off)")
    return CaptureConfig(kernels=kernels, memcpy="memcpy" in toks, memset="memset" in toks)


def gpu_present(environ: Mapping[str, str]) -> bool:
    """A cheap test that touches no CUDA library: device nodes exist and CUDA_VISIBLE_DEVICES hides nothing."""
    if environ.get("CUDA_VISIBLE_DEVICES", "x").strip() in ("", "-1"):
        return False
    return os.path.exists("/dev/nvidiactl") or any(n.startswith("nvidia") and n[6:].isdigit()
                                                   for n in _listdir("/dev"))


def _listdir(path: str) -> List[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def should_start(environ: Mapping[str, str], pid: int) -> bool:
    """Capture in this process? Only in a rank (RANK set, as the agent identifies ranks), not in a
    descendant of a process that already captures, and only where a GPU is visible."""
    if not environ.get(ENV_ENDPOINT) or "RANK" not in environ:
        return False
    owner = environ.get(ENV_OWNER)
    if owner and owner != str(pid):
        return False
    if environ.get(ENV_MODE, "nccl").strip().lower() == "off":
        return False
    return environ.get(ENV_FORCE) == "1" or gpu_present(environ)


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _stderr_line(line: str) -> None:
    try:  # fd 2, not sys.stderr: the job may have replaced or closed that object
        os.write(2, (line + "\n").encode(errors="replace"))
    except OSError:
        pass


class Shim:
    def __init__(self, cupti: Any, endpoint: str, config: CaptureConfig = CaptureConfig(), rank: int = -1,
                 flush_interval_s: float = FLUSH_INTERVAL_S, say: Callable[[str], None] = _stderr_line,
                 mono_ns: Callable[[], int] = time.monotonic_ns):
        self.cupti, self.endpoint, self.config, self.rank = cupti, endpoint, config, rank
        self.flush_interval_s = flush_interval_s
        self.say, self.mono_ns = say, mono_ns
        self.pid = os.getpid()
        self.capture = Capture(cupti, config)
        self.clock = CuptiClock(cupti.get_timestamp, mono_ns)
        self.corr = LaunchCorrelator()
        self.disabled = False
        self.warned = False
        self.counters: Dict[str, int] = {"msgs_sent": 0, "msgs_dropped": 0, "records_dropped_send": 0,
                                         "launch_api_widened": 0}
        self._n = 0
        self._status: Optional[Dict[str, Any]] = None
        self._stop = threading.Event()
        self._tick_lock = threading.Lock()
        self._send_lock = threading.Lock()  # a ZeroMQ socket is used by one thread at a time
        self._thread: Optional[threading.Thread] = None
        self._ctx = self._sock = None
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> "Shim":
        """Open the socket, switch CUPTI on, start the sender. On any error: off, one line, no raise."""
        atexit.register(self.shutdown)  # first: even a failed start closes its socket at exit
        try:
            import zmq
            self._ctx = zmq.Context(io_threads=1)
            self._sock = self._ctx.socket(zmq.PUSH)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.SNDHWM, SNDHWM)  # the bound; a send beyond it is dropped, counted
            self._sock.connect(self.endpoint)
            if not self.clock.sample():
                raise RuntimeError("could not read a CUPTI/monotonic clock pair")
            self.capture.start()
        except BaseException as e:
            self.fail("start", e)
            return self
        self._status = {"state": "on", "message": "", "kernels": self.config.kernels,
                        "api": self.capture.api_mode, "tids": self.capture.thread_ids}
        try:
            self._send({"kernels": [], "memops": []})  # the agent hears "on" now, not at the first flush
        except BaseException as e:
            self.fail("start", e)
            return self
        self._thread = threading.Thread(target=self._loop, name="ccld-cupti", daemon=True)
        self._thread.start()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._forked)
        return self

    def _forked(self) -> None:
        self.disabled = True  # the child has no sender thread, and must not use the parent's socket

    def _loop(self) -> None:
        while not self._stop.wait(self.flush_interval_s):
            if self.disabled:
                return
            try:
                self.tick()
            except BaseException as e:
                self.fail("flush", e)
                return

    def tick(self, final: bool = False) -> None:
        """One flush: CUPTI buffers -> correlated, converted records -> messages."""
        with self._tick_lock:
            if self.capture.error is not None:
                raise RuntimeError(f"CUPTI buffer callback: {type(self.capture.error).__name__}: "
                                   f"{self.capture.error}")
            self.clock.sample()
            if not final:
                self.capture.flush(forced=True)
            now = self.mono_ns()
            for rec in self.capture.queue.drain():
                self.corr.add(rec, now)
            self.corr.expire(now, everything=final)
            kernels, memops = self._convert(self.corr.take())
            self._maybe_widen()
            self.capture.cupti_dropped()
            self._send_all(kernels, memops)

    def _convert(self, ready) -> tuple:
        to_mono = self.clock.to_mono
        kernels: List[list] = []
        memops: List[list] = []
        for rec, launch in ready:
            tid, lts = launch if launch is not None else (0, 0)
            lns = to_mono(lts) if lts else 0
            if rec[0] == REC_KERNEL:
                _, start, end, dev, stream, corr, name = rec
                kernels.append([to_mono(start), to_mono(end), dev, stream, corr, name, tid, lns])
            else:
                _, start, end, dev, stream, corr, nbytes, copy_kind = rec
                op = "memcpy" if rec[0] == REC_MEMCPY else "memset"
                memops.append([op, to_mono(start), to_mono(end), dev, stream, corr, nbytes, copy_kind, tid, lns])
        self.counters["kernels_out"] = self.counters.get("kernels_out", 0) + len(kernels)
        return kernels, memops

    def _maybe_widen(self) -> None:
        """If kernels come but not one launch record with them (a CUPTI whose per-call-id switch needs
        the whole kind on), switch the RUNTIME and DRIVER kinds on, once."""
        c = self.capture.counters
        if (self.capture.api_mode == "selective" and not c["api"]
                and c["kernels"] + c["kernels_filtered"] >= FALLBACK_AFTER):
            self.capture.widen_launch_api()
            self.counters["launch_api_widened"] = 1

    def _snapshot(self) -> Dict[str, int]:
        out = self.capture.snapshot()
        out.update(self.corr.counters)
        out.update(self.counters)
        out["clock_rejected"], out["clock_steps"] = self.clock.rejected, self.clock.steps
        out["pending_launch"] = self.corr.pending()
        return {k: int(v) for k, v in out.items()}

    def _send_all(self, kernels: List[list], memops: List[list]) -> None:
        first = True
        while first or kernels or memops:
            first = False
            k, kernels = kernels[:MAX_RECORDS_PER_MSG], kernels[MAX_RECORDS_PER_MSG:]
            m, memops = memops[:MAX_RECORDS_PER_MSG - len(k)], memops[MAX_RECORDS_PER_MSG - len(k):]
            self._send({"kernels": k, "memops": m})

    def _send(self, body: Dict[str, Any]) -> bool:
        import msgpack
        import zmq
        if self._sock is None:
            return False
        self._n += 1
        msg = {"v": MSG_VERSION, "pid": self.pid, "rank": self.rank, "n": self._n, **body,
               "counters": self._snapshot()}
        if self._status is not None:
            msg["status"], self._status = self._status, None
        data = msgpack.packb(msg, use_bin_type=True)
        try:
            with self._send_lock:
                if self._sock is None:
                    return False
                self._sock.send(data, zmq.NOBLOCK)
        except zmq.Again:  # the agent is not reading (or not there): drop, count, never wait
            self.counters["msgs_dropped"] += 1
            self.counters["records_dropped_send"] += len(body.get("kernels", ())) + len(body.get("memops", ()))
            return False
        self.counters["msgs_sent"] += 1
        return True

    # -- failure and exit ------------------------------------------------------------------------
    def warn(self, what: str) -> None:
        if not self.warned:
            self.warned = True
            who = f"pid {self.pid}" + (f", rank {self.rank}" if self.rank >= 0 else "")
            self.say(_one_line(f"ccld: CUPTI capture is off in {who}: {what}; the job goes on without GPU timing"))

    def fail(self, where: str, exc: BaseException) -> None:
        """Turn capture off for good: one warning line, CUPTI switched off as far as it lets us."""
        if self.disabled:
            return
        self.disabled = True
        self._stop.set()
        self.warn(f"{where} failed: {type(exc).__name__}: {exc}")
        try:
            self.capture.stop(finalize=True)
        except BaseException:
            pass
        try:
            self._status = {"state": "off", "message": _one_line(f"{where}: {type(exc).__name__}: {exc}")}
            self._send({"kernels": [], "memops": []})
        except BaseException:
            pass

    def shutdown(self) -> None:
        """At interpreter exit (atexit): last flush and send, bounded by EXIT_TIMEOUT_S. Never raises."""
        if self._closed or os.getpid() != self.pid:
            return  # a forked child: the parent's CUPTI state and socket are not ours
        self._closed = True
        self._stop.set()
        if self.disabled:
            self._close(linger_ms=EXIT_LINGER_MS)  # lets the "off" status out if the agent is there
            return
        helper = threading.Thread(target=self._final, name="ccld-cupti-exit", daemon=True)
        helper.start()
        helper.join(EXIT_TIMEOUT_S)
        if helper.is_alive():
            self.disabled = True
            self.warn(f"the exit flush did not finish within {EXIT_TIMEOUT_S:g} s; its records are lost")

    def _final(self) -> None:
        try:
            if self._thread is not None:
                self._thread.join(EXIT_TIMEOUT_S)
            self.capture.stop(finalize=True)  # its forced flush fills the queue one last time
            self._status = {"state": "bye", "message": ""}
            self.tick(final=True)
        except BaseException as e:
            self.fail("exit", e)
        self._close(linger_ms=EXIT_LINGER_MS)

    def _close(self, linger_ms: int) -> None:
        locked = self._send_lock.acquire(timeout=1.0)  # a send never blocks; 1 s is only a safety bound
        try:
            sock, ctx, self._sock, self._ctx = self._sock, self._ctx, None, None
            if sock is not None:
                sock.close(linger=linger_ms)
            if ctx is not None:
                ctx.term()
        except BaseException:
            pass
        finally:
            if locked:
                self._send_lock.release()


def load_cupti(environ: Mapping[str, str]) -> Any:
    """The CUPTI module: cupti.cupti, or the module CCLD_CUPTI_MODULE names."""
    return importlib.import_module(environ.get(ENV_MODULE) or "cupti.cupti")


def maybe_start(environ: Optional[Mapping[str, str]] = None) -> Optional[Shim]:
    """sitecustomize's entry: start capture in this process if it is a rank with a GPU. Never raises."""
    env = os.environ if environ is None else environ
    pid = os.getpid()
    if not should_start(env, pid):
        return None
    os.environ[ENV_OWNER] = str(pid)  # processes this one starts stay out
    rank_text = env.get("RANK", "")
    rank = int(rank_text) if rank_text.isdigit() else -1
    try:
        config = parse_mode(env.get(ENV_MODE, "nccl"))
        if config is None:
            return None
        cupti = load_cupti(env)
    except BaseException as e:
        who = f"pid {pid}" + (f", rank {rank}" if rank >= 0 else "")
        _stderr_line(_one_line(f"ccld: CUPTI capture is off in {who}: {type(e).__name__}: {e}; "
                               "the job goes on without GPU timing"))
        return None
    return Shim(cupti, env[ENV_ENDPOINT], config, rank).start()
