"""Read NCCL Inspector logs (NVIDIA/nccl plugins/profiler/inspector) into the per-op table's Rows.

The Inspector profiler plugin writes one file per process, `<dump dir>/<hostname>-pid<pid>.log`: one
JSON object a line per completed collective (or p2p op) of each communicator the process is in:
  header     id (the communicator's hash, "0x..."), comm_name, rank (the process's rank IN THAT
             communicator), n_ranks, nnodes;
  metadata   hostname, pid, dump_timestamp_us (when the dump thread wrote it: not the op's time);
  coll_perf  coll ("AllReduce"...), coll_sn (NCCL's per-communicator, per-function counter: the same
             on every member, but AllReduce #5 and AllGather #5 share it), coll_msg_size_bytes,
             coll_exec_time_us (the longest channel's kernel time), coll_timing_source (kernel_gpu,
             kernel_cpu, collective_cpu), and with NCCL_INSPECTOR_DUMP_VERBOSE=1 only, event_trace_ts:
             coll_start_ts and each channel's kernel_start_ts/kernel_stop_ts (gettimeofday, Unix us);
  p2p_perf   p2p ops: counted, not read.
A process's global rank is its rank in the largest communicator it is in (n_ranks = the world: the
job's largest). A collective joins across ranks by (communicator, coll, coll_sn); the joined
collectives of a communicator are numbered in time order (the timeline's seq).
Time: a collective starts at its first channel's kernel_start_ts (the GPU began it: a rank whose
kernel starts late arrived late), else at coll_start_ts (the CPU enqueued it), and lasts
coll_exec_time_us. Without event_trace_ts a record has a duration and no start: the detectors judge
when ranks enter, so such a record is not read (counted); logs with none at all are an error that
says to set NCCL_INSPECTOR_DUMP_VERBOSE=1. Nothing here was checked against real Inspector output.
Caveat: only completed collectives are logged, so a hang (a collective some rank never entered) is
never in the logs; a missing log means a process's file is missing, not that it did not run.
"""
from __future__ import annotations

import collections
import contextlib
import glob
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from ccld.diagnose.frcheck import rank_span
from ccld.diagnose.opframes import format_groups, ranks_of_world, rows_store
from ccld.diagnose.optable import MAX_RANK, OpsTable, Row, gz_lines, guess_kind, normalize_op
from ccld.errors import CcldError

SUFFIXES = (".log", ".jsonl", ".log.gz", ".jsonl.gz")   # what the plugin (and its exporter) write
VERBOSE_HINT = ("set NCCL_INSPECTOR_DUMP_VERBOSE=1 for the job: then each record has event_trace_ts "
                "(docs/nccl-inspector.md)")


class InspectorError(CcldError):
    """No NCCL Inspector log could be used (named with its reason)."""


@dataclass
class Record:
    """One collective of one process, as read (before ranks are known)."""
    line: int
    comm: str            # group name: "comm_name(0xid)" or "0xid"
    comm_rank: int
    n_ranks: int
    op: str              # normalized
    sn: int
    nbytes: int
    start: float         # Unix s
    duration: float      # s
    source: str          # coll_timing_source


@dataclass
class Process:
    """One log file: one process."""
    path: str
    host: str = "?"
    pid: int = -1
    rank: int = -1       # global: its rank in the largest communicator it is in
    records: List[Record] = field(default_factory=list)
    no_start: int = 0    # records without event_trace_ts: not read
    p2p: int = 0         # p2p records: counted, not read


@dataclass
class InspectorSet:
    path: str
    procs: List[Process]
    errors: List[str]
    world: int
    table: OpsTable
    comms: Dict[str, int] = field(default_factory=dict)   # group -> n_ranks
    sources: Dict[str, int] = field(default_factory=dict)  # timing source -> records


def log_files(path: str) -> List[str]:
    """The Inspector logs under DIR (recursive, as the plugin's exporter finds them), or the one FILE."""
    if not os.path.isdir(path):
        return [path]
    return sorted(f for f in glob.glob(os.path.join(path, "**", "*"), recursive=True)
                  if f.endswith(SUFFIXES) and os.path.isfile(f))


def _lines(path: str) -> Iterator[str]:
    if path.endswith(".gz"):
        yield from gz_lines(path)  # a truncated gzip keeps the lines before the cut, then EOFError
    else:
        with open(path, "r", encoding="utf-8") as f:
            yield from f


