"""The agent loads and attaches its programs without bcc (program.Program, sysbpf.py, elfsyms.py),
and what it replaced bcc with agrees with bcc (the oracle, imported here and only here):

- an agent start, from a cold cache (compiled by bcc in a child process) and from a warm one, loads
  every family, attaches gloo's uprobes to a real torch process, and never has bcc in sys.modules;
- the ELF lister lists the same (name, address) pairs as bcc's get_user_functions_and_addresses on
  libtorch_cpu.so (~600,000 symbols), and turns addresses into the file offsets bcc's
  bcc_resolve_symname gives, on a library whose code is not at its file offset;
- a probe placed at such an offset fires, exactly as often as the function is called.
Needs root (it loads programs) and torch.
"""
import base64
import ctypes as ct
import glob
import json
import os
import re
import struct
import subprocess
import sys

import numpy
import pytest

from conftest import ROOT
from ccld.bpf import elfcode, elfsyms, sysbpf
from ccld.bpf.program import Program

pytestmark = pytest.mark.bpf

CALLS = 7  # the probed function is called a prime number of times: a lost or doubled hit shows
AGENT_START = r"""
import json, subprocess, sys
from ccld.tracer.families import load_families
pre = load_families()
out = {"problem": str(pre.problem) if pre.problem else None, "warnings": pre.warnings,
       "loaded": {f.NAME: f.from_cache for f, _ in pre.families}}
if sys.argv[1] == "attach":
    job = subprocess.Popen([sys.executable, "-c", "import torch, sys; print(1, flush=True); sys.stdin.read()"],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    job.stdout.readline()
    gloo = next(f for f, _ in pre.families if f.NAME == "gloo")
    att = gloo.attach(job.pid, gloo.find_lib(job.pid))
    out["probes"] = len(att.points) + len(att.ret_points)
    job.kill()
for f, _ in pre.families:
    f.close()
out["bcc"] = sorted(m for m in sys.modules if m == "bcc" or m.startswith("bcc."))
print(json.dumps(out))
"""


def torch_lib():
    import torch
    return os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")


def offset_differs(path):
    """True when `path`'s executable segment is mapped at another address than its file offset."""
    try:
        return any(s.flags & elfcode.PF_X and s.vaddr != s.offset for s in elfcode.segments(path))
    except (OSError, ValueError):
        return False


def openblas():
    """numpy's OpenBLAS (lld lays its code out at another address than its file offset)."""
    libs = glob.glob(os.path.join(os.path.dirname(os.path.dirname(numpy.__file__)), "numpy.libs", "*openblas*.so"))
    libs = [p for p in libs if offset_differs(p)]
    if not libs:
        pytest.fail("no numpy.libs OpenBLAS whose code sits at another address than its file offset")
    return libs[0]


def test_an_agent_start_never_imports_bcc(need_bpf, tmp_path):
    env = dict(os.environ, CCLD_BPF_CACHE=str(tmp_path / "cache"), PYTHONPATH=ROOT)
    runs = {}
    for run, mode in (("cold", "load"), ("warm", "attach")):
        res = subprocess.run([sys.executable, "-c", AGENT_START, mode], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=600)
        assert res.returncode == 0, f"{run}: rc {res.returncode}\n{res.stderr[-3000:]}"
        runs[run] = json.loads(res.stdout.strip().splitlines()[-1])
    for run, out in runs.items():
        assert out["problem"] is None and not out["warnings"], (run, out)
        assert out["bcc"] == [], f"{run} start imported {out['bcc']}"
        assert set(out["loaded"]) == {"gloo", "nccl", "pgnccl", "net", "sched", "rdma"}
    assert not any(runs["cold"]["loaded"].values()), "the cold start compiled every family"
    assert all(runs["warm"]["loaded"].values()), "the warm start loaded every family from the cache"
    assert runs["warm"]["probes"] >= 30


def test_the_elf_lister_lists_what_bcc_lists_on_libtorch(need_bpf):
    from bcc import BPF
    from ccld.bpf.gloo import GlooFamily
    lib = torch_lib()
    gloo = "^(" + "|".join(re.escape(p.prefix) for p in GlooFamily.PROBES) + ")"
    for pattern in (gloo, "^_ZN4c10d"):
        theirs = sorted((n.decode(), a) for n, a in BPF.get_user_functions_and_addresses(lib.encode(), pattern.encode()))
        ours = sorted(elfsyms.functions(lib, pattern))
        assert len(theirs) > 50 and ours == theirs, pattern


