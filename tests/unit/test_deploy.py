"""deploy/: Kubernetes manifests against the Kubernetes schemas (kubernetes-validate bundles them, so
this runs offline) and the structure that matters to ccld; systemd units through
`systemd-analyze verify`; every command a recipe runs parses with ccld's own command line.
The commands themselves run for real in tests/e2e/test_deploy_e2e.py."""
import os
import re
import shlex
import shutil
import subprocess

import pytest
import yaml

from ccld import cli
from conftest import ROOT

pytestmark = pytest.mark.unit

DEPLOY = os.path.join(ROOT, "deploy")
K8S = os.path.join(DEPLOY, "kubernetes")
K8S_VERSIONS = ("1.30.0", "1.37.0")   # 1.30: the first with securityContext.appArmorProfile
CCLD_BIN = "/opt/ccld/.venv/bin/ccld"


def manifests():
    out = []
    for name in sorted(os.listdir(K8S)):
        with open(os.path.join(K8S, name)) as f:
            out += [(name, d) for d in yaml.safe_load_all(f) if d]
    return out


def obj(kind, name):
    (d,) = [d for _, d in manifests() if d["kind"] == kind and d["metadata"]["name"] == name]
    return d


def parse(cmd):
    """ccld's own parser on a recipe's command line (argparse exits on an unknown flag)."""
    assert cmd[0].endswith("/ccld"), cmd
    return cli._parser().parse_args(cmd[1:])


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_is_valid_for_kubernetes(version):
    import kubernetes_validate
    docs = manifests()
    assert sorted({d["kind"] for _, d in docs}) == ["DaemonSet", "Deployment", "Namespace",
                                                    "PersistentVolumeClaim", "Service"]
    for name, d in docs:
        try:
            kubernetes_validate.validate(d, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{name}: {d['kind']} {d['metadata']['name']} is not valid for Kubernetes {version}: {e}")


def test_the_validator_does_catch_mistakes():
    import kubernetes_validate
    ds = obj("DaemonSet", "ccld-agent")
    ds["spec"]["template"]["spec"]["hostPid"] = True  # wrong case: strict validation must refuse it
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, K8S_VERSIONS[-1], strict=True)


def test_agent_daemonset_can_trace_every_rank_on_its_node():
    ds = obj("DaemonSet", "ccld-agent")
    spec = ds["spec"]["template"]["spec"]
    assert spec["hostPID"] is True
    (c,) = spec["containers"]
    sc = c["securityContext"]
    assert sc.get("privileged") or {"BPF", "PERFMON", "SYS_PTRACE"} <= set(sc["capabilities"]["add"])
    assert sc["runAsUser"] == 0 and sc["seccompProfile"]["type"] == "Unconfined"
    host = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    for path in ("/sys/kernel/btf", "/sys/kernel/tracing", "/lib/modules", "/usr/src"):
        name = next(n for n, p in host.items() if p == path)
        assert mounts[name] == path, f"{path} must be mounted where bcc and ccld look for it"
    args = parse(c["command"])
    assert args.verb == "agent" and args.discover and not args.pid and not args.no_bpf
    svc = obj("Service", "ccld-collector")
    events = next(p for p in svc["spec"]["ports"] if p["name"] == "events")
    assert args.collector == f"tcp://{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.cluster.local:" \
                             f"{events['port']}"
    assert spec["dnsPolicy"] == "ClusterFirstWithHostNet" if spec.get("hostNetwork") else True
    keys = {v["name"]: v["secret"] for v in spec["volumes"] if "secret" in v}
    by_mount = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    secret = keys[by_mount[os.path.dirname(args.curve_key)]]
    assert secret["defaultMode"] == 0o400  # ccld refuses a secret key others can read
    assert os.path.basename(args.curve_key) == "agent.key_secret"
    assert os.path.basename(args.collector_key) == "collector.key"
    # the spool lives on the node, so frames the collector has not stored survive a replaced pod
    spool_mount = next(m for m in c["volumeMounts"] if args.spool.startswith(m["mountPath"] + "/"))
    assert host[spool_mount["name"]] == spool_mount["mountPath"] and not spool_mount.get("readOnly")


def test_collector_deployment_and_service_agree():
    dep = obj("Deployment", "ccld-collector")
    svc = obj("Service", "ccld-collector")
    spec = dep["spec"]["template"]["spec"]
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    (c,) = spec["containers"]
    args = parse(c["command"])
    assert args.verb == "collector" and args.store and args.findings
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert args.listen == f"tcp://0.0.0.0:{ports['events']}"
    assert args.metrics == f"0.0.0.0:{ports['metrics']}"
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert {p["name"]: p["targetPort"] for p in svc["spec"]["ports"]} == {"events": "events", "metrics": "metrics"}
    assert svc["metadata"]["annotations"]["prometheus.io/port"] == str(ports["metrics"])
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols[mounts["/var/lib/ccld"]]["persistentVolumeClaim"]["claimName"] == "ccld-store"
    assert args.store.startswith("/var/lib/ccld/") and args.findings.startswith("/var/lib/ccld/")
    assert vols[mounts[os.path.dirname(args.curve_key)]]["secret"]["defaultMode"] == 0o400
    assert "fsGroup" not in (spec.get("securityContext") or {})  # it would make the secret group-readable


