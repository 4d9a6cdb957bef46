"""Find the ranks of a training job from /proc, with no help from the job.

A rank is a process whose environment has RANK and WORLD_SIZE (torchrun, SLURM via torchrun, and
most launchers set them). Forked children of a rank (DataLoader workers) inherit that environment;
they are not ranks, so a process whose parent carries the same rank identity is skipped; except the
command `ccld run` started when ccld itself holds that identity, where a Python program that is not a
known launcher is the rank (runs_training).
Caveat: reading another user's /proc/PID/environ needs root or ptrace rights; such processes are
reported as unreadable, not silently skipped.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Set, Tuple

from ccld.tracer.procstate import read_small, read_stat


@dataclass(frozen=True)
class RankIdentity:
    pid: int
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    job: str
    cmdline: str


# The only environment variables ccld reads from a rank; nothing else (tokens, keys) is kept or shipped.
NEEDED_ENV = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "TORCHELASTIC_RUN_ID", "CCLD_JOB"})
_SECRET_ARG = re.compile(r"(?i)(--?[\w-]*(token|secret|passw|api[_-]?key|auth)[\w-]*)(=|\s+)(\S+)")


def redact(cmdline: str) -> str:
    """A command line with the values of secret-looking options (--token=..., --password x) masked."""
    return _SECRET_ARG.sub(lambda m: f"{m.group(1)}{m.group(3)}***", cmdline)


def read_environ(pid: int) -> Optional[Dict[str, str]]:
    """The ccld-relevant part (NEEDED_ENV) of the environment a process started with, or None if
    it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    env = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            key = k.decode(errors="replace")
            if key in NEEDED_ENV:
                env[key] = v.decode(errors="replace")
    return env


_DECIMAL = re.compile(r"-?[0-9]{1,9}")  # int() would also take "1_0", " 7", "٣" and 10**30 (unencodable)


def _int(env: Dict[str, str], key: str, default: int = -1) -> int:
    """An environment variable as a plain decimal int below 10**9, else `default`."""
    v = env.get(key)
    return int(v) if v is not None and _DECIMAL.fullmatch(v) else default


def ppid_of(pid: int) -> int:
    st = read_stat(pid)  # parsed as bytes: a comm with ')' or invalid UTF-8 must not hide a process
    return -1 if st is None else st.ppid


def _raw_cmdline(pid: int) -> bytes:
    """/proc/PID/cmdline as read (arguments ending in NUL), b"" when the process is gone or unreadable."""
    try:
        return read_small(f"/proc/{pid}/cmdline")  # every scan, for each non-rank below the launcher
    except OSError:
        return b""


def _cmdline_text(raw: bytes) -> str:
    return redact(raw.replace(b"\0", b" ").decode(errors="replace").strip())


def _cmdline(pid: int) -> str:
    return _cmdline_text(_raw_cmdline(pid))


