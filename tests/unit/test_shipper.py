"""The shipper never blocks the producer, counts what it drops, and reaches a collector that
restarts on the same address. Real ZeroMQ on 127.0.0.1."""
import socket
import time

import pytest
import zmq

from ccld import wire as ev
from ccld.tracer import shipper as sh

pytestmark = pytest.mark.unit


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pull(ctx, endpoint):
    s = ctx.socket(zmq.PULL)
    s.setsockopt(zmq.LINGER, 0)
    s.bind(endpoint)
    return s


def receive(sock, seconds):
    out, end = [], time.time() + seconds
    while time.time() < end:
        if sock.poll(50):
            out += ev.decode_batch(sock.recv()).events
    return out


def state(i):
    return ev.RankState(pid=1, rank=0, ts_ns=i, state="S")


def test_reaches_a_collector_that_restarts_and_counts_drops(monkeypatch):
    monkeypatch.setattr(sh, "QUEUE_LIMIT", 50)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    ctx = zmq.Context()
    s = sh.Shipper(endpoint, "agent-t", "node-t").start()
    try:
        coll = pull(ctx, endpoint)
        for i in range(10):
            s.put(state(i))
        got = [e.ts_ns for e in receive(coll, 1.0) if e.KIND == "proc"]
        assert got == list(range(10))
        coll.close()  # the collector goes away
        time.sleep(0.3)
        t0 = time.monotonic()
        for i in range(10, 500):
            s.put(state(i))  # never blocks, even with nobody listening
        assert time.monotonic() - t0 < 5  # a blocked put would never return; this is not a speed check
        time.sleep(0.5)
        assert s.dropped > 0  # over the queue bound: dropped and counted, not blocking
        coll = pull(ctx, endpoint)  # the collector is back on the same address
        s.put(state(10_000))
        evs = receive(coll, 3.0)
        assert 10_000 in [e.ts_ns for e in evs if e.KIND == "proc"]
        losses = [e.counters["queue_dropped"] for e in evs if e.KIND == "loss"]
        assert losses and max(losses) == s.dropped  # the loss itself reaches the collector
        assert all(e.KIND != "clock" or e.wall_ns > 0 for e in evs)
        coll.close()
    finally:
        s.close(timeout_s=0.5)
        ctx.term()
