"""A per-op table's rows as the frames one agent would have shipped: the table's one reader for the timeline.

`ccld diagnose|report|export --ops FILE` write these frames to a temporary store and run on it, so a
table meets the same ingest, timeline, detectors and outputs as a recorded job (no detector here).
What the rows (optable.py) become, on the job's one clock (node ns = Unix ns: no clock conversion):
  a rank        RankInfo: synthetic pid PID_BASE + rank on node NODE, world size = highest rank + 1;
  a group       CommInit from each member that has rows. The default group (no `group`) spans the
                world, so a rank with no rows at all is still expected in its collectives; a named
                group's members are the ranks that have rows in it;
  a collective  CollEnter at start (op, bytes), WorkEnd at start + duration (none when the duration is
                empty: still inside when the table ended). No WorkStart: a table does not say when the
                library began running it. seq: the table's; else the n-th `op` of each rank in the group
                (in each `step`, when every collective row has one) is one collective, and those are
                numbered across the group in time order. So with counted seqs different ops never meet
                at one seq (an op mismatch needs a seq column), and without steps a lost row shifts
                its rank's later collectives by one (the step bounds that to its step);
  p2p           P2P at start and P2PEnd at the end (waited on from start); the n-th send a->b pairs with
                the n-th recv of b from a, as the timeline matches them;
  compute       a ComputeSpan at the
                row's end, its op as the name: the timeline keeps each run's span (timeline/compute.py)
                and compute.py compares each op's durations across the ranks. An empty duration (still
                computing when the table ended) says nothing of how long it took: not sent.
Frames are cut every SHIP_S of table time, as an agent ships, with one at least every HEARTBEAT_S
through quiet stretches (hang.py stops judging ranks whose agent fell silent), the last at the
table's end, which is the store's closed_at: "now" for the detectors. Start times from UNIX_AFTER on
are Unix seconds; smaller ones are relative, and the table is taken to end when its file was last
written (a Flight Recorder dump's time is its mtime too: frcheck.py).
Caveat: a table holds no process state (/proc), exits, scheduler or link metrics, so a rank missing
from a collective is "not-entered" (never "exited"), its cause is "unknown", and no link is named
from TCP metrics (only from p2p streams: p2pslow.py).
"""
from __future__ import annotations

import collections
import contextlib
import math
import os
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from ccld import __version__
from ccld import wire as ev
from ccld.diagnose.frcheck import rank_span
from ccld.diagnose.optable import DEFAULT_GROUP, OpsTable, Row, read_table
from ccld.store import StoreWriter

SHIP_S = 0.1          # a frame per 100 ms of table time, as an agent ships (the detectors tick every 0.5 s)
HEARTBEAT_S = 1.0     # and one at least this often: an agent 3 s without a frame is silent (thresholds.AGENT_SILENT_S)
FRAME_EVENTS = 2048   # events per frame at most (the agent's MAX_BATCH)
UNIX_AFTER = 1e9      # a start from this on (2001-09-09) is Unix seconds; below it, seconds from any origin
PID_BASE = 1_000_000  # rank r's synthetic pid (no process behind it)
NODE = AGENT = "ops-table"
BACKEND = "ops"


@dataclass
class Group:
    name: str
    comm: str                   # the communicator id: "<file name>/ops:<group>"
    members: List[int]
    numbered: str = "counted"   # "table": its seq column; "counted": per rank and op; "counted per step": also
    collectives: int = 0        # distinct seqs
    p2p: int = 0                # p2p rows


@dataclass
class OpsJob:
    """The table as a job: its groups, the rows that become events, its span on the Unix clock."""
    table: OpsTable
    name: str
    world: int
    groups: Dict[str, Group] = field(default_factory=dict)
    rows: List[Row] = field(default_factory=list)   # kept, in time order
    t_first: float = 0.0        # table seconds
    t_end: float = 0.0
    shift: float = 0.0          # table seconds + shift = Unix seconds

    @property
    def ranks(self) -> List[int]:
        return sorted({r.rank for r in self.rows})

    def ns(self, t: float) -> int:
        """Table seconds -> the node's (= Unix) ns."""
        return int(round((t + self.shift) * 1e9))


