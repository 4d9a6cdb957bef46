"""Canonical forms of ccld's outputs, and their comparison: the half of the rewrite guard
(bench/compare_outputs.py) that runs nothing. Each canon_* function turns one output into a list of
items in which only content remains; `compare` says what differs between two such lists.

  findings (`diagnose --json`), links, failure records: JSON objects, IGNORED_FINDING_FIELDS dropped
  Chrome JSON: its trace events; flow events (s/t/f) grouped by flow, their ids dropped (ids only
    number the flows); the top-level keys other than traceEvents
  Perfetto: tracks, slices (BEGIN paired with END on its track), instants, counters, flows and other
    packets, read with perfetto's shipped TracePacket protos; interning resolved, track uuids replaced
    by track paths ("rank 0 (vm, pid 1) / calls"), flow ids by their members, encoding fields
    (PERFETTO_ENCODING_FIELDS) dropped, debug annotations sorted
  text and HTML: lines in reading order, whitespace folded, VOLATILE_TEXT replaced; in HTML only the
    text outside style/script, a line per block element, embedded images by SHA-256, and the
    attributes that carry data (alt, title, data-*)
Every float is rounded to FLOAT_DECIMALS places. Caveats: a slice's BEGIN and END are paired by their
order on the track, as Perfetto pairs them; an END without a BEGIN is an item of its own. A flow is
every event that carries its id, over the whole trace: right while ids are not reused (ccld's
exporter numbers flows from one counter); a writer that reused them would show merged flows.
Decoding Perfetto in Python runs at about 15 k events/s: minutes for a million-event store.
"""
from __future__ import annotations

import collections
import csv
import difflib
import hashlib
import io
import json
import re
from html.parser import HTMLParser
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

# ---- what is not compared, and why ---------------------------------------------------------------
IGNORED_FINDING_FIELDS = (
    "stack",  # py-spy's dump of the culprit's live process: None offline, run-specific live
)
VOLATILE_TEXT = (
    (re.compile(r"generated \d{4}-\d\d-\d\d \d\d:\d\d UTC"), "generated <time> UTC"),  # report header
)
FLOAT_DECIMALS = 6
# Perfetto packet fields that say how the trace is encoded, not what it holds
PERFETTO_ENCODING_FIELDS = ("trusted_packet_sequence_id", "sequence_flags", "interned_data",
                            "incremental_state_cleared", "first_packet_on_sequence",
                            "previous_packet_dropped", "trusted_uid", "trusted_pid")
# interned references -> (the interned_data table, the field the resolved value replaces them with)
PERFETTO_INTERNED = {"name_iid": ("event_names", "name"), "category_iids": ("event_categories", "categories"),
                     "string_value_iid": ("debug_annotation_string_values", "string_value")}

SHOWN = 5            # differing items shown per (store, command)
CHANGES_SHOWN = 3      # changed fields shown per paired item
CLIP_KEEP = 30         # characters kept before the first difference of two long texts
PAIR_CANDIDATES = 200  # new items of one identity searched for the closest to a ref item (bounds the work)


# ---- canonical forms (pure functions; tests/unit/test_compare_outputs.py) ------------------------

def round_floats(x: Any, places: int = FLOAT_DECIMALS) -> Any:
    if isinstance(x, float):
        return round(x, places)
    if isinstance(x, dict):
        return {k: round_floats(v, places) for k, v in x.items()}
    if isinstance(x, list):
        return [round_floats(v, places) for v in x]
    return x


def canon_records(lines: Iterable[str]) -> List[Any]:
    """JSON lines (findings, recoveries, failure records, links) as objects without ignored fields."""
    out = []
    for line in lines:
        if line.strip():
            obj = json.loads(line)
            if isinstance(obj, dict):
                obj = {k: v for k, v in obj.items() if k not in IGNORED_FINDING_FIELDS}
            out.append(round_floats(obj))
    return out


def canon_csv(text: str) -> List[Dict[str, Any]]:
    """A CSV with a header (the failure trace) as one object a row, the header as an item of its own."""
    rows = list(csv.reader(io.StringIO(text)))
    if not rows:
        return []
    head = rows[0]
    out: List[Dict[str, Any]] = [{"header": head}]
    for r in rows[1:]:
        out.append({k: v for k, v in zip(head, r) if k not in IGNORED_FINDING_FIELDS})
    return out