def test_file_offsets_are_bccs(need_bpf):
    from bcc import BPF
    for lib in (openblas(), torch_lib()):
        syms = elfsyms.functions(lib, "^[a-z_]")[::97][:200]
        assert len(syms) > 20
        for name, addr in syms:
            assert elfcode.file_offset(lib, addr) == BPF._check_path_symbol(lib.encode(), None, addr, -1)[1], name


def counting_program():
    """A program of one function that adds 1 to hits[0] per run (a spec as progcache keeps it)."""
    def insn(op, dst=0, src=0, off=0, imm=0):
        return struct.pack("<BBhi", op, dst | src << 4, off, imm)
    code = b"".join([insn(0x18, 1, 1), insn(0),        # r1 = &hits (ld_imm64, the map's fd patched in)
                     insn(0xBF, 2, 10), insn(0x07, 2, imm=-4),  # r2 = fp - 4
                     insn(0x62, 10, off=-4),           # *(u32 *)(fp - 4) = 0: the key
                     insn(0x85, imm=1),                # r0 = bpf_map_lookup_elem(r1, r2)
                     insn(0x15, 0, off=2),             # if r0 == 0 goto out
                     insn(0xB7, 1, imm=1), insn(0xDB, 0, 1),  # lock *(u64 *)r0 += 1
                     insn(0xB7, 0), insn(0x95)])       # out: return 0
    return {"format": 1, "license": "GPL", "kern_version": 0,
            "tables": [{"name": "hits", "type": 2, "key_size": 4, "leaf_size": 8, "max_entries": 1, "flags": 0,
                        "key_desc": '"int"', "leaf_desc": '"unsigned long long"'}],
            "functions": [{"name": "count", "code": base64.b64encode(code).decode(), "relocs": [[0, "hits"]]}]}


@pytest.fixture(params=["uprobe_multi", "perf events"])
def uprobe_mode(request, monkeypatch):
    """Both ways a uprobe is attached: links (this kernel, 6.6+) and perf events (older kernels)."""
    multi = request.param == "uprobe_multi"
    if multi:
        assert sysbpf.has_uprobe_multi(), "this kernel (6.6+) has uprobe_multi links: the feature probe says no"
    monkeypatch.setattr(sysbpf, "_multi", multi)
    return multi


def test_the_uprobe_multi_probe_heeds_its_switch(need_bpf, monkeypatch):
    monkeypatch.setattr(sysbpf, "_multi", None)
    monkeypatch.setenv("CCLD_UPROBE_MULTI", "0")
    assert sysbpf.has_uprobe_multi() is False
    monkeypatch.setattr(sysbpf, "_multi", None)
    monkeypatch.delenv("CCLD_UPROBE_MULTI")
    assert sysbpf.has_uprobe_multi() is True  # kernel 6.18


def test_a_probe_at_a_file_offset_fires_once_per_call(need_bpf, uprobe_mode):
    lib = openblas()
    fns = ["scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_procs64_"]
    addrs = []
    for fn in fns:
        (addr,) = {a for n, a in elfsyms.functions(lib, f"^{fn}$")}
        assert elfcode.file_offset(lib, addr) != addr  # the case a wrong conversion would miss
        addrs.append(addr)
    calls = "; ".join(f"[lib.{fn}() for _ in range({CALLS})]" for fn in fns)
    caller = (f"import ctypes, sys; lib = ctypes.CDLL({lib!r}); sys.stdout.write('1\\n'); sys.stdout.flush(); "
              f"sys.stdin.readline(); {calls}")
    job = subprocess.Popen([sys.executable, "-c", caller], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    prog = Program(counting_program())
    try:
        job.stdout.readline()
        fds = prog.attach_uprobes(lib, [(a, "count", False) for a in addrs], pid=job.pid)
        assert prog.funcs["count"].fd >= 0
        assert len(fds) == (1 if uprobe_mode else 2)  # one link holds both offsets; a perf event each
        job.communicate("go\n", timeout=60)
        assert job.returncode == 0
        assert prog[b"hits"][ct.c_int(0)].value == 2 * CALLS
        prog.close_events(fds)
        assert prog._events == []
    finally:
        job.kill()
        prog.close()
    prog.close()  # idempotent
    assert prog.funcs == {}


def test_a_failed_attach_leaves_no_probe_behind(need_bpf, uprobe_mode):
    lib = openblas()
    (addr,) = {a for n, a in elfsyms.functions(lib, "^scipy_openblas_get_num_threads64_$")}
    prog = Program(counting_program())
    try:
        with pytest.raises(KeyError):  # the second function does not exist: the first's probe goes too
            prog.attach_uprobes(lib, [(addr, "count", False), (addr, "nosuch", False)])
        assert prog._events == []
    finally:
        prog.close()
