"""Synthetic jobs for unit tests: ranks on nodes with their own monotonic epochs, sent as real frames.

Tests say what happens in Unix seconds; FakeAgent turns that into node-monotonic ts_ns the way a
real agent would, and puts a ClockSample at the end of every frame (as the shipper does), so every
test also goes through the wire schema and the clock conversion.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional

from ccld import wire as ev

T0 = 1_764_400_000.0


class FakeAgent:
    def __init__(self, agent: str, node: str, boot_unix: float):
        self.agent, self.node, self.boot_unix = agent, node, boot_unix
        self.batch_no = 0
        self.pending: List[ev.Event] = []

    def mono(self, t_unix: float) -> int:
        return int(round((t_unix - self.boot_unix) * 1e9))

    def clock(self, t_unix: float) -> ev.ClockSample:
        m = self.mono(t_unix)
        return ev.ClockSample(mono_ns=m, wall_ns=int(round(t_unix * 1e9)), ts_ns=m)

    def frame(self, t_send: float, events: Optional[List[ev.Event]] = None) -> bytes:
        evs = list(self.pending if events is None else events)
        if events is None:
            self.pending = []
        self.batch_no += 1
        return ev.encode_batch(self.agent, self.node, self.batch_no, evs + [self.clock(t_send)])


class SynthJob:
    """`world` ranks of job `job` spread over `nodes` nodes, one agent per node, one gloo comm."""

    def __init__(self, world: int = 4, nodes: int = 2, job: str = "job", t0: float = T0):
        self.world, self.job = world, job
        self.comm = f"{job}/gloo:0"
        per = max(1, world // nodes)
        self.agents = [FakeAgent(f"agent-{n}", f"node{n}", boot_unix=t0 - 1000.0 * (n + 1)) for n in range(nodes)]
        self.agent_of = {r: self.agents[min(r // per, nodes - 1)] for r in range(world)}
        self.pid = {r: 1000 + r for r in range(world)}

    def _put(self, r: int, e: ev.Event) -> None:
        self.agent_of[r].pending.append(e)

    def ts(self, r: int, t: float) -> int:
        return self.agent_of[r].mono(t)

    def announce(self, t: float, group_size: Optional[int] = None) -> None:
        for a in self.agents:
            a.pending.append(ev.AgentHello(agent=a.agent, node=a.node, pid=1, version="test",
                                           sources=["gloo"], ts_ns=a.mono(t)))
        for r in range(self.world):
            a = self.agent_of[r]
            self._put(r, ev.RankInfo(pid=self.pid[r], rank=r, world_size=self.world, local_rank=r,
                                     node=a.node, job=self.job, ts_ns=self.ts(r, t)))
            self._put(r, ev.CommInit(pid=self.pid[r], rank=r, ts_ns=self.ts(r, t), backend="gloo",
                                     comm=self.comm, group_rank=r,
                                     group_size=self.world if group_size is None else group_size))

    def enter(self, r: int, seq: int, t: float, op: str = "allreduce", comm: Optional[str] = None) -> None:
        self._put(r, ev.CollEnter(pid=self.pid[r], rank=r, ts_ns=self.ts(r, t), backend="gloo",
                                  comm=comm or self.comm, seq=seq, op=op))

    def start(self, r: int, seq: int, t: float) -> None:
        self._put(r, ev.WorkStart(pid=self.pid[r], rank=r, ts_ns=self.ts(r, t), comm=self.comm, seq=seq))

    def end(self, r: int, seq: int, t: float, ok: bool = True) -> None:
        self._put(r, ev.WorkEnd(pid=self.pid[r], rank=r, ts_ns=self.ts(r, t), comm=self.comm, seq=seq, ok=ok,
                                error="" if ok else "boom"))

    def post(self, r: int, op: str, peer: int, n: int, t: float, comm: Optional[str] = None, nbytes: int = 4096) -> None:
        """Rank r posts its n-th `op` ("send"/"recv") with group rank `peer` (the default group: global)."""
        self._put(r, ev.P2P(pid=self.pid[r], rank=r, ts_ns=self.ts(r, t), backend="gloo", comm=comm or self.comm,
                            op=op, peer=peer, seq=n, nbytes=nbytes))

    def p2p_end(self, r: int, op: str, peer: int, n: int, t: float, comm: Optional[str] = None,
                ok: bool = True) -> None:
        self._put(r, ev.P2PEnd(pid=self.pid[r], rank=r, ts_ns=self.ts(r, t), comm=comm or self.comm, op=op,
                               peer=peer, seq=n, ok=ok, error="" if ok else "boom"))

    def transfer(self, src: int, dst: int, n: int, t: float, send_at: Optional[float] = None,
                 recv_at: Optional[float] = None, dur: float = 0.001) -> float:
        """The n-th transfer src -> dst: src posts at send_at, dst at recv_at (both default t); both
        sides are over `dur` after the later post. Returns that end time."""
        s_at = t if send_at is None else send_at
        r_at = t if recv_at is None else recv_at
        end = max(s_at, r_at) + dur
        self.post(src, "send", dst, n, s_at)
        self.post(dst, "recv", src, n, r_at)
        self.p2p_end(src, "send", dst, n, end)
        self.p2p_end(dst, "recv", src, n, end)
        return end

    def pipeline(self, steps: int, t: float, first_seq: int = 1, stage_ms: float = 5.0,
                 slow: Optional[Dict[int, float]] = None, first_n: int = 1,
                 link_ms: Optional[Dict[tuple, float]] = None) -> float:
        """`steps` steps of a one-micro-batch pipeline over every rank (stage = rank), then a loss
        all-reduce (seq first_seq + step): stage r > 0 posts its recv from r-1 at the step's start,
        computes stage_ms (+ slow[r]) once its input came, sends to r+1 (the n-th transfer, from
        `first_n`) and enters the all-reduce, where it waits for the last stage. A transfer takes 1 ms,
        plus link_ms[(r, r + 1)]. Returns the end."""
        slow, link_ms = slow or {}, link_ms or {}
        for i in range(steps):
            seq, n = first_seq + i, first_n + i
            ready = t
            enters = {}
            for r in range(self.world):
                done = ready + (stage_ms + slow.get(r, 0.0)) / 1e3
                if r + 1 < self.world:
                    ready = self.transfer(r, r + 1, n, done, recv_at=t,
                                          dur=0.001 + link_ms.get((r, r + 1), 0.0) / 1e3)
                enters[r] = ready if r + 1 < self.world else done
            for r, at in enters.items():
                self.enter(r, seq, at)
            last = max(enters.values())
            for r in range(self.world):
                self.start(r, seq, last)
                self.end(r, seq, last + 0.0005)
            t = last + 0.001
        return t

    def state(self, r: int, t: float, state: str, wchan: str = "", cpu_ns: int = 0) -> None:
        self._put(r, ev.RankState(pid=self.pid[r], rank=r, ts_ns=self.ts(r, t), state=state, wchan=wchan,
                                  cpu_ns=cpu_ns))

    def exit(self, r: int, t: float, exact: bool = False, signal: int = 0, by_launcher: bool = False) -> None:
        self._put(r, ev.RankExit(pid=self.pid[r], rank=r, ts_ns=self.ts(r, t), exact=exact, signal=signal,
                                 by_launcher=by_launcher))

    def collective(self, seq: int, t: float, op: str = "allreduce", spread: float = 0.002,
                   dur: float = 0.003, ranks: Optional[Iterable[int]] = None, finish: bool = True,
                   late: Optional[Dict[int, float]] = None) -> float:
        """Ranks enter between t and t+spread (rank r at t + spread*r/(world-1), plus late[r]); all
        start when the last arrives and end `dur` later. Returns the end time."""
        ranks = list(range(self.world)) if ranks is None else list(ranks)
        late = late or {}
        enters = {r: t + spread * r / max(1, self.world - 1) + late.get(r, 0.0) for r in ranks}
        last = max(enters.values())
        for r in ranks:
            self.enter(r, seq, enters[r], op)
        if finish:
            for r in ranks:
                self.start(r, seq, last)
                self.end(r, seq, last + dur)
        return last + dur

    def steps(self, first_seq: int, n: int, t: float, period: float = 0.1, **kw) -> float:
        """n healthy collectives first_seq.. first_seq+n-1, one every `period` s; returns the last end."""
        end = t
        for i in range(n):
            end = self.collective(first_seq + i, t + i * period, **kw)
        return end

    def frames(self, t_send: float) -> List[bytes]:
        # Every agent sends a frame each time, events or not, as the real agent does (its clock
        # sample every 100 ms); a node that stops sending is what "silent agent" means.
        return [a.frame(t_send) for a in self.agents]

    def feed(self, timeline, t_send: float) -> None:
        """Ship everything pending to `timeline` as frames received at t_send."""
        for f in self.frames(t_send):
            timeline.ingest(ev.decode_batch(f), t_send)


def rank_ip(r: int) -> str:
    return f"10.9.0.{r + 1}"


def rank_port(r: int, peer: int) -> int:
    """The local port of rank r's connection to `peer` (unique per rank and peer)."""
    return 20000 + 100 * r + peer


