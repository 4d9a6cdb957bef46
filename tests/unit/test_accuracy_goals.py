"""bench/accuracy.py's per-class verdict on issue 18's goals, scored from --log lines without running a
job: top-1 >= 98 % per class with >= 10 runs per scenario, hang p90 per shape, slowdown p90."""
import json
import os
import sys

import pytest

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
import accuracy  # noqa: E402


def log(tmp_path, runs):
    """runs: (scenario key, correct, latency s) per logged run."""
    p = tmp_path / "runs.jsonl"
    p.write_text("".join(json.dumps({"key": k, "run": i, "correct": ok, "detected": ok, "latency_s": lat,
                                     "false": []}) + "\n" for i, (k, ok, lat) in enumerate(runs)))
    return str(p)


def goals(tmp_path, runs):
    md = accuracy.accuracy_md(accuracy.from_logs([log(tmp_path, runs)]), "cmd")
    return {line.split(" | ")[0].lstrip("| "): line for line in md.splitlines() if line.startswith("| ")}, md


def test_a_class_meets_the_goal_at_98_percent_with_ten_runs_of_each_scenario(tmp_path):
    runs = [("ddp-killed", True, 1.2)] * 25 + [("ddp-stop", True, 3.1)] * 24 + [("ddp-stop", False, None)]
    rows, md = goals(tmp_path, runs)
    assert "| fault | 2 | 50 (25) | 49/50 (98.0 %) |" in rows["fault"] and rows["fault"].endswith("| met |")
    assert "ddp 3.1 s (met: <= 5)" in md


def test_a_class_under_98_percent_or_with_a_scenario_under_ten_runs_is_not_met(tmp_path):
    runs = [("ddp-killed", True, 1.2)] * 20 + [("ddp-killed", False, None)] + [("ddp-stop", True, 3.1)] * 9
    rows, md = goals(tmp_path, runs)
    assert rows["fault"].endswith("| not met: 96.7 %, a scenario with 9 runs |"), rows["fault"]


def test_hang_p90_is_judged_per_shape_and_slowdowns_against_60_s(tmp_path):
    runs = [("ddp-sleep", True, 6.0)] * 10 + [("pp-io", True, 6.0)] * 10 + [("ddp-slow", True, 61.0)] * 10
    _, md = goals(tmp_path, runs)
    assert "ddp 6.0 s (not met: <= 5)" in md and "pipeline 6.0 s (met: <= 10)" in md
    assert "Slowdowns: p90 61.0 s (not met: <= 60)." in md
