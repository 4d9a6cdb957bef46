"""bench/cupti_overhead.py without a GPU: arguments, ratios, the table, its files, and one whole run with
torch and CUPTI replaced by fakes (so the GPU run's code paths are exercised before a device sees them).
Also bench/gpu_check.sh: valid bash, installs nothing, and stops with exit 2 and a reason here."""
import json
import os
import subprocess
import sys
import types

import pytest

import fake_cupti

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import cupti_overhead as co  # noqa: E402

NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"


def test_defaults_and_bad_arguments(monkeypatch):
    monkeypatch.setenv("OUT", "/tmp/o")
    a = co.parse_args([])
    assert (a.rounds, a.kernels, a.allreduces, a.out) == (5, 20000, 2000, "/tmp/o")
    assert a.workloads == ["kernels", "allreduce"]
    assert co.parse_args(["--workloads", "allreduce"]).workloads == ["allreduce"]
    for bad in (["--workloads", "gemm"], ["--rounds", "0"], ["--kernels", "-1"]):
        with pytest.raises(SystemExit):
            co.parse_args(bad)


def test_modes_rotate_so_each_takes_each_place():
    orders = [co.mode_order(r) for r in range(3)]
    assert all(sorted(o) == sorted(co.MODES) for o in orders)
    assert [o[0] for o in orders] == ["off", "nccl", "all"]


def test_ratios_are_medians_over_off():
    samples = {"kernels": {"off": [1.0, 1.2, 0.9], "nccl": [1.01, 1.5, 0.95], "all": [2.0, 2.2, 1.8]}}
    rows = co.summarize(samples, {"kernels": 1000}, {"kernels": {"all": {"kept": 3000, "lost": 2}}})
    by = {r["mode"]: r for r in rows}
    assert by["off"]["ratio"] == 1.0 and by["nccl"]["ratio"] == pytest.approx(1.01)
    assert by["all"]["ratio"] == pytest.approx(2.0) and by["all"]["per_iter_us"] == pytest.approx(2000.0)
    assert (by["all"]["kept"], by["all"]["lost"]) == (3000, 2)
    table = co.format_table(rows)
    assert table.splitlines()[0].split()[:3] == ["workload", "mode", "windows"]
    assert "1.0100" in table and "2.0000" in table
    assert co.verdict(rows).startswith("NCCL-only filter: worst ratio 1.0100 (meets")


def test_files_are_written(tmp_path):
    rows = co.summarize({"allreduce": {"off": [1.0], "nccl": [1.2], "all": [1.3]}}, {"allreduce": 10}, {})
    paths = co.write_outputs(str(tmp_path), rows, {"date": "2026-01-01", "gpu": "G"})
    assert sorted(os.path.basename(p) for p in paths) == ["cupti_overhead.json", "cupti_overhead.md",
                                                          "cupti_overhead.txt"]
    assert json.loads((tmp_path / "cupti_overhead.json").read_text())["rows"][1]["ratio"] == pytest.approx(1.2)
    assert "misses the 1.01 goal" in (tmp_path / "cupti_overhead.md").read_text()


class FakeTensor:
    def __init__(self, fake):
        self.fake = fake

    def add_(self, _):
        self.fake.launch("_ZN2at6native6kernelEv")


def fake_torch(fake):
    torch = types.ModuleType("torch")
    torch.__version__ = "0.fake"
    torch.cuda = types.SimpleNamespace(is_available=lambda: True, set_device=lambda d: None,
                                       synchronize=lambda: None, get_device_name=lambda d: "FakeGPU")
    torch.zeros = torch.ones = lambda *a, **k: FakeTensor(fake)
    dist = types.ModuleType("torch.distributed")
    dist.ReduceOp = types.SimpleNamespace(AVG="avg")
    dist.FileStore = lambda path, n: object()
    dist.init_process_group = lambda *a, **k: None
    dist.destroy_process_group = lambda: None
    dist.all_reduce = lambda t, op=None, group=None: fake.launch(NCCL)
    torch.distributed = dist
    return torch, dist


def test_a_whole_run_with_fake_torch_and_cupti(tmp_path, monkeypatch, capsys):
    fake = fake_cupti.FakeCupti()
    torch, dist = fake_torch(fake)
    pkg = types.ModuleType("cupti")
    pkg.cupti = fake
    for name, mod in (("torch", torch), ("torch.distributed", dist), ("cupti", pkg), ("cupti.cupti", fake)):
        monkeypatch.setitem(sys.modules, name, mod)
    args = co.parse_args(["--rounds", "3", "--kernels", "40", "--allreduces", "30", "--out", str(tmp_path)])
    assert co.run(args) == 0
    out = capsys.readouterr().out
    rows = json.loads((tmp_path / "cupti_overhead.json").read_text())["rows"]
    kept = {(r["workload"], r["mode"]): r["kept"] for r in rows}
    assert kept == {("kernels", "off"): 0, ("kernels", "nccl"): 0, ("kernels", "all"): 120,
                    ("allreduce", "off"): 0, ("allreduce", "nccl"): 90, ("allreduce", "all"): 90}
    assert all(r["lost"] == 0 and r["windows"] == 3 for r in rows)
    assert "receiver got {'msgs':" in out and "'kernels': 300" in out  # every kept record reached the receiver
    assert "launch records: selective, thread ids: system" in out


def test_gpu_check_script_installs_nothing_and_explains_what_is_missing(tmp_path):
    script = os.path.join(ROOT, "bench", "gpu_check.sh")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    code = [line for line in open(script) if line.strip() and not line.lstrip().startswith("#")]
    assert not [line for line in code if "pip install" in line or "apt-get" in line]
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    p = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "missing: a CUDA device visible to torch" in p.stdout and "nothing was run" in p.stdout
    assert "missing:" in (tmp_path / "gpu_check.txt").read_text()
