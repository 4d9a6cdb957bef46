"""Compile one family's BPF C with bcc in a short-lived child process, so that the agent itself never
imports bcc (~64 MiB of RSS that would stay for the agent's life, and ~0.1 s).

The parent (compile_spec) runs `python -m ccld.bpf.compile` with the source file and cflags as JSON
on stdin; the child makes kernel headers findable (kheaders.py), compiles with bcc.BPF(), describes
the result (progcache.describe: maps, instructions, relocations) and writes that description as JSON
to its stdout; anything bcc or clang prints goes to stderr. The parent keeps the description in the
program cache (unless the cache is off) and loads it with program.Program, the same path as a
cached start. The child's own maps and programs die with it. A failed compile is an
EnvironmentProblem carrying the tail of the child's stderr.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Dict, Sequence

from ccld.errors import EnvironmentProblem

COMPILE_TIMEOUT_S = 300   # bcc's clang takes 1-3 s a family; a stuck compile must not hang the agent
ERR_TAIL = 3000           # characters of the child's stderr kept in the error
FAILED = 3                # the child's exit status when bcc could not compile the program
NO_BCC = 4                # ... when bcc cannot be imported
HINT = "check kernel headers (apt-get install linux-headers-amd64) and that you are root"
NO_BCC_HINT = "install it: apt-get install python3-bpfcc (then re-run scripts/setup.sh)"


def compile_spec(source: str, cflags: Sequence[str]) -> Dict[str, Any]:
    """progcache.describe() of `source` compiled with `cflags`, made by a child process."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    request = json.dumps({"source": source, "cflags": list(cflags)})
    try:
        got = subprocess.run([sys.executable, "-m", "ccld.bpf.compile"], input=request, capture_output=True,
                             text=True, env=env, timeout=COMPILE_TIMEOUT_S, cwd="/")
    except (OSError, subprocess.TimeoutExpired) as e:
        raise EnvironmentProblem(f"could not compile {os.path.basename(source)}: {e}", HINT)
    err = got.stderr.strip()[-ERR_TAIL:]
    if got.returncode == NO_BCC:
        raise EnvironmentProblem(f"bcc is not importable, and {os.path.basename(source)} is not in the "
                                 f"compiled-program cache: {err}", NO_BCC_HINT)
    if got.returncode != 0:
        raise EnvironmentProblem(f"could not compile/load {os.path.basename(source)} (exit {got.returncode}): "
                                 f"{err}", HINT)
    try:
        spec = json.loads(got.stdout)
    except ValueError as e:
        raise EnvironmentProblem(f"the compile of {os.path.basename(source)} returned no program: {e}", HINT)
    if not isinstance(spec, dict):
        raise EnvironmentProblem(f"the compile of {os.path.basename(source)} returned no program", HINT)
    return spec


def main() -> int:
    """The child: a request on stdin, the program's description on stdout (see the module's text)."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # bcc and clang print to fd 1 too: keep the description the only thing on the pipe
    req = json.load(sys.stdin)
    try:
        from bcc import BPF
    except ImportError as e:
        print(f"{e}", file=sys.stderr)
        return NO_BCC
    from ccld.bpf import progcache
    from ccld.bpf.kheaders import ensure_kernel_headers
    try:
        ensure_kernel_headers()
        bpf = BPF(src_file=req["source"].encode(), cflags=list(req["cflags"]))
        spec = progcache.describe(bpf)
    except Exception as e:
        hint = getattr(e, "hint", None)
        print(f"{e}" + (f" (fix: {hint})" if hint else ""), file=sys.stderr)
        return FAILED
    json.dump(spec, out)
    out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
