"""Export a store as a Chrome JSON trace (`ccld export --format json`), streamed like the Perfetto one.

The same TraceModel (ccld.export.model) drives both, so the content is the same: a process per
traced rank (pid), a thread per track (`calls`, `worker`, `p2p`, `state`, `findings`, `GPU d stream s`,
and their overlap lanes), pseudo-processes `communicators` and `ccld`; complete slices (ph X), instants (i),
counters (C: a rank's `link S->D MiB/s`, `RTT ms`, `retrans`, `runqueue wait %` and NCCL's
`nccl:H R->P MiB/s`, `steps in flight`, `net wait %`, named so in its process; the agents' losses
in `ccld`), flows (s, t, f) joining one collective across ranks, and
flows (s, f; name "kernel") from a rank's collective to the NCCL kernel that ran it.
Times: "ts"/"dur" are microseconds with three decimals (ns precision), in the collector's Unix
timebase (see model.TIMEBASE; also written under "otherData").
Caveat: Chrome's format has no track hierarchy: child tracks become threads of their group's process.
"""
from __future__ import annotations

import json
from typing import Any, Callable, Dict, Iterable, List, Optional

from ccld.export.perfetto import run_export
from ccld.export.tracks import Track, comm_args

_BP = ',"bp":"e"'  # a terminating flow event binds to the slice that encloses it
PSEUDO_PID = 1 << 30  # pids for the `communicators` and `ccld` groups, above any real or shifted pid
FLUSH_BYTES = 1 << 20  # output is written in ~1 MiB pieces


def _us(ns: int) -> str:
    """Exact microseconds with ns decimals (a float would round Unix-epoch ns to 0.25 us)."""
    if ns < 0:
        raise ValueError(f"time {ns} ns is negative")  # as in the Perfetto writer: counted, not written
    return f"{ns // 1000}.{ns % 1000:03d}"


