"""`ccld run -- CMD` where ccld's own environment holds RANK and WORLD_SIZE (a Kubernetes PyTorchJob
sets them for a pod's one process): CMD inherits them unchanged, so the environment cannot say whether
CMD is that rank (`python train.py`) or a launcher given the node's rank (`torchrun ...`). The command
line decides (discover.runs_training); real processes, identified from /proc by their parent."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from ccld.tracer import discover

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("argv, rank", [
    (["python", "train.py", "--lr", "0.1"], True),
    (["/usr/bin/python3.11", "-u", "-X", "dev", "/opt/job/train.py"], True),
    (["python3", "-m", "mypkg.train"], True),
    (["python", "-c", "import train"], True),
    (["python", "-W", "ignore", "-m", "torch.distributed.run", "--nproc-per-node", "8", "train.py"], False),
    (["/usr/bin/python3", "/usr/local/bin/torchrun", "--nproc-per-node", "8", "train.py"], False),
    (["python", "-m", "torch.distributed.launch", "train.py"], False),
    (["/usr/bin/python3", "/usr/local/bin/deepspeed", "train.py"], False),
    (["python", "/usr/local/bin/accelerate", "launch", "train.py"], False),
    (["torchrun", "train.py"], False),               # not a Python interpreter's command line
    (["bash", "-c", "python train.py"], False),       # a wrapper: neither
    (["python", "-m"], False),                       # nothing to run
    (["python"], False),
    ([], False),
])
def test_runs_training_tells_a_program_from_a_launcher(argv, rank):
    assert discover.runs_training(argv) is rank


# Run in a process whose environment holds a rank identity, as `ccld run` in a pod: it starts
# commands that inherit it unchanged and asks identify() about each (and about a grandchild).
PARENT = textwrap.dedent("""
    import json, os, subprocess, sys, tempfile, time
    sys.path.insert(0, sys.argv[1])
    from ccld.tracer import discover
    d = tempfile.mkdtemp()
    launcher = os.path.join(d, "torchrun")
    with open(launcher, "w") as f:
        f.write("import time; time.sleep(30)\\n")
    nap = "import time; time.sleep(30)"
    fork = "import os, time\\nif os.fork() == 0:\\n    time.sleep(30)\\ntime.sleep(30)"
    cmds = {"python": [sys.executable, "-c", nap], "torchrun": [sys.executable, launcher],
            "sleep": ["sleep", "30"], "rank_that_forks": [sys.executable, "-c", fork]}
    procs = {k: subprocess.Popen(v, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for k, v in cmds.items()}
    time.sleep(1.0)  # every child has exec'd (and the forking one forked)
    out = {k: discover.identify(p.pid) for k, p in procs.items()}
    kids = discover.descendants(procs["rank_that_forks"].pid)
    out["its_forked_worker"] = [discover.identify(k) for k in kids]
    reads, real = [], discover.read_small
    discover.read_small = lambda path, *a: (reads.append(path), real(path, *a))[1]
    me = discover.identify(procs["python"].pid)
    discover.read_small = real
    cmdline_reads = sum(path.endswith("/cmdline") for path in reads)
    out = {k: (v.rank if v is not None else None) if not isinstance(v, list) else
           [w.rank if w is not None else None for w in v] for k, v in out.items()}
    print(json.dumps(dict(out, cmdline=me.cmdline, cmdline_reads=cmdline_reads)))
    for pid in list(kids) + [p.pid for p in procs.values()]:
        os.kill(pid, 9)
""")


def test_the_command_of_a_process_holding_the_rank_identity_is_the_rank_unless_a_launcher():
    env = dict(os.environ, RANK="3", WORLD_SIZE="4", MASTER_ADDR="10.0.0.1", MASTER_PORT="29500")
    r = subprocess.run([sys.executable, "-c", PARENT, ROOT], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["python"] == 3            # `python train.py` in the pod: the rank, with the pod's RANK
    assert got["torchrun"] is None       # a launcher given the node's rank: its workers are the ranks
    assert got["sleep"] is None          # not a Python program
    assert got["rank_that_forks"] == 3
    assert got["its_forked_worker"] == [None]  # a DataLoader-like child of the rank: still not a rank
    assert got["cmdline"].endswith("-c import time; time.sleep(30)")
    assert got["cmdline_reads"] == 1     # read once for the launcher test and the identity's command line


def test_a_process_that_did_not_start_the_command_still_takes_it_for_a_forked_worker():
    """`ccld agent` (not the parent) keeps the old rule: a child with its parent's identity is a worker."""
    env = dict(os.environ, RANK="3", WORLD_SIZE="4", MASTER_ADDR="10.0.0.1", MASTER_PORT="29500")
    p = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                          "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); "
                          "print(c.pid, flush=True); time.sleep(30)"], env=env, stdout=subprocess.PIPE, text=True)
    try:
        child = int(p.stdout.readline())
        assert discover.identify(p.pid).rank == 3   # its parent (this test) holds no rank identity
        assert discover.identify(child) is None      # same identity as its parent, which is not us
    finally:
        p.kill()
        p.wait()
