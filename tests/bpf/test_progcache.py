"""The compiled-program cache (ccld/bpf/progcache.py): a program taken from it is the program bcc
compiles (same functions, same instructions once map fds are set aside; bcc itself, in this test
process, is the oracle), it loads and works without bcc (program.Program), and a cache file anyone
else could have written is not used. Needs root (it loads programs)."""
import base64
import os
import struct

import pytest

from ccld.bpf import progcache

pytestmark = pytest.mark.bpf


@pytest.fixture
def cache(tmp_path, monkeypatch, need_bpf):
    d = tmp_path / "cache"
    monkeypatch.setenv(progcache.ENV_DIR, str(d))
    return d


def without_fds(spec):
    """Each function's instructions with the map fds of its relocations zeroed."""
    out = {}
    for f in spec["functions"]:
        code = bytearray(base64.b64decode(f["code"]))
        for k, _ in f["relocs"]:
            struct.pack_into("<i", code, k * progcache.INSN + 4, 0)
        out[f["name"]] = bytes(code)
    return out


def test_a_cached_program_is_the_compiled_one_and_works(cache):
    from ccld.bpf.gloo import GlooFamily
    from ccld.bpf.gloo_translator import GlooTranslator
    first = GlooFamily(GlooTranslator(lambda e: None))
    first.load()
    assert not first.from_cache  # compiled by bcc in a child process (compile.py), loaded by Program
    cold = progcache.describe_cached(first.bpf)
    first.close()
    from bcc import BPF
    from ccld.bpf.kheaders import ensure_kernel_headers
    ensure_kernel_headers()
    oracle = BPF(src_file=first.source_path().encode(), cflags=first.all_cflags())
    try:
        compiled = progcache.describe(oracle)
    finally:
        oracle.cleanup()
    assert without_fds(cold) == without_fds(compiled)
    (path,) = os.listdir(cache)
    again = GlooFamily(GlooTranslator(lambda e: None))
    again.load()
    try:
        assert again.from_cache
        assert without_fds(progcache.describe_cached(again.bpf)) == without_fds(compiled)
        traced = again.bpf[b"traced"]  # maps work as bcc's: update, read, delete
        import ctypes as ct
        traced[ct.c_uint32(4242)] = ct.c_uint32(7)
        assert traced[ct.c_uint32(4242)].value == 7
        del traced[ct.c_uint32(4242)]
        assert again.lost() == 0 and again.ring.pending() == 0
        for name in ("work_init", "work_exec", "api_enter"):  # and the kernel accepts the functions
            assert again.bpf.load_func(name.encode(), 2).fd >= 0
    finally:
        again.close()


def test_a_cache_file_others_could_write_is_not_used(cache):
    from ccld.bpf.sched import SchedFamily, SchedTranslator
    fam = SchedFamily(SchedTranslator(lambda e: None))
    fam.load()
    fam.close()
    (path,) = os.listdir(cache)
    os.chmod(cache / path, 0o666)
    fam = SchedFamily(SchedTranslator(lambda e: None))
    fam.load()
    try:
        assert not fam.from_cache  # compiled again (and the file replaced by a private one)
        assert oct((cache / path).stat().st_mode & 0o777) == "0o600"
    finally:
        fam.close()


def test_a_damaged_cache_file_is_compiled_again(cache):
    from ccld.bpf.sched import SchedFamily, SchedTranslator
    fam = SchedFamily(SchedTranslator(lambda e: None))
    fam.load()
    fam.close()
    (path,) = os.listdir(cache)
    (cache / path).write_text('{"format": 1, "tables": [], "functions": [{"name": "x"')
    fam = SchedFamily(SchedTranslator(lambda e: None))
    fam.load()
    try:
        assert not fam.from_cache
    finally:
        fam.close()


def test_with_the_cache_off_a_program_comes_back_over_the_pipe(tmp_path, monkeypatch, need_bpf):
    import sys
    monkeypatch.setenv(progcache.ENV_DIR, "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # where a default cache would go
    from ccld.bpf.rdma import RdmaFamily
    had_bcc = "bcc" in sys.modules
    fam = RdmaFamily(lambda k, r: None)
    fam.load()
    try:
        assert not fam.from_cache and fam.ring is not None and fam.lost() == 0
        assert ("bcc" in sys.modules) == had_bcc, "the compile ran bcc in this process"
        assert not (tmp_path / "xdg" / "ccld" / "bpf").exists(), "nothing kept with the cache off"
    finally:
        fam.close()


def test_a_cold_start_compiles_ahead_in_several_children_and_a_broken_family_fails_alone(cache, tmp_path):
    """compile_ahead: the families the cache lacks are compiled by child processes side by side (one
    per CPU); each family gets its own program description, and one whose source does not compile
    gets its own problem while the others compile."""
    from ccld.bpf import loader
    from ccld.bpf.gloo import GlooFamily
    from ccld.bpf.gloo_translator import GlooTranslator
    from ccld.bpf.sched import SchedFamily
    from ccld.errors import EnvironmentProblem
    broken = tmp_path / "broken.bpf.c"
    broken.write_text("int f(void *ctx) { return undeclared; }\n")

    class Broken(SchedFamily):
        NAME = "broken"

        def source_path(self):
            return str(broken)

        def cache_key(self):
            return "broken-" + super().cache_key()

    fams = [GlooFamily(GlooTranslator(lambda e: None)), SchedFamily(lambda *a: None), Broken(lambda *a: None)]
    loader.compile_ahead(fams)
    assert isinstance(fams[0].ahead, dict) and isinstance(fams[1].ahead, dict)
    names = [{f["name"] for f in fam.ahead["functions"]} for fam in fams[:2]]
    assert "tracepoint__sched__sched_switch" in names[1] and "tracepoint__sched__sched_switch" not in names[0]
    assert {p.fn for p in GlooFamily.PROBES if p.fn} <= names[0]  # each family got its own program
    assert isinstance(fams[2].ahead, EnvironmentProblem) and "undeclared" in str(fams[2].ahead)
    fams[1].load()  # takes what was compiled ahead: loads it, and keeps it in the cache
    try:
        assert not fams[1].from_cache and fams[1].ahead is None and os.listdir(cache)
    finally:
        fams[1].close()

