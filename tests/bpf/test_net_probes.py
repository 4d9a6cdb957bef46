"""The net and sched probe families loaded into this kernel, on real processes and real sockets.

Exact counts: a child sends 23 messages of 1,000 bytes over TCP and reads 2 bytes back, so its
connection must show tx_bytes 23,000 in 23 calls and rx_bytes 2, with the 4-tuple the child itself
reports; the untraced parent's side must not appear at all.
"""
import os
import subprocess
import sys
import time

import pytest

from conftest import bpf_skip_reason

pytestmark = pytest.mark.bpf

CHILD = r"""
import os, socket, sys, time
sys.stdin.readline()                      # wait until the tracer has the pid
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
print("%s %d %s %d" % (s.getsockname() + s.getpeername()), flush=True)
for _ in range(23):
    s.sendall(b"x" * 1000)
assert s.recv(2) == b"ok"
sys.stdin.readline()                      # wait until the test has drained once
s.close()
time.sleep(0.3)
"""


@pytest.fixture(scope="module")
def fams():
    reason = bpf_skip_reason()
    if reason:
        pytest.skip(reason)
    from ccld.bpf.net import NetFamily, NetTranslator
    from ccld.bpf.sched import SchedFamily, SchedTranslator
    got = []
    out = {}
    for name, fam_cls, tr_cls in (("net", NetFamily, NetTranslator), ("sched", SchedFamily, SchedTranslator)):
        tr = tr_cls(got.append)
        fam = fam_cls(tr)
        fam.load()
        out[name] = (fam, tr)
    yield out, got
    for fam, _ in out.values():
        fam.close()


def trace(fams, pid, rank):
    for fam, tr in fams.values():
        tr.add_process(pid, rank, "job")
        fam.attach(pid, fam.find_lib(pid))


def drain(fams):
    for fam, _ in fams.values():
        fam.poll(0)


def test_connection_bytes_calls_tuple_and_close_are_exact(fams):
    import socket
    fams, got = fams
    got.clear()
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(srv.getsockname()[1])], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        trace(fams, child.pid, 7)
        child.stdin.write("go\n")
        child.stdin.flush()
        local_ip, local_port, peer_ip, peer_port = child.stdout.readline().split()
        conn, _ = srv.accept()
        n = 0
        while n < 23000:
            n += len(conn.recv(65536))
        conn.sendall(b"ok")
        time.sleep(0.2)
        drain(fams)
        child.stdin.write("close\n")
        child.stdin.flush()
        assert child.wait(10) == 0
        time.sleep(0.1)
        drain(fams)
    finally:
        child.kill()
        srv.close()
    links = [e for e in got if e.KIND == "link"]
    assert links and {e.pid for e in links} == {child.pid}  # the untraced parent's socket is not reported
    assert {(e.saddr, e.sport, e.daddr, e.dport) for e in links} == {(local_ip, int(local_port), peer_ip, int(peer_port))}
    first, last = links[0], links[-1]
    assert (first.tx_bytes, first.tx_calls, first.rx_bytes, first.rx_calls) == (23000, 23, 2, 1)
    assert first.rank == 7 and first.state == "ESTABLISHED" and not first.closed
    assert first.srtt_us > 0 and first.cwnd > 0 and first.last_tx_ns <= first.ts_ns
    assert last.closed and last.state == "CLOSE" and last.tx_bytes == 23000
    # The closed connection is gone from the kernel map: another drain reports nothing more for it, and
    # its bit left the socket filter (others' ACKs hashing there do not look it up).
    got.clear()
    drain(fams)
    assert [e for e in got if e.KIND == "link"] == []
    net = fams["net"][0]
    assert len(list(net.bpf[b"conns"].items())) == 0
    assert all(v.value == 0 for v in net.bpf[b"sock_bits"].values())


