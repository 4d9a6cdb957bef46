"""Recorded scenarios: stores written by real `ccld run` sessions (tests/data/<situation>/store),
each with the findings it must produce (expected.json). Replaying them offline must give exactly
those findings, so a detector change that breaks a real situation fails here. A new directory with
a store and an expected.json is picked up automatically."""
import json
import os

import pytest

from ccld.diagnose.replay import replay

pytestmark = pytest.mark.unit
DATA = os.path.join(os.path.dirname(__file__), "..", "data")
SCENARIOS = sorted(d for d in os.listdir(DATA) if os.path.isfile(os.path.join(DATA, d, "expected.json")))


def test_there_are_scenarios():
    assert len(SCENARIOS) >= 3


@pytest.mark.parametrize("name", SCENARIOS)
def test_replay_gives_the_recorded_findings(name):
    with open(os.path.join(DATA, name, "expected.json")) as f:
        expected = json.load(f)
    _, findings, _, report = replay(os.path.join(DATA, name, "store"))
    got = [{"kind": x.kind, "class": x.cls, "ranks": x.ranks, "seq": x.seq, "op": x.op} for x in findings]
    assert got == expected["findings"], expected["description"]
    assert report["problems"] == [] and report["frames_rejected"] == {}
