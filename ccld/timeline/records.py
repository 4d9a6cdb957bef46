"""The timeline's records: a training process (RankRecord), a communicator (Comm) and one collective as
every rank reported it (CollView, a view of the timeline's arrays: colltable.py). Written by the
Timeline (timeline.py; comms.py and collrows.py apply the communicator events) and read by every
analysis.

Times: Unix seconds (float), as everywhere in the timeline. Ranks are global ranks unless named group
ranks. Bounds: a RankRecord keeps its last RUNQ_HISTORY scheduler reports; how many collectives a Comm
keeps is comms.py's (MAX_COLLS_PER_COMM).
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, FrozenSet, List, Optional, Set, Tuple

from ccld.timeline.colltable import CollStore, CommCols
from ccld.timeline.collview import CollView
from ccld.timeline.donelog import DoneLog
from ccld.timeline.p2p import CommP2P

__all__ = ["RankRecord", "Comm", "CollView"]

RUNQ_HISTORY = 128            # scheduler reports kept per rank (every 0.5 s: a minute)
RUNQ_MIN_SPAN_S = 2.0         # a runqueue share over a span needs at least this much of it


@dataclass
class RankRecord:
    """One training process, keyed by (node, pid)."""
    node: str
    pid: int
    agent: str
    rank: int = -1
    world_size: int = -1
    local_rank: int = -1
    job: str = ""
    state: str = ""           # /proc state letter of the latest RankState
    wchan: str = ""
    cpu_ns: int = -1
    state_at: Optional[float] = None
    cpu_busy: Optional[float] = None  # CPU seconds per second between the last two RankStates
    exited_at: Optional[float] = None
    exit_reason: str = ""
    exit_exact: bool = False  # exited_at is the kernel's time of the exit, not the agent's next scan
    exit_signal: int = 0      # the fatal signal it was sent (0: none seen)
    stopped_by_launcher: bool = False  # that signal came from its launcher (a restart, a cancelled job)
    seen_at: Optional[float] = None   # its newest event but collective rows (those: its columns' seen_at)
    last_p2p: Optional[Tuple[str, int, float]] = None  # (op, peer, at)
    # Scheduler (SchedStats, cumulative ns): waiting for a CPU while runnable, and off CPU while blocked.
    runq_ns: int = -1
    runq_waits: int = 0
    offcpu_ns: int = -1
    runq_max_ns: int = 0              # longest single wait in the latest report's interval
    runq_share: Optional[float] = None  # runqueue seconds per second between the last two reports
    sched_at: Optional[float] = None
    runq_hist: Deque[Tuple[float, int]] = field(default_factory=lambda: collections.deque(maxlen=RUNQ_HISTORY))
    cells: List[Tuple[CollStore, int]] = field(default_factory=list, repr=False, compare=False)

    @property
    def last_event_at(self) -> Optional[float]:
        """Its newest event's time: the newest of seen_at and of its collective rows (colltable.py's cells)."""
        t = self.seen_at
        for store, cell in self.cells:
            c = float(store.seen_at[cell])
            if c != float("-inf") and (t is None or c > t):
                t = c
        return t

    def watch(self, store: CollStore, cell: int) -> None:
        """Cell `cell` of `store` holds this process's collective rows in one communicator."""
        self.cells.append((store, cell))

    def runq_since(self, since: float) -> Optional[float]:
        """Runqueue seconds per second from the first report at or after `since` to the latest (the
        share over a span, which one noisy report cannot tip), or None with under two reports."""
        h = self.runq_hist
        first = next((x for x in h if x[0] >= since), None)
        if first is None or h[-1][0] - first[0] < RUNQ_MIN_SPAN_S:
            return None
        return (h[-1][1] - first[1]) / 1e9 / (h[-1][0] - first[0])

    def saw(self, t: float) -> None:
        """An event of this process at `t`: keeps the newest (frames can arrive out of order)."""
        self.seen_at = t if self.seen_at is None else max(self.seen_at, t)

    def stopped(self) -> bool:
        return self.state in ("T", "t")

    def exited(self) -> bool:
        return self.exited_at is not None or self.state in ("Z", "X")


