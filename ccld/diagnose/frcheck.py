"""Findings from PyTorch Flight Recorder dumps (`ccld diagnose --flight-recorder DIR`).

The same Finding values the live detectors make, for the classes a set of dumps can support, per
process group (collective entries joined across ranks by (pg name, collective_seq_id)):
  inconsistent  the lowest seq whose op, sizes or dtypes differ between ranks: the ranks outside
                the largest agreeing group are blamed (Finding.stack: where they called it);
  not-entered   the lowest seq some members recorded and others did not: those others, with the
                last collective each did record; members that left no dump at all are blamed too
                when every dumped member waits (reason "no-dump");
  fault         (NCCL) every member entered the seq and it never completed: the members that never
                started it (state "scheduled" while others "started"), else all of them.
A collective is open on a rank when its entry is neither retired nor completed. Times: a dump holds
no time of its own, so `detected_at` is the newest dump file's mtime and the wait is measured per
rank (its file's mtime - its entry's time_created_ns, one host's clock). An open collective younger
than `floor_s` at dump time is in flight, not a hang. Slow classes need timing across ranks that
gloo dumps do not have (and NCCL's only per rank): not made here.
Caveat: gloo marks a timed-out collective retired like a completed one; a seq that some ranks
recorded and others did not is reported either way, with the waiters' state in the evidence.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Set, Tuple

from ccld.diagnose.findings import Finding
from ccld.diagnose.frdump import Dump, Entry, read_dir

FLOOR_S = 5.0   # as thresholds.FLOOR_S: an open collective this young at dump time may just be in flight
# Ops whose sizes and dtypes are the same on every rank (gather/scatter/alltoall differ by design).
SIZED_OPS = {"allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather", "_allgather_base",
             "allgather_into_tensor_coalesced", "reduce_scatter", "_reduce_scatter_base",
             "reduce_scatter_tensor_coalesced", "barrier"}
TORCH_DIRS = (os.sep + "torch" + os.sep,)  # frames inside torch are not where the user's code called


def op_name(profiling_name: str) -> str:
    """"gloo:all_reduce" -> "allreduce": ccld's vocabulary (the probes' names)."""
    name = profiling_name.split(":", 1)[-1]
    return name.replace("all_reduce", "allreduce").replace("all_gather", "allgather").replace("all_to_all", "alltoall")


def user_frame(frames: List[Dict[str, Any]]) -> Optional[str]:
    """'train.py:42 in step': the innermost frame outside torch (frames are innermost first)."""
    for fr in frames:
        fn = str(fr.get("filename", ""))
        if not any(d in fn for d in TORCH_DIRS):
            return f"{os.path.basename(fn)}:{fr.get('line')} in {fr.get('name')}"
    return None


def format_stack(frames: List[Dict[str, Any]]) -> str:
    """py-spy's shape, innermost first: '    all_reduce (torch/distributed/distributed_c10d.py:3245)'."""
    return "\n".join(f"    {fr.get('name')} ({fr.get('filename')}:{fr.get('line')})" for fr in frames)


class _Group:
    """One process group across the dumps."""

    def __init__(self, name: str):
        self.name = name
        self.desc = ""
        self.backend = ""
        self.members: Set[int] = set()
        self.colls: Dict[int, Dict[int, Entry]] = {}   # rank -> seq -> entry (collectives only)
        self.p2p = 0

    @property
    def comm(self) -> str:
        return f"{self.backend or 'pg'}:{self.name}"


def _groups(dumps: List[Dump]) -> Dict[str, _Group]:
    groups: Dict[str, _Group] = {}
    for d in dumps:
        for e in d.entries:
            g = groups.setdefault(e.pg, _Group(e.pg))
            g.desc = g.desc or (e.pg_desc if e.pg_desc != "undefined" else "")
            g.backend = g.backend or e.backend
            if e.p2p:
                g.p2p += 1
                continue
            g.colls.setdefault(d.rank, {})[e.seq] = e
        for name in d.pg_status:
            groups.setdefault(name, _Group(name)).members.add(d.rank)
    listed = [len(cfg["ranks"]) for d in dumps for cfg in d.pg_config.values() if cfg["ranks"]]
    world = max(listed + [max((d.rank for d in dumps), default=-1) + 1])
    for g in groups.values():
        g.members |= set(g.colls)
        configured = [cfg["ranks"] for d in dumps for name, cfg in d.pg_config.items()
                      if name == g.name and cfg["ranks"]]
        if configured:  # NCCL writes every group's global ranks; gloo writes one entry under "" (unusable)
            g.members = set(max(configured, key=len))
        elif g.desc == "default_pg" or g.name == "0":
            g.members |= set(range(world))
    return groups


def _signature(e: Entry) -> Tuple:
    op = op_name(e.name)
    if op in SIZED_OPS:
        return (op, repr(e.in_sizes), repr(e.in_dtypes), repr(e.out_sizes), repr(e.out_dtypes))
    return (op,)


