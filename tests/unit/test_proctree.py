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
        real = discover.read_stat
        monkeypatch.setattr(discover, "read_stat", lambda pid, proc: reads.append(pid) or real(pid, proc))
        tree = discover.ProcTree()
        pids = discover.list_pids()
        assert tree.descendants([top.pid], pids) == want
        first = len(reads)
        assert first >= len(pids) - 5  # every process once (a few may have gone meanwhile)
        assert tree.descendants([top.pid], discover.list_pids()) == want
        assert len(reads) - first < 20, "known processes were read again"

        victim = min(want)
        os.kill(victim, 9)
        deadline = time.monotonic() + 10
        while victim in discover.all_pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        got = tree.descendants([top.pid], discover.list_pids())
        assert victim not in got and got == want - {victim}
        assert victim not in tree._known
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
        assert tree.descendants([a.pid], discover.list_pids()) == ka
        assert tree.descendants([a.pid, b.pid], discover.list_pids()) == ka | kb
    finally:
        for p in (a, b):
            subprocess.run(["pkill", "-9", "-P", str(p.pid)])
            p.kill()
            p.wait()


class FakeProc:
    """A /proc of stat files only. A process that starts gets a new directory, made before the old
    holder of its pid is removed, so its inode number differs, as in procfs."""

    def __init__(self, root):
        self.root = root
        root.mkdir()
        self.tree = discover.ProcTree(str(root))

    def start(self, pid, ppid, start):
        new = self.root / f"new-{pid}"  # not a pid name: list_pids skips it
        new.mkdir()
        self._stat(new, pid, ppid, start)
        self.exit(pid)
        new.rename(self.root / str(pid))

    def reparent(self, pid, ppid):
        """Its parent died: the kernel gives it a new one, in the same /proc directory."""
        d = self.root / str(pid)
        start = int((d / "stat").read_bytes().split()[21])
        self._stat(d, pid, ppid, start)

    def exit(self, pid):
        d = self.root / str(pid)
        if d.exists():
            (d / "stat").unlink()
            d.rmdir()

    @staticmethod
    def _stat(d, pid, ppid, start):
        # fields 1-4, 5-21, 22 (starttime), 23-52, as proc(5) numbers them
        (d / "stat").write_bytes(b"%d (x) S %d " % (pid, ppid) + b"0 " * 17 + b"%d" % start + b" 0" * 30)

    def below(self, *roots):
        return self.tree.descendants(roots, discover.list_pids(str(self.root)))


@pytest.fixture
def fake(tmp_path):
    f = FakeProc(tmp_path / "proc")
    f.start(1, 0, 0)
    f.start(100, 1, 5)     # the root
    f.start(300, 1, 7)     # unrelated
    return f


def test_a_pid_taken_by_a_new_process_between_scans_is_read_again(fake):
    """Before the fix the tree kept a pid's first parent until it saw the pid gone from /proc: a rank's
    child that exited and whose pid an unrelated process took before the next scan made that process
    (and its children) descendants of the job."""
    fake.start(200, 100, 10)
    assert fake.below(100) == {200}
    fake.start(200, 300, 50)  # 200 exited; its pid went to a child of 300
    fake.start(201, 200, 51)  # which has a child of its own
    assert fake.below(100) == set()
    assert fake.below(300) == {200, 201}


def test_an_orphan_does_not_join_the_new_process_holding_its_dead_parents_pid(fake):
    """Before the fix an orphan's cached parent outlived that parent: once a rank's new child took the
    dead parent's pid, the orphan (an unrelated process) counted as the rank's grandchild."""
    fake.start(500, 300, 15)
    fake.start(400, 500, 20)
    assert fake.below(100) == set()
    fake.exit(500)
    fake.reparent(400, 1)     # 400 keeps 500 as its parent in the tree
    assert fake.below(100) == set()
    fake.start(500, 100, 60)  # a new child of the root takes pid 500
    assert fake.below(100) == {500}


def test_a_process_keeps_its_first_parent_under_a_new_inode_until_its_pid_is_reused(fake):
    fake.start(600, 100, 30)
    assert fake.below(100) == {600}
    fake.exit(100)
    fake.start(600, 1, 30)    # reparented, and procfs made a new inode for it: same start, same process
    assert fake.below(100) == {600}
    fake.start(600, 1, 90)    # a new process
    assert fake.below(100) == set()


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
