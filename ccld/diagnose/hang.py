"""Hang detection: which ranks keep a communicator's newest collective from finishing.

For each communicator, look at the highest seq S any member entered:
  (f) some member's library reported an error for S -> "fault" at once (no threshold: an error is
      not a wait): the members that neither finished nor failed (a rank that died inside, or never
      came), else the failed ranks themselves. When several stopped unfinished (the launcher stops
      the others right after the first death), `died_first` keeps the one the failed ranks' errors
      say they lost the connection to, else drops those seen alive after the fault, else orders
      their exits;
  (a) some expected members have not entered S while the others wait longer than the threshold
      -> "not-entered" naming exactly those ranks ("fault" when one of them is stopped or exited),
      with what each is doing instead (`doing`): inside a collective of another communicator (and
      whom that one waits for, following the chain; a cycle is a cross-communicator deadlock),
      blocked in I/O, busy on CPU, asleep, stopped, exited;
  (b) everyone entered S but some have not finished it for longer than the threshold
      -> "fault": the stopped/exited members if any, else the ranks that never started (or never
      finished) it. Which link is to blame is `links.find_link_faults`'s question.
A collective every member entered and finished is never a finding, and neither is a pause where all
ranks are between collectives (nobody entered S+1).

Thresholds adapt to the job: max(floor, k x the largest arrival spread (last enter - first enter))
for (a), max(floor, k x the largest duration (last end - last enter)) for (b), over the
communicator's collectives completed in the last hour (Timeline.recent_peaks), so a rank that
regularly arrives late (checkpointing on rank 0) is not called hung. The floor is `floor_s` when the
caller fixes it (--hang-after); by default (None) FLOOR_S until the communicator has LEARN_S of
completed collectives, then LEARNED_FLOOR_S: the job's own waits, not a fixed guess, set how
soon a wait is a hang (`floor_for`). A missing rank that is working
(busy on CPU or in disk I/O, e.g. writing a checkpoint) while the others wait gets BUSY_FLOOR_S
instead of floor_s: until then it is an informational `comp-slow` "pause" finding (find_pauses),
not a hang. Times: Unix seconds.
A rank whose agent went silent (killed, partitioned) would look like a rank that has not entered,
so a communicator with such a member is not judged until its agent speaks again (AGENT_SILENT_S).
"""
from __future__ import annotations

import collections
import heapq
import re
from typing import Any, Dict, List, Optional, Set, Tuple

from ccld.timeline.timeline import Comm, CollView, RankRecord, Timeline
from ccld.diagnose import waits
from ccld.diagnose.findings import STATE_NAMES, Finding, short_comm

FLOOR_S = 5.0   # never call a hang before this while a communicator's normal is unknown: agents ship every 100 ms
LEARNED_FLOOR_S = 3.0  # ... and once LEARN_S of its collectives completed (and k x their worst spread is lower):
LEARN_S = 15.0         # ... and at least LEARN_MIN_OPS of them: the job's own waits say how long they get; 3 s is
LEARN_MIN_OPS = 100    # 12 of the agent's 250 ms drains. (60 s before issue 18: a DDP hang 20 s into a job
                       # was named after the 5 s floor; K x the worst spread seen keeps slow-arriving jobs safe)
K = 4.0         # x the job's own worst recent spread/duration
EVIDENCE_RANKS = 16   # ranks described in full in one finding; `ranks` itself always lists every culprit
AGENT_SILENT_S = 3.0  # agents send a frame every 100 ms; 3 s without one means we are blind there
BUSY_CPU = 0.5        # CPU s per s between /proc samples: a rank this busy is computing, not blocked
STARVED_RUNQ = 0.5    # runqueue s per s (SchedStats) of a running rank that is waiting for a CPU more than using one
# A missing rank that is busy (CPU or disk) while its peers wait is most likely checkpointing or
# evaluating: it is a hang only after this long (or K x the job's longest such wait, if longer).
BUSY_FLOOR_S = 120.0
FAILED_GRACE_S = 1.0  # after the first error, wait this long for the other ranks' ends to arrive
MAX_CHAIN = 8         # hops followed from a missing rank to the collective it waits in, and on
WORKING_CPU = 0.3     # CPU s per s over a wait that makes a missing rank "working", whatever one sample says
STUCK_IO_CPU = 0.01   # CPU s per s below which a rank in D in one wait channel all along is stuck, not writing
ENDLESS_AFTER = 3     # a communicator with this many collectives entered by all and none ever ended has a
                      # source that reports no ends (NCCL's API probes without CUPTI or the profiler plugin)