@dataclass
class Comm:
    """A communicator (process group) across ranks."""
    id: str
    backend: str = ""
    group_size: int = -1
    job: str = ""
    members: Set[int] = field(default_factory=set)          # global ranks seen via CommInit/CollEnter
    pids: Dict[int, Tuple[str, int]] = field(default_factory=dict)  # global rank -> (node, pid)
    retired: Set[Tuple[str, int]] = field(default_factory=set)      # (node, pid)s replaced by a restart
    colls: "collections.OrderedDict[int, CollView]" = field(default_factory=collections.OrderedDict)
    made: int = 0              # views ever made (CollView.made: its place in that order) ...
    gone: int = 0              # ... and evicted, oldest made first: colls holds those made >= gone
    done: DoneLog = field(default_factory=DoneLog, repr=False, compare=False)  # its completions, as arrays
    store: Optional[CollStore] = field(default=None, repr=False, compare=False)  # what colls' views show ...
    cols: Optional[CommCols] = field(default=None, repr=False, compare=False)    # ... and its columns there
    max_seq: int = -1
    evicted_upto: int = -1     # seqs at or below this fell out of the bound; late events for them are dropped
    # bucket index -> (max arrival spread s, max duration s) of collectives completed in that bucket
    peaks: Dict[int, Tuple[float, float]] = field(default_factory=dict)
    completed: int = 0
    resets: int = 0
    expected: FrozenSet[int] = frozenset()                 # expected_members' answer, while expected_key holds
    expected_key: Tuple[Any, ...] = (-2,)                 # never computed
    dropped: int = 0                                       # members removed (drop_member)
    expected_world: int = -1                               # the world `expected` is range() of, -1: members
    group_of: Dict[int, int] = field(default_factory=dict)     # global rank -> group rank (CommInit)
    global_by_group: Dict[int, int] = field(default_factory=dict)  # its inverse
    ordered: Tuple[Any, List[int]] = ((), [])                  # (expected_key, sorted expected members): a cache
    seq_sources: Dict[int, str] = field(default_factory=dict)  # global rank -> CommInit.seq_source
    p2p: Optional[CommP2P] = None                              # its point-to-point ops, once it has any
    unseen_noted: bool = False  # hang.py counted (once) that a crowd of its members was never reported
    first_done_at: Optional[float] = None  # when its first collective completed (how long its normal is known)
    # Its expected members are the members seen, never the job's world: a per-process NCCL communicator
    # (named by its handle, seen after the attach) and one joined from such by align.py
    members_only: bool = False
    subgroup: bool = False  # known not to span the world (CommInit.subgroup): its size unknown, its members are those seen
    alignment: Optional[Dict[str, Any]] = None  # align.py's joined communicator: how (findings' evidence)
    expected_cols: Tuple[Any, Any] = (None, None)  # ((expected, ncols), columns of the expected or None): a cache
    _last: Tuple[int, Dict[int, Tuple[int, str, float]]] = (-1, {})

    @property
    def last_entered(self) -> Dict[int, Tuple[int, str, float]]:
        """rank -> (seq, op, at) of the newest collective it entered (a snapshot; made once per change)."""
        st = self.store
        if st is None or self.cols is None:
            return {}
        if self._last[0] != st.last_version:
            self._last = (st.last_version, st.last_entered(self.cols))
        return self._last[1]

    def last_entered_of(self, rank: int) -> Optional[Tuple[int, str, float]]:
        """last_entered's value for one rank (None: it entered none), read from its cell alone."""
        st, cols = self.store, self.cols
        cell = None if st is None or cols is None else cols.cell_of(rank)
        return None if st is None or cell is None else st.last_entered_cell(cell)

    def drop_member(self, rank: int) -> None:
        """`rank` is no longer one of its members; its next enter makes it one again (collapply.py adds a
        rank once per cell, so the cell forgets that it did)."""
        self.members.discard(rank)
        self.dropped += 1  # in expected_members' key: a rank added back later leaves the count as it was
        st, cols = self.store, self.cols
        cell = None if st is None or cols is None else cols.cell_of(rank)
        if st is not None and cell is not None:
            st.member[cell] = False

    def attach(self, store: CollStore) -> CommCols:
        """Its columns in `store` (made the first time)."""
        if self.cols is None:
            self.store, self.cols = store, store.new_comm()
        return self.cols
