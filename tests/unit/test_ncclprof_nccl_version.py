"""ccld.ncclprof.loaded_nccl(): which libnccl a process has mapped and its ncclGetVersion(), read with
the real library setup installs (nvidia-nccl-cu12; no GPU needed to ask its version). Each case runs in
a child process, so this one never maps NCCL."""
import glob
import importlib.metadata
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ASK = "import json; from ccld.ncclprof import loaded_nccl; print(json.dumps(loaded_nccl()))"


def child(code):
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_no_nccl_mapped_says_so():
    assert child(ASK) == ["", None]


def test_the_mapped_library_and_its_version():
    import nvidia.nccl  # setup.sh installs nvidia-nccl-cu12 (the uprobes' tests read its symbols)
    libs = sorted(glob.glob(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so*")))
    assert libs, "nvidia-nccl-cu12 has no libnccl.so: reinstall it (scripts/setup.sh)"
    path, version = child(f"import ctypes; ctypes.CDLL({libs[0]!r}); " + ASK)
    assert os.path.realpath(path) == os.path.realpath(libs[0])
    want = importlib.metadata.version("nvidia-nccl-cu12").split(".")[:3]
    assert version == [int(x) for x in want]
