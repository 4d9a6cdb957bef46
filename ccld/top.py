"""`ccld top`: a live terminal view of a running collector, refreshed in place (curses, so it works
over SSH and in tmux): ranks with the collective each is in and its arrival lag, links out of line,
open findings, and ccld's own ingest rate.

The data comes from the collector's read-only JSON at http://HOST:PORT/snapshot (the `--metrics`
endpoint; snapshot.py builds it), polled every --interval seconds. `render` turns one snapshot into
lines and is all the logic; the curses loop only draws them, so `--once` prints the same screen to
stdout. Times on screen: seconds since the event, by the collector's clock (`at` in the snapshot).
Caveat: rates (frames/s) need two snapshots, so the first screen shows none.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any, Dict, List, Optional, Tuple

from ccld.diagnose.findings import Finding, format_line, short_comm
from ccld.errors import CcldError

DEFAULT_ADDR = "127.0.0.1:9555"
FETCH_TIMEOUT_S = 3.0    # a collector busy with a scrape answers in milliseconds; 3 s means it is gone
MIN_INTERVAL_S = 0.2

# attributes of a line, mapped to curses colours by the loop (plain text for --once)
NORMAL, HEAD, BAD, WARN, DIM = "normal", "head", "bad", "warn", "dim"
Line = Tuple[str, str]


def fetch(addr: str, timeout: float = FETCH_TIMEOUT_S) -> Dict[str, Any]:
    url = addr if addr.startswith("http") else f"http://{addr}"
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/snapshot", timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise CcldError(f"{url}/snapshot answered {e.code}: is this a ccld collector's --metrics address?") from None
    except (urllib.error.URLError, OSError) as e:
        why = getattr(e, "reason", e)
        raise CcldError(f"cannot reach the collector at {url}: {why} (start it with --metrics {addr})") from None
    except ValueError as e:
        raise CcldError(f"{url}/snapshot is not JSON ({e}): is this a ccld collector's --metrics address?") from None


def _secs(s: Optional[float]) -> str:
    if s is None:
        return "-"
    if s < 1:
        return f"{s * 1000:.1f} ms"
    if s < 120:
        return f"{s:.1f} s"
    return f"{s / 60:.0f} min"


def _rate(cur: Dict[str, Any], prev: Optional[Dict[str, Any]], key: str) -> Optional[float]:
    if prev is None or cur.get("at") is None or prev.get("at") is None or cur["at"] <= prev["at"]:
        return None
    a, b = cur.get("collector", {}).get(key), prev.get("collector", {}).get(key)
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return None
    return (a - b) / (cur["at"] - prev["at"])


def _finding_line(d: Dict[str, Any], at: float) -> Line:
    """A finding as `ccld collector` prints it, with its wait counted up to the snapshot's time."""
    f = Finding(kind=d["kind"], cls=d["class"], ranks=d.get("ranks") or [], comm=d.get("comm") or "",
                seq=d.get("seq", -1), op=d.get("op") or "", onset_at=d["onset_at"], detected_at=max(at, d["onset_at"]),
                evidence=d.get("evidence") or {}, link=d.get("link"), job=d.get("job") or "", id=d.get("id") or "")
    return format_line(f), BAD if f.kind == "hang" else WARN


def render(snap: Dict[str, Any], width: int = 100, height: int = 40, prev: Optional[Dict[str, Any]] = None,
           source: str = "", offset: int = 0, error: Optional[str] = None, live: bool = True) -> List[Line]:
    """The screen for one snapshot: at most `height` lines of at most `width` columns. `prev` (the
    snapshot before) gives rates; `offset` scrolls the rank table."""
    at = snap.get("at") or time.time()
    col = snap.get("collector") or {}
    events = sum((col.get("events_by_kind") or {}).values())
    fps = _rate(snap, prev, "frames_ok")
    if prev is not None:
        prev_events = sum(((prev.get("collector") or {}).get("events_by_kind") or {}).values())
        eps = (events - prev_events) / (at - prev["at"]) if at > (prev.get("at") or at) else None
    else:
        eps = None
    rejected = sum((col.get("frames_rejected") or {}).values())
    lost = sum(sum(c.values()) for c in (col.get("agent_loss") or {}).values())
    clock = time.strftime("%H:%M:%S", time.localtime(at))
    head = (f"ccld top  {source}  {len(snap.get('agents') or {})} agents  {col.get('frames_ok', 0):,} frames"
            + (f" ({fps:.1f}/s, {eps:.0f} events/s)" if fps is not None and eps is not None else "")
            + f"  {rejected} rejected  {lost} lost by agents")
    head = head[:width - len(clock) - 1].ljust(width - len(clock) - 1) + " " + clock
    lines: List[Line] = [(head, HEAD)]
    if error:
        lines.append((f"! {error}"[:width], BAD))
    silent = [a for a, i in (snap.get("agents") or {}).items() if (i.get("silent_s") or 0) > 3]
    if silent:
        lines.append((f"! silent agents: {', '.join(silent)}"[:width], WARN))
    findings = snap.get("findings") or []
    body: List[Line] = []
    for job in snap.get("jobs") or []:
        body += _job_lines(job, at, width, offset)
    tail: List[Line] = [(f"findings ({len(findings)} open)", HEAD)]
    tail += [_finding_line(d, at) for d in findings[:8]] or [("  none", DIM)]
    if len(findings) > 8:
        tail.append((f"  ... {len(findings) - 8} more (ccld diagnose, or the findings file)", DIM))
    if live:
        tail.append(("q quits; up/down scroll the ranks", DIM))
    if not snap.get("jobs"):
        body = [("no job yet: waiting for agents to report ranks", DIM)]
    room = max(0, height - len(lines) - len(tail))
    if len(body) > room:
        body = body[:max(0, room - 1)] + [(f"... {len(body) - room + 1} more lines (scroll, or a taller terminal)", DIM)]
    return [(t[:width], a) for t, a in lines + body + tail][:height]