def _get(obj: Dict[str, Any], part: str, key: str, want: type) -> Any:
    v = obj.get(key)
    if v is None:
        raise ValueError(f"field '{part}.{key}': missing")
    if want is int and (isinstance(v, bool) or not isinstance(v, int)) or want is str and not isinstance(v, str):
        raise ValueError(f"field '{part}.{key}': expected {want.__name__}, found {v!r:.40}")
    return v


def _start_us(perf: Dict[str, Any]) -> Optional[float]:
    """The first channel's kernel start, else the collective's CPU start (Unix us); None without them."""
    ts = perf.get("event_trace_ts")
    if not isinstance(ts, dict):
        return None
    marks = [k.get("kernel_start_ts") for k in ts.get("kernel_events") or [] if isinstance(k, dict)]
    kernels = [float(k) for k in marks if isinstance(k, int) and not isinstance(k, bool) and k > 0]
    if kernels:
        return min(kernels)
    c = ts.get("coll_start_ts")
    return float(c) if isinstance(c, int) and not isinstance(c, bool) and c > 0 else None


def _record(n: int, obj: Any, proc: Process) -> Optional[Record]:
    """One line's collective; None for p2p or a record without a start; ValueError names the field."""
    if not isinstance(obj, dict):
        raise ValueError(f"a JSON {type(obj).__name__}, not an object")
    header, meta = obj.get("header"), obj.get("metadata")
    if not isinstance(header, dict):
        raise ValueError("field 'header': missing")
    if isinstance(meta, dict):
        proc.host = str(meta.get("hostname", proc.host))
        proc.pid = meta["pid"] if isinstance(meta.get("pid"), int) else proc.pid
    perf = obj.get("coll_perf")
    if not isinstance(perf, dict):
        if isinstance(obj.get("p2p_perf"), dict):
            proc.p2p += 1
            return None
        raise ValueError("field 'coll_perf': missing (nor p2p_perf)")
    cid = _get(header, "header", "id", str)
    name = header.get("comm_name")
    rank, size = _get(header, "header", "rank", int), _get(header, "header", "n_ranks", int)
    if not 0 <= rank < size <= MAX_RANK:
        raise ValueError(f"field 'header.rank': {rank} is not a rank of n_ranks {size}")
    op = normalize_op(_get(perf, "coll_perf", "coll", str))
    sn, nbytes = _get(perf, "coll_perf", "coll_sn", int), _get(perf, "coll_perf", "coll_msg_size_bytes", int)
    dur = _get(perf, "coll_perf", "coll_exec_time_us", int)
    if guess_kind(op) != "collective":
        raise ValueError(f"field 'coll_perf.coll': {perf['coll']!r:.40} is not a collective")
    start = _start_us(perf)
    if start is None:
        proc.no_start += 1
        return None
    group = f"{name}({cid})" if isinstance(name, str) and name and name != "unknown" else cid
    return Record(line=n, comm=group, comm_rank=rank, n_ranks=size, op=op, sn=sn, nbytes=nbytes,
                  start=start / 1e6, duration=dur / 1e6, source=str(perf.get("coll_timing_source", "?")))


