"""NCCL's proxy progress per link in the trace, from the profiler plugin's NetProgress events.

A NetProgress says how one rank's NCCL proxy moved data to (send) or from (recv) one peer of a
communicator on one channel over the plugin's last flush interval, ending at ts_ns. Per reporting
rank R, communicator, peer P and direction, all channels together, counter tracks under R's process,
named `nccl:H R->P ...` for sends and `nccl:H R<-P ...` for receives (H: the communicator's hash; the
arrow points the way the data goes; P a global rank):
  `MiB/s`: bytes the proxy completed;
  `steps in flight`: steps posted and not done at the latest report, the sum of each channel's latest
      (as timeline.netprog counts them): a stalled link holds it above 0 with 0 MiB/s;
  `net wait %`: of the time its steps waited, the share spent on the network (the peer) rather than
      on the GPU: high on the sender of a slow link, low on the links behind it (their data comes late).
Values are per BUCKET_NS of recorded time, written at the bucket's start, as netcounters.py writes TCP
links: a report's bytes and wait times are spread over the interval it covers (INTERVAL_NS, less
since the channel's previous report) in proportion to the time in each bucket; steps in flight go to
the bucket of the report's time; an unchanged value is not written again; after a burst a 0 follows
(the plugin sends nothing for an idle link); `net wait %` is written only where steps waited.
Peers: NetProgress names them by group rank; the communicator's CommInit events map them to global
ranks, by the time a bucket is written (CLOSE_AFTER_NS later); a peer still unknown then is named
`gG` (its group rank G) for good. Times: `ts` as the model converted it (facts.rare: model.TIMEBASE).
Caveat: a report is taken to cover at most one default flush interval; a plugin sending less often
(CCLD_NCCLPROF_FLUSH_MS) shows its bytes in the last INTERVAL_NS before each report.
Why not timeline.netprog.ProgressTable: it sums whole runs per link for the detectors; a trace needs
each interval's values, which every report carries as they are (nothing is joined or matched here).
Bounds: MAX_LINKS links, MAX_CHANNELS channel ids, MAX_MEMBERS rank mappings, and open buckets only
within CLOSE_AFTER_NS of the newest event; what does not fit is counted in anomalies.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Optional, Tuple

from ccld.export.buckets import Closing
from ccld.export.tracks import Proc, Track

if TYPE_CHECKING:
    from ccld.export.model import TraceModel

BUCKET_NS = 100_000_000        # the plugin's default flush interval (CCLD_NCCLPROF_FLUSH_MS): each
                               # channel's report fills about one bucket
INTERVAL_NS = 100_000_000      # a report covers at most one flush interval before it: the plugin zeroes
                               # its sums at every flush and sends nothing for an idle link
CLOSE_AFTER_NS = 2_000_000_000  # a bucket is written once recorded time is 2 s past its end (agents ship
                                # within that, as for netcounters); a later report goes to the next open one
MAX_LINKS = 65_536             # (rank, communicator, peer, direction) drawn: a 256-rank full mesh one way
MAX_CHANNELS = 256             # channel ids 0..255 (NCCL's MAXCHANNELS is 32..128, by version)
MAX_MEMBERS = 1_048_576        # (communicator, rank) mappings kept: 4096 communicators of 256 ranks
NCCL_ORDER = 1 << 20           # these tracks sort after the TCP link tracks (netcounters.LINK_ORDER + 3 x peer)
MAX_ORDER_PEER = 1 << 24       # peers beyond this share a sort position (the order is an int32)
MIB = float(1 << 20)


class Link:
    """One rank's transfers with one peer of one communicator, one direction: every channel's latest
    report [ts, in_flight], their in-flight sum, open buckets [bytes, net ns, gpu ns, in flight (-1:
    no report)] and the counter tracks (made when first written)."""
    __slots__ = ("proc", "comm", "peer", "send", "channels", "in_flight", "buckets", "closed", "rate",
                 "flight", "wait")

    def __init__(self, proc: Proc, comm: str, peer: int, send: bool):
        self.proc, self.comm, self.peer, self.send = proc, comm, peer, send
        self.channels: Dict[int, list] = {}
        self.in_flight = 0
        self.buckets: Dict[int, list] = {}
        self.closed = -(1 << 62)   # the highest bucket written
        self.rate: Optional[Track] = None
        self.flight: Optional[Track] = None
        self.wait: Optional[Track] = None


class NcclProgress:
    def __init__(self, model: "TraceModel"):
        self.m = model
        self.links: Dict[Tuple[Proc, str, int, bool], Link] = {}
        self.to_global: Dict[Tuple[str, int], int] = {}   # (comm, group rank) -> global rank
        self.to_group: Dict[Tuple[str, int], int] = {}    # (comm, global rank) -> group rank
        self.closing = Closing(BUCKET_NS, CLOSE_AFTER_NS)

    def note_comm(self, comm: str, group_rank: int, rank: int) -> None:
        """A CommInit: `rank` (global) is `group_rank` in `comm`."""
        if not (type(comm) is str and type(group_rank) is int and type(rank) is int) or group_rank < 0 or rank < 0:
            return
        if (comm, group_rank) not in self.to_global and len(self.to_global) >= MAX_MEMBERS:
            self.m.anomalies["nccl-comm-members-over-bound"] += 1
            return
        self.to_global[(comm, group_rank)] = rank
        self.to_group[(comm, rank)] = group_rank

    def on_progress(self, p: Proc, e: dict, ts: int) -> None:
        """One NetProgress wire event of rank `p`, at `ts` (collector Unix ns)."""
        comm, peer, send, ch = e["comm"], e["peer"], e["send"], e.get("channel", 0)
        nbytes, net, gpu, flight = (e.get(f, 0) for f in ("nbytes", "net_wait_ns", "gpu_wait_ns", "in_flight"))
        if not (type(comm) is str and type(send) is bool and type(peer) is type(ch) is type(nbytes) is
                type(net) is type(gpu) is type(flight) is int):
            raise TypeError("net_progress fields")
        if nbytes < 0 or net < 0 or gpu < 0 or flight < 0:
            raise ValueError("net_progress counters")
        if p.skip:
            return
        anomalies = self.m.anomalies
        # a negative peer or the rank itself is not a link, as in ProgressTable (which takes the global
        # rank for the group rank until the CommInit comes; here nothing is dropped on that guess)
        if peer < 0 or peer == self.to_group.get((comm, p.rank)):
            anomalies["nccl-progress-bad-peer"] += 1
            return
        if not 0 <= ch < MAX_CHANNELS:
            anomalies["nccl-progress-bad-channel"] += 1
            return
        key = (p, comm, peer, send)
        link = self.links.get(key)
        if link is None:
            if len(self.links) >= MAX_LINKS:
                anomalies["nccl-progress-links-over-bound"] += 1
                return
            link = self.links[key] = Link(p, comm, peer, send)
        c = link.channels.get(ch)
        if c is None:
            c = link.channels[ch] = [ts - INTERVAL_NS, 0]
        elif ts <= c[0]:
            anomalies["nccl-progress-out-of-order"] += 1
            return
        span = min(ts - c[0], INTERVAL_NS)
        link.in_flight += flight - c[1]
        c[0], c[1] = ts, flight
        lo, last = ts - span, (ts - 1) // BUCKET_NS
        moved = nbytes or net or gpu
        if (lo // BUCKET_NS if moved else last) <= link.closed:
            anomalies["nccl-progress-late"] += 1  # later than CLOSE_AFTER_NS: drawn in the next open bucket
        if moved:  # spread over the buckets the interval covers, by the time in each
            for i in range(lo // BUCKET_NS, last + 1):
                part = (min(ts, (i + 1) * BUCKET_NS) - max(lo, i * BUCKET_NS)) / span
                b = self._bucket(link, i)
                b[0] += nbytes * part
                b[1] += net * part
                b[2] += gpu * part
        self._bucket(link, last)[3] = link.in_flight

    def _bucket(self, link: Link, i: int) -> list:
        i = max(i, link.closed + 1)  # a bucket already written: the next one
        return self.closing.open(link, i, lambda: [0.0, 0.0, 0.0, -1])

    def due(self, now: int) -> None:
        """Write every bucket that closed by `now` (recorded time)."""
        for link, i, b in self.closing.due(now):
            self._write(link, i, b)

    def _write(self, link: Link, i: int, b: list) -> None:
        m = self.m
        link.closed = max(link.closed, i)
        nbytes, net, gpu, flight = b
        ts = i * BUCKET_NS
        if link.rate is None:
            link.rate = self._track(link, "MiB/s", "MiB/s", 0, "bytes the proxy completed")
            link.flight = self._track(link, "steps in flight", "", 1, "steps posted and not done at the "
                                      "latest report (a stalled link holds them with 0 MiB/s)")
        m.sample(link.rate, ts, round(nbytes * 1e9 / BUCKET_NS / MIB, 6))
        if flight >= 0 and link.flight is not None:
            m.sample(link.flight, ts, flight)
        if net + gpu > 0:
            if link.wait is None:
                link.wait = self._track(link, "net wait %", "%", 2, "of the time its steps waited, the share "
                                        "on the network (the peer) rather than on the GPU")
            m.sample(link.wait, ts, round(100.0 * net / (net + gpu), 3))
        if nbytes and i + 1 not in link.buckets:
            self._bucket(link, i + 1)  # an empty next bucket: the rate drops to 0 after a burst

    def _track(self, link: Link, what: str, unit: str, k: int, desc: str) -> Track:
        m, p = self.m, link.proc
        peer = self.to_global.get((link.comm, link.peer))
        label = f"g{link.peer}" if peer is None else str(peer)
        tag = link.comm.rsplit("/", 1)[-1]
        name = f"{tag} {p.rank}{'->' if link.send else '<-'}{label} {what}"
        who = f"rank {peer}" if peer is not None else f"group rank {link.peer} (global rank not known)"
        verb = "sends to" if link.send else "receives from"
        order = NCCL_ORDER + 6 * min(link.peer if peer is None else peer, MAX_ORDER_PEER) + 3 * (not link.send) + k
        return m.new_track(m.proc_track(p), name, "counter", order=order, unit=unit,
                           description=f"rank {p.rank} {verb} {who} on {link.comm}, NCCL proxy, all channels: "
                                       f"{desc}, per {BUCKET_NS / 1e6:g} ms")