def make_job(table: OpsTable, world: Optional[int] = None) -> OpsJob:
    """Groups and their members, every collective's seq, the span and its offset to Unix time. Rows
    that cannot be placed (no seq where the group has them, a seq used twice, a peer outside the group)
    become bad rows of `table`. `world`: the job's size where the source says it (a Kineto trace's
    distributedInfo), else the highest rank + 1."""
    world = max([r.rank + 1 for r in table.rows] + [world or 0])
    job = OpsJob(table=table, name=os.path.basename(os.path.normpath(table.path)), world=world)
    by_group: Dict[str, List[Row]] = collections.defaultdict(list)
    for r in table.rows:
        if r.kind != "compute":
            by_group[r.group].append(r)
    keep = [r for r in table.rows if r.kind == "compute"]
    for name, rows in sorted(by_group.items()):
        members = list(range(job.world)) if name == DEFAULT_GROUP else sorted({r.rank for r in rows})
        g = job.groups[name] = Group(name=name, comm=f"{job.name}/{BACKEND}:{name.replace('/', ':')}",
                                     members=members)
        colls = _seqs(table, g, [r for r in rows if r.kind == "collective"])
        g.collectives = len({r.seq for r in colls})
        keep += colls
        for r in rows:
            if r.kind != "p2p":
                continue
            if r.peer in members:
                g.p2p += 1
                keep.append(r)
            else:
                table.bad_row(f"{table.path}: row {r.n}: column 'peer': rank {r.peer} is not in group {name} "
                              f"(members {rank_span(members)})")
    job.rows = sorted(keep, key=lambda r: (r.start, r.n))
    job.t_first = job.rows[0].start
    job.t_end = max(r.start + (r.duration or 0.0) for r in job.rows)
    if job.t_first < UNIX_AFTER:  # relative times: the table ends when its file was written
        job.shift = os.path.getmtime(table.path) - job.t_end
    return job


def _seqs(table: OpsTable, g: Group, colls: List[Row]) -> List[Row]:
    """The group's collectives, each with its seq (the table's, or counted); rows that cannot have one
    are bad rows."""
    if any(r.seq is not None for r in colls):
        g.numbered = "table"
        ok, used = [], {}
        for r in colls:
            if r.seq is None:
                table.bad_row(f"{table.path}: row {r.n}: column 'seq': empty, where group {g.name} numbers "
                              "its collectives (give every one its seq, or leave the column out)")
            elif (r.rank, r.seq) in used:
                table.bad_row(f"{table.path}: row {r.n}: column 'seq': rank {r.rank} already ran seq {r.seq} "
                              f"of group {g.name} (row {used[(r.rank, r.seq)]})")
            else:
                used[(r.rank, r.seq)] = r.n
                ok.append(r)
        return ok
    count: Dict[Tuple[int, int, str], int] = collections.Counter()
    key_of: Dict[int, Tuple[int, str, int]] = {}
    first: Dict[Tuple[int, str, int], float] = {}
    g.numbered = "counted" if any(r.step is None for r in colls) else "counted per step"
    for r in sorted(colls, key=lambda r: (r.start, r.n)):
        step = -1 if r.step is None or g.numbered == "counted" else r.step
        count[(r.rank, step, r.op)] += 1
        k = key_of[r.n] = (step, r.op, count[(r.rank, step, r.op)])  # this rank's n-th of this op (in this step)
        first[k] = min(first.get(k, r.start), r.start)
    seq = {k: i for i, k in enumerate(sorted(first, key=lambda k: (first[k], k)), 1)}
    for r in colls:
        r.seq = seq[key_of[r.n]]
    return colls


