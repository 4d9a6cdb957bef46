"""The collector: ZeroMQ ingest (server), the append-only store (store), clock conversion (clock),
frame decoding and counting (ingest) and the cross-rank timeline (timeline).

Submodules are imported where used; importing this package loads nothing heavy (no zmq).
"""
