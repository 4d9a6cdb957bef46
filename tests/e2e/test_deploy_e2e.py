"""End to end: the exact commands of every deploy/ recipe, run for real on this machine against a
real 2-rank gloo job under torchrun, count-exact (23 allreduces per rank reach the collector).

Kubernetes: the collector's and the agent's container commands, with the key Secrets made as
deploy/README.md says (`ccld keys`) and mounted where the manifests mount them (same file names and
modes); only addresses (loopback, free ports) and absolute paths (under a temporary root) change.
systemd: the two ExecStart lines with the units' own defaults. SLURM: the sbatch script itself,
with stand-ins for `srun` (runs the command here, logs its options) and `scontrol` (one node).
Every test: the job waits (--wait-file) until the collector's /snapshot shows both of its ranks,
so the agent sees every collective; then the job runs to its end and ccld stops on SIGTERM.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from ccld.timeline.ingest import load_timeline
from conftest import GLOO_JOB, ROOT, bpf_skip_reason, free_port, gloo_job_cmd, torch_skip_reason
from test_deploy import obj, unit_exec
from test_run_e2e import Procs, wait_for

pytestmark = pytest.mark.e2e

STEPS = 23
CCLD = [sys.executable, "-m", "ccld.cli"]
START_TIMEOUT_S = 150.0   # agent: compile every probe family; torchrun: import torch (2 busy vCPUs)


@pytest.fixture
def procs(tmp_path):
    reason = bpf_skip_reason() or torch_skip_reason()
    if reason:
        pytest.skip(reason)
    p = Procs(tmp_path)
    yield p
    p.cleanup()


def snapshot(metrics):
    with urllib.request.urlopen(f"http://{metrics}/snapshot", timeout=5) as r:
        return json.loads(r.read())


def our_job(procs, metrics):
    """The job in the collector's snapshot whose ranks are this test's processes, once both show."""
    tagged = set(procs.tagged())
    try:
        snap = snapshot(metrics)
    except OSError:
        return None
    for job in snap["jobs"]:
        pids = {r["pid"] for r in job["ranks"]}
        if len(pids & tagged) == 2:
            return job["job"]
    return None


def wait_until(cond, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.25)
    raise AssertionError(f"{what} not within {timeout_s} s")


def run_job(procs, metrics, job_proc, go_file):
    """Release the job once the collector sees both of its ranks, wait for its end; its job id."""
    job = wait_until(lambda: our_job(procs, metrics), START_TIMEOUT_S, "both ranks in the collector's /snapshot")
    go_file.touch()
    assert job_proc.wait(120) == 0
    return job


def assert_counted(store, job):
    tl = load_timeline(str(store))
    comms = [c for c in tl.comms.values() if c.job == job]
    assert comms, f"no communicator of job {job} in the store"
    main = max(comms, key=lambda c: c.max_seq)
    done = sorted(s for s, v in main.colls.items() if v.completed_at is not None)
    assert done == list(range(1, STEPS + 1)), done
    assert {r: main.last_entered[r][1] for r in main.last_entered} == {0: "allreduce", 1: "allreduce"}


def stop(p, name):
    p.send_signal(signal.SIGTERM)
    assert p.wait(60) == 0, f"{name} did not stop cleanly on SIGTERM"


def secret_mounts(root, keys_dir):
    """Make the Secrets as deploy/README.md does and lay them out as the pods see them: {mountPath: dir}."""
    with open(os.path.join(ROOT, "deploy", "README.md")) as f:
        readme = f.read()
    secrets = {name: (key, path) for name, key, path in
               re.findall(r"create secret generic (\S+) --from-file=([^=\s]+)=(\S+)", readme)}
    for name in ("collector", "agent"):
        subprocess.run(CCLD + ["keys", str(keys_dir / "keys"), name], check=True, timeout=60, cwd=keys_dir)
    for kind, obj_name in (("DaemonSet", "ccld-agent"), ("Deployment", "ccld-collector")):
        spec = obj(kind, obj_name)["spec"]["template"]["spec"]
        vols = {v["name"]: v["secret"] for v in spec["volumes"] if "secret" in v}
        for m in spec["containers"][0]["volumeMounts"]:
            if m["name"] in vols:
                key, src = secrets[vols[m["name"]]["secretName"]]
                d = root / m["mountPath"].lstrip("/")
                d.mkdir(parents=True, exist_ok=True)
                (d / key).write_bytes((keys_dir / src).read_bytes())
                os.chmod(d / key, vols[m["name"]]["defaultMode"])


def remap(cmd, root, subs):
    """The recipe's argv with `ccld` run from this checkout, addresses substituted and absolute paths
    moved under `root`."""
    out = []
    for a in cmd[1:]:
        for old, new in subs.items():
            a = a.replace(old, new)
        out.append(str(root) + a if a.startswith("/") else a)
    return CCLD + out


def test_kubernetes_container_commands_trace_a_real_job(procs):
    root = procs.tmp / "pod"
    secret_mounts(root, procs.tmp)
    port, mport = free_port(), free_port()
    subs = {"tcp://0.0.0.0:5555": f"tcp://127.0.0.1:{port}", "0.0.0.0:9555": f"127.0.0.1:{mport}",
            "tcp://ccld-collector.ccld.svc.cluster.local:5555": f"tcp://127.0.0.1:{port}"}
    (root / "var/lib/ccld").mkdir(parents=True)
    col_cmd = obj("Deployment", "ccld-collector")["spec"]["template"]["spec"]["containers"][0]["command"]
    agent_cmd = obj("DaemonSet", "ccld-agent")["spec"]["template"]["spec"]["containers"][0]["command"]
    col, col_log = procs.start("collector", remap(col_cmd, root, subs))
    wait_for(col_log, r"ccld collector: listening on", 60, col)
    procs.env["CCLD_CACHE_DIR"] = str(root / "var/cache/ccld")
    agent, agent_log = procs.start("agent", remap(agent_cmd, root, subs))
    wait_for(agent_log, r"ccld agent: tracing every rank on this node", START_TIMEOUT_S, agent)
    go = procs.tmp / "go"
    job_proc, _ = procs.start("job", gloo_job_cmd(2, "--steps", STEPS, "--ops", "allreduce", "--wait-file", go))
    job = run_job(procs, f"127.0.0.1:{mport}", job_proc, go)
    time.sleep(1.0)   # the agent ships every 100 ms; let the last frames arrive
    stop(agent, "agent")
    stop(col, "collector")
    assert_counted(root / "var/lib/ccld/store", job)
    assert (root / "var/lib/ccld/findings.jsonl").exists()
    assert "refused an agent" not in col_log.read_text()


def test_systemd_exec_start_lines_trace_a_real_job(procs):
    root = procs.tmp / "host"
    port, mport = free_port(), free_port()
    subs = {"tcp://127.0.0.1:5555": f"tcp://127.0.0.1:{port}", "127.0.0.1:9555": f"127.0.0.1:{mport}"}
    (root / "var/lib/ccld").mkdir(parents=True)   # StateDirectory=ccld
    col_argv, _ = unit_exec("ccld-collector.service")
    agent_argv, agent_unit = unit_exec("ccld-agent.service")
    col, col_log = procs.start("collector", remap(col_argv, root, subs))
    wait_for(col_log, r"ccld collector: listening on", 60, col)
    cache = re.search(r"CCLD_CACHE_DIR=(\S+)", agent_unit).group(1)
    procs.env["CCLD_CACHE_DIR"] = str(root) + cache
    agent, agent_log = procs.start("agent", remap(agent_argv, root, subs))
    wait_for(agent_log, r"ccld agent: tracing every rank on this node", START_TIMEOUT_S, agent)
    go = procs.tmp / "go"
    job_proc, _ = procs.start("job", gloo_job_cmd(2, "--steps", STEPS, "--ops", "allreduce", "--wait-file", go))
    job = run_job(procs, f"127.0.0.1:{mport}", job_proc, go)
    time.sleep(1.0)
    stop(agent, "agent")
    stop(col, "collector")
    assert_counted(root / "var/lib/ccld/store", job)


SRUN = """#!/bin/bash
# stand-in for srun on one node: log the options, run the command here (exec: signals reach it)
echo "$*" >> "$SRUN_LOG"
while [[ $# -gt 0 && $1 == -* ]]; do shift; done
exec "$@"
"""
SCONTROL = """#!/bin/bash
# stand-in for `scontrol show hostnames LIST`: one node
[[ "$1 $2" == "show hostnames" ]] && echo localhost
"""


def test_slurm_script_runs_collector_agents_and_training(procs):
    bin_dir = procs.tmp / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        os.chmod(bin_dir / name, 0o755)
    port, mport = free_port(), free_port()
    ccld_dir, go = procs.tmp / "ccld", procs.tmp / "go"
    procs.env.update(PATH=f"{bin_dir}:{procs.env['PATH']}", SRUN_LOG=str(procs.tmp / "srun.log"),
                     SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="localhost",
                     CCLD=os.path.join(os.path.dirname(sys.executable), "ccld"), CCLD_DIR=str(ccld_dir),
                     CCLD_PORT=str(port), CCLD_METRICS_PORT=str(mport), CCLD_BIND="127.0.0.1", GPUS_PER_NODE="2",
                     RDZV_PORT=str(free_port()), TORCHRUN=f"{sys.executable} -m torch.distributed.run",
                     CCLD_CACHE_DIR=str(procs.tmp / "cache"))
    if not os.access(procs.env["CCLD"], os.X_OK):
        procs.env["CCLD"] = str(bin_dir / "ccld")
        (bin_dir / "ccld").write_text(f"#!/bin/sh\nexec {sys.executable} -m ccld.cli \"$@\"\n")
        os.chmod(bin_dir / "ccld", 0o755)
    script = os.path.join(ROOT, "deploy", "slurm", "ccld-train.sbatch")
    p, log = procs.start("sbatch", ["bash", script, GLOO_JOB, "--steps", str(STEPS), "--ops", "allreduce",
                                    "--wait-file", str(go)])
    job = wait_until(lambda: our_job(procs, f"127.0.0.1:{mport}"), START_TIMEOUT_S + 60,
                     "both ranks in the collector's /snapshot")
    go.touch()
    assert p.wait(180) == 0, log.read_text()[-3000:]
    calls = (procs.tmp / "srun.log").read_text().splitlines()
    background = sorted(calls[:2])   # the collector's and the agents' steps start together, in any order
    assert background[0].startswith("--nodes=1 --ntasks=1 --nodelist=localhost --overlap ")
    assert " collector --listen " in background[0]
    assert background[1].startswith("--ntasks-per-node=1 --overlap ") and " agent --discover --collector " \
        f"tcp://localhost:{port} " in background[1]
    assert calls[2].startswith(f"--ntasks-per-node=1 {sys.executable} -m torch.distributed.run --nnodes 1 "
                               "--nproc-per-node 2 --rdzv-backend c10d")
    assert len(calls) == 3
    text = log.read_text()
    assert f"ccld: findings in {ccld_dir}/findings.jsonl" in text and f"store {ccld_dir}/store:" in text
    assert_counted(ccld_dir / "store", job)
