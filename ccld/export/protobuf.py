"""Perfetto protobuf output: TracePackets of TrackEvents, written to a binary file as they come.

ProtoSink is the sink a model.TraceModel writes through (chrome.ChromeSink is the other). Hot packets
(collective slices) are encoded by hand from cached pieces, with interned names and argument keys;
rare ones (track descriptors, the clock snapshot) with the perfetto package's shipped
perfetto_trace_pb2. Field numbers are Perfetto's (trace_packet.proto, track_event.proto,
debug_annotation.proto, interned_data.proto, counter_descriptor.proto).
The hottest path is group() once per collective and rank() once per rank of it: a rank's calls and
worker slices (4 packets) go into the buffer as ~25 ready pieces (per-track heads, per-collective
arguments, packet heads by event length, varint tables), joined once per FLUSH_PARTS pieces.
Times: Unix ns; the first timed packet is preceded by a clock snapshot REALTIME = BOOTTIME so the
viewer can show wall-clock times. Caveat: one packet sequence (SEQ_ID) carries everything, so
interning is per trace; an unbounded number of distinct names would grow the intern tables (names
here are ops, communicators, track kinds, findings and GPU kernels: a few thousand at most).
"""
from __future__ import annotations

import json
import struct
from typing import Any, Dict, List, Optional

from ccld.export import accel
from ccld.export.tracks import Track, comm_args


def _uv(n: int) -> bytes:
    """Protobuf varint (negative ints as 64-bit two's complement, like int64), from tables of the
    1- and 2-byte ones: 14 bits at a time."""
    if n < _SMALL_N:
        if n >= 0:
            return _SMALL[n]
        n += 1 << 64
    if n < (1 << 28):
        return _LOW14[n & 0x3FFF] + _SMALL[n >> 14]
    if n >= (1 << 64):
        raise OverflowError(f"{n} does not fit in 64 bits")  # a longer varint would make the trace unreadable
    return _LOW14[n & 0x3FFF] + _LOW14[(n >> 14) & 0x3FFF] + _uv(n >> 28)


_SMALL_N = 1 << 14  # every 1- and 2-byte varint, precomputed (lengths, iids, small seqs)
_SMALL = [bytes((i,)) for i in range(0x80)] + [bytes(((i & 0x7F) | 0x80, i >> 7)) for i in range(0x80, _SMALL_N)]
_LOW14 = [bytes(((i & 0x7F) | 0x80, (i >> 7) | 0x80)) for i in range(1 << 14)]  # 14 bits, more to follow
_TS_TAILS: Dict[int, bytes] = {}
_TS_TAILS_MAX = 1 << 16
_TAIL9: Dict[int, bytes] = {}  # n >> 28 -> its 5-byte varint, for n in 2^56..2^63 (9-byte timestamps: Unix ns)


def _tail9(n: int) -> None:
    """Remember the high part of timestamp n when its varint is 9 bytes (ProtoSink.rank's fast path)."""
    if (1 << 56) <= n < (1 << 63):
        if len(_TAIL9) >= _TS_TAILS_MAX:
            _TAIL9.clear()
        _TAIL9[n >> 28] = _uv(n >> 28)


def _ts(n: int) -> bytes:
    """Varint of a timestamp (>= 2^28): two table lookups for the low 28 bits, and the rest, which
    changes every 268 ms of Unix ns, from a cache."""
    if n < (1 << 28) or n >= (1 << 63):
        if n < 0 or n >= (1 << 63):
            raise OverflowError(f"timestamp {n} ns is outside 0..2^63")
        return _uv(n)
    h = n >> 28
    tail = _TS_TAILS.get(h)
    if tail is None:
        if len(_TS_TAILS) >= _TS_TAILS_MAX:
            _TS_TAILS.clear()
        tail = _TS_TAILS[h] = _uv(h)
    return _LOW14[n & 0x3FFF] + _LOW14[(n >> 14) & 0x3FFF] + tail


def _ld(tag: bytes, body: bytes) -> bytes:
    return tag + _uv(len(body)) + body


