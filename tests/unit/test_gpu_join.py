"""The collector's join of CUPTI kernels to collectives: per rank, enter -> GPU start -> GPU end, through
real frames and the Timeline, in order, out of order, coalesced, several communicators, stream order."""
import pytest

from ccld import wire as ev
from ccld.timeline.gpu import MAX_LAUNCH_LAG_NS
from ccld.timeline.timeline import Timeline
from ccld_synth import T0, FakeAgent

pytestmark = pytest.mark.unit

COMM_A, COMM_B = "job/nccl:00000000000000aa", "job/nccl:00000000000000bb"
NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
TID = {0: 500, 1: 600}
LAUNCH_AFTER, GPU_AFTER, GPU_TOOK = 20e-6, 50e-6, 1e-3


class GpuJob:
    """`world` NCCL ranks on one node; times are Unix seconds, sent as that node's monotonic ns."""

    def __init__(self, world=2, comms=(COMM_A,), capture=True):
        """capture: each rank's CUPTI shim says it is on as the rank starts (a cupti ProbeStatus)."""
        self.world = world
        self.agent = FakeAgent("agent-0", "node0", boot_unix=T0 - 5000.0)
        self.tl = Timeline()
        self.t = T0
        self.corr = 0
        self.send([ev.RankInfo(pid=100 + r, rank=r, world_size=world, local_rank=r, node="node0", job="job",
                               ts_ns=self.ns(T0)) for r in range(world)]
                  + [ev.CommInit(pid=100 + r, rank=r, ts_ns=self.ns(T0), backend="nccl", comm=c, group_rank=r,
                                 group_size=world) for r in range(world) for c in comms]
                  + [ev.ProbeStatus(pid=100 + r, family="cupti", ok=True, ts_ns=self.ns(T0), target="libcupti",
                                    message="CUPTI capture on") for r in range(world) if capture])

    def ns(self, t):
        return self.agent.mono(t)

    def send(self, events):
        self.tl.ingest(ev.decode_batch(self.agent.frame(self.t + 1.0, events)), self.t + 1.0)

    def enter(self, r, comm, seq, t, op="allreduce"):
        return ev.CollEnter(pid=100 + r, rank=r, ts_ns=self.ns(t), backend="nccl", comm=comm, seq=seq, op=op,
                            tid=TID[r], count=1024, dtype="float32")

    def kernel(self, r, launch, stream=7, launched=True, name=NCCL, op="allreduce", nccl=True):
        self.corr += 1
        start = launch + GPU_AFTER
        return ev.GpuKernel(pid=100 + r, rank=r, ts_ns=self.ns(start), end_ns=self.ns(start + GPU_TOOK), device=0,
                            stream=stream, corr=self.corr, name=name, launch_tid=TID[r] if launched else 0,
                            launch_ns=self.ns(launch) if launched else 0, nccl=nccl, op=op, dtype="float32",
                            algo="RING", proto="LL")

    def span(self, comm, seq, r):
        return self.tl.gpu.span(comm, seq, r)

    def join(self):
        return self.tl.counters()["gpu"]["join"]


def enter_time(seq, r):
    return T0 + 10.0 + seq * 0.1 + r * 0.003


def assert_span(got, enter, launch):
    assert got is not None
    e, s, f = got
    assert e == pytest.approx(enter, abs=1e-6)
    assert s == pytest.approx(launch + GPU_AFTER, abs=1e-6)
    assert f == pytest.approx(launch + GPU_AFTER + GPU_TOOK, abs=1e-6)


@pytest.mark.parametrize("order", ["in-order", "kernels-reversed", "kernels-first"])
def test_every_rank_gets_enter_gpu_start_gpu_end(order):
    job = GpuJob()
    enters, kernels = [], []
    for seq in range(23):
        for r in range(job.world):
            t = enter_time(seq, r)
            enters.append(job.enter(r, COMM_A, seq, t))
            kernels.append(job.kernel(r, t + LAUNCH_AFTER))
    if order == "in-order":
        job.send([x for pair in zip(enters, kernels) for x in pair])
    elif order == "kernels-reversed":
        job.send(enters)
        job.send(kernels[::-1])
    else:  # a fast kernel can reach the collector before its CollEnter: it waits for it
        job.send(kernels[:10])
        job.send(enters[:16])
        job.send(kernels[10:20][::-1] + enters[16:] + kernels[20:])
    for seq in range(23):
        for r in range(job.world):
            t = enter_time(seq, r)
            assert_span(job.span(COMM_A, seq, r), t, t + LAUNCH_AFTER)
    j = job.join()
    assert job.tl.gpu.kernels_joined() == 46 and j.get("unjoined-no-enter", 0) == 0
    if order == "in-order":
        assert j["joins"] == 46 and "reassigned" not in j
    assert job.tl.counters()["gpu"]["kernels_waiting_for_enter"] == 0
    if order == "kernels-reversed":
        assert j["reassigned"] > 0  # later kernels first claimed earlier enters, then gave them back


