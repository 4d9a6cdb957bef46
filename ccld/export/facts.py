"""Every event kind but the per-collective ones, as the model's input loop meets them: process and
communicator facts (rank, comm), p2p calls, /proc states and exits, the agents' loss counters, the
network layer's link and scheduler counters (handed to netcounters.NetCounters), NCCL's proxy
progress per link (NetProgress, handed to netprog.NcclProgress), and CUPTI's GPU records and capture
status (handed to gpu.py).

Times: each event's ts_ns plus its agent's clock offset `off` = Unix ns (model.TIMEBASE). A kind newer
than this exporter is counted (stats skipped_events); a malformed event raises KeyError/TypeError,
which the input loop counts as a bad event.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict

from ccld.export import gpu
from ccld.export.tracks import Proc

if TYPE_CHECKING:
    from ccld.export.model import TraceModel

ABNORMAL_STATES = {"T": "stopped", "t": "tracing stop", "Z": "zombie", "X": "dead", "D": "disk sleep"}
RARE_KINDS = frozenset(("rank", "comm", "p2p", "proc", "rank_exit", "loss", "hello", "probe", "link", "sched",
                        "gpu_kernel", "gpu_memop", "gpu_loss", "compute", "net_progress"))


def rare(m: "TraceModel", agent: str, node: str, procs: Dict[int, Proc], k: str, e: dict, off: int) -> None:
    """Everything but the per-collective events: process and communicator facts, p2p, losses,
    link and scheduler counters."""
    if k not in RARE_KINDS:
        if type(k) is not str:
            raise TypeError("event kind")
        m.stats["skipped_events"] += 1  # a kind newer than this exporter
        return
    ts = e["ts_ns"]
    if type(ts) is not int:
        raise TypeError("ts_ns")
    ts += off
    if ts > m.max_ts:
        m.max_ts = ts
    if k == "gpu_kernel" or k == "gpu_memop":
        gpu.record(m, node, procs, k, e, off)
    elif k == "compute":  # a table's or trace's compute span: drawn like a kernel, on its own track
        span = dict(e, device=gpu.COMPUTE_DEVICE, stream=0, corr=e.get("n", -1))
        gpu.record(m, node, procs, "gpu_kernel", span, off)
    elif k == "link":
        p = procs.get(e["pid"]) or m.new_proc(node, e["pid"], e["rank"])
        m.net.on_link(node, p, e, ts)
    elif k == "net_progress":
        p = procs.get(e["pid"]) or m.new_proc(node, e["pid"], e["rank"])
        m.nccl.on_progress(p, e, ts)
    elif k == "sched":
        p = procs.get(e["pid"]) or m.new_proc(node, e["pid"], e["rank"])
        if not p.skip:
            m.net.on_sched(p, e, ts)
    elif k == "rank":
        pid, rank = e["pid"], e["rank"]
        p = procs.get(pid)
        if p is None:
            p = m.new_proc(node, pid, rank)
        elif p.rank != rank and p.track is None:
            p.rank, p.skip = rank, m.ranks is not None and rank not in m.ranks
        job, world = e["job"], e["world_size"]
        if p.job != job or p.world != world:
            p.job, p.world = job, world
            lst = m.by_rank.setdefault((job, rank), [])
            if not any(q is p for _, q in lst):
                lst.append((ts, p))
        m.colls.note_rank(job, rank, world)
    elif k == "comm":
        p = procs.get(e["pid"])
        m.colls.note_comm(e["comm"], e.get("backend", ""), e["group_size"], e["rank"],
                          p.job if p is not None else "", e.get("subgroup", False), e.get("seq_source", ""))
        m.nccl.note_comm(e["comm"], e.get("group_rank", -1), e["rank"])  # names NetProgress peers
    elif k == "p2p":
        p = procs.get(e["pid"]) or m.new_proc(node, e["pid"], e["rank"])
        if not p.skip and m.t_from <= ts <= m.t_to:
            args = [("peer", e["peer"]), ("comm", e["comm"]), ("tag", e.get("tag", 0))]
            if e.get("count", -1) >= 0:
                args.append(("count", e["count"]))
            if e.get("dtype"):
                args.append(("dtype", e["dtype"]))
            m.later(ts, m.instant_track(p, "p2p", "p2p", 300), "i", f"{e['op']} {e['peer']}", args)
    elif k == "proc":
        p = procs.get(e["pid"])
        if p is None or p.skip:
            return
        letter = e["state"]
        was, now = ABNORMAL_STATES.get(p.state_letter), ABNORMAL_STATES.get(letter)
        if (was or now) and was != now and m.t_from <= ts <= m.t_to:
            name = f"state {letter} ({now})" if now else f"state {letter} (back from {p.state_letter})"
            m.later(ts, m.instant_track(p, "state", "state", 400), "i", name,
                       [("state", letter), ("wchan", e.get("wchan", ""))])
        p.state_letter = letter
    elif k == "rank_exit":
        p = procs.get(e["pid"])
        if p is not None and not p.skip and m.t_from <= ts <= m.t_to:
            m.later(ts, m.instant_track(p, "state", "state", 400), "i",
                       f"exit ({e.get('reason', 'exited')})", [])
    elif k == "loss":
        for name, value in sorted(e["counters"].items()):
            m.counter(agent, str(name), ts, value)
    elif k == "gpu_loss":
        gpu.loss(m, node, procs, e, ts)
    elif k == "probe":
        if e["family"] == "cupti":  # CUPTI capture on in this rank: its NCCL enters are kept for the join
            p = procs.get(e["pid"])
            if p is None:
                p = m.new_proc(node, e["pid"], -1)
            gpu.gpu_proc(p).seen = e.get("ok") is True
    # hello: who is sending and what is attached; for `ccld diagnose`, not for a timeline
