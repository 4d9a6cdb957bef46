"""Alignment of NCCL communicators first seen after the agent attached (the uprobe path, `agent --pid`).

ccld/bpf/nccl.py names a communicator made before the attach `<job>/nccl:handle-r<rank>-<hex>`: a name of
one process, whose seq counts from the first call the agent saw (CommInit.seq_source "attach"). Each
such stream is a communicator of one member (Comm.members_only: nothing is judged on it) until joined.
For streams A and B, every offset d (B's seq + d = A's seq) at which at least MIN_MATCH of B's newest
calls meet A's is possible when those calls agree on (op, count, dtype); its score is their median
|enter time difference| (ranks enter one collective within the job's arrival spread; a call off, they
are a step apart). The best possible d is accepted when d-1 and d+1 were tried too, its median is under
MAX_SKEW_S and every other possible d's is RATIO times larger; else the stream waits (counted once per
stream in the timeline's anomalies as "nccl-align-ambiguous").

Matched streams make one communicator `<job>/nccl:aligned-r<rank>-<hex>`, named after and numbered as
the reference (the stream seen longest); each member has its offset and `start`, the first aligned seq
no member had called yet. From then on each member's CollEnter, WorkStart and WorkEnd are rewritten
(comm, seq + offset) at Timeline.ingest, before anything applies them: a column block once (its shared
comm, its seq column), a plain event by replace(); only frames from the nodes of aligned streams are
read. Earlier calls stay on the per-process communicators. P2P is not moved: NCCL numbers p2p per peer
from the attach, an offset this does not give. A stream that appears later joins by the same test
against the aligned communicator's calls (its reference's before the alignment, then its own).

Times: Unix seconds (the timeline's). Bounds: WINDOW newest calls of A against MATCH_WINDOW of B, every
offset in one numpy pass (~1 ms); a job is looked at every EVERY_S of receive time, MAX_PAIRS
comparisons at a time. Caveats: communicators with one op stream entered at the same times cannot be
told apart (they wait); a rank late at every collective by most of the time the op stream takes to
repeat itself is given the offset of the repeat.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Set, Tuple

import numpy as np

from ccld import wire as ev
from ccld.wire.blocks import Block

HANDLE_MARK = "/nccl:handle-"   # ccld/bpf/nccl.py's per-process name (this layer cannot import the agent's)
HOW = "op stream and enter times"
MIN_MATCH = 16       # calls that must agree at an offset; a step of a training loop has a handful to hundreds
WINDOW = 256         # newest calls of the reference stream compared ...
MATCH_WINDOW = 64    # ... with this many of the other's: offsets up to ~300 calls apart (attach seconds apart)
RATIO = 4.0          # the best offset's median |dt| is this many times smaller than any other possible one's
MAX_SKEW_S = 2.0     # ... and under this: ranks that far apart in one collective are not that collective
DT_FLOOR_S = 1e-6    # medians below a microsecond compare as a microsecond (clock conversion's resolution)
EVERY_S = 1.0        # receive seconds between two looks at one job's waiting streams
MAX_PAIRS = 64       # stream comparisons per look (~1 ms each): thousands of streams take many looks
EVIDENCE_MEMBERS = 16  # members described in a finding's evidence; n_members counts them all
_MOVED = frozenset({"coll", "start", "end"})
Key = Tuple[Any, ...]                            # (op, count, dtype) of a call
Stream = Tuple[np.ndarray, List[Key], np.ndarray]  # seq, keys, enter times (Unix s), by seq


class Match(NamedTuple):
    offset: Optional[int]  # B's seq + offset = A's seq; None: no accepted offset
    reason: str            # "aligned", "few-calls", "no-match" (no offset agrees), "ambiguous"
    matched: int = 0       # calls compared at the offset
    dt_s: float = 0.0      # their median |enter time difference|
    next_dt_s: Optional[float] = None  # the next best possible offset's (None: none agreed)


def per_process(backend: str, comm: str, seq_source: str) -> bool:
    """A CommInit's fields name an NCCL communicator of one process's handle, numbered from the attach
    (the export asks too, of a store's CommInit dicts: a name that is not a string is none)."""
    return backend == "nccl" and type(comm) is str and HANDLE_MARK in comm \
        and seq_source in (ev.SEQ_FROM_ATTACH, "")


def stream(comm: Any) -> Stream:
    """(seq, (op, count, dtype) keys, first enter time) of a communicator's newest WINDOW collectives."""
    views = sorted(itertools.islice(reversed(comm.colls.values()), WINDOW), key=lambda v: v.seq)
    seq: List[int] = []
    keys: List[Key] = []
    times: List[float] = []
    for v in views:
        if v.enter:
            r = min(v.enter, key=v.enter.__getitem__)
            size = v.sizes.get(r)
            seq.append(v.seq)
            keys.append((v.ops.get(r) or v.op, size[0], size[1]) if size else (v.ops.get(r) or v.op,))
            times.append(v.enter[r])
    return np.array(seq, np.int64), keys, np.array(times, np.float64)


def match(a: Stream, b: Stream) -> Match:
    """The offset that aligns stream b on stream a (module text), or why there is none yet."""
    a_seq, a_keys, a_t = a
    b_seq, b_keys, b_t = b[0][-MATCH_WINDOW:], b[1][-MATCH_WINDOW:], b[2][-MATCH_WINDOW:]
    if len(a_seq) < MIN_MATCH + 1 or len(b_seq) < MIN_MATCH + 1:
        return Match(None, "few-calls")
    codes: Dict[Key, int] = {}
    a_k = np.array([codes.setdefault(k, len(codes)) for k in a_keys], np.int64)
    b_k = np.array([codes.setdefault(k, len(codes)) for k in b_keys], np.int64)
    centre = int(a_seq[-1] - b_seq[-1])  # the newest calls of both are about the same collective
    lo = max(int(a_seq[0] - b_seq[-1]), centre - WINDOW - MATCH_WINDOW)
    hi = min(int(a_seq[-1] - b_seq[0]), centre + WINDOW + MATCH_WINDOW)
    offs = np.arange(lo, hi + 1, dtype=np.int64)
    want = b_seq[None, :] + offs[:, None]                    # [offset, call of b] -> seq of a it must be
    j = np.clip(np.searchsorted(a_seq, want), 0, len(a_seq) - 1)
    hit = a_seq[j] == want
    n = hit.sum(axis=1)
    agree = np.where(hit, a_k[j] == b_k[None, :], True).all(axis=1)
    tested = n >= MIN_MATCH
    good = np.flatnonzero(tested & agree)
    if not tested.any():
        return Match(None, "few-calls")
    if len(good) == 0:
        return Match(None, "no-match")
    dt = np.sort(np.where(hit[good], np.abs(a_t[j[good]] - b_t[None, :]), np.inf), axis=1)  # misses last
    rows, k = np.arange(len(good)), n[good]
    med = (dt[rows, (k - 1) // 2] + dt[rows, k // 2]) / 2
    i = int(np.argmin(med))
    best, best_dt = int(offs[good[i]]), float(med[i])
    rest = np.delete(med, i)
    next_dt = float(rest.min()) if len(rest) else None
    near = set(offs[tested].tolist())
    if (best - 1) not in near or (best + 1) not in near:
        return Match(None, "few-calls", int(n[good[i]]), best_dt, next_dt)  # its neighbours not tried yet
    if best_dt > MAX_SKEW_S or (next_dt is not None and next_dt < RATIO * max(best_dt, DT_FLOOR_S)):
        return Match(None, "ambiguous", int(n[good[i]]), best_dt, next_dt)
    return Match(best, "aligned", int(n[good[i]]), best_dt, next_dt)


def _rank(comm: Any) -> int:
    return next(iter(comm.members)) if len(comm.members) == 1 else -1


def _one_per_rank(tried: List[Tuple[Any, Optional[Match]]]) -> List[Tuple[Any, Match]]:
    """The matched streams, but none of a process two of whose streams matched (which is which?)."""
    found = [(c, m) for c, m in tried if m is not None]
    ranks = [_rank(c) for c, _ in found]
    return [(c, m) for c, m in found if ranks.count(_rank(c)) == 1]


class Aligner:
    """Per job: the waiting per-process streams, the aligned groups, and the rewrite of their events."""

    def __init__(self, tl: Any, make_comm: Callable[..., Any], max_comms: int):
        self.tl, self.make_comm, self.max_comms = tl, make_comm, max_comms
        self.rewrites: Dict[str, Tuple[str, int, int]] = {}  # per-process comm -> (aligned comm, offset, start)
        self.nodes: Set[str] = set()                         # nodes of aligned streams: only their frames are read
        self.waiting: Dict[str, Dict[str, str]] = {}         # job -> per-process comm -> why it waits
        self.groups: Dict[str, List[str]] = {}               # job -> its aligned comms
        self._due: Dict[str, float] = {}                     # job -> receive s of its next look
        self._ambiguous: Set[str] = set()                    # streams counted in anomalies once
        self._ref: Dict[str, str] = {}                       # aligned comm -> its reference stream
        self._ranks: Dict[str, Set[int]] = {}                # aligned comm -> ranks of its streams

    # ---- at ingest ---------------------------------------------------------------------------------

    def watch(self, comm: Any, rank: int) -> None:
        """A per-process communicator was announced (its CommInit, per_process): judged as a group of
        its own members, and waits to be aligned. Announced again (a handle reused by a new one): it
        leaves its group and starts over."""
        comm.members_only = True
        job = comm.id.split(HANDLE_MARK, 1)[0]
        was = self.rewrites.pop(comm.id, None)
        if was is not None:
            self.tl.anomalies["nccl-align-reset"] += 1
            if self._ref.get(was[0]) == comm.id:
                del self._ref[was[0]]  # its old calls no longer lead the group's stream
            aligned = self.tl.comms.get(was[0])
            self._ranks.get(was[0], set()).discard(rank)
            if aligned is not None and aligned.alignment is not None:
                aligned.drop_member(rank)
                al = aligned.alignment
                al["n_members"] -= 1
                al["members"] = [m for m in al["members"] if m["from"] != comm.id]
        self.waiting.setdefault(job, {})[comm.id] = "few-calls"

    def rewrite(self, plain: List[Any], blocks: List[Block]) -> Tuple[List[Any], List[Block]]:
        """A frame's events with those of aligned streams moved to their aligned communicator."""
        rw = self.rewrites
        if any(b.same.get("comm") in rw for b in blocks):  # a dict lookup per block
            blocks = [nb for b in blocks for nb in (self._block(b) if b.same.get("comm") in rw else (b,))]
        out = None
        for i, e in enumerate(plain):
            if e.KIND in _MOVED and e.comm in rw:
                name, off, start = rw[e.comm]
                if e.seq + off >= start:
                    out = out or list(plain)
                    out[i] = dataclasses.replace(e, comm=name, seq=e.seq + off)
        return out or plain, blocks

    def _block(self, b: Block) -> Tuple[Block, ...]:
        name, off, start = self.rewrites[b.same["comm"]]
        same = dict(b.same, comm=name)
        if "seq" in same:
            same["seq"] += off
            return (Block(b.kind, b.n, b.at, same, b.cols),) if same["seq"] >= start else (b,)
        moved = [s + off for s in b.cols["seq"]]
        go = [i for i, s in enumerate(moved) if s >= start]
        if len(go) == b.n:
            return (Block(b.kind, b.n, b.at, same, dict(b.cols, seq=moved)),)
        if not go:
            return (b,)
        stay = [i for i, s in enumerate(moved) if s < start]  # calls from before the alignment
        cols = {c: [v[i] for i in go] for c, v in b.cols.items()}
        cols["seq"] = [moved[i] for i in go]
        return (Block(b.kind, len(stay), b.at, b.same, {c: [v[i] for i in stay] for c, v in b.cols.items()}),
                Block(b.kind, len(go), b.at, same, cols))

    # ---- matching ----------------------------------------------------------------------------------

    def tick(self, now_s: float) -> None:
        """Look at the jobs whose turn it is (`now_s`: the timeline's forward-only receive seconds)."""
        for job in list(self.waiting):
            if now_s >= self._due.get(job, now_s):
                self._due[job] = now_s + EVERY_S
                self._look(job)

    def _look(self, job: str) -> None:
        comms, waiting = self.tl.comms, self.waiting[job]
        live = []
        for name in list(waiting):
            c = comms.get(name)
            if c is None or not c.members_only:
                del waiting[name]  # gone (bound) or rebuilt under the same name by a restart
            elif _rank(c) >= 0 and len(c.colls) > MIN_MATCH:
                live.append(c)
        if not waiting:
            del self.waiting[job]
        budget = [MAX_PAIRS]
        streams: Dict[str, Any] = {}

        def get(c: Any) -> Any:
            got = streams.get(c.id)
            if got is None:
                got = streams[c.id] = stream(c)
            return got

        for gname in self.groups.get(job, []):  # 1. streams joining an aligned communicator
            g = comms.get(gname)
            if g is None:
                continue
            a = self._group_stream(g)
            for c, m in _one_per_rank([(c, self._try(a, c, get, budget)) for c in live
                                       if _rank(c) not in self._ranks[gname]]):
                start = c.max_seq + 1 + m.offset  # from its next call on; a member once those fill g's
                self._join(g, c, m, start, member=start <= g.max_seq + 1)
                live.remove(c)
        live.sort(key=lambda c: (-c.max_seq, c.id))  # 2. the others: the stream seen longest is the reference
        while len(live) > 1 and budget[0] > 0:
            ref, live = live[0], live[1:]
            found = _one_per_rank([(c, self._try(get(ref), c, get, budget)) for c in live if _rank(c) != _rank(ref)])
            if found and self._group(job, ref, found):
                live = [c for c in live if c.id not in self.rewrites]

    def _try(self, a: Any, c: Any, get: Callable[[Any], Any], budget: List[int]) -> Optional[Match]:
        if budget[0] <= 0:
            return None
        budget[0] -= 1
        m = match(a, get(c))
        if m.offset is not None:
            return m
        waits = self.waiting.get(c.id.split(HANDLE_MARK, 1)[0], {})
        if c.id in waits and waits[c.id] != "ambiguous":  # the most telling reason stays while it waits
            waits[c.id] = m.reason
        if m.reason == "ambiguous" and c.id not in self._ambiguous:
            self._ambiguous.add(c.id)
            self.tl.anomalies["nccl-align-ambiguous"] += 1
        return None

    def _group(self, job: str, ref: Any, found: List[Tuple[Any, Match]]) -> bool:
        """A new aligned communicator of `ref` (whose seq it keeps) and the streams `found` on it, all
        from one start: the first seq no member has called yet, so each of its collectives gets every
        member's call."""
        name = ref.id.replace(HANDLE_MARK, "/nccl:aligned-", 1)
        if name in self.tl.comms or len(self.tl.comms) >= self.max_comms:
            self.tl.anomalies["nccl-align-no-room"] += 1
            return False
        g = self.tl.comms[name] = self.make_comm(id=name, backend="nccl", job=job, members_only=True)
        g.alignment = {"how": HOW, "matched_calls": 0, "n_members": 0, "members": []}
        self.groups.setdefault(job, []).append(name)
        self._ref[name], self._ranks[name] = ref.id, set()
        members: List[Tuple[Any, Optional[Match]]] = [(ref, None), *found]
        start = max(c.max_seq + 1 + (0 if m is None else m.offset) for c, m in members)
        for c, m in members:
            self._join(g, c, m, start, member=True)
        return True

    def _group_stream(self, g: Any) -> Stream:
        """An aligned communicator's calls: its reference's from before the alignment (same seq), then its own."""
        own = stream(g)
        ref = self.tl.comms.get(self._ref.get(g.id, ""))
        if ref is None:
            return own
        pre = stream(ref)
        return (np.concatenate((pre[0], own[0]))[-WINDOW:], (pre[1] + own[1])[-WINDOW:],
                np.concatenate((pre[2], own[2]))[-WINDOW:])

    def _join(self, g: Any, c: Any, m: Optional[Match], start: int, member: bool) -> None:
        """Stream c's calls from aligned seq `start` on go to aligned communicator g (m: how it matched;
        None for the reference). `member`: expected in g's collectives from now (else from its first)."""
        off, r = (0 if m is None or m.offset is None else m.offset), _rank(c)
        self.rewrites[c.id] = (g.id, off, start)
        self._ranks[g.id].add(r)
        self.waiting.get(g.job, {}).pop(c.id, None)
        if member:
            g.members.add(r)
        g.pids[r] = c.pids[r]
        self.nodes.add(c.pids[r][0])
        al = g.alignment
        al["n_members"] += 1
        if m is not None:
            al["matched_calls"] = min(al["matched_calls"] or m.matched, m.matched)
        if len(al["members"]) < EVIDENCE_MEMBERS:
            one = {"rank": r, "from": c.id, "seq_offset": off, "from_seq": start}
            if m is not None:
                one.update(matched_calls=m.matched, median_dt_s=round(m.dt_s, 6),
                           next_best_dt_s=None if m.next_dt_s is None else round(m.next_dt_s, 6))
            al["members"].append(one)

    def counters(self) -> Dict[str, Any]:
        """Aligned communicators and streams, and the waiting streams by why they wait."""
        waits = collections.Counter(why for names in self.waiting.values() for why in names.values())
        return {"aligned_comms": sum(map(len, self.groups.values())), "aligned_streams": len(self.rewrites),
                "waiting": dict(waits)}