def test_grouped_calls_share_one_kernel():
    job = GpuJob(world=1)
    ts = [T0 + 10 + i * 1e-4 for i in range(3)]
    launch = ts[-1] + 5e-4  # ncclGroupEnd launches after the last call of the group
    job.send([job.enter(0, COMM_A, seq, t) for seq, t in enumerate(ts)] + [job.kernel(0, launch)])
    for seq, t in enumerate(ts):
        assert_span(job.span(COMM_A, seq, 0), t, launch)
    assert job.join()["coalesced-enters"] == 2


def test_two_communicators_in_one_group_are_told_apart_by_stream():
    job = GpuJob(world=1, comms=(COMM_A, COMM_B))
    a0, b0 = T0 + 10, T0 + 10.1
    job.send([job.enter(0, COMM_A, 0, a0), job.kernel(0, a0 + LAUNCH_AFTER, stream=1),   # learns stream 1 -> A
              job.enter(0, COMM_B, 0, b0), job.kernel(0, b0 + LAUNCH_AFTER, stream=2)])  # learns stream 2 -> B
    a1, b1 = T0 + 11, T0 + 11.0001
    end = b1 + 1e-4
    # grouped: both calls, then B's kernel is launched first; only the stream says whose it is
    job.send([job.enter(0, COMM_A, 1, a1), job.enter(0, COMM_B, 1, b1),
              job.kernel(0, end, stream=2), job.kernel(0, end + 1e-5, stream=1)])
    assert_span(job.span(COMM_B, 1, 0), b1, end)
    assert_span(job.span(COMM_A, 1, 0), a1, end + 1e-5)


def test_kernel_op_narrows_the_choice_before_the_stream_is_known():
    job = GpuJob(world=1, comms=(COMM_A, COMM_B))
    t = T0 + 10
    job.send([job.enter(0, COMM_A, 0, t, op="allgather"), job.enter(0, COMM_B, 0, t + 1e-4, op="allreduce"),
              job.kernel(0, t + 2e-4, op="allreduce")])
    assert job.span(COMM_B, 0, 0)[1] is not None and job.span(COMM_A, 0, 0)[1] is None


def test_kernels_without_launch_records_join_in_stream_order():
    job = GpuJob(world=1)
    t0 = T0 + 10
    job.send([job.enter(0, COMM_A, 0, t0), job.kernel(0, t0 + LAUNCH_AFTER)])  # stream 7 -> COMM_A learned
    later = [T0 + 11 + i * 0.01 for i in range(5)]
    job.send([job.enter(0, COMM_A, i + 1, t) for i, t in enumerate(later)]
             + [job.kernel(0, t + LAUNCH_AFTER, launched=False) for t in later])
    for i, t in enumerate(later):
        assert_span(job.span(COMM_A, i + 1, 0), t, t + LAUNCH_AFTER)
    assert job.join()["joined-by-stream-order"] == 5


def test_unknown_stream_without_launch_is_counted_not_joined():
    job = GpuJob(world=1)
    t = T0 + 10
    job.send([job.enter(0, COMM_A, 0, t), job.kernel(0, t + LAUNCH_AFTER, launched=False, stream=9)])
    assert job.span(COMM_A, 0, 0)[1] is None and job.join()["unjoined-no-launch"] == 1


def test_p2p_and_compute_kernels_are_not_joined():
    job = GpuJob(world=1)
    t = T0 + 10
    job.send([job.enter(0, COMM_A, 0, t),
              job.kernel(0, t + 1e-5, name="ncclDevKernel_SendRecv(x)", op="sendrecv"),
              job.kernel(0, t + 2e-5, name="ampere_sgemm_128x64_nn", op="", nccl=False)])
    assert job.span(COMM_A, 0, 0)[1] is None
    j = job.join()
    assert (j["p2p-kernels"], j["compute-kernels"]) == (1, 1)


def test_launch_long_after_the_call_is_not_joined():
    job = GpuJob(world=1)
    t = T0 + 10
    job.send([job.enter(0, COMM_A, 0, t), job.kernel(0, t + MAX_LAUNCH_LAG_NS / 1e9 + 1)])
    assert job.span(COMM_A, 0, 0)[1] is None
    assert job.tl.counters()["gpu"]["kernels_waiting_for_enter"] == 1


