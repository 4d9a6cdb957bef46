"""The live collector process: ZeroMQ ingest and detection ticks (server), resent frames and their
acknowledgements (acks), the agents' time service (timesvc), /metrics and /snapshot (metrics, snapshot).

What it builds and runs is below it: the timeline (ccld.timeline), the detectors (ccld.diagnose), the
store (ccld.store). Submodules are imported where used; importing this package loads nothing heavy (no zmq).
"""