def _job_lines(job: Dict[str, Any], at: float, width: int, offset: int) -> List[Line]:
    out: List[Line] = []
    main = next((c for c in job.get("comms") or [] if c["id"] == job.get("main_comm")), None)
    state = ""
    if main is not None and main.get("seq", -1) >= 0:
        state = f"  {short_comm(main['id'])} seq {main['seq']} {main.get('op') or ''}"
        if main.get("missing") and main.get("first_enter_at"):
            state += f": waiting for {main['missing'][:8]} for {_secs(at - main['first_enter_at'])}"
    out.append((f"job {job.get('job') or '(unknown)'}  world {job.get('world_size')}{state}", HEAD))
    out.append((f"  {'rank':>5} {'node':<14} {'pid':>7} {'st':<2} {'collective (now, else last)':<32} "
                f"{'inside for':>10} {'arr. lag':>9} {'cpu':>5}", DIM))
    ranks = job.get("ranks") or []
    for r in ranks[offset:]:
        where = "-"
        if r.get("comm") is not None:
            where = f"{short_comm(r['comm'])} seq {r['seq']} {r.get('op') or ''}"
        cpu = f"{100 * r['cpu_busy']:.0f}%" if r.get("cpu_busy") is not None else "-"
        state = "X" if r.get("exited") else (r.get("state") or "-")
        mark = "!" if r.get("blamed") else " "
        text = (f" {mark}{r['rank']:>5} {str(r.get('node') or '-')[:14]:<14} {str(r.get('pid') or '-'):>7} "
                f"{state:<2} {where[:32]:<32} {_secs(r.get('for_s')) if r.get('inside') else '-':>10} "
                f"{_secs(r.get('lag_s')):>9} {cpu:>5}")
        out.append((text, BAD if r.get("blamed") else NORMAL))
    if job.get("ranks_omitted"):
        out.append((f"  ... {job['ranks_omitted']} ranks not in the snapshot", DIM))
    odd = [ln for ln in job.get("links") or [] if ln.get("out_of_line")]
    out.append((f"  links out of line (last 10 s): {len(odd)} of {len(job.get('links') or [])} rank pairs", HEAD))
    for ln in odd[:6]:
        out.append((f"    {ln['src']:>4} -> {ln['dst']:<4} {ln['bytes_per_s'] / 2**20:7.2f} MiB/s  "
                    f"rtt {ln['srtt_us'] / 1000:.2f} ms  {ln.get('why') or ''}", WARN))
    return out


def _loop(stdscr, addr: str, interval: float) -> None:
    import curses
    curses.curs_set(0)
    stdscr.timeout(int(interval * 1000))
    attrs = {NORMAL: curses.A_NORMAL, HEAD: curses.A_BOLD, BAD: curses.A_BOLD, WARN: curses.A_NORMAL,
             DIM: curses.A_DIM}
    if curses.has_colors():
        curses.use_default_colors()
        curses.init_pair(1, curses.COLOR_RED, -1)
        curses.init_pair(2, curses.COLOR_YELLOW, -1)
        attrs[BAD] = curses.color_pair(1) | curses.A_BOLD
        attrs[WARN] = curses.color_pair(2)
    snap: Dict[str, Any] = {}
    prev = None
    offset = 0
    next_fetch = 0.0
    error = None
    while True:
        if time.monotonic() >= next_fetch:
            try:
                new = fetch(addr)
                prev, snap, error = (snap or None), new, None
            except CcldError as e:
                error = f"{e} (retrying)"
            next_fetch = time.monotonic() + interval
        height, width = stdscr.getmaxyx()
        stdscr.erase()
        for y, (text, a) in enumerate(render(snap, width - 1, height, prev, addr, offset, error)):
            stdscr.addnstr(y, 0, text, width - 1, attrs.get(a, curses.A_NORMAL))
        stdscr.refresh()
        key = stdscr.getch()
        if key in (ord("q"), ord("Q"), 27):
            return
        if key in (curses.KEY_DOWN, ord("j")):
            offset += 1
        elif key in (curses.KEY_UP, ord("k")):
            offset = max(0, offset - 1)
        elif key == curses.KEY_NPAGE:
            offset += max(1, height - 10)
        elif key == curses.KEY_PPAGE:
            offset = max(0, offset - max(1, height - 10))
        most = max((len(j.get("ranks") or []) for j in snap.get("jobs") or []), default=0)
        offset = min(offset, max(0, most - 1))


def run(addr: str, interval: float, once: bool, say=print) -> int:
    if interval < MIN_INTERVAL_S:
        raise CcldError(f"--interval must be at least {MIN_INTERVAL_S} s")
    if once:
        import shutil
        size = shutil.get_terminal_size((100, 40))
        for text, _ in render(fetch(addr), min(size.columns, 100) if size.columns else 100, 10_000, source=addr, live=False):
            say(text.rstrip())
        return 0
    fetch(addr)  # fail with a clear message before taking over the terminal
    import curses
    import os
    for stale in ("LINES", "COLUMNS"):  # ncurses prefers these to the terminal's real (and changing) size
        os.environ.pop(stale, None)
    curses.wrapper(_loop, addr, interval)
    return 0
