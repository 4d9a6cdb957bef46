"""Builds libnccl-profiler-ccld.so from ccld_profiler.c: `cc -O2 -shared -fPIC -pthread ... -ldl`.

scripts/setup.sh runs `python -m ccld.ncclprof.build` (the .so goes beside the source, git-ignored);
tests build into a temporary directory. No C compiler, or a failed compile, is a reason (a string),
not an exception: ccld works without the plugin. The source's SHA-256 is built in
(ccld_np_source_sha256()), so `stale()` can tell a library built from an older ccld_profiler.c.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from typing import List, NamedTuple, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "ccld_profiler.c")
HEADER = os.path.join(HERE, "ccld_profiler.h")
LIB_NAME = "libnccl-profiler-ccld.so"  # NCCL_PROFILER_PLUGIN=ccld finds it by this name on the library path
COMPILE_TIMEOUT_S = 120


class Built(NamedTuple):
    path: Optional[str]  # the library, or None
    reason: str          # why not (empty when built)


def source_sha256() -> str:
    h = hashlib.sha256()
    for p in (SOURCE, HEADER):
        with open(p, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def installed_path() -> str:
    """Where setup puts the library (it may not be there: no compiler at setup)."""
    return os.path.join(HERE, LIB_NAME)


def compiler() -> Optional[str]:
    cc = os.environ.get("CC", "").strip()
    if cc:
        return cc
    for name in ("cc", "gcc", "clang"):
        if shutil.which(name):
            return name
    return None


def build(out_dir: str, cc: Optional[str] = None) -> Built:
    """Compile into out_dir/LIB_NAME (written whole, then renamed: a loader never sees half a file)."""
    cc = cc or compiler()
    if cc is None:
        return Built(None, "no C compiler (cc, gcc or clang; or $CC) found: the NCCL profiler plugin is not built")
    try:
        sha = source_sha256()
    except OSError as e:
        return Built(None, f"cannot read the plugin's source: {e}")
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, LIB_NAME)
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=out_dir)
    os.close(fd)
    cmd = shlex.split(cc) + ["-O2", "-shared", "-fPIC", "-pthread", "-Wall", "-std=gnu11",
                             f'-DCCLD_NP_SOURCE_SHA256="{sha}"', "-o", tmp, SOURCE, "-ldl"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        os.unlink(tmp)
        return Built(None, f"{cc} did not run: {e}")
    if r.returncode != 0:
        os.unlink(tmp)
        err = (r.stderr or r.stdout).strip().splitlines()
        return Built(None, f"{cc} failed ({r.returncode}): " + " | ".join(err[-5:]))
    os.chmod(tmp, 0o755)
    os.replace(tmp, out)
    return Built(out, "")


def stale(path: str) -> bool:
    """The library at path was built from another source than the one beside this file (or is not one).
    Loading it starts nothing: the plugin's thread starts at NCCL's first init."""
    try:
        lib = ctypes.CDLL(path)
        fn = lib.ccld_np_source_sha256
    except (OSError, AttributeError):
        return True
    fn.restype = ctypes.c_char_p
    return (fn() or b"").decode() != source_sha256()


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    res = build(args[0] if args else HERE)
    print(res.path or res.reason)
    return 0 if res.path else 1


if __name__ == "__main__":
    sys.exit(main())
