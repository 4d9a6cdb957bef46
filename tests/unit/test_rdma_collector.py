"""The collector's RDMA table: QPs joined to the peer rank's QP, NIC port counters, bounds, and the
timeline's dispatch of qp/nic events to it (through real frames from a synthetic 4-rank, 2-node job)."""
import collections

import pytest

from ccld import wire as ev
from ccld.timeline import rdma as rdm
from ccld.timeline.rdma import RdmaTable
from ccld.timeline.timeline import Timeline

from ccld_synth import T0, SynthJob

pytestmark = pytest.mark.unit

GID = {n: f"00000000000000000000ffff0a0000{i:02x}" for i, n in enumerate(["a", "b", "c", "d"], 1)}


def qp(t: RdmaTable, node, pid, rank, qpn, state="RTR", dest=-1, dgid="", dlid=-1, port=-1, call="ibv_modify_qp",
       job="j", at=1.0):
    t.update(node, job, ev.QpInfo(pid=pid, rank=rank, ts_ns=0, qp_num=qpn, state=state, dest_qp_num=dest,
                                  dgid=dgid, dlid=dlid, port=port, call=call), at)


def ends(q):
    return None if q is None else (q.node, q.pid, q.rank, q.qp_num)


def connected_pair():
    """Rank 0 (node a) QP 0x100 <-> rank 1 (node b) QP 0x200, over RoCE, set up as NCCL does."""
    t = RdmaTable(collections.Counter())
    for node, pid, rank, me, peer, peer_node in (("a", 10, 0, 0x100, 0x200, "b"), ("b", 20, 1, 0x200, 0x100, "a")):
        qp(t, node, pid, rank, me, state="INIT", port=1)
        qp(t, node, pid, rank, me, state="RTR", dest=peer, dgid=GID[peer_node].upper(), dlid=0, port=1)
        qp(t, node, pid, rank, me, state="RTS")
    return t


def test_mutual_join_names_the_peer_rank():
    t = connected_pair()
    assert ends(t.peer_of("a", 10, 0x100)) == ("b", 20, 1, 0x200)
    assert ends(t.peer_of("b", 20, 0x200)) == ("a", 10, 0, 0x100)
    assert t.peer_ranks() == {(0, 1): 1, (1, 0): 1}
    q = t.qps[("a", 10, 0x100)]
    # RTS carries no address: what RTR said is kept; GIDs are stored lower case
    assert (q.state, q.dest_qp_num, q.dgid, q.dlid, q.port) == ("RTS", 0x200, GID["b"], 0, 1)
    assert t.node_gids == {"a": {GID["a"]}, "b": {GID["b"]}}  # learned from the mutual join


def test_half_open_join_and_what_does_not_join():
    t = connected_pair()
    qp(t, "a", 10, 0, 0x101, dest=0x201, dgid=GID["b"])
    qp(t, "b", 20, 1, 0x201, state="INIT")                 # not yet RTR: its remote end is unknown
    assert ends(t.peer_of("a", 10, 0x101)) == ("b", 20, 1, 0x201)
    qp(t, "c", 30, 2, 0x202, dest=0x999)                   # 0x202 exists but is connected elsewhere
    qp(t, "a", 10, 0, 0x102, dest=0x202)
    assert t.peer_of("a", 10, 0x102) is None
    qp(t, "a", 10, 0, 0x103, dest=0x104)                   # same process: never a peer
    qp(t, "a", 10, 0, 0x104, dest=0x103)
    assert t.peer_of("a", 10, 0x103) is None
    qp(t, "a", 10, 0, 0x105, state="INIT")                 # no remote end yet
    assert t.peer_of("a", 10, 0x105) is None
    assert t.peer_of("a", 10, 0x999) is None               # unknown QP
    qp(t, "d", 40, 3, 0x300, dest=0x301, job="other")      # another job's QP with the right number
    qp(t, "a", 10, 0, 0x106, dest=0x300)
    assert t.peer_of("a", 10, 0x106) is None


def test_collisions_resolved_by_mutual_then_by_learned_gid():
    t = connected_pair()
    # QP number 0x400 exists on node b (rank 1) and node c (rank 2): QP numbers are only unique per NIC.
    qp(t, "b", 20, 1, 0x400, state="INIT")
    qp(t, "c", 30, 2, 0x400, state="INIT")
    qp(t, "a", 10, 0, 0x110, dest=0x400, dgid=GID["b"])
    assert ends(t.peer_of("a", 10, 0x110)) == ("b", 20, 1, 0x400)   # node b owns GID b (learned)
    qp(t, "a", 10, 0, 0x111, dest=0x400, dgid=GID["d"])             # a GID no candidate is known to own
    assert t.peer_of("a", 10, 0x111) is None
    qp(t, "c", 30, 2, 0x400, dest=0x111)                            # now c's 0x400 names 0x111 back
    assert ends(t.peer_of("a", 10, 0x111)) == ("c", 30, 2, 0x400)
    fresh = RdmaTable(collections.Counter())                        # nothing learned: ambiguous, not guessed
    qp(fresh, "b", 20, 1, 0x400, state="INIT")
    qp(fresh, "c", 30, 2, 0x400, state="INIT")
    qp(fresh, "a", 10, 0, 0x110, dest=0x400, dgid=GID["b"])
    assert fresh.peer_of("a", 10, 0x110) is None


