"""What one probe hit costs, per probe kind, measured in tight loops on this machine (as root).

Two views of each cost, both in one run:
  end to end   ns per call of a loop that hits the probe, with the probe loaded minus without it,
               medians over alternating rounds (includes the trap into the kernel for uprobes);
  in kernel    the BPF program's own run time per hit (kernel.bpf_stats_enabled, restored after).
Kinds: an entry uprobe that does nothing, one that writes a ring-buffer record (ccld's gloo/nccl
shape), one that adds into a hash map (the aggregation shape), both on libc's labs() called through
ctypes for this pid only (bench/probe_cost.bpf.c); the real gloo family on a world-size-1 gloo
all-reduce loop (per collective); the real net family on TCP sends over loopback (per send); the real
sched family on a pipe ping-pong (per round trip, two context switches each side); and the agent's
drain of the net family's map per connection.

    .venv/bin/python bench/probe_cost.py [--rounds 5] [--write-results]
"""
from __future__ import annotations

import argparse
import ctypes as ct
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Callable, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from results import write_section  # noqa: E402

BPF_STATS = "/proc/sys/kernel/bpf_stats_enabled"
LIBC = ct.CDLL("libc.so.6")
LIBC.labs.argtypes, LIBC.labs.restype = [ct.c_long], ct.c_long
CALLS = 20_000  # per timed batch; with ~200 ns a call a batch takes a few ms


def prog_stats(bpf) -> Dict[str, tuple]:
    """BPF function name -> (run_time_ns, run_cnt) of a loaded bcc object's programs."""
    out = {}
    for name, fn in bpf.funcs.items():
        try:
            with open(f"/proc/self/fdinfo/{fn.fd}") as f:
                text = f.read()
        except OSError:
            continue
        t = re.search(r"^run_time_ns:\s+(\d+)", text, re.M)
        c = re.search(r"^run_cnt:\s+(\d+)", text, re.M)
        if t and c:
            out[name.decode() if isinstance(name, bytes) else name] = (int(t.group(1)), int(c.group(1)))
    return out


def per_hit(before: Dict[str, tuple], after: Dict[str, tuple]) -> Dict[str, float]:
    out = {}
    for k, (t1, c1) in after.items():
        t0, c0 = before.get(k, (0, 0))
        if c1 > c0:
            out[k] = (t1 - t0) / (c1 - c0)
    return out


def time_batch(fn: Callable[[], None], n: int) -> float:
    t0 = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - t0) / n


def labs_loop() -> None:
    f = LIBC.labs
    for _ in range(CALLS):
        f(1)


def bench_uprobes(rounds: int) -> Dict[str, Dict[str, float]]:
    from bcc import BPF
    from ccld.bpf.kheaders import ensure_kernel_headers
    ensure_kernel_headers()
    b = BPF(src_file=os.path.join(ROOT, "bench", "probe_cost.bpf.c").encode())
    b[b"traced"][ct.c_uint32(os.getpid())] = ct.c_uint8(1)
    b[b"events"].open_ring_buffer(lambda *_: 0)
    libc_path = "c"  # bcc resolves a bare library name the way the dynamic linker does
    times: Dict[str, List[float]] = {"none": [], "up_empty": [], "up_record": [], "up_map": []}
    kernel: Dict[str, List[float]] = {k: [] for k in times if k != "none"}
    for _ in range(rounds):
        for kind in times:
            if kind != "none":
                b.attach_uprobe(name=libc_path.encode(), sym=b"labs", fn_name=kind.encode(), pid=os.getpid())
            labs_loop()  # warm up
            s0 = prog_stats(b)
            samples = []
            for _ in range(5):
                samples.append(time_batch(labs_loop, CALLS))
                b.ring_buffer_consume()
            times[kind].append(statistics.median(samples))
            if kind != "none":
                got = per_hit(s0, prog_stats(b)).get(kind)
                if got is not None:
                    kernel[kind].append(got)
                b.detach_uprobe(name=libc_path.encode(), sym=b"labs", pid=os.getpid())
    b.cleanup()
    base = statistics.median(times["none"])
    return {k: {"e2e_ns": statistics.median(v) - base, "kernel_ns": statistics.median(kernel[k]) if kernel[k] else None}
            for k, v in times.items() if k != "none"}


GLOO_CHILD = r"""
import os, sys, time, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
t = torch.ones(1)
print("ready", flush=True)
for line in sys.stdin:
    n = int(line)
    t0 = time.perf_counter_ns()
    for _ in range(n):
        dist.all_reduce(t)
    print((time.perf_counter_ns() - t0) / n, flush=True)
"""


