"""A D-state injector: a tiny FUSE filesystem whose one file never answers a read.

`StuckFuse(mountpoint)` mounts a filesystem by speaking the kernel's FUSE protocol over /dev/fuse
directly (no libfuse): a root directory with one regular file, `stuck` (1 MiB, read-only). Every
READ of it is left unanswered, so a process that reads it waits in the page cache for a page that
never arrives: state D in /proc/PID/stat (TASK_KILLABLE, in folio_wait_bit_common), as a rank on a
hung NFS or Lustre mount does. close() (or leaving the `with` block, or interpreter exit) answers
the waiting reads with EIO, aborts the connection and detaches the mount (umount2 MNT_FORCE |
MNT_DETACH; the force is FUSE's abort), so the reader's read fails with an OSError and it goes on;
nothing is left mounted and no reader is left blocked.

Needs root (mount(2)) and /dev/fuse. Protocol: include/uapi/linux/fuse.h, answered as version 7.31
with FUSE_ASYNC_READ, which is what sends reads through readahead and makes the reader wait on the
page lock (D) rather than in the request itself (an interruptible S). Requests are served by one
daemon thread of this process; the /dev/fuse fd is close-on-exec, so no child holds the connection.
"""
import atexit
import ctypes
import errno
import os
import select
import stat
import struct
import threading

FUSE_KERNEL_VERSION = 7
FUSE_KERNEL_MINOR = 31          # what we answer INIT with: every struct below has its 7.31 size
FUSE_ASYNC_READ = 1 << 0        # INIT flag: reads go through readahead, the reader waits on the page (D)
ROOT_ID = 1                     # FUSE's root node id
FILE_ID = 2
FILE_NAME = b"stuck"
FILE_SIZE = 1 << 20             # non-empty: a read past EOF would be answered by the kernel itself
MAX_WRITE = 1 << 16             # nobody writes here; the kernel's floor is 4096
READ_BUF = (1 << 20) + (1 << 12)  # > max_write + headers, and >= FUSE_MIN_READ_BUFFER (8 KiB)
POLL_MS = 100                   # the daemon thread looks at its stop flag this often
JOIN_S = 5.0                    # close(): the daemon thread has this long to see the abort
MS_NOSUID, MS_NODEV = 2, 4
MNT_FORCE, MNT_DETACH = 1, 2

OP_LOOKUP, OP_FORGET, OP_GETATTR, OP_OPEN, OP_READ = 1, 2, 3, 14, 15
OP_STATFS, OP_RELEASE, OP_FLUSH, OP_INIT, OP_OPENDIR, OP_READDIR, OP_RELEASEDIR = 17, 18, 25, 26, 27, 28, 29
OP_ACCESS, OP_INTERRUPT, OP_DESTROY, OP_BATCH_FORGET = 34, 36, 38, 42
NO_REPLY = (OP_FORGET, OP_BATCH_FORGET, OP_INTERRUPT)  # the kernel expects no answer to these
OK_EMPTY = (OP_RELEASE, OP_FLUSH, OP_RELEASEDIR, OP_ACCESS, OP_DESTROY)

IN_HEADER = struct.Struct("<IIQQIIIHH")      # len opcode unique nodeid uid gid pid total_extlen padding
OUT_HEADER = struct.Struct("<IiQ")           # len error unique
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")    # fuse_attr (88 bytes)
INIT_IN = struct.Struct("<IIII")             # major minor max_readahead flags (the rest unused here)
INIT_OUT = struct.Struct("<IIIIHHIIHHI28x")  # fuse_init_out (64 bytes)
ENTRY_OUT = struct.Struct("<QQQQII")         # nodeid generation entry_valid attr_valid nsecs; + attr
ATTR_OUT = struct.Struct("<QII")             # attr_valid attr_valid_nsec dummy; + attr
OPEN_OUT = struct.Struct("<QII")             # fh open_flags padding
STATFS_OUT_SIZE = 80                         # fuse_kstatfs
ATTR_VALID_S = 3600                          # nothing here changes: let the kernel cache names and attrs


class FuseError(OSError):
    """The filesystem could not be mounted (no /dev/fuse, no privilege, a bad mountpoint)."""


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    return libc


def _attr(node: int) -> bytes:
    if node == ROOT_ID:
        mode, size, nlink = stat.S_IFDIR | 0o755, 0, 2
    else:
        mode, size, nlink = stat.S_IFREG | 0o444, FILE_SIZE, 1
    blocks = (size + 511) // 512
    return ATTR.pack(node, size, blocks, 0, 0, 0, 0, 0, 0, mode, nlink, 0, 0, 0, 4096, 0)