MAX_SAMPLES = 600     # /proc samples kept per waited-for rank: 10 minutes at one a second
MAX_TRACKED = 4096    # ranks with samples before old ones are dropped ...
SAMPLES_KEPT_S = 600.0  # ... those not sampled for 10 minutes
NOTE_AFTER_S = 1.0    # waited-for ranks are sampled from this far into a wait (normal arrivals take ms) ...
NOTE_MAX_RANKS = 64   # ... when at most this many are missing (a few ranks hold the others: the pause case)
MAX_LISTED = 256      # ranks listed in one evidence field (waiting, finished, ...); its count is given too
EXIT_TIE_S = 0.1      # exits seen this close together are one /proc scan of the agent's: not ordered
EXACT_TIE_S = 0.002   # ... and, timed by the kernel (RankExit.exact), this close: killed together. A
                      # launcher stops the survivors of a death after noticing it (torchrun polls its
                      # workers every 0.1 s), so they exit milliseconds to a tenth of a second later
RECENT_FAILED = 4     # newest collectives of a communicator searched for the first error of a fault


class Blindness:
    """Which ranks' agents have been silent for longer than AGENT_SILENT_S at `now`, worked out once
    per tick for every communicator: O(agents) to find the silent agents and, only when there are
    some, O(ranks) once to list their ranks per job (not O(members) per communicator)."""

    def __init__(self, tl: Timeline, now: float):
        self.tl = tl
        self.silent = {a for a in tl.agents if tl.agent_is_silent(a, now, AGENT_SILENT_S)}
        self._by_job: Optional[Dict[str, Set[int]]] = None

    def members(self, comm: Comm, members: Set[int]) -> List[int]:
        if not self.silent:
            return []  # the common case, without looking at any rank
        if not comm.job:  # a communicator of unknown job: rank_record's unique-rank fallback, per member
            return sorted(r for r in members if self._blind(self.tl.rank_record(comm.job, r)))
        if self._by_job is None:
            by: Dict[str, Set[int]] = collections.defaultdict(set)
            for (job, rank), key in self.tl.by_rank.items():
                if self._blind(self.tl.ranks.get(key)):
                    by[job].add(rank)
            self._by_job = by
        got = self._by_job.get(comm.job, set())
        return sorted(got & members)

    def _blind(self, rec: Optional[RankRecord]) -> bool:
        return rec is not None and not rec.exited() and rec.agent in self.silent


def blind_members(tl: Timeline, comm: Comm, members: Set[int], now: float,
                  blind: Optional[Blindness] = None) -> List[int]:
    """Members whose agent has been silent for longer than AGENT_SILENT_S (`blind`: this tick's)."""
    return (blind or Blindness(tl, now)).members(comm, members)


def listed(ranks) -> List[int]:
    """At most MAX_LISTED of `ranks`, sorted: a finding at 16,384 ranks must stay a readable line."""
    ranks = ranks if isinstance(ranks, (set, frozenset, list, tuple, dict)) else list(ranks)
    return heapq.nsmallest(MAX_LISTED, ranks) if len(ranks) > 4 * MAX_LISTED else sorted(ranks)[:MAX_LISTED]


def _r(x: Optional[float], nd: int = 6) -> Optional[float]:
    return None if x is None else round(x, nd)


def open_collective(tl: Timeline, job: str, rank: int, skip: Optional[str] = None) -> Optional[Tuple[Comm, CollView]]:
    """The collective `rank` is inside right now (entered, not finished) on any communicator of
    `job` but `skip`: the newest one, or None."""
    best = None
    for c in tl.comms.values():
        if c.id == skip or c.job != job:
            continue
        last = c.last_entered.get(rank)
        if last is None:
            continue
        view = c.colls.get(last[0])
        if view is None or rank in view.end:
            continue
        if best is None or last[2] > best[2]:
            best = (c, view, last[2])
    return None if best is None else best[:2]


def _waits_for(tl: Timeline, comm: Comm, view: CollView) -> List[int]:
    """Whom an open collective waits for: the members that have not entered it, or, when all have,
    those that have not finished it."""
    expected = tl.expected_members(comm.id)
    missing = expected - view.enter.keys()
    return sorted(missing if missing else expected - view.end.keys())