SEQ_ID = 1
_SEQ_TAIL = b"\x50\x01\x68\x02"   # trusted_packet_sequence_id=1, sequence_flags=SEQ_NEEDS_INCREMENTAL_STATE
_FLOW = {"s": b"\xf9\x02", "t": b"\xf9\x02", "f": b"\x81\x03"}  # flow_ids=47 / terminating_flow_ids=48 (fixed64)
_Q = struct.Struct("<Q").pack
_D = struct.Struct("<d").pack
# Debug-annotation names interned by the first packet; iids 1..13 are hard-coded in ProtoSink.coll, .comm.
_FIXED_KEYS = ("op", "seq", "comm", "count", "dtype", "nbytes", "ok", "error", "unfinished", "ranks", "first_rank",
               "last_rank", "arrival_spread_us")
_ANN_RANKS, _ANN_FIRST, _ANN_LAST, _ANN_SPREAD = b"\x08\x0a\x20", b"\x08\x0b\x20", b"\x08\x0c\x20", b"\x08\x0d\x20"
_ANN_SEQ = b"\x08\x02\x20"        # name_iid=2 (seq), int_value follows
_ANN_COUNT = b"\x08\x04\x20"
_ANN_NBYTES = b"\x08\x06\x20"
_ANN_DTYPE = b"\x08\x05\x88\x01"  # name_iid=5 (dtype), string_value_iid follows
_ANN_UNFINISHED = b"\x22\x04\x08\x09\x10\x01"
_OK_T, _OK_F = b"\x22\x04\x08\x07\x10\x01", b"\x22\x04\x08\x07\x10\x00"  # ok (name_iid 7) = true / false
FLUSH_PARTS = 65_536    # pieces of packets buffered before they are joined and written (~0.5 MiB)
ANN_CACHE_MAX = 10_000  # encoded (key, string) args kept
SEQ_CACHE_MAX = 4096    # encoded seq args kept (each is used by every rank of its collective, twice)
_MAX_PRE = 4000         # longest cached event prefix; _HEAD/_MID cover the event lengths this allows
# For a BEGIN packet whose track event is lt bytes and whose timestamp is 9 bytes (Unix ns, 2^56..2^63):
# _HEAD[lt] = Trace.packet tag, packet length, timestamp tag; _MID[lt] = track_event tag and length.
_HEAD = [b"\x0a" + _uv(1 + 9 + 1 + len(_uv(lt)) + lt + len(_SEQ_TAIL)) + b"\x40" for lt in range(_MAX_PRE + 64)]
_MID = [b"\x5a" + _uv(lt) for lt in range(_MAX_PRE + 64)]


