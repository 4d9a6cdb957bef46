"""`ccld run` in a pod whose environment holds RANK and WORLD_SIZE (a Kubernetes PyTorchJob's), end to
end on real probes: `ccld run -- python train.py` traces that process as the pod's rank (before, it was
taken for a worker forked by ccld and nothing was traced), and `ccld run -- torchrun ...` traces its
workers only, never torchrun itself (which holds the pod's rank too)."""
import os
import subprocess
import sys

import pytest

from conftest import GLOO_JOB, free_port, gloo_job_cmd
from ccld.diagnose.replay import replay

pytestmark = pytest.mark.e2e

CCLD = [sys.executable, "-m", "ccld.cli"]


def pod_env(rank: int, world: int) -> dict:
    return dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def traced(store: str, cmd: list, env: dict):
    """Run `ccld run -- cmd`; (what it printed, the store's ranks as (rank, world size) by pid, its
    communicators' ids)."""
    p = subprocess.run(CCLD + ["run", "--store", store, "--"] + cmd, env=env, capture_output=True, text=True,
                       timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    tl, _, _, _ = replay(store)
    ranks = {pid: (r.rank, r.world_size) for (_, pid), r in tl.ranks.items()}
    comms = sorted(tl.comms)
    return out, ranks, comms


def test_a_python_command_holding_the_pods_rank_is_traced_as_that_rank(need_bpf, tmp_path):
    out, ranks, comms = traced(str(tmp_path / "store"), [sys.executable, GLOO_JOB, "--steps", "60"], pod_env(0, 1))
    assert "ccld: note: this environment sets RANK=0 WORLD_SIZE=1" in out
    assert list(ranks.values()) == [(0, 1)], out
    assert len(comms) == 1, comms


def test_torchrun_holding_the_pods_rank_is_no_rank_its_workers_are(need_bpf, tmp_path):
    out, ranks, comms = traced(str(tmp_path / "store"), gloo_job_cmd(2, "--steps", "60"), pod_env(0, 1))
    assert sorted(ranks.values()) == [(0, 2), (1, 2)], out  # the workers; no phantom rank 0 of 1 (torchrun)
    assert len(comms) == 1, comms