def wait_chain(tl: Timeline, comm: Comm, view: CollView, rank: int) -> Tuple[List[Dict[str, Any]], bool]:
    """Follow `rank` (missing from `view`) to the collective it is in, whom that waits for, where
    that rank is, and so on: (hops, True when the chain comes back to a collective already on it,
    i.e. a cross-communicator deadlock)."""
    hops: List[Dict[str, Any]] = []
    seen = {(comm.id, view.seq)}
    r = rank
    for _ in range(MAX_CHAIN):
        got = open_collective(tl, comm.job, r)
        if got is None:
            return hops, False
        c, v = got
        waits = _waits_for(tl, c, v)
        hops.append({"rank": r, "comm": c.id, "seq": v.seq, "op": v.ops.get(r) or v.op,
                     "entered_at": _r(v.enter.get(r)), "waits_for": waits[:EVIDENCE_RANKS]})
        if (c.id, v.seq) in seen:
            return hops, True
        seen.add((c.id, v.seq))
        nxt = [q for q in waits if q != r]
        if not nxt:
            return hops, False
        r = nxt[0]
    return hops, False


def doing(tl: Timeline, comm: Comm, rank: int, rec: Optional[RankRecord]) -> Tuple[str, str]:
    """(label, words) for what `rank` is doing (for a rank absent from `comm`'s newest collective:
    instead): exited, stopped, in-p2p (blocked in a send or recv), inside (`comm`'s newest collective),
    in-collective (another one, on any communicator), io, cpu-starved, busy, sleeping, running,
    unknown, not-seen."""
    if rec is None:
        return "not-seen", "not reported by any agent"
    if rec.exited():
        return "exited", f"exited ({rec.exit_reason or 'exited'})"
    if rec.stopped():
        return "stopped", "stopped (SIGSTOP or a debugger)"
    b = waits.blocked(tl, comm.job, rank)
    if b is not None and b.op is not None:
        return "in-p2p", f"in {b.label()}" + (" (its peer posted too: stuck)" if b.peer_posted else "")
    got = open_collective(tl, comm.job, rank)
    if got is not None:
        c, v = got
        if c is comm and v.seq == comm.max_seq:
            return "inside", f"inside seq {v.seq} {v.ops.get(rank) or v.op} (the collective in question)"
        return "in-collective", f"in {short_comm(c.id)} seq {v.seq} {v.ops.get(rank) or v.op}"
    wchan = rec.wchan if rec.wchan and rec.wchan != "0" else ""
    if rec.state == "D":
        return "io", "blocked in I/O" + (f" ({wchan})" if wchan else "")
    runq = getattr(rec, "runq_share", None)
    if rec.state == "R" and runq is not None and runq >= STARVED_RUNQ:
        return "cpu-starved", f"runnable but waiting for a CPU ({runq:.2f} s per s) outside collectives"
    if rec.cpu_busy is not None and rec.cpu_busy >= BUSY_CPU:
        return "busy", f"busy on CPU ({100 * rec.cpu_busy:.0f}%) outside collectives"
    if rec.state in ("S", "I"):
        return "sleeping", "asleep outside collectives" + (f" ({wchan})" if wchan else "")
    if rec.state:
        return "running", f"state {rec.state} outside collectives"
    return "unknown", "no /proc state yet"


def rank_evidence(tl: Timeline, comm: Comm, rank: int, now: float) -> Dict[str, Any]:
    """What `rank` is doing, as far as the timeline knows (JSON-ready)."""
    out: Dict[str, Any] = {"rank": rank}
    last = comm.last_entered.get(rank)
    out["last_entered"] = None if last is None else {"seq": last[0], "op": last[1], "at": _r(last[2])}
    rec = tl.rank_record(comm.job, rank)
    out["doing"], out["doing_text"] = doing(tl, comm, rank, rec)
    if rec is None:
        out["seen"] = False
        return out
    out.update(seen=True, pid=rec.pid, node=rec.node, state=rec.state,
               state_name=STATE_NAMES.get(rec.state, "") if rec.state else "", wchan=rec.wchan,
               cpu_ns=rec.cpu_ns if rec.cpu_ns >= 0 else None, cpu_busy=_r(rec.cpu_busy, 3),
               state_age_s=_r(now - rec.state_at, 3) if rec.state_at is not None else None,
               stopped=rec.stopped(), exited_at=_r(rec.exited_at), exit_reason=rec.exit_reason or None,
               last_event_at=_r(rec.last_event_at), agent=rec.agent,
               agent_silent_s=_r(tl.agent_silent_s(rec.agent, now), 3))
    if getattr(rec, "runq_share", None) is not None:
        out["runq_share"] = _r(rec.runq_share, 3)  # runnable but waiting for a CPU, s per s (SchedStats)
    if rec.last_p2p is not None:
        op, peer, at = rec.last_p2p
        out["last_p2p"] = {"op": op, "peer": peer, "at": _r(at)}
    loss = {k: v for k, v in tl.agent_loss.get(rec.agent, {}).items() if v}
    if loss:
        out["agent_loss"] = loss  # events of this rank may have been lost: weigh the finding accordingly
    return out


