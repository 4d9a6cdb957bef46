"""`ccld report`: one self-contained HTML page about a recorded store, to attach to a ticket.

The page holds the job's health summary and every finding with its evidence (report_sections.py), an
arrival-lag heatmap (ranks x the newest collectives of the main communicator: a straggler is a hot row,
a hung rank a cell in MISSING_COLOUR) and each rank's time in collective over time (report_plots.py),
the link matrix (MiB and retransmissions per rank pair, report_links.py) when network probes ran, and
how to open the Perfetto trace. This module replays the store, picks the communicator to draw and puts
the page together. Everything is inline: CSS, plots as base64 PNG `data:` URIs, and a
Content-Security-Policy that forbids fetching anything, so the file can be mailed and opened offline.
Plots are drawn with matplotlib's Agg canvas (no pyplot, no display).
Times: Unix seconds from the timeline, shown as UTC and as seconds since the recording began; lags
and durations in ms. Caveat: the cost is the replay (the whole store, as `ccld diagnose`); drawing is
bounded by the MAX_* constants of those modules, whatever the store's size.
"""
from __future__ import annotations

import datetime as _dt
import os
import time
from typing import Any, Callable, Dict, List, Optional

from ccld.timeline.records import Comm
from ccld.timeline.timeline import Timeline
from ccld.diagnose.findings import short_comm
from ccld.diagnose.replay import replay
from ccld.errors import CcldError
from ccld.export.htmlkit import esc as _e, section as _section
from ccld.export.report_links import link_matrix, links_section as _links_section
from ccld.export.report_plots import (MAX_HEATMAP_COLLS, MISSING_COLOUR, durations as _durations,
                                      durations_section as _durations_section, heatmap as _heatmap,
                                      heatmap_section as _heatmap_section)
from ccld.export.report_sections import (findings_section as _findings_section, health_section as _health,
                                         perfetto_section as _perfetto_section)

__all__ = ["link_matrix", "write_report"]  # link_matrix: re-exported, where callers have always found it

Progress = Optional[Callable[[str], None]]


def write_report(store_dir: str, out_html: str, progress: Progress = None, comm: Optional[str] = None,
                 last: int = MAX_HEATMAP_COLLS, floor_s: Optional[float] = None,
                 source: Optional[str] = None) -> Dict[str, Any]:
    """Replay `store_dir`, write the page to `out_html`, and return a JSON-ready summary of it.
    `source`: what the page names instead of the store (`--ops FILE` for a temporary store made from a
    per-op table), as the argument that gives `ccld export` the same events."""
    say = progress or (lambda _msg: None)
    t_start = time.monotonic()
    say(f"replaying {source or store_dir} through the detectors")
    tl, findings, recoveries, report = replay(store_dir, floor_s=floor_s)
    if source:
        report["store"] = source
    say(f"replayed {report.get('records', 0)} frames in {time.monotonic() - t_start:.1f} s")
    main = _main_comm(tl, comm)
    recovered = {r.get("id"): r.get("recovered_at") for r in recoveries}
    active = [f for f in findings if f.id not in recovered]
    t0 = _origin(tl, report.get("first_recv"))
    summary: Dict[str, Any] = dict(store=report.get("store"), ranks=len(tl.ranks), comms=len(tl.comms),
                                   collectives=_collectives_seen(tl), findings=len(findings),
                                   active=len(active), main_comm=main.id if main else None,
                                   heatmap=None, durations=False, links=False)
    sections = [_health(tl, report, findings, active, main, summary)]
    sections.append(_findings_section(findings, recovered, t0))
    if main is not None:
        say(f"drawing the arrival heatmap of {short_comm(main.id)}")
        heat = _heatmap(tl, main, findings, last)
        summary["heatmap"] = heat and {k: heat[k] for k in ("width", "height", "ranks", "seqs", "box")}
        sections.append(_heatmap_section(heat, main))
        say("drawing time in collective per rank")
        durations = _durations(tl, main, findings, t0)
        summary["durations"] = durations is not None
        sections.append(_durations_section(durations, main))
    else:
        sections.append(_section("arrival", "Arrival lag", "<p class=muted>No collectives in this store.</p>"))
    say("drawing the link matrix")
    links = _links_section(tl, findings)
    summary["links"] = "<img" in links
    sections.append(links)
    sections.append(_perfetto_section(report.get("store") or store_dir))
    page = _page(report, summary, sections)
    out_dir = os.path.dirname(os.path.abspath(out_html))
    os.makedirs(out_dir, exist_ok=True)
    tmp = out_html + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(page)
    os.replace(tmp, out_html)  # a reader never sees half a page
    summary.update(path=os.path.abspath(out_html), bytes=os.path.getsize(out_html),
                   seconds=round(time.monotonic() - t_start, 2))
    say(f"wrote {out_html} ({summary['bytes'] // 1024} KiB)")
    return summary


