"""CUPTI ns -> CLOCK_MONOTONIC ns: offsets from bracketed pairs, interpolated for drift, bounded."""
import itertools

import pytest

from ccld.cupti.clock import MAX_BRACKET_NS, MAX_SAMPLES, TRIES_PER_SAMPLE, CuptiClock

pytestmark = pytest.mark.unit


class Clocks:
    """Scripted clocks: each read of the monotonic clock advances it by `step`; CUPTI reads
    mono * (1 + ppm) + offset at the moment between two monotonic reads."""

    def __init__(self, offset, ppm=0.0, step=1000):
        self.t, self.offset, self.ppm, self.step = 1_000_000_000, offset, ppm, step

    def mono(self):
        self.t += self.step
        return self.t

    def cupti(self):
        return self.cupti_at(self.t + self.step // 2)

    def cupti_at(self, mono):
        return int(mono * (1 + self.ppm / 1e6)) + self.offset

    def advance(self, ns):
        self.t += ns


def test_constant_offset_converts_exactly():
    c = Clocks(offset=-123_456_789_000)
    clock = CuptiClock(c.cupti, c.mono)
    assert clock.sample()
    for mono in (c.t - 10_000_000, c.t, c.t + 5_000_000_000):
        assert clock.to_mono(c.cupti_at(mono)) == mono


def test_drift_is_interpolated_between_samples():
    c = Clocks(offset=5_000_000_000_000, ppm=200.0)  # 200 us per second: far more than real clocks drift
    clock = CuptiClock(c.cupti, c.mono)
    marks = []
    for _ in range(4):
        clock.sample()
        marks.append(c.t)
        c.advance(1_000_000_000)
    mid = marks[1] + 400_000_000
    assert abs(clock.to_mono(c.cupti_at(mid)) - mid) <= 2  # within rounding, not 80 us of drift
    # outside the sampled span the nearest sample's offset is used: error grows with the distance
    far = marks[-1] + 2_000_000_000
    assert abs(clock.to_mono(c.cupti_at(far)) - far) < 500_000


def test_zero_stays_zero_and_conversion_needs_a_sample():
    c = Clocks(offset=10)
    clock = CuptiClock(c.cupti, c.mono)
    with pytest.raises(RuntimeError):
        clock.to_mono(12345)
    clock.sample()
    assert clock.to_mono(0) == 0


def test_wide_brackets_are_rejected():
    c = Clocks(offset=10, step=MAX_BRACKET_NS + 1)  # every pair read across > 1 ms
    clock = CuptiClock(c.cupti, c.mono)
    assert not clock.sample()
    assert clock.rejected == 1 and not clock.ready()


def test_narrowest_of_the_tries_is_kept():
    mono_steps = iter([0, 900_000, 1_000_000, 1_000_010, 2_000_000, 2_500_000])  # widths 900 us, 10 ns, 500 us
    cupti_vals = iter([50, 7_000_000_000, 60])
    clock = CuptiClock(lambda: next(cupti_vals), lambda: next(mono_steps))
    assert clock.sample()
    assert TRIES_PER_SAMPLE == 3
    assert clock.to_mono(7_000_000_000) == 1_000_005  # the 10 ns bracket's midpoint


def test_cupti_stepping_back_starts_the_history_over():
    vals = itertools.chain([100, 100, 100], itertools.repeat(50))
    t = itertools.count(0, 10)
    clock = CuptiClock(lambda: next(vals), lambda: next(t))
    assert clock.sample()
    assert clock.sample()
    assert clock.steps == 1 and clock._at == [50]
    assert clock.to_mono(50) == 65  # the new pair's offset (read between 60 and 70), not the old one's


def test_samples_are_bounded():
    c = Clocks(offset=3)
    clock = CuptiClock(c.cupti, c.mono)
    for _ in range(MAX_SAMPLES + 50):
        clock.sample()
        c.advance(1000)
    assert len(clock._at) == MAX_SAMPLES
