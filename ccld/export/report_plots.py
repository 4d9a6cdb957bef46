"""The report's views of the main communicator's collectives: the arrival-lag heatmap and each rank's
time in collective, each drawn as an inline PNG (htmlkit) and put in its section.

Heatmap: ranks x the newest `last` collectives, each cell a rank's enter behind the collective's first
enter (ms, square-root colour scale); a rank that never entered is a MISSING_COLOUR cell, blamed ranks
are labelled in red and a finding's collective is marked above its column; past MAX_HEATMAP_RANKS
rows, the culprits and the ranks that miss or lag most are drawn. Time in collective: each rank's enter
to its end (waiting included) against seconds since the recording began, MAX_LINE_POINTS collectives
sampled evenly; past MAX_LINE_RANKS ranks, a min-max band and median, with lines for the ranks furthest
from typical and the culprits. Times: Unix seconds from the timeline; lags and durations in ms.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
from matplotlib import colormaps
from matplotlib.colors import PowerNorm
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from ccld.timeline.records import Comm
from ccld.timeline.timeline import Timeline
from ccld.diagnose.findings import Finding, short_comm
from ccld.export.htmlkit import DPI, esc as _e, img as _img, png as _png, section as _section, ticks as _ticks

MAX_HEATMAP_COLLS = 200   # newest collectives in the heatmap: a pattern shows in tens; keeps cells >= 4 px wide
MAX_HEATMAP_RANKS = 256   # rows drawn; a bigger job shows the ranks that lag most (culprits always)
MAX_LINE_POINTS = 2000    # collectives per rank in the duration plot, sampled evenly over the timeline window
SMOOTH_FROM = 80          # from this many points per rank, a rolling median line over faint raw points
MAX_LINE_RANKS = 12       # lines drawn; with more ranks: median and min-max band, plus the outliers
HEAT_W = 1000             # heatmap width, px
HEAT_MARGINS = (70, 130, 44, 46)  # left, right, top, bottom px around the heatmap's cells
MISSING_COLOUR = "#2b59c3"  # "never entered": a blue, far from every lag colour of YlOrRd
LAG_CMAP = "YlOrRd"


# ---- data ---------------------------------------------------------------------------------------

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

def heatmap(tl: Timeline, comm: Comm, findings: Sequence[Finding], last: int) -> Optional[Dict[str, Any]]:
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


def durations(tl: Timeline, comm: Comm, findings: Sequence[Finding],
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

def heatmap_section(heat: Optional[Dict[str, Any]], comm: Comm) -> str:
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


def durations_section(d: Optional[Dict[str, Any]], comm: Comm) -> str:
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