class ChromeSink:
    def __init__(self, f):
        self.f = f
        self.buf: List[str] = []
        self.buffered = 0
        self.any = False
        self.bytes = 0
        self.esc: Dict[str, str] = {}
        self.next_pseudo = PSEUDO_PID
        self.next_tid: Dict[int, int] = {}
        self.g: tuple = ()  # the collective rank() writes, and its events' shared JSON (set by group())
        self.gj: tuple = ()
        self._write('{"traceEvents":[\n')

    def _write(self, s: str) -> None:
        data = s.encode("utf-8")
        self.f.write(data)
        self.bytes += len(data)

    def _ev(self, s: str) -> None:
        self.buf.append(s)
        self.buffered += len(s)
        if self.buffered >= FLUSH_BYTES:
            self.flush()

    def flush(self) -> None:
        if self.buf:
            self._write((",\n" if self.any else "") + ",\n".join(self.buf))
            self.any = True
            self.buf, self.buffered = [], 0

    def _s(self, s: Any) -> str:
        """A JSON string literal, cached (op, comm and dtype names repeat)."""
        if type(s) is not str:
            return json.dumps(str(s))
        got = self.esc.get(s)
        if got is None:
            got = json.dumps(s)
            if len(self.esc) < 100_000:
                self.esc[s] = got
        return got

    def _meta(self, pid: int, tid: Optional[int], what: str, args: Dict[str, Any]) -> None:
        t = f',"tid":{tid}' if tid is not None else ""
        self._ev(f'{{"ph":"M","name":"{what}","pid":{pid}{t},"args":{json.dumps(args)}}}')

    def start(self, ts: int) -> None:
        pass

    def declare(self, t: Track) -> None:
        root = t
        while root.parent is not None:
            root = root.parent
        if t is root:
            pid = t.pid if t.kind == "process" else self.next_pseudo
            if t.kind != "process":
                self.next_pseudo += 1
            self._meta(pid, None, "process_name", {"name": t.name})
            if t.order is not None:
                self._meta(pid, None, "process_sort_index", {"sort_index": t.order})
            t.out = (pid, 0)
            return
        pid = root.out[0]
        if t.kind == "counter":
            t.out = (pid, 0, self._s(t.name))
            return
        tid = self.next_tid.get(pid, 1)
        self.next_tid[pid] = tid + 1
        self._meta(pid, tid, "thread_name", {"name": t.name})
        if t.order is not None:
            self._meta(pid, tid, "thread_sort_index", {"sort_index": t.order})
        t.out = (pid, tid, f'"pid":{pid},"tid":{tid}')

    def coll(self, t: Track, b: int, e: int, op: str, seq: int, comm: str, count: int, dtype: str,
             nbytes: int, ok: Any, error: Any, unfinished: bool, fid: int, role: Any, kfid: int = 0) -> None:
        where, ts = t.out[2], _us(b)
        if role:
            bp = ',"bp":"e"' if role == "f" else ""
            self._ev(f'{{"ph":"{role}","id":{int(fid)},"cat":"flow","name":"collective",{where},"ts":{ts}{bp}}}')
        if kfid:
            self._ev(f'{{"ph":"s","id":{int(kfid)},"cat":"flow","name":"kernel",{where},"ts":{ts}}}')
        args = self._coll_args(op, seq, comm, count, dtype, nbytes)
        args += ',"ok":true' if ok is True else ',"ok":false'
        if error:
            args += f',"error":{self._s(error)}'
        if unfinished:
            args += ',"unfinished":true'
        self._ev(f'{{"ph":"X","cat":"collective","name":{self._s(op)},{where},"ts":{ts},"dur":{_us(e - b)},'
                 f'"args":{{{args}}}}}')

    def _coll_args(self, op: str, seq: int, comm: str, count: int, dtype: str, nbytes: int) -> str:
        """A collective slice's JSON args (without ok/error): sizes only where the probe knew them."""
        args = f'"op":{self._s(op)},"seq":{int(seq)},"comm":{self._s(comm)}'
        if type(count) is int and count >= 0:
            args += f',"count":{count}'
        if dtype:
            args += f',"dtype":{self._s(dtype)}'
        if type(nbytes) is int and nbytes >= 0:
            args += f',"nbytes":{nbytes}'
        return args

    def group(self, op: str, seq: int, comm: str, count: int, dtype: str, nbytes: int, fid: int) -> None:
        """The collective whose ranks rank() writes next (as protobuf.ProtoSink.group): the JSON that
        all its ranks' events share, made once."""
        self.g = (op, seq, comm, count, dtype, nbytes, fid)
        name, seq = self._s(op), int(seq)
        args = self._coll_args(op, seq, comm, count, dtype, nbytes)
        fid = int(fid)
        self.gj = (f'{{"ph":"X","cat":"collective","name":{name},', f'"args":{{{args},"ok":true}}',
                   f'"args":{{{args},"ok":false}}', f'{{"ph":"X","cat":"worker","name":{name},',
                   f'"args":{{"seq":{seq},"comm":{self._s(comm)}}}',
                   {r: f'{{"ph":"{r}","id":{fid},"cat":"flow","name":"collective",' for r in ("s", "t", "f")})

    def rank(self, tc: Track, tw: Optional[Track], b: int, s: int, e: int, ok: Any, error: Any,
             unfinished: bool, role: Any, kfid: int) -> None:
        """A rank's `calls` slice and, when tw is given, its `worker` slice (as protobuf.ProtoSink.rank)."""
        if error or unfinished or b < 0 or s < 0 or e < b:
            op, seq, comm, count, dtype, nbytes, fid = self.g
            self.coll(tc, b, e, op, seq, comm, count, dtype, nbytes, ok, error, unfinished, fid, role, kfid)
            if tw is not None:
                self.work(tw, s, e, op, seq, comm, unfinished)
            return
        x_c, ok_args, bad_args, x_w, w_args, flows = self.gj
        where = tc.out[2]
        ts = f"{b // 1000}.{b % 1000:03d}"
        d = e - b
        buf = self.buf
        n = len(buf)
        if role:
            buf.append(f'{flows[role]}{where},"ts":{ts}{_BP if role == "f" else ""}}}')
        if kfid:
            buf.append(f'{{"ph":"s","id":{int(kfid)},"cat":"flow","name":"kernel",{where},"ts":{ts}}}')
        buf.append(f'{x_c}{where},"ts":{ts},"dur":{d // 1000}.{d % 1000:03d},'
                   f'{ok_args if ok is True else bad_args}}}')
        if tw is not None:
            d = e - s
            buf.append(f'{x_w}{tw.out[2]},"ts":{s // 1000}.{s % 1000:03d},"dur":{d // 1000}.{d % 1000:03d},'
                       f'{w_args}}}')
        for i in range(n, len(buf)):
            self.buffered += len(buf[i])
        if self.buffered >= FLUSH_BYTES:
            self.flush()

    def comm(self, t: Track, b: int, e: int, op: str, seq: int, comm: str, ranks: int, first_rank: int,
             last_rank: int, spread_us: int, partial: bool, unfinished: int) -> None:
        """A collective on its communicator's track (as protobuf.ProtoSink.comm)."""
        self.slice(t, b, e, op, comm_args(seq, comm, ranks, first_rank, last_rank, spread_us, partial, unfinished))

    def work(self, t: Track, b: int, e: int, op: str, seq: int, comm: str, unfinished: bool) -> None:
        args = f'"seq":{int(seq)},"comm":{self._s(comm)}' + (',"unfinished":true' if unfinished else "")
        self._ev(f'{{"ph":"X","cat":"worker","name":{self._s(op)},{t.out[2]},"ts":{_us(b)},"dur":{_us(e - b)},'
                 f'"args":{{{args}}}}}')

    def _args(self, args: list) -> str:
        return json.dumps(dict(args), default=str)

    def slice(self, t: Track, b: int, e: int, name: str, args: list, instant_at_begin: str = "") -> None:
        self._ev(f'{{"ph":"X","name":{self._s(name)},{t.out[2]},"ts":{_us(b)},"dur":{_us(e - b)},'
                 f'"args":{self._args(args)}}}')
        if instant_at_begin:
            self.instant(t, b, instant_at_begin, args[:1])

    def gpu(self, t: Track, b: int, e: int, name: str, args: list, fids: List[int]) -> None:
        ts = _us(b)
        for fid in fids:
            self._ev(f'{{"ph":"f","bp":"e","id":{int(fid)},"cat":"flow","name":"kernel",{t.out[2]},"ts":{ts}}}')
        self._ev(f'{{"ph":"X","cat":"gpu","name":{self._s(name)},{t.out[2]},"ts":{ts},"dur":{_us(e - b)},'
                 f'"args":{self._args(args)}}}')

    def instant(self, t: Track, ts: int, name: str, args: list) -> None:
        self._ev(f'{{"ph":"i","s":"t","name":{self._s(name)},{t.out[2]},"ts":{_us(ts)},'
                 f'"args":{self._args(args)}}}')

    def counter(self, t: Track, ts: int, value: Any) -> None:
        v = int(value) if type(value) is int else float(value)
        self._ev(f'{{"ph":"C","name":{t.out[2]},"pid":{t.out[0]},"ts":{_us(ts)},"args":{{"value":{v}}}}}')

    def finish(self, meta: Dict[str, Any]) -> int:
        self.flush()
        self._write('\n],\n"displayTimeUnit":"ns",\n"otherData":' + json.dumps(meta, default=str) + "}\n")
        return self.bytes


def export_chrome(store_dir: str, out_path: str, t_from: Optional[float] = None, t_to: Optional[float] = None,
                  ranks: Optional[Iterable[int]] = None, progress: Optional[Callable[[Dict[str, Any]], None]] = None,
                  findings=None, hang_after: float = 5.0) -> Dict[str, Any]:
    """Write `store_dir` as a Chrome JSON trace at `out_path`; arguments and stats as export_perfetto."""
    return run_export(store_dir, out_path, ChromeSink, "wb", t_from, t_to, ranks, progress, findings, hang_after)
