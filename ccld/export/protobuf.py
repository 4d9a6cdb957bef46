"""Perfetto protobuf output: TracePackets of TrackEvents, written to a binary file as they come.

ProtoSink is the sink a model.TraceModel writes through (chrome.ChromeSink is the other). Hot packets
(collective slices) are encoded by hand from cached pieces, with interned names and argument keys;
rare ones (track descriptors, the clock snapshot) with the perfetto package's shipped
perfetto_trace_pb2. Field numbers are Perfetto's (trace_packet.proto, track_event.proto,
debug_annotation.proto, interned_data.proto, counter_descriptor.proto).
Times: Unix ns; the first timed packet is preceded by a clock snapshot REALTIME = BOOTTIME so the
viewer can show wall-clock times. Caveat: one packet sequence (SEQ_ID) carries everything, so
interning is per trace; an unbounded number of distinct names would grow the intern tables (names
here are ops, communicators, track kinds and findings: a few thousand at most).
"""
from __future__ import annotations

import json
import struct
from typing import Any, Dict, List

from ccld.export.tracks import Track


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
# Debug-annotation names interned by the first packet; iids 1..9 are hard-coded in ProtoSink.coll.
_FIXED_KEYS = ("op", "seq", "comm", "count", "dtype", "nbytes", "ok", "error", "unfinished")
_ANN_SEQ = b"\x08\x02\x20"        # name_iid=2 (seq), int_value follows
_ANN_COUNT = b"\x08\x04\x20"
_ANN_NBYTES = b"\x08\x06\x20"
_ANN_DTYPE = b"\x08\x05\x88\x01"  # name_iid=5 (dtype), string_value_iid follows
_ANN_UNFINISHED = b"\x22\x04\x08\x09\x10\x01"
FLUSH_PACKETS = 8192    # packets joined per write (~0.5 MiB)
ANN_CACHE_MAX = 10_000  # encoded (key, string) args kept


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
        self.started = False
        # First packet of the sequence: clears incremental state and interns the usual arg names.
        body = b"".join(_ld(b"\x1a", b"\x08" + _uv(i + 1) + _ld(b"\x12", k.encode()))
                        for i, k in enumerate(_FIXED_KEYS))
        self.keys = {k: i + 1 for i, k in enumerate(_FIXED_KEYS)}
        self._packet(_ld(b"\x62", body) + b"\x50\x01\x68\x01")

    def _packet(self, pkt: bytes) -> None:
        self.buf.append(b"\x0a" + _uv(len(pkt)) + pkt)
        if len(self.buf) >= FLUSH_PACKETS:
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
        # cached pieces of this track's events: its uuid field, and its whole END event + packet tail
        end = _ld(b"\x5a", b"\x48\x02\x58" + _uv(t.uuid)) + _SEQ_TAIL
        t.out = (b"\x58" + _uv(t.uuid), end, b"\x0a" + _SMALL[10 + len(end)] + b"\x40")

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
        if len(self.buf) >= FLUSH_PACKETS:
            self.flush()

    def coll(self, t: Track, b: int, e: int, op: str, seq: int, comm: str, count: int, dtype: str,
             nbytes: int, ok: Any, error: Any, unfinished: bool, fid: int, role: Any) -> None:
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
        te += size
        if error:
            te += self._ann("error", error)
        if unfinished:
            te += _ANN_UNFINISHED
        if role:
            te += _FLOW[role] + _Q(fid)
        self._pair(t, b, e, te)

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
