"""Offline diagnosis: replay a store through the same timeline and detectors as the live collector.

Hangs and slowdowns both (Diagnoser.diagnose), through the same FindingTracker: the findings, their
update records (report["updates"]) and recoveries are those the collector printed live, except
Python stacks (py-spy needs the live processes).

Frames are ingested in stored order (those between two ticks together); before each frame the
detectors run at every STEP_S of recorded time (the frames' recv times, Unix seconds) up to it, and
at the end up to the moment the collector closed the store, so a recorded hang is found offline as it was live, with the same ids
and onsets (detection times differ by at most a step).
Caveat: during long silent gaps the step widens (at most MAX_STEPS_PER_GAP ticks per gap), so
`detected_at` there is coarser; stores are read whole segment by segment (64 MiB at a time).
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

from ccld.diagnose import Diagnoser
from ccld.diagnose.findings import Finding
from ccld.diagnose.tracker import FindingTracker
from ccld.store import list_segments, read_meta, read_stats, read_store
from ccld.timeline.clock import format_clock_lines
from ccld.timeline.ingest import LOAD_GROUP, IngestCounters, decode_frame
from ccld.timeline.timeline import Timeline

STEP_S = 0.5              # same period as the live collector's detection tick
MAX_STEPS_PER_GAP = 2000  # bounds the work of an hour-long silence to a few thousand ticks


def replay(store_dir: str, floor_s: Optional[float] = None, k: float = 4.0,
           step_s: float = STEP_S) -> Tuple[Timeline, List[Finding], List[Dict[str, Any]], Dict[str, Any]]:
    """(timeline, findings, recoveries, report). Raises StoreError when the store cannot be read at all."""
    problems: List[str] = []
    meta = read_meta(store_dir)
    records = read_store(store_dir, problems)
    tl = Timeline()
    counters = IngestCounters()
    diag = Diagnoser(tl, floor_s=floor_s, k=k)
    tracker = FindingTracker()
    findings: List[Finding] = []
    recoveries: List[Dict[str, Any]] = []
    updates: List[Dict[str, Any]] = []
    rejects: List[str] = []  # first few reject messages, for the report

    def tick(now: float) -> None:
        changes = tracker.step(diag.diagnose(now), now)
        findings.extend(changes.new)
        updates.extend(changes.updated)
        recoveries.extend(changes.recovered)

    def run_until(next_tick: float, until: float) -> float:
        step = max(step_s, (until - next_tick) / MAX_STEPS_PER_GAP)
        while next_tick <= until:
            tick(next_tick)
            next_tick += step
        return next_tick

    first = last = None
    n = backwards = 0
    group: List[Tuple[Any, float]] = []
    next_tick = 0.0
    # `ccld run` stopped the job on purpose from here on: the live collector ran no detection after it
    quiesced = meta.get("quiesced_at") if isinstance(meta.get("quiesced_at"), (int, float)) else None
    for recv, frame in records:
        if last is not None and recv < last:
            backwards += 1  # the collector's wall clock stepped back; keep recorded time monotonic
            recv = last
        if first is None:
            first, next_tick = recv, recv + step_s
        until = recv if quiesced is None else min(recv, quiesced)
        if next_tick <= until or len(group) >= LOAD_GROUP:
            tl.ingest_many(group)  # the frames since the last tick, together, before the next one looks
            group = []
        next_tick = run_until(next_tick, until)
        batch, err = decode_frame(frame, counters)
        if batch is not None:
            group.append((batch, recv))
        if err is not None and len(rejects) < 20:
            rejects.append(f"record {n} ({recv:.3f}): {err.reason}: {err}")
        last = recv
        n += 1
    tl.ingest_many(group)
    closed_at = meta.get("closed_at")
    if last is not None:
        end = max(last, closed_at) if isinstance(closed_at, (int, float)) else last
        if quiesced is not None:
            end = min(end, max(first, quiesced))
        run_until(next_tick, end)
        tick(end)
    report = dict(store=os.path.abspath(store_dir), segments=len(list_segments(store_dir)), records=n,
                  problems=problems, first_recv=first, last_recv=last, closed_at=closed_at, quiesced_at=quiesced,
                  recv_time_backwards=backwards, reject_examples=rejects,
                  findings=len(findings), recoveries=len(recoveries), active=len(tracker.active),
                  updates=updates,
                  recorded_stats=read_stats(store_dir))
    report.update(counters.to_dict())
    report.update(tl.counters())
    return tl, findings, recoveries, report


def format_report(report: Dict[str, Any], store: bool = True) -> List[str]:
    """The report as short lines for `ccld diagnose`: what was read, and every loss or damage.
    store=False: the store was made from another source (a per-op table, which says what it read
    itself): no store line, and no clock lines (its events are on one clock already)."""
    span = ""
    if report.get("first_recv") is not None:
        span = f", {report['last_recv'] - report['first_recv']:.1f} s of recording"
    out = [f"store {report.get('store')}: {report.get('records', 0)} frames in {report.get('segments', 0)} "
           f"segments{span}; {report.get('agents', 0)} agents, {report.get('ranks', 0)} ranks, "
           f"{report.get('comms', 0)} communicators"] if store else []
    out += [f"store problem: {p}" for p in report.get("problems") or []]

    def counts(title: str, d: Optional[Dict[str, Any]]) -> None:
        d = {k: v for k, v in (d or {}).items() if v}
        if d:
            out.append(f"{title}: " + ", ".join(f"{k} {v}" for k, v in sorted(d.items())))

    counts("frames rejected", report.get("frames_rejected"))
    live = (report.get("recorded_stats") or {}).get("frames_rejected")
    counts("frames rejected live (never stored)", live)
    counts("bad events dropped", report.get("bad_events"))
    if report.get("skipped_events"):
        out.append(f"events of newer kinds skipped: {report['skipped_events']}")
    for agent, c in sorted((report.get("agent_loss") or {}).items()):
        counts(f"agent {agent} lost", c)
    counts("timeline anomalies", report.get("anomalies"))
    if store:
        out += format_clock_lines(report.get("clock"))  # per node: offset, drift, uncertainty (timeline/clock.py)
    return out
