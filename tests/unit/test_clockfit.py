"""The round-trip estimator (ccld/tracer/clockfit.py) against synthetic exchanges with a known truth:
offset and drift, noisy and asymmetric delays, slow round trips and outliers, Unix-scale numbers."""
import random

import pytest

from ccld.tracer import clockfit
from ccld.tracer.clockfit import Exchange, OffsetFit, best_of

pytestmark = pytest.mark.unit

ANCHOR = 1_764_400_000_000_000_000   # the collector's timebase: Unix ns
BOOT = 3_600_000_000_000             # the node's clock reads 1 h at true time 0


class Sim:
    """A node whose clock runs `drift_ppm` fast, offset from the collector; exchanges at true times."""

    def __init__(self, drift_ppm, seed=1):
        self.d = drift_ppm * 1e-6
        self.rng = random.Random(seed)

    def node(self, true_ns):
        return int(round(BOOT + true_ns * (1 + self.d)))

    def truth(self, node_ns):
        """The collector's time of node time node_ns."""
        return ANCHOR + (node_ns - BOOT) / (1 + self.d)

    def exchange(self, true_ns, up_ns, down_ns, service_ns=5_000):
        t1 = self.node(true_ns)
        t2 = ANCHOR + true_ns + up_ns
        t3 = t2 + service_ns
        t4 = self.node(true_ns + up_ns + service_ns + down_ns)
        return Exchange(t1, t2, t3, t4)

    def burst(self, true_ns, n=8, base_us=40, jitter_us=60, asym_us=0):
        """n exchanges 2 ms apart; each one-way delay = base + exponential jitter (+ asymmetry upward)."""
        out = []
        for i in range(n):
            up = (base_us + asym_us + self.rng.expovariate(1 / jitter_us)) * 1000
            down = (base_us + self.rng.expovariate(1 / jitter_us)) * 1000
            out.append(self.exchange(true_ns + i * 2_000_000, int(up), int(down)))
        return out


def run(sim, seconds, **burst_kw):
    fit = OffsetFit()
    for s in range(seconds):
        assert fit.add(best_of(sim.burst(s * 1_000_000_000, **burst_kw)))
    return fit


def err_us(sim, est, node_ns):
    return (est.at(node_ns) - sim.truth(node_ns)) / 1e3


@pytest.mark.parametrize("drift_ppm", [-45.0, 0.0, 30.0])
def test_offset_and_drift_are_recovered_from_noisy_symmetric_round_trips(drift_ppm):
    sim = Sim(drift_ppm)
    est = run(sim, 40).estimate()
    now = sim.node(40_000_000_000)
    assert abs(err_us(sim, est, now)) < 10
    # drift of the offset (collector - node) is -d/(1+d) of node time
    assert est.drift_ppb == pytest.approx(-drift_ppm * 1e3, abs=500)
    assert est.samples >= 30 and est.rtt_min_ns > 0
    assert abs(err_us(sim, est, now)) * 1e3 <= est.uncertainty_ns


def test_a_constant_asymmetry_biases_by_half_of_it_and_stays_inside_the_uncertainty():
    sim = Sim(20.0, seed=3)
    est = run(sim, 30, asym_us=60).estimate()
    e = err_us(sim, est, sim.node(30_000_000_000))
    assert 20 < e < 40           # the request takes 60 us longer: the offset reads 30 us high
    assert abs(e) * 1e3 <= est.uncertainty_ns  # which half the round trip bounds


def test_slow_round_trips_and_delayed_replies_are_left_out():
    sim = Sim(-30.0, seed=5)
    fit = OffsetFit()
    rng = random.Random(7)
    for s in range(40):
        t = s * 1_000_000_000
        if s % 3 == 2:   # a whole burst on a busy path: round trips over 1 ms, the requests' 300 us longer
            ex = best_of([sim.exchange(t + i * 2_000_000, rng.randint(800_000, 900_000), 500_000)
                          for i in range(8)])
        else:
            ex = best_of(sim.burst(t))
        fit.add(ex)
    est = fit.estimate()
    assert est.samples < est.window  # the stalled bursts were dropped
    assert abs(err_us(sim, est, sim.node(40_000_000_000))) < 10
    assert est.drift_ppb == pytest.approx(30_000, abs=500)


