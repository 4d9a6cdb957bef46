"""Estimate this node's clock offset and drift to the collector's clock from timestamped round trips.

One exchange is NTP's four timestamps: t1 (request sent) and t4 (reply received) on this node's
clock, t2 (request received) and t3 (reply sent) on the collector's; all integer ns. Its offset
((t2 - t1) + (t3 - t4)) / 2 is exact when the two one-way delays are equal, and wrong by at most
half the round trip (t4 - t1) - (t3 - t2) when they are not, so the exchanges with the smallest
round trip are the trustworthy ones: the caller keeps the best of each burst (best_of), and the fit
keeps the fastest of those. OffsetFit fits offset = a + b * (t - ref) over a sliding window of
those samples (least squares, after dropping slow round trips and then residual outliers), so a
drift of tens of ppm (tens of us per second) is followed between samples.

Units: ns, and drift in ppb (ns per s). Uncertainty = half the smallest round trip in the window +
the RMS of the fit's residuals: the first term bounds an asymmetry of the path, the second the
noise. Caveat: a constant asymmetry (a one-way delay that is always longer) is invisible to any
round-trip method; it stays inside that bound, and the collector's refinement from collectives
(ccld/timeline/clockrefine.py) is what can see it.
"""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Deque, Iterable, List, Optional

WINDOW_S = 60.0            # the fit's window: long enough to see a drift of 1 ppm (60 us) above the noise
MAX_SAMPLES = 240          # bound of the window (one sample a burst, a burst a second: ~4 minutes)
MIN_DRIFT_SPAN_S = 2.0     # fit a drift only over at least this much time (before: offset only) ...
MIN_DRIFT_SAMPLES = 4      # ... and at least this many samples
UNFITTED_DRIFT_PPB = 100_000  # before a drift is fitted, the error grows with the sample's age at up to
                              # 100 ppm (crystals are within tens of ppm): counted in the uncertainty
SLOW_RTT_FACTOR = 2.0      # samples whose round trip is over factor x the window's fastest + slack ...
SLOW_RTT_SLACK_NS = 50_000  # ... are left out: their error bound is too loose to help
RTT_WEIGHT_NS = 20_000     # weight 1 / (rtt - fastest + this)^2: a sample's possible error grows with its rtt
OUTLIER_K = 4.0            # residuals beyond K x the robust spread (MAD) are left out of the refit ...
OUTLIER_FLOOR_NS = 5_000   # ... but never below this (jitter of a few us is not an outlier)
MAX_DRIFT_PPB = 1_000_000  # 1000 ppm: far beyond any crystal; a fitted drift above it means garbage input


@dataclass(frozen=True)
class Exchange:
    """One request/reply: t1, t4 on this node's clock, t2, t3 on the collector's (ns)."""
    t1: int
    t2: int
    t3: int
    t4: int

    @property
    def rtt_ns(self) -> int:
        return (self.t4 - self.t1) - (self.t3 - self.t2)

    @property
    def offset2_ns(self) -> int:
        """Twice the offset collector minus node, assuming equal one-way delays (exact, in integers:
        Unix ns are ~1.8e18, where a float's step is 256 ns)."""
        return (self.t2 - self.t1) + (self.t3 - self.t4)

    @property
    def mid2_ns(self) -> int:
        """Twice the node's time the offset belongs to."""
        return self.t1 + self.t4

    def valid(self) -> bool:
        return self.t4 >= self.t1 and self.t3 >= self.t2 and self.rtt_ns >= 0


def best_of(exchanges: Iterable[Exchange]) -> Optional[Exchange]:
    """The valid exchange with the smallest round trip (None when there is none)."""
    good = [x for x in exchanges if x.valid()]
    return min(good, key=lambda x: x.rtt_ns) if good else None


@dataclass(frozen=True)
class Estimate:
    ref_ns: int            # node time at which offset_ns holds (the newest sample's)
    offset_ns: int         # collector - node at ref_ns
    drift_ppb: int         # d(offset)/d(node time), ns per s
    uncertainty_ns: int    # rtt_min_ns / 2 + residual_ns
    rtt_min_ns: int
    residual_ns: int
    samples: int           # samples the fit used
    window: int            # samples in the window

    def at(self, t_ns: int) -> float:
        """Collector time of node time t_ns (ns)."""
        return t_ns + self.offset_ns + self.drift_ppb * (t_ns - self.ref_ns) / 1e9


