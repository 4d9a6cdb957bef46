"""The export's optional C accelerator (_hotpath.c: the column blocks' row loops and a collective's
per-rank slices), or None: not built (no C compiler at install), built for another interface (a
checkout updated without `make setup`: said once on stderr), or CCLD_PURE_PYTHON=1 in the
environment. The Python loops in colblocks.py and collectives.py are the reference; with `hot` they
call it first and finish in Python from wherever it stopped. Tests set `hot` to None to compare."""
from __future__ import annotations

import os
import sys

VERSION = 2  # _hotpath.c's HOTPATH_VERSION this Python is written for (2: ends() returns its open group)

hot = None
if os.environ.get("CCLD_PURE_PYTHON", "") in ("", "0"):
    try:
        from ccld.export import _hotpath as hot
    except ImportError:
        hot = None
    if hot is not None and getattr(hot, "VERSION", None) != VERSION:
        print(f"ccld: {hot.__file__} is from another version (rebuild it: make setup); "
              "exporting in pure Python", file=sys.stderr)
        hot = None
    if hot is not None:
        from ccld.export.tracks import Lanes, Proc, Track
        hot.bind(Proc, Track, Lanes)
