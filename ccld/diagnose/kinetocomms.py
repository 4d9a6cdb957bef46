"""Which process group, and which peer, each communication op of a Kineto trace belongs to (kineto.py reads them).

record_param_comms (NCCL; what c10d records where it does): "Process Group Name" ("0" is the default
group) with its "Process Group Description"; a send's peer is "Dst Rank", a recv's "Src Rank" (global
ranks: torch maps the group rank through the group's ranks), else "Rank" (the peer's group rank)
through "Process Group Ranks".
gloo annotations (`gloo:all_reduce`, torch 2.x's gloo writes no record_param_comms): nothing on the
event names its group. Each gloo process group runs its collectives on worker threads of its own
(ProcessGroupGloo's `threads`, 2 by default), created with the group, so thread ids rise in the order
the groups were made, the order of distributedInfo's pg_config (the groups this rank is a member of).
With G groups in pg_config and k x G worker threads seen, the i-th k threads by id are group i's.
Where that cannot be told (the count does not split, or a group ran nothing in the profile) all are
the default group's and the header says so; read_traces also checks the result across ranks (every
member of a group ran as many of its collectives, of the same ops and sizes) and undoes it where they
disagree.
gloo p2p (`gloo:send`, `gloo:recv` on the calling thread): the peer is the third argument ("Concrete
Inputs") of the c10d::send / c10d::recv_ op around the annotation: a rank of the op's group, which the
trace does not name: taken as the default group (global ranks), as pipelines usually send.
"""
from __future__ import annotations

import bisect
import collections
import json
from typing import Any, Dict, List, Optional, Tuple

from ccld.diagnose.optable import DEFAULT_GROUP

COMMS_OP = "record_param_comms"
DEFAULT_PG = "0"      # c10d's name of the default process group (every rank)
C10D_P2P = {"c10d::send": "send", "c10d::recv_": "recv"}  # the ops around gloo's p2p annotations
COUNT_SLACK = 0.05    # group members' collective counts may differ this much (profilers start apart)
MIN_SLACK = 2         # ... or by this many


def args_of(e: Dict[str, Any]) -> Dict[str, Any]:
    a = e.get("args")
    return a if isinstance(a, dict) else {}


