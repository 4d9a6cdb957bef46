"""`ccld export` with CUPTI records: a track per (device, stream) under each rank's process, a slice per
kernel and memcpy/memset, and the NCCL kernel tied to the collective it ran (a flow from the rank's
collective slice, and comm/seq args), for frames with events as maps and as column blocks (schema 1.4).
Parsed back with perfetto's shipped protos (test_export_perfetto.parse: tracks declared before use,
slices balanced and ordered per track), and as Chrome JSON."""
import collections
import json

import msgpack
import pytest

from ccld import wire as ev
from ccld.store import StoreWriter
from ccld.export.chrome import export_chrome
from ccld.export.perfetto import export_perfetto

from ccld_synth import T0, FakeAgent
from test_export_perfetto import parse

pytestmark = pytest.mark.unit

COMM_A, COMM_B = "job/nccl:00000000000000aa", "job/nccl:00000000000000bb"
NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
GEMM = "ampere_sgemm_128x64_nn"
WORLD = 2
N_COLL = 23                     # prime: a lost or doubled kernel shows
TID = {0: 500, 1: 600}          # each rank's launching (Python main) thread
LAUNCH_AFTER, GPU_AFTER, GPU_TOOK = 20e-6, 50e-6, 1e-3
CUPTI_LAG = 0.5                 # GPU records reach the agent a CUPTI flush (500 ms) after the host events
NS = 1_000_000_000
ROW_FIELDS = {"coll": ("seq", "pid", "rank", "ts_ns", "tid"), "start": ("seq", "pid", "rank", "ts_ns"),
              "end": ("seq", "pid", "rank", "ts_ns")}


def ns(t):
    return int(round(t * NS))


def enter_time(seq, r):
    return T0 + 10.0 + seq * 0.1 + r * 0.003


def frame(agent, batch, events, shape):
    """A frame as an agent sends it: every event a map (schema 1.3), or coll/start/end as column blocks
    (1.4: one block per kind and shared fields, `at` = map events before its first row)."""
    env = {"v": [1, 3], "agent": agent.agent, "node": agent.node, "batch": batch}
    if shape == "maps":
        env["events"] = [e.to_wire() for e in events]
        return msgpack.packb(env, use_bin_type=True)
    plain, blocks = [], {}
    for e in events:
        rowf = ROW_FIELDS.get(e.KIND)
        if rowf is None:
            plain.append(e.to_wire())
            continue
        d = e.to_wire()
        same = tuple((k, v) for k, v in d.items() if k not in rowf and k != "k")
        b = blocks.get((e.KIND, same))
        if b is None:
            b = blocks[(e.KIND, same)] = {"k": e.KIND, "n": 0, "at": len(plain), "same": dict(same),
                                          "cols": {f: [] for f in rowf}}
        b["n"] += 1
        for f in rowf:
            b["cols"][f].append(d[f])
    env.update(v=[1, 4], events=plain, blocks=list(blocks.values()))
    return msgpack.packb(env, use_bin_type=True)


