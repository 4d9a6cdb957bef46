"""discover.ProcTree: the agent's view of a job's process tree, reading each process's parent once."""
import os
import subprocess
import time

import pytest

from ccld.tracer import discover

pytestmark = pytest.mark.unit


def wait_children(pid, n, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        kids = discover.descendants(pid)
        if len(kids) >= n:
            return kids
        time.sleep(0.05)
    raise AssertionError(f"{pid} has {discover.descendants(pid)}, wanted {n} descendants")


def test_descendants_match_a_full_scan_and_parents_are_read_once(monkeypatch):
    # sh -> (sleep, sh -> sleep): three descendants, two levels
    top = subprocess.Popen(["sh", "-c", "sleep 30 & sh -c 'sleep 30 & wait' & wait"])
    try:
        want = wait_children(top.pid, 3)
        reads = []
        real = discover.ppid_of
        monkeypatch.setattr(discover, "ppid_of", lambda pid: reads.append(pid) or real(pid))
        tree = discover.ProcTree()
        pids = discover.all_pids()
        assert tree.descendants([top.pid], pids) == want
        first = len(reads)
        assert first >= len(pids) - 5  # every process once (a few may have gone meanwhile)
        assert tree.descendants([top.pid], discover.all_pids()) == want
        assert len(reads) - first < 20, "known processes were read again"

        victim = min(want)
        os.kill(victim, 9)
        deadline = time.monotonic() + 10
        while victim in discover.all_pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        got = tree.descendants([top.pid], discover.all_pids())
        assert victim not in got and got == want - {victim}
        assert victim not in tree._ppid
    finally:
        subprocess.run(["pkill", "-9", "-P", str(top.pid)])
        top.kill()
        top.wait()


def test_several_roots_and_a_new_child():
    a = subprocess.Popen(["sh", "-c", "sleep 30 & wait"])
    b = subprocess.Popen(["sh", "-c", "sleep 30 & wait"])
    try:
        ka, kb = wait_children(a.pid, 1), wait_children(b.pid, 1)
        tree = discover.ProcTree()
        assert tree.descendants([a.pid], discover.all_pids()) == ka
        assert tree.descendants([a.pid, b.pid], discover.all_pids()) == ka | kb
    finally:
        for p in (a, b):
            subprocess.run(["pkill", "-9", "-P", str(p.pid)])
            p.kill()
            p.wait()


def test_a_library_keeps_one_set_of_probes_when_its_process_exits_during_the_attach(tmp_path):
    """loader.Family.attach files a library's probes by (device, inode), so the same file reached through
    /proc/PID/root and directly gets one set. The key is read before the attach (seconds on libtorch):
    read after it, a process that exited meanwhile takes its /proc/PID/root path along, the probes are
    filed under the path, and the next rank mapping that file gets a second set (every call twice)."""
    from ccld.bpf import loader

    lib = tmp_path / "libtorch_cpu.so"
    lib.write_bytes(b"\x7fELF")
    root = tmp_path / "root-of-pid"  # stands for /proc/PID/root: gone when the process is
    os.symlink(tmp_path, root)
    attached = []

    class Traced(dict):
        def __setitem__(self, k, v):
            dict.__setitem__(self, k.value, v.value)

    class Fake(loader.Family):
        NAME = "fake"

        def _attach_lib(self, path):
            attached.append(path)
            if root.is_symlink():
                root.unlink()  # the traced process exits while its library's probes go on
            return loader.Attachment(-1, path)

    fam = Fake(lambda kind, rec: None)
    fam.bpf = {b"traced": Traced()}
    fam.attach(1, str(root / "libtorch_cpu.so"))
    fam.attach(2, str(lib))  # another rank, the same file
    assert len(attached) == 1 and list(fam.libs) == [loader.lib_key(str(lib))]
