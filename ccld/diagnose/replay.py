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


class Replay:
    """The replay fed one stored frame at a time (feed), in stored order, then finished once (finish):
    what `replay` does with a store, for a caller that reads the store itself for something else too
    (`ccld export` writes its trace in the same pass, so the store is read once)."""

    def __init__(self, meta: Dict[str, Any], floor_s: Optional[float] = None, k: float = 4.0,
                 step_s: float = STEP_S):
        self.meta, self.step_s = meta, step_s
        self.tl = Timeline()
        self.counters = IngestCounters()
        self.diag = Diagnoser(self.tl, floor_s=floor_s, k=k)
        self.tracker = FindingTracker()
        self.findings: List[Finding] = []
        self.recoveries: List[Dict[str, Any]] = []
        self.updates: List[Dict[str, Any]] = []
        self.rejects: List[str] = []  # first few reject messages, for the report
        self.first: Optional[float] = None
        self.last: Optional[float] = None
        self.n = self.backwards = 0
        self.group: List[Tuple[Any, float]] = []
        self.next_tick = 0.0
        # `ccld run` stopped the job on purpose from here on: the live collector ran no detection after it
        q = meta.get("quiesced_at")
        self.quiesced: Optional[float] = q if isinstance(q, (int, float)) else None

    def _tick(self, now: float) -> None:
        changes = self.tracker.step(self.diag.diagnose(now), now)
        self.findings.extend(changes.new)
        self.updates.extend(changes.updated)
        self.recoveries.extend(changes.recovered)

    def _run_until(self, until: float) -> None:
        step = max(self.step_s, (until - self.next_tick) / MAX_STEPS_PER_GAP)
        while self.next_tick <= until:
            self._tick(self.next_tick)
            self.next_tick += step

    def feed(self, recv: float, frame: bytes) -> None:
        """One stored record: the frame and when the collector received it (Unix seconds)."""
        if self.last is not None and recv < self.last:
            self.backwards += 1  # the collector's wall clock stepped back; keep recorded time monotonic
            recv = self.last
        if self.first is None:
            self.first, self.next_tick = recv, recv + self.step_s
        until = recv if self.quiesced is None else min(recv, self.quiesced)
        if self.next_tick <= until or len(self.group) >= LOAD_GROUP:
            self.tl.ingest_many(self.group)  # the frames since the last tick, together, before the next one looks
            self.group = []
        self._run_until(until)
        batch, err = decode_frame(frame, self.counters)
        if batch is not None:
            self.group.append((batch, recv))
        if err is not None and len(self.rejects) < 20:
            self.rejects.append(f"record {self.n} ({recv:.3f}): {err.reason}: {err}")
        self.last = recv
        self.n += 1

    def finish(self, store_dir: str, problems: List[str]) -> Tuple[Timeline, List[Finding], List[Dict[str, Any]],
                                                                   Dict[str, Any]]:
        """(timeline, findings, recoveries, report), after the last frame; problems: what reading the
        store met (read_store's list)."""
        self.tl.ingest_many(self.group)
        self.group = []
        closed_at = self.meta.get("closed_at")
        first, last, quiesced = self.first, self.last, self.quiesced
        if first is not None and last is not None:
            end = max(last, closed_at) if isinstance(closed_at, (int, float)) else last
            if quiesced is not None:
                end = min(end, max(first, quiesced))
            self._run_until(end)
            self._tick(end)
        report = dict(store=os.path.abspath(store_dir), segments=len(list_segments(store_dir)), records=self.n,
                      problems=problems, first_recv=first, last_recv=last, closed_at=closed_at,
                      quiesced_at=quiesced, recv_time_backwards=self.backwards, reject_examples=self.rejects,
                      findings=len(self.findings), recoveries=len(self.recoveries),
                      active=len(self.tracker.active), updates=self.updates,
                      recorded_stats=read_stats(store_dir))
        report.update(self.counters.to_dict())
        report.update(self.tl.counters())
        return self.tl, self.findings, self.recoveries, report


def replay(store_dir: str, floor_s: Optional[float] = None, k: float = 4.0,
           step_s: float = STEP_S) -> Tuple[Timeline, List[Finding], List[Dict[str, Any]], Dict[str, Any]]:
    """(timeline, findings, recoveries, report). Raises StoreError when the store cannot be read at all."""
    problems: List[str] = []
    r = Replay(read_meta(store_dir), floor_s, k, step_s)
    for recv, frame in read_store(store_dir, problems):
        r.feed(recv, frame)
    return r.finish(store_dir, problems)


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