def test_kernels_without_host_events_wait_bounded_and_are_counted(monkeypatch):
    from ccld.timeline import gpu
    monkeypatch.setattr(gpu, "MAX_WAITING", 5)
    job = GpuJob(world=1)
    job.send([job.kernel(0, T0 + 10 + i) for i in range(8)])  # e.g. eBPF is off: no CollEnter at all
    assert job.join()["unjoined-no-enter"] == 3
    assert job.tl.counters()["gpu"]["kernels_waiting_for_enter"] == 5


def test_a_lost_kernel_record_makes_the_next_kernel_claim_its_call():
    """The documented caveat: with kernel 0's record dropped by CUPTI, seq 0 gets kernel 1's times."""
    job = GpuJob(world=1)
    t0, t1 = T0 + 10, T0 + 10.1
    job.send([job.enter(0, COMM_A, 0, t0), job.enter(0, COMM_A, 1, t1), job.kernel(0, t1 + LAUNCH_AFTER),
              ev.GpuLoss(pid=100, rank=0, ts_ns=job.ns(t1), counters={"cupti_dropped": 1})])
    assert job.span(COMM_A, 0, 0)[1] == job.span(COMM_A, 1, 0)[1]
    assert job.tl.counters()["gpu"]["shim_loss"]["cupti_dropped"] == 1


def test_gpu_events_are_not_unhandled_kinds():
    job = GpuJob(world=1)
    t = T0 + 10
    job.send([job.enter(0, COMM_A, 0, t), job.kernel(0, t + 1e-5),
              ev.GpuMemop(pid=100, rank=0, ts_ns=job.ns(t), end_ns=job.ns(t + 1e-3), device=0, stream=7, corr=99,
                          op="memcpy", nbytes=8),
              ev.GpuLoss(pid=100, rank=0, ts_ns=job.ns(t), counters={"queue_dropped": 2})])
    assert not [k for k in job.tl.anomalies if k.startswith("unhandled-kind")]
    assert job.tl.counters()["gpu"]["ranks_reporting"] == 1


def test_a_thread_past_its_bound_of_remembered_calls_keeps_joining(monkeypatch):
    """More calls on one thread than it remembers: the oldest are forgotten, the newest still join
    (the forgetting shifted the list under the index of the call just inserted: an IndexError once)."""
    from ccld.timeline import gpu
    monkeypatch.setattr(gpu, "MAX_ENTERS_PER_THREAD", 8)
    job = GpuJob(world=1)
    for seq in range(1, 31):
        job.send([job.enter(0, COMM_A, seq, enter_time(seq, 0))])
    launch = enter_time(30, 0) + LAUNCH_AFTER
    job.send([job.kernel(0, launch)])
    assert_span(job.span(COMM_A, 30, 0), enter_time(30, 0), launch)
    assert job.join().get("enters-forgotten", 0) >= 20


def test_without_cupti_capture_nccl_enters_take_the_fast_path_and_join_nothing():
    """A rank with no CUPTI shim (no cupti ProbeStatus, no GPU record) keeps none of its NCCL enters for
    the join: its column blocks take the timeline's fast path; once a GPU record shows capture, the
    rank's later enters are kept and joined."""
    job = GpuJob(world=2, capture=False)
    for seq in (1, 2):
        job.send([e for r in range(2) for e in (job.enter(r, COMM_A, seq, enter_time(seq, r)),
                                                ev.WorkEnd(pid=100 + r, rank=r, ts_ns=job.ns(enter_time(seq, r) + 0.01),
                                                           comm=COMM_A, seq=seq))])
    assert job.tl.gpu.procs == {} and job.tl.gpu.capture == set()
    assert job.tl.comms[COMM_A].colls[2].enter.keys() == {0, 1}  # the timeline has them all the same
    job.send([job.kernel(0, enter_time(2, 0) + LAUNCH_AFTER)])  # capture shows: rank 0 is now kept
    job.send([job.enter(r, COMM_A, 3, enter_time(3, r)) for r in range(2)])
    job.send([job.kernel(0, enter_time(3, 0) + LAUNCH_AFTER)])
    assert_span(job.span(COMM_A, 3, 0), enter_time(3, 0), enter_time(3, 0) + LAUNCH_AFTER)
    assert job.span(COMM_A, 3, 1)[1] is None and (("node0", 101) not in job.tl.gpu.procs)
