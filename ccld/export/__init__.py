"""Writers that turn a store into something to look at: a Perfetto trace (perfetto.py), the same as
Chrome JSON (chrome.py), and an HTML report (report.py).

This module holds what the `ccld export` verb and the collectors' `--perfetto FILE` share: picking
the format, the one-line summary, and the export a collector does when it stops.
"""
from __future__ import annotations

import json
import shutil
from typing import Any, Callable, Dict, List, Optional

from ccld.errors import CcldError

FORMATS = ("perfetto", "json")


def guess_format(out_path: str, fmt: Optional[str] = None) -> str:
    """`fmt` when given, else json for *.json and perfetto for anything else."""
    if fmt:
        if fmt not in FORMATS:
            raise CcldError(f"unknown trace format {fmt!r} (choose {' or '.join(FORMATS)})")
        return fmt
    return "json" if out_path.lower().endswith(".json") else "perfetto"


def export_trace(store_dir: str, out_path: str, fmt: str = "perfetto", **kw) -> Dict[str, Any]:
    """Write `store_dir` as a trace in format `fmt`; keyword arguments as perfetto.export_perfetto."""
    if fmt == "json":
        from ccld.export.chrome import export_chrome
        return export_chrome(store_dir, out_path, **kw)
    from ccld.export.perfetto import export_perfetto
    return export_perfetto(store_dir, out_path, **kw)


def parse_ranks(text: Optional[str]) -> Optional[List[int]]:
    """"0,2,5-7" -> [0, 2, 5, 6, 7]; None stays None (all ranks)."""
    if text is None:
        return None
    out = []
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part[1:]:
                lo, hi = part.split("-", 1)
                out += range(int(lo), int(hi) + 1)
            elif part:
                out.append(int(part))
        except ValueError:
            raise CcldError(f"--ranks: {part!r} is not a rank or a range (e.g. --ranks 0,2,4-7)") from None
    if not out or any(r < 0 for r in out):
        raise CcldError(f"--ranks {text!r}: give ranks >= 0, e.g. --ranks 0,2")
    return sorted(set(out))


def read_findings(path: str) -> List[Dict[str, Any]]:
    """Findings from a findings file (one JSON object a line, as the collector writes it)."""
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    d = json.loads(line)
                except ValueError as e:
                    raise CcldError(f"{path}:{n}: not a JSON line: {e}") from None
                if isinstance(d, dict) and d.get("kind") in ("hang", "slow"):
                    out.append(d)  # "recovered" lines say when a finding ended; the trace marks onsets
    except OSError as e:
        raise CcldError(f"cannot read findings {path}: {e.strerror}") from None
    return out


def _n(x: float) -> str:
    return f"{x / 1e6:.1f} M" if x >= 1e6 else f"{x / 1e3:.0f} k" if x >= 1e4 else f"{x:.0f}"


def progress_line(p: Dict[str, Any]) -> str:
    total = p.get("bytes_total") or 0
    share = f" ({100 * p['bytes_read'] / total:.0f}% of the store)" if total else ""
    rate = p["events"] / p["elapsed_s"] if p.get("elapsed_s") else 0
    return f"ccld export: {_n(p['events'])} events{share}, {_n(rate)} events/s"


def summary_line(s: Dict[str, Any]) -> str:
    """One line: what was written, how big, how long (`ccld export`'s last line)."""
    n = s["findings"]
    replay = f"; findings {s['replay_s']:.1f} s" if s.get("replay_s") else ""
    gpu = s.get("gpu_kernels", 0) + s.get("gpu_memops", 0)
    gpu = f" ({gpu} GPU, {s.get('gpu_joined', 0)} kernels joined to collectives)" if gpu else ""
    if s.get("compute_spans"):  # a table's or trace's compute rows (timeline/compute.py)
        gpu += f" ({s['compute_spans']} compute)"
    return (f"ccld export: {s['out']} ({s['bytes'] / 2**20:.1f} MiB): {s['tracks']} tracks, {s['slices']} slices"
            f"{gpu}, {s['flows']} flows, {s.get('counters', 0)} counter samples, {n} finding{'s' * (n != 1)}; "
            f"{s['events']} events in {s['seconds']:.1f} s "
            f"({_n(s['events_per_s'])} events/s{replay})")


def export_at_stop(store_dir: str, out_path: str, findings, say: Callable[[str], None],
                   remove_store: bool = False) -> Optional[Dict[str, Any]]:
    """`--perfetto FILE` of `ccld collector`/`ccld run`: export the store with the findings made live
    (no replay); a failure is said, not raised (the job's outcome matters more than its trace).
    remove_store: the store was a temporary one made only for this trace."""
    try:
        stats = export_trace(store_dir, out_path, guess_format(out_path), findings=list(findings or []))
        say(summary_line(stats))
        return stats
    except (CcldError, OSError) as e:
        say(f"ccld: could not write the trace {out_path}: {e}")
        return None
    finally:
        if remove_store:
            shutil.rmtree(store_dir, ignore_errors=True)