class GpuJob:
    """WORLD NCCL ranks with CUPTI capture on one node; times are Unix seconds, sent as node-monotonic ns.
    Host events go out in the frame of their time; GPU records CUPTI_LAG later (or `kernels_first`:
    in the frame before their host events, as a fast flush can do)."""

    def __init__(self, comms=(COMM_A,), probe=True):
        self.agent = FakeAgent("agent-0", "node0", boot_unix=T0 - 5000.0)
        self.out = collections.defaultdict(list)  # frame number (Unix time in 100 ms) -> events
        self.batch = 0
        self.corr = 0
        t = T0 + 1
        first = [ev.RankInfo(pid=100 + r, rank=r, world_size=WORLD, local_rank=r, node="node0", job="job",
                             ts_ns=self.ns(t)) for r in range(WORLD)]
        first += [ev.CommInit(pid=100 + r, rank=r, ts_ns=self.ns(t), backend="nccl", comm=c, group_rank=r,
                              group_size=WORLD) for r in range(WORLD) for c in comms]
        if probe:
            first += [ev.ProbeStatus(pid=100 + r, family="cupti", ok=True, ts_ns=self.ns(t), target="libcupti",
                                     message="CUPTI capture on") for r in range(WORLD)]
        self.out[int(t * 10)] += first

    def ns(self, t):
        return self.agent.mono(t)

    def at(self, t, events):
        self.out[int(t * 10) + 1] += events  # shipped with the next 100 ms frame (frames are numbered by 100 ms)

    def collective(self, seq, comm=COMM_A, stream=7, op="allreduce", kernels_first=False, kernels=True):
        """Every rank enters, its kernel runs (and its record is queued unless not `kernels`), it ends.
        Returns {rank: (enter, gpu start, gpu end)}."""
        times = {}
        for r in range(WORLD):
            t = enter_time(seq, r)
            start = t + LAUNCH_AFTER + GPU_AFTER
            end = start + GPU_TOOK
            pid = 100 + r
            self.at(t, [ev.CollEnter(pid=pid, rank=r, ts_ns=self.ns(t), backend="nccl", comm=comm, seq=seq, op=op,
                                     tid=TID[r], count=1024, dtype="float32", nbytes=4096),
                        ev.WorkStart(pid=pid, rank=r, ts_ns=self.ns(start), comm=comm, seq=seq),
                        ev.WorkEnd(pid=pid, rank=r, ts_ns=self.ns(end), comm=comm, seq=seq)])
            if kernels:
                self.at(t - 0.1 if kernels_first else t + CUPTI_LAG, [self.kernel(r, t + LAUNCH_AFTER, stream, op)])
            times[r] = (t, start, end)
        return times

    def kernel(self, r, launch, stream=7, op="allreduce", name=NCCL, nccl=True):
        self.corr += 1
        start = launch + GPU_AFTER
        return ev.GpuKernel(pid=100 + r, rank=r, ts_ns=self.ns(start), end_ns=self.ns(start + GPU_TOOK), device=0,
                            stream=stream, corr=self.corr, name=name, launch_tid=TID[r], launch_ns=self.ns(launch),
                            nccl=nccl, op=op if nccl else "", dtype="float32" if nccl else "",
                            algo="RING" if nccl else "", proto="LL" if nccl else "")

    def write(self, path, shape):
        w = StoreWriter(str(path))
        for n in range(min(self.out), max(self.out) + 1):
            self.batch += 1
            t = n / 10
            w.append(frame(self.agent, self.batch, self.out.get(n, []) + [self.agent.clock(t)], shape), t)
        w.close()


def by_name(t, prefix):
    return [s for s in t.slices if t.track_name(s["track"]).startswith(prefix)]


def calls_by_key(t):
    return {(t.rank_of(s["track"]), s["args"]["seq"]): s for s in by_name(t, "calls")}


@pytest.fixture(params=["maps", "blocks"])
def shape(request):
    return request.param


