"""`ccld run`'s side of CUPTI: decide once whether GPU timing can work, and give the job the shim.

`probe()` answers without touching the job: is capture switched off (CCLD_CUPTI=off), is
cupti-python importable, and does a CUPTI call work here (`get_timestamp()` raises NotSupportedError
when there is no GPU driver, which is what CI machines have). `job_env()` says the one line ccld run
prints about it, and when capture can work it opens the agent's CuptiSink and returns the job's
environment with the shim's directory first on PYTHONPATH (its sitecustomize chains any other one)
and the endpoint and mode the shim reads. Otherwise the job's environment is left exactly as it was.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional

from ccld.cupti import shim
from ccld.errors import CcldError

SHIM_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")
PKG_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds `ccld`
ENV_PKG = "CCLD_CUPTI_PKG"  # where the shim finds ccld if the job's interpreter cannot import it


@dataclass(frozen=True)
class Probe:
    ok: bool
    line: str     # what ccld run says, once
    mode: str = ""


def _is_no_gpu(e: BaseException) -> bool:
    """cupti-python raises cupti._internal.utils.NotSupportedError when no CUDA driver/GPU is present."""
    return any(c.__name__ in ("NotSupportedError", "FunctionNotFoundError") for c in type(e).__mro__)


def probe(environ: Mapping[str, str], load: Optional[Callable[[], Any]] = None) -> Probe:
    """Can the shim capture on this node? `load` returns the CUPTI module (tests pass a fake)."""
    text = environ.get(shim.ENV_MODE, "nccl")
    try:
        config = shim.parse_mode(text)
    except ValueError as e:
        raise CcldError(str(e)) from None
    if config is None:
        return Probe(False, f"ccld: CUPTI: off ({shim.ENV_MODE}=off), host-side timing only")
    mode = config.kernels + ("+memcpy" if config.memcpy else "") + ("+memset" if config.memset else "")
    forced = environ.get(shim.ENV_FORCE) == "1"
    if not forced and not shim.gpu_present(environ):
        return Probe(False, "ccld: CUPTI: no GPU, host-side timing only")
    try:
        cupti = load() if load is not None else shim.load_cupti(environ)
    except ImportError as e:
        return Probe(False, f"ccld: CUPTI: cupti-python is not importable ({e}; pip install 'ccld[cupti]'), "
                            "host-side timing only")
    try:
        cupti.get_timestamp()
    except Exception as e:
        if _is_no_gpu(e):
            return Probe(False, "ccld: CUPTI: no GPU, host-side timing only")
        return Probe(False, f"ccld: CUPTI: unusable ({type(e).__name__}: {e}), host-side timing only")
    return Probe(True, f"ccld: CUPTI: on ({'NCCL kernels' if config.kernels == 'nccl' else 'all kernels'}"
                       f"{', memcpy' if config.memcpy else ''}{', memset' if config.memset else ''}), "
                       "injected into the job's Python ranks", mode)


def shim_env(base: Mapping[str, str], endpoint: str, mode: str) -> Dict[str, str]:
    """The job's environment with the shim on it; `base` is not changed."""
    env = dict(base)
    old = env.get("PYTHONPATH", "")
    parts = [p for p in old.split(os.pathsep) if p and os.path.abspath(p) != SHIM_DIR]
    env["PYTHONPATH"] = os.pathsep.join([SHIM_DIR] + parts)
    env[shim.ENV_ENDPOINT] = endpoint
    env[shim.ENV_MODE] = mode
    env[ENV_PKG] = PKG_DIR
    env.pop(shim.ENV_OWNER, None)  # a ccld run inside a traced job starts a fresh tree
    return env


def job_env(agent: Any, say: Callable[[str], None], base: Optional[Mapping[str, str]] = None,
            load: Optional[Callable[[], Any]] = None) -> Optional[Dict[str, str]]:
    """Say whether CUPTI is on; return the job's environment with the shim, or None to leave it as is."""
    base = os.environ if base is None else base
    p = probe(base, load)
    say(p.line)
    if not p.ok:
        return None
    endpoint = agent.open_cupti_sink()
    return shim_env(base, endpoint, p.mode)