def _inconsistent(g: _Group, by_rank: Dict[int, Dump], detected: float) -> Optional[Finding]:
    seqs = sorted({s for c in g.colls.values() for s in c})
    for seq in seqs:
        here = {r: c[seq] for r, c in g.colls.items() if seq in c}
        if len(here) < 2:
            continue
        sigs: Dict[Tuple, List[int]] = {}
        for r, e in sorted(here.items()):
            sigs.setdefault(_signature(e), []).append(r)
        if len(sigs) < 2:
            continue
        major = max(sigs.items(), key=lambda kv: (len(kv[1]), -kv[1][0]))
        odd = sorted(r for s, rs in sigs.items() if s != major[0] for r in rs)
        differ_ops = len({s[0] for s in sigs}) > 1
        what = "ops" if differ_ops else "sizes or dtypes"
        per_rank = {str(r): {"op": op_name(e.name), "input_sizes": e.in_sizes, "input_dtypes": e.in_dtypes,
                             "output_sizes": e.out_sizes, "called_at": user_frame(e.frames)}
                    for r, e in sorted(here.items())}
        odd_desc = ", ".join(f"rank {r} {op_name(here[r].name)}"
                             + ("" if differ_ops else f" {here[r].in_sizes} {here[r].in_dtypes}") for r in odd[:4])
        major_e = here[major[1][0]]
        summary = (f"different {what}: {odd_desc} where {len(major[1])} ranks call {op_name(major_e.name)}"
                   + ("" if differ_ops else f" {major_e.in_sizes} {major_e.in_dtypes}"))
        stacks = [f"rank {r} ({user_frame(here[r].frames) or 'no frames'}):\n{format_stack(here[r].frames)}"
                  for r in odd if here[r].frames]
        onset = min(e.created_ns for e in here.values()) / 1e9
        return Finding(kind="hang", cls="inconsistent", ranks=odd, comm=g.comm, seq=seq, op=op_name(major_e.name),
                       onset_at=onset, detected_at=max(detected, onset),
                       evidence={"source": "flight-recorder", "reason": "different-ops" if differ_ops else "different-sizes",
                                 "pg_desc": g.desc, "per_rank": per_rank, "summary": summary},
                       stack="\n".join(stacks) or None)
    return None


def _waited(entries: Dict[int, Entry], by_rank: Dict[int, Dump]) -> float:
    """How long the ranks had been inside at dump time, each on its own host's clock."""
    return max(by_rank[r].mtime - e.created_ns / 1e9 for r, e in entries.items())


def _hang(g: _Group, by_rank: Dict[int, Dump], detected: float, floor_s: float) -> Optional[Finding]:
    dumped = sorted(g.members & set(by_rank))
    no_dump = sorted(g.members - set(by_rank))
    if len(g.members) < 2 or not dumped:
        return None
    top = {r: max(g.colls.get(r, {0: None})) for r in dumped}   # 0: entered nothing in this group
    low, high = min(top.values()), max(top.values())
    base = {"source": "flight-recorder", "pg_desc": g.desc, "expected": len(g.members),
            "no_dump": no_dump or None, "dumps": {str(r): by_rank[r].path for r in dumped}}
    if low < high:
        # the lowest seq a member is missing (low + 1, unless ring buffers already dropped it)
        seq = min(s for r in dumped for s in g.colls.get(r, {}) if s > low)
        inside = {r: g.colls[r][seq] for r in dumped if seq in g.colls.get(r, {})}
        missing = sorted(r for r in dumped if top[r] < seq)
        blamed = missing + no_dump
        op = op_name(next(iter(inside.values())).name)
        all_done = all(e.done for e in inside.values())
        waited = _waited(inside, by_rank)
        if not all_done and waited < floor_s:
            return None  # the others entered moments before the dump: in flight
        details, fr_ranks = [], []
        for r in missing:
            last = g.colls.get(r, {}).get(top[r])
            details.append({"rank": r, "seen": True,
                            "last_entered": {"seq": top[r], "op": op_name(last.name)} if last else None})
            fr_ranks.append({"rank": r, "last_seq": top[r], "last_op": op_name(last.name) if last else None,
                             "last_called_at": user_frame(last.frames) if last else None,
                             "dump_age_s": round(detected - by_rank[r].mtime, 3)})
        waiting_at = next((user_frame(e.frames) for e in inside.values() if e.frames), None)
        summary = (f"{_who(sorted(inside))} in seq {seq} {op}" + (f" at {waiting_at}" if waiting_at else "")
                   + "; " + "; ".join(f"rank {x['rank']} last entered seq {x['last_seq']} {x['last_op'] or ''}"
                                       + (f" at {x['last_called_at']}" if x["last_called_at"] else "")
                                       for x in fr_ranks[:4]))
        if no_dump:
            summary += f"; no dump from rank(s) {no_dump}"
        evidence = dict(base, reason="not-entered", waiting=sorted(inside), waited_s=round(waited, 3),
                        waiters_done=all_done, waiting_at=waiting_at, ranks=details, fr_ranks=fr_ranks,
                        summary=summary)
        if all_done:
            evidence["note"] = ("the waiting ranks no longer wait: the collective failed or timed out there "
                                "(gloo retires a timed-out collective), or the others' dumps are newer")
        onset = min(e.created_ns for e in inside.values()) / 1e9
        return Finding(kind="hang", cls="not-entered", ranks=blamed, comm=g.comm, seq=seq, op=op,
                       onset_at=onset, detected_at=max(detected, onset), evidence=evidence)
    seq = high
    if seq <= 0:
        return None
    inside = {r: g.colls[r][seq] for r in dumped}
    if all(e.done for e in inside.values()):
        return None  # everyone finished its newest collective: between collectives
    waited = _waited(inside, by_rank)
    if waited < floor_s:
        return None
    op = op_name(next(iter(inside.values())).name)
    onset = min(e.created_ns for e in inside.values()) / 1e9
    if no_dump:
        waiting_at = next((user_frame(e.frames) for e in inside.values() if e.frames), None)
        summary = (f"{_who(dumped)} in seq {seq} {op}" + (f" at {waiting_at}" if waiting_at else "")
                   + f"; no dump from rank(s) {no_dump}")
        return Finding(kind="hang", cls="not-entered", ranks=no_dump, comm=g.comm, seq=seq, op=op, onset_at=onset,
                       detected_at=max(detected, onset),
                       evidence=dict(base, reason="no-dump", waiting=dumped, waited_s=round(waited, 3),
                                     summary=summary))
    states = {r: e.state for r, e in inside.items()}
    if g.backend == "nccl" and "started" in states.values() and "scheduled" in states.values():
        blamed, reason = sorted(r for r, s in states.items() if s == "scheduled"), "not-started"
    else:
        blamed, reason = dumped, "not-finished"
    summary = (f"every rank is inside seq {seq} {op} and it has not completed; "
               + (f"rank(s) {blamed} never started it" if reason == "not-started" else
                  "the dumps cannot tell which link or rank holds it"))
    return Finding(kind="hang", cls="fault", ranks=blamed, comm=g.comm, seq=seq, op=op, onset_at=onset,
                   detected_at=max(detected, onset),
                   evidence=dict(base, reason=reason, states={str(r): s for r, s in states.items()},
                                 waited_s=round(waited, 3), summary=summary))


