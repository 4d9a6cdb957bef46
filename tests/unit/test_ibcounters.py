"""The NIC counter reader against a directory laid out like /sys/class/infiniband, with the bad files a
real one can hold, and the agent's sampling hook. No root needed (and root's bypass of file modes is
why "unreadable" is made with a dangling link and a non-directory, not with chmod).
"""
import os

import pytest

from ccld import wire as ev
from ccld.tracer import ibcounters

pytestmark = pytest.mark.unit

TS = 123_456_789


def _write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


@pytest.fixture
def sysfs(tmp_path):
    """Two mlx5 devices with two ports each, as the kernel lays them out, plus every kind of bad entry."""
    root = tmp_path / "infiniband"
    p = lambda *parts: str(root.joinpath(*parts))  # noqa: E731
    # mlx5_0 port 1: IB PortCounters and mlx5 hw_counters, one garbage file, a setting and an N/A.
    _write(p("mlx5_0", "ports", "1", "counters", "port_xmit_wait"), "4242\n")
    _write(p("mlx5_0", "ports", "1", "counters", "port_rcv_errors"), "0\n")
    _write(p("mlx5_0", "ports", "1", "counters", "symbol_error"), "7\n")
    _write(p("mlx5_0", "ports", "1", "counters", "port_xmit_data"), "18446744073709551615\n")  # u64 max
    _write(p("mlx5_0", "ports", "1", "counters", "port_rcv_data"), "hello\n")                # garbage
    _write(p("mlx5_0", "ports", "1", "hw_counters", "out_of_sequence"), "5\n")
    _write(p("mlx5_0", "ports", "1", "hw_counters", "lifespan"), "12\n")                     # a setting
    _write(p("mlx5_0", "ports", "1", "hw_counters", "np_cnp_sent"), "N/A (no PMA)\n")
    _write(p("mlx5_0", "ports", "1", "state"), "4: ACTIVE\n")                                # not a counter dir
    # mlx5_0 port 2: one counter and one that vanished (a dangling link: open fails like a removed device).
    _write(p("mlx5_0", "ports", "2", "counters", "port_xmit_wait"), "9\n")
    os.symlink(p("mlx5_0", "gone"), p("mlx5_0", "ports", "2", "counters", "link_downed"))
    # mlx5_1 port 1: counters + hw_counters, a subdirectory and a FIFO where files belong.
    _write(p("mlx5_1", "ports", "1", "counters", "symbol_error"), "1")                         # no newline
    _write(p("mlx5_1", "ports", "1", "hw_counters", "packet_seq_err"), "  2 \n")
    os.makedirs(p("mlx5_1", "ports", "1", "counters", "subdir"))
    os.mkfifo(p("mlx5_1", "ports", "1", "counters", "fifo"))  # opening it would block the agent
    # mlx5_1 port 2: one good counter; hw_counters is a file, not a directory; bad numbers.
    _write(p("mlx5_1", "ports", "2", "counters", "port_rcv_errors"), "3\n")
    _write(p("mlx5_1", "ports", "2", "counters", "negative"), "-1\n")
    _write(p("mlx5_1", "ports", "2", "counters", "too_wide"), "18446744073709551616\n")
    _write(p("mlx5_1", "ports", "2", "counters", "empty"), "")
    _write(p("mlx5_1", "ports", "2", "counters", "huge"), "1" * 100)
    _write(p("mlx5_1", "ports", "2", "hw_counters"), "not a directory\n")
    os.makedirs(p("mlx5_1", "ports", "notaport"))
    # Not devices: a plain file, a device directory without ports, a port with no counters at all.
    _write(p("README"), "x\n")
    os.makedirs(p("mlx5_2"))
    os.makedirs(p("mlx5_3", "ports", "1"))
    return str(root)


EXPECTED = [
    ("mlx5_0", 1, {"port_xmit_wait": 4242, "port_rcv_errors": 0, "symbol_error": 7,
                   "port_xmit_data": (1 << 64) - 1, "hw.out_of_sequence": 5}),
    ("mlx5_0", 2, {"port_xmit_wait": 9}),
    ("mlx5_1", 1, {"symbol_error": 1, "hw.packet_seq_err": 2}),
    ("mlx5_1", 2, {"port_rcv_errors": 3}),
]
ERRORS = {"garbage": 5, "not-available": 1, "unreadable": 2, "not-a-file": 2, "bad-port": 1}


