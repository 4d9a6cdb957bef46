"""The test tree's own shape: pytest (rootdir-relative imports, no packages) refuses two test
modules with one basename when it collects every tier at once, as CI does; a tier run alone hides it."""
import collections
import os

import pytest

pytestmark = pytest.mark.unit

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_test_module_has_its_own_basename():
    seen = collections.defaultdict(list)
    for root, dirs, files in os.walk(TESTS):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for f in files:
            if f.startswith("test_") and f.endswith(".py"):
                seen[f].append(os.path.relpath(os.path.join(root, f), TESTS))
    assert {k: v for k, v in seen.items() if len(v) > 1} == {}