def test_stream_tracks_kernels_and_links(tmp_path, shape):
    job = GpuJob()
    times = {}
    for seq in range(1, N_COLL + 1):
        for r, x in job.collective(seq).items():
            times[(r, seq)] = x
    t = enter_time(5, 0)
    for r in range(WORLD):  # compute kernels and copies on another stream; the shim's loss counters
        job.at(t + CUPTI_LAG, [job.kernel(r, t + 0.01, stream=13, name=GEMM, nccl=False),
                               ev.GpuMemop(pid=100 + r, rank=r, ts_ns=job.ns(t + 0.02), end_ns=job.ns(t + 0.021),
                                           device=0, stream=13, corr=900 + r, op="memcpy", nbytes=1 << 20,
                                           copy_kind=1, launch_tid=TID[r], launch_ns=job.ns(t + 0.019)),
                               ev.GpuLoss(pid=100 + r, rank=r, ts_ns=job.ns(t), counters={"cupti_dropped": 3})])
    job.write(tmp_path / "s", shape)
    out = tmp_path / "t.pftrace"
    stats = export_perfetto(str(tmp_path / "s"), str(out), findings=[])
    t = parse(out)
    assert t.errors == []  # every track declared before use (parents first), balanced, ordered per track
    assert stats["gpu_kernels"] == WORLD * (N_COLL + 1) and stats["gpu_memops"] == WORLD
    assert stats["gpu_joined"] == WORLD * N_COLL and stats["gpu_unjoined"] == 0

    # one track per (device, stream) under each rank's process track
    streams = {(t.rank_of(u), t.track_name(u)): d for u, d in t.tracks.items()
               if t.track_name(u).startswith("GPU ")}
    assert sorted(streams) == [(r, f"GPU 0 stream {s}") for r in range(WORLD) for s in (13, 7)]
    for (r, _), d in streams.items():
        parent = t.tracks[d.parent_uuid]
        assert parent.HasField("process") and parent.process.pid == 100 + r

    calls = calls_by_key(t)
    kernels = [s for s in by_name(t, "GPU 0 stream 7")]
    assert len(kernels) == WORLD * N_COLL
    for k in kernels:
        r, seq = t.rank_of(k["track"]), k["args"]["seq"]
        enter, start, end = times[(r, seq)]
        assert k["name"] == NCCL and k["args"]["comm"] == COMM_A and k["args"]["op"] == "allreduce"
        assert k["args"]["stream"] == 7 and k["args"]["device"] == 0 and k["args"]["launch_tid"] == TID[r]
        assert k["args"]["algo"] == "RING" and k["args"]["corr"] > 0
        assert abs(k["begin"] - ns(start)) < 1000 and abs(k["end"] - ns(end)) < 1000  # collector timebase
        # the flow: from this rank's slice of (comm, seq) to its kernel, which ends it
        c = calls[(r, seq)]
        assert len(k["terminating"]) == 1 and k["terminating"][0] in c["flows"] and not k["flows"]
        assert abs(c["begin"] - ns(enter)) < 1000 and c["begin"] < k["begin"]
    fids = [k["terminating"][0] for k in kernels]
    assert len(set(fids)) == len(fids) and stats["gpu_flows"] == len(fids)
    cross = {f for s in calls.values() for f in s["flows"] + s["terminating"]} - set(fids)
    assert len(cross) == N_COLL  # the flows across ranks are still one per collective

    other = by_name(t, "GPU 0 stream 13")
    assert sorted(s["name"] for s in other) == sorted([GEMM, "memcpy HtoD"] * WORLD)
    for s in other:
        assert "seq" not in s["args"] and not s["flows"] and not s["terminating"]
        if s["name"].startswith("memcpy"):
            assert s["args"]["bytes"] == 1 << 20 and s["args"]["launch_tid"] in TID.values()
    loss = [x for x in t.counters if t.track_name(x["track"]) == "rank 1 cupti cupti_dropped"]
    assert [x["value"] for x in loss] == [3]


def healthy_store(path):
    """A GpuJob of N_COLL collectives with their kernels, written as column blocks at `path`."""
    job = GpuJob()
    for seq in range(1, N_COLL + 1):
        job.collective(seq)
    job.write(path, "blocks")
    return path


def test_chrome_json_has_the_stream_threads_and_kernel_flows(tmp_path):
    healthy_store(tmp_path / "s")
    out = tmp_path / "t.json"
    export_chrome(str(tmp_path / "s"), str(out), findings=[])
    evs = json.loads(out.read_text())["traceEvents"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in evs if e["ph"] == "M" and e["name"] == "thread_name"}
    assert sorted(n for n in threads.values() if n.startswith("GPU")) == ["GPU 0 stream 7"] * WORLD
    last = {}
    for e in evs:
        if e["ph"] in ("X", "s", "t", "f"):
            key = (e["pid"], e["tid"])
            assert e["ts"] >= last.get(key, 0), f"thread {threads[key]} goes back in time"
            last[key] = e["ts"]
    kernels = [e for e in evs if e["ph"] == "X" and threads[(e["pid"], e["tid"])] == "GPU 0 stream 7"]
    assert len(kernels) == WORLD * N_COLL and all(e["cat"] == "gpu" and e["args"]["comm"] == COMM_A for e in kernels)
    starts = {e["id"]: e for e in evs if e["ph"] == "s" and e["name"] == "kernel"}
    ends = [e for e in evs if e["ph"] == "f" and e["name"] == "kernel"]
    assert len(ends) == WORLD * N_COLL
    for f in ends:  # each kernel's flow starts on the calls thread of the same process, at its enter
        s = starts[f["id"]]
        assert s["pid"] == f["pid"] and threads[(s["pid"], s["tid"])] == "calls" and s["ts"] < f["ts"]


