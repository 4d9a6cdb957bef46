"""The report's written sections: health (status, counts, losses and damage, communicators, each rank
at the end of the recording, runqueue wait), the findings with their evidence, and how to open the
Perfetto trace. HTML only, every value escaped (htmlkit); the plots are report_plots.py's and
report_links.py's. Times: Unix seconds, shown as UTC and as seconds since the recording began. Caveat:
long lists are cut at MAX_RANK_ROWS and MAX_FINDINGS_SHOWN, saying how many more there are.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

from ccld.timeline.records import Comm
from ccld.timeline.timeline import Timeline
from ccld.diagnose.findings import STATE_NAMES, Finding, format_line, short_comm
from ccld.diagnose.replay import format_report
from ccld.export.htmlkit import esc as _e, rel as _rel, section as _section, table as _table, utc as _utc
from ccld.export.report_links import runq_table

MAX_FINDINGS_SHOWN = 100  # findings with full evidence; the count of the rest is shown
MAX_RANK_ROWS = 64        # rows of the rank table (culprits first)
PERFETTO_UI = "https://ui.perfetto.dev"


def health_section(tl: Timeline, report: Dict[str, Any], findings: List[Finding], active: List[Finding],
                   main: Optional[Comm], summary: Dict[str, Any]) -> str:
    if active:
        status = f'<span class="badge bad">{len(active)} active finding{"s" * (len(active) != 1)}</span>'
    elif findings:
        status = f'<span class="badge warn">{len(findings)} finding(s), all recovered</span>'
    else:
        status = '<span class="badge ok">no findings</span>'
    first, last = report.get("first_recv"), report.get("last_recv")
    span = f"{last - first:.1f} s" if first is not None and last is not None else "-"
    worlds = sorted({w for w in tl.jobs.values() if w > 0})
    cards = [("ranks", f"{summary['ranks']}" + (f" (world {', '.join(map(str, worlds))})" if worlds else "")),
             ("communicators", summary["comms"]), ("collectives seen", summary["collectives"]),
             ("recording", span), ("frames", f"{report.get('records', 0)} in {report.get('segments', 0)} segments"),
             ("findings", f"{len(findings)} ({len(active)} active)")]
    grid = "".join(f'<div class="card"><div class="k">{_e(k)}</div><div class="v">{_e(v)}</div></div>'
                   for k, v in cards)
    losses = format_report(report)[1:]
    loss_html = ("<ul class=loss>" + "".join(f"<li>{_e(x)}</li>" for x in losses) + "</ul>" if losses
                 else '<p class="muted">No losses, rejects or damage: every frame was read and accepted.</p>')
    comms = [[_e(short_comm(c.id)), _e(c.backend), len(tl.expected_members(c.id)), c.max_seq, c.completed,
              len(c.colls), "main" if main is c else ""]
             for c in sorted(tl.comms.values(), key=lambda c: c.id)[:MAX_RANK_ROWS]]
    body = (f"<p>{status} &nbsp; recorded {_e(_utc(first))} to {_e(_utc(last))}</p>"
            f'<div class="grid">{grid}</div><h3>Losses and damage</h3>{loss_html}'
            "<h3>Communicators</h3>"
            + _table(["comm", "backend", "members", "highest seq", "completed", "in window", ""], comms)
            + "<h3>Ranks at the end of the recording</h3>" + _ranks_table(tl, active)
            + runq_table(tl, first))
    return _section("health", "Health", body)


def _ranks_table(tl: Timeline, active: List[Finding]) -> str:
    blamed = {r for f in active for r in f.ranks}
    recs = sorted(tl.ranks.values(), key=lambda r: (r.rank not in blamed, r.job, r.rank, r.node, r.pid))
    rows = []
    for rec in recs[:MAX_RANK_ROWS]:
        last = max((c.last_entered[rec.rank] for c in tl.comms.values()
                    if c.job == rec.job and rec.rank in c.last_entered), key=lambda x: x[2], default=None)
        state = f"{rec.state} ({STATE_NAMES.get(rec.state, '?')})" if rec.state else "-"
        if rec.exited():
            state = f"exited ({rec.exit_reason or 'exited'})"
        rows.append([f'<b class="bad">{rec.rank}</b>' if rec.rank in blamed else rec.rank, _e(rec.node), rec.pid,
                     _e(state), _e(rec.wchan or "-"),
                     _e(f"seq {last[0]} {last[1]}") if last else "-",
                     "-" if rec.cpu_busy is None else f"{100 * rec.cpu_busy:.0f}%"])
    more = (f'<p class="muted">{len(recs) - MAX_RANK_ROWS} more ranks not listed.</p>'
            if len(recs) > MAX_RANK_ROWS else "")
    return _table(["rank", "node", "pid", "state", "wchan", "last collective", "cpu"], rows) + more


def findings_section(findings: List[Finding], recovered: Dict[str, Any], t0: Optional[float]) -> str:
    if not findings:
        return _section("findings", "Findings", '<p class="muted">No findings: no hang was detected.</p>')
    parts = []
    for f in findings[:MAX_FINDINGS_SHOWN]:
        ev = f.evidence or {}
        rec_at = recovered.get(f.id)
        status = (f'<span class="badge warn">recovered {_e(_utc(rec_at))}</span>' if f.id in recovered
                  else '<span class="badge bad">active</span>')
        fields = [("kind / class", f"{f.kind} / {f.cls}" + (f" ({ev['reason']})" if ev.get("reason") else "")),
                  ("culprit ranks", ", ".join(map(str, f.ranks))),
                  ("link", f"{f.link[0]} <-> {f.link[1]}" if f.link else "-"), ("communicator", f.comm),
                  ("seq", f.seq), ("op", f.op), ("onset", _utc(f.onset_at) + _rel(f.onset_at, t0)),
                  ("detected", _utc(f.detected_at) + _rel(f.detected_at, t0)),
                  ("time to detect", f"{f.detected_at - f.onset_at:.2f} s"),
                  ("threshold", f"{ev['threshold_s']} s" if ev.get("threshold_s") is not None else "-"),
                  ("waiting ranks", ", ".join(map(str, ev.get("waiting") or [])) or "-"),
                  ("id", f.id)]
        kv = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in fields)
        rows = []
        for r in ev.get("ranks") or []:
            last = r.get("last_entered")
            state = r.get("state") or ("not reported" if r.get("seen") is False else "-")
            if r.get("state_name"):
                state += f" ({r['state_name']})"
            if r.get("exited_at") is not None:
                state = f"exited ({r.get('exit_reason') or 'exited'})"
            rows.append([f'<b class="bad">{_e(r.get("rank"))}</b>', _e(state), _e(r.get("wchan") or "-"),
                         _e(f"seq {last['seq']} {last.get('op', '')}" if last else "none"),
                         _e(f"{100 * r['cpu_busy']:.0f}%" if r.get("cpu_busy") is not None else "-"),
                         _e(f"{r.get('node', '-')} / {r.get('pid', '-')}")])
        culprit = _table(["rank", "state", "wchan", "last collective", "cpu", "node / pid"], rows)
        raw = _e(json.dumps(f.to_json(), indent=1, default=str))
        parts.append(f'<div class="finding"><h3>{status} <code>{_e(format_line(f))}</code></h3>'
                     f'<table class="kv">{kv}</table><h4>What the culprit is doing</h4>{culprit}'
                     f"<details><summary>evidence (JSON)</summary><pre>{raw}</pre></details></div>")
    if len(findings) > MAX_FINDINGS_SHOWN:
        parts.append(f'<p class="muted">{len(findings) - MAX_FINDINGS_SHOWN} more findings: '
                     "see <code>ccld diagnose STORE --json</code>.</p>")
    return _section("findings", f"Findings ({len(findings)})", "\n".join(parts))


def perfetto_section(store: str) -> str:
    return _section("perfetto", "Open the Perfetto trace",
                    "<p>Every rank's collectives on its own track, with flows joining one collective across "
                    "ranks, markers for the findings, counters for each rank's links (MiB/s, RTT, "
                    "retransmissions per peer) and runqueue wait, and, when CUPTI ran (<code>ccld run</code> on "
                    "a GPU), a track per CUDA stream with each kernel, the NCCL ones linked to their "
                    "collective:</p>"
                    f"<pre>ccld export {_e(store)} --perfetto out.pftrace</pre>"
                    f'<p>then open <a href="{PERFETTO_UI}">{PERFETTO_UI}</a> and drag <code>out.pftrace</code> '
                    "into the page (the trace stays on your machine: the UI loads it locally).</p>")