def test_exact_counters_and_counted_errors(sysfs):
    r = ibcounters.CounterReader(sysfs, clock=lambda: TS)
    assert r.present()
    got = r.sample()
    assert all(isinstance(e, ev.NicCounters) and e.ts_ns == TS for e in got)
    assert [(e.device, e.port, e.counters) for e in got] == EXPECTED
    assert r.errors == ERRORS and r.error_count() == sum(ERRORS.values())


def test_each_bad_path_is_named_once(sysfs):
    r = ibcounters.CounterReader(sysfs, clock=lambda: TS)
    r.sample()
    msgs = r.take_messages()
    base = sysfs + os.sep
    named = sorted(m.split(":", 1)[0][len(base):] for m in msgs)
    assert named == sorted([
        "mlx5_0/ports/1/counters/port_rcv_data", "mlx5_0/ports/1/hw_counters/np_cnp_sent",
        "mlx5_0/ports/2/counters/link_downed", "mlx5_1/ports/1/counters/subdir", "mlx5_1/ports/1/counters/fifo",
        "mlx5_1/ports/2/counters/negative", "mlx5_1/ports/2/counters/too_wide", "mlx5_1/ports/2/counters/empty",
        "mlx5_1/ports/2/counters/huge", "mlx5_1/ports/2/hw_counters", "mlx5_1/ports/notaport"])
    by_path = {m.split(":", 1)[0][len(base):]: m for m in msgs}
    assert "'hello'" in by_path["mlx5_0/ports/1/counters/port_rcv_data"]
    assert "No such file" in by_path["mlx5_0/ports/2/counters/link_downed"]
    assert "wider than 64 bits" in by_path["mlx5_1/ports/2/counters/too_wide"]
    # The next sample reads the same values, counts the same failures again, names nobody again.
    again = r.sample()
    assert [(e.device, e.port, e.counters) for e in again] == EXPECTED
    assert r.take_messages() == []
    assert r.errors == {k: 2 * v for k, v in ERRORS.items()}


def test_values_follow_the_files(sysfs):
    r = ibcounters.CounterReader(sysfs, clock=lambda: TS)
    r.sample()
    _write(os.path.join(sysfs, "mlx5_0", "ports", "2", "counters", "port_xmit_wait"), "10\n")
    os.remove(os.path.join(sysfs, "mlx5_1", "ports", "2", "counters", "port_rcv_errors"))
    got = {(e.device, e.port): e.counters for e in r.sample()}
    assert got[("mlx5_0", 2)] == {"port_xmit_wait": 10}
    assert ("mlx5_1", 2) not in got  # no readable counter left on that port: no event


def test_absent_root_is_quiet(tmp_path):
    r = ibcounters.CounterReader(str(tmp_path / "nothing"))
    assert not r.present()
    assert r.sample() == [] and r.errors == {} and r.take_messages() == []


def test_messages_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(ibcounters, "MAX_MESSAGES_KEPT", 3)
    for i in range(5):
        _write(str(tmp_path / "d" / "ports" / "1" / "counters" / f"c{i}"), "x\n")
    r = ibcounters.CounterReader(str(tmp_path))
    assert r.sample() == []
    assert len(r.take_messages()) == 3 and r.errors == {"garbage": 5}


def test_events_survive_the_wire(sysfs):
    got = ibcounters.CounterReader(sysfs, clock=lambda: TS).sample()
    batch = ev.decode_batch(ev.encode_batch("a", "n", 1, got))
    assert batch.events == got and not batch.errors


def test_agent_ships_samples_and_counts_errors(sysfs, caplog):
    from ccld.tracer.agent import Agent
    agent = Agent("tcp://127.0.0.1:9", pids=[os.getpid()], use_bpf=False, say=lambda s: None)
    try:
        shipped = []
        agent.shipper.put = shipped.append
        agent.nic = ibcounters.CounterReader(sysfs, clock=lambda: TS)
        with caplog.at_level("WARNING", logger="ccld.agent"):
            agent._sample_nic()
        assert [(e.device, e.port, e.counters) for e in shipped] == EXPECTED
        assert sum("ib counters:" in r.getMessage() for r in caplog.records) == 11
        loss = agent._loss()
        assert {k: v for k, v in loss.items() if k.startswith("nic_counter_")} == {
            f"nic_counter_{k}": v for k, v in ERRORS.items()}
        agent.nic = ibcounters.CounterReader(sysfs + "-absent")
        shipped.clear()
        agent._sample_nic()
        assert shipped == []
    finally:
        agent.shipper.close()