def test_the_readme_creates_every_secret_the_manifests_mount():
    with open(os.path.join(DEPLOY, "README.md")) as f:
        readme = f.read()
    made = dict(re.findall(r"create secret generic (\S+) --from-file=(\S+?)=", readme))
    for kind, name in (("DaemonSet", "ccld-agent"), ("Deployment", "ccld-collector")):
        spec = obj(kind, name)["spec"]["template"]["spec"]
        (c,) = spec["containers"]
        args = parse(c["command"])
        secrets = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
        for m in c["volumeMounts"]:
            if m["name"] in secrets:
                file = made.get(secrets[m["name"]])
                assert file, f"deploy/README.md never creates Secret {secrets[m['name']]}"
                used = [a for a in (getattr(args, "curve_key", None), getattr(args, "collector_key", None))
                        if a and os.path.dirname(a) == m["mountPath"]]
                assert not used or os.path.basename(used[0]) == file, (used, file)
                if getattr(args, "allow_keys", None) == m["mountPath"]:
                    assert file.endswith(".key")


def test_the_image_installs_ccld_where_the_manifests_run_it():
    with open(os.path.join(DEPLOY, "Dockerfile")) as f:
        docker = f.read()
    assert "python3 -m venv /opt/ccld/.venv" in docker and "pip install --no-cache-dir /opt/ccld" in docker
    for _, d in manifests():
        for c in ((d.get("spec") or {}).get("template") or {}).get("spec", {}).get("containers", []):
            assert c["command"][0] == CCLD_BIN and c["image"] == "ccld:0.1.0"


def unit_exec(name):
    """(ExecStart argv with the unit's own defaults substituted, the unit's text)."""
    with open(os.path.join(DEPLOY, "systemd", name)) as f:
        text = f.read()
    env = {}
    for line in re.findall(r"^Environment=(.*)$", text, re.M):
        env.update(kv.split("=", 1) for kv in shlex.split(line))
    line = re.search(r"^ExecStart=(.*)$", text, re.M).group(1)
    argv = []
    for word in shlex.split(line):
        if re.fullmatch(r"\$\{?(\w+)\}?", word):   # $VAR splits into words, ${VAR} is one word (systemd)
            v = env.get(word.strip("${}"), "")
            argv += v.split() if not word.startswith("${") else [v]
        else:
            argv.append(word)
    return argv, text


def test_systemd_units_pass_systemd_analyze_verify(tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (scripts/setup.sh installs systemd)")
    for name in ("ccld-collector.service", "ccld-agent.service"):
        # verify checks that ExecStart's program exists: point /opt/ccld at this checkout
        with open(os.path.join(DEPLOY, "systemd", name)) as f:
            (tmp_path / name).write_text(f.read().replace("/opt/ccld", ROOT))
    r = subprocess.run(["systemd-analyze", "verify", "ccld-collector.service", "ccld-agent.service"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr   # warnings count: verify exits 0 on them
    bad = (tmp_path / "ccld-agent.service").read_text().replace("Restart=on-failure", "Restart=on-failur")
    (tmp_path / "bad.service").write_text(bad)
    r = subprocess.run(["systemd-analyze", "verify", "bad.service"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60)
    assert "Failed to parse service restart specifier" in r.stderr   # the check does look


def test_systemd_commands_parse_and_keep_the_store_in_the_state_directory():
    argv, text = unit_exec("ccld-collector.service")
    args = parse(argv)
    assert args.verb == "collector" and args.listen == "tcp://127.0.0.1:5555" and args.metrics == "127.0.0.1:9555"
    state = re.search(r"^StateDirectory=(\S+)$", text, re.M).group(1)
    assert args.store.startswith(f"/var/lib/{state}/") and args.findings.startswith(f"/var/lib/{state}/")
    assert "EnvironmentFile=-/etc/default/ccld" in text
    argv, text = unit_exec("ccld-agent.service")
    args = parse(argv)
    assert args.verb == "agent" and args.discover and args.collector == "tcp://127.0.0.1:5555"
    assert re.search(r"^User=", text, re.M) is None   # root: eBPF
    with open(os.path.join(DEPLOY, "systemd", "ccld.env")) as f:
        env = f.read()
    for var in ("CCLD_LISTEN", "CCLD_METRICS", "CCLD_COLLECTOR_ARGS", "CCLD_COLLECTOR", "CCLD_AGENT_ARGS"):
        assert f"#{var}=" in env


def test_slurm_script_is_valid_bash_with_one_agent_per_node():
    path = os.path.join(DEPLOY, "slurm", "ccld-train.sbatch")
    assert os.access(path, os.X_OK)
    subprocess.run(["bash", "-n", path], check=True, timeout=30)
    with open(path) as f:
        text = f.read()
    assert re.search(r"^srun --ntasks-per-node=1 --overlap \\\n\s+\"\$CCLD\" agent --discover", text, re.M)
    assert re.search(r'^srun --nodes=1 --ntasks=1 --nodelist="\$head" --overlap \\\n\s+"\$CCLD" collector', text, re.M)
    assert "#SBATCH --ntasks-per-node=1" in text