def canon_chrome(trace: Any) -> List[Any]:
    """Chrome JSON (object or bare array form): the events, flows as one item each (their members,
    without the id, which only numbers them), and the top-level keys other than traceEvents."""
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    out: List[Dict[str, Any]] = []
    flows: Dict[Tuple[Any, ...], List[Dict[str, Any]]] = collections.defaultdict(list)
    for e in events:
        if isinstance(e, dict) and e.get("ph") in ("s", "t", "f") and "id" in e:
            flows[(e.get("cat"), e.get("name"), json.dumps(e["id"]))].append(
                {k: v for k, v in e.items() if k not in ("id", "cat", "name")})
        else:
            out.append(e)
    for (cat, name, _), members in flows.items():
        out.append({"ph": "flow", "cat": cat, "name": name, "members": sorted(members, key=key_text)})
    if isinstance(trace, dict):
        out.extend({"meta": {k: v}} for k, v in trace.items() if k != "traceEvents")
    return list(round_floats(out))


def canon_perfetto(data: bytes) -> List[Any]:
    """A Perfetto trace's content, independent of packet order, interning, uuids and flow ids."""
    from google.protobuf.json_format import MessageToDict
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

    def as_dict(m: Any) -> Dict[str, Any]:
        return dict(MessageToDict(m, preserving_proto_field_name=True))

    trace = pb.Trace()
    trace.ParseFromString(data)
    labels: Dict[int, Tuple[str, int]] = {}
    for p in trace.packet:
        if p.HasField("track_descriptor"):
            d = p.track_descriptor
            label = d.name or d.thread.thread_name or d.process.process_name or f"track {d.uuid}"
            labels[d.uuid] = (label, d.parent_uuid if d.HasField("parent_uuid") else 0)

    def path(uuid: int) -> str:
        parts, seen = [], set()
        while uuid and uuid not in seen:
            seen.add(uuid)
            label, uuid = labels.get(uuid, (f"<undeclared {uuid}>", 0))
            parts.append(label)
        return " / ".join(reversed(parts))

    out: List[Dict[str, Any]] = []
    tables: Dict[int, Dict[str, Dict[int, str]]] = {}
    open_: Dict[int, List[Dict[str, Any]]] = collections.defaultdict(list)
    flows: Dict[int, List[List[Any]]] = collections.defaultdict(list)
    cleared = pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
    for p in trace.packet:
        seq = p.trusted_packet_sequence_id
        if p.sequence_flags & cleared or p.incremental_state_cleared or seq not in tables:
            tables[seq] = collections.defaultdict(dict)
        if p.HasField("interned_data"):
            for field, entries in p.interned_data.ListFields():
                for e in entries:
                    value = e.name if hasattr(e, "name") else e.str.decode("utf-8", "replace")
                    tables[seq][field.name][e.iid] = value
        if p.HasField("track_descriptor"):
            d = as_dict(p.track_descriptor)
            d.pop("uuid", None)
            d.pop("parent_uuid", None)
            out.append({"kind": "track", "track": path(p.track_descriptor.uuid), **d})
        rest = {k: v for k, v in as_dict(p).items()
                if k not in PERFETTO_ENCODING_FIELDS + ("track_descriptor", "track_event", "timestamp")}
        if rest:
            out.append({"kind": "packet", "timestamp": p.timestamp, **rest})
        if not p.HasField("track_event"):
            continue
        te = p.track_event
        ev = _resolve(as_dict(te), tables[seq])
        for k in ("track_uuid", "type", "flow_ids", "terminating_flow_ids"):
            ev.pop(k, None)
        where = path(te.track_uuid)
        for ids, role in ((te.flow_ids, "out"), (te.terminating_flow_ids, "in")):
            for fid in ids:
                flows[fid].append([where, p.timestamp, role])
        kind = pb.TrackEvent.Type.Name(te.type).replace("TYPE_", "").lower()
        if kind == "slice_end":
            if open_[te.track_uuid]:
                s = open_[te.track_uuid].pop()
                s["end"] = p.timestamp
                if ev:
                    s["end_fields"] = ev
            else:
                out.append({"kind": "unmatched slice end", "track": where, "ts": p.timestamp, **ev})
            continue
        item = {"kind": kind, "track": where, "ts": p.timestamp, **ev}
        if kind == "slice_begin":
            item.update(kind="slice", end=None)  # end None: never ended
            open_[te.track_uuid].append(item)
        out.append(item)
    out.extend({"kind": "flow", "members": sorted(m)} for m in flows.values())
    return list(round_floats(out))


