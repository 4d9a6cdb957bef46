"""The agent's sink for ccld's NCCL profiler plugin: datagrams on a real Unix socket -> wire events, and
`ccld run`'s injection of the plugin into the job's environment."""
import os
import socket
import time

import numpy as np
import pytest

from ccld import wire as ev
from ccld.errors import CcldError
from ccld.bpf.rows import Rows
from ccld.ncclprof import format as fmt
from ccld.tracer import ncclprof_sink as ns

pytestmark = pytest.mark.unit

HASH = 0x1234ABCD00FF0011
PID = 4242


class Out(list):
    def __call__(self, item):
        self.extend(item.events() if isinstance(item, Rows) else [item])

    def of(self, cls):
        return [e for e in self if isinstance(e, cls)]


def task(kind, seq, t, op=5, dtype=8, count=1024, peer=-1, flags=0, id=None):
    """A task record; `seq` is NCCL's (per function); `id` the plugin's id of the op (shared by its records)."""
    r = np.zeros(1, fmt.TASK_DTYPE)
    r["id"] = 1000 + 16 * seq + op if id is None else id
    r["kind"], r["op"], r["dtype"], r["count"], r["comm_hash"], r["seq"] = kind, op, dtype, count, HASH, seq
    r["t_ns"], r["t_enq_ns"], r["peer"], r["flags"] = t, t, peer, flags
    return r.view(np.uint8)


def comm(rank=2, nranks=4, t=5):
    r = np.zeros(1, fmt.COMM_DTYPE)
    r["kind"], r["flags"], r["comm_hash"], r["rank"], r["nranks"], r["nnodes"], r["t_ns"] = \
        fmt.KIND_COMM, fmt.F_FROM_INIT, HASH, rank, nranks, 1, t
    return r.view(np.uint8)


def progress(peer=3, send=True, steps=8, in_flight=1):
    r = np.zeros(1, fmt.PROGRESS_DTYPE)
    r["kind"], r["flags"], r["comm_hash"], r["peer"], r["channel"] = fmt.KIND_PROGRESS, fmt.F_SEND if send else 0, \
        HASH, peer, 1
    r["nbytes"], r["steps"], r["net_wait_ns"], r["gpu_wait_ns"], r["in_flight"], r["last_ns"] = \
        steps << 16, steps, 4000, 100, in_flight, 77
    return r.view(np.uint8)


def datagram(*recs, number=1, state=fmt.STATE_ON, text="", sent=1000):
    rows = np.concatenate(recs) if recs else None
    return fmt.encode({"pid": PID, "rank": 7, "number": number, "state": state, "sent_ns": sent,
                       "api_version": 5, "drop_queue": 3}, rows, text)


@pytest.fixture
def sink():
    out = Out()
    firsts = []
    s = ns.NcclProfSink(out, ident_of=lambda pid: (2, "job") if pid == PID else None)
    s.on_first = lambda pid, since: firsts.append((pid, since))
    s.out, s.firsts = out, firsts
    yield s
    s.close()


def send(sink, raw):
    """Send one datagram as a plugin does, and wait until the sink's reader thread has it."""
    before = sink.received
    c = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    c.sendto(raw, sink.path)
    c.close()
    deadline = time.monotonic() + 5
    while sink.received == before and time.monotonic() < deadline:
        time.sleep(0.005)
    assert sink.received == before + 1


def test_a_datagram_becomes_the_ranks_events_with_ncclss_own_ids(sink):
    send(sink, datagram(comm(), task(fmt.KIND_COLL_START, 0, 10), task(fmt.KIND_COLL_KERNEL, 0, 11),
                        task(fmt.KIND_COLL_END, 0, 15, flags=fmt.F_END_CHILDREN),
                        task(fmt.KIND_COLL_START, 1, 20, op=1, dtype=10, count=8, peer=0),
                        task(fmt.KIND_P2P_START, 1, 30, op=7, peer=3), task(fmt.KIND_P2P_END, 1, 31, op=7, peer=3),
                        progress()))
    assert sink.poll() == 1
    name = f"job/nccl:{HASH:016x}"
    (init,) = sink.out.of(ev.CommInit)
    assert (init.comm, init.rank, init.group_rank, init.group_size, init.seq_source) == (name, 2, 2, 4, "library")
    enters = sink.out.of(ev.CollEnter)
    assert [(e.seq, e.lib_seq, e.op, e.dtype, e.count, e.nbytes, e.ts_ns, e.backend) for e in enters] == [
        (0, 0, "allreduce", "float32", 1024, 4096, 10, "nccl"), (1, 1, "broadcast", "bfloat16", 8, 16, 20, "nccl")]
    assert enters[1].root == 0
    assert [(e.seq, e.ts_ns) for e in sink.out.of(ev.WorkStart)] == [(0, 11)]
    assert [(e.seq, e.ts_ns, e.ok) for e in sink.out.of(ev.WorkEnd)] == [(0, 15, True)]
    (p2p,) = sink.out.of(ev.P2P)
    assert (p2p.op, p2p.peer, p2p.seq, p2p.comm) == ("send", 3, 1, name)
    assert [(e.op, e.peer, e.seq) for e in sink.out.of(ev.P2PEnd)] == [("send", 3, 1)]
    (np_,) = sink.out.of(ev.NetProgress)
    assert (np_.peer, np_.send, np_.channel, np_.steps, np_.net_wait_ns, np_.in_flight, np_.ts_ns) == \
        (3, True, 1, 8, 4000, 1, 1000)
    (on,) = sink.out.of(ev.ProbeStatus)
    assert on.ok and on.family == "ncclprof" and "v5" in on.message
    assert sink.firsts == [(PID, 5)]  # the uprobes of this pid yield from its first record on
    assert sink.loss()["ncclprof_drop_queue"] == 3
    # enters come before starts and ends of the same collective in what is emitted
    kinds = [type(e).__name__ for e in sink.out if isinstance(e, (ev.CollEnter, ev.WorkStart, ev.WorkEnd))]
    assert kinds.index("WorkStart") > kinds.index("CollEnter") and kinds.index("WorkEnd") > kinds.index("WorkStart")


