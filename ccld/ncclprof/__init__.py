"""ccld's NCCL profiler plugin: libnccl-profiler-ccld.so (ccld_profiler.c), its datagram format
(format.py: numpy dtypes and decode()) and its build (build.py). docs/nccl-profiler.md says what it
records and how; tests/unit/test_ncclprof_plugin.py drives it without a GPU.

This package imports nothing of ccld but ccld.errors: the agent (tracer) and its tests read datagrams
through format.decode().
"""

# The plugin's environment (read once, at NCCL's first init of a communicator)
ENV_ENDPOINT = "CCLD_NCCLPROF_ENDPOINT"  # AF_UNIX datagram socket path to send to; unset: the plugin is off
ENV_FLUSH_MS = "CCLD_NCCLPROF_FLUSH_MS"  # send interval, ms (1..60000; default 100)
ENV_MASK = "CCLD_NCCLPROF_MASK"          # narrows the activation mask (NCCL's ncclProfile* bits)
ENV_CHAIN = "CCLD_NCCLPROF_CHAIN"        # another profiler plugin (path or name) that gets every call too
ENV_QUEUE = "CCLD_NCCLPROF_QUEUE"        # records held between flushes (power of 2, 16..2^20; default 16384)
ENV_HANDLES = "CCLD_NCCLPROF_HANDLES"    # coll/p2p/kernel-channel events open at once (16..2^20; default 8192)
ENV_FAULT = "CCLD_NCCLPROF_FAULT"        # tests only: "alloc" or "thread" fails that step