def _resolve(ev: Dict[str, Any], tables: Dict[str, Dict[int, str]]) -> Dict[str, Any]:
    """Replace interned ids by what they name, in a track event and its debug annotations."""
    def one(d: Dict[str, Any], names: str) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for k, v in d.items():
            if k == "name_iid":
                out["name"] = tables.get(names, {}).get(int(v), f"<iid {v}>")
            elif k in PERFETTO_INTERNED:
                table, field = PERFETTO_INTERNED[k]
                got = [tables.get(table, {}).get(int(i), f"<iid {i}>") for i in (v if isinstance(v, list) else [v])]
                out[field] = got if isinstance(v, list) else got[0]
            else:
                out[k] = v
        return out

    ev = one(ev, "event_names")
    if "debug_annotations" in ev:  # order of arguments is not content
        ev["debug_annotations"] = sorted((one(a, "debug_annotation_names") for a in ev["debug_annotations"]),
                                         key=key_text)
    return ev


class _PageText(HTMLParser):
    """A page's text in reading order: a line per block element, the plots as digests, the
    attributes that carry data (alt, title, data-*) as lines of their own."""
    BLOCKS = {"p", "div", "tr", "li", "h1", "h2", "h3", "h4", "section", "table", "br", "pre", "ul",
              "summary", "details", "footer", "nav", "thead", "tbody", "title"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.lines: List[str] = []
        self.cur: List[str] = []
        self.skip = 0

    def _break(self) -> None:
        text = " ".join("".join(self.cur).split())
        if text:
            self.lines.append(text)
        self.cur = []

    def handle_starttag(self, tag: str, attrs: List[Tuple[str, Optional[str]]]) -> None:
        if tag in ("style", "script"):
            self.skip += 1
        if tag in self.BLOCKS:
            self._break()
        for k, v in attrs:
            v = v or ""
            if k == "src" and v.startswith("data:"):
                self._break()
                self.lines.append(f"[{tag} {len(v)} bytes sha256:{hashlib.sha256(v.encode()).hexdigest()[:16]}]")
            elif k in ("alt", "title") or k.startswith("data-"):
                self._break()
                self.lines.append(f"[{k}={' '.join(v.split())}]")

    def handle_endtag(self, tag: str) -> None:
        if tag in ("style", "script"):
            self.skip = max(0, self.skip - 1)
        if tag in self.BLOCKS:
            self._break()

    def handle_data(self, data: str) -> None:
        if not self.skip:
            self.cur.append(data)


def canon_text(text: str) -> List[str]:
    """Plain text as lines, whitespace folded, volatile parts replaced."""
    lines = [" ".join(ln.split()) for ln in text.splitlines()]
    return [_scrub(ln) for ln in lines if ln]


def canon_html(text: str) -> List[str]:
    parser = _PageText()
    parser.feed(text)
    parser.close()
    parser._break()
    return [_scrub(ln) for ln in parser.lines]


def _scrub(line: str) -> str:
    for pattern, repl in VOLATILE_TEXT:
        line = pattern.sub(repl, line)
    return line


# ---- comparing -----------------------------------------------------------------------------------

def key_text(x: Any) -> str:
    return x if isinstance(x, str) else json.dumps(x, sort_keys=True, separators=(",", ":"), default=str)


def clip_pair(a: str, b: str, keep: int = CLIP_KEEP) -> Tuple[str, str]:
    """Two long texts cut to where they start to differ (with `keep` characters before it)."""
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    if at <= keep:
        return a, b
    return "..." + a[at - keep:], "..." + b[at - keep:]


def field_changes(a: Any, b: Any, where: str = "") -> List[str]:
    """'path: old -> new' for every leaf that differs between two JSON values."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in list(a) + [k for k in b if k not in a]:
            out += field_changes(a.get(k, "<absent>"), b.get(k, "<absent>"), f"{where}.{k}" if where else str(k))
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [c for i, (x, y) in enumerate(zip(a, b)) for c in field_changes(x, y, f"{where}[{i}]")]
    if a == b:
        return []
    x, y = clip_pair(key_text(a), key_text(b))
    return [f"{where or 'value'}: {x} -> {y}"]


def _ident(x: Any) -> str:
    """An identity as a few words: its values that are set, joined by spaces."""
    return " ".join(key_text(v) for v in (x if isinstance(x, list) else [x]) if v is not None)


def compare(ref: List[Any], new: List[Any], ordered: bool = False,
            pair: Optional[Callable[[Any], Any]] = None, shown: int = SHOWN) -> Dict[str, Any]:
    """The differences between two canonical outputs: counts of items only in one of them, and the
    first `shown` differences as lines. Multisets (ordered=False): an item of the ref and one of the
    new output with the same identity (`pair`) are shown as the fields that changed ("~"), others as
    "-" (ref only) and "+" (new only). Sequences (ordered=True): a line diff, replaced lines cut to
    where they start to differ."""
    if ordered:
        return _compare_lines([key_text(x) for x in ref], [key_text(x) for x in new], shown)
    ca, cb = collections.Counter(map(key_text, ref)), collections.Counter(map(key_text, new))
    only_a, only_b = sorted((ca - cb).elements()), sorted((cb - ca).elements())
    out: List[str] = []
    used: Set[int] = set()
    by_id: Dict[str, List[int]] = collections.defaultdict(list)

    def ident(item: str) -> Optional[str]:
        x = json.loads(item)
        return key_text(pair(x)) if pair is not None and isinstance(x, dict) else None

    for i, s in enumerate(only_b if pair is not None else []):
        by_id[ident(s) or ""].append(i)
    n = 0
    for s in only_a:
        if n >= shown:
            break
        n += 1
        key = ident(s)
        cands = [i for i in by_id.get(key, []) if i not in used][:PAIR_CANDIDATES] if key else []
        if pair is None or not cands:
            out.append(f"- {s}")
            continue
        # the most alike of the new items with the same identity: the fewest fields changed
        a = json.loads(s)
        _, best, changes = min((len(c), i, c) for i in cands for c in [field_changes(a, json.loads(only_b[i]))])
        used.add(best)
        out.append(f"~ {_ident(pair(a))}")
        out += [f"    {c}" for c in changes[:CHANGES_SHOWN]]
        out += [f"    (+{len(changes) - CHANGES_SHOWN} more fields)"] if len(changes) > CHANGES_SHOWN else []
    for i, s in enumerate(only_b):
        if n >= shown:
            break
        if i not in used:
            n += 1
            out.append(f"+ {s}")
    return {"same": not only_a and not only_b, "ref_items": len(ref), "new_items": len(new),
            "only_ref": len(only_a), "only_new": len(only_b), "shown": out}


def _compare_lines(a: List[str], b: List[str], shown: int) -> Dict[str, Any]:
    out: List[str] = []
    only_a = only_b = 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        only_a, only_b = only_a + i2 - i1, only_b + j2 - j1
        for k in range(max(i2 - i1, j2 - j1)):
            x, y = (a[i1 + k] if i1 + k < i2 else None), (b[j1 + k] if j1 + k < j2 else None)
            if x is not None and y is not None:
                x, y = clip_pair(x, y)
            if len(out) < 2 * shown:
                out += [f"{sign} {t}" for sign, t in (("-", x), ("+", y)) if t is not None]
    return {"same": only_a == only_b == 0, "ref_items": len(a), "new_items": len(b),
            "only_ref": only_a, "only_new": only_b, "shown": out}


def finding_id(f: Dict[str, Any]) -> Any:
    return [f.get(k) for k in ("kind", "class", "comm", "seq", "ranks", "id")]


def event_id(e: Dict[str, Any]) -> Any:
    args: Dict[str, Any] = e["args"] if isinstance(e.get("args"), dict) else {}
    return [e.get(k) for k in ("kind", "ph", "cat", "name", "pid", "tid", "track")] + [args.get("seq")]


def record_id(r: Dict[str, Any]) -> Any:
    return sorted(r)  # links and CSV rows: the closest one with the same fields
