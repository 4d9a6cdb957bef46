"""What the agent does on every scan and drain, kept cheap: loader.read_maps / mapped_path /
Family.find_lib (which mapped file is a family's library, found by one regex over /proc/PID/maps' text;
the agent looks again whenever a rank's address space changes), and records.member (np.isin for a
drain's pids against the few traced processes)."""
import ctypes.util
import re

import pytest

from ccld.bpf.gloo import GlooFamily
from ccld.bpf.loader import mapped_path, read_maps
from ccld.bpf.nccl import NcclFamily
from ccld.bpf.rdma import RdmaFamily

pytestmark = pytest.mark.unit

MAPS = """\
55d0c0a00000-55d0c0a2c000 r--p 00000000 08:01 1311 /usr/bin/python3.11
7f1a20000000-7f1a20021000 rw-p 00000000 00:00 0
7f1a2f400000-7f1a2f600000 r--p 00000000 08:01 9001 /opt/venv/lib/libtorch_cpu.so.bak
7f1a30000000-7f1a31000000 r--p 00000000 08:01 9002 /opt/my venv/lib/libtorch_cpu.so
7f1a31000000-7f1a38000000 r-xp 01000000 08:01 9002 /opt/my venv/lib/libtorch_cpu.so
7f1a40000000-7f1a40100000 r-xp 00000000 08:01 9003 /usr/lib/x86_64-linux-gnu/libibverbs.so.1.14.44.0 (deleted)
7f1a41000000-7f1a41100000 r-xp 00000000 08:01 9004 /usr/lib/libnccl.so.2.21.5
7ffd1c000000-7ffd1c021000 rw-p 00000000 00:00 0                          [stack]"""


def pat(family):
    return re.compile(family.LIB_PATTERN, re.M)


def test_the_first_line_whose_path_ends_in_the_library_gives_the_whole_path():
    # a path with a space is kept whole; a file that only starts with the name (".bak") is not it
    assert mapped_path(MAPS, pat(GlooFamily)) == "/opt/my venv/lib/libtorch_cpu.so"
    assert mapped_path(MAPS, pat(NcclFamily)) == "/usr/lib/libnccl.so.2.21.5"
    # the last line, without a newline after it
    assert mapped_path(MAPS.split("\n", 6)[6], pat(NcclFamily)) == "/usr/lib/libnccl.so.2.21.5"


def test_a_deleted_or_absent_library_is_not_found():
    assert mapped_path(MAPS, pat(RdmaFamily)) is None  # "(deleted)": replaced on disk, cannot be probed
    assert mapped_path("", pat(GlooFamily)) is None
    assert mapped_path(MAPS.replace("libnccl", "libnccx"), pat(NcclFamily)) is None


def test_find_lib_reads_a_live_process_maps_once_for_several_families():
    libc = ctypes.util.find_library("c")
    assert libc, "no libc to look for"
    import os
    text = read_maps(os.getpid())
    assert "libc.so" in text and text.count("\n") > 10
    found = mapped_path(text, re.compile(r"/libc\.so(\.[0-9.]+)?$", re.M))
    assert found is not None and found.endswith(("libc.so.6", "libc.so")) and os.path.exists(found)
    assert read_maps(2**22 + 7) == ""  # no such process
    assert GlooFamily.__new__(GlooFamily).find_lib(os.getpid(), "") is None


def test_member_is_isin_for_small_and_large_sets():
    import numpy as np
    from ccld.bpf.records import SMALL_SET, member
    rng = np.random.default_rng(7)
    vals = rng.integers(0, 64, 500).astype(np.uint32)  # as the ring's tgid column comes
    for among in ([], [5], [5, 9, 63], list(range(0, 64, 2))[:SMALL_SET + 3], np.array([1, 2], np.int64)):
        got = member(vals, among)
        assert got.dtype == bool and got.shape == vals.shape
        assert (got == np.isin(vals, np.asarray(among, np.int64))).all(), among
    assert member(np.zeros(0, np.int64), [1]).shape == (0,)