def int_arg(v: Any) -> Optional[int]:
    """An integer arg of a trace event (an int, or digits in a string), else None."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, str) and v.strip().lstrip("-").isdigit():
        return int(v)
    return None


def group_of(args: Dict[str, Any]) -> str:
    """A record_param_comms op's process group: its name (with its description), the default group's
    as DEFAULT_GROUP (every rank; read_traces makes it TRACED_GROUP when ranks have no trace)."""
    name = args.get("Process Group Name")
    if name is None:
        return DEFAULT_GROUP
    name = str(name)
    if name == DEFAULT_PG:  # another group of every rank keeps its name: it numbers its own seqs
        return DEFAULT_GROUP
    desc = args.get("Process Group Description")
    return pg_label(name, desc)


def pg_label(name: str, desc: Any) -> str:
    return f"{name}({desc})" if isinstance(desc, str) and desc and desc not in ("undefined", "default_pg") else name


def comms_peer(op: str, args: Dict[str, Any]) -> Optional[int]:
    """The global rank a record_param_comms send/recv goes to or comes from, where the trace says it."""
    peer = int_arg(args.get("Dst Rank" if op == "send" else "Src Rank"))
    if peer is not None:
        return peer
    local, ranks = int_arg(args.get("Rank")), args.get("Process Group Ranks")
    if isinstance(ranks, str):
        try:
            ranks = json.loads(ranks)
        except ValueError:
            return None
    if local is not None and isinstance(ranks, list) and 0 <= local < len(ranks):
        return int_arg(ranks[local])
    return None


class GlooPeers:
    """The c10d::send / c10d::recv_ ops of one trace by thread: the peer of a gloo p2p annotation."""

    def __init__(self, evs: List[Dict[str, Any]]):
        by: Dict[Tuple[Any, Any], List[Tuple[float, float, str, Optional[int]]]] = collections.defaultdict(list)
        for e in evs:
            op = C10D_P2P.get(e["name"])
            if op is None:
                continue
            inputs = args_of(e).get("Concrete Inputs")
            peer = int_arg(inputs[2]) if isinstance(inputs, list) and len(inputs) > 2 else None
            ts = float(e["ts"])
            by[(e.get("pid"), e.get("tid"))].append((ts, ts + float(e.get("dur") or 0.0), op, peer))
        self.ops = {k: sorted(v) for k, v in by.items()}
        self.starts = {k: [o[0] for o in v] for k, v in self.ops.items()}

    def peer(self, e: Dict[str, Any], op: str) -> Optional[int]:
        key = (e.get("pid"), e.get("tid"))
        ts = float(e["ts"])
        i = bisect.bisect_right(self.starts.get(key, []), ts) - 1
        if i < 0:
            return None
        start, end, c10d_op, peer = self.ops[key][i]
        return peer if c10d_op == op and ts <= end else None


def gloo_groups(info: Dict[str, Any], threads: List[Tuple[Any, Any]]) -> Tuple[Dict[Tuple[Any, Any], str], str]:
    """(worker thread -> group, a line saying how) for the gloo collective annotations' threads of one
    trace; {} (all the default group's) where the groups cannot be told apart."""
    pgs = [p for p in info.get("pg_config") or [] if isinstance(p, dict) and p.get("pg_name") is not None]
    if len(pgs) < 2:
        return {}, ""
    if all(int_arg(p["pg_name"]) is not None for p in pgs):
        pgs.sort(key=lambda p: int_arg(p["pg_name"]))
    tids = sorted(set(threads), key=lambda k: (int_arg(k[1]) if int_arg(k[1]) is not None else -1, str(k)))
    if not tids or len(tids) % len(pgs):
        return {}, (f"{len(pgs)} gloo process groups but {len(tids)} worker threads with collectives: the groups "
                    "cannot be told apart, all taken as the default group")
    per = len(tids) // len(pgs)
    out = {}
    for i, p in enumerate(pgs):
        name = str(p["pg_name"])
        group = DEFAULT_GROUP if name == DEFAULT_PG else pg_label(name, p.get("pg_desc"))
        for k in tids[i * per:(i + 1) * per]:
            out[k] = group
    return out, f"{len(pgs)} gloo process groups told apart by their worker threads ({per} each, in creation order)"


def check_groups(rows_by_rank: Dict[int, List[Any]], mapped: Dict[int, bool]) -> List[str]:
    """Undo the thread mapping (rows back to the default group) where a group's members ran different
    numbers of its collectives, or different ops and sizes; returns what was undone, as lines."""
    counts: Dict[str, Dict[int, int]] = collections.defaultdict(dict)
    kinds: Dict[str, Dict[int, frozenset]] = collections.defaultdict(dict)
    for rank, rows in rows_by_rank.items():
        if mapped.get(rank):
            colls = [r for r in rows if r.kind == "collective"]
            for g, n in collections.Counter(r.group for r in colls).items():
                counts[g][rank] = n
                kinds[g][rank] = frozenset((r.op, r.nbytes) for r in colls if r.group == g)
    bad = sorted(g for g, per in counts.items() if g != DEFAULT_GROUP and (
        max(per.values()) - min(per.values()) > max(MIN_SLACK, COUNT_SLACK * max(per.values()))
        or len(set(kinds[g].values())) > 1))
    if not bad:
        return []
    for rank, rows in rows_by_rank.items():
        if mapped.get(rank):
            for r in rows:
                if r.kind == "collective":
                    r.group = DEFAULT_GROUP
    return [f"gloo group{'s' * (len(bad) > 1)} {', '.join(bad)}: members ran different collectives (counts, ops "
            "or sizes), so the worker threads were not told apart right; all taken as the default group"]