def test_ends_that_never_started_stay_open_and_launch_only_ends_close(sink):
    send(sink, datagram(task(fmt.KIND_COLL_START, 0, 10), task(fmt.KIND_COLL_START, 1, 11),
                        task(fmt.KIND_COLL_END, 0, 10, flags=fmt.F_END_ENQUEUE),
                        task(fmt.KIND_COLL_END, 1, 0, flags=fmt.F_END_STALE)))
    sink.poll()
    assert [e.seq for e in sink.out.of(ev.WorkEnd)] == [0]
    assert sink.counters["ends_never_started"] == 1 and sink.counters["ends_launch_only"] == 1


def test_bad_datagrams_are_counted_by_reason_and_the_rest_is_read(sink):
    good = datagram(task(fmt.KIND_COLL_START, 0, 10))
    send(sink, b"\x00" * 200)
    send(sink, good[:120])
    send(sink, good)
    assert sink.poll() == 3
    assert sink.counters["bad_datagram_magic"] == 1 and sink.counters["bad_datagram_truncated"] == 1
    assert len(sink.out.of(ev.CollEnter)) == 1


def test_lost_datagrams_are_counted_from_the_numbering(sink):
    send(sink, datagram(number=1))
    send(sink, datagram(number=4))
    sink.poll()
    assert sink.counters["datagrams_lost"] == 2


def test_off_says_why_once(sink):
    send(sink, datagram(number=1))
    send(sink, datagram(number=2, state=fmt.STATE_OFF, text="out of memory for the event pool"))
    sink.poll()
    off = [e for e in sink.out.of(ev.ProbeStatus) if not e.ok]
    assert len(off) == 1 and "out of memory" in off[0].message
    assert sink.announce() == []  # off: not said again as on


def test_an_unknown_process_waits_for_discovery_then_goes_with_what_the_plugin_said(sink, monkeypatch):
    raw = fmt.encode({"pid": PID + 1, "rank": 5, "number": 1}, task(fmt.KIND_COLL_START, 0, 10))
    send(sink, raw)
    sink.poll()
    assert sink.out.of(ev.CollEnter) == [] and sink.counters["held"] == 1
    monkeypatch.setattr(ns, "HOLD_S", 0.0)
    sink.poll()
    (e,) = sink.out.of(ev.CollEnter)
    assert (e.rank, e.comm) == (5, f"job/nccl:{HASH:016x}")


class FakeAgent:
    def __init__(self):
        self.opened = 0

    def open_ncclprof_sink(self):
        self.opened += 1
        return "/tmp/x/sink"


def test_ccld_run_injects_the_plugin_and_chains_the_users(monkeypatch, tmp_path):
    lib = tmp_path / "libnccl-profiler-ccld.so"
    lib.write_bytes(b"")
    monkeypatch.setattr(ns, "plugin_path", lambda env: str(lib))
    said, agent = [], FakeAgent()
    env = ns.job_env(agent, said.append, {ns.ENV_FORCE: "1", "NCCL_PROFILER_PLUGIN": "/opt/inspector.so", "A": "b"})
    assert env[ns.ENV_PLUGIN] == str(lib) and env[ns.ENV_CHAIN] == "/opt/inspector.so"
    assert env[ns.ENV_ENDPOINT] == "/tmp/x/sink" and env["A"] == "b" and agent.opened == 1
    assert "chaining /opt/inspector.so" in said[0]


