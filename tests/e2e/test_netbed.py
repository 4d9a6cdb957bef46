"""The network test bed itself (tests/netbed.py): a real 4-rank gloo job across namespaces, and
each fault doing what it says on the link it names.

Speed is compared as ratios of one job's progress rates before, during and after a fault, with
wide margins (the 2-core CI box is shared). Budget: a 4-rank job starts in ~4-15 s; the file
takes about a minute.
"""
import os
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: netbed
from netbed import NetBed, NetBedError, netbed, skip_reason  # noqa: F401,E402  (netbed: fixture)

_SKIP = skip_reason()
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")]

START_TIMEOUT_S = 90.0      # 4 ranks importing torch on a loaded 2-core box
RESUME_TIMEOUT_S = 30.0     # after a blackhole clears, TCP's backed-off RTO fires within seconds
WINDOW_S = 3.0              # one progress-rate sample
SETTLE_S = 0.5              # let queues fill or drain after a fault changes
# 256 KiB allreduce: ~10 ms a step unshaped; ring allreduce moves ~384 KiB per link per step,
# ~150 ms at 20 Mbit/s, so a shaped link slows steps ~10x.
FAST_JOB = ["--seconds", "120", "--elems", "65536", "--compute-ms", "1", "--progress-every", "1",
            "--timeout-s", "120"]


def wait_until(pred, timeout, what, bed):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        if any(p.poll() is not None for p in bed.procs):
            break
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}\n{bed.logs()}")


def started(bed, steps=5):
    wait_until(lambda: min(bed.latest_steps()) >= steps, START_TIMEOUT_S, "the job's first steps", bed)


def rate(bed, seconds=WINDOW_S):
    """Steps per second of rank 0 (allreduce keeps ranks in step) over the next `seconds`."""
    time.sleep(SETTLE_S)
    t0 = time.time()
    time.sleep(seconds)
    t1 = time.time()
    n = sum(1 for _, t in bed.progress(0) if t0 <= t < t1)
    return n / (t1 - t0)


def test_job_runs_across_namespaces_and_connections_are_seen(netbed):
    bed = netbed
    go = os.path.join(bed.workdir, "go")
    bed.start_job(["--steps", "23", "--ops", "allreduce,broadcast,allgather,sendrecv",
                   "--elems", "1024", "--wait-file", go, "--timeout-s", "120"])
    pids = bed.rank_pids()
    n = bed.ranks
    pairs = {(i, j) for i in range(n) for j in range(n) if i < j}

    def mesh_up():
        seen = {tuple(sorted((bed.rank_of_ip(c.saddr), bed.rank_of_ip(c.daddr))))
                for c in bed.connections() if c.dport != 29500 and c.sport != 29500}
        return pairs <= seen
    wait_until(mesh_up, START_TIMEOUT_S, "gloo's full mesh", bed)

    conns = bed.connections()
    for r in range(n):
        ident = subprocess.run(["ip", "netns", "identify", str(pids[r])], capture_output=True, text=True)
        assert ident.stdout.strip() == bed.ns(r), f"rank {r} (pid {pids[r]}) is not in {bed.ns(r)}"
        mine = [c for c in conns if c.netns == bed.ns(r)]
        assert mine and all(c.pid == pids[r] and c.saddr == bed.ip(r) for c in mine), mine
        if r:  # every rank reaches rank 0's TCPStore across the bridge
            assert any(c.daddr == bed.ip(0) and c.dport == 29500 for c in mine), mine
    for i, j in pairs:  # each gloo pair, from both ends, with the right pid at each end
        assert any(c.netns == bed.ns(i) and c.daddr == bed.ip(j) and c.pid == pids[i] for c in conns)
        assert any(c.netns == bed.ns(j) and c.daddr == bed.ip(i) and c.pid == pids[j] for c in conns)

    open(go, "w").close()
    assert bed.wait_job(60) == [0] * n, bed.logs()
    for r in range(n):
        assert f"rank {r} done: 23 steps" in bed.log(r), bed.logs()


