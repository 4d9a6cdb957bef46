"""`ccld export`: a store as a Perfetto trace (TrackEvent protobuf), streamed: one pass, flat memory.

This is the entry the CLI and the collectors use (through ccld.export.export_trace): open the output,
stream the store's frames through a model.TraceModel into a sink, and say what was written. The pieces:
tracks.py (Track, Lanes, Proc), model.py (events to tracks; what the trace holds), collectives.py
(slices and flows), facts.py (the other event kinds), gpu.py (CUPTI kernels and memops on stream
tracks, joined to collectives), netcounters.py (link and runqueue counters), netprog.py (NCCL's
proxy progress per link), marks.py (findings), protobuf.py (the Perfetto sink) and chrome.py (the
Chrome JSON sink).
Times: Unix ns in the collector's timebase (TIMEBASE); the trace opens with a clock snapshot
(REALTIME = BOOTTIME) so viewers can show wall-clock times.
Caveat: the output is written to OUT.tmp and renamed at the end, so a failed export leaves nothing.
"""
from __future__ import annotations

import gc
import os
import time
from typing import Any, Callable, Dict, Iterable, List, Optional

from ccld.errors import CcldError
from ccld.export.marks import findings_dicts
from ccld.export.model import TIMEBASE, TraceModel
from ccld.export.protobuf import ProtoSink
from ccld.export.tracks import Lanes, Proc, Track
from ccld.store import list_segments, read_meta, read_store

__all__ = ["ExportError", "Lanes", "Proc", "ProtoSink", "TIMEBASE", "Track", "TraceModel", "export_perfetto",
           "run_export"]

PROGRESS_EVERY_S = 1.0
GC_THRESHOLD = 100_000  # allocations between young-generation collections while exporting


class ExportError(CcldError):
    """The trace cannot be written (output not writable, bad window or rank list)."""


# ---- the export ------------------------------------------------------------------------------------

def _ns(t: Optional[float]) -> Optional[int]:
    return None if t is None else int(round(float(t) * 1e9))


def run_export(store_dir: str, out_path: str, make_sink: Callable[[Any], Any], mode: str,
               t_from: Optional[float] = None, t_to: Optional[float] = None,
               ranks: Optional[Iterable[int]] = None, progress: Optional[Callable[[Dict[str, Any]], None]] = None,
               findings=None, hang_after: Optional[float] = None) -> Dict[str, Any]:
    """Shared by the Perfetto and Chrome JSON exports: stream the store through a TraceModel into
    `make_sink(file)`. findings=None: the detectors find them in the same pass, each frame fed to a
    ccld.diagnose.replay.Replay beside the model (replay_s: the time it took); a list (Finding objects
    or their JSON dicts) is used as given."""
    meta = read_meta(store_dir)  # StoreError now, before any output is made
    if t_from is not None and t_to is not None and t_from > t_to:
        raise ExportError(f"--from {t_from} is after --to {t_to}")
    t0 = time.monotonic()
    replay_s = 0.0
    rep = None
    if findings is None:  # found by the detectors in the same pass as the trace: the store is read once
        from ccld.diagnose.replay import Replay
        rep = Replay(meta, floor_s=hang_after)
    total = sum(os.path.getsize(p) for _, p in list_segments(store_dir))
    tmp = out_path + ".tmp"
    try:
        f = open(tmp, mode)
    except OSError as e:
        raise ExportError(f"cannot write {out_path}: {e.strerror}") from None
    problems: List[str] = []
    t1 = time.monotonic()
    gc_was = gc.get_threshold()
    # The export makes a few small containers per event, all short-lived or in bounded tables: with
    # the default threshold (700) the collector runs every few hundred events (~8% of the time).
    gc.set_threshold(max(gc_was[0], GC_THRESHOLD), *gc_was[1:])
    try:
        with f:
            sink = make_sink(f)
            model = TraceModel(sink, _ns(t_from), _ns(t_to), ranks)
            done = 0
            last = t1
            for i, (recv, frame) in enumerate(read_store(store_dir, problems)):
                if rep is not None:
                    r0 = time.perf_counter()
                    rep.feed(recv, frame)
                    replay_s += time.perf_counter() - r0
                model.feed(frame)
                done += len(frame) + 12
                if progress and (i & 63) == 0:
                    now = time.monotonic()
                    if now - last >= PROGRESS_EVERY_S:
                        last = now
                        progress({"phase": "write", "events": model.stats["events"], "bytes_read": done,
                                  "bytes_total": total, "elapsed_s": now - t1})
            if rep is not None:
                r0 = time.perf_counter()
                findings = rep.finish(store_dir, problems)[1]
                replay_s += time.perf_counter() - r0
            found = findings_dicts(findings)
            model.finish(meta.get("closed_at"), found)
            size = sink.finish({"timebase": TIMEBASE,
                                "clock_offsets_ns": {a: o.offset_ns for a, o in model.clock.agents().items()}})
        os.replace(tmp, out_path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    finally:
        gc.set_threshold(*gc_was)
    end = time.monotonic()
    st = model.stats
    stats = {"out": os.path.abspath(out_path), "bytes": size, "seconds": end - t0, "replay_s": replay_s,
             "write_s": end - t1 - replay_s, "events": st["events"], "frames": st["frames"], "tracks": st["tracks"],
             "slices": st["slices"], "instants": st["instants"], "counters": st["counters"],
             "flows": st["flows"], "findings": st["findings"], "findings_total": len(found),
             "gpu_kernels": st["gpu_kernels"], "gpu_memops": st["gpu_memops"], "gpu_joined": st["gpu_joined"],
             "compute_spans": st["compute_spans"],
             "gpu_unjoined": st["gpu_unjoined"], "gpu_flows": st["gpu_flows"],
             "extra_lanes": st["extra_lanes"], "reordered": st["reordered"], "bad_events": st["bad_events"],
             "skipped_events": st["skipped_events"], "frames_rejected": dict(model.frames_rejected),
             "anomalies": dict(model.anomalies), "store_problems": problems}
    stats["events_per_s"] = stats["events"] / stats["write_s"] if stats["write_s"] > 0 else 0.0
    return stats


def export_perfetto(store_dir: str, out_path: str, t_from: Optional[float] = None, t_to: Optional[float] = None,
                    ranks: Optional[Iterable[int]] = None, progress: Optional[Callable[[Dict[str, Any]], None]] = None,
                    findings=None, hang_after: Optional[float] = None) -> Dict[str, Any]:
    """Write `store_dir` as a Perfetto protobuf trace at `out_path`; returns stats (see run_export).

    t_from/t_to: Unix seconds (slices overlapping the window are kept whole); ranks: global ranks
    to keep (None: all)."""
    return run_export(store_dir, out_path, ProtoSink, "wb", t_from, t_to, ranks, progress, findings, hang_after)