def test_kernels_that_come_before_their_enters_still_join(tmp_path):
    job = GpuJob()
    for seq in range(1, N_COLL + 1):
        job.collective(seq, kernels_first=seq % 2 == 0)
    job.write(tmp_path / "s", "blocks")
    stats = export_perfetto(str(tmp_path / "s"), str(tmp_path / "t.pftrace"), findings=[])
    t = parse(tmp_path / "t.pftrace")
    assert t.errors == [] and stats["gpu_joined"] == WORLD * N_COLL
    calls = calls_by_key(t)
    for k in by_name(t, "GPU 0 stream 7"):
        assert k["terminating"][0] in calls[(t.rank_of(k["track"]), k["args"]["seq"])]["flows"]


def test_grouped_calls_and_two_communicators(tmp_path):
    """Three calls made in one NCCL group run as one kernel (args: collectives 3, a flow from each);
    then two communicators, whose streams tell their kernels apart."""
    job = GpuJob(comms=(COMM_A, COMM_B))
    r = 0
    ts = [T0 + 10 + i * 1e-4 for i in range(3)]
    launch = ts[-1] + 5e-4  # ncclGroupEnd launches after the group's last call
    host = []
    for seq, t in enumerate(ts, 1):
        for rank in range(WORLD):
            host += [ev.CollEnter(pid=100 + rank, rank=rank, ts_ns=job.ns(t), backend="nccl", comm=COMM_A, seq=seq,
                                  op="allreduce", tid=TID[rank]),
                     ev.WorkEnd(pid=100 + rank, rank=rank, ts_ns=job.ns(launch + 0.002), comm=COMM_A, seq=seq)]
    job.at(T0 + 10, host)
    job.at(T0 + 10 + CUPTI_LAG, [job.kernel(rank, launch) for rank in range(WORLD)])
    for i in range(4):  # then both communicators, on streams 21 (A) and 22 (B)
        job.collective(10 + i, comm=COMM_A, stream=21)
        job.collective(20 + i, comm=COMM_B, stream=22)
    job.write(tmp_path / "s", "maps")
    stats = export_perfetto(str(tmp_path / "s"), str(tmp_path / "t.pftrace"), findings=[])
    t = parse(tmp_path / "t.pftrace")
    assert t.errors == [] and stats["gpu_unjoined"] == 0
    calls = {(t.rank_of(s["track"]), s["args"]["comm"], s["args"]["seq"]): s for s in by_name(t, "calls")}
    grouped = [k for k in by_name(t, "GPU 0 stream 7") if t.rank_of(k["track"]) == r]
    assert len(grouped) == 1 and grouped[0]["args"]["collectives"] == 3 and grouped[0]["args"]["seq"] == 1
    assert sorted(grouped[0]["terminating"]) == sorted(calls[(r, COMM_A, s)]["flows"][-1] for s in (1, 2, 3))
    for stream, comm, seqs in ((21, COMM_A, range(10, 14)), (22, COMM_B, range(20, 24))):
        ks = by_name(t, f"GPU 0 stream {stream}")
        assert sorted((t.rank_of(k["track"]), k["args"]["seq"]) for k in ks) == \
            sorted((rank, s) for rank in range(WORLD) for s in seqs)
        for k in ks:
            assert k["args"]["comm"] == comm
            assert k["terminating"][0] in calls[(t.rank_of(k["track"]), comm, k["args"]["seq"])]["flows"]


