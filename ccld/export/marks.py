"""Findings in the trace: a slice onset -> detected, and an instant at onset, on the `findings` track of
every rank a finding blames, so the culprit stands out beside its own collectives.

A finding that names a link (`link: [a, b]`, comm-slow and link faults) is drawn on both ranks of
the link, which are also the processes whose `link a->b` counter tracks show that link's throughput,
RTT and retransmissions. Findings are JSON dicts as the collector writes them (or Finding.to_json()).
Times: onset_at/detected_at are Unix seconds, drawn as Unix ns. Caveat: a finding written by another
ccld version is shown with its raw JSON when it cannot be formatted, rather than not at all.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Dict, List

from ccld.export.tracks import Proc

if TYPE_CHECKING:
    from ccld.export.model import TraceModel


def findings_dicts(findings) -> List[Dict[str, Any]]:
    """Hang and slow findings as JSON dicts, from Finding objects or dicts ("recovered" lines dropped)."""
    out = []
    for f in findings or []:
        d = f.to_json() if hasattr(f, "to_json") else f
        if isinstance(d, dict) and d.get("kind") in ("hang", "slow"):
            out.append(d)
    return out


def _link(f: Dict[str, Any]) -> List[int]:
    link = f.get("link")
    if isinstance(link, (list, tuple)) and len(link) == 2:
        return [int(link[0]), int(link[1])]
    return []


def write_findings(m: "TraceModel", findings: List[Dict[str, Any]]) -> None:
    """Every finding, in onset order; a malformed one is counted (stats bad_findings), never fatal."""
    def onset(f):
        return f.get("onset_at") if isinstance(f.get("onset_at"), (int, float)) else 0
    for f in sorted(findings, key=onset):
        try:
            _finding(m, f)
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError):
            m.stats["bad_findings"] += 1


def _finding(m: "TraceModel", f: Dict[str, Any]) -> None:
    from ccld.diagnose.findings import Finding, format_line
    onset = int(float(f["onset_at"]) * 1e9)
    detected = max(onset, int(float(f.get("detected_at") or f["onset_at"]) * 1e9))
    ranks = [int(r) for r in f.get("ranks") or []]
    link = _link(f)
    if detected < m.t_from or onset > m.t_to:
        return
    try:
        line = format_line(Finding(kind=f["kind"], cls=f["class"], ranks=ranks, link=link or None,
                                   comm=f.get("comm") or "", seq=f.get("seq", -1), op=f.get("op") or "",
                                   onset_at=onset / 1e9, detected_at=detected / 1e9,
                                   evidence=f.get("evidence") or {}, id=f.get("id") or ""))
    except Exception:  # a finding file from another version: show it raw rather than not at all
        line = json.dumps(f, default=str)[:200]
    name = f"{str(f['kind']).upper()} {f['class']}"
    args = [("id", f.get("id") or ""), ("class", f["class"]), ("ranks", ",".join(map(str, ranks))),
            ("comm", f.get("comm") or ""), ("seq", f.get("seq", -1)), ("op", f.get("op") or ""),
            ("waited_s", round((detected - onset) / 1e9, 3)), ("finding", line)]
    if link:
        args.insert(3, ("link", f"{link[0]}->{link[1]}"))
    placed = False
    for r in ranks + [r for r in link if r not in ranks]:  # both ends of a named link, always
        if m.ranks is not None and r not in m.ranks:
            continue
        p = rank_proc(m, f.get("job") or "", r, onset)
        t = p.findings.pick(onset, detected)
        if not t.declared:
            m.declare(t)
        m.sink.slice(t, onset, detected, name, args, instant_at_begin=name + " onset")
        m.stats["slices"] += 1
        m.stats["instants"] += 1
        placed = True
    m.stats["findings"] += placed


def rank_proc(m: "TraceModel", job: str, rank: int, at: int) -> Proc:
    """The process that was rank `rank` of `job` at time `at` (a restarted rank has several)."""
    cands = m.by_rank.get((job, rank))
    if not cands and not job:
        got = [v for (j, r), v in m.by_rank.items() if r == rank]
        cands = got[0] if len(got) == 1 else None
    if cands:
        before = [p for ts, p in cands if ts <= at]
        p = before[-1] if before else cands[0][1]
    else:  # blamed but never reported by any agent: give it a track of its own
        p = m.procs.get("not seen", {}).get(-rank - 1) or m.new_proc("not seen", -rank - 1, rank)
    m.proc_track(p)
    return p
