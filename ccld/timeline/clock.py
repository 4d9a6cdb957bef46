"""Clock conversion: the ONE place where a node's clock becomes the collector's timebase (Unix s).

Every event carries `ts_ns` in the clock of the node that made it (CLOCK_MONOTONIC: each node's has
its own epoch, its boot). Per agent, in order of preference:
  sync+job  the round-trip estimate below, corrected with the job's own collectives (ranks leave one
            collective together: clockrefine.py), bounded by the round-trip uncertainty;
  sync      the agent's ClockSync: offset and drift to the collector's clock, measured by timestamped
            round trips with the collector's time service (tracer/timesync.py, collector/timesvc.py);
            error within `uncertainty_ns` (half the fastest round trip + the fit's residual);
  wall      the latest ClockSample, a (CLOCK_MONOTONIC, CLOCK_REALTIME) pair read back to back on the
            node: as good as the node's NTP/PTP (assumed WALL_UNCERTAINTY_NS), used until the first
            ClockSync and whenever an agent has no time service.
The collector's timebase is its CLOCK_MONOTONIC + an anchor taken at start (= its wall clock unless
that steps). Events keep their clock domain in the store; `ccld diagnose` replays the same rules.
Helpers for detectors: `uncertainty_s`, `pair_uncertainty_s`, `clock_evidence`, `ranks_clock_evidence`
(a finding whose evidence rests on a time difference smaller than the clocks' uncertainty says so).
Caveat: an event is converted once, when it is ingested, with the estimate of that moment; a later,
better estimate does not move events already in the timeline.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Tuple

from ccld import wire as ev
from ccld.errors import CcldError
from ccld.timeline.clockrefine import JobClockRefiner

WALL_UNCERTAINTY_NS = 1_000_000  # a node's wall clock under NTP: ~1 ms (assumed; nothing here measures it)
MAX_SYNC_DRIFT_PPB = 1_000_000   # 1000 ppm: a ClockSync claiming more is corrupt


class NoClockSample(CcldError):
    """An agent's monotonic time was asked for before that agent sent any ClockSample or ClockSync."""


@dataclass(frozen=True)
class ClockOffset:
    offset_ns: int      # Unix ns - node ns, at sampled_mono_ns (for a constant-offset user, e.g. the export)
    sampled_mono_ns: int
    samples: int        # how many ClockSamples this agent has sent
    source: str = "wall"            # "wall", "sync" or "sync+job" (see the module docstring)
    drift_ppb: int = 0
    uncertainty_ns: int = WALL_UNCERTAINTY_NS


class _AgentClock:
    __slots__ = ("wall_offset", "wall_mono", "wall_samples", "sync", "syncs", "corr", "corr_unc",
                 "rel_unc", "groups")

    def __init__(self) -> None:
        self.wall_offset: Optional[int] = None
        self.wall_mono = 0
        self.wall_samples = 0
        self.sync: Optional[ev.ClockSync] = None
        self.syncs = 0
        self.corr = 0                     # refinement from collectives, ns (added to the base)
        self.corr_unc: Optional[int] = None
        self.rel_unc: Optional[int] = None  # vs the other refined agents (the job's common reference)
        self.groups = 0


