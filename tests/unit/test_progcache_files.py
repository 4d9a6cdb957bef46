"""The compiled-program cache's key and its trust in files (no root: nothing is loaded here)."""
import os

import pytest

from ccld.bpf import progcache

pytestmark = pytest.mark.unit


def test_the_key_changes_with_the_text_the_cflags_and_the_kernels_name(tmp_path):
    src = tmp_path / "p.bpf.c"
    src.write_text("int f(void *ctx) { return 0; }")
    k = progcache.cache_key([str(src)], ["-DA=1"])
    assert k == progcache.cache_key([str(src)], ["-DA=1"])
    assert k != progcache.cache_key([str(src)], ["-DA=2"])
    src.write_text("int f(void *ctx) { return 1; }")
    assert k != progcache.cache_key([str(src)], ["-DA=1"])


def test_every_family_is_keyed_by_its_own_source():
    from ccld.tracer.families import build_families
    keys = {fam.NAME: fam.cache_key() for fam, _ in build_families(lambda e: None)}
    assert set(keys) == set(progcache.PROGRAMS)
    assert len(set(keys.values())) == len(keys)
    for fam, _ in build_families(lambda e: None):  # what ccld run preloads is what the family would load
        source, kernel = progcache.PROGRAMS[fam.NAME]
        assert (fam.SOURCE, tuple(fam.KERNEL_CFLAGS)) == (source, kernel)
        assert progcache.program_key(source, progcache.default_cflags(fam.NAME), kernel) == fam.cache_key()


def test_files_others_could_write_are_not_trusted(tmp_path, monkeypatch):
    d = tmp_path / "c"
    monkeypatch.setenv(progcache.ENV_DIR, str(d))
    progcache.save(str(d), "k", {"format": progcache.FORMAT, "tables": [], "functions": []})
    assert progcache.lookup(str(d), "k") is not None
    os.chmod(d / "k.json", 0o664)
    assert progcache.lookup(str(d), "k") is None
    os.chmod(d / "k.json", 0o600)
    os.chmod(d, 0o777)
    assert progcache.lookup(str(d), "k") is None


def test_off_turns_the_cache_off(monkeypatch):
    monkeypatch.setenv(progcache.ENV_DIR, "off")
    assert progcache.cache_dir() is None
