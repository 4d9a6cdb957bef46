"""Findings: what the detectors conclude, as values; printing them is `format_line`'s job.

A Finding's JSON shape is the one in DESIGN.md ("Findings"), plus `id` (stable: the same hang found
live and by replay has the same id) and `job`. Times (`onset_at`, `detected_at`, times inside the
evidence) are Unix seconds. `stack` is the culprits' Python stacks (py-spy, live only), else None.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

LINE_COLS = 100  # default terminal output fits 100 columns (STYLE.md)

STATE_NAMES = {"R": "running", "S": "sleeping", "D": "disk sleep", "T": "stopped", "t": "tracing stop",
               "Z": "zombie", "X": "dead", "I": "idle", "W": "paging", "P": "parked"}


@dataclass
class Finding:
    kind: str                      # "hang" | "slow" | "info" (a verdict that blames nobody: `spread`)
    cls: str                       # the JSON "class": not-entered, inconsistent, fault, comp-slow, ...
    ranks: List[int]               # global ranks the finding blames
    comm: str
    seq: int
    op: str
    onset_at: float
    detected_at: float
    evidence: Dict[str, Any] = field(default_factory=dict)
    link: Optional[List[int]] = None   # a rank pair, when the finding is localised to a link
    stack: Optional[str] = None
    job: str = ""
    id: str = ""

    def __post_init__(self) -> None:
        self.ranks = sorted(self.ranks)
        if not self.id:
            h = hashlib.sha1(repr(self.key()).encode()).hexdigest()[:12]
            self.id = f"{self.kind}-{h}"

    def key(self) -> Tuple[str, str, int, Tuple[int, ...]]:
        """What makes two findings the same one (the tracker reports each key once)."""
        return (self.cls, self.comm, self.seq, tuple(self.ranks))

    def to_json(self) -> Dict[str, Any]:
        """A JSON-ready dict in DESIGN.md's key order, then id and job."""
        return {"kind": self.kind, "class": self.cls, "ranks": list(self.ranks), "link": self.link,
                "comm": self.comm, "seq": self.seq, "op": self.op, "onset_at": self.onset_at,
                "detected_at": self.detected_at, "evidence": self.evidence, "stack": self.stack,
                "id": self.id, "job": self.job}

    def json_line(self) -> str:
        return json.dumps(self.to_json(), sort_keys=False, default=str)


def recovery_record(f: Finding, recovered_at: float) -> Dict[str, Any]:
    return {"kind": "recovered", "id": f.id, "class": f.cls, "ranks": list(f.ranks), "comm": f.comm,
            "seq": f.seq, "recovered_at": recovered_at}


def _ranks_text(ranks: List[int], most: int = 8) -> str:
    shown = ",".join(str(r) for r in ranks[:most])
    return f"[{shown}{',...+%d' % (len(ranks) - most) if len(ranks) > most else ''}]"


def rank_detail(r: Dict[str, Any], compact: int = 0) -> str:
    """One rank's evidence in words: 'rank 2 S (sleeping) in hrtimer_nanosleep, last entered seq 56'.

    compact >= 1 drops the state's name, >= 2 shortens "last entered seq", >= 5 clips the wchan.
    """
    text = f"rank {r.get('rank')}"
    if not r.get("seen", True):
        text += " not reported by any agent"
    elif r.get("exited_at") is not None:
        text += f" exited ({r.get('exit_reason') or 'exited'})"
    elif r.get("state"):
        text += f" {r['state']}" + ("" if compact >= 1 else f" ({STATE_NAMES.get(r['state'], '?')})")
        wchan = r.get("wchan") or ""
        if wchan and wchan != "0":
            text += f" in {wchan[:16] if compact >= 5 else wchan}"
    if (r.get("cpu_busy") or 0) >= 0.5 and r.get("exited_at") is None:  # busy, not waiting: worth a word
        text += f", cpu {100 * r['cpu_busy']:.0f}%"
    elsewhere = r.get("doing") in ("in-collective", "in-p2p")
    if elsewhere:  # waiting in another operation: the most useful words, kept at every compaction
        text += f" {r.get('doing_text')}"
    last = r.get("last_entered")
    if elsewhere and compact >= 3:
        pass
    elif last:
        text += f", last {'' if compact >= 2 else 'entered '}seq {last['seq']}"
    elif r.get("seen", True):
        text += ", entered nothing yet"
    return text


