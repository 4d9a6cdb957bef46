"""The spool's directory: taking it (owner-only, one agent at a time), its metadata, its segment files.

Layout of a spool directory:
    spool.lock              flock()ed by the agent using it (its pid inside); the kernel frees it
    spool.json              {"format": "ccld-spool", "version": 1, "collector": ENDPOINT, "acked": {...}}
    frames-00000001.spool   records back to back (spool_records.py); a new file every segment_bytes
                            and at every start
Caveat: every failure is an OSError with a sentence in strerror; the caller decides (spool.py falls
back to memory).
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import stat
import tempfile
from typing import Dict, List, Optional, Tuple

LOCK_FILE, META_FILE = "spool.lock", "spool.json"
_SEGMENT_RE = re.compile(r"^frames-(\d{8,})\.spool$")


def default_dir(node: str) -> str:
    """Where `ccld agent` spools by default: /var/lib/ccld/spool/NODE as root, else under the temp dir."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", node) or "node"
    if os.geteuid() == 0:
        return os.path.join("/var/lib/ccld/spool", safe)
    return os.path.join(tempfile.gettempdir(), f"ccld-spool-{os.geteuid()}", safe)


def segment_name(no: int) -> str:
    return f"frames-{no:08d}.spool"


class SpoolDir:
    """One spool directory, taken (locked) by this agent between take() and release()."""

    def __init__(self, path: str):
        self.path = path
        self.lock_fd: Optional[int] = None

    def take(self) -> None:
        """Create or check the directory (a real directory, ours, owner-only) and lock it."""
        d = self.path
        os.makedirs(os.path.dirname(d), mode=0o700, exist_ok=True)
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode):
            raise OSError(errno.ENOTDIR, "not a directory (a symlink is not accepted)")
        if st.st_uid != os.geteuid():
            raise OSError(errno.EPERM, f"owned by uid {st.st_uid}, not this user ({os.geteuid()})")
        if st.st_mode & 0o077:
            os.chmod(d, 0o700)  # frames hold command lines and host names: owner-only
        fd = os.open(os.path.join(d, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise OSError(errno.EBUSY, f"in use by another agent (pid {holder}); give each agent its "
                                       "own --spool") from None
        self.lock_fd = fd
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None

    def read_meta(self) -> dict:
        """spool.json as written by write_meta, or {} when missing or unreadable."""
        try:
            with open(os.path.join(self.path, META_FILE)) as f:
                meta = json.load(f)
        except (OSError, ValueError):
            return {}
        return meta if isinstance(meta, dict) else {}

    def write_meta(self, collector: str, acked: Dict[str, int]) -> None:
        """Whose frames these are, and (at a clean stop) what the collector acknowledged; replaced whole."""
        tmp = os.path.join(self.path, META_FILE + ".tmp")
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            json.dump({"format": "ccld-spool", "version": 1, "collector": collector, "acked": acked}, f)
        os.replace(tmp, os.path.join(self.path, META_FILE))

    def segments(self) -> List[Tuple[int, str]]:
        """(number, path) of each segment file there, oldest first."""
        return sorted((int(m.group(1)), os.path.join(self.path, n)) for n in os.listdir(self.path)
                      for m in [_SEGMENT_RE.match(n)] if m)

    def create_segment(self, no: int) -> Tuple[str, int]:
        """A new, empty segment file: its path and an fd open for appending (and reading) to it."""
        path = os.path.join(self.path, segment_name(no))
        return path, os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