def proc_state(pid: int) -> str:
    """The one-letter state of a process (R, S, D, T, Z, ...) from /proc/PID/stat; '' if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return ""
    return data[data.rindex(b")") + 2:][:1].decode()


class StuckFuse:
    """A mounted filesystem whose file `path` blocks every reader in D until close()."""

    def __init__(self, mountpoint: str):
        self.mountpoint = os.path.abspath(mountpoint)
        self.path = os.path.join(self.mountpoint, FILE_NAME.decode())
        self._fd = -1
        self._mounted = False
        self._made_dir = False
        self._closing = threading.Event()   # READs from now on are answered with EIO
        self._stop = threading.Event()      # the daemon thread ends (before the fd is closed)
        self._lock = threading.Lock()
        self._pending = []      # unique ids of READs left unanswered
        self._thread = None
        self._libc = _libc()
        self._open()

    # -- public --

    def pending_reads(self) -> int:
        """How many READ requests are waiting (the kernel may split one read(2) into a few)."""
        with self._lock:
            return len(self._pending)

    def close(self) -> None:
        """Answer the waiting reads with EIO, abort the connection, unmount; safe to call twice."""
        if self._fd < 0:
            return
        self._closing.set()
        with self._lock:
            pending, self._pending = self._pending, []
        for unique in pending:
            self._reply(unique, -errno.EIO)
        if self._mounted:
            # MNT_FORCE: FUSE aborts the connection (every request still in flight fails);
            # MNT_DETACH: the mount goes even while a reader still holds the file open.
            if self._libc.umount2(self.mountpoint.encode(), MNT_FORCE | MNT_DETACH) == 0:
                self._mounted = False
            else:
                err = ctypes.get_errno()
                os.write(2, f"fusebed: umount {self.mountpoint}: {os.strerror(err)}\n".encode())
        self._stop.set()
        if self._thread is not None:
            self._thread.join(JOIN_S)
        os.close(self._fd)  # the last fd of the connection: the kernel aborts whatever is left
        self._fd = -1
        if self._made_dir:
            try:
                os.rmdir(self.mountpoint)
            except OSError:
                pass
        atexit.unregister(self.close)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- mount and serve --

    def _open(self) -> None:
        if not os.path.exists("/dev/fuse"):
            raise FuseError(errno.ENOENT, "no /dev/fuse (FUSE is not in this kernel, or not in this container)")
        if not os.path.isdir(self.mountpoint):
            os.makedirs(self.mountpoint)
            self._made_dir = True
        try:
            self._fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise FuseError(e.errno, f"/dev/fuse: {e.strerror}") from None
        atexit.register(self.close)
        opts = f"fd={self._fd},rootmode={stat.S_IFDIR:o},user_id={os.getuid()},group_id={os.getgid()},allow_other"
        if self._libc.mount(b"stuckfuse", self.mountpoint.encode(), b"fuse.stuckfuse", MS_NOSUID | MS_NODEV,
                            opts.encode()) != 0:
            err = ctypes.get_errno()
            self.close()
            raise FuseError(err, f"mount fuse on {self.mountpoint}: {os.strerror(err)} (needs root)")
        self._mounted = True
        self._thread = threading.Thread(target=self._serve, name="stuckfuse", daemon=True)
        self._thread.start()

    def _reply(self, unique: int, error: int = 0, data: bytes = b"") -> None:
        try:
            os.write(self._fd, OUT_HEADER.pack(OUT_HEADER.size + len(data), error, unique) + data)
        except OSError:
            pass  # ENOENT: the request was interrupted or aborted meanwhile; ENODEV: connection gone

    def _serve(self) -> None:
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(POLL_MS):
                    continue
                msg = os.read(self._fd, READ_BUF)
            except InterruptedError:
                continue
            except OSError:
                return  # ENODEV: unmounted or aborted
            if len(msg) >= IN_HEADER.size:
                self._handle(msg)

    def _handle(self, msg: bytes) -> None:
        _, op, unique, node, *_ = IN_HEADER.unpack_from(msg)
        body = msg[IN_HEADER.size:]
        if op in NO_REPLY:
            return
        if op == OP_INIT:
            _, _, readahead, _ = INIT_IN.unpack_from(body)
            self._reply(unique, 0, INIT_OUT.pack(FUSE_KERNEL_VERSION, FUSE_KERNEL_MINOR, readahead, FUSE_ASYNC_READ,
                                                 16, 12, MAX_WRITE, 1, 0, 0, 0))
        elif op == OP_LOOKUP:
            if node == ROOT_ID and body.rstrip(b"\0") == FILE_NAME:
                self._reply(unique, 0, ENTRY_OUT.pack(FILE_ID, 0, ATTR_VALID_S, ATTR_VALID_S, 0, 0) + _attr(FILE_ID))
            else:
                self._reply(unique, -errno.ENOENT)
        elif op == OP_GETATTR:
            self._reply(unique, 0, ATTR_OUT.pack(ATTR_VALID_S, 0, 0) + _attr(node))
        elif op in (OP_OPEN, OP_OPENDIR):
            self._reply(unique, 0, OPEN_OUT.pack(0, 0, 0))
        elif op == OP_READ:
            with self._lock:
                if not self._closing.is_set():
                    self._pending.append(unique)  # never answered: the reader waits in D
                    return
            self._reply(unique, -errno.EIO)
        elif op == OP_READDIR:
            self._reply(unique, 0)  # an empty listing (the file is found by name)
        elif op == OP_STATFS:
            self._reply(unique, 0, bytes(STATFS_OUT_SIZE))
        elif op in OK_EMPTY:
            self._reply(unique, 0)
        else:
            self._reply(unique, -errno.ENOSYS)
