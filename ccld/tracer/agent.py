"""The node agent: discovers a job's ranks, attaches probe families (families.py) to them, and ships events.

One thread does the work, in a loop: drain every family's ring buffer (POLL_MS), and every
SCAN_INTERVAL_MS look at /proc for ranks that appeared (attach) or went away (detach, forget).
Ranks are found as descendants of a launched command (`ccld run`), as given PIDs and their
descendants (`ccld agent --pid`), or anywhere on the node (`--discover`). Times are this node's
CLOCK_MONOTONIC ns (shifted by CCLD_TEST_CLOCK in tests: nodeclock.py), measured against the
collector's clock by timesync.py. A failure on one rank or one library is a warning; the agent
keeps going, and nothing here can block or fail the traced job (probes are entry-only, the queue
drops when full). Frames wait in a spool (spool.py; on disk with `ccld agent`) until the collector
acknowledges them, and are sent again after it restarts.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

from ccld import __version__
from ccld import wire as ev
from ccld.errors import CcldError, EnvironmentProblem
from ccld.tracer import discover, ibcounters, procstate
from ccld.tracer.families import FAMILY_NAMES, Preloaded, load_families
from ccld.tracer.nodeclock import NodeClock
from ccld.tracer.shipper import Shipper
from ccld.tracer.sinks import RankSinks
from ccld.tracer.spool import DEFAULT_MAX_BYTES as DEFAULT_SPOOL_BYTES, Spool

log = logging.getLogger("ccld.agent")

POLL_MS = 500             # ring-buffer drain period: records wait at most this long in the kernel, a hang is
                          # judged over seconds (floor >= 3 s; a node's data counts as complete up to its last
                          # RankState, sent once a second), and a drain's cost is mostly fixed (numpy calls in
                          # the translator, a frame in the shipper; 1.6-3.7x a hot loop's, caches being cold
                          # after the sleep): 250 -> 500 ms took the agent from 0.93 to 0.68 % of a core on a
                          # busy job (bench/agent_cost.py). The collector's cost is per frame too
FAST_POLL_MS = 125        # ... but while records come fast enough to fill more than FAST_SHARE of a ring
FAST_SHARE = 0.25         # buffer in POLL_MS (or a drain took that much), the next drain comes this soon (a
                          # burst: gloo's 16 MiB ring holds 1.3 s of 20,000 collectives/s, bench/burst.py)
SCAN_INTERVAL_MS = 200    # new ranks are attached within this (+ attach time) of mapping libtorch ...
IDLE_SCAN_INTERVAL_MS = 1000  # ... while ranks come and go; once the set is stable for STABLE_S, scan
STABLE_S = 30.0               # /proc less often (a full scan reads every /proc/PID/stat: ~1 % of a core)
WALK_EVERY_S = 5.0        # once stable, /proc is walked for new ranks only when a pid was given out (Agent._walk_due),
                          # and at least this often (a process that execs into a rank makes no new pid)
PROC_INTERVAL_S = 1.0     # /proc state of each rank, shipped as liveness and "what it is doing"
ANNOUNCE_S = 10.0         # re-send hello and ranks so a restarted collector relearns the job
NEG_CACHE_LIMIT = 65536   # remembered non-rank processes (by pid+cmdline) in --discover mode
MAPS_RECHECK_S = 10.0     # a rank's /proc/PID/maps (thousands of lines with torch) is read again when its
                          # address space grew (a library mapped), or at the latest this often
NIC_INTERVAL_S = 5.0      # RDMA port counters (sysfs, cumulative; ~50 file reads per port): seconds are enough


def poll_after(busiest: float, since_ms: float, poll_ms: int = POLL_MS) -> int:
    """The ms until the next drain, after a drain whose fullest ring buffer gave up `busiest` of its room
    `since_ms` after the drain before it. Judged by rate (what a drain poll_ms apart would take), so the
    fast period holds while a burst lasts, not just for the one drain after the first big one."""
    rate = busiest * poll_ms / max(since_ms, 1.0)
    return min(FAST_POLL_MS, poll_ms) if max(busiest, rate) > FAST_SHARE else poll_ms


def drain_ms_from_env() -> int:
    """POLL_MS, or CCLD_DRAIN_MS when set (benchmarks compare periods; a user may trade CPU for promptness)."""
    raw = os.environ.get("CCLD_DRAIN_MS")
    if raw is None or raw == "":
        return POLL_MS
    try:
        ms = int(raw)
    except ValueError:
        ms = -1
    if not 50 <= ms <= 5000:
        raise CcldError(f"CCLD_DRAIN_MS={raw!r}: the agent's drain period is a whole number of milliseconds "
                        "from 50 to 5000 (default 500)")
    return ms


@dataclass
class Rank:
    ident: discover.RankIdentity
    attached: Dict[str, str] = field(default_factory=dict)  # family -> library path
    failed: Set[str] = field(default_factory=set)            # families that failed to attach
    last_state: Optional[Tuple[str, str, int]] = None
    last_state_at: float = 0.0
    maps_vsize: int = -1         # the address space's size when its maps were last read for libraries
    maps_read_at: float = 0.0
    ppid: int = 0                # its parent (the launcher, under torchrun): a signal from it is a stop


class Agent:
    def __init__(self, endpoint: str, *, pids: Sequence[int] = (), root_pid: Optional[int] = None,
                 discover_all: bool = False, use_bpf: bool = True, say: Callable[[str], None] = print,
                 node: Optional[str] = None, keys=None, probes: Sequence[str] = FAMILY_NAMES,
                 time_service: Optional[str] = None, clock: Optional[NodeClock] = None,
                 spool_dir: Optional[str] = None, spool_max_bytes: int = DEFAULT_SPOOL_BYTES,
                 preloaded: Optional[Preloaded] = None, cupti_sink=None, ncclprof_sink=None):
        if not pids and root_pid is None and not discover_all:
            raise CcldError("the agent needs something to trace: --pid PID, --discover, or a command (ccld run)")
        self.endpoint = endpoint
        self.poll_ms = drain_ms_from_env()
        self.pids, self.root_pid, self.discover_all = list(pids), root_pid, discover_all
        self.use_bpf = use_bpf
        self.probes = list(probes)
        self.say = say
        self.node = node or socket.gethostname()
        self.agent_id = f"{self.node}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.ranks: Dict[int, Rank] = {}
        self.families: List[Tuple[object, object]] = []
        self.sources: List[str] = ["proc"]
        self.bpf_problem: Optional[EnvironmentProblem] = None
        self._not_ranks: Dict[Tuple[int, str], None] = {}
        self._tree = discover.ProcTree()  # parents read once per process, not every scan
        self._walked: Tuple[int, float] = (-1, 0.0)  # last_pid before the last walk for candidates, and when
        self._walk_again = True  # that walk met a new process (it may still exec): the next scan walks too
        self._stop = threading.Event()
        self._stopped = False
        self._last_change = time.monotonic()  # when a rank last appeared, left or got its probes
        self._thread: Optional[threading.Thread] = None
        # Clock sync with the collector's time service (default: its port + 1; "off": wall clock only)
        from ccld.tracer.timesync import TimeSync
        from ccld.wire.protocol import default_time_endpoint
        self.clock = clock or NodeClock.from_env()
        self.time_service = default_time_endpoint(endpoint) if time_service is None else time_service
        self.timesync = (TimeSync(self.time_service, self.clock, keys=keys, say=say)
                         if self.time_service and self.time_service != "off" else None)
        # Frames wait in the spool until the collector acknowledges them (asked on the time service);
        # on disk with a spool_dir (`ccld agent`), else in memory.
        self.spool = Spool(spool_dir, spool_max_bytes, collector=endpoint, say=say).open()
        self.shipper = Shipper(endpoint, self.agent_id, self.node, extra_loss=self._loss, keys=keys,
                               clock=self.clock, sync=self.timesync, spool=self.spool,
                               acks=self.timesync.endpoint if self.timesync is not None else None, say=say)
        # what code inside the ranks sends: the CUPTI shim, the NCCL profiler plugin (when ccld run injects them)
        self.sinks = RankSinks(self.shipper.put, self._ident_of, self._plugin_took_nccl)
        self.nic = ibcounters.CounterReader()  # RDMA NIC port counters, sampled when the node has any
        self._preloaded = preloaded
        if preloaded is not None:
            self._adopt(preloaded)
        if cupti_sink is not None:  # made before the agent (ccld run): its records come here now
            self.sinks.adopt_cupti(cupti_sink)
        if ncclprof_sink is not None:
            self.sinks.adopt_ncclprof(ncclprof_sink)

    # -- lifecycle ---------------------------------------------------------------------------
    def load(self) -> None:
        """Load the probe families (from the compiled-program cache: ~10 ms each; compiling: ~1 s
        each). Says once which sources are on."""
        if self._preloaded is None:
            self._adopt(load_families(self.probes, self.use_bpf))

    def _adopt(self, pre: Preloaded) -> None:
        self._preloaded = pre
        pre.relay.target = self.shipper.put
        self.families, self.sources, self.bpf_problem = list(pre.families), list(pre.sources), pre.problem
        for line in pre.warnings:
            self.say(line)
        if self.bpf_problem is not None and self.use_bpf:
            self.say(f"ccld: eBPF probes are off: {self.bpf_problem} (fix: {self.bpf_problem.hint}); "
                     f"tracing with /proc only")
            for fam, _ in self.families:
                fam.close()
            self.families = []
            self.sources = ["proc"]

    def start(self) -> "Agent":
        if self._preloaded is None:
            self.load()
        if self.timesync is not None:
            self.timesync.start()
        self.shipper.start()
        if self.nic.present():
            self.sources.append("ib-counters")
        self._announce()
        self._thread = threading.Thread(target=self._loop, name="ccld-agent", daemon=True)
        self._thread.start()
        return self

    @property
    def all_sources(self) -> List[str]:
        """Every source of events: the probe families, /proc, and the sinks of code inside the ranks."""
        return list(self.sources) + self.sinks.sources

    def open_cupti_sink(self) -> str:
        """Receive GPU records from the CUPTI shim in this agent's ranks; returns the endpoint the shim
        pushes to (ccld/cupti/inject.py puts it in the job's environment). Polled by the loop."""
        return self.sinks.open_cupti()

    def open_ncclprof_sink(self, path: Optional[str] = None) -> str:
        """Receive the NCCL profiler plugin's datagrams from this agent's ranks; returns the socket path
        (ccld/tracer/ncclprof_sink.job_env puts it in the job's environment; `ccld agent
        --nccl-plugin-socket PATH` names one for jobs started elsewhere). Polled by the loop."""
        return self.sinks.open_ncclprof(path)

    def _ident_of(self, pid: int) -> Optional[Tuple[int, str]]:
        """(global rank, job) of a process of this node: known to discovery, or read from /proc now."""
        r = self.ranks.get(pid)
        ident = r.ident if r is not None else discover.identify(pid)
        return None if ident is None else (ident.rank, ident.job)

    def _plugin_took_nccl(self, pid: int, since_ns: int) -> None:
        """The NCCL profiler plugin reports this rank's NCCL from since_ns on: its uprobes' records stop."""
        for fam, tr in self.families:
            if getattr(fam, "NAME", "") in ("nccl", "pgnccl") and hasattr(tr, "defer_to_plugin"):
                tr.defer_to_plugin(pid, since_ns)

    def _c10d_took_nccl(self, pid: int) -> None:
        """The ProcessGroupNCCL probes are on this rank: its collectives come from them, numbered by c10d,
        and the NCCL API probes' collective records of it are dropped (pgnccl.py)."""
        for fam, tr in self.families:
            if getattr(fam, "NAME", "") == "nccl" and hasattr(tr, "leave_collectives"):
                tr.leave_collectives(pid)

    def stop(self) -> None:
        """Detach, flush and close. Safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        for fam, _ in self.families:
            try:
                fam.poll(0)
            except Exception:
                pass
        self.sinks.close()  # before the ranks are forgotten: their pids still map to ranks
        for pid in list(self.ranks):  # a last look: ranks that died since the last scan are exits, not
            # ranks we stopped watching (`ccld run` stops us right after the job ends, and a rank killed
            # there, then its peers stopped by the launcher, may all be gone within one scan)
            dead = not discover.alive(pid)
            self._forget(pid, reason="exited" if dead else "agent stopped", exited=dead)
        for fam, _ in self.families:
            fam.close()
        self.shipper.close()
        if self.timesync is not None:
            self.timesync.close()

    # -- the loop ----------------------------------------------------------------------------
    def _loop(self) -> None:
        # Each pass drains the ring buffers first, then scans /proc: a rank's RankState is put after
        # the records that came before it, so the collector reads the latest one as "this agent's
        # records up to here are in" (Timeline.agent_lag_s) and judges no wait past it.
        next_scan = next_announce = next_nic = 0.0
        poll_ms, last_ns = self.poll_ms, time.monotonic_ns() - self.poll_ms * 1_000_000
        while True:
            self.sinks.poll()  # before the families drain: see sinks.py (one source per NCCL collective)
            now_ns = time.monotonic_ns()
            busiest = 0.0
            for fam, _ in self.families:  # each drains what came (or, kernel families, when their interval is up)
                busiest = max(busiest, fam.ring_share(fam.tick(now_ns)))
            poll_ms, last_ns = poll_after(busiest, (now_ns - last_ns) / 1e6, self.poll_ms), now_ns
            now = time.monotonic()
            if now >= next_scan:
                try:
                    self._scan(now)
                except Exception:  # one bad /proc read must not end tracing
                    log.exception("scan failed")
                stable = now - self._last_change >= STABLE_S
                next_scan = now + (IDLE_SCAN_INTERVAL_MS if stable else SCAN_INTERVAL_MS) / 1000
            if now >= next_announce:
                if next_announce:
                    self._announce()
                next_announce = now + ANNOUNCE_S
            if now >= next_nic:
                next_nic = now + NIC_INTERVAL_S
                try:
                    self._sample_nic()
                except Exception:  # a bug in the counter reader must not end tracing
                    log.exception("NIC counter sample failed")
            if self.shipper.queued:
                self.shipper.kick()  # one wakeup of the sender per pass that made events
            if self._stop.wait(poll_ms / 1000):
                return

    def _candidates(self) -> Set[int]:
        if self.discover_all:
            return set(discover.all_pids())
        roots = ([self.root_pid] if self.root_pid is not None else []) + list(self.pids)
        # The command `ccld run` started is a candidate too (`ccld run -- env RANK=0 ... python train.py`,
        # a wrapper that exports RANK). One whose RANK ccld's own environment holds as well (a pod's)
        # is the rank when it is Python running no known launcher (`python train.py`), else (torchrun
        # given the pod's node rank) it fails identify's parent check as a rank's forked worker does.
        return set(roots) | self._tree.descendants(roots, discover.list_pids())

    def _walk_due(self, now: float) -> bool:
        """Whether this scan walks /proc for candidates (every process of the node: ms a second where
        hundreds run). Once stable, only after a pid was given out or a walk met a new process, or
        WALK_EVERY_S after the last."""
        last = discover.last_pid()
        pid_then, at = self._walked
        if (self._walk_again or last < 0 or last != pid_then or now - at >= WALK_EVERY_S
                or now - self._last_change < STABLE_S):
            self._walked = (last, now)
            return True
        return False

    def _scan(self, now: float) -> None:
        cands = self._candidates() if self._walk_due(now) else set()
        self._walk_again = False
        for pid in cands - set(self.ranks):
            key = (pid, discover._cmdline(pid))
            if key in self._not_ranks:
                continue
            self._walk_again = True  # a process first seen: it may still exec (the walk after catches it)
            ident = discover.identify(pid)
            if ident is None:
                if len(self._not_ranks) >= NEG_CACHE_LIMIT:
                    self._not_ranks.clear()
                self._not_ranks[key] = None
                continue
            self._add(ident)
        # One read of each rank's stat a scan: whether it is alive, its state, its address space's size.
        stats = {pid: procstate.read_stat(pid) for pid in self.ranks}
        dead = [pid for pid, st in stats.items() if st is None or st.state in "ZX"]
        if dead:  # drain first: forgetting a pid drops its records, and a dead rank's last ones matter most
            for fam, _ in self.families:
                fam.poll(0)
        for pid in dead:
            self._forget(pid, reason="exited", exited=True)
        for pid, r in list(self.ranks.items()):
            stat = stats.get(pid)
            self._try_attach(r, -1 if stat is None else stat.vsize)
            if now - r.last_state_at >= PROC_INTERVAL_S:
                st = procstate.read_state(pid, stat)
                if st is not None:
                    r.last_state, r.last_state_at = st, now
                    self.shipper.put(ev.RankState(pid=pid, rank=r.ident.rank, ts_ns=time.monotonic_ns(),
                                                  state=st[0], wchan=st[1], cpu_ns=st[2]))

    def _rank_info(self, r: Rank) -> ev.RankInfo:
        i = r.ident
        return ev.RankInfo(pid=i.pid, rank=i.rank, world_size=i.world_size, local_rank=i.local_rank,
                           node=self.node, job=i.job, ts_ns=time.monotonic_ns(), master_addr=i.master_addr,
                           master_port=i.master_port, cmdline=i.cmdline[:512], libs=dict(r.attached))

    def _add(self, ident: discover.RankIdentity) -> None:
        self._last_change = time.monotonic()
        r = self.ranks[ident.pid] = Rank(ident)
        st = procstate.read_stat(ident.pid)
        r.ppid = st.ppid if st is not None else 0
        for _, tr in self.families:
            tr.add_process(ident.pid, ident.rank, ident.job)
        self.shipper.put(self._rank_info(r))
        self._try_attach(r)

    def _try_attach(self, r: Rank, vsize: Optional[int] = None) -> None:
        """Attach the families not yet on this rank whose library it maps (`vsize`: its address
        space's size when the caller has just read its stat)."""
        pending = [fam for fam, _ in self.families if fam.NAME not in r.attached and fam.NAME not in r.failed]
        if not pending:
            return
        from ccld.bpf.kernel_family import KernelFamily
        from ccld.bpf.loader import read_maps
        maps = None
        if any(not isinstance(f, KernelFamily) for f in pending):
            # One read of the maps for every library family, and only when the address space changed
            # (libraries come with an import or a dlopen) or MAPS_RECHECK_S passed: a torch rank's maps
            # are ~1 ms of reading, and a CPU job never maps libnccl nor libibverbs.
            if vsize is None:
                vsize = procstate.vsize(r.ident.pid)
            now = time.monotonic()
            if vsize != r.maps_vsize or now - r.maps_read_at >= MAPS_RECHECK_S:
                r.maps_vsize, r.maps_read_at = vsize, now
                maps = read_maps(r.ident.pid)
        for fam in pending:
            name = fam.NAME
            if isinstance(fam, KernelFamily):
                lib = fam.find_lib(r.ident.pid)
            else:
                lib = fam.find_lib(r.ident.pid, maps) if maps is not None else None
            if lib is None:
                continue  # not mapped (yet): a rank still importing torch; try again next scan
            ts = time.monotonic_ns()
            try:
                att = fam.attach(r.ident.pid, lib)
            except EnvironmentProblem as e:
                r.failed.add(name)
                self.say(f"ccld: warning: rank {r.ident.rank} (pid {r.ident.pid}): {e}")
                self.shipper.put(ev.ProbeStatus(pid=r.ident.pid, family=name, ok=False, ts_ns=ts,
                                                target=lib, message=str(e)))
                continue
            r.attached[name] = lib
            if name == "pgnccl":
                self._c10d_took_nccl(r.ident.pid)
            self._last_change = time.monotonic()
            self.shipper.put(ev.ProbeStatus(pid=r.ident.pid, family=name, ok=True, ts_ns=ts, target=lib,
                                            attached=len(att.points),
                                            message=("missing: " + ", ".join(att.missing)) if att.missing else ""))
            self.shipper.put(self._rank_info(r))

    def _forget(self, pid: int, reason: str, exited: bool) -> None:
        r = self.ranks.pop(pid, None)
        if r is None:
            return
        self._last_change = time.monotonic()
        how = None
        if exited:  # the kernel's account of the death where a family saw it (sched), before it forgets the pid
            for fam, _ in self.families:
                got = getattr(fam, "exit_info", None)
                how = got(pid) if got is not None else None
                if how is not None:
                    break
        at = how.exit_ns if how is not None else None
        sig = how.signal if how is not None else 0
        for fam, tr in self.families:
            fam.detach(pid)
            tr.forget(pid)
        if exited:
            self.shipper.put(ev.RankExit(pid=pid, rank=r.ident.rank, ts_ns=at or time.monotonic_ns(), reason=reason,
                                         exact=bool(at), signal=sig,
                                         by_launcher=bool(sig) and how.sender == r.ppid and r.ppid > 1))

    def _announce(self) -> None:
        self.shipper.put(ev.AgentHello(agent=self.agent_id, node=self.node, pid=os.getpid(),
                                       version=__version__, sources=self.all_sources,
                                       ts_ns=time.monotonic_ns()))
        for r in list(self.ranks.values()):
            self.shipper.put(self._rank_info(r))
        for e in self.sinks.announce():
            self.shipper.put(e)

    def _sample_nic(self) -> None:
        if not self.nic.present():
            return
        for e in self.nic.sample():
            self.shipper.put(e)
        for msg in self.nic.take_messages():  # each failing file is named once, then only counted
            log.warning("ib counters: %s", msg)

    def _loss(self) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for reason, n in list(self.nic.errors.items()):
            out[f"nic_counter_{reason}"] = n
        out.update(self.sinks.loss())
        for fam, tr in self.families:
            try:
                out[f"{fam.NAME}_ringbuf_lost"] = fam.lost()
            except Exception:
                pass
            for reason, n in list(fam.bad_records.items()):
                out[f"{fam.NAME}_bad_record_{reason}"] = n
            out[f"{fam.NAME}_unmatched"] = getattr(tr, "unmatched", 0)
        return out

    def run_forever(self) -> None:
        """Run until stop() (from a signal handler) is called."""
        while not self._stop.wait(0.5):
            pass