def test_residual_outliers_are_dropped_from_the_fit():
    sim = Sim(10.0, seed=11)
    fit = run(sim, 40)
    good = fit.estimate()
    # a few samples that look fast but are 400 us off (a reply stamped late on the collector side)
    fit2 = OffsetFit()
    sim = Sim(10.0, seed=11)  # the same exchanges again
    for s in range(40):
        x = best_of(sim.burst(s * 1_000_000_000))
        if s in (10, 21, 33):
            x = Exchange(x.t1, x.t2 + 800_000, x.t3 + 800_000, x.t4)
        fit2.add(x)
    est = fit2.estimate()
    now = sim.node(40_000_000_000)
    assert est.samples <= est.window - 3
    assert abs(err_us(sim, est, now) - err_us(sim, good, now)) < 5


def test_before_a_drift_can_be_fitted_the_uncertainty_grows_with_the_samples_age():
    sim = Sim(50.0, seed=2)
    fit = OffsetFit()
    fit.add(best_of(sim.burst(0)))
    e1 = fit.estimate()
    assert e1.drift_ppb == 0 and e1.samples == 1
    fit.add(best_of(sim.burst(1_000_000_000, base_us=200)))  # slower: the first sample stays the offset
    e2 = fit.estimate()
    assert e2.drift_ppb == 0
    now = sim.node(1_000_000_000)
    assert abs(err_us(sim, e2, now)) * 1e3 <= e2.uncertainty_ns  # 50 us of drift since: counted in


def test_the_window_slides_and_follows_a_new_drift():
    fit = OffsetFit(window_s=20)
    a, b = Sim(0.0, seed=4), Sim(40.0, seed=4)
    for s in range(30):
        fit.add(best_of(a.burst(s * 1_000_000_000)))
    # the node's clock changes rate (temperature); only its recent samples should count
    for s in range(30, 70):
        t = s * 1_000_000_000
        xs = []
        for x in b.burst(t):
            # b's clock, continuous with a's at 30 s
            shift = a.node(30_000_000_000) - b.node(30_000_000_000)
            xs.append(Exchange(x.t1 + shift, x.t2, x.t3, x.t4 + shift))
        fit.add(best_of(xs))
    est = fit.estimate()
    assert len(fit.samples) <= 21
    assert est.drift_ppb == pytest.approx(-40_000, abs=1_000)


def test_invalid_and_out_of_order_exchanges_are_rejected_and_counted():
    fit = OffsetFit()
    assert not fit.add(Exchange(100, 50, 40, 200))       # reply sent before the request was read
    assert not fit.add(Exchange(100, 50, 60, 90))        # received before sent
    assert fit.add(Exchange(1_000_000, ANCHOR, ANCHOR + 10, 1_100_000))
    assert not fit.add(Exchange(500_000, ANCHOR, ANCHOR + 10, 600_000))  # this node's clock went back
    assert fit.rejected == 3 and len(fit.samples) == 1
    assert best_of([Exchange(100, 50, 40, 200)]) is None


def test_unix_scale_offsets_keep_nanoseconds():
    # offset ~1.76e18 ns: a float's step there is 256 ns; the estimate must still be exact
    fit = OffsetFit()
    for i in range(3):
        t1 = 5_000_000_000_000 + i * 1_000_000_000
        fit.add(Exchange(t1, t1 + ANCHOR + 1_001, t1 + ANCHOR + 2_001, t1 + 3_000))
    est = fit.estimate()
    assert est.offset_ns == ANCHOR + 1  # ((1001) + (2001 - 3000)) / 2
    assert est.rtt_min_ns == 2_000 and est.drift_ppb == 0


def test_drift_is_bounded(monkeypatch):
    fit = OffsetFit()
    for s in range(10):  # offsets jumping by 10 ms a second: garbage, not a crystal
        t = s * 1_000_000_000
        fit.add(Exchange(t, ANCHOR + t + s * 10_000_000, ANCHOR + t + s * 10_000_000, t + 1000))
    assert abs(fit.estimate().drift_ppb) <= clockfit.MAX_DRIFT_PPB
