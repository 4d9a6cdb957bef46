"""A network fault-injection test bed: N "hosts", one network namespace per rank, on one bridge.

Layout of a bed whose prefix is P = "ccldt<creator pid>-<6 hex>" (unique per instance):
  P-sw    br0 and the bridge ends v0..v{N-1} of the veth pairs (the "switch")
  P-r<i>  eth0 = 10.213.S.(i+1)/24 (S random per bed) and lo, both up; IPv6 off, so gloo uses IPv4
Nothing is added to the root namespace's interfaces; each bed is its own L2 domain, so two beds
with the same subnet cannot collide. A job runs one rank per rank namespace, as root-PID-namespace
processes, so a tracer in the root namespace sees them by pid (and tracepoints are global).

Faults, all undone by clear_faults() (no netem or prio qdisc on this kernel, so there is no fixed
delay: rate limits give queueing delay, iptables gives loss and blackholes). "Packets" means every
IPv4 packet, gloo data and ACKs and TCPStore traffic alike; a rank's own loopback is never touched:
  rate_limit_rank  tbf on all of ONE rank's links: "out" = its eth0 (what it sends to every peer),
                   "in" = its bridge port (what every peer sends to it), "both"
  rate_limit_pair  htb + u32 dst filter on eth0 of a (to b) and of b (to a), or a only (one_way):
                   just the a<->b link; a's and b's traffic to other ranks stays unshaped
  loss             TCP packets from src dropped at random on dst's INPUT: src's data to dst and
                   src's ACKs of dst's data; src retransmits as on a lossy wire (an OUTPUT drop is
                   reported back to TCP, which re-queues without a real retransmit)
  blackhole        every packet between a and b, both ways (INPUT of both); ARP still passes
Cleanup: every namespace made is removed on close(), on an exception in the `with`, at exit (atexit)
and on SIGTERM; a new bed first removes namespaces of beds whose creator pid is dead. Caveat: a
creator in another PID namespace sharing /run/netns would look dead; beds are for one test machine.
Needs root, iproute2 (ip, tc, ss) and iptables (the nf_tables backend is fine).
"""
import atexit
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLOO_JOB = os.path.join(ROOT, "ccld", "workloads", "gloo_job.py")
PREFIX = "ccldt"
NETNS_DIR = "/run/netns"
MASTER_PORT = 29500          # rank 0's namespace is fresh, so the usual torchrun port is always free
_STALE = re.compile(rf"^{PREFIX}(\d+)-[0-9a-f]+-(sw|r\d+)$")
_PROGRESS = re.compile(r"^rank (\d+) step (\d+) t ([0-9.]+)$", re.M)
_ADDR = re.compile(r"^\[?([0-9a-fA-F.:%\w]+?)\]?:(\d+)$")
_PID = re.compile(r"pid=(\d+)")
_RETRANS = re.compile(r"\bretrans:\d+/(\d+)")


class NetBedError(RuntimeError):
    pass


class Conn(NamedTuple):
    """One established TCP connection as `ss` sees it from inside a rank's namespace (an
    IPv4-mapped address, ::ffff:a.b.c.d, is given as a.b.c.d)."""
    saddr: str
    sport: int
    daddr: str
    dport: int
    pid: Optional[int]   # None when no process holds the socket (e.g. mid-close)
    netns: str


