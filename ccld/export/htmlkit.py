"""Small pieces the report's sections share: HTML escaping, sections, tables, inline PNG images.

Images are base64 PNG `data:` URIs drawn with matplotlib's Agg canvas (no pyplot, no display), at
DPI so that a figure's inches x DPI are its exact pixel size (the tests check them). Times are Unix
seconds, shown as UTC.
"""
from __future__ import annotations

import base64
import datetime as _dt
import html
import io
import math
from typing import Any, List, Optional, Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

DPI = 100                 # figure inches x DPI = exact pixel sizes (the tests check them)


def png(fig: Figure) -> str:
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def ticks(n: int, most: int, always: Sequence[int]) -> List[int]:
    """Up to about `most` evenly spaced indexes of n (first and last included), plus `always`."""
    step = max(1, math.ceil(n / most))
    return sorted(set(range(0, n, step)) | {n - 1} | set(always))


def esc(x: Any) -> str:
    return html.escape("" if x is None else str(x), quote=True)


def utc(t: Optional[float]) -> str:
    if t is None:
        return "-"
    return _dt.datetime.fromtimestamp(t, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"


def rel(t: Optional[float], t0: Optional[float]) -> str:
    return "" if t is None or t0 is None else f" (+{t - t0:.2f} s)"


def section(anchor: str, title: str, body: str) -> str:
    return f'<section id="{anchor}"><h2>{esc(title)}</h2>\n{body}\n</section>'


def table(head: Sequence[str], rows: Sequence[Sequence[Any]], cls: str = "") -> str:
    th = "".join(f"<th>{esc(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table class="{cls}"><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>'


def img(data: str, width: int, height: int, alt: str, extra: str = "") -> str:
    return (f'<img src="data:image/png;base64,{data}" width="{width}" height="{height}" alt="{esc(alt)}"'
            f"{extra}>")