def _dead(tl: Timeline, comm: Comm, ranks: Set[int]) -> List[int]:
    out = []
    for r in ranks:
        rec = tl.rank_record(comm.job, r)
        if rec is not None and (rec.stopped() or rec.exited()):
            out.append(r)
    return sorted(out)


def stopped_by_launcher(tl: Timeline, comm: Comm, ranks) -> List[int]:
    """Those of `ranks` that exited of a signal from their own launcher (RankExit.by_launcher)."""
    out = []
    for r in ranks:
        rec = tl.rank_record(comm.job, r)
        if rec is not None and rec.exited() and rec.stopped_by_launcher:
            out.append(r)
    return sorted(out)


def crashed(tl: Timeline, comm: Comm, ranks) -> List[int]:
    """Those of `ranks` that died of a signal not from their launcher (killed, out of memory, a
    segfault or abort): such a peer will not come, whatever the threshold, and when the launcher then
    stops the others at once (torchrun within ~0.1 s) there is no later moment to say it. (A rank that
    exits by itself is left to the thresholds: at a job's end ranks exit with ops still open.)"""
    out = []
    for r in ranks:
        rec = tl.rank_record(comm.job, r)
        if rec is not None and rec.exited() and rec.exit_signal and not rec.stopped_by_launcher:
            out.append(r)
    return sorted(out)


def job_stopped(tl: Timeline, comm: Comm, expected) -> bool:
    """Every member of `comm` exited of its launcher's signal: the job was stopped or restarted (an
    elastic restart, a cancelled job), which leaves its last collective open on no one's account."""
    return bool(expected) and len(stopped_by_launcher(tl, comm, expected)) == len(expected)


def _why_dead(tl: Timeline, comm: Comm, ranks: List[int]) -> str:
    recs = [tl.rank_record(comm.job, r) for r in ranks]
    return "exited" if all(r is not None and r.exited() for r in recs) else "stopped"


def _active_now(rec: RankRecord) -> bool:
    return rec.state in ("R", "D") or (rec.cpu_busy is not None and rec.cpu_busy >= BUSY_CPU)


class Activity:
    """The /proc samples (state, CPU time, wait channel) of ranks that keep their peers waiting, noted
    each tick, so "is it working?" is judged over the whole wait and not flipped by one sample (a
    checkpoint alternates between CPU, disk waits and short sleeps). One per Timeline (the Diagnoser's)."""

    def __init__(self) -> None:
        self._samples: Dict[Tuple[str, int], "collections.deque"] = {}

    def note(self, rec: RankRecord) -> "collections.deque":
        key = (rec.node, rec.pid)
        d = self._samples.get(key)
        if d is None:
            d = self._samples[key] = collections.deque(maxlen=MAX_SAMPLES)
        if rec.state_at is not None and (not d or d[-1][0] != rec.state_at):
            d.append((rec.state_at, rec.state, rec.cpu_ns, rec.wchan))
        return d

    def working(self, rec: RankRecord, since: float) -> bool:
        """True when, since `since`, the rank was running or in disk I/O in at least half of the
        samples, or used WORKING_CPU of a CPU; with fewer than 2 samples, from the latest one. Disk
        waits count only while the I/O moves: a rank in D that used no CPU (below STUCK_IO_CPU) in
        one wait channel all along is stuck in I/O (a dead NFS or FUSE server), not working."""
        got = [x for x in self.note(rec) if x[0] >= since]
        if len(got) < 2:
            return _active_now(rec) or (rec.cpu_busy is not None and rec.cpu_busy >= WORKING_CPU)
        span = got[-1][0] - got[0][0]
        share = (got[-1][2] - got[0][2]) / 1e9 / span if span > 0 and got[0][2] >= 0 else 0.0
        if stuck_in_io(got, share):
            return False
        active = sum(1 for _, st, _, _ in got if st in ("R", "D")) / len(got)
        return active >= 0.5 or share >= WORKING_CPU

    def prune(self, now: float) -> None:
        if len(self._samples) > MAX_TRACKED:
            self._samples = {k: d for k, d in self._samples.items() if d and d[-1][0] >= now - SAMPLES_KEPT_S}