def skip_reason() -> Optional[str]:
    """None when this process can build a bed, else why not."""
    if os.geteuid() != 0:
        return "the network test bed needs root (network namespaces, tc, iptables)"
    for tool in ("ip", "tc", "ss", "iptables"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (scripts/setup.sh installs iproute2 and iptables)"
    import importlib.util
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed (pip install torch==2.13.0)"
    return None


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(list(argv), capture_output=True, text=True)
    if check and p.returncode != 0:
        raise NetBedError(f"{' '.join(argv)} failed (rc={p.returncode}): {p.stderr.strip()}")
    return p


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_netns(name: str) -> None:
    """Kill what runs inside (a netns outlives its `ip netns del` while a process holds it), delete."""
    pids = _run(["ip", "netns", "pids", name], check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _run(["ip", "netns", "del", name], check=False)


def remove_stale() -> List[str]:
    """Remove namespaces left by beds whose creator died (crash, SIGKILL); returns their names."""
    try:
        names = os.listdir(NETNS_DIR)
    except FileNotFoundError:
        return []
    gone = []
    for name in sorted(names):
        m = _STALE.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _remove_netns(name)
            gone.append(name)
    return gone


# Every open bed, so atexit and SIGTERM can tear them down. SIGTERM's default action skips atexit,
# hence the handler (installed only where nobody else handles SIGTERM).
_LIVE: "set[NetBed]" = set()
_LIVE_LOCK = threading.RLock()   # re-entrant: the SIGTERM handler may run while it is held
_HOOKED = False


def _close_all() -> None:
    with _LIVE_LOCK:
        beds = list(_LIVE)
    for bed in beds:
        if bed.owner_pid == os.getpid():   # a forked child inherits _LIVE but owns none of them
            bed.close()


def _on_sigterm(signum, frame) -> None:
    _close_all()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _hook_exit() -> None:
    global _HOOKED
    if _HOOKED:
        return
    _HOOKED = True
    atexit.register(_close_all)
    if threading.current_thread() is threading.main_thread() \
            and signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, _on_sigterm)


class NetBed:
    """N rank namespaces on one bridge; runs a gloo job across them and injects faults on links."""

    def __init__(self, ranks: int = 4, python: str = sys.executable, keep_logs: bool = False):
        if not 1 <= ranks <= 200:
            raise ValueError(f"ranks must be 1..200, got {ranks}")
        self.ranks = ranks
        self.python = python
        self.owner_pid = os.getpid()
        self.prefix = f"{PREFIX}{self.owner_pid}-{secrets.token_hex(3)}"
        self.subnet = f"10.213.{secrets.randbelow(254) + 1}"
        self.switch = f"{self.prefix}-sw"
        self.workdir = tempfile.mkdtemp(prefix=self.prefix + "-")
        self.procs: List[subprocess.Popen] = []
        self._keep_logs = keep_logs
        self._made: List[str] = []            # namespaces created, in order
        self._undo: List[Tuple[str, List[str]]] = []   # (namespace, argv) undoing each fault step
        self._qdisc: Dict[Tuple[str, str], str] = {}    # (namespace, dev) -> root qdisc kind we added
        self._htb_classes: Dict[Tuple[str, str], int] = {}
        self._closed = False
        self.iptables = shutil.which("iptables") or "iptables"
        _hook_exit()
        remove_stale()
        with _LIVE_LOCK:
            _LIVE.add(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # -- layout --------------------------------------------------------------------------------
    def ns(self, rank: int) -> str:
        """The namespace of a rank."""
        self._check_rank(rank)
        return f"{self.prefix}-r{rank}"

    def ip(self, rank: int) -> str:
        """The IPv4 address of a rank's eth0."""
        self._check_rank(rank)
        return f"{self.subnet}.{rank + 1}"

    def rank_of_ip(self, addr: str) -> Optional[int]:
        """The rank that owns an address, or None."""
        head, _, last = _plain(addr).rpartition(".")
        if head != self.subnet or not last.isdigit() or not 1 <= int(last) <= self.ranks:
            return None
        return int(last) - 1

    def namespaces(self) -> List[str]:
        """Every namespace this bed made and has not removed yet."""
        return list(self._made)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.ranks:
            raise ValueError(f"rank {rank} is not in this bed (0..{self.ranks - 1})")

    def _build(self) -> None:
        self._add_netns(self.switch)
        _run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
        for r in range(self.ranks):
            ns = self.ns(r)
            self._add_netns(ns)
            # Both ends are made in the switch namespace and one moves out: none touches the root one.
            _run(["ip", "-n", self.switch, "link", "add", f"v{r}", "type", "veth",
                  "peer", "name", "eth0", "netns", ns])
            _run(["ip", "-n", self.switch, "link", "set", f"v{r}", "master", "br0", "up"])
            # IPv4 only: gloo picks eth0's first address, and the iptables faults match IPv4 sources.
            _run(["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
                  "net.ipv6.conf.default.disable_ipv6=1"], check=False)
            _run(["ip", "-n", ns, "addr", "add", f"{self.ip(r)}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _add_netns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._made.append(name)

    def exec(self, where, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        """Run a command in a rank's namespace (int) or a named one (e.g. bed.switch)."""
        ns = self.ns(where) if isinstance(where, int) else where
        return _run(["ip", "netns", "exec", ns, *argv], check=check)

    # -- lifetime ------------------------------------------------------------------------------
    def __enter__(self) -> "NetBed":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the job, remove every namespace made (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.stop_job()
        finally:
            for name in reversed(self._made):   # ranks first, then the switch with the bridge ends
                _remove_netns(name)
            self._made.clear()
            with _LIVE_LOCK:
                _LIVE.discard(self)
            if not self._keep_logs:
                shutil.rmtree(self.workdir, ignore_errors=True)

    # -- the job -------------------------------------------------------------------------------
    def start_job(self, script_args: Sequence = (), env_extra: Optional[Dict[str, str]] = None,
                  port: int = MASTER_PORT, script: str = GLOO_JOB) -> List[subprocess.Popen]:
        """Start one rank of `script` (gloo_job.py by default) in each rank namespace."""
        if self.procs:
            raise NetBedError("a job is already running in this bed; stop_job() first")
        for r in range(self.ranks):
            env = {"RANK": str(r), "LOCAL_RANK": "0", "WORLD_SIZE": str(self.ranks),
                   "MASTER_ADDR": self.ip(0), "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "eth0",
                   "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env_extra or {})}
            argv = ["ip", "netns", "exec", self.ns(r), "env", *[f"{k}={v}" for k, v in env.items()],
                    self.python, script, *[str(a) for a in script_args]]
            with open(self.log_path(r), "wb") as log:
                # `ip netns exec` and `env` exec in place, so Popen.pid is the rank's python pid.
                self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                                   stdin=subprocess.DEVNULL, start_new_session=True))
        return list(self.procs)

    def rank_pids(self) -> List[int]:
        """The pid of each rank's process, by rank."""
        return [p.pid for p in self.procs]

    def wait_job(self, timeout: float) -> List[int]:
        """Wait for every rank to exit; their return codes by rank. TimeoutError names the laggards."""
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                left = [i for i, q in enumerate(self.procs) if q.poll() is None]
                raise TimeoutError(f"ranks {left} still running after {timeout:.0f} s") from None
        return [p.returncode for p in self.procs]

    def stop_job(self) -> None:
        """Kill every rank (SIGCONT first, so a stopped one dies too) and reap them."""
        for p in self.procs:
            if p.poll() is not None:
                continue            # reaped: its pid, and so its group id, may belong to another now
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.killpg(p.pid, sig)   # its own session: any child it made goes too
                except ProcessLookupError:
                    pass
        for p in self.procs:
            p.wait()
        self.procs = []

    def log_path(self, rank: int) -> str:
        """The file a rank's stdout and stderr go to."""
        self._check_rank(rank)
        return os.path.join(self.workdir, f"rank{rank}.log")

    def log(self, rank: int) -> str:
        """A rank's output so far."""
        try:
            with open(self.log_path(rank), errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def logs(self) -> str:
        """Every rank's output, headed by rank (for assertion messages)."""
        return "\n".join(f"--- rank {r} ---\n{self.log(r)[-3000:]}" for r in range(self.ranks))

    def progress(self, rank: int) -> List[Tuple[int, float]]:
        """(step, unix time) of each "rank R step N t T" line the rank printed (--progress-every)."""
        return [(int(m.group(2)), float(m.group(3))) for m in _PROGRESS.finditer(self.log(rank))
                if int(m.group(1)) == rank]

    def latest_steps(self) -> List[int]:
        """The latest step each rank reported, by rank (0 before the first report)."""
        return [max((s for s, _ in self.progress(r)), default=0) for r in range(self.ranks)]

    # -- ground truth --------------------------------------------------------------------------
    def connections(self) -> List[Conn]:
        """Established TCP connections in every rank namespace, from `ss -tnpH`."""
        out = []
        for r in range(self.ranks):
            text = self.exec(r, "ss", "-tnpH", "state", "established").stdout
            out.extend(_parse_ss(text, self.ns(r)))
        return out

    def retrans_segs(self, rank: int) -> int:
        """Tcp RetransSegs of a rank's namespace (/proc/net/snmp is per namespace)."""
        lines = [ln.split() for ln in self.exec(rank, "cat", "/proc/net/snmp").stdout.splitlines()
                 if ln.startswith("Tcp:")]
        if len(lines) < 2 or "RetransSegs" not in lines[0]:
            raise NetBedError(f"no Tcp RetransSegs in /proc/net/snmp of {self.ns(rank)}")
        return int(lines[1][lines[0].index("RetransSegs")])

    def pair_retrans(self, src: int, dst: int) -> int:
        """Segments src retransmitted on its connections to dst (sum of `ss -ti` retrans totals)."""
        text = self.exec(src, "ss", "-tinH", "dst", self.ip(dst)).stdout
        return sum(int(n) for n in _RETRANS.findall(text))

    # -- faults --------------------------------------------------------------------------------
    def rate_limit_rank(self, rank: int, rate: str, direction: str = "both", burst: str = "64kb",
                        latency: str = "100ms") -> None:
        """tbf on all of one rank's links: "out" = eth0 (what it sends to every peer), "in" = its
        bridge port (what every peer sends to it), "both". Packets over the queue are dropped."""
        if direction not in ("out", "in", "both"):
            raise ValueError(f"direction must be out, in or both, got {direction!r}")
        tbf = ["tbf", "rate", rate, "burst", burst, "latency", latency]
        if direction in ("out", "both"):
            self._root_qdisc(self.ns(rank), "eth0", tbf)
        if direction in ("in", "both"):
            self._root_qdisc(self.switch, f"v{rank}", tbf)

    def rate_limit_pair(self, a: int, b: int, rate: str, one_way: bool = False,
                        burst: Optional[str] = None) -> None:
        """htb on a's eth0 with a u32 filter on b's address (and b's to a unless one_way): only the
        a<->b link is shaped; traffic to other ranks leaves unclassified, hence unshaped."""
        pairs = [(a, b)] if one_way else [(a, b), (b, a)]
        for src, dst in pairs:
            ns, dev = self.ns(src), "eth0"
            if self._qdisc.get((ns, dev)) != "htb":
                self._root_qdisc(ns, dev, ["handle", "1:", "htb"])  # no default class: direct
            cls = self._htb_classes.get((ns, dev), 0) + 1
            self._htb_classes[(ns, dev)] = cls
            extra = ["burst", burst] if burst else []
            self.exec(ns, "tc", "class", "add", "dev", dev, "parent", "1:", "classid", f"1:{cls}",
                      "htb", "rate", rate, "ceil", rate, *extra)
            self.exec(ns, "tc", "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip",
                      "prio", "1", "u32", "match", "ip", "dst", f"{self.ip(dst)}/32",
                      "flowid", f"1:{cls}")

    def loss(self, src: int, dst: int, probability: float) -> None:
        """Drop TCP packets from src at random on dst's INPUT: src's data to dst, and src's ACKs of
        dst's data. src sees the loss and retransmits, as on a lossy wire."""
        if not 0.0 < probability <= 1.0:
            raise ValueError(f"probability must be in (0, 1], got {probability}")
        self._iptables(self.ns(dst), ["INPUT", "-s", self.ip(src), "-p", "tcp", "-m", "statistic",
                                      "--mode", "random", "--probability", f"{probability:g}",
                                      "-j", "DROP"])

    def blackhole(self, a: int, b: int) -> None:
        """Drop every IPv4 packet between a and b, both directions (INPUT of both)."""
        self._iptables(self.ns(b), ["INPUT", "-s", self.ip(a), "-j", "DROP"])
        self._iptables(self.ns(a), ["INPUT", "-s", self.ip(b), "-j", "DROP"])

    def clear_faults(self) -> None:
        """Undo every fault, newest first."""
        errors = []
        while self._undo:
            ns, argv = self._undo.pop()
            p = self.exec(ns, *argv, check=False)
            if p.returncode != 0:
                errors.append(f"{ns}: {' '.join(argv)}: {p.stderr.strip()}")
        self._qdisc.clear()
        self._htb_classes.clear()
        if errors:
            raise NetBedError("could not undo: " + "; ".join(errors))

    def _root_qdisc(self, ns: str, dev: str, spec: List[str]) -> None:
        if (ns, dev) in self._qdisc:
            raise NetBedError(f"{dev} in {ns} already has a {self._qdisc[(ns, dev)]} fault (one root "
                              "qdisc per device; clear_faults() first)")
        self.exec(ns, "tc", "qdisc", "add", "dev", dev, "root", *spec)
        self._qdisc[(ns, dev)] = "htb" if "htb" in spec else spec[0]
        self._undo.append((ns, ["tc", "qdisc", "del", "dev", dev, "root"]))

    def _iptables(self, ns: str, rule: List[str]) -> None:
        self.exec(ns, self.iptables, "-w", "-A", *rule)      # -w: the xtables lock is host-wide
        self._undo.append((ns, [self.iptables, "-w", "-D", *rule]))


def _parse_ss(text: str, netns: str) -> List[Conn]:
    """Rows of `ss -tnpH state established`: Recv-Q Send-Q Local:Port Peer:Port [users:(...)].
    A socket shared by several processes is listed under the first one."""
    out = []
    for line in text.splitlines():
        addrs = [m for m in (_ADDR.match(tok) for tok in line.split()) if m]
        if len(addrs) < 2:
            continue
        pid = _PID.search(line)
        (sa, sp), (da, dp) = [(_plain(m.group(1)), int(m.group(2))) for m in addrs[:2]]
        out.append(Conn(sa, sp, da, dp, int(pid.group(1)) if pid else None, netns))
    return out


def _plain(addr: str) -> str:
    """10.1.2.3 for ::ffff:10.1.2.3 (a dual-stack socket, as c10d's TCPStore uses), no %scope."""
    addr = addr.split("%")[0]
    return addr[len("::ffff:"):] if addr.startswith("::ffff:") and "." in addr else addr


@pytest.fixture
def netbed(request):
    """A 4-rank NetBed, closed after the test (ranks: parametrize indirectly with an int)."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    with NetBed(getattr(request, "param", 4)) as bed:
        yield bed
