"""The trace's clock tracks: each agent's round-trip clock estimate (ClockSync) as counters.

Called by model.TraceModel for every "clock_sync" event: the estimate goes into the model's
ClockTable (timeline/clock.py, the one conversion), so the events that follow convert with it, and
three counters under the `ccld` group show it per agent: `AGENT clock offset s` (collector minus
node, at the estimate), `AGENT clock drift ppm` and `AGENT clock uncertainty us`.
Times: collector Unix ns. Caveats: the export adds one offset per frame (the estimate evaluated at
the agent's latest sample), so a drift of D ppm costs up to D x 100 ms (3 us at 30 ppm); and it
converts with the round-trip estimate only: the collector's refinement from collectives
(clockrefine.py) moves its timeline by at most that uncertainty, so the two can differ by that much.
"""
from __future__ import annotations

import weakref

from ccld import wire as ev

# model -> {agent: ts_ns of the last estimate drawn}
_SEEN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def on_sync(model, agent: str, e: dict, off):
    """Apply one clock_sync wire event to `model`; returns the agent's offset (ns) to use from now."""
    try:
        sync = ev.event_from_wire(e)
    except ev.FrameError:
        model.stats["bad_events"] += 1
        return off
    if not isinstance(sync, ev.ClockSync) or not model.clock.update_sync(agent, sync):
        model.anomalies["bad-clock-sample"] += 1
        return off
    o = model.clock.offset(agent)
    seen = _SEEN.setdefault(model, {})
    if seen.get(agent) != sync.ts_ns:  # every frame repeats the agent's latest estimate: draw it once
        seen[agent] = sync.ts_ns
        ts = model.clock.to_unix_ns(agent, sync.ts_ns)
        model.counter(agent, "clock offset s", ts, o.offset_ns / 1e9)
        model.counter(agent, "clock drift ppm", ts, sync.drift_ppb / 1e3)
        model.counter(agent, "clock uncertainty us", ts, sync.uncertainty_ns / 1e3)
    if off is None:
        return None  # before its first ClockSample: the model still holds this agent's events
    off = model.offsets[agent] = o.offset_ns
    return off
