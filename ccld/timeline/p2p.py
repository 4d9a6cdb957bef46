"""Point-to-point operations of one communicator, matched pairwise.

A p2p op is one rank's side of one transfer: posted (P2P) and over (P2PEnd). The stream a->b on a
communicator pairs the n-th send of a to b with the n-th recv of b from a (P2P.seq is n, counted by
each rank's agent per direction and peer), which is what the library does too: ops between one pair
of ranks complete in order. Numbering is exact for a rank whose agent saw the group made (CommInit
with its group rank); for a rank first seen mid-run its n starts at our attach, so the two sides of a
stream may be numbered from different transfers. Such a stream is aligned before it is paired: the
offset d (recv n + d pairs with send n) that makes the two sides' ends coincide (a transfer is over
on both sides at once, give or take a drain), found once ALIGN_MIN pairs overlap and only when it
is clearly better than every other offset; until then `pairs` yields nothing for it, while open ops
still say what each rank is blocked in.
Peers are group ranks in the events; `Comm.global_of` maps them to global ranks.
Times are Unix seconds (the Timeline converted them). Bounds: the newest MAX_OPS_PER_KEY ops per
(rank, direction, peer), MAX_KEYS_PER_COMM such keys, MAX_OPEN_PER_RANK open ops per rank (an isend
never waited for stays open until it falls out); what falls out is counted in the anomalies.
"""
from __future__ import annotations

import collections
from typing import Deque, Dict, Iterator, List, Optional, Set, Tuple

import numpy as np

from ccld import wire as ev

MAX_OPS_PER_KEY = 512      # transfers kept per (rank, direction, peer): minutes of a pipeline's micro-batches
MAX_KEYS_PER_COMM = 65536  # (rank, direction, peer) keys: a rank talks to a handful of peers
MAX_OPEN_PER_RANK = 256    # posted, not yet over: a batch of isend/irecv is a few
MAX_FAILED = 64            # failed ops remembered per communicator: a death fails a few per neighbour
PEAK_BUCKET_S = 300.0      # the longest wait of a completed op, per 5-minute bucket ...
PEAK_BUCKETS = 12          # ... for an hour (as Timeline.recent_peaks for collectives)
COMPLEMENT = {"send": "recv", "recv": "send"}
ALIGN_MIN = 16             # transfers both sides hold before a mid-run stream's offset is chosen
ALIGN_MAX_OFFSET = 128     # offsets tried: agents attach a node's ranks seconds apart while micro-batches fly
ALIGN_SLACK_S = 0.002      # a recv "ends before its send was posted" by more than this (clock error across nodes)
ALIGN_MAX_EARLY = 0.05     # the chosen offset: at most this share of recvs end before their send was posted
ALIGN_MIN_EARLY_BEFORE = 0.5  # ... while one offset less has at least this share (it pairs recvs with later sends)
ALIGN_CLEAR = 2.0          # and its median end mismatch is this many times below any other causal offset's

Key = Tuple[int, str, int]  # (global rank, "send" | "recv", peer group rank)


class P2POp:
    """One rank's side of one transfer."""
    __slots__ = ("rank", "op", "peer", "seq", "posted", "ended", "ok", "error", "wait_at", "nbytes")

    def __init__(self, rank: int, op: str, peer: int, seq: int, posted: float, nbytes: int):
        self.rank, self.op, self.peer, self.seq = rank, op, peer, seq
        self.posted, self.nbytes = posted, nbytes
        self.ended: Optional[float] = None
        self.ok = True
        self.error = ""
        self.wait_at: Optional[float] = None  # when the rank began waiting on it, where the probes say

    def blocked_from(self) -> float:
        """When the rank began waiting on it: its wait's start when known, else when it was posted."""
        return self.posted if self.wait_at is None else max(self.posted, self.wait_at)

    def describe(self) -> str:
        return f"{self.op} {'to' if self.op == 'send' else 'from'} group rank {self.peer} (#{self.seq})"