def test_destroy_reset_and_create():
    t = connected_pair()
    qp(t, "a", 10, 0, -1, state="", call="ibv_create_qp")
    qp(t, "a", 10, 0, -1, state="", call="ibv_create_qp")
    assert t.creates == {("a", 10): 2} and ("a", 10, -1) not in t.qps
    qp(t, "b", 20, 1, 0x200, state="", call="ibv_destroy_qp")
    assert ("b", 20, 0x200) not in t.qps and 0x200 not in t.by_qpn
    assert t.peer_of("a", 10, 0x100) is None
    qp(t, "a", 10, 0, 0x100, state="RESET")
    q = t.qps[("a", 10, 0x100)]
    assert (q.state, q.dest_qp_num, q.dgid, q.dlid, q.port) == ("RESET", -1, "", -1, 1)
    qp(t, "a", 10, 0, 0x7777, state="", call="ibv_destroy_qp")    # destroy of a QP never seen: nothing to do
    assert t.counters() == {"qps": 1, "ports": 0, "qp_creates": 2}


def test_qp_bound_drops_least_recently_updated(monkeypatch):
    monkeypatch.setattr(rdm, "MAX_QPS", 3)
    anomalies = collections.Counter()
    t = RdmaTable(anomalies)
    for i, qpn in enumerate((1, 2, 3)):
        qp(t, "a", 10, 0, qpn, state="INIT", at=float(i))
    qp(t, "a", 10, 0, 1, state="RTR", at=5.0)                       # 1 is now the most recently updated
    qp(t, "a", 10, 0, 4, state="INIT", at=6.0)
    assert [k[2] for k in t.qps] == [3, 1, 4]
    assert anomalies == {"rdma-qps-over-bound": 1} and 2 not in t.by_qpn


def nic(t, node, device, port, at, **counters):
    t.update(node, "", ev.NicCounters(ts_ns=0, device=device, port=port, counters=counters), at)


def test_port_counters_latest_previous_and_rates(monkeypatch):
    t = RdmaTable(collections.Counter())
    nic(t, "a", "mlx5_0", 1, 10.0, port_xmit_wait=100, symbol_error=3, port_xmit_data=1000)
    p = t.ports[("a", "mlx5_0", 1)]
    assert p.rates() == {}                                           # one sample: no rate yet
    nic(t, "a", "mlx5_0", 1, 15.0, port_xmit_wait=600, symbol_error=3, port_xmit_data=500, link_downed=1)
    assert (p.counters, p.prev, p.at, p.prev_at) == (
        {"port_xmit_wait": 600, "symbol_error": 3, "port_xmit_data": 500, "link_downed": 1},
        {"port_xmit_wait": 100, "symbol_error": 3, "port_xmit_data": 1000}, 15.0, 10.0)
    # port_xmit_data went down (a reset): no rate; link_downed is new: no rate
    assert p.rates() == {"port_xmit_wait": 100.0, "symbol_error": 0.0}
    monkeypatch.setattr(rdm, "MAX_PORTS", 2)
    nic(t, "a", "mlx5_0", 2, 16.0, symbol_error=0)
    nic(t, "b", "mlx5_0", 1, 17.0, symbol_error=0)
    assert list(t.ports) == [("a", "mlx5_0", 2), ("b", "mlx5_0", 1)]
    assert t.anomalies == {"rdma-ports-over-bound": 1}


def test_timeline_dispatches_qp_and_nic_events():
    job, tl = SynthJob(), Timeline()
    job.announce(T0)
    # ranks 0,1 on node0, ranks 2,3 on node1; rank 1 and rank 2 connect one QP each way.
    for r, me, peer, gid in ((1, 0x10, 0x20, GID["b"]), (2, 0x20, 0x10, GID["a"])):
        for state, kw in (("INIT", dict(port=1)), ("RTR", dict(dest_qp_num=peer, dgid=gid, dlid=0)), ("RTS", {})):
            job._put(r, ev.QpInfo(pid=job.pid[r], rank=r, ts_ns=job.ts(r, T0 + 1), qp_num=me, state=state,
                                  call="ibv_modify_qp", **kw))
    job.agent_of[0].pending.append(ev.NicCounters(ts_ns=job.ts(0, T0 + 1), device="mlx5_0", port=1,
                                                  counters={"port_xmit_wait": 7}))
    job.feed(tl, T0 + 2)
    assert not [k for k in tl.anomalies if k.startswith("unhandled-kind")]
    assert ends(tl.rdma.peer_of("node0", job.pid[1], 0x10)) == ("node1", job.pid[2], 2, 0x20)
    assert tl.rdma.peer_ranks("job") == {(1, 2): 1, (2, 1): 1}
    assert tl.rdma.qps[("node0", job.pid[1], 0x10)].job == "job"
    p = tl.rdma.ports[("node0", "mlx5_0", 1)]
    assert p.counters == {"port_xmit_wait": 7} and p.at == pytest.approx(T0 + 1, abs=1e-6)
    assert tl.events_by_kind["qp"] == 6 and tl.events_by_kind["nic"] == 1
