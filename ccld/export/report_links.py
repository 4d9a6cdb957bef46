"""The report's network and CPU views: the link matrix and the runqueue-wait table.

Link matrix: from the timeline's LinkTable (`pair_window(job, -inf, inf)`: what each directed rank
pair's buckets add up to over the recording), two heatmaps of one job (the first with link data when
there are several): MiB sent src -> dst, and retransmissions counted by the sender. Cells of a link
that a finding names are boxed in FINDING_COLOUR (both directions). A plain mapping or square matrix
(the older `links` shapes, see link_matrix) is drawn as one heatmap. Units: MiB (2^20 bytes), counts,
RTT in ms. Caveat: the LinkTable keeps SERIES_BUCKETS seconds per pair, so on a recording longer than
that the matrix covers its end.
Runqueue wait: per rank, the cumulative runqueue ns of its latest SchedStats over the time from the
first frame to that report (the agent counts from when it attached), and the share between its last
two reports. A rank's threads add up, so a share can pass 100%.
"""
from __future__ import annotations

import statistics
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from ccld.export.htmlkit import DPI, esc, img, png, section, table, ticks

MAX_LINK_RANKS = 256        # rows and columns drawn; a bigger job shows its lowest ranks
MAX_PAIR_ROWS = 8           # rows of the "notable pairs" table under the heatmaps
MAX_RUNQ_ROWS = 64          # ranks in the runqueue table (most waiting first)
VALUES_UP_TO = 16           # matrices this small get their values written in the cells
FINDING_COLOUR = "#c0392b"  # the red of blamed ranks elsewhere in the report
NO_DATA_COLOUR = "#dddddd"
MARGINS = (60, 110, 34, 44)  # left, right (colour bar), top (title), bottom px around the cells
MIB = float(1 << 20)


def link_matrix(links: Any) -> Optional[Tuple[List[int], np.ndarray]]:
    """(ranks, matrix) from a timeline's `links`: {(src, dst): value}, {src: {dst: value}}, or a
    square sequence of rows (rank i = row i). None when empty or not one of these shapes."""
    if links is None or (hasattr(links, "__len__") and len(links) == 0):
        return None
    pairs: Dict[Tuple[int, int], float] = {}
    try:
        if isinstance(links, dict):
            for k, v in links.items():
                if isinstance(k, tuple) and len(k) == 2:
                    pairs[(int(k[0]), int(k[1]))] = float(v)
                elif isinstance(v, dict):
                    pairs.update({(int(k), int(d)): float(x) for d, x in v.items()})
                else:
                    return None
        else:
            m = np.asarray(links, dtype=float)
            if m.ndim != 2 or m.shape[0] != m.shape[1]:
                return None
            return list(range(m.shape[0])), m
    except (TypeError, ValueError):
        return None
    ranks = sorted({r for p in pairs for r in p})[:MAX_LINK_RANKS]
    idx = {r: i for i, r in enumerate(ranks)}
    m = np.full((len(ranks), len(ranks)), np.nan)
    for (a, b), v in pairs.items():
        if a in idx and b in idx:
            m[idx[a], idx[b]] = v
    return ranks, m


def _job_pairs(links) -> Tuple[Optional[str], List[str], Dict[Tuple[int, int], Any]]:
    """(job, jobs with link data, {(src, dst): PairSummary}) of the first job whose pairs moved bytes."""
    found: List[Tuple[str, Dict]] = []
    for job in links.jobs():
        win = links.pair_window(job, float("-inf"), float("inf"))
        win = {p: s for p, s in win.items() if s.tx_bytes or s.retrans or s.resets}
        if win:
            found.append((job, win))
    if not found:
        return None, [], {}
    return found[0][0], [j for j, _ in found], found[0][1]


def _heatmap(ranks: List[int], m: np.ndarray, title: str, unit: str, cmap: str, marked: Sequence[Tuple[int, int]],
             id_: str, fmt: str) -> str:
    """One rank x rank heatmap as an <img>, with its geometry in data- attributes (as the arrival one)."""
    n = len(ranks)
    side = max(240, min(800, 40 + 14 * n))
    left, right, top, bottom = MARGINS
    width, height = left + side + right, top + side + bottom
    fig = Figure(figsize=(width / DPI, height / DPI), dpi=DPI)
    ax = fig.add_axes((left / width, bottom / height, side / width, side / height))
    shown = np.ma.masked_invalid(m)
    im = ax.imshow(shown, cmap=colormaps[cmap].with_extremes(bad=NO_DATA_COLOUR), aspect="auto",
                   interpolation="nearest", vmin=0, vmax=max(float(np.nanmax(m)) if np.isfinite(m).any() else 0, 1e-9))
    idx = {r: i for i, r in enumerate(ranks)}
    if n <= VALUES_UP_TO:
        for i in range(n):
            for j in range(n):
                if np.isfinite(m[i, j]):
                    r, g, b_, _ = im.cmap(im.norm(m[i, j]))
                    dark = 0.299 * r + 0.587 * g + 0.114 * b_ < 0.55  # white text on dark cells
                    ax.text(j, i, format(m[i, j], fmt), ha="center", va="center", fontsize=8,
                            color="white" if dark else "black")
    for a, b in marked:
        if a in idx and b in idx:
            ax.add_patch(Rectangle((idx[b] - 0.5, idx[a] - 0.5), 1, 1, fill=False, ec=FINDING_COLOUR, lw=3))
    at = ticks(n, 24, [idx[r] for p in marked for r in p if r in idx])
    ax.set_xticks(at, [str(ranks[i]) for i in at])
    ax.set_yticks(at, [str(ranks[i]) for i in at])
    ax.set_xlabel("to rank")
    ax.set_ylabel("from rank")
    ax.tick_params(labelsize=8)
    cax = fig.add_axes(((left + side + 12) / width, bottom / height, 12 / width, side / height))
    cb = fig.colorbar(im, cax=cax)
    cb.set_label(unit, fontsize=8)
    cb.ax.tick_params(labelsize=7)
    fig.text(left / width, 1 - 10 / height, title, fontsize=10, va="top")
    attrs = (f' id="{id_}" data-ranks="{",".join(map(str, ranks))}"'
             f' data-box="{left},{top},{left + side},{top + side}"'
             f' data-marked="{" ".join(f"{a}-{b}" for a, b in marked)}"')
    return img(png(fig), width, height, title, attrs)


