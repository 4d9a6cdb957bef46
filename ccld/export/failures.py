"""`ccld export STORE --failure-trace OUT`: every finding of a recording as one failure record, for
failure-aware schedulers and job-scheduling simulators (format: docs/failure-trace.md).

Findings come from replaying the store through the detectors (or from the collector's findings
file with --findings, whose "recovered" lines give the ends). A record says when the failure began
(`start`, Unix s, and `start_offset_s` from the first frame of the recording), when it ended (its
recovery) or that it was still open when the recording ended (`open`, duration up to the end), its
kind and class, the ranks and the nodes they ran on, the link (rank pair) when it has one, and the
job (MASTER_ADDR:MASTER_PORT) with its world size. Formats by OUT's extension: .csv (lists joined
with spaces), .json (one document), .jsonl (one record a line). Records are sorted by start.
"""
from __future__ import annotations

import csv
import json
import os
from typing import Any, Dict, List, Optional, Tuple

from ccld.errors import CcldError

FORMAT = "ccld-failure-trace"
VERSION = 1
FIELDS = ["id", "job", "world_size", "kind", "class", "start", "start_offset_s", "detected", "end", "duration_s",
          "open", "ranks", "nodes", "link", "comm", "seq", "op", "summary"]


def _findings_from_file(path: str) -> Tuple[List[Dict[str, Any]], Dict[str, float]]:
    found, ends = [], {}
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    d = json.loads(line)
                except ValueError as e:
                    raise CcldError(f"{path}:{n}: not a JSON line: {e}") from None
                if not isinstance(d, dict):
                    continue
                if d.get("kind") in ("hang", "slow"):
                    found.append(d)
                elif d.get("kind") == "recovered" and isinstance(d.get("recovered_at"), (int, float)):
                    ends.setdefault(str(d.get("id")), d["recovered_at"])
    except OSError as e:
        raise CcldError(f"cannot read findings {path}: {e.strerror}") from None
    return found, ends


def failure_records(store_dir: str, findings_path: Optional[str] = None, hang_after: Optional[float] = None) -> List[Dict[str, Any]]:
    from ccld.diagnose.replay import replay
    tl, findings, recoveries, report = replay(store_dir, floor_s=hang_after)
    if findings_path:
        found, ends = _findings_from_file(findings_path)
    else:
        found = [f.to_json() for f in findings if f.kind in ("hang", "slow")]  # an info verdict is no failure
        ends = {}
        for r in recoveries:
            ends.setdefault(str(r["id"]), r["recovered_at"])
    began = report.get("first_recv")
    ended = max([x for x in (report.get("last_recv"), report.get("closed_at")) if isinstance(x, (int, float))],
                default=None)
    out = []
    for f in found:
        start = float(f["onset_at"])
        end = ends.get(str(f.get("id")))
        last = end if end is not None else (ended if ended is not None else f.get("detected_at"))
        job = f.get("job") or ""
        nodes = []
        for r in f.get("ranks") or []:
            rec = tl.rank_record(job, r)
            if rec is not None and rec.node not in nodes:
                nodes.append(rec.node)
        out.append({"id": f.get("id"), "job": job, "world_size": tl.jobs.get(job, -1) if job else -1,
                    "kind": f["kind"], "class": f["class"], "start": round(start, 6),
                    "start_offset_s": round(start - began, 6) if began is not None else None,
                    "detected": round(float(f["detected_at"]), 6), "end": round(end, 6) if end is not None else None,
                    "duration_s": round(max(0.0, last - start), 6) if last is not None else None,
                    "open": end is None, "ranks": list(f.get("ranks") or []), "nodes": nodes,
                    "link": list(f["link"]) if f.get("link") else None, "comm": f.get("comm"), "seq": f.get("seq"),
                    "op": f.get("op"), "summary": (f.get("evidence") or {}).get("summary")})
    out.sort(key=lambda r: (r["start"], r["id"] or ""))
    return out


def _csv_value(v: Any) -> Any:
    if isinstance(v, list):
        return " ".join(map(str, v))
    if isinstance(v, bool):
        return "true" if v else "false"
    return "" if v is None else v


def write_records(records: List[Dict[str, Any]], out_path: str) -> None:
    ext = os.path.splitext(out_path)[1].lower()
    if ext not in (".csv", ".json", ".jsonl"):
        raise CcldError(f"--failure-trace {out_path}: say the format with the extension: .csv, .json or .jsonl")
    try:
        with open(out_path, "w", encoding="utf-8", newline="") as f:
            if ext == ".csv":
                w = csv.DictWriter(f, fieldnames=FIELDS)
                w.writeheader()
                for r in records:
                    w.writerow({k: _csv_value(r[k]) for k in FIELDS})
            elif ext == ".jsonl":
                for r in records:
                    f.write(json.dumps(r) + "\n")
            else:
                json.dump({"format": FORMAT, "version": VERSION, "records": records}, f, indent=1)
                f.write("\n")
    except OSError as e:
        raise CcldError(f"cannot write {out_path}: {e.strerror}") from None


def write_failure_trace(store_dir: str, out_path: str, findings_path: Optional[str] = None,
                        hang_after: Optional[float] = None) -> str:
    """Write the trace; the one-line summary for the terminal."""
    records = failure_records(store_dir, findings_path, hang_after)
    write_records(records, out_path)
    still = sum(1 for r in records if r["open"])
    classes = {}
    for r in records:
        classes[r["class"]] = classes.get(r["class"], 0) + 1
    what = ", ".join(f"{n} {c}" for c, n in sorted(classes.items())) or "no failures"
    return (f"ccld export: {out_path}: {len(records)} failure record{'s' * (len(records) != 1)} ({what}"
            + (f"; {still} still open at the end of the recording" if still else "") + ")")
