"""Refine the nodes' clock offsets with the job itself: ranks leave one collective together.

The ranks of a blocking collective (all-reduce, all-gather, barrier, ...) cannot finish before the
last one's data reached them, so they leave it within microseconds of each other, whoever arrived
late. Each matched collective (communicator, seq) whose WorkEnds come from two or more agents is a
free synchronization point: per agent, the median of its ranks' end times (in its *base* timebase,
the round-trip conversion without any refinement); per agent, the residual against a reference
agent. The median of an agent's last WINDOW residuals (robust to a straggling or descheduled rank)
is its clock error relative to the reference. The round trips fix the common part: corrections are
centred on the round-trip estimates, weighted by 1/uncertainty^2, and each is clamped to its own
round-trip uncertainty (a node without a time service, converting with its wall clock, may be moved
up to MAX_WALL_CORRECTION_S: its error is not bounded by anything measured).

Units: ns. A collective is read once it has waited SETTLE_S of the collector's receive time since its
first WorkEnd came (`now`, set by the timeline per frame: agents ship every 0.5 s, so by then every
agent's ends are in, at any rate of collectives), or once MAX_ENTRIES (agent, collective) entries
wait; without receive times that move (a caller that gives none, frames stamped alike),
SETTLE_GROUPS collectives after it.
Corrections are recomputed every UPDATE_EVERY collectives used, at most every UPDATE_MIN_S of receive
time (the sorts of WINDOW residuals are the refinement's main cost; clocks drift slowly).
The job's estimate is weighed against the round trips' by precision: its error is taken as the
median's standard error plus how far apart ranks leave one collective (the residuals' robust spread,
at least JOB_SYNC_FLOOR_NS), so on busy CPUs, where ranks leave milliseconds apart, it barely counts,
and on a healthy cluster, where they leave microseconds apart, it dominates.
Sources: gloo's WorkEnd (finishWorkGloo in every rank). NCCL's host API returns before the GPU work
ends, so it gives no such point; CUPTI's kernel ends could (not used yet).
Caveat: the premise fails where ranks do not leave together (a reduce or broadcast whose root leaves
early, a rank that errors out); failed ends are ignored and the median discards a minority of such
groups, but an exit order skewed more than the spread biases the result, within the clamp.
"""
from __future__ import annotations

import collections
import math
from typing import Any, Callable, Deque, Dict, Iterable, List, Optional, Tuple

SETTLE_S = 1.0            # receive time a collective waits for every agent's ends (frames every 0.5 s)
MAX_ENTRIES = 131_072     # (agent, collective) entries waiting, at most: 64 collectives of 2,048 agents
SETTLE_GROUPS = 64        # without receive times: read 64 collectives later (a handful are in flight)
UPDATE_MIN_S = 0.5        # receive time between recomputations, at least
WINDOW = 1000             # residuals kept per agent: minutes of a job at ten collectives a second
MIN_GROUPS = 20           # an agent's correction needs this many shared collectives (median of 20 is robust)
BATCHES = 10              # batch medians for the standard error (see _median_se)
UPDATE_EVERY = 10         # read collectives between recomputations
JOB_SYNC_FLOOR_NS = 5_000  # ranks leave one collective within a few us: the method's own floor
MAX_WALL_CORRECTION_S = 60.0  # a wall-clock (no time service) node: any NTP-less error up to this
REF_LOST_AFTER = 50       # multi-agent collectives in a row without the reference agent: pick a new one