def bench_gloo(rounds: int, n: int = 3000) -> Dict[str, float]:
    """ns per all_reduce (world size 1, gloo) with the gloo family attached and tracing, minus without."""
    from ccld.bpf.gloo import GlooFamily
    from ccld.bpf.gloo_translator import GlooTranslator
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from conftest import free_port
    child = subprocess.Popen([sys.executable, "-c", GLOO_CHILD, str(free_port())], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert child.stdout.readline().strip() == "ready"

    def run() -> float:
        child.stdin.write(f"{n}\n")
        child.stdin.flush()
        return float(child.stdout.readline())

    off, on, kernel = [], [], []
    try:
        run()
        for _ in range(rounds):
            off.append(statistics.median(run() for _ in range(3)))
            fam = GlooFamily(GlooTranslator(lambda e: None))
            fam.load()
            fam.attach(child.pid, fam.find_lib(child.pid))
            run()
            s0 = prog_stats(fam.bpf)
            on.append(statistics.median(run() for _ in range(3)))
            hits = per_hit(s0, prog_stats(fam.bpf))
            kernel.append(sum(hits.values()))  # every program one collective runs, once each
            fam.poll(0)
            fam.close()
    finally:
        child.kill()
    return {"e2e_ns": statistics.median(on) - statistics.median(off), "kernel_ns": statistics.median(kernel),
            "base_ns": statistics.median(off)}


def bench_net(rounds: int, n: int = 20000) -> Dict[str, float]:
    """ns per 64-byte TCP send over loopback with the net family loaded and this process traced."""
    from ccld.bpf.net import NetFamily, NetTranslator
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    cli = socket.create_connection(srv.getsockname())
    peer, _ = srv.accept()
    stop = threading.Event()

    def drain() -> None:
        peer.settimeout(0.2)
        while not stop.is_set():
            try:
                peer.recv(1 << 20)
            except socket.timeout:
                pass

    th = threading.Thread(target=drain, daemon=True)
    th.start()
    msg = b"x" * 64

    def loop() -> None:
        for _ in range(n):
            cli.send(msg)

    off, on, kernel = [], [], []
    try:
        for _ in range(rounds):
            off.append(statistics.median(time_batch(loop, n) for _ in range(3)))
            fam = NetFamily(NetTranslator(lambda e: None))
            fam.load()
            fam.attach(os.getpid(), fam.find_lib(os.getpid()))
            loop()
            s0 = prog_stats(fam.bpf)
            on.append(statistics.median(time_batch(loop, n) for _ in range(3)))
            hits = per_hit(s0, prog_stats(fam.bpf))
            kernel.append(hits.get("tracepoint__sock__sock_send_length", float("nan")))
            fam.close()
    finally:
        stop.set()
        th.join()
        for s in (cli, peer, srv):
            s.close()
    return {"e2e_ns": statistics.median(on) - statistics.median(off), "kernel_ns": statistics.median(kernel),
            "base_ns": statistics.median(off)}


PONG = "import os,sys\nr,w=int(sys.argv[1]),int(sys.argv[2])\nwhile True:\n b=os.read(r,1)\n if not b: break\n os.write(w,b)\n"


def bench_sched(rounds: int, n: int = 5000) -> Dict[str, float]:
    """ns per pipe round trip with a child (two context switches each side) with the sched family on."""
    from ccld.bpf.sched import SchedFamily, SchedTranslator
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    child = subprocess.Popen([sys.executable, "-c", PONG, str(r1), str(w2)], pass_fds=(r1, w2))

    def loop() -> None:
        for _ in range(n):
            os.write(w1, b"x")
            os.read(r2, 1)

    off, on, kernel = [], [], []
    try:
        loop()
        for _ in range(rounds):
            off.append(statistics.median(time_batch(loop, n) for _ in range(3)))
            fam = SchedFamily(SchedTranslator(lambda e: None))
            fam.load()
            for pid in (os.getpid(), child.pid):
                fam.attach(pid, fam.find_lib(pid))
            s0 = prog_stats(fam.bpf)
            on.append(statistics.median(time_batch(loop, n) for _ in range(3)))
            hits = per_hit(s0, prog_stats(fam.bpf))
            kernel.append(hits.get("tracepoint__sched__sched_switch", float("nan")))
            fam.close()
    finally:
        os.close(w1)
        child.wait(10)
    return {"e2e_ns": statistics.median(on) - statistics.median(off), "kernel_ns": statistics.median(kernel),
            "base_ns": statistics.median(off)}


def bench_drain(sizes=(1000, 10000)) -> Dict[int, tuple]:
    """µs per connection of one drain of the net family's map: the first (every entry new: decoded and
    shipped as a LinkStats) and the next (nothing moved: read and compared only)."""
    from ccld.bpf.net import Conn, NetFamily, NetTranslator
    out = {}
    for n in sizes:
        shipped: list = []
        tr = NetTranslator(shipped.append)
        fam = NetFamily(tr)
        fam.load()
        pid = os.getpid()
        fam.attach(pid, fam.find_lib(pid))
        tr.add_process(pid, 0, "bench")
        conns = fam.bpf[b"conns"]
        for i in range(n):
            c = Conn(tgid=pid, family=2, sport=10000 + i % 50000, dport=80, state=1, tx_bytes=i)
            c.saddr[0], c.daddr[0] = 127, 10
            conns[ct.c_uint64(0x1000 + i)] = c
        t0 = time.perf_counter()
        fam.drain()
        t1 = time.perf_counter()
        fam.drain()
        t2 = time.perf_counter()
        assert len(shipped) == n, f"drain shipped {len(shipped)} of {n}"
        out[n] = ((t1 - t0) / n * 1e6, (t2 - t1) / n * 1e6)
        fam.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--write-results", action="store_true")
    a = ap.parse_args()
    with open(BPF_STATS) as f:
        stats_before = f.read().strip()
    with open(BPF_STATS, "w") as f:
        f.write("1")
    try:
        res = {"uprobes": bench_uprobes(a.rounds)}
        print("uprobes", res["uprobes"], file=sys.stderr)
        res["gloo"] = bench_gloo(a.rounds)
        print("gloo", res["gloo"], file=sys.stderr)
        res["net"] = bench_net(a.rounds)
        print("net", res["net"], file=sys.stderr)
        res["sched"] = bench_sched(a.rounds)
        print("sched", res["sched"], file=sys.stderr)
        res["drain"] = bench_drain()
        print("drain", res["drain"], file=sys.stderr)
    finally:
        with open(BPF_STATS, "w") as f:
            f.write(stats_before)
    if a.write_results:
        write_results(res, "python bench/probe_cost.py" + (f" --rounds {a.rounds}" if a.rounds != 5 else "")
                      + " --write-results")


def _ns(x) -> str:
    return "n/a" if x is None or x != x else f"{x:,.0f} ns"


def write_results(r: dict, cmd: str) -> None:
    u = r["uprobes"]
    rows = [
        f"| entry uprobe, empty program | labs() call | {_ns(u['up_empty']['e2e_ns'])} | {_ns(u['up_empty']['kernel_ns'])} |",
        f"| entry uprobe, filter + ring-buffer record (gloo/nccl shape) | labs() call | {_ns(u['up_record']['e2e_ns'])} | {_ns(u['up_record']['kernel_ns'])} |",
        f"| entry uprobe, filter + hash add (aggregation shape) | labs() call | {_ns(u['up_map']['e2e_ns'])} | {_ns(u['up_map']['kernel_ns'])} |",
        f"| gloo family, all its probes | gloo all_reduce, world 1 ({r['gloo']['base_ns'] / 1e3:.1f} us) | {_ns(r['gloo']['e2e_ns'])} | {_ns(r['gloo']['kernel_ns'])} |",
        f"| net family: sock_send_length | 64 B TCP send, loopback ({r['net']['base_ns'] / 1e3:.1f} us) | {_ns(r['net']['e2e_ns'])} | {_ns(r['net']['kernel_ns'])} |",
        f"| sched family: sched_switch | pipe round trip ({r['sched']['base_ns'] / 1e3:.1f} us) | {_ns(r['sched']['e2e_ns'])} | {_ns(r['sched']['kernel_ns'])} per switch |",
    ]
    drain = "; ".join(f"{n:,} connections: {a:.1f} us each when all changed, {b:.1f} us when none did"
                      for n, (a, b) in r["drain"].items())
    body = f"""### Probe cost per hit

`{cmd}` as root on {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')}. End to end = ns per call of a tight
loop with the probe loaded minus without it (medians over alternating rounds; noisy below ~50 ns, and
can come out negative); in kernel = the BPF program's own run time per hit (kernel.bpf_stats_enabled).

| probe | hit by | end to end | in kernel |
|---|---|---:|---:|
{chr(10).join(rows)}

Agent drain of the net family's connection map every 0.5 s (batch read, compare with the last
shipment, build a LinkStats for what changed): {drain}."""
    write_section("probe_cost", body)


if __name__ == "__main__":
    main()