def test_ccld_run_leaves_nccl_alone_when_told_or_without_gpu_or_plugin(monkeypatch):
    said, agent = [], FakeAgent()
    monkeypatch.setattr(ns, "gpu_present", lambda env: False)
    assert ns.job_env(agent, said.append, {}) is None and said == []  # no GPU: no NCCL, nothing to say
    assert ns.job_env(agent, said.append, {ns.ENV_FORCE: "1", ns.ENV_MODE: "off"}) is None
    assert ns.job_env(agent, said.append, {ns.ENV_FORCE: "1", "NCCL_PROFILER_PLUGIN": "none"}) is None
    monkeypatch.setattr(ns, "plugin_path", lambda env: None)
    assert ns.job_env(agent, said.append, {ns.ENV_FORCE: "1"}) is None
    assert agent.opened == 0 and len(said) == 3 and "not built" in said[-1]


def test_the_socket_is_private_and_removed_on_close():
    s = ns.NcclProfSink(lambda e: None)
    d = os.path.dirname(s.path)
    assert os.stat(d).st_mode & 0o777 == 0o700
    s.close()
    assert not os.path.exists(d)


def test_collectives_are_numbered_per_communicator_across_functions(sink):
    # NCCL numbers per function: all-reduce 0, broadcast 0, all-reduce 1. The timeline needs one number
    # per collective: 0, 1, 2 (kept across datagrams), NCCL's number as lib_seq; later records find theirs by id.
    send(sink, datagram(task(fmt.KIND_COLL_START, 0, 10), task(fmt.KIND_COLL_START, 0, 11, op=1, peer=0),
                        task(fmt.KIND_COLL_END, 0, 12, op=1, flags=fmt.F_END_CHILDREN), number=1))
    send(sink, datagram(task(fmt.KIND_COLL_START, 1, 20), task(fmt.KIND_COLL_KERNEL, 1, 21),
                        task(fmt.KIND_COLL_END, 0, 22, flags=fmt.F_END_CHILDREN),
                        task(fmt.KIND_COLL_END, 7, 23, flags=fmt.F_END_CHILDREN), number=2))
    sink.poll()
    assert [(e.seq, e.lib_seq, e.op) for e in sink.out.of(ev.CollEnter)] == [
        (0, 0, "allreduce"), (1, 0, "broadcast"), (2, 1, "allreduce")]
    assert [(e.seq, e.ts_ns) for e in sink.out.of(ev.WorkStart)] == [(2, 21)]
    assert [(e.seq, e.ts_ns) for e in sink.out.of(ev.WorkEnd)] == [(1, 12), (0, 22)]
    assert sink.counters["unknown_tasks"] == 1  # the end of a collective whose start never came


def test_more_datagrams_than_the_socket_queues_are_all_read(sink):
    # A Unix datagram socket queues only max_dgram_qlen (10 here) datagrams, and the agent polls every
    # 250 ms: its reader thread must keep up with 4 "ranks" sending every 5 ms without waiting (as the
    # plugin sends: MSG_DONTWAIT, a refused send is a loss) while nobody polls.
    socks = [socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) for _ in range(4)]
    refused = 0
    for i in range(30):
        for c in socks:
            try:
                c.sendto(datagram(number=i + 1), socket.MSG_DONTWAIT, sink.path)
            except BlockingIOError:
                refused += 1
        time.sleep(0.005)
    for c in socks:
        c.close()
    deadline = time.monotonic() + 5
    while sink.received < 120 - refused and time.monotonic() < deadline:
        time.sleep(0.01)
    assert refused == 0 and sink.received == 120
    assert sum(sink.poll() for _ in range(3)) == 120


def test_a_named_socket_for_jobs_started_elsewhere(tmp_path):
    # ccld agent --nccl-plugin-socket PATH: a stale socket of a dead agent is replaced, a path that cannot
    # be bound is a clear error, and close() removes the socket (not the directory it is in).
    path = tmp_path / "ncclprof.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    stale.bind(str(path))
    stale.close()
    out = Out()
    s = ns.NcclProfSink(out, ident_of=lambda pid: (2, "job"), path=str(path))
    try:
        send(s, datagram(task(fmt.KIND_COLL_START, 0, 10)))
        s.poll()
        assert len(out.of(ev.CollEnter)) == 1
    finally:
        s.close()
    assert not path.exists() and tmp_path.exists()
    with pytest.raises(CcldError, match="cannot bind"):
        ns.NcclProfSink(out, path=str(tmp_path / "no-such-dir" / "x.sock"))


def test_a_process_that_exited_keeps_the_job_it_was_known_in(sink, monkeypatch):
    # Its last datagram ("bye") often comes after the process is gone, when /proc can no longer say
    # which job it was in: the events go where its earlier ones went, not to a job of their own.
    known = {PID: (2, "job")}
    sink.ident_of = lambda pid: known.get(pid)
    send(sink, datagram(task(fmt.KIND_COLL_START, 0, 10), number=1))
    sink.poll()
    known.clear()
    send(sink, datagram(task(fmt.KIND_COLL_START, 1, 20), number=2, state=fmt.STATE_BYE))
    sink.poll()
    assert [(e.rank, e.comm) for e in sink.out.of(ev.CollEnter)] == [(2, f"job/nccl:{HASH:016x}")] * 2
    assert sink.counters["held"] == 0
