"""ccld.timeline: the in-memory model every analysis reads, built from decoded frames.

    timeline.py     ranks, communicators and collectives joined across agents (Timeline): ingest of
                    one or several frames, the questions; its records in records.py (RankRecord, Comm,
                    CollView); CommInit, p2p and rank events applied by comms.py one at a time
    colltable.py    every communicator's collectives as arrays (CollStore: cells, slots, entries),
                    shown to the analyses one collective at a time by collview.py (CollView); each
                    communicator's completions also as arrays (donelog.py), read by the slowdown tests
    collrows.py     every enter, start and end (column block rows or single events) gathered as rows,
                    applied with array operations by collapply.py: one ingest path
    ingest.py       one frame: decode (counted by reason), then into a Timeline; a store into a fresh one
    clock.py        the one conversion of a node's clock to the collector's timebase (clockrefine.py:
                    corrected with the job's own collectives)
    links.py        TCP connections joined into rank pairs, with per-pair baselines
    p2p.py          point-to-point ops matched pairwise; rdma.py: queue pairs and NIC counters
    gpu.py          CUPTI kernels joined to the collectives they ran (its rule: gpujoin.py, shared with
                    the export)
    members.py      which ranks a communicator expects in its collectives: the rule, shared with the
                    export (Timeline.expected_members answers it for the analyses)
    blocked.py      each rank's time spent waiting in communication
    align.py        NCCL communicators seen only after the attach (named per process) joined across
                    ranks by their op streams and enter times; their events rewritten at ingest

Used by the live collector (ccld.collector), `diagnose` (ccld.diagnose), the outputs (ccld.export,
`ccld links`) and the metrics. Layering: it imports ccld.wire, ccld.store (reading a store) and
ccld.errors, never the detectors or anything above them (import contracts in pyproject.toml).
Submodules are imported where used.
"""