# ---- data ---------------------------------------------------------------------------------------

def _main_comm(tl: Timeline, wanted: Optional[str]) -> Optional[Comm]:
    """The communicator to draw: `wanted` (full id or its short name), else the widest, then busiest."""
    comms = [c for c in tl.comms.values() if c.colls]
    if wanted:
        for c in comms:
            if wanted in (c.id, short_comm(c.id)):
                return c
        names = ", ".join(sorted(short_comm(c.id) for c in comms)) or "none"
        raise CcldError(f"no communicator {wanted!r} with collectives in this store (there are: {names})")
    if not comms:
        return None
    return max(comms, key=lambda c: (len(tl.expected_members(c.id)), c.completed + len(c.colls), c.id))


def _origin(tl: Timeline, first_recv: Optional[float]) -> Optional[float]:
    """Time zero of the page: the first frame's arrival, or an earlier event time it carried."""
    firsts = [c.colls[next(iter(c.colls))].first_enter() for c in tl.comms.values() if c.colls]
    return min([t for t in firsts + [first_recv] if t is not None], default=None)


def _collectives_seen(tl: Timeline) -> int:
    """Completed collectives (counted without bound) plus those in the window that never completed."""
    return sum(c.completed + sum(1 for v in c.colls.values() if v.completed_at is None)
               for c in tl.comms.values())


CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;margin:0;color:#1d2330;
 background:#f6f7f9}
main{max-width:1040px;margin:0 auto;padding:16px 20px 40px}
h1{font-size:22px;margin:8px 0 2px}h2{font-size:18px;border-bottom:1px solid #d9dde3;padding-bottom:4px;
 margin-top:28px}h3{font-size:15px;margin:14px 0 6px}h4{font-size:13px;margin:10px 0 4px;color:#4a5261}
section{background:#fff;border:1px solid #e1e4e8;border-radius:6px;padding:4px 16px 14px;margin-top:14px}
section h2{margin-top:10px}
table{border-collapse:collapse;font-size:13px;margin:4px 0}th,td{border:1px solid #e1e4e8;padding:3px 8px;
 text-align:left;vertical-align:top}thead th{background:#f0f2f5}table.kv th{background:#f7f8fa;width:150px}
code,pre{font-family:"DejaVu Sans Mono",Menlo,Consolas,monospace;font-size:12px}
pre{background:#f3f4f6;padding:8px;overflow:auto;max-height:320px}
.grid{display:grid;grid-template-columns:repeat(6,1fr);gap:8px;margin:8px 0}
.card{border:1px solid #e1e4e8;border-radius:6px;padding:6px 10px;background:#fafbfc}
.card .k{font-size:11px;color:#5b6473;text-transform:uppercase}.card .v{font-size:16px;font-weight:600}
.badge{display:inline-block;border-radius:10px;padding:1px 9px;font-size:12px;font-weight:600;color:#fff}
.badge.bad{background:#c0392b}.badge.warn{background:#b9770e}.badge.ok{background:#1e8449}
b.bad{color:#c0392b}.muted{color:#5b6473}.loss li{color:#8e4a00}
.finding{border-left:4px solid #c0392b;padding-left:12px;margin:10px 0 16px}
.sw{display:inline-block;width:11px;height:11px;background:%s;vertical-align:middle}
img{max-width:100%%;height:auto;display:block;margin:8px 0}
.pair{display:flex;flex-wrap:wrap;gap:0 16px}
footer{color:#5b6473;font-size:12px;margin-top:20px}
""" % MISSING_COLOUR


def _page(report: Dict[str, Any], summary: Dict[str, Any], sections: List[str]) -> str:
    # default-src 'none': the page can fetch nothing; images only from data: URIs, styles only inline
    csp = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"
    title = f"ccld report: {os.path.basename(str(report.get('store') or '').rstrip('/')) or 'store'}"
    nav = " · ".join(f'<a href="#{a}">{t}</a>' for a, t in
                     [("health", "health"), ("findings", "findings"), ("arrival", "arrival lag"),
                      ("durations", "time in collective"), ("links", "links"), ("perfetto", "Perfetto")])
    made = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return ("<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
            f'<meta http-equiv="Content-Security-Policy" content="{csp}">'
            '<meta name=viewport content="width=device-width,initial-scale=1">'
            '<link rel="icon" href="data:,">'
            f"<title>{_e(title)}</title><style>{CSS}</style></head>\n<body><main>"
            f"<h1>{_e(title)}</h1><div class=muted>store <code>{_e(report.get('store'))}</code>; "
            f"generated {made} by <code>ccld report</code></div><nav>{nav}</nav>\n"
            + "\n".join(sections)
            + f"\n<footer>ccld report · main communicator <code>{_e(summary.get('main_comm'))}</code></footer>"
            "</main></body></html>\n")