def read_log(path: str, bad: Callable[[str], None]) -> Process:
    """One process's log; a bad line is one call of `bad` naming the file and line. ValueError (the
    reason) when the file cannot be read at all."""
    proc = Process(path=path)
    n = 0
    try:
        for n, text in enumerate(_lines(path), 1):
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except ValueError as e:
                bad(f"{path}: line {n}: not a JSON object ({e}); the other lines are read")
                continue
            try:
                rec = _record(n, obj, proc)
            except ValueError as e:
                bad(f"{path}: line {n}: {e}")
                continue
            if rec is not None:
                proc.records.append(rec)
    except OSError as e:
        raise ValueError(f"cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        bad(f"{path}: after line {n}: not UTF-8 text ({e}); the lines before it are read")
    except EOFError:
        bad(f"{path}: truncated after line {n}: the compressed data ends early; the lines before it are read")
    except Exception as e:  # zlib.error from a damaged gzip
        bad(f"{path}: damaged compressed data after line {n} ({e}); the lines before it are read")
    return proc


def read_logs(path: str) -> InspectorSet:
    """Every log under `path` as one per-op table (Unix seconds). Raises InspectorError when none can
    be used."""
    files = log_files(path)
    if not files:
        raise InspectorError(f"{path}: no NCCL Inspector logs ({', '.join('*' + s for s in SUFFIXES)}) there")
    table = OpsTable(path=path, fmt="nccl-inspector", rows=[], bad=[])
    errors: List[str] = []
    procs: List[Process] = []
    for f in files:
        try:
            procs.append(read_log(f, table.bad_row))
        except ValueError as e:
            errors.append(f"{f}: {e}; skipped")
    with_recs = [p for p in procs if p.records]
    if not with_recs:
        no_start = sum(p.no_start for p in procs)
        if no_start:
            raise InspectorError(f"{path}: {no_start} collectives, none with a start time: the logs hold each "
                                 "collective's duration (coll_exec_time_us) but not when each rank began it, and "
                                 f"ccld judges when ranks enter; {VERBOSE_HINT}")
        first = (errors + table.bad)[:1]
        raise InspectorError(f"{path}: no collectives in {len(files)} log{'s' * (len(files) > 1)}"
                             + (f"; first: {first[0]}" if first else ""))
    world = max(r.n_ranks for p in with_recs for r in p.records)
    placed: Dict[int, Process] = {}
    for p in with_recs:
        ranks = {r.comm_rank for r in p.records if r.n_ranks == world}
        if len(ranks) != 1:
            errors.append(f"{p.path}: " + ("in no communicator of the whole job (n_ranks "
                          f"{world}): its global rank is unknown" if not ranks else
                          f"ranks {rank_span(sorted(ranks))} in communicators of the whole job") + "; skipped")
            continue
        p.rank = ranks.pop()
        if p.rank in placed:
            errors.append(f"{p.path}: rank {p.rank} again (also {placed[p.rank].path}); skipped")
            continue
        placed[p.rank] = p
    ks = InspectorSet(path=path, procs=[placed[r] for r in sorted(placed)], errors=errors, world=world, table=table)
    _rows(ks)
    return ks


def _rows(ks: InspectorSet) -> None:
    """The join: per communicator, each (coll, coll_sn) is one collective; they are numbered in the
    order their first member began them (the timeline's seq)."""
    first: Dict[Tuple[str, str, int], float] = {}
    for p in ks.procs:
        for r in p.records:
            k = (r.comm, r.op, r.sn)
            first[k] = min(first.get(k, r.start), r.start)
            ks.comms[r.comm] = r.n_ranks
    seqs: Dict[Tuple[str, str, int], int] = {}
    count: Dict[str, int] = collections.Counter()
    for k in sorted(first, key=lambda k: (first[k], k)):
        count[k[0]] += 1
        seqs[k] = count[k[0]]
    sources: Dict[str, int] = collections.Counter()
    n = 0
    for p in ks.procs:
        for r in p.records:
            n += 1
            sources[r.source] += 1
            ks.table.rows.append(Row(n=n, rank=p.rank, op=r.op, kind="collective", start=r.start,
                                     duration=r.duration, group=r.comm, seq=seqs[(r.comm, r.op, r.sn)],
                                     peer=None, step=None, nbytes=r.nbytes))
    ks.sources = dict(sources)


def format_set(ks: InspectorSet) -> List[str]:
    """What was read: one line for the logs, then what was left out and the timing sources."""
    of_world, absent = ranks_of_world([p.rank for p in ks.procs], ks.world, "log")
    lines = [f"nccl inspector logs {ks.path}: {len(ks.procs)} processes, {of_world}"
             + f"; {len(ks.table.rows)} collectives in {len(ks.comms)} communicator{'s' * (len(ks.comms) > 1)}"]
    if absent:
        lines.append(f"  no log from rank{'s' * (len(absent) > 1)} {rank_span(absent)}: each communicator is "
                     "judged among its members that have a log")
    lines.append("  time: first kernel_start_ts (Unix us, each host's clock) + coll_exec_time_us")
    lines.append("  timing: " + ", ".join(f"{s} {c}" for s, c in sorted(ks.sources.items())))
    no_start, p2p = sum(p.no_start for p in ks.procs), sum(p.p2p for p in ks.procs)
    if no_start:
        lines.append(f"  {no_start} collectives without event_trace_ts (no start time): not read")
    if p2p:
        lines.append(f"  p2p records: {p2p}, not read")
    return lines


@contextlib.contextmanager
def inspector_store(path: str, say: Optional[Callable[[str], None]] = None
                    ) -> Iterator[Tuple[str, List[str]]]:
    """(store directory, what was read: format_set, then the communicators as the job has them) of the
    logs under `path`: a temporary store of the frames opframes makes of their rows (a per-op table's
    path), removed afterwards. Each file skipped and each bad line is one line to `say` (stderr by
    default)."""
    ks = read_logs(path)
    with rows_store(ks.table, ks.world, ks.errors, say) as (store, job):
        yield store, format_set(ks) + format_groups(job)
