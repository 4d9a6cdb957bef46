"""The append-only store: every good frame the collector received, raw, in the order received.

layout.py   the files of a store directory and the record format (version 2, and version 1, still
            read); store.json and stats.json read and checked
writer.py   StoreWriter: appends records, flushes and fsyncs them on a clock, one writer per store
reader.py   read_store: every good record back, in order; damage and unclean ends reported, not fatal

Times: `recv` is the collector's wall clock; event times inside frames stay in their nodes' clocks.
What the rest of ccld uses is importable from here (`from ccld.store import StoreWriter, read_store`).
"""
from ccld.store.layout import StoreError, list_segments, read_meta, read_stats
from ccld.store.reader import StoreProblem, read_store
from ccld.store.writer import StoreWriter

__all__ = ["StoreError", "StoreProblem", "StoreWriter", "list_segments", "read_meta", "read_stats", "read_store"]
