"""A job in another mount namespace (a container, seen from an agent on the host or in a DaemonSet):
its libtorch path means nothing in the agent's namespace, so the agent must reach the library through
/proc/PID/root, and attach to it once however many paths lead to the same file.

The job runs under `unshare --mount` with the virtualenv bind-mounted at a path that, in the test's own
namespace, is an empty directory: the ranks map .../ns-venv/lib/.../libtorch_cpu.so, which does not
exist here. Every collective must still be counted exactly once.
"""
import os
import shlex
import shutil
import subprocess
import sys

import pytest

from conftest import GLOO_JOB, gloo_job_cmd
from test_gloo_probes import COLL_OPS, OPS, STEPS, WORLD, Pipeline, assert_no_loss, job_colls, the_comm

pytestmark = pytest.mark.bpf


@pytest.fixture
def pipeline(need_bpf, tmp_path, job_env):
    if shutil.which("unshare") is None:
        pytest.fail("unshare (util-linux) is missing: it is part of every Debian install")
    p = Pipeline(tmp_path, job_env)
    try:
        yield p
    finally:
        p.close()  # kills the ranks by pid too


def test_job_in_another_mount_namespace_is_traced_through_proc_root(pipeline, tmp_path):
    from ccld.bpf.loader import seen_from_here

    venv_here = sys.prefix
    mnt = tmp_path / "ns-venv"
    mnt.mkdir()
    go = tmp_path / "go"
    cmd = gloo_job_cmd(WORLD, "--steps", STEPS, "--ops", OPS, "--wait-file", go)
    pipeline.port = int(cmd[cmd.index("--master-port") + 1])
    inner = [str(mnt / "bin" / "python")] + cmd[1:]
    assert GLOO_JOB in inner
    script = f"mount --bind {shlex.quote(venv_here)} {shlex.quote(str(mnt))} && exec {shlex.join(inner)}"
    with open(pipeline.out_path, "w") as out:
        pipeline.proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                                         env=pipeline.env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
    agent = pipeline.make_agent(root_pid=pipeline.proc.pid)
    agent.start()
    pipeline.wait_attached()

    pid = pipeline.job_pids()[0]
    (fam,) = [fam for fam, _ in agent.families if fam.NAME == "gloo"]
    lib = fam.find_lib(pid)
    assert lib == f"/proc/{pid}/root{mnt}" + lib.split(str(mnt), 1)[1], lib
    assert not os.path.exists(lib.split("/root", 1)[1]), "the job's own path should not exist out here"
    assert seen_from_here(os.getpid(), "/x") == "/x"
    assert len(fam.libs) == 1, f"one library file, probed once: {list(fam.libs)}"

    go.touch()
    rc = pipeline.wait_job()
    assert rc == 0, f"job failed (rc {rc}):\n{pipeline.output()}"
    tl = pipeline.finish_tracing()
    want = {(r, op): STEPS for r in range(WORLD) for op in COLL_OPS}
    assert dict(tl.enter_counts) == want, f"CollEnter counts: {sorted(tl.enter_counts.items())}"
    assert dict(tl.end_counts) == want, f"WorkEnd counts: {sorted(tl.end_counts.items())}"
    comm = the_comm(tl, pipeline.port)
    assert {s: v.op for s, v in comm.colls.items()} == job_colls(STEPS)
    assert comm.completed == len(job_colls(STEPS))
    assert_no_loss(tl)