def test_rate_limit_slows_the_job_and_clearing_restores_it(netbed):
    bed = netbed
    bed.start_job(FAST_JOB)
    started(bed)
    before = rate(bed)

    bed.rate_limit_pair(0, 1, "20mbit")
    pair_limited = rate(bed)
    classes = bed.exec(0, "tc", "-s", "class", "show", "dev", "eth0").stdout
    qdisc = bed.exec(0, "tc", "-s", "qdisc", "show", "dev", "eth0").stdout
    bed.clear_faults()
    after_pair = rate(bed)

    bed.rate_limit_rank(2, "20mbit")
    rank_limited = rate(bed)
    bed.clear_faults()
    after_rank = rate(bed)

    msg = (f"steps/s: before {before:.1f}, pair 0-1 limited {pair_limited:.1f}, cleared "
           f"{after_pair:.1f}, rank 2 limited {rank_limited:.1f}, cleared {after_rank:.1f}")
    assert before > 0 and after_pair > 0 and after_rank > 0, msg + "\n" + bed.logs()
    assert pair_limited < 0.5 * before and rank_limited < 0.5 * before, msg
    assert after_pair > 2 * pair_limited and after_rank > 2 * rank_limited, msg
    # The htb class took the traffic to rank 1 only; rank 0's traffic to 2 and 3 went unshaped.
    assert "class htb 1:1" in classes and " Sent 0 bytes" not in classes.split("class htb 1:1")[1], classes
    assert "direct_packets_stat 0 " not in qdisc, qdisc


def test_loss_on_one_link_makes_its_sender_retransmit(netbed):
    bed = netbed
    bed.start_job(FAST_JOB)
    started(bed)
    base = {(s, d): bed.pair_retrans(s, d) for s in range(4) for d in range(4) if s != d}
    segs0 = bed.retrans_segs(0)

    bed.loss(0, 1, 0.05)
    time.sleep(4.0)
    grew = {k: bed.pair_retrans(*k) - v for k, v in base.items()}
    segs = bed.retrans_segs(0) - segs0
    bed.clear_faults()

    assert grew[(0, 1)] >= 3, grew
    assert grew[(0, 1)] == max(grew.values()), f"the lossy link 0->1 is not the worst: {grew}"
    assert segs >= grew[(0, 1)], (segs, grew)


def test_blackhole_stops_progress_and_clearing_resumes_it(netbed):
    bed = netbed
    bed.start_job(FAST_JOB)
    started(bed)

    bed.blackhole(0, 1)
    time.sleep(1.0)           # steps already past the link finish
    held = bed.latest_steps()
    time.sleep(3.0)
    still = bed.latest_steps()
    assert max(b - a for a, b in zip(held, still)) <= 1, f"progress went on: {held} -> {still}"
    assert all(p.poll() is None for p in bed.procs), bed.logs()

    bed.clear_faults()
    wait_until(lambda: min(bed.latest_steps()) >= max(still) + 5, RESUME_TIMEOUT_S,
               f"progress past {still} once the blackhole is cleared", bed)


def netns_names():
    return set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
               .stdout.split()) - {"(id:"}


def test_bed_removes_its_namespaces_on_exit_and_on_exception():
    with NetBed(2) as bed:
        made = bed.namespaces()
        assert set(made) <= netns_names() and len(made) == 3
    assert not {n for n in netns_names() if n.startswith(bed.prefix)}

    with pytest.raises(RuntimeError, match="boom"):
        with NetBed(2) as bed:
            assert set(bed.namespaces()) <= netns_names()
            raise RuntimeError("boom")
    assert not {n for n in netns_names() if n.startswith(bed.prefix)}


def test_bed_removes_namespaces_of_dead_beds():
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"ccldt{dead.pid}-abcdef-r0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        with NetBed(1) as bed:
            assert stale not in netns_names()
            assert bed.ns(0) in netns_names()  # a live bed's own namespaces stay
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)


def test_sigterm_removes_the_namespaces_and_kills_the_ranks(tmp_path):
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = (f"import sys, time; sys.path.insert(0, {tests!r}); from netbed import NetBed\n"
              "bed = NetBed(2); bed.start_job(['--wait-file', '/nonexistent'])\n"
              "print(bed.prefix, *bed.rank_pids(), flush=True); time.sleep(120)\n")
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        prefix, *pids = child.stdout.readline().split()
        assert {f"{prefix}-sw", f"{prefix}-r0", f"{prefix}-r1"} <= netns_names()
        child.terminate()
        child.wait(30)
    finally:
        child.kill()
    assert not {n for n in netns_names() if n.startswith(prefix)}
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}"), f"rank pid {pid} outlived the bed"


def test_faults_refuse_two_root_qdiscs_on_one_device():
    with NetBed(2) as bed:
        bed.rate_limit_rank(0, "10mbit", direction="out")
        with pytest.raises(NetBedError, match="one root qdisc per device"):
            bed.rate_limit_pair(0, 1, "10mbit")
        bed.clear_faults()
        bed.rate_limit_pair(0, 1, "10mbit")
        bed.loss(0, 1, 0.5)
        bed.blackhole(0, 1)
        bed.clear_faults()
        assert "DROP" not in bed.exec(1, "iptables", "-w", "-S", "INPUT").stdout
        assert "htb" not in bed.exec(0, "tc", "qdisc", "show", "dev", "eth0").stdout
