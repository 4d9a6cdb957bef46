"""Clock conversion: node-monotonic ns -> Unix seconds, from the latest sample of each agent."""
import pytest

from ccld.errors import CcldError
from ccld.timeline.clock import ClockTable, NoClockSample

pytestmark = pytest.mark.unit


def test_before_any_sample_is_a_clear_error():
    c = ClockTable()
    assert not c.has("a") and c.offset("a") is None
    with pytest.raises(NoClockSample, match="agent 'a' has sent no clock sample") as ei:
        c.to_unix("a", 123)
    assert isinstance(ei.value, CcldError)


def test_offset_is_wall_minus_mono_of_latest_sample():
    c = ClockTable()
    assert c.update("a", mono_ns=5_000_000_000, wall_ns=1_764_400_000_000_000_000)
    assert c.to_unix("a", 6_000_000_000) == pytest.approx(1_764_400_001.0, abs=1e-6)
    assert c.to_unix("a", 5_000_000_000 - 250_000_000) == pytest.approx(1_764_399_999.75, abs=1e-6)
    # the node's wall clock was stepped forward by 2 s: the latest sample wins
    assert c.update("a", mono_ns=7_000_000_000, wall_ns=1_764_400_004_000_000_000)
    assert c.to_unix("a", 7_000_000_000) == pytest.approx(1_764_400_004.0, abs=1e-6)
    assert c.offset("a").samples == 2


def test_agents_have_independent_epochs():
    c = ClockTable()
    c.update("node0", mono_ns=1_000_000_000_000, wall_ns=1_764_400_000_000_000_000)
    c.update("node1", mono_ns=9_000_000, wall_ns=1_764_400_000_000_000_000)
    assert c.to_unix("node0", 1_000_500_000_000) == pytest.approx(c.to_unix("node1", 509_000_000), abs=1e-6)


def test_keeps_microseconds_at_unix_scale():
    c = ClockTable()
    c.update("a", mono_ns=10**15, wall_ns=1_764_400_000_123_456_789)
    assert c.to_unix("a", 10**15 + 1_000) - c.to_unix("a", 10**15) == pytest.approx(1e-6, abs=3e-7)


def test_implausible_samples_are_counted_not_used():
    c = ClockTable()
    assert not c.update("a", mono_ns=-1, wall_ns=5)
    assert not c.update("a", mono_ns=1, wall_ns=0)
    assert c.rejected == 2 and not c.has("a")