def events(job: OpsJob) -> List[Tuple[float, ev.Event]]:
    """(table seconds, event) of the whole job in time order (an op's end before the next op's enter
    at the same instant)."""
    t0, ns = job.t_first, job.ns
    head: List[ev.Event] = [ev.AgentHello(agent=AGENT, node=NODE, pid=0, version=__version__,
                                          sources=["ops-table"], ts_ns=ns(t0))]
    seen = set(job.ranks)
    for r in sorted(seen):
        head.append(ev.RankInfo(pid=PID_BASE + r, rank=r, world_size=job.world, local_rank=-1, node=NODE,
                                job=job.name, ts_ns=ns(t0)))
    for g in job.groups.values():
        source = ev.SEQ_LIBRARY if g.numbered == "table" else ev.SEQ_FROM_INIT
        for i, r in enumerate(g.members):
            if r in seen:
                head.append(ev.CommInit(pid=PID_BASE + r, rank=r, ts_ns=ns(t0), backend=BACKEND, comm=g.comm,
                                        group_rank=i, group_size=len(g.members), seq_source=source))
    out: List[Tuple[float, int, int, ev.Event]] = [(t0, -1, i, e) for i, e in enumerate(head)]
    p2p_n: Dict[Tuple[str, int, str, int], int] = collections.Counter()
    for r in job.rows:  # in time order: the n-th p2p op of a stream is its n-th in time
        if r.kind == "compute":
            if r.duration is not None:  # sent when it is over, as a live source would
                out.append((r.start + r.duration, 0, r.n, ev.ComputeSpan(
                    pid=PID_BASE + r.rank, rank=r.rank, ts_ns=ns(r.start), end_ns=ns(r.start + r.duration),
                    name=r.op, n=r.n)))
            continue
        pid, g = PID_BASE + r.rank, job.groups[r.group]
        end = None if r.duration is None else r.start + r.duration
        if r.kind == "collective":
            out.append((r.start, 1, r.n, ev.CollEnter(pid=pid, rank=r.rank, ts_ns=ns(r.start), backend=BACKEND,
                                                      comm=g.comm, seq=r.seq, op=r.op, nbytes=r.nbytes)))
            if end is not None:
                out.append((end, 0, r.n, ev.WorkEnd(pid=pid, rank=r.rank, ts_ns=ns(end), comm=g.comm, seq=r.seq)))
            continue
        peer = g.members.index(r.peer)  # a group rank, as the probes send it
        p2p_n[(r.group, r.rank, r.op, peer)] += 1
        seq = p2p_n[(r.group, r.rank, r.op, peer)]
        out.append((r.start, 1, r.n, ev.P2P(pid=pid, rank=r.rank, ts_ns=ns(r.start), backend=BACKEND, comm=g.comm,
                                            op=r.op, peer=peer, seq=seq, nbytes=r.nbytes)))
        if end is not None:
            out.append((end, 0, r.n, ev.P2PEnd(pid=pid, rank=r.rank, ts_ns=ns(end), comm=g.comm, op=r.op,
                                               peer=peer, seq=seq, wait_ns=ns(r.start))))
    out.sort(key=lambda x: x[:3])
    return [(t, e) for t, _, _, e in out]


def frames(job: OpsJob) -> Iterator[Tuple[float, bytes]]:
    """(recv Unix s, frame) as one agent would have shipped the job's events: every SHIP_S while there
    are some, at least every HEARTBEAT_S, the last at the table's end; each ends with a ClockSample."""
    evs = events(job)
    t0, end = job.t_first, job.t_end
    beat = round(HEARTBEAT_S / SHIP_S)
    step, last_sent = 0, -beat  # frame k is sent at t0 + k * SHIP_S (integer steps: no float drift)
    i = batch = 0
    while True:
        recv = min(t0 + step * SHIP_S, end)
        j = i
        while j < len(evs) and evs[j][0] <= recv:
            j += 1
        if j > i or step - last_sent >= beat or recv >= end:
            now = job.ns(recv)
            for k in range(i, max(j, i + 1), FRAME_EVENTS):
                batch += 1
                chunk = [e for _, e in evs[k:min(j, k + FRAME_EVENTS)]]
                chunk.append(ev.ClockSample(mono_ns=now, wall_ns=now, ts_ns=now))
                yield recv + job.shift, ev.encode_batch(AGENT, NODE, batch, chunk)
            last_sent, i = step, j
        if recv >= end:
            return
        # nothing until the next event (or the end): skip to its frame, or to the next heartbeat
        upto = evs[i][0] if i < len(evs) else end
        step = max(step + 1, min(math.ceil((upto - t0) / SHIP_S), last_sent + beat))


