"""Make bcc find kernel headers on machines whose running kernel has no matching header package.

bcc compiles every program against kernel headers. It looks in /lib/modules/$(uname -r)/build, then
at $BCC_KERNEL_SOURCE. Debian splits its headers into `linux-headers-X-common` and `-X-amd64`; bcc
needs one merged tree, so we build a symlink farm of the two under a cache dir (about 1 s, once) and
point BCC_KERNEL_SOURCE at it. Header version != running kernel is fine for tracepoint and uprobe
programs (their argument layouts come from the running kernel), which is all ccld uses.
"""
from __future__ import annotations

import glob
import os
import platform
import shutil
from typing import Optional

from ccld.errors import EnvironmentProblem

CACHE_DIR = os.environ.get("CCLD_CACHE_DIR") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ccld")

INSTALL_HINT = "install kernel headers: apt-get install linux-headers-amd64 (or linux-headers-$(uname -r))"


def _has_headers(path: str) -> bool:
    return (os.path.isfile(os.path.join(path, "include/linux/kconfig.h"))
            and os.path.isfile(os.path.join(path, "include/generated/autoconf.h")))


def _debian_pair() -> Optional[tuple]:
    """The newest (common, arch) pair of Debian header dirs under /usr/src, if any."""
    for arch_dir in sorted(glob.glob("/usr/src/linux-headers-*"), reverse=True):
        base = os.path.basename(arch_dir)
        if base.endswith("-common") or not os.path.isdir(os.path.join(arch_dir, "include")):
            continue
        stem = base.rsplit("-", 1)[0]
        common = f"/usr/src/{stem}-common"
        if os.path.isdir(common):
            return common, arch_dir
    return None


def _merge(common: str, arch: str, dest: str) -> None:
    """Symlink farm: every file of `common`, then every file of `arch` on top (arch wins)."""
    tmp = dest + f".tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    for src in (common, arch):
        for root, dirs, files in os.walk(src, followlinks=False):
            rel = os.path.relpath(root, src)
            out = os.path.join(tmp, rel)
            os.makedirs(out, exist_ok=True)
            for d in dirs:  # a directory symlink in the package stays a symlink
                p = os.path.join(root, d)
                if os.path.islink(p):
                    link = os.path.join(out, d)
                    if os.path.lexists(link):
                        os.remove(link) if not os.path.isdir(link) or os.path.islink(link) else None
                    if not os.path.exists(link):
                        os.symlink(os.path.realpath(p), link)
            for f in files:
                link = os.path.join(out, f)
                if os.path.lexists(link):
                    os.remove(link)
                os.symlink(os.path.join(root, f), link)
    os.replace(tmp, dest) if not os.path.exists(dest) else shutil.rmtree(tmp, ignore_errors=True)


def ensure_kernel_headers() -> str:
    """Return the header tree bcc will use, setting BCC_KERNEL_SOURCE if we had to build one.

    Raises EnvironmentProblem with an install hint when no headers can be found at all.
    """
    env = os.environ.get("BCC_KERNEL_SOURCE")
    if env and _has_headers(env):
        return env
    build = f"/lib/modules/{platform.release()}/build"
    if _has_headers(build):
        return build
    pair = _debian_pair()
    if pair is None:
        raise EnvironmentProblem("no kernel headers found for bcc (looked in /lib/modules and /usr/src)",
                                 INSTALL_HINT)
    common, arch = pair
    dest = os.path.join(CACHE_DIR, "kheaders-" + os.path.basename(arch))
    if not _has_headers(dest):
        os.makedirs(CACHE_DIR, exist_ok=True)
        _merge(common, arch, dest)
    if not _has_headers(dest):
        raise EnvironmentProblem(f"merged kernel headers at {dest} are incomplete", INSTALL_HINT)
    os.environ["BCC_KERNEL_SOURCE"] = dest
    return dest
