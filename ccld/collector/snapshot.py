"""A JSON snapshot of a live collector for `ccld top`: ranks and their current collective, arrival
lag, links out of line, open findings. Served read-only at /snapshot on the `--metrics` port.

Built by the caller under the collector's lock (`snapshot(timeline, tracker, now)`), from what the
timeline already keeps; nothing is recorded for it. Times: Unix seconds (the timeline's base);
`now` is the collector's clock at the request. Bounds: at most MAX_RANKS ranks and MAX_LINKS link
rows per job, culprits and out-of-line links first (the rest is counted in `*_omitted`).
Caveat: arrival lag is a mean over the communicator's last LAG_WINDOW completed collectives, so a
rank that just became late shows it within a few collectives, not at once.
"""
from __future__ import annotations

import statistics
from typing import Any, Dict, Iterable, List, Optional, Tuple

from ccld.timeline.records import Comm, CollView
from ccld.timeline.timeline import Timeline

SNAPSHOT_VERSION = 1
LAG_WINDOW = 20          # completed collectives averaged for a rank's arrival lag: smooths one-off jitter
LINK_WINDOW_S = 10.0     # link rates over the last 10 s: the agents report every second or so
MAX_RANKS = 4096         # per job in one snapshot; a terminal shows far fewer
MAX_LINKS = 256          # per job
RTT_OUT_OF_LINE_X = 4.0  # a pair whose mean RTT is 4x the job's median pair RTT ...
RTT_FLOOR_US = 1000      # ... and above 1 ms (loopback pairs jitter by 10x at tens of microseconds)
THROUGHPUT_OUT_OF_LINE_X = 0.25  # a pair carrying under 1/4 of the median bulk pair's bytes/s
BULK_BYTES_PER_S = 1 << 20       # pairs below 1 MiB/s are control traffic: their rate says nothing


def completed_views(comm: Comm, n: int) -> List[CollView]:
    """The newest `n` completed collectives of `comm`, oldest first."""
    out: List[CollView] = []
    for v in reversed(comm.colls.values()):
        if v.completed_at is not None and v.enter:
            out.append(v)
            if len(out) >= n:
                break
    out.reverse()
    return out


def rank_lags(comm: Comm, n: int = LAG_WINDOW) -> Dict[int, float]:
    """Per rank: mean seconds after the first rank it entered, over the last `n` completed collectives."""
    sums: Dict[int, float] = {}
    counts: Dict[int, int] = {}
    for v in completed_views(comm, n):
        first = v.first_enter()
        for r, t in v.enter.items():
            sums[r] = sums.get(r, 0.0) + (t - first)
            counts[r] = counts.get(r, 0) + 1
    return {r: sums[r] / counts[r] for r in sums}


def main_comm(tl: Timeline, job: str) -> Optional[Comm]:
    """The job's widest communicator (the default process group, normally), then the busiest."""
    comms = [c for c in tl.comms.values() if c.job == job]
    return max(comms, key=lambda c: (len(tl.expected_members(c.id)), c.max_seq), default=None)


def _current(tl: Timeline, job: str) -> Dict[int, Tuple[Comm, int, str, float, bool]]:
    """Per rank: (comm, seq, op, entered at, inside) of the newest collective it entered on any of the
    job's communicators; inside = entered and not finished."""
    out: Dict[int, Tuple[Comm, int, str, float, bool]] = {}
    for c in tl.comms.values():
        if c.job != job:
            continue
        for r, (seq, op, at) in c.last_entered.items():
            view = c.colls.get(seq)
            inside = view is not None and r not in view.end and r not in view.failed
            cur = out.get(r)
            if cur is None or at > cur[3]:
                out[r] = (c, seq, op, at, inside)
    return out


def _r(x: Optional[float], nd: int = 6) -> Optional[float]:
    return None if x is None else round(x, nd)


def _us(us: float) -> str:
    return f"{us / 1000:.1f} ms" if us >= 1000 else f"{us:.0f} us"