def check(dumps: List[Dump], floor_s: float = FLOOR_S) -> List[Finding]:
    """Findings for a set of dumps (one per rank), one at most per process group."""
    if not dumps:
        return []
    by_rank = {d.rank: d for d in dumps}
    detected = max(d.mtime for d in dumps)
    out: List[Finding] = []
    for name, g in sorted(_groups(dumps).items(), key=lambda kv: (len(kv[0]), kv[0])):
        f = _inconsistent(g, by_rank, detected) or _hang(g, by_rank, detected, floor_s)
        if f is not None:
            out.append(f)
    return out


def diagnose_dumps(directory: str, prefix: Optional[str] = None,
                   floor_s: float = FLOOR_S) -> Tuple[List[Finding], List[Dump]]:
    dumps = read_dir(directory, prefix)
    return check(dumps, floor_s), dumps


def rank_span(ranks: List[int]) -> str:
    """"0-3" for a run of three or more ranks, else "0,2" (also in opframes.format_job)."""
    if ranks and ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def _who(ranks: List[int]) -> str:
    return f"rank {ranks[0]} waits" if len(ranks) == 1 else f"ranks {rank_span(ranks)} wait"


def format_dumps(dumps: List[Dump]) -> List[str]:
    """What was read: one line for the set, one per process group."""
    if not dumps:
        return []
    fmts = sorted({d.fmt for d in dumps})
    lines = [f"flight recorder: {len(dumps)} dumps ({'/'.join(fmts)}, version {dumps[0].version}, "
             f"{dumps[0].backend}) in {os.path.dirname(dumps[0].path) or '.'}: "
             f"ranks {rank_span([d.rank for d in dumps])}, {sum(len(d.entries) for d in dumps)} entries"]
    for name, g in sorted(_groups(dumps).items(), key=lambda kv: (len(kv[0]), kv[0])):
        seqs = sorted({s for c in g.colls.values() for s in c})
        lines.append(f"  pg {name}" + (f" ({g.desc})" if g.desc else "")
                     + f": members {rank_span(sorted(g.members))}"
                     + (f", seqs {seqs[0]}..{seqs[-1]}" if seqs else ", no collectives")
                     + (f", {g.p2p} p2p entries (not matched)" if g.p2p else ""))
    return lines


def format_detail(f: Finding) -> List[str]:
    """The dump-specific lines under a finding's one-line summary."""
    ev = f.evidence or {}
    if f.cls == "inconsistent":  # the summary is already on the finding's line: say where each called it
        per = ev.get("per_rank") or {}
        return [f"  rank {r} called {per[str(r)]['op']} at {per[str(r)]['called_at']}"
                for r in f.ranks[:8] if per.get(str(r), {}).get("called_at")]
    out = [f"  {ev['summary']}"] if ev.get("summary") else []
    if ev.get("note"):
        out.append(f"  note: {ev['note']}")
    return out
