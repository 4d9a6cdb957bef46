"""Network progress of NCCL's transfers per link, from the profiler plugin's NetProgress events.

Each NetProgress says how one rank's proxy moved data to (send) or from (recv) one peer on one
channel over an interval. This table sums the intervals per directed link of a communicator
(rank -> peer for sends, peer -> rank for receives: the direction the data flows), over all channels,
and keeps when each link last moved and how many steps it had in flight at its latest report. It is
the only place these events are read; detectors ask `links_of(comm)`.

Times: Unix seconds (the caller converts ts_ns and last_ns with the agent's clock). Peers are group
ranks of the communicator; the table stores them as reported and maps them to global ranks when asked
(the communicator's CommInit may arrive after the first progress).
Bounded: at most MAX_LINKS entries; beyond that new links are counted as an anomaly, not kept.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, Optional, Tuple

from ccld import wire as ev

MAX_LINKS = 262_144  # directed (comm, src, dst) links kept: 16 channels' worth for a 16k-rank ring
MAX_REPORTS = 1_200  # sender reports kept per link for windows: 2 minutes at the plugin's 100 ms (x channels)


@dataclass
class LinkProgress:
    """One directed link of one communicator (data flows src -> dst), as both ends report it."""
    comm: str
    src: int                 # group ranks
    dst: int
    tx_bytes: int = 0        # completed, summed over reports and channels, as the sender reported them
    rx_bytes: int = 0        # ... as the receiver did
    tx_steps: int = 0
    rx_steps: int = 0
    net_wait_s: float = 0.0  # summed time steps waited on the network
    gpu_wait_s: float = 0.0  # ... on the GPU
    tx_in_flight: int = 0    # the sender's steps posted and not done, at its latest report (over channels):
                             # a sender with data on the wire that never completes is the stalled link
    rx_in_flight: int = 0    # the receiver's posted receives not done (every waiting rank has some)
    last_moved: Optional[float] = None   # Unix s a step of it last moved (either end)
    reported: Optional[float] = None     # Unix s of the latest report (either end)
    first_reported: Optional[float] = None
    # the sender's reports, oldest first: (Unix s, bytes, steps, network wait s), for windows
    history: Deque[Tuple[float, int, int, float]] = field(default_factory=lambda: collections.deque(maxlen=MAX_REPORTS))


@dataclass
class Window:
    """What a link's sender reported over a span: completed bytes and steps, their network wait."""
    nbytes: int = 0
    steps: int = 0
    net_wait_s: float = 0.0
    reports: int = 0

    @property
    def wait_per_step_s(self) -> Optional[float]:
        return self.net_wait_s / self.steps if self.steps else None


class ProgressTable:
    def __init__(self, anomalies: "collections.Counter[str]"):
        self.anomalies = anomalies
        self._links: Dict[Tuple[str, int, int], LinkProgress] = {}
        # (comm, reporting group rank, peer, send, channel) -> in_flight at its latest report
        self._inflight: Dict[Tuple[str, int, int, bool, int], int] = {}
        self.by_comm: Dict[str, Dict[Tuple[int, int], LinkProgress]] = collections.defaultdict(dict)

    def update(self, e: ev.NetProgress, group_rank: Optional[int], to_unix: Callable[[int], float]) -> None:
        """Apply one report. `group_rank`: the reporting rank's rank in e.comm (None: not known yet,
        then its global rank is used, which is right for the world communicator)."""
        me = e.rank if group_rank is None else group_rank
        if e.peer < 0 or me < 0 or e.peer == me:
            self.anomalies["net-progress-bad-peer"] += 1
            return
        src, dst = (me, e.peer) if e.send else (e.peer, me)
        key = (e.comm, src, dst)
        link = self._links.get(key)
        if link is None:
            if len(self._links) >= MAX_LINKS:
                self.anomalies["net-progress-links-over-bound"] += 1
                return
            link = self._links[key] = LinkProgress(comm=e.comm, src=src, dst=dst)
            self.by_comm[e.comm][(src, dst)] = link
        t = to_unix(e.ts_ns)
        link.first_reported = t if link.first_reported is None else min(link.first_reported, t)
        link.reported = t if link.reported is None else max(link.reported, t)
        if e.send:
            link.tx_bytes += e.nbytes
            link.tx_steps += e.steps
            if e.steps:
                link.history.append((t, e.nbytes, e.steps, e.net_wait_ns / 1e9))
        else:
            link.rx_bytes += e.nbytes
            link.rx_steps += e.steps
        link.net_wait_s += e.net_wait_ns / 1e9
        link.gpu_wait_s += e.gpu_wait_ns / 1e9
        ikey = (e.comm, me, e.peer, e.send, e.channel)
        if e.send:
            link.tx_in_flight += e.in_flight - self._inflight.get(ikey, 0)
        else:
            link.rx_in_flight += e.in_flight - self._inflight.get(ikey, 0)
        self._inflight[ikey] = e.in_flight
        if e.last_ns > 0:
            moved = to_unix(e.last_ns)
            link.last_moved = moved if link.last_moved is None else max(link.last_moved, moved)

    def links_of(self, comm: str) -> Dict[Tuple[int, int], LinkProgress]:
        """(src, dst) group ranks -> progress, for one communicator ({} when it has none)."""
        return self.by_comm.get(comm, {})

    def window(self, comm: str, t0: float, t1: float) -> Dict[Tuple[int, int], Window]:
        """Per directed link of `comm` with sender reports in [t0, t1] (Unix s): their sums."""
        out: Dict[Tuple[int, int], Window] = {}
        for key, lp in self.links_of(comm).items():
            w = Window()
            for t, nbytes, steps, wait in reversed(lp.history):
                if t < t0:
                    break
                if t <= t1:
                    w.nbytes, w.steps, w.net_wait_s, w.reports = w.nbytes + nbytes, w.steps + steps, \
                        w.net_wait_s + wait, w.reports + 1
            if w.reports:
                out[key] = w
        return out
