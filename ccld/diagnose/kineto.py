"""Read torch.profiler (Kineto) traces, one per rank, into the per-op table's Rows (opframes.py makes them events).

A trace is one JSON document (`.json`, or `.json.gz`), as `prof.export_chrome_trace()` writes it:
  rank, world   `distributedInfo` (rank, world_size, backend); a trace without it names no
                rank and is skipped with one error line naming the file;
  collectives   the `record_param_comms` CPU ops (NCCL; gloo in some versions) with their args:
                "Collective name", "Process Group Name" (c10d's "0" is the default group: every rank),
                "Seq" (the collective's number in its group, the same on every member),
                "In msg nelems" x "dtype". Where a
                trace has none, the backend's annotations (`gloo:all_reduce`, `nccl:*`, category
                user_annotation: the work's span on the backend's thread) are the collectives, with
                no seq (counted per rank and op, as for a table without `seq`), bytes from their
                "Input Dims"/"Input type", and a group told by the worker thread that ran them
                (kinetocomms.py). The cpu_op's "Sequence number" is autograd's, not the
                collective's: never read as a seq;
  p2p           record_param_comms "send"/"recv" with the peer's rank ("Dst Rank"/"Src Rank"), or the
                `gloo:send`/`gloo:recv` annotations with the peer from the c10d op around them
                (kinetocomms.py): p2p rows, paired as the n-th send a->b with the n-th recv of b from
                a; one whose peer the trace does not say (recv from any source) is counted, not read;
  compute       the record_function ranges (category user_annotation, not gloo:/nccl:, not
                ProfilerStep#N): compute rows named as the user named them, compared across ranks;
  NCCL kernels  `ncclDevKernel_*`/`ncclKernel_*` (category kernel) joined to their record_param_comms:
                by "External id" (the CPU op that launched it), else by "correlation" through the
                cudaLaunchKernel runtime event, then to the record_param_comms around that CPU event
                on its thread. A joined collective's start and end are its kernels' (device time).
Time: `ts`/`dur` are microseconds. With `baseTimeNanoseconds` (torch >= 2.x) a ts counts from that
Unix time, so every rank lands on the wall clock (ranks on one host share it; across hosts as far as
their clocks agree: NTP). Without it, a ts from UNIX_US on is taken as Unix microseconds; smaller ones
are each rank's own clock, not aligned (said in the header).
A rank without a trace: the others' collectives completed, so it ran them; the default group is judged
among the ranks with a trace (TRACED_GROUP) and the header says who is missing.
Caveat: GPU compute kernels are not read (one name runs at many shapes); ranges the user did not
name are not compute rows.
"""
from __future__ import annotations

import bisect
import collections
import contextlib
import glob
import gzip
import json
import math
import os
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from ccld.diagnose.frcheck import rank_span
from ccld.diagnose.kinetocomms import (COMMS_OP, GlooPeers, args_of, check_groups, comms_peer, gloo_groups,
                                       group_of, int_arg)
from ccld.diagnose.opframes import format_groups, ranks_of_world, rows_store
from ccld.diagnose.optable import DEFAULT_GROUP, MAX_RANK, OpsTable, Row, guess_kind, normalize_op
from ccld.errors import CcldError