def stuck_in_io(samples, cpu_share: float) -> bool:
    """(state_at, state, cpu_ns, wchan) samples over a wait: every one in D, in one wait channel, with
    next to no CPU used: the I/O is not moving."""
    return (len(samples) >= 2 and all(st == "D" for _, st, _, _ in samples)
            and len({w for _, _, _, w in samples}) == 1 and cpu_share < STUCK_IO_CPU)


def _working(tl: Timeline, comm: Comm, ranks: Set[int], since: float, activity: Optional[Activity]) -> bool:
    """True when every one of `ranks` is alive and working (busy on CPU, or in disk I/O)."""
    for r in ranks:
        rec = tl.rank_record(comm.job, r)
        if rec is None or rec.exited() or rec.stopped():
            return False
        if not (activity.working(rec, since) if activity is not None else _active_now(rec)):
            return False
    return bool(ranks)


def _ranks_words(ranks: List[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"{len(ranks)} ranks"


def _summary(details: List[Dict[str, Any]], reason: str) -> str:
    """What a change of deserves a new line on the terminal (the tracker compares it): no numbers."""
    shown = "; ".join(f"rank {d['rank']} {d.get('doing', '?')}" for d in details[:4])
    return f"{reason}: {shown}" + (f" (+{len(details) - 4})" if len(details) > 4 else "")


def _active_since(tl: Timeline, comm: Comm, rank: int) -> float:
    """When `rank` last did anything the probes saw: on `comm`'s collectives, or any p2p op of its."""
    rec = tl.rank_record(comm.job, rank)
    p2p = rec.last_p2p[2] if rec is not None and rec.last_p2p is not None else None
    return max(x for x in (_last_activity(comm, rank), p2p, float("-inf")) if x is not None)


def _last_activity(comm: Comm, rank: int) -> Optional[float]:
    """When `rank` last did anything on `comm` that the probes saw: entered, started or ended one of
    its two newest collectives there (the newer may be waiting while the older ends)."""
    last = comm.last_entered.get(rank)
    if last is None:
        return None
    best = last[2]
    for s in (last[0], last[0] - 1):
        v = comm.colls.get(s)
        if v is not None:
            for got in (v.start.get(rank), v.end.get(rank)):
                if got is not None and got > best:
                    best = got
    return best


LOST_RE = re.compile(r"connection to group rank (\d+) broke")  # ccld/bpf/gloo.py writes it in WorkEnd.error


def _first_error(tl: Timeline, comm: Comm) -> Tuple[Optional[float], Set[int], Dict[int, int]]:
    """Over the newest RECENT_FAILED collectives: (earliest error end, ranks that reported an error,
    global rank -> how many of them say their connection to it broke). The first sign of a fault,
    who saw it, and whom they lost (a rank can fail the collective before the newest)."""
    first, who, named = None, set(), collections.Counter()
    order: Optional[List[int]] = None
    for s in range(comm.max_seq - RECENT_FAILED + 1, comm.max_seq + 1):
        v = comm.colls.get(s)
        if v is None or not v.failed:
            continue
        for r, err in v.failed.items():
            t = v.end.get(r)
            if t is not None and (first is None or t < first):
                first = t
            m = LOST_RE.search(err or "")
            if m is not None and r not in who:  # a rank's first error names the peer it lost first
                if order is None:
                    order = sorted(tl.expected_members(comm.id))  # group rank g is the g-th smallest member
                g = int(m.group(1))
                if 0 <= g < len(order):
                    named[order[g]] += 1
            who.add(r)
    return first, who, dict(named)


def died_first(tl: Timeline, comm: Comm, dead: List[int], since: Optional[float],
               erred: Set[int], named: Optional[Dict[int, int]] = None) -> Tuple[List[int], Dict[str, Any]]:
    """Of ranks that all stopped without finishing, those whose death started it: (ranks, how).

    A rank killed inside a collective is gone before its peers notice; the launcher then stops the
    others (torchrun: SIGTERM, ~0.1 s later), often before they notice too. So: ranks whose exit
    came from their launcher's signal are victims; of the rest, the rank(s) the
    failed ranks' errors say they lost the connection to (`named`, votes per rank); else a rank that
    reported an error, or did anything on `comm` after the fault's first error (`since`), outlived the
    fault and is a victim; of the rest, the one whose exit the agent saw first (not within one scan of
    another's) is the first to die. Each rule applies only when it leaves someone."""
    how: Dict[str, Any] = {}
    out = list(dead)
    stopped = stopped_by_launcher(tl, comm, out)
    if stopped and len(stopped) < len(out):  # the launcher stopped them after the others died
        out = [r for r in out if r not in stopped]
        how["stopped_by_launcher"] = listed(stopped)
        if len(out) == 1:
            return out, how
    votes = {r: n for r, n in (named or {}).items() if r in out}
    if votes:
        top = max(votes.values())
        lost = [r for r in out if votes.get(r) == top]
        if len(lost) < len(out):
            how["peers_lost_connection_to"] = {str(r): n for r, n in sorted(votes.items())}
            return sorted(lost), how
    if since is not None:
        alive_after = [r for r in out if r in erred or _active_since(tl, comm, r) >= since]
        if alive_after and len(alive_after) < len(out):
            out = [r for r in out if r not in alive_after]
            how["active_after_fault"] = listed(alive_after)
    if len(out) > 1:
        exits, exact = {}, True
        for r in out:
            rec = tl.rank_record(comm.job, r)
            if rec is not None and rec.exited_at is not None:
                exits[r] = rec.exited_at
                exact &= rec.exit_exact
        if len(exits) == len(out):
            t0 = min(exits.values())
            tie = EXACT_TIE_S if exact else EXIT_TIE_S
            early = [r for r in out if exits[r] - t0 < tie]
            if len(early) < len(out):
                how["exited_later"] = listed(r for r in out if r not in early)
                how["exit_times"] = "kernel" if exact else "agent scans"
                out = early
    return sorted(out), how


def _failed(tl: Timeline, comm: Comm, view: CollView, expected: Set[int], now: float,
            base: Dict[str, Any]) -> Optional[Finding]:
    first = min(view.end[r] for r in view.failed if r in view.end)
    if now - first < FAILED_GRACE_S:
        return None
    no_end = expected - view.end.keys()
    failed = set(view.failed)
    order = None
    how: Dict[str, Any] = {}
    if no_end:
        # Gloo reports an error on every rank that lost a peer; the one that neither finished nor
        # failed is where it started (it died, was stopped, or never came). The launcher stops the
        # other ranks within ~0.1 s of the first death, often before they notice a peer is gone, so
        # several may qualify: a rank that never entered is likelier the first than one waiting
        # inside, and died_first sorts out the rest where the events allow.
        dead = _dead(tl, comm, no_end)
        candidates = dead or sorted(no_end)
        outside = [r for r in candidates if r not in view.enter]
        blamed = outside if outside and len(outside) < len(candidates) else candidates
        if len(blamed) > 1:
            since, erred, named = _first_error(tl, comm)
            blamed, how = died_first(tl, comm, blamed, min(first, since) if since is not None else first,
                                     erred | failed, named)
        dead = [r for r in dead if r in blamed]
        if len(blamed) > 1:
            order = "unknown: these ranks all stopped without finishing, too close together to order"
        reason = _why_dead(tl, comm, dead) if dead else "peers-failed"
    else:
        dead = _dead(tl, comm, failed)
        blamed, reason = dead or sorted(failed), "failed"
    details = [rank_evidence(tl, comm, r, now) for r in blamed[:EVIDENCE_RANKS]]
    evidence = dict(base, reason=reason, failed_at=_r(first), failed_ranks=listed(failed), n_failed=len(failed),
                    never_ended=listed(no_end) or None, n_entered=len(view.enter.keys() & expected),
                    sizes_known=bool(view.sizes), death_order=order, ranks=details, summary=_summary(details, reason),
                    note="the library reported errors on the ranks that lost a peer during this collective; "
                         "a rank that died inside it (killed, out of memory, or aborted by the library, e.g. "
                         "on a message larger than expected: a tensor size mismatch) is named"
                         + ("; no tensor sizes were recorded for this collective, so a size mismatch cannot "
                            "be told apart" if not view.sizes else ""))
    if how:
        evidence["outlived_fault"] = how  # the other ranks that stopped unfinished, and why they are not named
    return Finding(kind="hang", cls="fault", ranks=blamed, comm=comm.id, seq=view.seq, op=view.op,
                   onset_at=first, detected_at=now, evidence=evidence, job=comm.job)


def floor_for(floor_s: Optional[float], first_done_at: Optional[float], now: float,
              completed: Optional[int] = None) -> float:
    """The shortest wait called a hang: `floor_s` when fixed; else FLOOR_S, lowered to
    LEARNED_FLOOR_S once the operations have LEARN_S of history (first completed at `first_done_at`)
    and, where the caller counts them, LEARN_MIN_OPS of them completed."""
    if floor_s is not None:
        return floor_s
    learned = (first_done_at is not None and now - first_done_at >= LEARN_S
               and (completed is None or completed >= LEARN_MIN_OPS))
    return LEARNED_FLOOR_S if learned else FLOOR_S


def check_comm(tl: Timeline, comm: Comm, now: float, floor_s: Optional[float] = None, k: float = K,
               activity: Optional[Activity] = None, blind: Optional[Blindness] = None) -> Optional[Finding]:
    """The hang (kind "hang") or pause (kind "slow", informational) finding for one communicator
    at time `now`, or None."""
    seq = comm.max_seq
    view: Optional[CollView] = comm.colls.get(seq) if seq >= 0 else None
    if view is None or not view.enter or (view.completed_at is not None and not view.failed):
        return None  # the common case (completed), answered without looking at any rank
    expected = tl.expected_members(comm.id)
    if len(expected) < 2:
        return None  # a group of one cannot wait on a peer
    if job_stopped(tl, comm, expected):
        return None  # its launcher stopped every member (a restart): nobody waits on anybody
    base = {"expected": len(expected), "failed": {str(r): e for r, e in sorted(view.failed.items())} or None}
    if view.failed:
        return _failed(tl, comm, view, expected, now, base)
    if blind_members(tl, comm, expected, now, blind):
        return None  # we cannot tell "has not entered" from "its events cannot reach us"
    spread_peak, dur_peak = tl.recent_peaks(comm.id, now)
    entered = expected & view.enter.keys()
    missing = expected - entered
    if len(missing) > NOTE_MAX_RANKS:
        # A crowd of members no agent has ever reported (a frame announcing a huge world, or a job
        # traced on a few of its nodes): "not entered" cannot be told from "not traced" for them, and
        # naming each one every tick is the tick's whole cost. Judge the members that are seen.
        unseen = {r for r in missing if tl.rank_record(comm.job, r) is None}
        if len(unseen) > NOTE_MAX_RANKS:
            if not comm.unseen_noted:
                tl.anomalies["unseen-members-not-judged"] += 1
                comm.unseen_noted = True
            missing = missing - unseen
            if not missing:
                return None
    if missing:
        onset = min(view.enter[r] for r in entered) if entered else view.first_enter()
        threshold = max(floor_for(floor_s, comm.first_done_at, now, comm.completed), k * spread_peak)
        if activity is not None and now - onset > NOTE_AFTER_S and len(missing) <= NOTE_MAX_RANKS:
            for r in missing:  # from early in the wait, so "working" is judged over all of it
                rec = tl.rank_record(comm.job, r)
                if rec is not None:
                    activity.note(rec)
        gone = crashed(tl, comm, missing)
        if now - onset <= threshold and not gone:
            return None
        # The missing ranks may themselves wait for others (in a send/recv, or another communicator's
        # collective): the culprits are the heads of those chains, and whether they are dead or working
        # is what decides the class.
        chain = waits.follow(tl, comm.job, sorted(missing))
        culprits = set(chain.heads)
        if activity is not None and culprits != missing and len(culprits) <= NOTE_MAX_RANKS:
            for r in culprits:
                rec = tl.rank_record(comm.job, r)
                if rec is not None:
                    activity.note(rec)
        dead = gone or _dead(tl, comm, culprits)  # the launcher's stops after a crash are its consequences
        busy_threshold = max(BUSY_FLOOR_S, k * spread_peak)
        pause = not dead and now - onset <= busy_threshold and _working(tl, comm, culprits, onset, activity)
        blamed = dead or sorted(culprits)
        details = [rank_evidence(tl, comm, r, now) for r in blamed[:EVIDENCE_RANKS]]
        reason = _why_dead(tl, comm, dead) if dead else "pause" if pause else "not-entered"
        evidence = dict(base, reason=reason, waited_s=round(now - onset, 3), threshold_s=round(threshold, 3),
                        learned_spread_s=round(spread_peak, 6), waiting=listed(entered), n_waiting=len(entered),
                        also_missing=listed(missing - set(blamed)) or None, ranks=details,
                        summary=_summary(details, reason))
        if culprits != missing and not chain.cycle:
            evidence["blamed_through"] = {"missing": listed(missing), "chain": chain.hops[:EVIDENCE_RANKS]}
            evidence["summary"] += "; the others wait for it through a chain"
        if chain.cycle:
            evidence["deadlock"] = True
        if pause:
            # what it is busy with flips between CPU and disk from sample to sample: not news
            evidence.update(informational=True, hang_after_s=round(busy_threshold, 3),
                            summary=f"pause: {_ranks_words(blamed)} working outside collectives",
                            note=f"the missing rank{'s are' if len(blamed) > 1 else ' is'} busy outside "
                                 "collectives (on CPU or in disk I/O) while the others wait: a checkpoint-"
                                 f"like pause, not a hang unless it lasts {busy_threshold:.0f} s")
            return Finding(kind="slow", cls="comp-slow", ranks=blamed, comm=comm.id, seq=seq, op=view.op,
                           onset_at=onset, detected_at=now, evidence=evidence, job=comm.job)
        if not dead:
            chains = {}
            for r in blamed[:EVIDENCE_RANKS]:
                hops, cycle = wait_chain(tl, comm, view, r)
                if hops:
                    chains[str(r)] = {"hops": hops, "deadlock": cycle}
            if chains:
                evidence["wait_chains"] = chains
                evidence["deadlock"] = evidence.get("deadlock", False) or any(c["deadlock"] for c in chains.values())
        return Finding(kind="hang", cls="fault" if dead else "not-entered", ranks=blamed, comm=comm.id,
                       seq=seq, op=view.op, onset_at=onset, detected_at=now, evidence=evidence, job=comm.job)
    not_ended = expected - view.end.keys()
    if not not_ended:
        return None  # completed: everyone is between collectives
    if comm.first_done_at is None and seq >= ENDLESS_AFTER:
        return None  # its source reports no completions (NCCL's API probes alone): "inside" is "in flight"
    onset = max(view.enter[r] for r in expected)
    threshold = max(floor_for(floor_s, comm.first_done_at, now, comm.completed), k * dur_peak)
    if now - onset <= threshold:
        return None
    dead = _dead(tl, comm, expected)
    started = expected & view.start.keys()
    how: Dict[str, Any] = {}
    if len(dead) > 1:  # killed inside, then the launcher stopped the others before any error came
        since, erred, named = _first_error(tl, comm)
        dead, how = died_first(tl, comm, dead, since, erred, named)
    if dead:
        blamed, reason = dead, _why_dead(tl, comm, dead)
    elif started and expected - started:
        blamed, reason = sorted(expected - started), "not-started"
    else:
        blamed, reason = sorted(not_ended), "not-finished"
    details = [rank_evidence(tl, comm, r, now) for r in blamed[:EVIDENCE_RANKS]]
    evidence = dict(base, reason=reason, waited_s=round(now - onset, 3), threshold_s=round(threshold, 3),
                    learned_duration_s=round(dur_peak, 6), finished=listed(expected - not_ended),
                    not_finished=listed(not_ended), n_not_finished=len(not_ended),
                    started=listed(started) if view.start else None,
                    note="all ranks entered; which link is at fault is not localised yet",
                    ranks=details, summary=_summary(details, reason))
    if how:
        evidence["outlived_fault"] = how
    return Finding(kind="hang", cls="fault", ranks=blamed, comm=comm.id, seq=seq, op=view.op,
                   onset_at=onset, detected_at=now, evidence=evidence, job=comm.job)


def check_all(tl: Timeline, now: float, floor_s: Optional[float] = None, k: float = K,
              activity: Optional[Activity] = None) -> List[Finding]:
    """Every communicator's hang or pause finding (both kinds; the facade splits them). `activity`
    (the Diagnoser's) judges a waited-for rank over its whole wait; without it, from one sample."""
    out = []
    blind: Optional[Blindness] = None
    for comm in list(tl.comms.values()):
        seq = comm.max_seq
        view = comm.colls.get(seq) if seq >= 0 else None
        if view is None or not view.enter or (view.completed_at is not None and not view.failed):
            continue  # check_comm's first test, without the call: most communicators, most ticks
        if blind is None:
            blind = Blindness(tl, now)
        f = check_comm(tl, comm, now, floor_s, k, activity, blind)
        if f is not None:
            out.append(f)
    if activity is not None:
        activity.prune(now)
    return out


def find_hangs(tl: Timeline, now: float, floor_s: Optional[float] = None, k: float = K) -> List[Finding]:
    return [f for f in check_all(tl, now, floor_s, k) if f.kind == "hang"]


def find_pauses(tl: Timeline, now: float, floor_s: Optional[float] = None, k: float = K) -> List[Finding]:
    """Informational: a rank busy outside collectives (checkpoint-like) while its peers wait."""
    return [f for f in check_all(tl, now, floor_s, k) if f.kind == "slow"]