class ProtoSink:
    """Writes TracePackets to a binary file. Hot packets (slices) are encoded by hand from cached
    pieces, with interned names and arg keys; rare ones (track descriptors, the clock snapshot)
    with the shipped perfetto_trace_pb2. Field numbers are perfetto's (trace_packet.proto,
    track_event.proto, debug_annotation.proto, interned_data.proto)."""

    def __init__(self, f):
        from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb
        self.pb = pb
        self.f = f
        self.buf: List[bytes] = []
        self.bytes = 0
        self.names: Dict[str, int] = {}
        self.strs: Dict[str, int] = {}
        self.coll_pre: Dict[tuple, bytes] = {}
        self.ann_cache: Dict[tuple, bytes] = {}
        self.size_anns: Dict[tuple, bytes] = {}
        self.group_pre: Dict[tuple, tuple] = {}  # (op, comm, count, dtype, nbytes) -> pieces (see group())
        self.seq_anns: Dict[int, bytes] = {}
        self.g: tuple = ()  # the collective rank() writes and its encoded pieces (set by group())
        self.gp: tuple = ()
        self.started = False
        # First packet of the sequence: clears incremental state and interns the usual arg names.
        body = b"".join(_ld(b"\x1a", b"\x08" + _uv(i + 1) + _ld(b"\x12", k.encode()))
                        for i, k in enumerate(_FIXED_KEYS))
        self.keys = {k: i + 1 for i, k in enumerate(_FIXED_KEYS)}
        self._packet(_ld(b"\x62", body) + b"\x50\x01\x68\x01")

    def _packet(self, pkt: bytes) -> None:
        self.buf.append(b"\x0a" + _uv(len(pkt)) + pkt)
        if len(self.buf) >= FLUSH_PARTS:
            self.flush()

    def flush(self) -> None:
        if self.buf:
            data = b"".join(self.buf)
            self.f.write(data)
            self.bytes += len(data)
            self.buf = []

    def _intern(self, table: Dict[str, int], field: bytes, s: str) -> int:
        iid = table.get(s)
        if iid is None:
            iid = table[s] = len(table) + 1
            value = s.encode("utf-8", "replace")
            self._packet(_ld(b"\x62", _ld(field, b"\x08" + _uv(iid) + _ld(b"\x12", value))) + _SEQ_TAIL)
        return iid

    def _name(self, s: str) -> int:
        return self._intern(self.names, b"\x12", s)      # InternedData.event_names = 2

    def _key(self, s: str) -> int:
        return self._intern(self.keys, b"\x1a", s)       # InternedData.debug_annotation_names = 3

    def _str(self, s: str) -> int:
        if type(s) is not str:
            raise TypeError("string expected")
        return self._intern(self.strs, b"\xea\x01", s)   # InternedData.debug_annotation_string_values = 29

    def _ann(self, key: str, v: Any) -> bytes:
        """One debug annotation; (key, string) pairs are cached (comm names, states repeat)."""
        c = v.__class__
        if c is str or c is bool:
            got = self.ann_cache.get((key, v))
            if got is not None:
                return got
        head = b"\x08" + _uv(self._key(key))
        if c is int:
            x = head + b"\x20" + _uv(v)
            return b"\x22" + _SMALL[len(x)] + x
        if c is bool:
            body = head + (b"\x10\x01" if v else b"\x10\x00")
        elif c is float:
            body = head + b"\x29" + _D(v)
        else:
            s = v if c is str else json.dumps(v, default=str)
            body = head + _ld(b"\x32", s.encode("utf-8", "replace"))
        got = _ld(b"\x22", body)
        if (c is str or c is bool) and len(self.ann_cache) < ANN_CACHE_MAX:
            self.ann_cache[(key, v)] = got
        return got

    def _anns(self, args: list) -> bytes:
        return b"".join([self._ann(k, v) for k, v in args])

    def start(self, ts: int) -> None:
        """The clock relation, before the first timed packet: REALTIME = BOOTTIME (Unix ns)."""
        pkt = self.pb.TracePacket()
        pkt.timestamp = ts
        for cid in (self.pb.BUILTIN_CLOCK_REALTIME, self.pb.BUILTIN_CLOCK_BOOTTIME):
            c = pkt.clock_snapshot.clocks.add()
            c.clock_id, c.timestamp = cid, ts
        pkt.trusted_packet_sequence_id = SEQ_ID
        self._packet(pkt.SerializeToString())
        self.started = True

    def declare(self, t: Track) -> None:
        pkt = self.pb.TracePacket()
        d = pkt.track_descriptor
        d.uuid = t.uuid
        if t.parent is not None:
            d.parent_uuid = t.parent.uuid
        if t.kind == "process":
            d.process.pid = t.pid
            d.process.process_name = t.name
        elif t.kind == "thread":
            d.thread.pid, d.thread.tid, d.thread.thread_name = t.pid, t.tid, t.name
        else:
            d.name = t.name
        if t.kind == "counter":
            d.counter.SetInParent()
            if t.unit:
                d.counter.unit_name = t.unit
        if t.child_order:
            d.child_ordering = t.child_order
        if t.order is not None:
            d.sibling_order_rank = t.order
        if t.description:
            d.description = t.description
        pkt.trusted_packet_sequence_id = SEQ_ID
        self._packet(pkt.SerializeToString())
        # cached pieces of this track's events: its uuid field; its whole END event + packet tail; the END
        # packet's head (Trace.packet tag, length, timestamp tag), alone and after a BEGIN's tail; the
        # BEGIN event's type and track, and its length
        end = _ld(b"\x5a", b"\x48\x02\x58" + _uv(t.uuid)) + _SEQ_TAIL
        head = b"\x0a" + _SMALL[10 + len(end)] + b"\x40"
        begin = b"\x48\x01\x58" + _uv(t.uuid)  # type SLICE_BEGIN, track_uuid
        t.out = (b"\x58" + _uv(t.uuid), end, head, _SEQ_TAIL + head, begin, len(begin))

    def _pair(self, t: Track, b: int, e: int, te: bytes) -> None:
        """A BEGIN packet with track event `te` at b and the matching END at e, as one write."""
        if not self.started:
            self.start(b)
        bt, et, lt = _ts(b), _ts(e), len(te)
        out = t.out
        head = _SMALL[1 + len(bt) + 1 + (1 if lt < 0x80 else 2) + lt + 4] if lt < 0x3F00 else None
        if head is None or len(et) != 9:  # the general case (not Unix-epoch ns, or a huge event)
            pkt = b"\x40" + bt + b"\x5a" + _uv(lt) + te + _SEQ_TAIL
            end = b"\x40" + et + out[1]
            self.buf.append(b"\x0a" + _uv(len(pkt)) + pkt + b"\x0a" + _uv(len(end)) + end)
        else:
            self.buf.append(b"".join((b"\x0a", head, b"\x40", bt, b"\x5a", _SMALL[lt], te, _SEQ_TAIL,
                                      out[2], et, out[1])))
        if len(self.buf) >= FLUSH_PARTS:
            self.flush()

    def coll(self, t: Track, b: int, e: int, op: str, seq: int, comm: str, count: int, dtype: str,
             nbytes: int, ok: Any, error: Any, unfinished: bool, fid: int, role: Any, kfid: int = 0) -> None:
        """A rank's collective slice; fid/role: its place in the flow across ranks (s, t, f);
        kfid: the flow to the GPU kernel that ran it (0: none)."""
        key = (t.uuid, op, comm, ok is True)
        te = self.coll_pre.get(key)
        if te is None:  # type BEGIN, track, name, and the args that repeat: op, comm, ok
            te = self.coll_pre[key] = (
                b"\x48\x01" + t.out[0] + b"\x50" + _uv(self._name(op)) +
                _ld(b"\x22", b"\x08\x01\x88\x01" + _uv(self._str(op))) +
                _ld(b"\x22", b"\x08\x03\x88\x01" + _uv(self._str(comm))) +
                (b"\x22\x04\x08\x07\x10\x01" if ok is True else b"\x22\x04\x08\x07\x10\x00"))
        x = _uv(seq)
        te += b"\x22" + _SMALL[3 + len(x)] + _ANN_SEQ + x
        te += self._size_anns(count, dtype, nbytes)
        if error:
            te += self._ann("error", error)
        if unfinished:
            te += _ANN_UNFINISHED
        if role:
            te += _FLOW[role] + _Q(fid)
        if kfid:
            te += b"\xf9\x02" + _Q(kfid)
        self._pair(t, b, e, te)

    def group(self, op: str, seq: int, comm: str, count: int, dtype: str, nbytes: int, fid: int) -> None:
        """The collective (and its arguments) whose ranks rank() writes next: its shared pieces,
        encoded once for all its ranks. Raises like coll() on values it cannot encode; self.g is then
        empty, so comm() does not take the previous collective's pieces for this one's."""
        self.g = ()
        key = (op, comm, count, dtype, nbytes)
        got = self.group_pre.get(key)
        if got is None:
            name = b"\x50" + _uv(self._name(op))
            comm_ann = _ld(b"\x22", b"\x08\x03\x88\x01" + _uv(self._str(comm)))
            got = (name + _ld(b"\x22", b"\x08\x01\x88\x01" + _uv(self._str(op))) + comm_ann,
                   self._size_anns(count, dtype, nbytes), name + comm_ann)
            if len(got[0]) + len(got[1]) + len(got[2]) > _MAX_PRE:
                raise ValueError("arguments too long")  # not from a well-formed store: counted as bad events
            if len(self.group_pre) >= ANN_CACHE_MAX:
                self.group_pre.clear()
            self.group_pre[key] = got
        sq = self.seq_anns.get(seq)
        if sq is None:
            sq = self._seq_ann(seq)
        c2, w = sq + got[1], got[2] + sq
        fq = _Q(fid) if fid else b""
        # the calls event's args with ok true and with ok false, their length (6: the ok annotation), the
        # worker event's name and args and their length, the flow fields by role
        self.gp = (got[0] + _OK_T + c2, got[0] + _OK_F + c2, len(got[0]) + 6 + len(c2), w, len(w),
                   {0: b"", "s": _FLOW["s"] + fq, "t": _FLOW["t"] + fq, "f": _FLOW["f"] + fq})
        self.g = (op, seq, comm, count, dtype, nbytes, fid)

    def rank(self, tc: Track, tw: Optional[Track], b: int, s: int, e: int, ok: Any, error: Any,
             unfinished: bool, role: Any, kfid: int) -> None:
        """One rank's part of the collective group() named: its `calls` slice b..e on tc (as coll())
        and, when tw is not None, its `worker` slice s..e on tw (as work()), as one write. The hot
        path of the export: every piece but the timestamps' low 28 bits comes from a cache (per track,
        per collective, per 268 ms of time: _TAIL9), and the 2-4 packets are joined once."""
        T = _TAIL9
        try:
            tb, te_ = T[b >> 28], T[e >> 28]
            ts_ = T[s >> 28] if tw is not None else tb
        except KeyError:
            tb = None
        if tb is None or error or unfinished or not self.started:
            op, seq, comm, count, dtype, nbytes, fid = self.g
            self.coll(tc, b, e, op, seq, comm, count, dtype, nbytes, ok, error, unfinished, fid, role, kfid)
            if tw is not None:
                self.work(tw, s, e, op, seq, comm, unfinished)
            for x in (b, s, e):
                _tail9(x)
            return
        c_ok, c_bad, clen, w, wlen, flows = self.gp
        L = _LOW14
        e1, e2 = L[e & 0x3FFF], L[(e >> 14) & 0x3FFF]
        fl = flows[role]
        if kfid:
            fl += b"\xf9\x02" + _Q(kfid)
        oc = tc.out
        lt = oc[5] + clen + len(fl)
        buf = self.buf
        buf += (_HEAD[lt], L[b & 0x3FFF], L[(b >> 14) & 0x3FFF], tb, _MID[lt], oc[4], c_ok if ok is True else c_bad,
                fl, oc[3], e1, e2, te_, oc[1])
        if tw is not None:
            ow = tw.out
            lt = ow[5] + wlen
            buf += (_HEAD[lt], L[s & 0x3FFF], L[(s >> 14) & 0x3FFF], ts_, _MID[lt], ow[4], w, ow[3], e1, e2, te_,
                    ow[1])
        if len(buf) >= FLUSH_PARTS:
            self.flush()

    def _seq_ann(self, seq: int) -> bytes:
        x = _uv(seq)
        got = b"\x22" + _SMALL[3 + len(x)] + _ANN_SEQ + x
        if len(self.seq_anns) >= SEQ_CACHE_MAX:
            self.seq_anns.clear()
        self.seq_anns[seq] = got
        return got

    def _size_anns(self, count: int, dtype: str, nbytes: int) -> bytes:
        size = self.size_anns.get((count, dtype, nbytes))
        if size is None:  # count, dtype, nbytes: a job repeats a few combinations (its buckets)
            size = b""
            if count.__class__ is int and count >= 0:
                x = _uv(count)
                size += b"\x22" + _SMALL[3 + len(x)] + _ANN_COUNT + x
            if dtype:
                x = _uv(self._str(dtype))
                size += b"\x22" + _SMALL[4 + len(x)] + _ANN_DTYPE + x
            if nbytes.__class__ is int and nbytes >= 0:
                x = _uv(nbytes)
                size += b"\x22" + _SMALL[3 + len(x)] + _ANN_NBYTES + x
            if len(self.size_anns) < ANN_CACHE_MAX:
                self.size_anns[(count, dtype, nbytes)] = size
        return size

    def work(self, t: Track, b: int, e: int, op: str, seq: int, comm: str, unfinished: bool) -> None:
        """A worker slice: the collective as the library ran it (args seq, comm)."""
        key = (t.uuid, op, comm, None)
        te = self.coll_pre.get(key)
        if te is None:
            te = self.coll_pre[key] = (b"\x48\x01" + t.out[0] + b"\x50" + _uv(self._name(op)) +
                                       _ld(b"\x22", b"\x08\x03\x88\x01" + _uv(self._str(comm))))
        x = _uv(seq)
        te += b"\x22" + _SMALL[3 + len(x)] + _ANN_SEQ + x
        if unfinished:
            te += _ANN_UNFINISHED
        self._pair(t, b, e, te)

    def slice(self, t: Track, b: int, e: int, name: str, args: list, instant_at_begin: str = "") -> None:
        te = b"\x48\x01" + t.out[0] + b"\x50" + _uv(self._name(name)) + self._anns(args)
        if instant_at_begin:
            bt, et = _ts(b), _ts(e)  # both first: a bad time must not leave a BEGIN without its END
            if not self.started:
                self.start(b)
            self._packet(b"\x40" + bt + _ld(b"\x5a", te) + _SEQ_TAIL)
            self.instant(t, b, instant_at_begin, args[:1])
            self._packet(b"\x40" + et + t.out[1])
        else:
            self._pair(t, b, e, te)

    def comm(self, t: Track, b: int, e: int, op: str, seq: int, comm: str, ranks: int, first_rank: int,
             last_rank: int, spread_us: int, partial: bool, unfinished: int) -> None:
        """A collective on its communicator's track: first rank's enter to the last end (args seq, comm,
        ranks, first_rank, last_rank, arrival_spread_us; partial and unfinished when so)."""
        if partial or unfinished or self.g[:3] != (op, seq, comm) or not self.started:
            self.slice(t, b, e, op, comm_args(seq, comm, ranks, first_rank, last_rank, spread_us, partial,
                                              unfinished))
            return
        w = self.gp[3]  # name, comm and seq, as a worker slice has them
        hot = accel.hot
        if hot is not None and hot.comm(self, t.out, w, b, e, ranks, first_rank, last_rank, spread_us):
            return
        x1, x2, x3, x4 = _uv(ranks), _uv(first_rank), _uv(last_rank), _uv(spread_us)
        self._pair(t, b, e, b"".join((b"\x48\x01", t.out[0], w,
                                      b"\x22", _SMALL[3 + len(x1)], _ANN_RANKS, x1,
                                      b"\x22", _SMALL[3 + len(x2)], _ANN_FIRST, x2,
                                      b"\x22", _SMALL[3 + len(x3)], _ANN_LAST, x3,
                                      b"\x22", _SMALL[3 + len(x4)], _ANN_SPREAD, x4)))

    def gpu(self, t: Track, b: int, e: int, name: str, args: list, fids: List[int]) -> None:
        """A kernel or memcpy/memset on a stream track; fids: the flows from its collectives it ends."""
        te = b"\x48\x01" + t.out[0] + b"\x50" + _uv(self._name(name)) + self._anns(args)
        for fid in fids:
            te += b"\x81\x03" + _Q(fid)  # terminating_flow_ids = 48 (fixed64)
        self._pair(t, b, e, te)

    def instant(self, t: Track, ts: int, name: str, args: list) -> None:
        if not self.started:
            self.start(ts)
        te = b"\x48\x03" + t.out[0] + b"\x50" + _uv(self._name(name)) + self._anns(args)
        self._packet(b"\x40" + _ts(ts) + _ld(b"\x5a", te) + _SEQ_TAIL)

    def counter(self, t: Track, ts: int, value: Any) -> None:
        if not self.started:
            self.start(ts)
        v = b"\xf0\x01" + _uv(value) if type(value) is int else b"\xe1\x02" + _D(float(value))
        self._packet(b"\x40" + _ts(ts) + _ld(b"\x5a", b"\x48\x04" + t.out[0] + v) + _SEQ_TAIL)

    def finish(self, meta: Dict[str, Any]) -> int:
        self.flush()
        return self.bytes
