"""The wire schema: every event kind round-trips; every malformed frame is rejected or counted, clearly."""
import dataclasses

import msgpack
import pytest

from ccld import wire as ev
from ccld.timeline.ingest import IngestCounters, decode_frame

pytestmark = pytest.mark.unit

ONE_OF_EACH = [
    ev.AgentHello(agent="a1", node="n1", pid=7, version="0.1.0", sources=["gloo", "proc"], ts_ns=5),
    ev.ClockSample(mono_ns=10, wall_ns=1_764_400_000_000_000_000, ts_ns=10),
    ev.RankInfo(pid=100, rank=3, world_size=4, local_rank=1, node="n1", job="j", ts_ns=11,
                master_addr="10.0.0.1", master_port=29500, cmdline="python train.py",
                libs={"libtorch_cpu.so": "/x/libtorch_cpu.so"}),
    ev.RankExit(pid=100, rank=3, ts_ns=12, reason="killed by SIGKILL"),
    ev.RankState(pid=100, rank=3, ts_ns=13, state="S", wchan="futex_wait_queue", cpu_ns=123456),
    ev.CommInit(pid=100, rank=3, ts_ns=14, backend="gloo", comm="j/gloo:0", group_rank=3, group_size=4, handle=99,
                seq_source="library"),
    ev.CollEnter(pid=100, rank=3, ts_ns=15, backend="gloo", comm="j/gloo:0", seq=57, op="allreduce", tid=101,
                 count=4096, dtype="float32", root=-1, nbytes=16384, lib_seq=59),
    ev.WorkStart(pid=100, rank=3, ts_ns=16, comm="j/gloo:0", seq=57),
    ev.WorkEnd(pid=100, rank=3, ts_ns=17, comm="j/gloo:0", seq=57, ok=False, error="timeout"),
    ev.P2P(pid=100, rank=3, ts_ns=18, backend="gloo", comm="j/gloo:0", op="send", peer=0, tag=5, count=8,
           dtype="float32", seq=4, nbytes=32, lib_seq=60),
    ev.ProbeStatus(pid=100, family="gloo", ok=True, ts_ns=19, target="/x/libtorch_cpu.so", attached=12,
                   message="ok"),
    ev.LossCounters(ts_ns=20, counters={"ringbuf_lost": 3, "queue_dropped": 0}),
    ev.LinkStats(pid=100, rank=3, ts_ns=21, saddr="10.0.0.4", sport=40000, daddr="10.0.0.1", dport=29500,
                 tx_bytes=1 << 40, rx_bytes=5, tx_calls=2, rx_calls=1, tx_errs=0, rx_errs=1, retrans=7,
                 resets=1, srtt_us=55, cwnd=10, state="ESTABLISHED", last_tx_ns=20, last_rx_ns=19, closed=True),
    ev.SchedStats(pid=100, rank=3, ts_ns=22, runq_ns=5000, runq_waits=3, runq_max_ns=4000, offcpu_ns=9,
                  switches=12),
    ev.QpInfo(pid=100, rank=3, ts_ns=23, qp_num=0x11, state="RTR", dest_qp_num=0x22,
              dgid="fe800000000000000000000000000001", dlid=4, port=1, call="ibv_modify_qp"),
    ev.NicCounters(ts_ns=24, device="mlx5_0", port=1, counters={"port_xmit_wait": 12, "symbol_error": 0}),
    ev.GpuKernel(pid=100, rank=3, ts_ns=25, end_ns=26, device=0, stream=13, corr=4242,
                 name="ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", launch_tid=101,
                 launch_ns=24, nccl=True, op="allreduce", redop="sum", dtype="float32", algo="RING", proto="LL"),
    ev.GpuMemop(pid=100, rank=3, ts_ns=27, end_ns=28, device=0, stream=13, corr=4243, op="memcpy", nbytes=1 << 20,
                copy_kind=8, launch_tid=101, launch_ns=26),
    ev.GpuLoss(pid=100, rank=3, ts_ns=29, counters={"cupti_dropped": 5, "queue_dropped": 0}),
    ev.ClockSync(ts_ns=30, ref_ns=29, offset_ns=-3_000_000_000, drift_ppb=-25_000, uncertainty_ns=41_000,
                 rtt_min_ns=80_000, residual_ns=1_000, samples=30, epoch=7),
    ev.P2PEnd(pid=100, rank=3, ts_ns=19, comm="j/gloo:0", op="send", peer=0, seq=4, ok=False, error="x",
              wait_ns=18),
    ev.NetProgress(pid=100, rank=3, ts_ns=31, comm="j/nccl:00000000deadbeef", peer=2, send=True, channel=1,
                   nbytes=1 << 20, steps=8, net_wait_ns=400_000, gpu_wait_ns=20_000, in_flight=2, last_ns=30),
    ev.ComputeSpan(pid=100, rank=3, ts_ns=32, end_ns=40, name="forward", n=7),
]


def frame_of(env):
    return msgpack.packb(env, use_bin_type=True)


def env(events, v=(ev.SCHEMA_MAJOR, ev.SCHEMA_MINOR), **over):
    d = {"v": list(v), "agent": "a1", "node": "n1", "batch": 1, "events": events}
    d.update(over)
    return d


def test_every_kind_is_covered():
    assert {type(e).KIND for e in ONE_OF_EACH} == set(ev.EVENT_TYPES)