class SynthLinks:
    """Both ends of every rank pair's TCP connection of a SynthJob, reported as LinkStats.

    Counters are cumulative, as the agent ships them: `send(r, peer, t, nbytes, ...)` adds to rank r's
    side of the (r, peer) connection and to the peer's receive side, then queues both reports."""

    def __init__(self, job: "SynthJob"):
        self.job = job
        self.c: Dict[tuple, Dict[str, int]] = {}

    def _side(self, r: int, peer: int) -> Dict[str, int]:
        return self.c.setdefault((r, peer), dict(tx_bytes=0, rx_bytes=0, retrans=0, resets=0, srtt_us=0))

    def report(self, r: int, peer: int, t: float, **extra) -> None:
        s = self._side(r, peer)
        self.job._put(r, ev.LinkStats(pid=self.job.pid[r], rank=r, ts_ns=self.job.ts(r, t), saddr=rank_ip(r),
                                      sport=rank_port(r, peer), daddr=rank_ip(peer), dport=rank_port(peer, r),
                                      state="ESTABLISHED", **dict(s, **extra)))

    def send(self, r: int, peer: int, t: float, nbytes: int, srtt_us: int = 50, retrans: int = 0,
             resets: int = 0) -> None:
        me, them = self._side(r, peer), self._side(peer, r)
        me["tx_bytes"] += nbytes
        me["retrans"] += retrans
        me["resets"] += resets
        me["srtt_us"] = srtt_us
        them["rx_bytes"] += nbytes
        self.report(r, peer, t)
        self.report(peer, r, t)

    def ring(self, t: float, nbytes: int = 16384, srtt: Optional[Dict[tuple, int]] = None,
             retrans: Optional[Dict[tuple, int]] = None) -> None:
        """Every rank sends nbytes to the next one (a ring all-reduce's traffic)."""
        w = self.job.world
        for r in range(w):
            p = (r, (r + 1) % w)
            self.send(r, p[1], t, nbytes, srtt_us=(srtt or {}).get(p, 50), retrans=(retrans or {}).get(p, 0))
