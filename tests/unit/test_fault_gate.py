"""The workloads' FaultGate (ccld/workloads/jobkit.py): without --fault-file a one-rank fault applies
in exactly its step, as the step flags always did; with one, in the first step >= its step that comes
once the file exists, and in that step only. The e2e scenarios place their onsets with it."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "ccld", "workloads"))
import jobkit  # noqa: E402 - a sibling module to the workload scripts, as they import it

pytestmark = pytest.mark.unit


def test_without_a_file_a_fault_applies_in_its_step_only():
    gate = jobkit.FaultGate("")
    assert [s for s in range(10) if gate.due("hang", s, 3)] == [3]
    assert [s for s in range(10) if gate.due("never", s, -1)] == []  # the flags' default: no fault


def test_with_a_file_it_waits_for_the_file_then_applies_once(tmp_path):
    go = tmp_path / "go"
    gate = jobkit.FaultGate(str(go))
    applied = []
    for step in range(12):
        if step == 7:
            go.write_text("")
        for _ in range(2):  # asked twice in a step (e.g. per micro-batch): the same answer both times
            if gate.due("hang", step, 2):
                applied.append(step)
    assert applied == [7, 7]
    assert gate.fired == {"hang": 7}


def test_its_step_still_counts_once_the_file_exists(tmp_path):
    go = tmp_path / "go"
    go.write_text("")
    gate = jobkit.FaultGate(str(go))
    assert [s for s in range(10) if gate.due("io", s, 4)] == [4]