def _median(xs: List[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def _line(points: List[tuple]) -> tuple:
    """Weighted least squares (a, b, xm) of y = a + b * (x - xm), xm the weighted mean of x, from
    (x, y, w) points; b = 0 when all x are equal."""
    sw = sum(p[2] for p in points)
    xm = sum(p[2] * p[0] for p in points) / sw
    ym = sum(p[2] * p[1] for p in points) / sw
    sxx = sum(p[2] * (p[0] - xm) ** 2 for p in points)
    if sxx <= 0:
        return ym, 0.0, xm
    sxy = sum(p[2] * (p[0] - xm) * (p[1] - ym) for p in points)
    return ym, sxy / sxx, xm


class OffsetFit:
    """A sliding window of (mid, offset, rtt) samples and the line through the trustworthy ones."""

    def __init__(self, window_s: float = WINDOW_S, max_samples: int = MAX_SAMPLES):
        self.window_ns = int(window_s * 1e9)
        # (mid, offset, rtt) in ns; mid and offset relative to the base (the first sample's), as floats
        self.samples: Deque[tuple] = collections.deque(maxlen=max_samples)
        self.base_mid2 = self.base_off2 = 0
        self.rejected = 0   # invalid exchanges (a clock went backwards, negative round trip)

    def reset(self) -> None:
        self.samples.clear()

    def add(self, x: Exchange) -> bool:
        if not x.valid():
            self.rejected += 1
            return False
        if not self.samples:
            self.base_mid2, self.base_off2 = x.mid2_ns, x.offset2_ns
        mid = (x.mid2_ns - self.base_mid2) / 2
        if self.samples and mid < self.samples[-1][0]:
            self.rejected += 1  # out of order: this node's clock went back, or a stale reply
            return False
        self.samples.append((mid, (x.offset2_ns - self.base_off2) / 2, x.rtt_ns))
        while self.samples and mid - self.samples[0][0] > self.window_ns:
            self.samples.popleft()
        return True

    def estimate(self) -> Optional[Estimate]:
        if not self.samples:
            return None
        pts = list(self.samples)
        rtt_min = min(p[2] for p in pts)
        # 1. slow round trips out: an exchange with round trip r is wrong by up to r/2
        limit = rtt_min * SLOW_RTT_FACTOR + SLOW_RTT_SLACK_NS
        fast = [p for p in pts if p[2] <= limit]
        span_s = (fast[-1][0] - fast[0][0]) / 1e9
        with_drift = span_s >= MIN_DRIFT_SPAN_S and len(fast) >= MIN_DRIFT_SAMPLES
        used = fast
        for _ in range(2):  # 2. fit, drop residual outliers (a delayed reply that looked fast), refit
            a, b, xm = self._fit(used, with_drift)
            res = [p[1] - (a + b * (p[0] - xm)) for p in used]
            mad = _median([abs(r) for r in res]) * 1.4826
            cut = max(OUTLIER_K * mad, OUTLIER_FLOOR_NS)
            kept = [p for p, r in zip(used, res) if abs(r) <= cut]
            if len(kept) == len(used) or len(kept) < max(2, len(used) // 2):
                break
            used = kept
        a, b, xm = self._fit(used, with_drift)
        res = [p[1] - (a + b * (p[0] - xm)) for p in used]
        resid = math.sqrt(sum(r * r for r in res) / len(res)) if len(res) > 1 else 0.0
        ref = pts[-1][0]
        if not with_drift:  # the offset is the fastest sample's: it ages at the unknown drift
            resid += abs(ref - xm) * UNFITTED_DRIFT_PPB / 1e9
        rtt_min_used = min(p[2] for p in used)
        drift_ppb = max(-MAX_DRIFT_PPB, min(MAX_DRIFT_PPB, b * 1e9))
        return Estimate(ref_ns=self.base_mid2 // 2 + int(round(ref)),
                        offset_ns=self.base_off2 // 2 + int(round(a + b * (ref - xm))),
                        drift_ppb=int(round(drift_ppb)),
                        uncertainty_ns=int(math.ceil(rtt_min_used / 2 + resid)), rtt_min_ns=int(rtt_min_used),
                        residual_ns=int(round(resid)), samples=len(used), window=len(pts))

    @staticmethod
    def _fit(points: List[tuple], with_drift: bool) -> tuple:
        if with_drift:
            fastest = min(p[2] for p in points)
            return _line([(p[0], p[1], 1.0 / (p[2] - fastest + RTT_WEIGHT_NS) ** 2) for p in points])
        # Too short to see a drift: the fastest sample's offset (the tightest bound), not the mean.
        best = min(points, key=lambda p: p[2])
        return best[1], 0.0, best[0]
