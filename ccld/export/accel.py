"""The export's optional C accelerator (_hotpath.c: the column blocks' row loops and a collective's
per-rank slices), or None: not built (no C compiler at install), built for another interface (a
checkout updated without `make setup`: said once on stderr), or CCLD_PURE_PYTHON=1 in the
environment. The Python loops in colblocks.py and collectives.py are the reference; with `hot` they
call it first and finish in Python from wherever it stopped. Tests set `hot` to None to compare."""
from __future__ import annotations

import hashlib
import os
import sys

VERSION = 2  # _hotpath.c's HOTPATH_VERSION this Python is written for (2: ends() returns its open group)



def _stale(mod) -> bool:
    """The module was built from another _hotpath.c than the one beside it (a checkout edited or
    updated without `make setup`). An install without the source (a wheel) is taken as built."""
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_hotpath.c")
    try:
        with open(src, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest() != getattr(mod, "SOURCE_SHA256", "")
    except OSError:
        return False


hot = None
if os.environ.get("CCLD_PURE_PYTHON", "") in ("", "0"):
    try:
        from ccld.export import _hotpath as hot
    except ImportError:
        hot = None
    if hot is not None and (getattr(hot, "VERSION", None) != VERSION or _stale(hot)):
        print(f"ccld: {hot.__file__} was built from another _hotpath.c (rebuild it: make setup); "
              "exporting in pure Python", file=sys.stderr)
        hot = None
    if hot is not None:
        from ccld.export.tracks import Lanes, Proc, Track
        hot.bind(Proc, Track, Lanes)
