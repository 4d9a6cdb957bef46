"""Simulated nodes on one machine: several ranks and one `ccld agent` per network namespace, one
`ccld collector` reachable across the bridge, each node's clock shifted and drifting by a known amount.

Built on tests/netbed.py without changing it: a NetBed of nodes + 1 hosts, where hosts 0..nodes-1 are
the nodes and the last host runs the collector. The job is any workload script (gloo_job.py by
default) started once per rank with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, ...;
rendezvous on rank 0's node). Ranks map to nodes by `layout` (layout[r] is rank r's node; default:
ranks_per_node consecutive ranks per node, global rank = node * ranks_per_node + local rank). The collector listens on
the bridge, so it needs CurveZMQ: keys are made in the bed's work directory (`ccld keys`), one pair
per node and one for the collector. Each agent gets CCLD_TEST_CLOCK (ccld/tracer/nodeclock.py):
eBPF timestamps ignore time namespaces, so the agent shifts what it sends. NetBed's faults work on
hosts, so bed.rate_limit_pair(a, b) shapes the link between nodes a and b (all their rank pairs:
a layout with one communicating rank pair across two nodes isolates that rank link).
Ground truth: `truth_unix_ns(node, t)` is the collector's time of node time t (needs the collector's
timebase anchor, which it writes in stats.json).
Cleanup: close() stops agents and collector (SIGINT, so the store is closed cleanly), the job, and
the bed (whose namespaces' removal kills anything left inside).
"""
import json
import os
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

from netbed import GLOO_JOB, MASTER_PORT, NetBed

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ccld.tracer.nodeclock import ENV as TEST_CLOCK_ENV  # noqa: E402
from ccld.tracer.nodeclock import NodeClock  # noqa: E402

CCLD = [sys.executable, "-m", "ccld.cli"]
EVENTS_PORT = 5555       # the collector's host namespace is fresh: fixed ports are free


