"""Compile one family's BPF C with bcc in a short-lived child process, so that the agent itself never
imports bcc (~64 MiB of RSS that would stay for the agent's life, and ~0.1 s).

The parent (compile_specs) runs `python -m ccld.bpf.compile` with a list of (source file, cflags) as
JSON on stdin; the child makes kernel headers findable (kheaders.py), compiles each with bcc.BPF(),
describes the result (progcache.describe: maps, instructions, relocations) and writes the list of
descriptions (or each one's error) as JSON to its stdout; anything bcc or clang prints goes to
stderr. A cold start compiles the families the cache lacks in one child per CPU, each taking several
(loader.compile_ahead). The parent keeps the description in the program cache (unless the cache is off) and loads it with program.Program, the same path as a
cached start. The child's own maps and programs die with it. A failed compile is an
EnvironmentProblem carrying the tail of the child's stderr.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Dict, List, Sequence, Tuple, Union

from ccld.errors import EnvironmentProblem

COMPILE_TIMEOUT_S = 300   # bcc's clang takes 1-3 s a family; a stuck compile must not hang the agent
ERR_TAIL = 3000           # characters of the child's stderr kept in the error
NO_BCC = 4                # the child's exit status when bcc cannot be imported
HINT = "check kernel headers (apt-get install linux-headers-amd64) and that you are root"
NO_BCC_HINT = "install it: apt-get install python3-bpfcc (then re-run scripts/setup.sh)"


def compile_specs(requests: Sequence[Tuple[str, Sequence[str]]]) -> List[Union[Dict[str, Any], EnvironmentProblem]]:
    """For each (source file, cflags), progcache.describe() of it compiled, or the problem that kept it
    from compiling; all made by one child process (bcc and its LLVM start once: ~0.3 s a family saved
    on a cold start of every family). An EnvironmentProblem when the child itself fails."""
    names = ", ".join(os.path.basename(src) for src, _ in requests)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    request = json.dumps([{"source": src, "cflags": list(cflags)} for src, cflags in requests])
    try:
        got = subprocess.run([sys.executable, "-m", "ccld.bpf.compile"], input=request, capture_output=True,
                             text=True, env=env, timeout=COMPILE_TIMEOUT_S * len(requests), cwd="/")
    except (OSError, subprocess.TimeoutExpired) as e:
        raise EnvironmentProblem(f"could not compile {names}: {e}", HINT)
    err = got.stderr.strip()[-ERR_TAIL:]
    if got.returncode == NO_BCC:
        raise EnvironmentProblem(f"bcc is not importable, and {names} not in the compiled-program cache: {err}",
                                 NO_BCC_HINT)
    try:
        answers = json.loads(got.stdout) if got.returncode == 0 else None
    except ValueError:
        answers = None
    if not isinstance(answers, list) or len(answers) != len(requests):
        raise EnvironmentProblem(f"the compile of {names} failed (exit {got.returncode}): {err}", HINT)
    out: List[Union[Dict[str, Any], EnvironmentProblem]] = []
    for (src, _), ans in zip(requests, answers):
        if isinstance(ans, dict) and isinstance(ans.get("spec"), dict):
            out.append(ans["spec"])
        else:
            why = ans.get("error") if isinstance(ans, dict) else None
            said = f"{why}; the compiler said: {err}" if why and err else (why or err)  # clang's lines are on stderr
            out.append(EnvironmentProblem(f"could not compile/load {os.path.basename(src)}: {said}", HINT))
    return out


def compile_spec(source: str, cflags: Sequence[str]) -> Dict[str, Any]:
    """progcache.describe() of `source` compiled with `cflags` (a child process); else an EnvironmentProblem."""
    (got,) = compile_specs([(source, cflags)])
    if isinstance(got, EnvironmentProblem):
        raise got
    return got


def main() -> int:
    """The child: requests on stdin, for each the program's description or the error, on stdout
    (see the module's text)."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # bcc and clang print to fd 1 too: keep the descriptions the only thing on the pipe
    requests = json.load(sys.stdin)
    try:
        from bcc import BPF
    except ImportError as e:
        print(f"{e}", file=sys.stderr)
        return NO_BCC
    from ccld.bpf import progcache
    from ccld.bpf.kheaders import ensure_kernel_headers
    answers: List[Dict[str, Any]] = []
    for req in requests:
        try:
            ensure_kernel_headers()
            bpf = BPF(src_file=req["source"].encode(), cflags=list(req["cflags"]))
            answers.append({"spec": progcache.describe(bpf)})
            bpf.cleanup()
        except Exception as e:
            hint = getattr(e, "hint", None)
            answers.append({"error": f"{e}" + (f" (fix: {hint})" if hint else "")})
    json.dump(answers, out)
    out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
