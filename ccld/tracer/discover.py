"""Find the ranks of a training job from /proc, with no help from the job.

A rank is a process whose environment has RANK and WORLD_SIZE (torchrun, SLURM via torchrun, and
most launchers set them). Forked children of a rank (DataLoader workers) inherit that environment;
they are not ranks, so a process whose parent carries the same rank identity is skipped.
Caveat: reading another user's /proc/PID/environ needs root or ptrace rights; such processes are
reported as unreadable, not silently skipped.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Set


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


def read_environ(pid: int) -> Optional[Dict[str, str]]:
    """The environment a process started with, or None if it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    env = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            env[k.decode(errors="replace")] = v.decode(errors="replace")
    return env


def _int(env: Dict[str, str], key: str, default: int = -1) -> int:
    try:
        return int(env.get(key, default))
    except ValueError:
        return default


def ppid_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return int(stat[stat.rindex(")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def identify(pid: int) -> Optional[RankIdentity]:
    """The rank identity of `pid`, or None when it is not a (top-level) rank process."""
    env = read_environ(pid)
    if not env or "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    if rank < 0 or world <= 0:
        return None
    addr, port = env.get("MASTER_ADDR", ""), _int(env, "MASTER_PORT", 0)
    parent = read_environ(ppid_of(pid))
    if parent and all(parent.get(k) == env.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None  # a worker forked by a rank (e.g. a DataLoader worker), not a rank itself
    job = env.get("CCLD_JOB") or (f"{addr}:{port}" if addr else env.get("TORCHELASTIC_RUN_ID", "job"))
    return RankIdentity(pid, rank, world, _int(env, "LOCAL_RANK", rank), addr, port, job, _cmdline(pid))


def all_pids() -> List[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def descendants(root: int, pids: Optional[Iterable[int]] = None) -> Set[int]:
    """Every live process below `root` in the process tree (one pass over /proc)."""
    children: Dict[int, List[int]] = {}
    for pid in (pids if pids is not None else all_pids()):
        children.setdefault(ppid_of(pid), []).append(pid)
    out, todo = set(), [root]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return stat[stat.rindex(")") + 2] not in "ZX"
    except (OSError, ValueError, IndexError):
        return False