def test_round_trip_every_kind():
    frame = ev.encode_batch("a1", "n1", 42, ONE_OF_EACH)
    b = ev.decode_batch(frame)
    assert (b.agent, b.node, b.batch, b.version) == ("a1", "n1", 42, (ev.SCHEMA_MAJOR, ev.SCHEMA_MINOR))
    assert b.events == ONE_OF_EACH
    assert b.errors == [] and b.skipped == 0


def test_plain_msgpack_reads_a_frame():
    frame = ev.encode_batch("a1", "n1", 1, ONE_OF_EACH, columns=False)
    d = msgpack.unpackb(frame, raw=False)
    assert d["v"] == [ev.SCHEMA_MAJOR, ev.SCHEMA_MINOR]
    assert [e["k"] for e in d["events"]] == [type(e).KIND for e in ONE_OF_EACH]
    coll = d["events"][6]
    assert coll["comm"] == "j/gloo:0" and coll["seq"] == 57 and coll["op"] == "allreduce"
    assert coll == dict(k="coll", **dataclasses.asdict(ONE_OF_EACH[6]))


GOOD_EVENT = ONE_OF_EACH[7].to_wire()

REJECTED = [
    ("empty", b"", "empty"),
    ("not msgpack", b"\xc1", "not-msgpack"),
    ("truncated", ev.encode_batch("a", "n", 1, ONE_OF_EACH)[:-5], "truncated"),
    ("list envelope", frame_of([1, 2, 3]), "bad-envelope"),
    ("no version", frame_of({"agent": "a", "node": "n", "batch": 1, "events": []}), "no-version"),
    ("version not a pair", frame_of(env([], v=(1,))), "no-version"),
    ("newer major", frame_of(env([], v=(ev.SCHEMA_MAJOR + 1, 0))), "newer-major"),
    ("older major", frame_of(env([], v=(ev.SCHEMA_MAJOR - 1, 9))), "older-major"),
    ("bad envelope field", frame_of(env([], agent=5)), "bad-envelope"),
    ("events not a list", frame_of(env({"k": "coll"})), "bad-envelope"),
    ("trailing bytes", ev.encode_batch("a", "n", 1, []) + b"\x00", "trailing-bytes"),
    ("oversize", b"\x00" * (ev.MAX_FRAME_BYTES + 1), "too-large"),
]


@pytest.mark.parametrize("name,frame,reason", REJECTED, ids=[r[0] for r in REJECTED])
def test_malformed_frames_are_rejected_and_counted(name, frame, reason):
    with pytest.raises(ev.FrameError) as ei:
        ev.decode_batch(frame)
    assert ei.value.reason == reason
    assert str(ei.value)  # a message a person can read
    c = IngestCounters()
    batch, err = decode_frame(frame, c)
    assert batch is None and err.reason == reason
    assert c.frames_rejected == {reason: 1} and c.frames_ok == 0


def test_newer_major_message_says_upgrade():
    with pytest.raises(ev.FrameError, match="upgrade the collector"):
        ev.decode_batch(frame_of(env([], v=(ev.SCHEMA_MAJOR + 1, 0))))


BAD_EVENTS = [
    ("event missing field", {k: v for k, v in GOOD_EVENT.items() if k != "seq"}, "missing-field", "'seq'"),
    ("wrong field type", dict(GOOD_EVENT, seq="57"), "bad-field", "'seq'"),
    ("bool is not an int", dict(GOOD_EVENT, seq=True), "bad-field", "'seq'"),
    ("event not a map", [1, 2], "bad-event", "not a map"),
    ("unknown kind in same minor", {"k": "warp-drive", "ts_ns": 1}, "unknown-kind", "warp-drive"),
]


@pytest.mark.parametrize("name,bad,reason,mentions", BAD_EVENTS, ids=[b[0] for b in BAD_EVENTS])
def test_bad_event_is_dropped_and_the_rest_kept(name, bad, reason, mentions):
    frame = frame_of(env([GOOD_EVENT, bad, GOOD_EVENT]))
    c = IngestCounters()
    batch, err = decode_frame(frame, c)
    assert err is None
    assert len(batch.events) == 2 and all(isinstance(e, ev.WorkStart) for e in batch.events)
    assert [e.reason for e in batch.errors] == [reason]
    msg = str(batch.errors[0])
    assert "event #1" in msg and "'a1'" in msg and mentions in msg
    assert c.frames_ok == 1 and c.bad_events == {reason: 1}


def test_unknown_kind_in_newer_minor_is_skipped_and_counted():
    frame = frame_of(env([GOOD_EVENT, {"k": "warp-drive", "x": 1}], v=(ev.SCHEMA_MAJOR, ev.SCHEMA_MINOR + 1)))
    c = IngestCounters()
    batch, err = decode_frame(frame, c)
    assert err is None and batch.skipped == 1 and batch.errors == [] and len(batch.events) == 1
    assert c.skipped_events == 1 and not c.bad_events


def test_unknown_extra_fields_are_tolerated():
    frame = frame_of(env([dict(GOOD_EVENT, future_field=[1, 2]), ], v=(ev.SCHEMA_MAJOR, ev.SCHEMA_MINOR + 3),
                         future_envelope_field="x"))
    batch = ev.decode_batch(frame)
    assert batch.events == [ONE_OF_EACH[7]] and batch.errors == []


def test_decode_never_raises_anything_but_frame_error():
    base = ev.encode_batch("a", "n", 1, ONE_OF_EACH)
    for cut in range(0, len(base), 7):
        for mutated in (base[:cut], base[:cut] + b"\xff" + base[cut + 1:]):
            try:
                ev.decode_batch(mutated)
            except ev.FrameError:
                pass
