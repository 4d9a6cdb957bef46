"""This node's clock as the agent reports it: CLOCK_MONOTONIC, or, in tests, a shifted and drifting one.

Every time the agent sends is this node's CLOCK_MONOTONIC ns, from BPF (bpf_ktime_get_ns) or from
Python (time.monotonic_ns()). To test clock alignment on one machine, CCLD_TEST_CLOCK="OFFSET_S,DRIFT_PPM"
(e.g. "-2.5,30") makes the agent behave as if it ran on a node whose clocks are OFFSET_S seconds
off and run DRIFT_PPM faster: t' = t + OFFSET + t * DRIFT (t in ns since this machine's boot).
eBPF timestamps ignore time namespaces, so the transform is applied in ONE place, when events are
shipped (NodeClock.event, called by the shipper on every event), to every monotonic field of every
kind (MONO_FIELDS) and to the wall clock of ClockSamples (shifted as its paired monotonic reading,
so this node's wall clock is off by as much). The time sync stamps with now_ns(), i.e. already in
the transformed clock; ClockSync events are therefore left as they are.
Caveat: test only; a malformed value is an error (the agent refuses to start), never ignored.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Mapping, Optional

from ccld import wire as ev
from ccld.errors import CcldError

ENV = "CCLD_TEST_CLOCK"
# Fields holding this node's CLOCK_MONOTONIC ns (0 in launch_ns/last_*ns means "none": kept 0).
MONO_FIELDS = ("ts_ns", "end_ns", "launch_ns", "last_tx_ns", "last_rx_ns", "mono_ns", "wait_ns", "last_ns")
# Fields ending in _ns that are NOT monotonic times: durations and counters, and the wall clock
# (shifted with its ClockSample's mono_ns). tests/unit/test_nodeclock.py checks that every *_ns
# field of the schema is in one of the two lists, so a new time field cannot escape the transform.
NOT_MONO_FIELDS = ("cpu_ns", "runq_ns", "runq_max_ns", "offcpu_ns", "wall_ns",
                   "ref_ns", "offset_ns", "uncertainty_ns", "rtt_min_ns", "residual_ns", "net_wait_ns", "gpu_wait_ns")
MAX_TEST_OFFSET_S = 1e6        # ~11 days either way: beyond that it is a typo
MAX_TEST_DRIFT_PPM = 1000.0    # far beyond a real crystal (tens of ppm)


class NodeClock:
    """t' = t + offset_ns + t * drift_ppb / 1e9; the identity by default."""

    def __init__(self, offset_ns: int = 0, drift_ppb: int = 0):
        self.offset_ns, self.drift_ppb = int(offset_ns), int(drift_ppb)
        self.identity = self.offset_ns == 0 and self.drift_ppb == 0

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "NodeClock":
        text = (os.environ if environ is None else environ).get(ENV, "").strip()
        if not text:
            return cls()
        parts = [p.strip() for p in text.split(",")]
        try:
            if len(parts) != 2:
                raise ValueError("two values")
            off_s, ppm = float(parts[0]), float(parts[1])
        except ValueError:
            raise CcldError(f"{ENV}={text!r}: expected OFFSET_S,DRIFT_PPM (e.g. -2.5,30)") from None
        if not (abs(off_s) <= MAX_TEST_OFFSET_S and abs(ppm) <= MAX_TEST_DRIFT_PPM):
            raise CcldError(f"{ENV}={text!r}: offset must be within {MAX_TEST_OFFSET_S:g} s and drift "
                            f"within {MAX_TEST_DRIFT_PPM:g} ppm")
        return cls(round(off_s * 1e9), round(ppm * 1e3))

    def shift(self, mono_ns: int) -> int:
        """t' - t at real monotonic time t."""
        return self.offset_ns + mono_ns * self.drift_ppb // 1_000_000_000

    def apply(self, mono_ns: int) -> int:
        return mono_ns + self.shift(mono_ns) if mono_ns else mono_ns

    def invert(self, node_ns: int) -> float:
        """The real monotonic time of node time t' (tests' ground truth)."""
        return (node_ns - self.offset_ns) / (1 + self.drift_ppb / 1e9)

    def now_ns(self) -> int:
        """This node's time now, in the clock its events are reported in."""
        return self.apply(time.monotonic_ns())

    def event(self, e: ev.Event) -> ev.Event:
        """`e` with every monotonic field in this clock (e itself for the identity and ClockSync)."""
        if self.identity or isinstance(e, ev.ClockSync):
            return e
        changes = {}
        d = e.__dict__
        for name in MONO_FIELDS:
            v = d.get(name)
            if type(v) is int and v:
                changes[name] = self.apply(v)
        if isinstance(e, ev.ClockSample):
            changes["wall_ns"] = e.wall_ns + self.shift(e.mono_ns)
        return dataclasses.replace(e, **changes) if changes else e

    def __repr__(self) -> str:
        return f"NodeClock(offset {self.offset_ns / 1e9:+g} s, drift {self.drift_ppb / 1e3:+g} ppm)"