def test_a_reset_from_the_peer_is_counted(fams):
    import socket
    import struct
    fams, got = fams
    got.clear()
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    code = ("import socket,sys,time; sys.stdin.readline(); s=socket.create_connection(('127.0.0.1',%d)); "
            "s.sendall(b'hi'); sys.stdin.readline()\ntry:\n s.recv(10)\nexcept OSError as e: print(e.errno)\n"
            "time.sleep(0.2)" % srv.getsockname()[1])
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        trace(fams, child.pid, 1)
        child.stdin.write("go\n")
        child.stdin.flush()
        conn, _ = srv.accept()
        assert conn.recv(2) == b"hi"
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()  # linger 0: the server sends RST instead of FIN
        child.stdin.write("recv\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "104"  # ECONNRESET seen by the child
        child.wait(10)
        drain(fams)
    finally:
        child.kill()
        srv.close()
    links = [e for e in got if e.KIND == "link" and e.pid == child.pid]
    assert links and links[-1].resets >= 1 and links[-1].closed


def test_runqueue_wait_of_a_rank_sharing_its_cpu_with_a_hog(fams):
    fams, got = fams
    busy = "import time\nt=time.monotonic()\nwhile time.monotonic()-t < 2.0: pass\n"
    cpu = sorted(os.sched_getaffinity(0))[0]
    hog = subprocess.Popen(["taskset", "-c", str(cpu), sys.executable, "-c", busy])
    rank = subprocess.Popen(["taskset", "-c", str(cpu), sys.executable, "-c", "import sys; sys.stdin.readline()\n" + busy],
                            stdin=subprocess.PIPE, text=True)
    sleeper = subprocess.Popen([sys.executable, "-c", "import sys,time; sys.stdin.readline(); time.sleep(1.0)"],
                               stdin=subprocess.PIPE, text=True)
    try:
        got.clear()
        trace(fams, rank.pid, 3)
        trace(fams, sleeper.pid, 4)
        t0 = time.monotonic()
        for p in (rank, sleeper):
            p.stdin.write("go\n")
            p.stdin.flush()
        rank.wait(30)
        sleeper.wait(30)
        wall = time.monotonic() - t0
        drain(fams)
    finally:
        for p in (hog, rank, sleeper):
            p.kill()
    st = {e.rank: e for e in got if e.KIND == "sched"}
    hogged, asleep = st[3], st[4]
    # Their threads exited: gone from the program's thread table and bitmap (a tid reused by another
    # process's thread is not counted for them).
    sched = fams["sched"][0]
    gone = {rank.pid, sleeper.pid}
    assert not [k.value for k, t in sched.bpf[b"threads"].items() if t.tgid in gone]
    words = {k.value: v.value for k, v in sched.bpf[b"thread_bits"].items() if v.value}
    assert not [p for p in gone if words.get(p >> 6, 0) & (1 << (p & 63))]
    # Two busy loops share one CPU: the rank waits for it about half the time.
    assert hogged.runq_ns > 0.2 * wall * 1e9 and hogged.runq_waits > 10 and hogged.runq_max_ns > 0
    assert asleep.offcpu_ns >= 0.9e9 and asleep.runq_ns < hogged.runq_ns


def test_a_traced_process_exit_is_timed_by_the_kernel(fams):
    # Two traced processes with threads of their own; one is SIGKILLed, 50 ms later the other is
    # SIGTERMed: each exit time is its main thread's (a worker thread ending is no death), in order,
    # with the signal that ended it and its sender.
    import signal
    fams, _ = fams
    sched, _tr = fams["sched"]
    code = "import threading, time\nthreading.Thread(target=time.sleep, args=(0.2,)).start()\ntime.sleep(60)"
    kids = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(2)]
    try:
        for i, k in enumerate(kids):
            trace({"sched": fams["sched"]}, k.pid, i)
        time.sleep(0.5)  # the helper thread has ended: still no exit
        assert [sched.exit_info(k.pid).exit_ns for k in kids] == [None, None]
        os.kill(kids[0].pid, signal.SIGCHLD)  # not a fatal signal: not kept
        assert sched.exit_info(kids[0].pid).signal == 0
        t0 = time.monotonic_ns()
        kids[0].send_signal(signal.SIGKILL)
        time.sleep(0.05)
        kids[1].send_signal(signal.SIGTERM)
        for k in kids:
            k.wait(10)
        t1 = time.monotonic_ns()
        ia, ib = (sched.exit_info(k.pid) for k in kids)
        a, b = ia.exit_ns, ib.exit_ns
        assert a is not None and b is not None and t0 <= a < b <= t1, (t0, a, b, t1)
        assert b - a >= 40_000_000, (a, b)
        # the signal that ended each, and who sent it (this process: their parent, as a launcher is)
        assert (ia.signal, ia.sender, ib.signal, ib.sender) == (9, os.getpid(), 15, os.getpid()), (ia, ib)
    finally:
        for k in kids:
            if k.poll() is None:
                k.kill()
            sched.detach(k.pid)