class CommP2P:
    """The p2p ops of one communicator (held by its Comm)."""

    def __init__(self, anomalies: collections.Counter):
        self.anomalies = anomalies
        self.ops: Dict[Key, "collections.OrderedDict[int, P2POp]"] = {}
        self.open: Dict[int, Dict[Tuple[str, int, int], P2POp]] = {}   # rank -> (op, peer, seq) -> op
        self.exact: Set[int] = set()      # ranks whose numbering began with the group
        self.peaks: Dict[int, float] = {}  # bucket -> longest wait (ended - blocked_from) completed in it
        self.aligned: Dict[Tuple[int, int], int] = {}  # (src, dst) -> offset of a mid-run stream, once found
        self.last_posted: Dict[int, float] = {}  # rank -> when it last posted an op here
        self.last_done: Dict[int, float] = {}    # rank -> the latest post time of its ops that are over
        self.posted = 0
        self.ended = 0
        self.first_done_at: Optional[float] = None  # when the first op completed here
        self.failed: Deque[P2POp] = collections.deque(maxlen=MAX_FAILED)  # the newest ops that ended in an error

    def post(self, rank: int, e: ev.P2P, t: float) -> Optional[P2POp]:
        if e.op not in COMPLEMENT or e.seq < 0 or e.peer < 0:
            self.anomalies["p2p-unnumbered"] += 1  # recv from any source: no pair to match it with
            return None
        key = (rank, e.op, e.peer)
        got = self.ops.get(key)
        if got is None:
            if len(self.ops) >= MAX_KEYS_PER_COMM:
                self.anomalies["p2p-keys-over-bound"] += 1
                return None
            got = self.ops[key] = collections.OrderedDict()
        if e.seq in got:
            self.anomalies["duplicate-p2p"] += 1
            return None
        op = got[e.seq] = P2POp(rank, e.op, e.peer, e.seq, t, e.nbytes)
        while len(got) > MAX_OPS_PER_KEY:
            _, old = got.popitem(last=False)
            self._close(old)
        opened = self.open.setdefault(rank, {})
        opened[(e.op, e.peer, e.seq)] = op
        if len(opened) > MAX_OPEN_PER_RANK:
            oldest = min(opened, key=lambda k: opened[k].posted)
            del opened[oldest]
            self.anomalies["p2p-open-over-bound"] += 1  # posted and never waited for (isend dropped)
        self.posted += 1
        if t > self.last_posted.get(rank, float("-inf")):
            self.last_posted[rank] = t
        return op

    def end(self, rank: int, e: ev.P2PEnd, t: float, wait_at: Optional[float]) -> Optional[P2POp]:
        got = self.ops.get((rank, e.op, e.peer))
        op = got.get(e.seq) if got is not None else None
        if op is None:
            self.anomalies["p2p-end-without-post"] += 1
            return None
        if op.ended is not None:
            self.anomalies["duplicate-p2p-end"] += 1
            return None
        op.ended, op.ok, op.error, op.wait_at = t, e.ok, e.error, wait_at
        self._close(op)
        self.ended += 1
        if not e.ok:
            self.failed.append(op)
        if op.posted > self.last_done.get(rank, float("-inf")):
            self.last_done[rank] = op.posted
        if e.ok:
            if self.first_done_at is None:
                self.first_done_at = t
            bucket = int(t // PEAK_BUCKET_S)
            self.peaks[bucket] = max(self.peaks.get(bucket, 0.0), t - op.blocked_from())
            while len(self.peaks) > PEAK_BUCKETS:
                del self.peaks[min(self.peaks)]
        return op

    def _close(self, op: P2POp) -> None:
        opened = self.open.get(op.rank)
        if opened is not None:
            opened.pop((op.op, op.peer, op.seq), None)
            if not opened:
                del self.open[op.rank]

    # ---- questions ------------------------------------------------------------------------------

    def open_ops(self, rank: int) -> List[P2POp]:
        return list(self.open.get(rank, {}).values())

    def newest_open(self, rank: int) -> Optional[P2POp]:
        opened = self.open.get(rank)
        return max(opened.values(), key=lambda o: o.posted) if opened else None

    def open_toward(self, rank: int, op: str, peer_group: int) -> List[P2POp]:
        """`rank`'s open ops of kind `op` with group rank `peer_group`, oldest first."""
        opened = self.open.get(rank, {})
        return sorted((o for (k, p, _), o in opened.items() if k == op and p == peer_group), key=lambda o: o.seq)

    def last_of(self, rank: int, op: str, peer_group: int) -> Optional[P2POp]:
        got = self.ops.get((rank, op, peer_group))
        return next(reversed(got.values())) if got else None

    def recent_peak(self, now: float) -> float:
        """The longest wait of a p2p op completed on this communicator in the last hour, s."""
        oldest = int(now // PEAK_BUCKET_S) - PEAK_BUCKETS + 1
        return max((w for b, w in self.peaks.items() if b >= oldest), default=0.0)

    def offset(self, src: int, dst: int, g_src: int, g_dst: int) -> Optional[int]:
        """d such that recv n + d on dst pairs with send n of src: 0 when both count from the group's
        creation, the aligned offset of a mid-run stream once established, else None.

        Alignment: for the true d, no recv ends before its send was posted (data cannot arrive
        first) and the two sides end together; for d - 1 most recvs end before their (later) send
        was posted. So d is the offset, within +-ALIGN_MAX_OFFSET, whose median end mismatch is
        smallest, with (almost) no recv ending before its send, while d - 1 has many that do."""
        if src in self.exact and dst in self.exact:
            return 0
        got = self.aligned.get((src, dst))
        if got is not None:
            return got
        sends, recvs = self.ops.get((src, "send", g_dst)), self.ops.get((dst, "recv", g_src))
        if not sends or not recvs or len(sends) < ALIGN_MIN or len(recvs) < ALIGN_MIN:
            return None
        s_n = np.fromiter((n for n, o in sends.items() if o.ended is not None), dtype=np.int64)
        s_post = np.fromiter((o.posted for o in sends.values() if o.ended is not None), dtype=np.float64)
        s_end = np.fromiter((o.ended for o in sends.values() if o.ended is not None), dtype=np.float64)
        r_ended = {n: o.ended for n, o in recvs.items() if o.ended is not None}
        if len(s_n) < ALIGN_MIN or len(r_ended) < ALIGN_MIN:
            return None
        r_min, r_max = min(r_ended), max(r_ended)
        r_end = np.full(r_max - r_min + 1, np.nan)
        r_end[np.fromiter(r_ended, dtype=np.int64) - r_min] = np.fromiter(r_ended.values(), dtype=np.float64)
        stats = {}
        for d in range(-ALIGN_MAX_OFFSET, ALIGN_MAX_OFFSET + 1):
            idx = s_n + d - r_min
            ok = (idx >= 0) & (idx < len(r_end))
            ends = np.full(len(s_n), np.nan)
            ends[ok] = r_end[idx[ok]]
            have = ~np.isnan(ends)
            if have.sum() < ALIGN_MIN:
                continue
            early = float(np.mean(ends[have] < s_post[have] - ALIGN_SLACK_S))
            stats[d] = (float(np.median(np.abs(ends[have] - s_end[have]))), early)
        fits = [(m, k) for k, (m, early) in stats.items() if early <= ALIGN_MAX_EARLY]
        if not fits:
            return None
        mismatch, d = min(fits)
        before = stats.get(d - 1)
        others = [m for m, k in fits if k != d]
        if before is not None and before[1] < ALIGN_MIN_EARLY_BEFORE:
            return None  # d - 1 is causal too: the stream is too regular (or too idle) to tell yet
        if others and mismatch * ALIGN_CLEAR >= min(others):
            return None  # another causal offset fits about as well: not yet
        self.aligned[(src, dst)] = d
        return d

    def pairs(self, src: int, dst: int, g_src: int, g_dst: int) -> Iterator[Tuple[P2POp, P2POp]]:
        """(send, recv) of the stream src -> dst (global ranks; g_*: their group ranks), matched by n
        (and the stream's offset, for a mid-run one), for the transfers both sides still hold. Nothing
        while a mid-run stream is not aligned."""
        d = self.offset(src, dst, g_src, g_dst)
        if d is None:
            return
        sends, recvs = self.ops.get((src, "send", g_dst)), self.ops.get((dst, "recv", g_src))
        if not sends or not recvs:
            return
        for n, s in sends.items():
            r = recvs.get(n + d)
            if r is not None:
                yield s, r

    def streams(self) -> List[Tuple[int, int]]:
        """(global rank, peer group rank) of every rank's send streams."""
        return [(rank, peer) for rank, op, peer in self.ops if op == "send"]