class ClockTable:
    """Per agent: its clock sources and the conversion. Not thread-safe: the timeline's lock covers it."""

    def __init__(self, refine: bool = True) -> None:
        self._c: Dict[str, _AgentClock] = {}
        self.rejected = 0  # samples that cannot be right (negative or zero clocks, absurd drift)
        self.revision = 0  # bumped whenever a conversion may have changed: who converted ahead can tell
        self.refiner = (JobClockRefiner(self._base_or_none, self._base_source, self._sync_unc, self._apply)
                        if refine else None)

    # ---- input ------------------------------------------------------------------------------------
    def update(self, agent: str, mono_ns: int, wall_ns: int) -> bool:
        """Record a ClockSample; returns False (and counts it) when the sample is not plausible."""
        if mono_ns < 0 or wall_ns <= 0:
            self.rejected += 1
            return False
        c = self._c.get(agent) or self._c.setdefault(agent, _AgentClock())
        c.wall_offset, c.wall_mono = wall_ns - mono_ns, mono_ns
        c.wall_samples += 1
        self.revision += 1
        return True

    def update_sync(self, agent: str, e: ev.ClockSync) -> bool:
        """Record a ClockSync estimate; False (counted) when it cannot be right."""
        if (e.uncertainty_ns < 0 or e.ref_ns < 0 or abs(e.drift_ppb) > MAX_SYNC_DRIFT_PPB
                or e.rtt_min_ns < 0 or e.samples < 0):
            self.rejected += 1
            return False
        c = self._c.get(agent) or self._c.setdefault(agent, _AgentClock())
        c.sync = e
        c.syncs += 1
        self.revision += 1
        return True

    def update_event(self, agent: str, e: ev.Event) -> bool:
        """A ClockSample or ClockSync, whichever `e` is."""
        if isinstance(e, ev.ClockSync):
            return self.update_sync(agent, e)
        return self.update(agent, e.mono_ns, e.wall_ns)

    def arrived(self, recv_s: float) -> None:
        """The receive time (s, never decreasing) of the frame whose ends come next: the refinement
        settles collectives by it."""
        if self.refiner is not None:
            self.refiner.arrived(recv_s)

    def observe_end(self, agent: str, e: ev.WorkEnd) -> None:
        """A collective's end in one rank: a synchronization point for the refinement."""
        if self.refiner is not None and e.ok and agent in self._c:
            self.refiner.observe_end(agent, e.comm, e.seq, e.ts_ns)

    def params(self, agent: str) -> Tuple[int, int, int, int]:
        """(add, ref, drift_ppb, corr): agent's conversion as numbers, for converting many times at
        once: base = mono + add + floor(drift_ppb x (mono - ref) / 1e9), Unix ns = base + corr.
        Raises NoClockSample before its first sample."""
        c = self._c.get(agent)
        if c is None:
            raise NoClockSample(f"agent {agent!r} has sent no clock sample yet")
        s = c.sync
        if s is None:
            return c.wall_offset, 0, 0, c.corr
        return s.offset_ns, s.ref_ns, s.drift_ppb, c.corr

    def base_many(self, agent: str, mono_ns: List[int]) -> Optional[List[int]]:
        """Each of `mono_ns` in `agent`'s base timebase (Unix ns by its round trips or wall clock, without
        the refinement's correction), for the refinement's synchronization points (WorkEnds); None when
        there is no refinement or no clock for that agent yet."""
        c = self._c.get(agent)
        if self.refiner is None or c is None:
            return None
        s = c.sync
        if s is None:
            add = c.wall_offset
            return [m + add for m in mono_ns]
        add, ref, drift = s.offset_ns, s.ref_ns, s.drift_ppb
        return [m + add + (drift * (m - ref)) // 1_000_000_000 for m in mono_ns]

    # ---- conversion -------------------------------------------------------------------------------
    def has(self, agent: str) -> bool:
        return agent in self._c

    def _base(self, c: _AgentClock, mono_ns: int) -> int:
        s = c.sync
        if s is not None:
            return mono_ns + s.offset_ns + (s.drift_ppb * (mono_ns - s.ref_ns)) // 1_000_000_000
        return mono_ns + c.wall_offset

    def _base_or_none(self, agent: str, mono_ns: int) -> Optional[int]:
        c = self._c.get(agent)
        return None if c is None else self._base(c, mono_ns)

    def to_unix_ns(self, agent: str, mono_ns: int) -> int:
        """Collector Unix ns of `mono_ns` on `agent`'s node. Raises NoClockSample before its first sample."""
        c = self._c.get(agent)
        if c is None:
            raise NoClockSample(f"agent {agent!r} has sent no clock sample yet; "
                                f"its monotonic time {mono_ns} ns cannot be converted")
        return self._base(c, mono_ns) + c.corr

    def to_unix(self, agent: str, mono_ns: int) -> float:
        """Unix seconds of `mono_ns` on `agent`'s node. Raises NoClockSample before its first sample."""
        return self.to_unix_ns(agent, mono_ns) / 1e9

    def to_unix_many(self, agent: str, mono_ns: List[int]) -> List[float]:
        """to_unix of each of `mono_ns`, the same arithmetic with the agent's constants read once."""
        c = self._c.get(agent)
        if c is None:
            raise NoClockSample(f"agent {agent!r} has sent no clock sample yet")
        s = c.sync
        if s is None:
            add = c.wall_offset + c.corr
            return [(m + add) / 1e9 for m in mono_ns]
        add, ref, drift = s.offset_ns + c.corr, s.ref_ns, s.drift_ppb
        return [(m + add + (drift * (m - ref)) // 1_000_000_000) / 1e9 for m in mono_ns]

    # ---- what is known ----------------------------------------------------------------------------
    def source(self, agent: str) -> str:
        c = self._c.get(agent)
        if c is None:
            return ""
        return "wall" if c.sync is None else ("sync+job" if c.corr_unc is not None else "sync")

    def _base_source(self, agent: str) -> str:
        """What the refinement corrects: "sync" (round trips) or "wall"."""
        c = self._c.get(agent)
        return "wall" if c is None or c.sync is None else "sync"

    def _sync_unc(self, agent: str) -> int:
        c = self._c.get(agent)
        return WALL_UNCERTAINTY_NS if c is None or c.sync is None else c.sync.uncertainty_ns

    def _apply(self, corrections: Dict[str, tuple]) -> None:
        for agent, (corr, unc, rel, groups) in corrections.items():
            c = self._c.get(agent)
            if c is not None:
                if corr != c.corr:
                    self.revision += 1
                c.corr, c.corr_unc, c.rel_unc, c.groups = corr, unc, rel, groups

    def uncertainty_ns(self, agent: str) -> int:
        """How far this agent's converted times may be from the collector's clock."""
        c = self._c.get(agent)
        if c is None:
            return WALL_UNCERTAINTY_NS
        if c.corr_unc is not None:
            return c.corr_unc
        return self._sync_unc(agent)

    def uncertainty_s(self, agent: str) -> float:
        return self.uncertainty_ns(agent) / 1e9

    def pair_uncertainty_s(self, a: str, b: str) -> float:
        """How wrong a time difference between events of agents a and b may be: 0 on one node (one
        clock); the sum of both uncertainties, or of their uncertainties relative to each other when
        the job aligned both and that is smaller."""
        if a == b:
            return 0.0
        both = self.uncertainty_ns(a) + self.uncertainty_ns(b)
        ca, cb = self._c.get(a), self._c.get(b)
        if ca is not None and cb is not None and ca.rel_unc is not None and cb.rel_unc is not None:
            both = min(both, ca.rel_unc + cb.rel_unc)
        return both / 1e9

    def offset(self, agent: str) -> Optional[ClockOffset]:
        c = self._c.get(agent)
        if c is None:
            return None
        at = max(c.wall_mono, c.sync.ts_ns if c.sync is not None else 0)
        return ClockOffset(offset_ns=self.to_unix_ns(agent, at) - at, sampled_mono_ns=at,
                           samples=c.wall_samples, source=self.source(agent), drift_ppb=c.sync.drift_ppb if c.sync is not None else 0,
                           uncertainty_ns=self.uncertainty_ns(agent))

    def agents(self) -> Dict[str, ClockOffset]:
        return {a: self.offset(a) for a in self._c}

    def summary(self) -> Dict[str, Dict[str, Any]]:
        """JSON-ready state per agent, for stats.json and `ccld diagnose` (format_clock_lines)."""
        out = {}
        for a, c in self._c.items():
            o = self.offset(a)
            s = c.sync
            d: Dict[str, Any] = {"source": o.source, "offset_ns": o.offset_ns, "at_ns": o.sampled_mono_ns,
                                 "drift_ppm": o.drift_ppb / 1e3,
                                 "uncertainty_us": round(o.uncertainty_ns / 1e3, 1),
                                 "wall_offset_ns": c.wall_offset, "clock_samples": c.wall_samples,
                                 "sync_estimates": c.syncs}
            if s is not None:
                d.update(sync_ref_ns=s.ref_ns, sync_offset_ns=s.offset_ns, sync_drift_ppb=s.drift_ppb,
                         sync_uncertainty_us=round(s.uncertainty_ns / 1e3, 1),
                         rtt_min_us=round(s.rtt_min_ns / 1e3, 1), sync_samples=s.samples, epoch=s.epoch)
            if c.corr_unc is not None:
                d.update(job_correction_ns=c.corr, job_rel_uncertainty_us=round(c.rel_unc / 1e3, 1),
                         job_collectives=c.groups,
                         job_clamped=bool(self.refiner and self.refiner.clamped.get(a)))
            out[a] = d
        return out


# ---- helpers for detectors and reports ------------------------------------------------------------

def clock_evidence(clock: ClockTable, agents: Iterable[str], difference_s: float) -> Dict[str, Any]:
    """Evidence fields for a finding that compares times of events from these agents' nodes:
    `clock_uncertainty_s` (the largest pair uncertainty among them) and, when |difference_s| is
    not larger, `below_clock_uncertainty: true` (the difference may be the clocks, not the job)."""
    ags = sorted(set(agents))
    u = max((clock.pair_uncertainty_s(a, b) for i, a in enumerate(ags) for b in ags[i + 1:]), default=0.0)
    out: Dict[str, Any] = {"clock_uncertainty_s": round(u, 9)}
    if u > 0 and abs(difference_s) <= u:
        out["below_clock_uncertainty"] = True
    return out


def ranks_clock_evidence(timeline, job: str, ranks: Iterable[int], difference_s: float) -> Dict[str, Any]:
    """clock_evidence for global ranks of a job (their agents from the timeline's rank records)."""
    agents = []
    for r in ranks:
        rec = timeline.rank_record(job, r)
        if rec is not None:
            agents.append(rec.agent)
    return clock_evidence(timeline.clock, agents, difference_s)


def format_clock_lines(summary: Optional[Dict[str, Dict[str, Any]]]) -> List[str]:
    """`ccld diagnose` lines: per agent, its conversion source, offset, drift and uncertainty."""
    out = []
    for agent, d in sorted((summary or {}).items()):
        line = (f"clock {agent}: {d.get('source')} {d.get('offset_ns', 0) / 1e9:+.6f} s "
                f"{d.get('drift_ppm', 0):+.2f} ppm +-{d.get('uncertainty_us', 0):.0f} us")
        extra = []
        if "rtt_min_us" in d:
            extra.append(f"rtt {d['rtt_min_us']:.0f} us")
        if "job_correction_ns" in d:
            extra.append(f"job {d['job_correction_ns'] / 1e3:+.1f} us over {d.get('job_collectives', 0)}"
                         + (" clamped" if d.get("job_clamped") else ""))
        out.append(line + (f" ({'; '.join(extra)})" if extra else ""))
    return out
