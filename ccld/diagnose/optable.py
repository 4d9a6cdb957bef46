"""Read a per-op table: one row per operation a rank ran, validated into Rows (opframes.py makes them events).

Formats: CSV, JSON Lines (both also gzip-compressed; the format is told by the name, else by the
content) and Parquet (with pyarrow, which ccld does not require: without it, an error says to install
it). Columns (docs/ops-table.md): rank, op, start (s), duration (s), and optionally kind (collective,
p2p or compute; guessed from op), group, seq, peer (a global rank), step, bytes; unknown columns are
ignored. Ops are put in ccld's (c10d's) vocabulary: "nccl:all_reduce", "AllReduce", "all-reduce" are
all "allreduce", so spellings cannot look like a mismatch.
Damage: a bad row is one error line (`FILE: row N: column 'c': ...`, N counting data rows from 1) and
the rest is read; a truncated or damaged gzip keeps every row before the cut and says where; a table
without a required column, or with no readable row, is an OpsTableError naming the file and column.
An empty duration means "not over when the table ended" (a rank still waiting inside).
"""
from __future__ import annotations

import codecs
import contextlib
import csv
import gzip
import json
import math
import zlib
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

from ccld.diagnose.frcheck import op_name
from ccld.errors import CcldError

REQUIRED = ("rank", "op", "start", "duration")
KINDS = ("collective", "p2p", "compute")
MAX_RANK = 1 << 17    # as the timeline's MAX_WORLD_SIZE: a larger rank is a damaged row
MAX_SHOWN = 20        # bad-row lines printed; the rest are counted
DEFAULT_GROUP = "world"  # rows with no group: every rank of the job
COLLECTIVES = {"allreduce", "allgather", "reduce_scatter", "reducescatter", "broadcast", "reduce", "barrier",
               "monitored_barrier", "alltoall", "gather", "scatter", "allgather_into_tensor", "reduce_scatter_tensor",
               "alltoall_base", "alltoall_single", "allreduce_coalesced", "allgather_coalesced",
               "allgather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced", "allgather_base",
               "reduce_scatter_base"}
P2P_OPS = {"send": "send", "recv": "recv", "isend": "send", "irecv": "recv"}


class OpsTableError(CcldError):
    """A per-op table cannot be read (named file, and the column or row)."""


def normalize_op(name: str) -> str:
    """"nccl:all_reduce", "AllReduce", "all-reduce" -> "allreduce": ccld's (c10d's) vocabulary."""
    name = name.strip().lower().replace("-", "_")
    name = op_name(name)
    for prefix in ("nccl", "gloo"):  # ncclAllReduce -> ncclallreduce
        if name.startswith(prefix) and name[len(prefix):].lstrip("_") in COLLECTIVES:
            name = name[len(prefix):].lstrip("_")
    name = name.lstrip("_") if name.lstrip("_") in COLLECTIVES else name
    return "reduce_scatter" + name[len("reducescatter"):] if name.startswith("reducescatter") else name


def guess_kind(op: str) -> str:
    """The kind of an op (normalize_op'd) when the table does not say it."""
    return "collective" if op in COLLECTIVES else "p2p" if op in P2P_OPS else "compute"


@dataclass
class Row:
    n: int               # data row number, from 1
    rank: int
    op: str              # normalized
    kind: str
    start: float         # table seconds
    duration: Optional[float]  # None: not over when the table ended
    group: str
    seq: Optional[int]
    peer: Optional[int]
    step: Optional[int]
    nbytes: int


@dataclass
class OpsTable:
    path: str
    fmt: str
    rows: List[Row]
    bad: List[str]              # the first MAX_SHOWN bad-row messages
    bad_rows: int = 0

    def bad_row(self, msg: str) -> None:
        self.bad_rows += 1
        if len(self.bad) < MAX_SHOWN:
            self.bad.append(msg)

    def bad_lines(self) -> List[str]:
        """One line per bad row (the first MAX_SHOWN), then how many more there were."""
        more = self.bad_rows - len(self.bad)
        return self.bad + ([f"{self.path}: {more} more bad rows (not shown)"] if more > 0 else [])


# ---- reading --------------------------------------------------------------------------------------

