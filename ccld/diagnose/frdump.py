"""Read PyTorch Flight Recorder dumps: one file per rank, pickle or JSON, as torch 2.x writes them.

Where they come from: NCCL writes `$TORCH_FR_DUMP_TEMP_FILE<rank>` (pickle) when its watchdog times
out; any backend (gloo too) can be asked with torch._C._distributed_c10d._dump_fr_trace() (pickle)
or _dump_fr_trace_json() (JSON). Both carry `version` ("2.10" in torch 2.13), `pg_config`
(pg name -> desc, ranks), `pg_status` (pg name -> last enqueued/started/completed seq; ints in
pickles, strings in JSON) and `entries`, one per collective or p2p op: process_group (name, desc),
collective_seq_id, profiling_name ("gloo:all_reduce", "nccl:all_reduce"), sizes, dtypes, state,
retired, time_created_ns (Unix ns), frames (pickle only). The rank is not inside the dump: it is the
number at the end of the file name (torch's analyzer convention, `<prefix><rank>`).
Gloo caveats (platform notes, section 9): state stays "scheduled", the discovered times are 0 or
None, p2p ops are not recorded, and pg_config has one entry under "" whose ranks may be "[]".
Pickles are loaded with an unpickler that refuses every class (a dump holds only dicts, lists,
tuples, strings and numbers), so a hostile file cannot run code. Every problem raises FrDumpError
naming the file and the field.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from ccld.errors import CcldError

MAX_DUMP_BYTES = 512 << 20   # a 20,000-entry NCCL dump with stacks is tens of MiB; more is not a dump
NAME_RE = re.compile(r"^(?P<prefix>.*?)(?P<rank>\d+)(?:\.(?:json|pkl|pickle))?$")
KNOWN_MAJOR = "2"            # dump format major version this reader understands


class FrDumpError(CcldError):
    """A Flight Recorder dump cannot be read (named file, named field)."""


@dataclass
class Entry:
    pg: str                  # process group name ("0" is the default group)
    pg_desc: str
    seq: int                 # collective_seq_id (per process group, from 1), or p2p_seq_id for p2p
    p2p: bool
    name: str                # profiling_name, e.g. "gloo:all_reduce"
    in_sizes: List[Any]
    in_dtypes: List[str]
    out_sizes: List[Any]
    out_dtypes: List[str]
    state: str               # scheduled | started | completed (gloo: always scheduled)
    retired: bool            # the backend is done with it (completed, or failed / timed out)
    created_ns: int          # Unix ns
    started_ns: int          # 0 when unknown (gloo)
    completed_ns: int
    timeout_ms: Optional[int]
    frames: List[Dict[str, Any]] = field(default_factory=list)  # innermost first

    @property
    def backend(self) -> str:
        return self.name.split(":", 1)[0] if ":" in self.name else ""

    @property
    def done(self) -> bool:
        return self.retired or self.state == "completed"


@dataclass
class Dump:
    path: str
    rank: int
    fmt: str                 # pickle | json
    version: str
    comm_lib_version: str
    pg_config: Dict[str, Dict[str, Any]]   # pg name -> {"desc": str, "ranks": [int] or None}
    pg_status: Dict[str, Dict[str, int]]   # pg name -> {"last_enqueued": n, "last_started": n, "last_completed": n}
    entries: List[Entry]
    mtime: float             # when the file was written (no dump time is recorded inside)

    @property
    def backend(self) -> str:
        names = {e.backend for e in self.entries if e.backend}
        return names.pop() if len(names) == 1 else ",".join(sorted(names)) or "unknown"


class _NoClasses(pickle.Unpickler):
    def find_class(self, module: str, name: str):  # noqa: D102
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: a Flight Recorder dump holds no classes")


def _load(path: str) -> Tuple[Any, str]:
    try:
        size = os.path.getsize(path)
        if size > MAX_DUMP_BYTES:
            raise FrDumpError(f"{path}: {size} bytes, larger than any Flight Recorder dump "
                              f"({MAX_DUMP_BYTES >> 20} MiB)")
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise FrDumpError(f"{path}: cannot read: {e.strerror or e}") from None
    if not data:
        raise FrDumpError(f"{path}: empty file (the dump was not written, or was cut off)")
    if data[:1] == b"\x80":
        try:
            return _NoClasses(io.BytesIO(data)).load(), "pickle"
        except (EOFError, pickle.UnpicklingError, ValueError, TypeError, IndexError, KeyError) as e:
            raise FrDumpError(f"{path}: not a complete pickle ({type(e).__name__}: {e}): truncated?") from None
    if data.lstrip()[:1] == b"{":
        try:
            return json.loads(data), "json"
        except (ValueError, UnicodeDecodeError) as e:
            raise FrDumpError(f"{path}: not valid JSON ({e}): truncated?") from None
    raise FrDumpError(f"{path}: neither a pickle nor JSON (starts with {data[:8]!r})")


def _get(d: Dict[str, Any], key: str, types, where: str, default: Any = ..., allow_none: bool = False):
    types = types if isinstance(types, tuple) else (types,)
    if not isinstance(d, dict):
        raise FrDumpError(f"{where}: expected a mapping, found {type(d).__name__}")
    if key not in d:
        if default is not ...:
            return default
        raise FrDumpError(f"{where}: missing field {key!r}")
    v = d[key]
    if v is None and allow_none:
        return v
    if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):  # True is an int to Python
        want = "/".join(t.__name__ for t in types)
        raise FrDumpError(f"{where}: field {key!r} should be {want}, found {type(v).__name__} {v!r:.40}")
    return v


def _int(v: Any, where: str) -> int:
    """pg_status values are ints in pickles and strings in JSON."""
    try:
        return int(v)
    except (TypeError, ValueError):
        raise FrDumpError(f"{where}: expected a number, found {v!r:.40}") from None


def _ranks(text: Any, where: str) -> Optional[List[int]]:
    """pg_config ranks: "[0, 1, 2, 3]" (a string) or a list; "[]" (gloo) means unknown."""
    if isinstance(text, str):
        try:
            text = json.loads(text)
        except ValueError:
            raise FrDumpError(f"{where}: field 'ranks' is not a list: {text!r:.60}") from None
    if not isinstance(text, list) or not all(isinstance(r, int) and not isinstance(r, bool) for r in text):
        raise FrDumpError(f"{where}: field 'ranks' is not a list of ranks: {text!r:.60}")
    return text or None


def _entry(e: Any, where: str) -> Entry:
    pg = _get(e, "process_group", (list, tuple), where)
    if len(pg) != 2 or not all(isinstance(x, str) for x in pg):
        raise FrDumpError(f"{where}: field 'process_group' should be [name, desc], found {pg!r:.60}")
    p2p = bool(_get(e, "is_p2p", bool, where, default=False))
    seq = _get(e, "p2p_seq_id" if p2p else "collective_seq_id", int, where)
    frames = _get(e, "frames", list, where, default=[])
    for i, fr in enumerate(frames):
        if not isinstance(fr, dict):
            raise FrDumpError(f"{where}: frames[{i}] should be a mapping")
    return Entry(pg=pg[0], pg_desc=pg[1], seq=seq, p2p=p2p, name=_get(e, "profiling_name", str, where),
                 in_sizes=_get(e, "input_sizes", list, where, default=[]),
                 in_dtypes=_get(e, "input_dtypes", list, where, default=[]),
                 out_sizes=_get(e, "output_sizes", list, where, default=[]),
                 out_dtypes=_get(e, "output_dtypes", list, where, default=[]),
                 state=_get(e, "state", str, where), retired=bool(_get(e, "retired", bool, where, default=False)),
                 created_ns=_get(e, "time_created_ns", int, where),
                 started_ns=_get(e, "time_discovered_started_ns", int, where, default=0, allow_none=True) or 0,
                 completed_ns=_get(e, "time_discovered_completed_ns", int, where, default=0, allow_none=True) or 0,
                 timeout_ms=_get(e, "timeout_ms", int, where, default=None, allow_none=True), frames=frames)


def read_dump(path: str, rank: int) -> Dump:
    raw, fmt = _load(path)
    if not isinstance(raw, dict):
        raise FrDumpError(f"{path}: the dump should be a mapping at the top, found {type(raw).__name__}")
    version = str(_get(raw, "version", (str, int, float), path))
    if version.split(".", 1)[0] != KNOWN_MAJOR:
        raise FrDumpError(f"{path}: field 'version' is {version!r}; this ccld reads Flight Recorder "
                          f"format {KNOWN_MAJOR}.x")
    entries_raw = _get(raw, "entries", list, path, default=[])  # JSON dumps leave it out when empty
    entries = [_entry(e, f"{path}: entries[{i}]") for i, e in enumerate(entries_raw)]
    pg_config: Dict[str, Dict[str, Any]] = {}
    for name, cfg in _get(raw, "pg_config", dict, path, default={}).items():
        where = f"{path}: pg_config[{name!r}]"
        pg_config[str(name)] = {"desc": str(_get(cfg, "desc", str, where, default="")),
                                "ranks": _ranks(_get(cfg, "ranks", (str, list), where, default="[]"), where)}
    pg_status: Dict[str, Dict[str, int]] = {}
    for name, st in _get(raw, "pg_status", dict, path, default={}).items():
        where = f"{path}: pg_status[{name!r}]"
        pg_status[str(name)] = {k.replace("_collective", ""): _int(_get(st, k, (int, str), where), f"{where}: {k}")
                                for k in ("last_enqueued_collective", "last_started_collective",
                                          "last_completed_collective") if k in st}
    return Dump(path=path, rank=rank, fmt=fmt, version=version,
                comm_lib_version=str(raw.get("comm_lib_version") or ""), pg_config=pg_config,
                pg_status=pg_status, entries=entries, mtime=os.path.getmtime(path))


def find_dumps(directory: str, prefix: Optional[str] = None) -> List[Tuple[str, int]]:
    """(path, rank) of every dump in `directory`: files named <prefix><rank> (optionally .json/.pkl).
    Without `prefix`, there must be exactly one prefix among the files."""
    if not os.path.isdir(directory):
        raise FrDumpError(f"{directory}: not a directory of Flight Recorder dumps")
    groups: Dict[str, List[Tuple[str, int]]] = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        m = NAME_RE.match(name)
        if not m or not os.path.isfile(path) or name.startswith("."):
            continue
        if prefix is not None and m.group("prefix") != prefix:
            continue
        groups.setdefault(m.group("prefix"), []).append((path, int(m.group("rank"))))
    if not groups:
        raise FrDumpError(f"{directory}: no dump files (named <prefix><rank>, e.g. nccl_trace_rank_3)"
                          + (f" with prefix {prefix!r}" if prefix else ""))
    if len(groups) > 1:
        raise FrDumpError(f"{directory}: dumps with several prefixes ({', '.join(map(repr, sorted(groups)))}): "
                          "say which with --fr-prefix")
    found = next(iter(groups.values()))
    ranks = [r for _, r in found]
    dup = sorted({r for r in ranks if ranks.count(r) > 1})
    if dup:
        raise FrDumpError(f"{directory}: more than one dump for rank(s) {dup} (e.g. both .json and .pkl): "
                          "keep one per rank")
    return sorted(found, key=lambda x: x[1])


def read_dir(directory: str, prefix: Optional[str] = None) -> List[Dump]:
    return [read_dump(path, rank) for path, rank in find_dumps(directory, prefix)]