UNIX_US = 1e15        # a ts from here on (2001-09-09, in us) is Unix microseconds
ANNOTATION_PREFIXES = ("gloo:", "nccl:")
STEP_PREFIX = "ProfilerStep#"  # prof.step()'s range: not a compute op of the job's own
NCCL_KERNELS = ("ncclDevKernel_", "ncclKernel_")
CPU_CATS = {"cpu_op", "operator", "user_annotation", "python_function"}   # events that launch work on the CPU
RUNTIME_CATS = {"cuda_runtime", "runtime", "cuda_driver"}
TRACED_GROUP = "traced"  # the default group when some ranks have no trace: its ranks that have one
DTYPE_BYTES = {"float": 4, "float32": 4, "double": 8, "float64": 8, "half": 2, "float16": 2, "bfloat16": 2,
               "long": 8, "int64": 8, "int": 4, "int32": 4, "short": 2, "int16": 2, "char": 1, "int8": 1,
               "byte": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


class KinetoError(CcldError):
    """No Kineto trace could be read (each named with its reason)."""


@dataclass
class Trace:
    """One rank's trace, as read."""
    path: str
    rank: int
    world: int
    backend: str
    clock: str                  # "base" (baseTimeNanoseconds), "unix" (absolute ts) or "own" (relative)
    source: str                 # "record_param_comms" or "annotations"
    rows: List[Row] = field(default_factory=list)
    kernels: int = 0            # NCCL kernels seen
    joined: int = 0             # of them, joined to a collective
    p2p: int = 0                # p2p ops read
    p2p_unread: int = 0         # p2p ops whose peer the trace does not say
    compute: int = 0            # record_function ranges read as compute rows
    groups: str = ""            # how gloo collectives' groups were told (kinetocomms.gloo_groups), if they were
    mapped: bool = False        # gloo collectives put in groups by their worker threads


@dataclass
class KinetoSet:
    """The traces given, as one per-op table (rows in Unix seconds when the clocks allow it)."""
    path: str
    traces: List[Trace]
    errors: List[str]           # one line per file skipped
    world: int
    table: OpsTable
    notes: List[str] = field(default_factory=list)  # header lines: what could not be told as it was read


def _load(path: str) -> Dict[str, Any]:
    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rt", encoding="utf-8") as f:
                doc = json.load(f)
        else:
            with open(path, "r", encoding="utf-8") as f:
                doc = json.load(f)
    except OSError as e:
        if isinstance(e, gzip.BadGzipFile):
            raise ValueError(f"not gzip data ({e})") from None
        raise ValueError(f"cannot read: {e.strerror or e}") from None
    except EOFError:
        raise ValueError("truncated: the compressed data ends early (nothing of a cut trace is read)") from None
    except zlib.error as e:
        raise ValueError(f"damaged compressed data ({e})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text ({e})") from None
    except ValueError as e:
        raise ValueError(f"not a JSON document ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise ValueError("not a Kineto/Chrome trace (no traceEvents list)")
    return doc


def _num(v: Any) -> Optional[float]:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    return None


def _size(dtype: Any) -> Optional[int]:
    return DTYPE_BYTES.get(str(dtype).strip().lower().replace("c10::", "").replace("torch.", ""))


def _nbytes(args: Dict[str, Any]) -> int:
    """The message size: In msg nelems x the dtype's size (record_param_comms), else the first input's
    Input Dims x Input type (an annotation); -1 when the trace does not say."""
    n, size = int_arg(args.get("In msg nelems")), _size(args.get("dtype"))
    if n is not None and size:
        return n * size
    dims, types = args.get("Input Dims"), args.get("Input type")
    if isinstance(dims, list) and dims and isinstance(dims[0], list) and isinstance(types, list) and types:
        size = _size(types[0])
        if size and all(int_arg(d) is not None for d in dims[0]):
            return math.prod(int(d) for d in dims[0]) * size
    return -1


class _Clock:
    """A trace's ts (us) -> seconds: Unix seconds where the trace allows it."""

    def __init__(self, doc: Dict[str, Any], first_ts: float):
        self.base_ns = int_arg(doc.get("baseTimeNanoseconds"))
        self.kind = "base" if self.base_ns is not None else "unix" if first_ts >= UNIX_US else "own"

    def s(self, ts_us: float) -> float:
        if self.base_ns is not None:
            return (self.base_ns + round(ts_us * 1000)) / 1e9
        return ts_us / 1e6


def read_trace(path: str, first_n: int = 1) -> Trace:
    """One rank's trace; ValueError (the reason, without the file) when it cannot be used. Rows are
    numbered from first_n (row numbers are unique across the traces of a job)."""
    doc = _load(path)
    info = doc.get("distributedInfo")
    if not isinstance(info, dict):
        raise ValueError("no distributedInfo (rank, world size): torch.profiler writes it only for a job "
                         "that called init_process_group before profiling")
    rank, world = int_arg(info.get("rank")), int_arg(info.get("world_size"))
    if rank is None or world is None or not 0 <= rank < world or world > MAX_RANK:
        raise ValueError(f"distributedInfo: rank {info.get('rank')!r} of world_size {info.get('world_size')!r} "
                         "is not a rank")
    evs = [e for e in doc["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X"
           and _num(e.get("ts")) is not None and isinstance(e.get("name"), str)]
    clock = _Clock(doc, min((float(e["ts"]) for e in evs), default=0.0))
    comms = [e for e in evs if e["name"] == COMMS_OP]
    t = Trace(path=path, rank=rank, world=world, backend=str(info.get("backend", "?")), clock=clock.kind,
              source=COMMS_OP if comms else "annotations")
    spans = {id(e): _span(e) for e in comms}
    for k_start, k_end, comm in _kernels(t, evs, comms):
        s = spans[id(comm)]  # the first kernel replaces the CPU span; more (coalesced) widen it
        spans[id(comm)] = (k_start, k_end, "gpu") if s[2] == "cpu" else (min(s[0], k_start), max(s[1], k_end), "gpu")
    threads: Dict[Tuple[Any, Any], str] = {}
    peers = None
    if not comms:
        comms = [e for e in evs if e.get("cat") == "user_annotation" and e["name"].startswith(ANNOTATION_PREFIXES)]
        spans = {id(e): _span(e) for e in comms}
        threads, t.groups = gloo_groups(info, [(e.get("pid"), e.get("tid")) for e in comms
                                               if guess_kind(normalize_op(e["name"])) == "collective"])
        t.mapped = bool(threads)
        peers = GlooPeers(evs)
    work = [(float(e["ts"]), 0, e) for e in comms] + [(float(e["ts"]), 1, e) for e in evs if _compute(e)]
    n = first_n
    for _, what, e in sorted(work, key=lambda w: w[:2]):
        args = args_of(e)
        start, end, _ = spans[id(e)] if what == 0 else _span(e)
        if what == 1:
            t.compute += 1
            t.rows.append(Row(n=n, rank=rank, op=e["name"].strip(), kind="compute", start=clock.s(start),
                              duration=(end - start) / 1e6, group=DEFAULT_GROUP, seq=None, peer=None, step=None,
                              nbytes=-1))
            n += 1
            continue
        name = args.get("Collective name") if e["name"] == COMMS_OP else e["name"]
        op = normalize_op(str(name or "?"))
        kind = guess_kind(op)
        if kind == "p2p":
            peer = comms_peer(op, args) if peers is None else peers.peer(e, op)
            if peer is None or not 0 <= peer < world or peer == rank:
                t.p2p_unread += 1
                continue
            t.p2p += 1
            group = group_of(args) if peers is None else DEFAULT_GROUP
        elif kind == "collective":
            peer = None
            group = group_of(args) if peers is None else threads.get((e.get("pid"), e.get("tid")), DEFAULT_GROUP)
        else:  # e.g. an "init" record: not a collective ranks meet in
            continue
        seq = int_arg(args.get("Seq")) if e["name"] == COMMS_OP and kind == "collective" else None
        t.rows.append(Row(n=n, rank=rank, op=op, kind=kind, start=clock.s(start), duration=(end - start) / 1e6,
                          group=group, seq=seq if seq is not None and seq >= 0 else None,
                          peer=peer, step=None, nbytes=_nbytes(args)))
        n += 1
    return t


def _compute(e: Dict[str, Any]) -> bool:
    """A record_function range of the user's own: a compute row."""
    return (e.get("cat") == "user_annotation" and not e["name"].startswith(ANNOTATION_PREFIXES)
            and not e["name"].startswith(STEP_PREFIX) and bool(e["name"].strip()))


def _span(e: Dict[str, Any]) -> Tuple[float, float, str]:
    ts = float(e["ts"])
    return ts, ts + (_num(e.get("dur")) or 0.0), "cpu"


def _kernels(t: Trace, evs: List[Dict[str, Any]],
             comms: List[Dict[str, Any]]) -> Iterator[Tuple[float, float, Dict[str, Any]]]:
    """(start us, end us, record_param_comms) of every NCCL kernel joined to its collective."""
    by_ext: Dict[int, Dict[str, Any]] = {}
    by_corr: Dict[int, Dict[str, Any]] = {}
    for e in evs:
        args = args_of(e)
        cat = str(e.get("cat", "")).lower()
        if cat in CPU_CATS and int_arg(args.get("External id")) is not None:
            ext = int(args["External id"])
            if e["name"] == COMMS_OP or ext not in by_ext:
                by_ext[ext] = e
        elif cat in RUNTIME_CATS and int_arg(args.get("correlation")) is not None:
            by_corr[int(args["correlation"])] = e
    per_thread: Dict[Tuple[Any, Any], List[Dict[str, Any]]] = collections.defaultdict(list)
    for c in comms:
        per_thread[(c.get("pid"), c.get("tid"))].append(c)
    starts = {k: [float(c["ts"]) for c in sorted(v, key=lambda c: float(c["ts"]))] for k, v in per_thread.items()}
    for k in per_thread:
        per_thread[k].sort(key=lambda c: float(c["ts"]))
    for e in evs:
        if str(e.get("cat", "")).lower() != "kernel" or not e["name"].startswith(NCCL_KERNELS):
            continue
        t.kernels += 1
        args = args_of(e)
        anchor = (by_ext.get(int_arg(args.get("External id")) or -1)
                  or by_corr.get(int_arg(args.get("correlation")) or -1))
        comm = anchor if anchor is not None and anchor["name"] == COMMS_OP else None
        if comm is None and anchor is not None:  # the record_param_comms around the launching event
            key, ts = (anchor.get("pid"), anchor.get("tid")), float(anchor["ts"])
            i = bisect.bisect_right(starts.get(key, []), ts) - 1
            if i >= 0:
                c = per_thread[key][i]
                comm = c if ts <= float(c["ts"]) + (_num(c.get("dur")) or 0.0) else None
        if comm is not None:
            t.joined += 1
            ks = float(e["ts"])
            yield ks, ks + (_num(e.get("dur")) or 0.0), comm


def trace_files(paths: List[str]) -> List[str]:
    """The trace files of DIR|FILE arguments: a directory's *.json and *.json.gz (not recursive)."""
    out: List[str] = []
    for p in paths:
        if os.path.isdir(p):
            out += sorted(glob.glob(os.path.join(p, "*.json")) + glob.glob(os.path.join(p, "*.json.gz")))
        else:
            out.append(p)
    return out


def read_traces(paths: List[str]) -> KinetoSet:
    """Every trace of `paths` as one table; a file that cannot be used is one line in `errors`.
    Raises KinetoError when none can be used."""
    files = trace_files(paths)
    label = paths[0] if len(paths) == 1 else f"{len(files)} files"
    if not files:
        raise KinetoError(f"{label}: no Kineto traces (*.json, *.json.gz) there")
    traces: List[Trace] = []
    errors: List[str] = []
    n = 1
    for path in files:
        try:
            t = read_trace(path, first_n=n)
        except ValueError as e:
            errors.append(f"{path}: {e}; skipped")
            continue
        other = next((o for o in traces if o.rank == t.rank), None)
        if other is not None:
            errors.append(f"{path}: rank {t.rank} again (also in {other.path}); skipped")
            continue
        if all(r.kind == "compute" for r in t.rows):
            errors.append(f"{path}: rank {t.rank}: no collectives in the trace (no record_param_comms, no gloo:/nccl: "
                          "annotations)")
        traces.append(t)
        n += len(t.rows)
    if not any(t.rows for t in traces):
        if len(errors) == 1:  # one file: its own reason is the message
            raise KinetoError(errors[0].removesuffix("; skipped"))
        raise KinetoError(f"{label}: no collectives in any of {len(files)} traces; first: {errors[0]}")
    notes = check_groups({t.rank: t.rows for t in traces}, {t.rank: t.mapped for t in traces})
    if notes:
        for t in traces:
            t.mapped = False
    rows = [r for t in traces for r in t.rows]
    world = max(t.world for t in traces)
    if len(traces) < world:  # the others' collectives completed, so the missing ranks ran them: judge
        for r in rows:       # the default group among the ranks with a trace (a named group's members)
            if r.group == DEFAULT_GROUP:
                r.group = TRACED_GROUP
    worlds = sorted({t.world for t in traces})
    if len(worlds) > 1:
        errors.append(f"{label}: the traces disagree on the world size ({', '.join(map(str, worlds))}); "
                      f"taking {worlds[-1]}")
    path = paths[0] if len(paths) == 1 else os.path.commonpath([os.path.abspath(p) for p in files])
    return KinetoSet(path=label, traces=sorted(traces, key=lambda t: t.rank), errors=errors, world=worlds[-1],
                     table=OpsTable(path=path, fmt="kineto", rows=rows, bad=[]), notes=notes)


CLOCKS = {"base": "each trace's baseTimeNanoseconds + ts: Unix time, ranks on one wall clock",
          "unix": "ts as Unix microseconds: ranks on one wall clock",
          "own": "each rank's own clock from its trace's start (no baseTimeNanoseconds): ranks NOT aligned"}


def format_set(ks: KinetoSet) -> List[str]:
    """What was read: one line for the traces, the clock, one per source of collectives."""
    ranks = [t.rank for t in ks.traces]
    of_world, absent = ranks_of_world(ranks, ks.world, "trace")
    backends = sorted({t.backend for t in ks.traces})
    lines = [f"kineto traces {ks.path}: {len(ks.traces)} trace{'s' * (len(ks.traces) != 1)}, {of_world}"
             + f", backend {', '.join(backends)}; "
             f"{sum(r.kind == 'collective' for r in ks.table.rows)} collectives"]
    if absent:
        lines.append(f"  no trace from rank{'s' * (len(absent) > 1)} {rank_span(absent)}: the default group is "
                     f"judged among rank{'s' * (len(ranks) > 1)} {rank_span(ranks)} (group {TRACED_GROUP})")
    clocks = sorted({t.clock for t in ks.traces})
    lines.append("  clock: " + "; ".join(CLOCKS[c] for c in clocks)
                 + (" (traces mix clocks: ranks not aligned)" if len(clocks) > 1 else ""))
    by_source = collections.Counter(t.source for t in ks.traces)
    for source, count in sorted(by_source.items()):
        what = ("record_param_comms (group, sizes; seq where the trace has it)" if source == COMMS_OP
                else "gloo:/nccl: annotations (no record_param_comms: no seq)")
        lines.append(f"  {count} trace{'s' * (count > 1)}: collectives from {what}")
    kernels, joined = sum(t.kernels for t in ks.traces), sum(t.joined for t in ks.traces)
    if kernels:
        lines.append(f"  NCCL kernels: {joined} of {kernels} joined to their collective (device time used)")
    told = sorted({t.groups for t in ks.traces if t.mapped or t.groups.endswith("the default group")})
    lines += [f"  {line}" for line in told + ks.notes]
    p2p, unread = sum(t.p2p for t in ks.traces), sum(t.p2p_unread for t in ks.traces)
    if p2p or unread:
        lines.append(f"  p2p ops: {p2p} read (send/recv with their peer)"
                     + (f", {unread} whose peer the trace does not say, not read" if unread else ""))

    return lines


@contextlib.contextmanager
def kineto_store(paths: List[str], say: Optional[Callable[[str], None]] = None
                 ) -> Iterator[Tuple[str, List[str]]]:
    """(store directory, what was read: format_set, then the groups as the job has them) of the traces
    of `paths`: a temporary store of the frames opframes makes of their rows (the same path as a per-op
    table's), removed afterwards. Each file skipped and each row that could not be placed is one line
    to `say` (stderr by default)."""
    ks = read_traces(paths)
    with rows_store(ks.table, ks.world, ks.errors, say) as (store, job):
        yield store, format_set(ks) + format_groups(job)