def write_store(job: OpsJob, store_dir: str) -> int:
    """The job's frames as a store, closed at the table's end; returns how many frames."""
    w = StoreWriter(store_dir, fsync=False)
    n = 0
    try:
        for recv, frame in frames(job):
            w.append(frame, recv)
            n += 1
        w.meta["source"] = {"ops_table": os.path.abspath(job.table.path), "format": job.table.fmt}
    finally:
        w.close(closed_at=job.t_end + job.shift)
    return n


@contextlib.contextmanager
def table_store(path: str) -> Iterator[Tuple[str, OpsJob]]:
    """(store directory, job) of the table at `path`: a temporary store, removed afterwards."""
    job = make_job(read_table(path))
    with job_store(job) as store:
        yield store, job


@contextlib.contextmanager
def job_store(job: OpsJob) -> Iterator[str]:
    """A temporary store of `job` (any reader's rows: a table's, Kineto traces'), removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="ccld-ops-") as d:
        store = os.path.join(d, "store")
        write_store(job, store)
        yield store


@contextlib.contextmanager
def rows_store(table: OpsTable, world: int, errors: List[str],
               say: Optional[Callable[[str], None]] = None) -> Iterator[Tuple[str, OpsJob]]:
    """(store directory, job) of a reader's rows (Kineto traces', NCCL Inspector logs'): a temporary
    store, removed afterwards. Each of `errors` (a file skipped) and each row that could not be placed
    is one line to `say` (stderr by default)."""
    job = make_job(table, world=world)
    for line in errors + job.table.bad_lines():
        (say or _stderr)(f"ccld: {line}")
    with job_store(job) as store:
        yield store, job


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


def ranks_of_world(ranks: List[int], world: int, what: str) -> Tuple[str, List[int]]:
    """("ranks 0,2,3 of world size 4 (no <what> from rank 1)", the absent ranks), for a reader's header."""
    absent = sorted(set(range(world)) - set(ranks))
    return (f"rank{'s' * (len(ranks) > 1)} {rank_span(ranks)} of world size {world}"
            + (f" (no {what} from rank{'s' * (len(absent) > 1)} {rank_span(absent)})" if absent else ""), absent)


def format_groups(job: OpsJob) -> List[str]:
    """The groups' (and compute rows') lines of format_job, for a reader that says what it read in its own
    header."""
    return format_job(job)[1:]


def format_job(job: OpsJob) -> List[str]:
    """What was read: one line for the table, one per group (as frcheck.format_dumps)."""
    kinds = collections.Counter(r.kind for r in job.rows)
    ranks, t = job.ranks, job.table
    absent = sorted(set(range(job.world)) - set(ranks))
    lines = [f"ops table {t.path} ({t.fmt}): {len(job.rows)} rows"
             + (f" ({t.bad_rows} bad, skipped)" if t.bad_rows else "") + f", ranks {rank_span(ranks)}"
             + (f" (no rows from {rank_span(absent)})" if absent else "")
             + f", {job.t_end - job.t_first:.1f} s; {kinds['collective']} collective, {kinds['p2p']} p2p, "
             f"{kinds['compute']} compute rows"]
    for g in job.groups.values():
        numbered = {"table": "from the table", "counted": "counted per rank and op",
                    "counted per step": "counted per rank, step and op"}[g.numbered]
        lines.append(f"  group {g.name}: members {rank_span(g.members)}"
                     + (f", {g.collectives} collectives (seq {numbered})" if g.collectives else "")
                     + (f", {g.p2p} p2p rows" if g.p2p else ""))
    lines += format_compute(job)
    return lines


def format_compute(job: OpsJob) -> List[str]:
    """The compute rows' line of format_job (none without compute rows)."""
    ops = collections.Counter(r.op for r in job.rows if r.kind == "compute")
    if not ops:
        return []
    names = ", ".join(op for op, _ in ops.most_common(3)) + (f" (+{len(ops) - 3})" if len(ops) > 3 else "")
    return [f"  compute: {sum(ops.values())} rows of {len(ops)} op{'s' * (len(ops) > 1)} ({names}), each op's "
            "durations compared across its ranks"]