def identify(pid: int) -> Optional[RankIdentity]:
    """The rank identity of `pid`, or None when it is not a (top-level) rank process."""
    env = read_environ(pid)
    if not env or "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    if rank < 0 or world <= 0:
        return None
    addr, port = env.get("MASTER_ADDR", ""), _int(env, "MASTER_PORT", 0)
    ppid = ppid_of(pid)
    parent = read_environ(ppid)
    raw = None
    if parent and all(parent.get(k) == env.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        if ppid != os.getpid():
            return None  # a worker forked by a rank (e.g. a DataLoader worker), not a rank itself
        raw = _raw_cmdline(pid)
        if not runs_training(_argv(raw)):
            return None  # as above, or a launcher (torchrun) `ccld run` started with the node's RANK
        # else: the command `ccld run` (this process) started, holding our own RANK (a pod's one process)
    job = env.get("CCLD_JOB") or (f"{addr}:{port}" if addr else env.get("TORCHELASTIC_RUN_ID", "job"))
    text = _cmdline_text(_raw_cmdline(pid) if raw is None else raw)
    return RankIdentity(pid, rank, world, _int(env, "LOCAL_RANK", rank), addr, port, job, text)


# Launchers whose process carries its environment's RANK but is not a rank (its workers are): by
# script name (torchrun's console script, ...) or by the module given to `python -m`.
LAUNCHER_SCRIPTS = frozenset({"torchrun", "deepspeed", "accelerate", "colossalai", "horovodrun", "lightning"})
LAUNCHER_MODULES = frozenset({"torch.distributed.run", "torch.distributed.launch", "deepspeed.launcher.runner",
                              "deepspeed.launcher.launch", "accelerate.commands.launch",
                              "accelerate.commands.accelerate_cli", "horovod.runner.launch"})
_PYTHON = re.compile(r"python[0-9.]*")
_OPT_WITH_ARG = frozenset({"-W", "-X", "-Q"})  # interpreter options whose value is the next argument


def _argv(raw: bytes) -> List[str]:
    """A process's arguments from its /proc/PID/cmdline (_raw_cmdline)."""
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def runs_training(argv: List[str]) -> bool:
    """Whether a command line is a Python interpreter running a program that is not a known launcher
    (LAUNCHER_SCRIPTS, LAUNCHER_MODULES): `python train.py`, `python -m mypkg.train`, `python -c ...`.
    This decides the one case the environment cannot: `ccld run -- CMD` where ccld's own environment
    holds RANK and WORLD_SIZE too (a Kubernetes PyTorchJob sets them for a pod's process), so CMD is
    either that rank (`python train.py`) or a launcher given the node's rank (`torchrun ...`). A shell
    or another wrapper is neither: the Python it starts then looks like a worker of it and is not
    traced (README, Limits, says how to run such a pod)."""
    if not argv or not _PYTHON.fullmatch(os.path.basename(argv[0])):
        return False
    i = 1
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "-":
        if argv[i] == "-m":
            return i + 1 < len(argv) and argv[i + 1] not in LAUNCHER_MODULES
        if argv[i].startswith("-c"):
            return True
        i += 2 if argv[i] in _OPT_WITH_ARG else 1
    return i < len(argv) and os.path.basename(argv[i]) not in LAUNCHER_SCRIPTS


def is_rank(pid: int, rank: int) -> bool:
    """True when `pid` is (still) a training process of global rank `rank`, from its environment:
    a pid reused by another process since the agent reported it must not be paused by py-spy (the live
    collector gives it to diagnose/stack.py's StackTaker, which asks before each dump)."""
    ident = identify(pid)
    return ident is not None and ident.rank == rank


def all_pids() -> List[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def descendants(root: int, pids: Optional[Iterable[int]] = None) -> Set[int]:
    """Every live process below `root` in the process tree (one pass over /proc)."""
    children: Dict[int, List[int]] = {}
    for pid in (pids if pids is not None else all_pids()):
        children.setdefault(ppid_of(pid), []).append(pid)
    return _below(children, [root])


def _below(children: Dict[int, List[int]], roots: Iterable[int]) -> Set[int]:
    """Every process under `roots` (roots themselves excluded) in a parent -> children map."""
    out: Set[int] = set()
    todo = list(roots)
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def list_pids(proc: str = "/proc") -> Dict[int, int]:
    """pid -> inode number of PROC/PID, for every process now: one directory read, no stat call (the
    kernel gives each /proc/PID inode a fresh number, so a pid taken by a new process shows a new one)."""
    with os.scandir(proc) as it:
        return {int(d.name): d.inode() for d in it if d.name.isdigit()}


def last_pid(proc: str = "/proc") -> int:
    """The pid the kernel gave out last in this pid namespace (PROC/loadavg's last field; -1 when it
    cannot be read): unchanged between two reads, no process or thread was created in between, here
    or in any pid namespace below this one (a process there has a pid here too)."""
    try:
        with open(os.path.join(proc, "loadavg"), "rb") as f:
            return int(f.read().split()[-1])
    except (OSError, ValueError, IndexError):
        return -1


class ProcTree:
    """descendants() for an agent that asks every scan: each process's parent and start time are read
    from PROC/PID/stat once, when its pid first shows up, not on every scan (a full read of every
    /proc/PID/stat of a busy node was a quarter of the agent's CPU). Pids gone from /proc are forgotten
    at the next scan.
    Pid reuse: a pid whose /proc inode number changed (list_pids) is read again, so a new process that
    took a dead one's pid between two scans gets its own parent, not the dead one's; if the start time
    read is the old one, it is the same process (procfs made a new inode) and keeps its first parent.
    And a process is a child of the process now holding its (first) parent's pid only if that one
    started no later: a child never predates its parent, so an orphan whose dead parent's pid went to
    a new process is not that new process's child.
    Caveat: a process reparented after its parent died keeps counting as that parent's descendant
    while that parent is a root (for a job's ranks, what one wants). Roots are pids: a dead root's pid
    taken by a new process makes that process's children descendants (the caller names roots)."""

    def __init__(self, proc: str = "/proc") -> None:
        self.proc = proc
        self._known: Dict[int, Tuple[int, int, int]] = {}  # pid -> (inode, start ticks, first parent)

    def descendants(self, roots: Iterable[int], pids: Mapping[int, int]) -> Set[int]:
        """Every live process below any of `roots` (roots themselves excluded), `pids` being
        list_pids(self.proc) now."""
        known = self._known
        for gone in known.keys() - pids.keys():
            del known[gone]
        for pid, ino in pids.items():
            k = known.get(pid)
            if k is None or k[0] != ino:
                st = read_stat(pid, self.proc)
                if st is None:
                    known.pop(pid, None)  # gone while we looked: try again next scan
                elif k is not None and k[1] == st.starttime:
                    known[pid] = (ino, k[1], k[2])  # the same process under a new inode
                else:
                    known[pid] = (ino, st.starttime, st.ppid)
        children: Dict[int, List[int]] = {}
        for pid, (_, start, ppid) in known.items():
            parent = known.get(ppid)
            if parent is None or parent[1] <= start:
                children.setdefault(ppid, []).append(pid)
        return _below(children, roots)


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    st = read_stat(pid)
    return st is not None and st.state not in "ZX"
