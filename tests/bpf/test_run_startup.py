"""`ccld run` starts the command before its collector and agent are up (the probe programs come from
the compiled-program cache, loaded first): nothing of the job may be missed for that. A 4-rank gloo
job run under `ccld run --store` has, in the store, every rank's process-group creation (CommInit
seen at creation: group_rank known) and every collective from seq 1, exactly, with every start and
end. Run twice: the first run may compile (a cold cache), the second loads from the cache.
"""
import collections
import os
import subprocess
import sys

import pytest

from conftest import ROOT, gloo_job_cmd

from ccld.bpf.progcache import PROGRAMS

pytestmark = pytest.mark.bpf

WORLD, STEPS = 4, 23
OPS = "allreduce,broadcast,barrier"
RUN_TIMEOUT_S = 240


def stored_events(store):
    from ccld import wire as ev
    from ccld.store import read_store
    out = []
    for _, frame in read_store(str(store)):
        out.extend(ev.decode_batch(frame).events)
    return out


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("bpfcache")


@pytest.mark.parametrize("run", ["cold cache", "warm cache"])
def test_ccld_run_misses_nothing_of_the_job(need_bpf, tmp_path, job_env, cache_dir, run):
    store = tmp_path / "store"
    job_env = dict(job_env, CCLD_BPF_CACHE=str(cache_dir))
    assert bool(os.listdir(cache_dir)) == (run == "warm cache")
    cmd = [sys.executable, "-m", "ccld.cli", "run", "--store", str(store), "--"] + \
        gloo_job_cmd(WORLD, "--steps", STEPS, "--ops", OPS)
    res = subprocess.run(cmd, cwd=ROOT, env=job_env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                         start_new_session=True)
    assert res.returncode == 0, f"rc {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    evs = stored_events(store)
    inits = [e for e in evs if e.KIND == "comm" and e.backend == "gloo"]
    assert sorted(e.group_rank for e in inits) == list(range(WORLD)), f"CommInits: {inits}"
    comm = inits[0].comm
    want = {1 + len(OPS.split(",")) * s + j for s in range(STEPS) for j in range(len(OPS.split(",")))}
    by = collections.defaultdict(lambda: collections.defaultdict(set))
    for e in evs:
        if e.KIND in ("coll", "start", "end") and e.comm == comm:
            by[e.KIND][e.rank].add(e.seq)
    for kind in ("coll", "start", "end"):
        for r in range(WORLD):
            got = by[kind][r]
            assert got == want, (f"rank {r} {kind}: missing {sorted(want - got)[:10]}, extra {sorted(got - want)[:10]}"
                                 f"\n{res.stderr[-2000:]}")
    assert len(os.listdir(cache_dir)) == len(PROGRAMS), "every family's program kept in the cache"
