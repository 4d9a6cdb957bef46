"""The ProcessGroupNCCL probes (ccld/bpf/pgnccl.bpf.c) against the CUDA torch installed where a GPU is:
its libtorch_cuda.so must export every function they probe, resolved as the agent resolves them
(Family._plan: by mangled-name prefix). Run by bench/gpu_check.sh. The eBPF side is tested without a GPU
on a library with torch's symbols (tests/bpf/test_pgnccl_probes.py): the device machine has no bcc to
compile the program, so no probe has fired in a real ProcessGroupNCCL yet."""
import os

import pytest

from ccld.bpf.pgnccl import PgncclFamily

pytestmark = pytest.mark.gpu


def test_the_installed_cuda_torch_exports_every_processgroupnccl_probe():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cuda.so")
    points, missing = PgncclFamily(None)._plan(lib)
    assert not missing, f"{torch.__version__}: {missing}"
    assert sorted(p.fn for _, _, p in points) == ["init_work", "pg_init", "work_new"]
