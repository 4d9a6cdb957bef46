"""10,000 malformed and good frames at a live collector over real ZeroMQ (127.0.0.1, random port).

The small version of bench/fuzz_collector.py (which sends 200,000): the same generator, sender
subprocess and checks. Nothing crashes or hangs, every frame is counted exactly once and by the
reason the decoder gives, good frames beside the junk reach the timeline, memory stays bounded.
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "bench"))

import fuzz_collector  # noqa: E402

pytestmark = pytest.mark.unit

FRAMES = 10_000
MAX_RSS_GROWTH_MIB = 150  # measured ~40 MiB for 10k frames; the timeline keeps what the junk names (agents, comms)


def test_collector_survives_10k_malformed_frames():
    r = fuzz_collector.run_fuzz(FRAMES, seed=1, wait_s=60)
    assert r["problems"] == []                         # the full list of checks, see run_fuzz
    assert r["frames"] == FRAMES and r["good_frames"] == FRAMES // fuzz_collector.GOOD_EVERY
    assert all(r["threads_alive"].values()) and r["internal_errors"] == 0
    assert r["frames_ok"] + sum(r["frames_rejected"].values()) == FRAMES
    assert r["good_events_in_timeline"] == r["good_frames"] * fuzz_collector.GOOD_EVENTS
    # the generator reaches every kind of rejection the decoder has for a frame arriving over the wire
    assert {"not-msgpack", "truncated", "trailing-bytes", "empty", "bad-envelope", "no-version", "newer-major",
            "older-major", "too-many-items"} <= set(r["frames_rejected"])
    assert {"bad-field", "missing-field", "bad-event", "unknown-kind"} <= set(r["bad_events"])
    assert r["rss_growth_mib"] < MAX_RSS_GROWTH_MIB, r
