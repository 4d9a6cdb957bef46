"""When a wait is judged, and from how long it is a hang: the floors, their learning, and blind spots.

Thresholds adapt to the job: max(floor, k x the largest arrival spread (last enter - first enter))
for a member that has not entered (hang.py's case (a)), max(floor, k x the largest duration (last end -
last enter)) for one that has not finished (case (b)), over the communicator's collectives completed in
the last hour (Timeline.recent_peaks), so a rank that regularly arrives late (checkpointing on rank 0)
is not called hung. The floor is `floor_s` when the caller fixes it (--hang-after); by default (None)
FLOOR_S until the communicator has LEARN_S of completed collectives, then LEARNED_FLOOR_S: the job's
own waits, not a fixed guess, set how soon a wait is a hang (`floor_for`). A missing rank that is
working (busy on CPU or in disk I/O, e.g. writing a checkpoint: activity.py) while the others wait
gets BUSY_FLOOR_S instead of the floor. Times: Unix seconds.
A rank whose agent went silent (killed, partitioned) would look like a rank that has not entered,
so a communicator with such a member is not judged until its agent speaks again (AGENT_SILENT_S,
`Blindness`); so is one whose agent still sends heartbeats but not its ranks' records (AGENT_LAG_S:
its drain stalled, or the node or this collector was frozen for seconds: a CI run once saw every rank
of a healthy job look hung at once, 11-12 s at a time, as a paused VM would make them).
hang.py (collectives) and p2phang.py (sends and receives) judge by these.
"""
from __future__ import annotations

import collections
from typing import Dict, List, Optional, Set

from ccld.timeline.records import Comm, RankRecord
from ccld.timeline.timeline import Timeline

FLOOR_S = 5.0   # never call a hang before this while a communicator's normal is unknown: agents ship every 0.5 s
LEARNED_FLOOR_S = 3.0  # ... and once LEARN_S of its collectives completed (and k x their worst spread is lower):
LEARN_S = 15.0         # ... and at least LEARN_MIN_OPS of them: the job's own waits say how long they get; 3 s is
LEARN_MIN_OPS = 100    # 6 of the agent's 500 ms drains. (60 s before issue 18: a DDP hang 20 s into a job
                       # was named after the 5 s floor; K x the worst spread seen keeps slow-arriving jobs safe)
K = 4.0         # x the job's own worst recent spread/duration
AGENT_SILENT_S = 3.0  # agents send a frame every 0.5 s (a heartbeat each second when idle); 3 s without one ...
AGENT_LAG_S = 3.0     # ... and so are we when its latest /proc state (every ~1 s, after a drain) is this old:
                      # heartbeats still come, but its ranks' records do not (a stalled drain, a frozen VM)
# A missing rank that is busy (CPU or disk) while its peers wait is most likely checkpointing or
# evaluating: it is a hang only after this long (or K x the job's longest such wait, if longer).
BUSY_FLOOR_S = 120.0


def blind_agents(tl: Timeline, now: float) -> Set[str]:
    """Agents whose ranks cannot be judged at `now`: silent, or lagging (Timeline.agent_is_lagging)."""
    return {a for a in tl.agents
            if tl.agent_is_silent(a, now, AGENT_SILENT_S) or tl.agent_is_lagging(a, now, AGENT_LAG_S)}


class Blindness:
    """Which ranks' agents are blind at `now` (silent, or lagging: blind_agents), worked out once
    per tick for every communicator: O(agents) to find the blind agents and, only when there are
    some, O(ranks) once to list their ranks per job (not O(members) per communicator)."""

    def __init__(self, tl: Timeline, now: float):
        self.tl = tl
        self.silent = blind_agents(tl, now)
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