def _median(xs: List[int]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def _median_se(xs: List[int], med: float) -> float:
    """Standard error of the median of xs, honest about runs: consecutive collectives share a busy
    CPU or a slow link, so their residuals are not independent. The larger of the i.i.d. formula
    (1.2533 x robust sigma / sqrt n) and the spread of the medians of BATCHES consecutive batches."""
    n = len(xs)
    mad_se = 1.2533 * 1.4826 * _median([abs(x - med) for x in xs]) / math.sqrt(n)
    if n < 5 * BATCHES:
        return 2 * mad_se  # too few for batches: assume runs halve the information
    size = n // BATCHES
    meds = [_median(xs[i * size:(i + 1) * size]) for i in range(BATCHES)]
    mean = sum(meds) / BATCHES
    batch_se = math.sqrt(sum((m - mean) ** 2 for m in meds) / (BATCHES - 1) / BATCHES)
    return max(mad_se, batch_se)


class JobClockRefiner:
    """Collects WorkEnd times per (comm, seq) and agent; hands corrections to `apply`.

    base_ns(agent, mono_ns) -> Unix ns without refinement (None when the agent has no clock);
    source(agent) -> "sync" or "wall"; uncertainty_ns(agent) -> the round-trip (or wall) bound;
    apply({agent: (correction_ns, uncertainty_ns, rel_uncertainty_ns, groups)}) installs them."""

    def __init__(self, base_ns: Callable[[str, int], Optional[int]], source: Callable[[str], str],
                 uncertainty_ns: Callable[[str], int], apply: Callable[[Dict[str, tuple]], None]):
        self.base_ns, self.source, self.uncertainty_ns, self.apply = base_ns, source, uncertainty_ns, apply
        # (comm, seq) -> (receive time of its first end or None, agent -> its ranks' end times), oldest first
        self.groups: "collections.OrderedDict[Tuple[str, int], Tuple[Optional[float], Dict[str, List[int]]]]" = \
            collections.OrderedDict()
        self.now: Optional[float] = None  # receive time (s) of the frame being read (arrived); None: not known
        self.moving = False               # receive times have changed since the first (else: settle by count)
        self.entries = 0                  # (agent, collective) entries in groups
        self.last_update: Optional[float] = None
        self.ref: Optional[str] = None
        self.resid: Dict[str, Deque[int]] = {}
        self.sources: Dict[str, str] = {}
        self.read = 0           # collectives read
        self.used = 0           # ... that had 2+ agents and the reference
        self.without_ref = 0    # multi-agent collectives in a row without the reference
        self.clamped: Dict[str, bool] = {}

    def observe_end(self, agent: str, comm: str, seq: int, mono_ns: int) -> None:
        t = self.base_ns(agent, mono_ns)
        if t is None:
            return
        self.observe_groups([(agent, comm, seq, [t])])

    def arrived(self, now: float) -> None:
        """The receive time (s, never decreasing) of the frame whose ends come next. Until it has
        changed once, collectives settle by count (tests and synthetic stores stamp frames alike)."""
        if self.now is not None and now != self.now:
            self.moving = True
        self.now = now

    def _settle(self) -> None:
        """Read the collectives that waited long enough (SETTLE_S of receive time, or SETTLE_GROUPS
        collectives when it is not known), or beyond MAX_ENTRIES."""
        groups, now = self.groups, self.now
        while groups:
            first = next(iter(groups.values()))[0]
            if self.moving and first is not None:
                settled = now - first >= SETTLE_S
            else:  # receive time unknown, or the same for every frame so far: count
                settled = len(groups) >= SETTLE_GROUPS
            if not settled and self.entries <= MAX_ENTRIES:
                break
            _, (_, old) = groups.popitem(last=False)
            self.entries -= len(old)
            self._read(old)

    def observe_groups(self, groups: Iterable[Tuple[str, str, int, List[int]]]) -> None:
        """observe_end for each (agent, comm, seq, its ranks' ends in base Unix ns) in turn: a flush's
        ends in one call (each agent's timebase is looked at once: it cannot change within one)."""
        checked = set()
        for agent, comm, seq, ends in groups:
            if agent not in checked:
                checked.add(agent)
                src = self.source(agent)
                if self.sources.get(agent) != src:  # its base timebase changed: old residuals mean nothing now
                    self.sources[agent] = src
                    self._forget(agent)
            key = (comm, seq)
            got = self.groups.get(key)
            if got is None:
                self._settle()
                got = self.groups[key] = (self.now, {})
            g = got[1]
            have = g.get(agent)
            if have is None:
                g[agent] = list(ends)
                self.entries += 1
            else:
                have.extend(ends)

    def _forget(self, agent: str) -> None:
        """`agent`'s base timebase changed (its first round-trip estimate, say): its residuals, and its
        ends still waiting in collectives (up to SETTLE_S of them: at 1,000+ collectives a second they
        would fill the whole WINDOW), were measured on the old one."""
        for _, g in self.groups.values():
            if g.pop(agent, None) is not None:
                self.entries -= 1
        if agent == self.ref:
            self.ref = None
            self.resid.clear()
        else:
            self.resid.pop(agent, None)

    def _read(self, group: Dict[str, List[int]]) -> None:
        self.read += 1
        if len(group) < 2:
            return
        if self.ref is None or self.ref not in group:
            if self.ref is not None:
                self.without_ref += 1
                if self.without_ref < REF_LOST_AFTER:
                    return
            self.ref, self.without_ref = min(group), 0  # deterministic: same store, same reference
            self.resid.clear()
        self.without_ref = 0
        m_ref = _median(group[self.ref])
        for a, ends in group.items():
            if a != self.ref:
                self.resid.setdefault(a, collections.deque(maxlen=WINDOW)).append(int(_median(ends) - m_ref))
        self.used += 1
        if self.used % UPDATE_EVERY == 0 and (not self.moving or self.last_update is None
                                              or not 0 <= self.now - self.last_update < UPDATE_MIN_S):
            self.last_update = self.now
            self.update()

    def update(self) -> None:
        """Recompute every correction from the residuals kept.

        Unknowns: x_a, agent a's error in its base timebase. The round trips say x_a ~ 0 with spread
        r_a (half the uncertainty bound: the bound is about 2 sigma; infinite for a wall-clock node);
        the job says x_a - x_ref ~ delta_a with spread s_a (the median's standard error, with the
        method's floor). Least squares over both, solved in closed form (every relation is to the
        reference): each source counts by how precise it is, so a noisy job (ranks that leave a
        collective milliseconds apart on busy CPUs) barely moves a good round-trip estimate."""
        if self.ref is None:
            return
        delta: Dict[str, float] = {}
        s2: Dict[str, float] = {}
        n: Dict[str, int] = {}
        for a, r in self.resid.items():
            if len(r) < MIN_GROUPS:
                continue
            xs = list(r)
            med = _median(xs)
            se = _median_se(xs, med)
            # How far apart ranks leave one collective here (robust sigma of the residuals: the clock
            # error is the same for all of them) also bounds how skewed their exit order may be on
            # average: the job's word is never trusted beyond one collective's spread.
            spread = 1.4826 * _median([abs(x - med) for x in xs])
            delta[a], s2[a], n[a] = med, se * se + max(JOB_SYNC_FLOOR_NS, spread) ** 2, len(xs)
        if not delta:
            return
        agents = [self.ref] + list(delta)
        wall = {a: self.source(a) == "wall" for a in agents}
        u = {a: max(1, self.uncertainty_ns(a)) for a in agents}
        r2 = {a: math.inf if wall[a] else (u[a] / 2) ** 2 for a in agents}
        # y = x_ref: minimise y^2/r2_ref + sum_a (y + delta_a)^2 / (r2_a + s2_a)
        num = sum(delta[a] / (r2[a] + s2[a]) for a in delta)
        den = (0.0 if wall[self.ref] else 1.0 / r2[self.ref]) + sum(1.0 / (r2[a] + s2[a]) for a in delta)
        y = -num / den if den > 0 else 0.0
        var_y = 1.0 / den if den > 0 else 0.0
        x = {self.ref: y}
        var = {self.ref: var_y}
        rel = {self.ref: JOB_SYNC_FLOOR_NS}
        for a in delta:
            k = 1.0 if wall[a] else r2[a] / (r2[a] + s2[a])  # how much of the job's word counts for a
            x[a] = k * (y + delta[a])
            var[a] = (s2[a] if wall[a] else r2[a] * s2[a] / (r2[a] + s2[a])) + k * k * var_y
            rel[a] = math.sqrt(s2[a])
        out = {}
        for a in agents:
            bound = MAX_WALL_CORRECTION_S * 1e9 if wall[a] else u[a]
            corr = -x[a]
            self.clamped[a] = abs(corr) > bound
            corr = max(-bound, min(bound, corr))
            unc = 2 * math.sqrt(var[a])  # back to a ~2-sigma bound, like the round trips'
            if not wall[a]:
                unc = min(u[a], unc)
            out[a] = (int(round(corr)), int(math.ceil(unc)), int(math.ceil(2 * rel[a])),
                      n.get(a, min(n.values())))
        self.apply(out)

    def counters(self) -> Dict[str, Any]:
        return {"collectives_read": self.read, "collectives_used": self.used,
                "open": len(self.groups), "reference": self.ref or ""}
