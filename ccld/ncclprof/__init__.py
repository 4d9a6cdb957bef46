"""ccld's NCCL profiler plugin: libnccl-profiler-ccld.so (ccld_profiler.c), its datagram format
(format.py: numpy dtypes and decode()) and its build (build.py). docs/nccl-profiler.md says what it
records and how; tests/unit/test_ncclprof_plugin.py drives it without a GPU.

This package imports nothing of ccld but ccld.errors: the agent (tracer) and its tests read datagrams
through format.decode().
"""

import os

# The plugin's environment (read once, at NCCL's first init of a communicator)
ENV_ENDPOINT = "CCLD_NCCLPROF_ENDPOINT"  # AF_UNIX datagram socket path to send to; unset: the plugin is off
ENV_FLUSH_MS = "CCLD_NCCLPROF_FLUSH_MS"  # send interval, ms (1..60000; default 100)
ENV_MASK = "CCLD_NCCLPROF_MASK"          # narrows the activation mask (NCCL's ncclProfile* bits)
ENV_CHAIN = "CCLD_NCCLPROF_CHAIN"        # another profiler plugin (path or name) that gets every call too
ENV_QUEUE = "CCLD_NCCLPROF_QUEUE"        # records held between flushes (power of 2, 16..2^20; default 16384)
ENV_HANDLES = "CCLD_NCCLPROF_HANDLES"    # coll/p2p/kernel-channel events open at once (16..2^20; default 8192)
ENV_FAULT = "CCLD_NCCLPROF_FAULT"        # tests only: "alloc" or "thread" fails that step


def loaded_nccl():
    """The NCCL this process has mapped: (path of libnccl, (major, minor, patch) from its
    ncclGetVersion()), or ("", None) when none is mapped (not loaded yet, or linked in statically:
    then torch.cuda.nccl.version() tells the version torch was built with). Which ncclProfiler_vN NCCL
    asks a plugin for follows from it: 2.23 v1, 2.24 v2, 2.25-2.26 v3, 2.27 v4, 2.28+ v5 and up."""
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            paths = {line.split(None, 5)[-1].strip() for line in f if "libnccl.so" in line}
    except OSError:
        return "", None
    for path in sorted(p for p in paths if p.startswith("/") and "libnccl.so" in os.path.basename(p)):
        try:
            code = ctypes.c_int()
            if ctypes.CDLL(path).ncclGetVersion(ctypes.byref(code)) != 0:
                continue
        except (OSError, AttributeError):
            continue
        v = code.value  # 2.9 and later: major*10000 + minor*100 + patch; before: major*1000 + ...
        return path, ((v // 10000, v // 100 % 100, v % 100) if v >= 20900 else (v // 1000, v // 100 % 10, v % 100))
    return "", None