def test_without_a_capture_status_kernels_before_the_first_record_stay_unjoined(tmp_path):
    """No "CUPTI on" status in the store (an older agent, or the status was lost): a rank's enters are
    kept for the join only from its first GPU record on, so the kernels of the collectives before it
    are drawn without comm/seq; the later ones are joined and linked, and no kernel ends a flow that no
    collective starts."""
    job = GpuJob(probe=False)
    for seq in range(1, N_COLL + 1):
        job.collective(seq)
    job.write(tmp_path / "s", "blocks")
    stats = export_perfetto(str(tmp_path / "s"), str(tmp_path / "t.pftrace"), findings=[])
    t = parse(tmp_path / "t.pftrace")
    assert t.errors == [] and 0 < stats["gpu_unjoined"] < WORLD * N_COLL // 2
    calls = calls_by_key(t)
    kernels = by_name(t, "GPU 0 stream 7")
    joined = [k for k in kernels if "seq" in k["args"]]
    assert len(joined) == stats["gpu_joined"] == WORLD * N_COLL - stats["gpu_unjoined"]
    assert min(k["args"]["seq"] for k in joined) > 1
    for k in kernels:
        if "seq" in k["args"]:
            assert k["terminating"][0] in calls[(t.rank_of(k["track"]), k["args"]["seq"])]["flows"]
        else:
            assert not k["terminating"]


def test_records_as_the_agents_cupti_sink_makes_them(tmp_path):
    """The shim's messages through the agent's CuptiSink (capture status, kernel rows with a mangled
    NCCL name, a memcpy row, loss counters) into the store: exported as stream tracks, joined, linked."""
    from ccld.tracer.cupti_sink import CuptiSink
    mangled = "_Z40ncclDevKernel_AllReduce_Sum_bf16_RING_LL24ncclDevKernelArgsStorageILm4096EE"
    job = GpuJob(probe=False)
    got = []
    sink = CuptiSink(got.append, rank_of=lambda pid: pid - 100, mono_ns=lambda: job.ns(T0 + 1))
    try:
        for r in range(WORLD):  # the shim says capture is on as the rank starts
            sink.handle(msgpack.packb({"v": 1, "pid": 100 + r, "rank": r, "n": 1, "status": {"state": "on"},
                                       "kernels": [], "memops": [], "counters": {"cupti_dropped": 0}}))
        job.at(T0 + 1, list(got))
        n = {r: 1 for r in range(WORLD)}
        for seq in range(1, N_COLL + 1):
            for r, (enter, start, end) in job.collective(seq, kernels=False).items():
                n[r] += 1
                got.clear()
                row = [job.ns(start), job.ns(end), 0, 7, 1000 * seq + r, mangled, TID[r], job.ns(enter + LAUNCH_AFTER)]
                copy = ["memcpy", job.ns(end), job.ns(end + 1e-5), 0, 7, 5000 * seq + r, 4096, 2, TID[r], job.ns(end)]
                sink.handle(msgpack.packb({"v": 1, "pid": 100 + r, "rank": r, "n": n[r], "kernels": [row],
                                           "memops": [copy], "counters": {"cupti_dropped": 0}}))
                job.at(enter + CUPTI_LAG, list(got))
    finally:
        sink.close()
    job.write(tmp_path / "s", "blocks")
    stats = export_perfetto(str(tmp_path / "s"), str(tmp_path / "t.pftrace"), findings=[])
    t = parse(tmp_path / "t.pftrace")
    assert t.errors == [] and stats["gpu_joined"] == WORLD * N_COLL and stats["gpu_memops"] == WORLD * N_COLL
    calls = calls_by_key(t)
    on_stream = by_name(t, "GPU 0 stream 7")
    kernels = [s for s in on_stream if s["name"] == mangled]
    assert len(kernels) == WORLD * N_COLL and len(on_stream) == 2 * WORLD * N_COLL
    for k in kernels:
        assert (k["args"]["op"], k["args"]["dtype"], k["args"]["algo"]) == ("allreduce", "bfloat16", "RING")
        assert k["terminating"][0] in calls[(t.rank_of(k["track"]), k["args"]["seq"])]["flows"]
    assert {s["name"] for s in on_stream} - {mangled} == {"memcpy DtoH"}