def link_rows(tl: Timeline, job: str, now: float, window_s: float = LINK_WINDOW_S) -> List[Dict[str, Any]]:
    """Per directed rank pair over the last `window_s`: bytes/s, retransmissions, RTT, and whether it
    is out of line with the job's other pairs (and why). Out-of-line rows first."""
    pairs = tl.links.pair_window(job, now - window_s, now)
    rtts = [s.srtt_mean_us for s in pairs.values() if s.srtt_mean_us > 0]
    median_rtt = statistics.median(rtts) if rtts else 0.0
    rates = [s.tx_bytes / window_s for s in pairs.values() if s.tx_bytes / window_s >= BULK_BYTES_PER_S]
    median_rate = statistics.median(rates) if len(rates) >= 2 else 0.0
    rows = []
    for (src, dst), s in sorted(pairs.items()):
        rate = s.tx_bytes / window_s
        why = []
        if s.retrans:
            why.append(f"{s.retrans} retransmissions")
        if s.resets:
            why.append(f"{s.resets} resets")
        if median_rtt and s.srtt_mean_us >= max(RTT_FLOOR_US, RTT_OUT_OF_LINE_X * median_rtt):
            why.append(f"rtt {_us(s.srtt_mean_us)} vs median {_us(median_rtt)}")
        if median_rate and 0 < rate < THROUGHPUT_OUT_OF_LINE_X * median_rate:
            why.append(f"{rate / 2**20:.1f} MiB/s vs median {median_rate / 2**20:.1f} MiB/s")
        rows.append({"src": src, "dst": dst, "bytes_per_s": round(rate, 1), "retrans": s.retrans,
                     "resets": s.resets, "srtt_us": round(s.srtt_mean_us, 1), "srtt_max_us": s.srtt_max_us,
                     "out_of_line": bool(why), "why": "; ".join(why) or None})
    rows.sort(key=lambda r: (not r["out_of_line"], r["src"], r["dst"]))
    return rows


def _job_snapshot(tl: Timeline, job: str, now: float, blamed: Iterable[int]) -> Dict[str, Any]:
    world = tl.jobs.get(job, -1)
    main = main_comm(tl, job)
    lags = rank_lags(main) if main is not None else {}
    current = _current(tl, job)
    known = {r for (j, r) in tl.by_rank if j == job}
    ranks = sorted(known | set(current) | (set(range(world)) if 0 < world <= MAX_RANKS else set()))
    blamed = set(blamed)
    ranks.sort(key=lambda r: (r not in blamed, r))
    rows = []
    for r in ranks[:MAX_RANKS]:
        rec = tl.rank_record(job, r)
        cur = current.get(r)
        row: Dict[str, Any] = {"rank": r, "node": rec.node if rec else None, "pid": rec.pid if rec else None,
                               "state": rec.state if rec else None, "exited": bool(rec and rec.exited()),
                               "cpu_busy": _r(rec.cpu_busy, 3) if rec else None,
                               "lag_s": _r(lags.get(r)), "blamed": r in blamed,
                               "comm": None, "seq": None, "op": None, "inside": False, "for_s": None}
        if cur is not None:
            c, seq, op, at, inside = cur
            row.update(comm=c.id, seq=seq, op=op, inside=inside, for_s=_r(max(0.0, now - at), 3) if inside else None)
        rows.append(row)
    comms = []
    for c in sorted((c for c in tl.comms.values() if c.job == job), key=lambda c: c.id):
        expected = tl.expected_members(c.id)
        head = c.colls.get(c.max_seq)
        entered = set(head.enter) if head is not None else set()
        comms.append({"id": c.id, "backend": c.backend, "members": len(expected), "seq": c.max_seq,
                      "op": head.op if head is not None else None,
                      "completed": head is not None and head.completed_at is not None,
                      "missing": sorted(expected - entered)[:64] if head is not None and head.completed_at is None else [],
                      "first_enter_at": _r(head.first_enter()) if head is not None else None})
    links = link_rows(tl, job, now)
    return {"job": job, "world_size": world, "main_comm": main.id if main is not None else None,
            "ranks": rows, "ranks_omitted": max(0, len(ranks) - MAX_RANKS), "comms": comms,
            "links": links[:MAX_LINKS], "links_omitted": max(0, len(links) - MAX_LINKS)}


def snapshot(tl: Timeline, active: Iterable[Any], now: float, stats: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Everything `ccld top` shows, JSON-ready. `active`: the tracker's open findings. Call it under
    the collector's lock."""
    findings = sorted(active, key=lambda f: (f.kind != "hang", f.onset_at))
    blamed: Dict[str, set] = {}
    for f in findings:
        blamed.setdefault(f.job, set()).update(f.ranks)
    jobs = sorted(set(tl.jobs) | {c.job for c in tl.comms.values()})
    out_findings = []
    for f in findings:
        d = f.to_json()
        d.pop("stack", None)  # pages of text: `ccld diagnose` and the findings file have them
        d["evidence"] = {k: v for k, v in (d.get("evidence") or {}).items() if k != "stack"}
        d["age_s"] = _r(now - f.onset_at, 3)
        out_findings.append(d)
    return {"version": SNAPSHOT_VERSION, "at": now, "collector": stats or {},
            "agents": {a: {"node": i.get("node"), "silent_s": _r(tl.agent_silent_s(a, now), 3)}
                       for a, i in sorted(tl.agents.items())},
            "jobs": [_job_snapshot(tl, j, now, blamed.get(j, ())) for j in jobs],
            "findings": out_findings}
