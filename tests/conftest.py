"""Shared test plumbing: tier enforcement and helpers for real jobs.

Tiers are markers: unit (no root), bpf (root + eBPF), gpu (CUDA device), e2e (real multi-rank job
under ccld). Where a machine can run a tier, a skip there is a failure, not a pass: CI sets
CCLD_REQUIRE_TIERS=unit,bpf,e2e, and any skipped test in those tiers then fails the run.
"""
import os
import socket
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "unit"))  # ccld_synth, the synthetic-job helper
TIERS = ("unit", "bpf", "gpu", "e2e")
REQUIRED = {t for t in os.environ.get("CCLD_REQUIRE_TIERS", "").split(",") if t}
GLOO_JOB = os.path.join(ROOT, "ccld", "workloads", "gloo_job.py")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if not rep.skipped or not REQUIRED:
        return
    tiers = [m.name for m in item.iter_markers() if m.name in TIERS]
    hit = [t for t in tiers if t in REQUIRED]
    if hit:
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        rep.outcome = "failed"
        rep.longrepr = f"tier {hit[0]!r} is required here (CCLD_REQUIRE_TIERS) but the test skipped: {reason}"


def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("perfetto_tp"):
            continue  # optional: needs a trace_processor binary, which no package ships here
        if not any(m.name in TIERS for m in item.iter_markers()):
            item.add_marker(pytest.mark.unit)  # a test without a tier is a unit test


def bpf_skip_reason():
    """None when this process can load eBPF programs, else why not."""
    from ccld.bpf.progcache import bpf_available
    problem = bpf_available()
    return None if problem is None else f"{problem} ({problem.hint})"


def torch_skip_reason():
    import importlib.util
    return None if importlib.util.find_spec("torch") else "torch is not installed (pip install torch==2.13.0)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gloo_job_cmd(nproc=4, *args):
    """A torchrun command line for ccld's gloo workload (see ccld/workloads/gloo_job.py for flags)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), GLOO_JOB] + [str(a) for a in args]


@pytest.fixture
def need_bpf():
    reason = bpf_skip_reason() or torch_skip_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture
def job_env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
