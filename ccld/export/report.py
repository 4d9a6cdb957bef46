"""`ccld report`: one self-contained HTML page about a recorded store, to attach to a ticket.

The page holds the job's health summary, every finding with its evidence, an arrival-lag heatmap
(ranks x the newest collectives of the main communicator: a straggler is a hot row, a hung rank a
cell in MISSING_COLOUR), each rank's time in collective over time, the link matrix (MiB and
retransmissions per rank pair, report_links.py) when network probes ran, and how to open the
Perfetto trace. Everything is inline: CSS, plots as base64 PNG `data:` URIs, and a
Content-Security-Policy that forbids fetching anything, so the file can be mailed and opened offline.
Plots are drawn with matplotlib's Agg canvas (no pyplot, no display).
Times: Unix seconds from the timeline, shown as UTC and as seconds since the recording began; lags
and durations in ms. Caveat: the cost is the replay (the whole store, as `ccld diagnose`); drawing is
bounded by the MAX_* constants below, whatever the store's size.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from matplotlib import colormaps
from matplotlib.colors import PowerNorm
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from ccld.timeline.timeline import Comm, Timeline
from ccld.diagnose.findings import STATE_NAMES, Finding, format_line, short_comm
from ccld.diagnose.replay import format_report, replay
from ccld.errors import CcldError
from ccld.export.htmlkit import DPI, esc as _e, img as _img, png as _png, rel as _rel, section as _section
from ccld.export.htmlkit import table as _table, ticks as _ticks, utc as _utc
from ccld.export.report_links import link_matrix, links_section as _links_section, runq_table

__all__ = ["link_matrix", "write_report"]  # link_matrix: re-exported, where callers have always found it

MAX_HEATMAP_COLLS = 200   # newest collectives in the heatmap: a pattern shows in tens; keeps cells >= 4 px wide
MAX_HEATMAP_RANKS = 256   # rows drawn; a bigger job shows the ranks that lag most (culprits always)
MAX_LINE_POINTS = 2000    # collectives per rank in the duration plot, sampled evenly over the timeline window
SMOOTH_FROM = 80          # from this many points per rank, a rolling median line over faint raw points
MAX_LINE_RANKS = 12       # lines drawn; with more ranks: median and min-max band, plus the outliers
MAX_FINDINGS_SHOWN = 100  # findings with full evidence; the count of the rest is shown
MAX_RANK_ROWS = 64        # rows of the rank table (culprits first)
HEAT_W = 1000             # heatmap width, px
HEAT_MARGINS = (70, 130, 44, 46)  # left, right, top, bottom px around the heatmap's cells
MISSING_COLOUR = "#2b59c3"  # "never entered": a blue, far from every lag colour of YlOrRd
LAG_CMAP = "YlOrRd"
PERFETTO_UI = "https://ui.perfetto.dev"

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


def _culprits(findings: Sequence[Finding], comm_id: str) -> Dict[int, List[int]]:
    """rank -> seqs at which a finding on `comm_id` blames it."""
    out: Dict[int, List[int]] = {}
    for f in findings:
        if f.comm == comm_id:
            for r in f.ranks:
                out.setdefault(r, []).append(f.seq)
    return out


def _lag_matrix(tl: Timeline, comm: Comm, last: int) -> Tuple[List[int], List[int], np.ndarray]:
    """(ranks, seqs, ms): each rank's enter behind the collective's first enter; NaN = never entered."""
    seqs = sorted(comm.colls)[-max(1, last):]
    ranks = set(tl.expected_members(comm.id))
    for s in seqs:
        ranks.update(comm.colls[s].enter)
    ranks_l = sorted(ranks)
    index = {r: i for i, r in enumerate(ranks_l)}
    lag = np.full((len(ranks_l), len(seqs)), np.nan)
    for j, s in enumerate(seqs):
        v = comm.colls[s]
        first = v.first_enter()
        for r, t in v.enter.items():
            lag[index[r], j] = (t - first) * 1000.0
    return ranks_l, seqs, lag


def _pick_rows(ranks: List[int], lag: np.ndarray, keep: Sequence[int], most: int) -> List[int]:
    """Row indexes to draw when there are too many ranks: the culprits, then the most missing/late."""
    if len(ranks) <= most:
        return list(range(len(ranks)))
    missing = np.isnan(lag).sum(axis=1)
    with np.errstate(all="ignore"):
        mean = np.nan_to_num(np.nanmean(lag, axis=1), nan=0.0)
    score = missing * 1e9 + mean
    forced = [i for i, r in enumerate(ranks) if r in set(keep)][:most]
    rest = [int(i) for i in np.argsort(-score, kind="stable") if int(i) not in forced]
    return sorted(forced + rest[:most - len(forced)])


# ---- plots --------------------------------------------------------------------------------------

def _heatmap(tl: Timeline, comm: Comm, findings: Sequence[Finding], last: int) -> Optional[Dict[str, Any]]:
    ranks, seqs, lag = _lag_matrix(tl, comm, last)
    if not ranks or not seqs:
        return None
    culprits = _culprits(findings, comm.id)
    rows = _pick_rows(ranks, lag, list(culprits), MAX_HEATMAP_RANKS)
    ranks, lag = [ranks[i] for i in rows], lag[rows, :]
    left, right, top, bottom = HEAT_MARGINS
    row_px = max(3, min(36, 480 // len(ranks)))
    plot_w, plot_h = HEAT_W - left - right, row_px * len(ranks)
    width, height = HEAT_W, plot_h + top + bottom
    fig = Figure(figsize=(width / DPI, height / DPI), dpi=DPI)
    ax = fig.add_axes((left / width, bottom / height, plot_w / width, plot_h / height))
    finite = lag[np.isfinite(lag)]
    vmax = max(1.0, float(finite.max())) if finite.size else 1.0
    cmap = colormaps[LAG_CMAP].with_extremes(bad=MISSING_COLOUR)
    # sqrt scale: a 2 ms jitter and a 40 ms straggler both show next to a 5 s hang's waiters
    im = ax.imshow(np.ma.masked_invalid(lag), cmap=cmap, norm=PowerNorm(0.5, vmin=0.0, vmax=vmax),
                   aspect="auto", interpolation="nearest")
    ys = _ticks(len(ranks), 24, [i for i, r in enumerate(ranks) if r in culprits])
    ax.set_yticks(ys, [str(ranks[i]) for i in ys])
    for i, lbl in zip(ys, ax.get_yticklabels()):
        if ranks[i] in culprits:
            lbl.set_color("#c0392b")
            lbl.set_fontweight("bold")
    col = {q: j for j, q in enumerate(seqs)}
    for f in findings:  # a red mark above the column of each finding: the hung cell may be 4 px wide
        if f.comm == comm.id and f.seq in col:
            ax.plot([col[f.seq]], [1 + 7 / plot_h], marker="v", ms=8, color="#c0392b", clip_on=False,
                    transform=ax.get_xaxis_transform(), markeredgewidth=0)
    xs = _ticks(len(seqs), 10, [])
    ax.set_xticks(xs, [str(seqs[j]) for j in xs])
    ax.set_xlabel(f"collective seq ({short_comm(comm.id)}, newest {len(seqs)})")
    ax.set_ylabel("rank")
    ax.tick_params(labelsize=8)
    cax = fig.add_axes(((left + plot_w + 14) / width, bottom / height, 12 / width, plot_h / height))
    cb = fig.colorbar(im, cax=cax)
    cb.set_label("lag (ms)", fontsize=8)
    cb.ax.tick_params(labelsize=7)
    fig.legend(handles=[Patch(facecolor=MISSING_COLOUR, label="never entered")], loc="upper right",
               frameon=False, fontsize=8, bbox_to_anchor=(1.0, 1.0))
    fig.text(left / width, 1 - 14 / height, "arrival lag: each rank's enter behind the first rank's (ms)",
             fontsize=10, va="top")
    box = [left, top, left + plot_w, top + plot_h]  # cells' area in image pixels, from the top-left
    return dict(png=_png(fig), width=width, height=height, ranks=ranks, seqs=seqs, box=box,
                missing=int(np.isnan(lag).sum()), vmax=vmax, culprits=culprits)


def _durations(tl: Timeline, comm: Comm, findings: Sequence[Finding],
               t0: Optional[float]) -> Optional[Dict[str, Any]]:
    """Each rank's time in collective (its enter to its end, waiting included), over time."""
    seqs = sorted(comm.colls)
    if len(seqs) > MAX_LINE_POINTS:
        step = len(seqs) / MAX_LINE_POINTS
        seqs = [seqs[int(i * step)] for i in range(MAX_LINE_POINTS)]
    series: Dict[int, Tuple[List[float], List[float]]] = {}
    firsts = [comm.colls[s].first_enter() for s in seqs]
    base = t0 if t0 is not None else min((f for f in firsts if f is not None), default=None)
    if base is None:
        return None
    for s in seqs:
        v = comm.colls[s]
        for r, t_in in v.enter.items():
            t_out = v.end.get(r)
            if t_out is not None and t_out >= t_in:
                xs, ys = series.setdefault(r, ([], []))
                xs.append(t_in - base)
                ys.append((t_out - t_in) * 1000.0)
    if not series:
        return None
    fig = Figure(figsize=(HEAT_W / DPI, 360 / DPI), dpi=DPI)
    ax = fig.add_axes((70 / HEAT_W, 46 / 360, (HEAT_W - 70 - 160) / HEAT_W, (360 - 90) / 360))
    ranks = sorted(series)
    culprits = _culprits(findings, comm.id)
    means = {r: float(np.mean(series[r][1])) for r in ranks}
    if len(ranks) <= MAX_LINE_RANKS:
        shown = ranks
    else:
        # A band for everyone, lines only for the ranks furthest from the typical rank (and culprits)
        typical = float(np.median(list(means.values())))
        far = sorted(ranks, key=lambda r: -abs(means[r] - typical))
        shown = sorted(list(dict.fromkeys([r for r in ranks if r in culprits] + far))[:MAX_LINE_RANKS])
        _band(ax, seqs, comm, base)
    if len(shown) > 10:
        ax.set_prop_cycle(color=colormaps["tab20"].colors)  # tab10's colours would repeat
    for r in shown:
        xs, ys = series[r]
        label = f"rank {r}" + (" (blamed)" if r in culprits else "")
        if len(xs) < SMOOTH_FROM:
            ax.plot(xs, ys, lw=1.2 if r in culprits else 0.8, marker=".", ms=3, label=label)
        else:  # raw points faint, a rolling median on top: jitter of hundreds of steps would be a hairball
            (line,) = ax.plot(xs, _rolling_median(ys, max(3, len(ys) // 40)), lw=1.6 if r in culprits else 1.1,
                              label=label)
            ax.plot(xs, ys, ".", ms=2, alpha=0.25, color=line.get_color())
    for f in findings:
        if f.comm == comm.id:
            ax.axvline(f.onset_at - base, color="#c0392b", ls="--", lw=1)
            ax.annotate(f"{f.cls} seq {f.seq}", (f.onset_at - base, 1.0), xycoords=("data", "axes fraction"),
                        fontsize=8, color="#c0392b", ha="right", va="top", rotation=90)
    ys_all = np.concatenate([np.asarray(series[r][1]) for r in ranks])
    pos = ys_all[ys_all > 0]
    if pos.size and pos.max() > 50 * max(np.median(pos), 1e-3):
        ax.set_yscale("log")  # one checkpoint-long wait must not flatten the everyday picture
    ax.set_xlabel("s since the recording began")
    ax.set_ylabel("time in collective (ms)")
    smooth = " (line: rolling median)" if max(len(series[r][0]) for r in shown) >= SMOOTH_FROM else ""
    ax.set_title(f"time in collective per rank: enter to end, waiting for peers included{smooth} "
                 f"({short_comm(comm.id)})", fontsize=10, loc="left")
    ax.grid(alpha=0.3)
    ax.tick_params(labelsize=8)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return dict(png=_png(fig), width=HEAT_W, height=360, ranks=len(ranks), shown=shown, points=len(seqs))


def _rolling_median(ys: Sequence[float], window: int) -> np.ndarray:
    """Centred rolling median (shorter windows at the ends)."""
    a = np.asarray(ys, dtype=float)
    half = window // 2
    return np.array([np.median(a[max(0, i - half):i + half + 1]) for i in range(len(a))])


def _band(ax, seqs: Sequence[int], comm: Comm, base: float) -> None:
    """Min-max band and median of every rank's time in collective (for jobs with too many lines)."""
    xs, lo, mid, hi = [], [], [], []
    for s in seqs:
        v = comm.colls[s]
        d = [(v.end[r] - t) * 1000.0 for r, t in v.enter.items() if r in v.end and v.end[r] >= t]
        if d:
            xs.append(v.first_enter() - base)
            lo.append(min(d))
            mid.append(float(np.median(d)))
            hi.append(max(d))
    if xs:
        ax.fill_between(xs, lo, hi, color="#95a5a6", alpha=0.3, lw=0, label="all ranks: min-max")
        ax.plot(xs, mid, color="#34495e", lw=1, ls=":", label="all ranks: median")


# ---- HTML ---------------------------------------------------------------------------------------

def _health(tl: Timeline, report: Dict[str, Any], findings: List[Finding], active: List[Finding],
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


def _findings_section(findings: List[Finding], recovered: Dict[str, Any], t0: Optional[float]) -> str:
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


def _heatmap_section(heat: Optional[Dict[str, Any]], comm: Comm) -> str:
    if heat is None:
        return _section("arrival", "Arrival lag", '<p class="muted">No collective was entered.</p>')
    attrs = (f' id="heatmap" data-ranks="{",".join(map(str, heat["ranks"]))}"'
             f' data-seqs="{",".join(map(str, heat["seqs"]))}" data-box="{",".join(map(str, heat["box"]))}"'
             f' data-missing-colour="{MISSING_COLOUR}"')
    img = _img(heat["png"], heat["width"], heat["height"], "arrival-lag heatmap", attrs)
    return _section("arrival", "Arrival lag (rank x collective)",
                    f"<p>The newest {len(heat['seqs'])} collectives of <code>{_e(comm.id)}</code>: how long "
                    "after the first rank each rank entered. A straggler is a hot row; a rank that never "
                    f'entered is a <span class="sw"></span> cell. Lags up to {heat["vmax"]:.1f} ms, square-root '
                    f"colour scale; {heat['missing']} missing entries. A red ▼ marks the collective of a finding; "
                    f"blamed ranks are labelled in red.</p>{img}")


def _durations_section(d: Optional[Dict[str, Any]], comm: Comm) -> str:
    if d is None:
        return _section("durations", "Time in collective",
                        '<p class="muted">No collective has both an enter and an end for any rank.</p>')
    note = (f" Lines for {len(d['shown'])} of {d['ranks']} ranks (the furthest from typical, and blamed "
            "ranks); the band is the min-max of all." if len(d["shown"]) < d["ranks"] else "")
    img = _img(d["png"], d["width"], d["height"], "time in collective per rank", ' id="durations"')
    return _section("durations", "Time in collective per rank",
                    f"<p>{d['points']} collectives of <code>{_e(comm.id)}</code>. Ranks that wait for a "
                    "straggler spend longer in each collective than the straggler itself; a slow link "
                    f"lifts everyone's line together.{note}</p>{img}")


def _perfetto_section(store: str) -> str:
    return _section("perfetto", "Open the Perfetto trace",
                    "<p>Every rank's collectives on its own track, with flows joining one collective across "
                    "ranks, markers for the findings, counters for each rank's links (MiB/s, RTT, "
                    "retransmissions per peer) and runqueue wait, and, when CUPTI ran (<code>ccld run</code> on "
                    "a GPU), a track per CUDA stream with each kernel, the NCCL ones linked to their "
                    "collective:</p>"
                    f"<pre>ccld export {_e(store)} --perfetto out.pftrace</pre>"
                    f'<p>then open <a href="{PERFETTO_UI}">{PERFETTO_UI}</a> and drag <code>out.pftrace</code> '
                    "into the page (the trace stays on your machine: the UI loads it locally).</p>")


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