class MultiNodeBed:
    def __init__(self, nodes: int = 3, ranks_per_node: int = 2, clocks: Sequence[str] = (),
                 keep_logs: bool = False, layout: Optional[Sequence[int]] = None):
        self.nodes, self.per = nodes, ranks_per_node
        self.layout = list(layout) if layout is not None else [r // ranks_per_node for r in range(nodes * ranks_per_node)]
        bad = [n for n in self.layout if not 0 <= n < nodes]
        if bad or not self.layout:
            raise ValueError(f"layout {self.layout}: every rank's node must be one of 0..{nodes - 1}")
        self.world = len(self.layout)
        self.clock_specs = list(clocks) + [""] * (nodes - len(clocks))
        self.clocks = [NodeClock.from_env({TEST_CLOCK_ENV: c}) for c in self.clock_specs]
        self.bed = NetBed(ranks=nodes + 1, keep_logs=keep_logs)
        self.workdir = self.bed.workdir
        self.keys = os.path.join(self.workdir, "keys")
        self.allow = os.path.join(self.workdir, "allow")
        self.job: List[subprocess.Popen] = []
        self.agents: List[subprocess.Popen] = []
        self.collector: Optional[subprocess.Popen] = None
        self.store = os.path.join(self.workdir, "store")
        self.findings = os.path.join(self.workdir, "findings.jsonl")
        self._make_keys()

    # -- layout ------------------------------------------------------------------------------------
    def node_name(self, n: int) -> str:
        return f"node{n}"

    def node_of(self, rank: int) -> int:
        return self.layout[rank]

    def ranks_of(self, node: int) -> List[int]:
        return [r for r, n in enumerate(self.layout) if n == node]

    @property
    def collector_host(self) -> int:
        return self.nodes

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.bed.ip(self.collector_host)}:{EVENTS_PORT}"

    def _make_keys(self) -> None:
        def keys(d, name):
            subprocess.run(CCLD + ["keys", d, name], check=True, capture_output=True, timeout=60)
        keys(self.keys, "collector")
        os.makedirs(self.allow, mode=0o700, exist_ok=True)
        for n in range(self.nodes):
            keys(self.keys, self.node_name(n))
            os.link(os.path.join(self.keys, f"{self.node_name(n)}.key"),
                    os.path.join(self.allow, f"{self.node_name(n)}.key"))

    # -- processes -----------------------------------------------------------------------------------
    def _spawn(self, host: int, argv: List[str], log: str, env: Optional[Dict[str, str]] = None):
        env_args = [f"{k}={v}" for k, v in (env or {}).items()]
        full = ["ip", "netns", "exec", self.bed.ns(host), "env", *env_args, *argv]
        with open(os.path.join(self.workdir, log), "wb") as out:
            return subprocess.Popen(full, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, cwd=os.path.dirname(GLOO_JOB))

    def start_collector(self, extra: Sequence[str] = ()) -> subprocess.Popen:
        self.collector = self._spawn(self.collector_host, CCLD + [
            "collector", "--listen", self.endpoint, "--store", self.store, "--findings", self.findings,
            "--curve-key", os.path.join(self.keys, "collector.key_secret"), "--allow-keys", self.allow,
            *extra], "collector.log", {"PYTHONUNBUFFERED": "1"})
        return self.collector

    def start_job(self, script_args: Sequence = (), script: str = GLOO_JOB,
                  env: Optional[Dict[str, str]] = None) -> List[subprocess.Popen]:
        """One process of `script` per rank on its node, with torchrun's environment (and `env`)."""
        for r in range(self.world):
            n = self.node_of(r)
            local = self.ranks_of(n)
            full = {"RANK": str(r), "LOCAL_RANK": str(local.index(r)), "LOCAL_WORLD_SIZE": str(len(local)),
                    "WORLD_SIZE": str(self.world), "MASTER_ADDR": self.bed.ip(self.node_of(0)),
                    "MASTER_PORT": str(MASTER_PORT), "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1",
                    "PYTHONUNBUFFERED": "1", **(env or {})}
            self.job.append(self._spawn(n, [sys.executable, script, *[str(a) for a in script_args]],
                                        f"rank{r}.log", full))
        return self.job

    def rank_pids(self, node: Optional[int] = None) -> List[int]:
        """Each rank's pid (`ip netns exec` and `env` exec in place), of one node or all."""
        return [p.pid for r, p in enumerate(self.job) if node is None or self.node_of(r) == node]

    def start_agents(self, probes: str = "gloo", extra: Sequence[str] = ()) -> List[subprocess.Popen]:
        for n in range(self.nodes):
            argv = CCLD + ["agent", "--collector", self.endpoint, "--node", self.node_name(n), "--probes", probes,
                           "--curve-key", os.path.join(self.keys, f"{self.node_name(n)}.key_secret"),
                           "--collector-key", os.path.join(self.keys, "collector.key"), *extra]
            for p in self.rank_pids(n):
                argv += ["--pid", str(p)]
            env = {"PYTHONUNBUFFERED": "1"}
            if self.clock_specs[n]:
                env[TEST_CLOCK_ENV] = self.clock_specs[n]
            self.agents.append(self._spawn(n, argv, f"agent{n}.log", env))
        return self.agents

    def log(self, name: str) -> str:
        try:
            with open(os.path.join(self.workdir, name), errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def logs(self, tail: int = 1500) -> str:
        names = ["collector.log"] + [f"agent{n}.log" for n in range(self.nodes)] + \
                [f"rank{r}.log" for r in range(self.world)]
        return "\n".join(f"--- {n} ---\n{self.log(n)[-tail:]}" for n in names)

    def steps(self) -> List[int]:
        """The latest "rank R step N" each rank printed (--progress-every)."""
        out = []
        for r in range(self.world):
            lines = [ln for ln in self.log(f"rank{r}.log").splitlines() if ln.startswith(f"rank {r} step ")]
            out.append(int(lines[-1].split()[3]) if lines else 0)
        return out

    def stats(self) -> dict:
        try:
            with open(os.path.join(self.store, "stats.json")) as f:
                return json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def findings_list(self) -> List[dict]:
        try:
            with open(self.findings) as f:
                return [json.loads(x) for x in f if x.strip()]
        except FileNotFoundError:
            return []

    # -- ground truth ------------------------------------------------------------------------------
    def node_of_agent(self, agent: str) -> int:
        """Agents are named NODE:PID:HEX."""
        return int(agent.split(":", 1)[0][len("node"):])

    def truth_unix_ns(self, node: int, t_ns: int, anchor_ns: int) -> float:
        """The collector's time (Unix ns) of time t_ns on `node`'s shifted clock."""
        return self.clocks[node].invert(t_ns) + anchor_ns

    # -- lifetime ----------------------------------------------------------------------------------
    def stop_tracing(self, timeout: float = 40.0) -> None:
        """SIGINT the agents, then the collector (it flushes the store and stats.json)."""
        for p in self.agents:
            _interrupt(p)
        for p in self.agents:
            _reap(p, timeout)
        if self.collector is not None:
            time.sleep(0.5)
            _interrupt(self.collector)
            _reap(self.collector, timeout)

    def stop_job(self) -> None:
        for p in self.job:
            if p.poll() is None:
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.killpg(p.pid, sig)
                    except ProcessLookupError:
                        pass
        for p in self.job:
            p.wait()

    def close(self) -> None:
        try:
            self.stop_job()
            self.stop_tracing(timeout=20.0)
        finally:
            self.bed.close()

    def __enter__(self) -> "MultiNodeBed":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _interrupt(p: subprocess.Popen) -> None:
    if p.poll() is None:
        try:
            p.send_signal(signal.SIGINT)  # `ip netns exec` and `env` exec in place: this is ccld
        except ProcessLookupError:
            pass


def _reap(p: subprocess.Popen, timeout: float) -> None:
    try:
        p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