def _format(path: str, head: bytes) -> str:
    """csv, jsonl or parquet: from the name, else from the first bytes (of the decompressed text)."""
    name = path.lower()
    name = name[:-3] if name.endswith(".gz") else name
    if head[:4] == b"PAR1" or name.endswith((".parquet", ".pq")):
        return "parquet"
    if name.endswith((".jsonl", ".ndjson", ".json")):
        return "jsonl"
    if name.endswith((".csv", ".txt")):
        return "csv"
    if head[:2] == b"\x1f\x8b":
        try:
            with gzip.open(path, "rb") as f:
                head = f.read(64)
        except (OSError, EOFError, zlib.error):
            return "csv"  # damaged: reading it as CSV says where
    return "jsonl" if head.lstrip()[:1] == b"{" else "csv"


def _records(path: str, table: OpsTable) -> Iterator[Tuple[int, Dict[str, Any]]]:
    """(row number, raw mapping) of every data row; sets table.fmt; raises OpsTableError for a file
    that cannot be read at all or lacks a required column."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError as e:
        raise OpsTableError(f"{path}: cannot read: {e.strerror or e}") from None
    if not head:
        raise OpsTableError(f"{path}: empty file")
    gz = head[:2] == b"\x1f\x8b"
    fmt = _format(path, head)
    if fmt == "parquet":
        table.fmt = "parquet"
        yield from _parquet(path)
        return
    table.fmt = fmt + (".gz" if gz else "")
    n = 0
    try:
        with contextlib.ExitStack() as stack:
            f = gz_lines(path) if gz else stack.enter_context(open(path, "r", encoding="utf-8", newline=""))
            if fmt == "csv":
                reader = csv.DictReader(f)
                cols = [c.strip() for c in reader.fieldnames or []]
                reader.fieldnames = cols
                _need(path, cols)
                for n, rec in enumerate(reader, 1):
                    yield n, rec
            else:
                seen: set = set()
                for line in f:
                    if not line.strip():
                        continue
                    n += 1
                    try:
                        rec = json.loads(line)
                    except ValueError as e:
                        table.bad_row(f"{path}: row {n}: not a JSON object ({e})")
                        continue
                    if not isinstance(rec, dict):
                        table.bad_row(f"{path}: row {n}: a JSON {type(rec).__name__}, not an object")
                        continue
                    seen.update(c for c in REQUIRED if c in rec)
                    yield n, rec
                if n:
                    _need(path, [c for c in REQUIRED if c in seen])
    except EOFError:
        table.bad_row(f"{path}: truncated after row {n}: the compressed data ends early; the rows before it "
                      "are read")
    except zlib.error as e:
        table.bad_row(f"{path}: damaged compressed data after row {n} ({e}); the rows before it are read")
    except UnicodeDecodeError as e:
        table.bad_row(f"{path}: after row {n}: not UTF-8 text ({e}); the rows before it are read")
    except csv.Error as e:
        table.bad_row(f"{path}: after row {n}: not CSV ({e}); the rows before it are read")


def gz_lines(path: str) -> Iterator[str]:
    """The lines of a gzip file (several members too), each with its newline. zlib rather than the gzip
    module, so a truncated file gives every line before the cut (the cut line itself is dropped) and
    then EOFError; damaged data raises zlib.error."""
    dec = codecs.getincrementaldecoder("utf-8")()
    z = zlib.decompressobj(wbits=31)
    tail = ""
    with open(path, "rb") as f:
        for data in iter(lambda: f.read(1 << 16), b""):
            while data:
                text = tail + dec.decode(z.decompress(data))
                *lines, tail = text.split("\n")
                for line in lines:
                    yield line + "\n"
                data = z.unused_data if z.eof else b""
                if data:
                    z = zlib.decompressobj(wbits=31)  # the next member of a concatenated file
    if not z.eof:
        raise EOFError("the compressed stream has no end marker")
    tail += dec.decode(b"", final=True)
    if tail:
        yield tail


def _need(path: str, cols: List[str]) -> None:
    missing = [c for c in REQUIRED if c not in cols]
    if missing:
        raise OpsTableError(f"{path}: missing column{'s' * (len(missing) > 1)} {', '.join(map(repr, missing))} "
                            f"(found: {', '.join(cols) or 'none'}); a per-op table needs "
                            f"{', '.join(REQUIRED)} (docs/ops-table.md)")


def _parquet(path: str) -> Iterator[Tuple[int, Dict[str, Any]]]:
    try:
        import pyarrow.parquet as pq  # optional: only Parquet needs it
    except ImportError:
        raise OpsTableError(f"{path}: reading Parquet needs pyarrow, which is not installed: "
                            "`pip install pyarrow` (or give the table as CSV or JSON Lines)") from None
    try:
        pf = pq.ParquetFile(path)
        _need(path, list(pf.schema_arrow.names))
        n = 0
        for batch in pf.iter_batches(columns=[c for c in pf.schema_arrow.names]):
            for rec in batch.to_pylist():
                n += 1
                yield n, rec
    except OpsTableError:
        raise
    except Exception as e:  # pyarrow's errors (ArrowInvalid, OSError) on a damaged or truncated file
        raise OpsTableError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None


def _absent(v: Any) -> bool:
    return v is None or (isinstance(v, str) and not v.strip()) or (isinstance(v, float) and math.isnan(v))


def _num(v: Any, col: str, want: str) -> float:
    if not isinstance(v, bool):  # True is an int to Python, not a time or a rank
        try:
            return float(v)  # numbers, and text with spaces around it
        except (TypeError, ValueError):
            pass
    raise ValueError(f"column {col!r}: expected {want}, found {v!r:.40}")


def _int(v: Any, col: str) -> int:
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    x = _num(v, col, "an integer")
    if not x.is_integer():
        raise ValueError(f"column {col!r}: expected an integer, found {v!r:.40}")
    return int(x)


def _float(v: Any, col: str) -> float:
    x = _num(v, col, "seconds (a number)")
    if not math.isfinite(x) or x < 0:
        raise ValueError(f"column {col!r}: expected seconds >= 0, found {v!r:.40}")
    return x


def _row(n: int, rec: Dict[str, Any]) -> Row:
    """One validated row; ValueError names the column."""
    for c in ("rank", "op", "start"):
        if _absent(rec.get(c)):
            raise ValueError(f"column {c!r}: empty")
    rank = _int(rec["rank"], "rank")
    if not 0 <= rank < MAX_RANK:
        raise ValueError(f"column 'rank': {rank} is not a rank (0..{MAX_RANK - 1})")
    if not isinstance(rec["op"], str):
        raise ValueError(f"column 'op': expected a name, found {rec['op']!r:.40}")
    op = normalize_op(rec["op"])
    kind = rec.get("kind")
    if _absent(kind):
        kind = guess_kind(op)
    elif not isinstance(kind, str) or kind.strip().lower() not in KINDS:
        raise ValueError(f"column 'kind': expected one of {', '.join(KINDS)}, found {kind!r:.40}")
    kind = kind.strip().lower()
    start = _float(rec["start"], "start")
    duration = None if _absent(rec.get("duration")) else _float(rec["duration"], "duration")
    opt = {c: None if _absent(rec.get(c)) else _int(rec[c], c) for c in ("seq", "peer", "step", "bytes")}
    if opt["seq"] is not None and opt["seq"] < 0:
        raise ValueError(f"column 'seq': expected a number >= 0, found {opt['seq']}")
    if kind == "p2p":
        if op not in P2P_OPS:
            raise ValueError(f"column 'op': a p2p op is send, recv, isend or irecv, found {rec['op']!r:.40}")
        if opt["peer"] is None or not 0 <= opt["peer"] < MAX_RANK:
            raise ValueError("column 'peer': a p2p row needs the peer's rank")
        op = P2P_OPS[op]
    group = rec.get("group")
    group = DEFAULT_GROUP if _absent(group) else str(group).strip()
    return Row(n=n, rank=rank, op=op, kind=kind, start=start, duration=duration, group=group, seq=opt["seq"],
               peer=opt["peer"], step=opt["step"], nbytes=-1 if opt["bytes"] is None else opt["bytes"])


def read_table(path: str) -> OpsTable:
    """Read and validate every row of `path`. Raises OpsTableError when nothing can be read."""
    table = OpsTable(path=path, fmt="", rows=[], bad=[])
    for n, rec in _records(path, table):
        try:
            table.rows.append(_row(n, rec))
        except ValueError as e:
            table.bad_row(f"{path}: row {n}: {e}")
    if not table.rows:
        raise OpsTableError(f"{path}: no readable rows" + (f" ({table.bad_rows} bad; first: {table.bad[0]})"
                                                            if table.bad else ""))
    return table