def short_comm(comm: str) -> str:
    """`host:port/gloo:0` -> `gloo:0`: the job prefix is in the JSON; on the terminal it only costs width."""
    return comm.rsplit("/", 1)[-1] if comm else comm


def format_line(f: Union[Finding, Dict[str, Any]]) -> str:
    """One readable line for a Finding or a recovery record, made more compact until it fits LINE_COLS."""
    if isinstance(f, dict):
        where = f"{short_comm(f.get('comm'))}" + (f" seq {f.get('seq')}" if (f.get("seq") or 0) >= 0 else "")
        if f.get("kind") == "recovered":
            line = f"RECOVERED {f.get('class')} ranks {_ranks_text(f.get('ranks') or [])} {where} ({f.get('id')})"
        elif f.get("kind") == "updated":
            line = f"UPDATED {f.get('class')} {_ranks_text(f.get('ranks') or [])} {where}: {f.get('summary')}"
        else:
            raise TypeError("format_line takes a Finding, a recovery record or an update record")
        return line if len(line) <= LINE_COLS else line[:LINE_COLS - 3] + "..."
    ev = f.evidence or {}
    if f.kind == "info":  # no culprit: what the job does, in words
        line = f"INFO {f.cls} {short_comm(f.comm)} {f.op}: {ev.get('summary') or ev.get('note') or ''}"
        return line if len(line) <= LINE_COLS else line[:LINE_COLS - 3] + "..."
    if f.kind == "slow" and not ev.get("informational"):
        line = (f"SLOW {f.cls} {_ranks_text(f.ranks)} {short_comm(f.comm)} {f.op}"
                + (f" link {f.link[0]}->{f.link[1]}" if f.link else "") + f": {ev.get('summary') or ev.get('note') or ''}")
        return line if len(line) <= LINE_COLS else line[:LINE_COLS - 3] + "..."
    if f.cls == "inconsistent":
        line = f"HANG inconsistent {_ranks_text(f.ranks)} {short_comm(f.comm)} seq {f.seq}: {ev.get('summary', '')}"
        return line if len(line) <= LINE_COLS else line[:LINE_COLS - 3] + "..."
    inside = ev.get("reason") in ("not-started", "not-finished")
    waited = f.detected_at - f.onset_at
    details = list(ev.get("ranks") or [])
    if ev.get("deadlock"):  # the rank waiting elsewhere says what closes the cycle
        details.sort(key=lambda d: d.get("doing") not in ("in-collective", "in-p2p"))
    p2p = ev.get("p2p") or {}
    if p2p:  # the stream: data flows src -> dst; the waiter is one end
        src, dst = (p2p.get("waiter"), p2p.get("peer")) if f.op == "send" else (p2p.get("peer"), p2p.get("waiter"))
        what = f"{short_comm(f.comm)} {f.op} {src}->{dst} #{f.seq}"
    else:
        what = f"{short_comm(f.comm)} seq {f.seq} {f.op}"
    line = ""
    for compact in range(6):
        verb = ("inside for " if inside else "waiting ") if compact < 4 else ""
        kind = "INFO" if ev.get("informational") else f.kind.upper()
        head = f"{kind} {f.cls} {'ranks ' if compact < 3 else ''}{_ranks_text(f.ranks)} {what}: {verb}{waited:.1f} s"
        parts = [head]
        if ev.get("failed_ranks"):
            parts.append(f"errors on {_ranks_text(ev['failed_ranks'])}")
        if ev.get("informational"):
            parts.append(("busy outside communication: " if compact < 2 else "") + "a pause, not a hang")
        if ev.get("deadlock"):
            parts.append("cross-communicator deadlock" if compact < 2 else "deadlock")
        if f.link and ev.get("summary"):
            parts.append(ev["summary"] if compact < 3 else f"link {f.link[0]}->{f.link[1]}")
        if ev.get("reason") == "not-started":
            parts.append("never started it")
        elif ev.get("reason") == "not-finished":
            parts.append("never finished it")
        if details:
            d = rank_detail(details[0], compact)
            parts.append(d + (f" (+{len(details) - 1})" if len(details) > 1 and compact < 5 else ""))
        line = "; ".join(parts)
        if len(line) <= LINE_COLS:
            return line
    return line[:LINE_COLS - 3] + "..."
