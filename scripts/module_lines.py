"""Fails when a module under ccld/ is longer than MAX_LINES (STYLE.md: small modules that each own one
verb). Run by `make check`; exit status 1 and one line per module over, naming it and its count.

The modules still over the limit are listed in ALLOWED, each with its line count when it was listed as
its ceiling: it may shrink, not grow. One that is under the limit now is named in a note, to be taken
off the list (a note, not a failure: a split lands first, then its entry goes).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Mapping, Tuple

MAX_LINES = 450
# Modules over MAX_LINES, with their ceilings (their line counts when listed). Split them; never raise one.
ALLOWED: Dict[str, int] = {}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ME = "scripts/module_lines.py"  # where ALLOWED is, for the messages


def count_lines(path: str) -> int:
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def modules(root: str, package: str = "ccld") -> List[str]:
    """Every *.py under root/package, as paths relative to root with "/" separators, sorted."""
    out = []
    for d, dirs, files in os.walk(os.path.join(root, package)):
        dirs[:] = [x for x in dirs if not x.startswith(".") and x != "__pycache__"]
        out += [os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/") for f in files if f.endswith(".py")]
    return sorted(out)


def check(root: str, limit: int = MAX_LINES, allowed: Mapping[str, int] = ALLOWED) -> Tuple[List[str], List[str]]:
    """(failures, notes): a module over `limit` and not allowed, or over its ceiling, fails; an allowed
    module now under the limit, or gone, is a note."""
    failures, notes = [], []
    for rel in modules(root):
        n = count_lines(os.path.join(root, rel))
        ceiling = allowed.get(rel)
        if ceiling is None and n > limit:
            failures.append(f"{rel}: {n} lines, over the limit of {limit}: split it by responsibility")
        elif ceiling is not None and n > ceiling:
            failures.append(f"{rel}: {n} lines, over its ceiling of {ceiling} (listed in {ME} as a module "
                            f"still over {limit}): it may shrink, not grow")
        elif ceiling is not None and n <= limit:
            notes.append(f"{rel}: {n} lines, within the limit of {limit} now: take it off ALLOWED in {ME}")
    present = set(modules(root))
    notes += [f"{rel}: no such module: take it off ALLOWED in {ME}" for rel in sorted(allowed) if rel not in present]
    return failures, notes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=ROOT, help="the checkout to check (default: this one)")
    ap.add_argument("--max-lines", type=int, default=MAX_LINES, help=f"the limit (default {MAX_LINES})")
    args = ap.parse_args(argv)
    failures, notes = check(args.root, args.max_lines)
    for line in notes:
        print(f"module_lines: note: {line}")
    for line in failures:
        print(f"module_lines: {line}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