def links_section(tl: Any, findings: Sequence[Any] = ()) -> str:
    links = getattr(tl, "links", None)
    if hasattr(links, "pair_window"):
        return _table_section(links, findings)
    got = link_matrix(links)  # an older timeline's mapping or matrix
    if got is None:
        return _no_data()
    ranks, m = got
    unit = getattr(tl, "links_unit", "") or "value"
    pic = _heatmap(ranks, m, f"link matrix ({unit})", unit, "viridis", [], "links", ".3g")
    return section("links", "Link matrix", f"<p>{len(ranks)} ranks; grey: no traffic seen.</p>{pic}")


def _no_data() -> str:
    return section("links", "Link matrix",
                   '<p class="muted">no link data in this store (network probes not enabled)</p>')


def _table_section(links, findings: Sequence[Any]) -> str:
    job, jobs, win = _job_pairs(links)
    if job is None:
        return _no_data()
    named = [f for f in findings if getattr(f, "link", None) and getattr(f, "job", job) in (job, "")]
    marked = sorted({(int(f.link[0]), int(f.link[1])) for f in named} |
                    {(int(f.link[1]), int(f.link[0])) for f in named})
    mib = link_matrix({p: s.tx_bytes / MIB for p, s in win.items()})
    ret = link_matrix({p: float(s.retrans) for p, s in win.items()})
    ranks = mib[0]
    pics = (_heatmap(ranks, mib[1], "MiB sent, from rank (row) to rank (column)", "MiB", "viridis", marked,
                     "links", ".3g") +
            _heatmap(ranks, ret[1], "TCP retransmissions, counted by the sender", "retransmissions", "Purples",
                     marked, "links-retrans", ".0f"))
    others = f" Other jobs with link data: {esc(', '.join(jobs[1:]))}." if len(jobs) > 1 else ""
    note = ""
    if named:
        note = "<p>" + "<br>".join(
            f'<b class="bad">link {int(f.link[0])} &harr; {int(f.link[1])}</b> named by '
            f"<code>{esc(f.kind.upper())} {esc(f.cls)}</code> (boxed in red)" for f in named[:10]) + "</p>"
    rows = sorted(win.values(), key=lambda s: (-s.retrans, -s.resets, -s.tx_bytes, s.src, s.dst))[:MAX_PAIR_ROWS]
    flagged = {p for p in marked}
    body = [[(f'<b class="bad">{s.src} -> {s.dst}</b>' if (s.src, s.dst) in flagged else f"{s.src} -> {s.dst}"),
             f"{s.tx_bytes / MIB:.1f}", s.retrans, s.resets, f"{s.srtt_mean_us / 1000:.2f}",
             f"{s.srtt_max_us / 1000:.2f}"] for s in rows]
    return section("links", "Link matrix",
                   f"<p>Job <code>{esc(job)}</code>: {len(win)} directed rank pairs over TCP, the whole "
                   f"recording. Grey: no traffic seen. A slow or lossy link is a cell apart from its row "
                   f"and column.{others}</p>{note}<div class=pair>{pics}</div>"
                   "<h3>Pairs with the most retransmissions</h3>"
                   + table(["pair", "MiB sent", "retrans", "resets", "mean srtt ms", "max srtt ms"], body))


def runq_table(tl: Any, first_recv: Optional[float]) -> str:
    """The health section's runqueue-wait line and table; "" when no rank reported SchedStats."""
    recs = [r for r in tl.ranks.values() if getattr(r, "runq_ns", -1) >= 0]
    if not recs:
        return ""

    def share(r) -> Optional[float]:
        if r.sched_at is None or first_recv is None or r.sched_at <= first_recv:
            return None
        return r.runq_ns / 1e9 / (r.sched_at - first_recv)

    recs.sort(key=lambda r: (-(share(r) or 0.0), r.job, r.rank))
    shares = [s for s in (share(r) for r in recs) if s is not None]
    head = "CPU runqueue wait (runnable, waiting for a CPU) per rank"
    if shares:
        top = recs[0]
        head += (f": most on rank {top.rank} ({100 * shares[0]:.1f}% of the recording), median "
                 f"{100 * statistics.median(shares):.1f}% over {len(shares)} ranks")
    rows = [[r.rank, esc(r.node), f"{r.runq_ns / 1e9:.2f}", "-" if share(r) is None else f"{100 * share(r):.1f}%",
             "-" if r.runq_share is None else f"{100 * r.runq_share:.1f}%", f"{r.runq_max_ns / 1e6:.1f}",
             r.runq_waits] for r in recs[:MAX_RUNQ_ROWS]]
    more = (f'<p class="muted">{len(recs) - MAX_RUNQ_ROWS} more ranks not listed.</p>'
            if len(recs) > MAX_RUNQ_ROWS else "")
    return (f'<h3>CPU runqueue wait</h3><p id="runq">{esc(head)}. A rank whose threads wait for a CPU '
            "arrives late at collectives (comp-slow); threads add up, so a share can pass 100%.</p>"
            + table(["rank", "node", "total wait s", "of the recording", "latest", "longest wait ms (latest)",
                     "waits"], rows) + more)
