"""p2p hangs on synthetic pipelines (stage = rank, a send/recv between neighbours each step, then a loss
all-reduce): a stage that never sends is named alone, however many ranks end up waiting on it and
in which operations; both sides posted and stuck is a fault of the pair; a stage that is busy
(checkpointing) is an informational pause; a healthy pipeline raises nothing.
The real pipeline under the real probes: tests/e2e/test_shapes.py.
"""
import pytest

from ccld import wire as ev

from ccld.timeline.timeline import Timeline
from ccld.diagnose import Diagnoser
from ccld.diagnose.findings import format_line

from ccld_synth import T0, SynthJob

pytestmark = pytest.mark.unit

STEPS = 23


def healthy(world=4):
    job, tl = SynthJob(world=world), Timeline()
    job.announce(T0)
    t = job.pipeline(STEPS, T0 + 1)
    job.feed(tl, t + 0.01)
    return job, tl, t + 0.05


def hangs(tl, now):
    return Diagnoser(tl).find_hangs(now)


def test_the_pipeline_streams_are_paired_and_a_healthy_pipeline_raises_nothing():
    job, tl, t = healthy()
    p2p = tl.comms[job.comm].p2p
    for r in range(3):
        pairs = list(p2p.pairs(r, r + 1, r, r + 1))
        assert [s.seq for s, _ in pairs] == list(range(1, STEPS + 1))
        assert all(s.ended is not None and v.ended is not None for s, v in pairs)
    assert not p2p.open
    d = Diagnoser(tl)
    for now in (t, t + 6, t + 60):
        assert d.diagnose(now) == []


def stage_never_sends(stage=2):
    """Step 24: stage 2 received from stage 1 and never sends on; stage 3 waits in its recv. Without
    a loss all-reduce in between, stages 0 and 1 go on: step 25's 0 -> 1 transfer happens, then 1
    blocks in its send to 2 (gloo's send waits for the receiver's recv) and 0 in its step-26 send to 1.
    Nobody reaches a collective."""
    assert stage == 2
    job, tl, t = healthy()
    n = STEPS + 1
    at = job.transfer(0, 1, n, t + 0.005)
    at = job.transfer(1, 2, n, at + 0.005)
    job.post(3, "recv", 2, n, t)              # waits for stage 2, forever
    at = job.transfer(0, 1, n + 1, at + 0.005)
    job.post(1, "send", 2, n + 1, at + 0.005)  # 2 never posts its recv
    job.post(0, "send", 1, n + 2, at + 0.01)   # 1 never posts its recv
    job.state(stage, at + 0.5, "S", "hrtimer_nanosleep", cpu_ns=10 ** 9)
    job.feed(tl, at + 1)
    for i in range(2, 8):  # agents keep sending heartbeat frames
        job.feed(tl, at + i)
    return job, tl, at


def test_a_stage_that_never_sends_is_named_alone_with_the_chain():
    job, tl, at = stage_never_sends(2)
    assert hangs(tl, at + 4) == []  # under the 5 s floor
    (f,) = hangs(tl, at + 6.5)
    assert (f.kind, f.cls, f.ranks) == ("hang", "not-entered", [2]), format_line(f)
    (d,) = f.evidence["ranks"]
    assert d["doing"] == "sleeping" and "hrtimer_nanosleep" in d["doing_text"]
    p2p = f.evidence["p2p"]
    assert f.op in ("send", "recv") and p2p["peer"] == 2 and not p2p["peer_posted"]
    # every other rank waits on it, directly (3 in recv from 2, 1 in send to 2) or through rank 1
    others = {w["p2p"]["waiter"] for w in f.evidence.get("also_waiting", [])} | {p2p["waiter"]}
    assert others == {0, 1, 3}, f.evidence
    line = format_line(f)
    assert line.startswith("HANG not-entered ") and "[2] gloo:0 " in line and "rank 2 S" in line, line
    assert len(line) <= 100


def test_rank_0_waiting_through_rank_1_is_blamed_on_the_head():
    job, tl, at = stage_never_sends(2)
    from ccld.diagnose import p2phang
    got = {f.evidence["p2p"]["waiter"]: f for f in p2phang.check_all(tl, at + 6.5)}
    assert set(got) == {0, 1, 3}
    assert all(f.ranks == [2] for f in got.values())
    chain = got[0].evidence["blamed_through"]
    assert chain["missing"] == [1] and chain["chain"][0]["rank"] == 1 and chain["chain"][0]["waits_for"] == [2]


def test_the_waiting_ranks_in_the_loss_allreduce_blame_the_stage_too():
    """Ranks 0 and 1 reach the loss all-reduce of step 24; 3 waits in recv from 2, which sleeps: the
    all-reduce's missing ranks are 2 and 3, but 3 only waits for 2: one finding, naming 2."""
    job, tl, t = healthy()
    n, seq = STEPS + 1, STEPS + 1
    at = job.transfer(0, 1, n, t + 0.005)
    at = job.transfer(1, 2, n, at + 0.005)
    job.post(3, "recv", 2, n, t)
    for r in (0, 1):
        job.enter(r, seq, at + 0.01)
    job.state(2, at + 0.5, "S", "hrtimer_nanosleep", cpu_ns=10 ** 9)
    for i in range(1, 8):
        job.feed(tl, at + i)
    (f,) = hangs(tl, at + 6.5)
    assert (f.cls, f.ranks) == ("not-entered", [2]), format_line(f)
    comms = {f.comm} | {w["comm"] for w in f.evidence.get("also_waiting", [])}
    ops = {f.op} | {w["op"] for w in f.evidence.get("also_waiting", [])}
    assert comms == {job.comm} and ops == {"allreduce", "recv"}, f.evidence.get("also_waiting")


def test_both_sides_posted_and_stuck_is_a_fault_of_the_pair():
    job, tl, t = healthy()
    n = STEPS + 1
    job.post(1, "send", 2, n, t + 0.01)
    job.post(2, "recv", 1, n, t + 0.005)
    for i in range(1, 8):
        job.feed(tl, t + i)
    (f,) = [h for h in hangs(tl, t + 6.5) if h.cls == "fault"]
    assert (f.ranks, f.link, f.evidence["reason"]) == ([1, 2], [1, 2], "transfer-stuck"), f.evidence


def test_a_stage_checkpointing_is_a_pause_not_a_hang():
    job, tl, t = healthy()
    n = STEPS + 1
    job.post(1, "recv", 0, n, t + 0.001)          # stage 1 waits for stage 0, which checkpoints
    for i in range(1, 20):
        job.state(0, t + i, ("R", "D")[i % 2], "", cpu_ns=int(0.8 * i * 1e9))
        job.feed(tl, t + i)
    d = Diagnoser(tl)
    assert d.find_hangs(t + 10) == []
    (p,) = d.find_slow(t + 10)
    assert (p.cls, p.ranks, p.evidence["reason"], p.evidence["informational"]) == ("comp-slow", [0], "pause", True)


def test_an_isend_never_waited_for_does_not_hold_its_rank():
    """Rank 0 posts a send that it never waits on (an isend whose request it dropped) and goes on:
    later collectives complete. It is not blocked, and nothing is a hang."""
    job, tl, t = healthy()
    job.post(0, "send", 1, STEPS + 1, t)
    job.steps(STEPS + 1, 10, t + 0.1)
    for i in range(1, 8):
        job.feed(tl, t + 1 + i)
    assert hangs(tl, t + 8) == []


@pytest.mark.parametrize("shift", [3, 24, -17])
def test_a_stream_counted_from_attach_on_one_side_is_aligned_by_its_ends(shift):
    """Rank 2 was attached `shift` transfers after rank 1 (no CommInit from the group's creation): its
    recv n is rank 1's send n + shift. The stream pairs once the two sides show the offset: no recv
    ends before its send was posted, and the two sides end together (transfers 5 ms apart, each
    1 ms, the sides' ends 0.2 ms apart as across nodes)."""
    job, tl = SynthJob(), Timeline()
    job.announce(T0)
    t = T0 + 1
    for n in range(1, 81):
        s_at = t + 0.005 * n
        end = s_at + 0.001
        job.post(1, "send", 2, n + max(0, -shift), s_at)
        job.p2p_end(1, "send", 2, n + max(0, -shift), end)
        if n > shift:
            job.post(2, "recv", 1, n - shift + max(0, -shift), s_at - 0.002)
            job.p2p_end(2, "recv", 1, n - shift + max(0, -shift), end + 0.0002)
    job.feed(tl, t + 3)
    p2p = tl.comms[job.comm].p2p
    p2p.exact.discard(2)  # rank 2's numbering began at our attach
    assert p2p.offset(1, 2, 1, 2) == -shift
    pairs = list(p2p.pairs(1, 2, 1, 2))
    assert len(pairs) == 80 - max(0, shift) and all(abs(s.ended - r.ended) < 0.001 for s, r in pairs)


def test_a_killed_stage_is_the_fault_its_neighbours_failed_with():
    """Stage 1 is SIGKILLed while waiting in its recv from 0: stage 0's send to it and stage 2's recv
    from it fail (gloo lost the connections), the agent sees it exit. Its own open recv is no wait:
    the fault is rank 1, not a pause or a hang blamed on rank 0."""
    job, tl, t = healthy()
    n = STEPS + 1
    job.post(1, "recv", 0, n, t)
    job.post(2, "recv", 1, n, t)
    job.post(0, "send", 1, n, t + 0.01)
    job.exit(1, t + 0.2)
    job.p2p_end(0, "send", 1, n, t + 0.05, ok=False)
    job.p2p_end(2, "recv", 1, n, t + 0.06, ok=False)
    for i in range(1, 4):
        job.feed(tl, t + i)
    d = Diagnoser(tl)
    (f,) = d.find_hangs(t + 2.5)
    assert (f.cls, f.ranks, f.evidence["reason"]) == ("fault", [1], "exited"), f.evidence
    assert f.evidence["failed_ranks"] == [0, 2] and f.evidence["peers_failed_with"] == {"1": 2}
    assert d.find_slow(t + 2.5) == []


def test_a_stage_killed_then_the_rest_stopped_before_any_error_is_named():
    """torchrun stops the other stages ~0.1 s after stage 1 is SIGKILLed, before gloo fails any of their
    ops: no error, no threshold reached, every rank gone. Stage 1 is named from its exit while its
    neighbours' ops with it were open; a job stopped whole by its launcher is nobody's fault."""
    for killed in (True, False):
        job, tl, t = healthy()
        n = STEPS + 1
        job.post(1, "recv", 0, n, t)
        job.post(2, "recv", 1, n, t)
        job.post(0, "send", 1, n, t + 0.01)
        if killed:
            job.exit(1, t + 0.2, exact=True, signal=9)
        for r in ((0, 2, 3) if killed else range(4)):
            job.exit(r, t + 0.3, exact=True, signal=15, by_launcher=True)
        job.feed(tl, t + 0.4)
        found = Diagnoser(tl).find_hangs(t + 0.5)
        if killed:
            (f,) = found
            assert (f.cls, f.ranks, f.evidence["reason"], f.evidence["waiting"]) == ("fault", [1], "exited", [0, 2])
        else:
            assert found == []


@pytest.mark.parametrize("exact", [True, False])
def test_of_two_stages_gone_the_one_killed_first_is_the_fault(exact):
    """As on a real 4-stage pipeline: stage 1 is SIGKILLed; stage 0's send to it fails. Stage 2 is
    still sending to 3 (it outlived the fault) when torchrun stops it 0.1 s later; 3's recv from 2
    fails. Both dead, each named by one failed op: the one that died first is the fault, from
    the kernel's exit times, or (scan times too close to order) from stage 2's send after the fault."""
    job, tl, t = healthy()
    n = STEPS + 1
    job.post(1, "recv", 0, n, t)
    job.post(0, "send", 1, n, t + 0.01)
    job.post(3, "recv", 2, n, t)
    job.exit(1, t + 0.02, exact=exact)
    job.p2p_end(0, "send", 1, n, t + 0.03, ok=False)
    job.post(2, "send", 3, n, t + 0.04)  # stage 2 still at work after the fault
    job.exit(2, t + 0.12 if exact else t + 0.06, exact=exact)
    job.p2p_end(3, "recv", 2, n, t + 0.13, ok=False)
    for i in range(1, 4):
        job.feed(tl, t + i)
    (f,) = hangs(tl, t + 2.5)
    assert (f.cls, f.ranks, f.evidence["reason"]) == ("fault", [1], "exited"), f.evidence
    assert f.evidence["peers_failed_with"] == {"1": 1, "2": 1}
    assert f.evidence["outlived_fault"] == {"active_after_fault": [2]}


def test_of_two_stages_gone_without_a_sign_of_life_the_kernels_exit_times_order_them():
    job, tl, t = healthy()
    n = STEPS + 1
    job.post(1, "recv", 0, n, t)
    job.post(0, "send", 1, n, t + 0.01)
    job.post(2, "send", 3, n, t + 0.01)
    job.post(3, "recv", 2, n, t)
    job.exit(1, t + 0.02, exact=True)
    job.exit(2, t + 0.09, exact=True)  # within one /proc scan of the first: only the kernel's times tell
    job.p2p_end(0, "send", 1, n, t + 0.03, ok=False)
    job.p2p_end(3, "recv", 2, n, t + 0.10, ok=False)
    for i in range(1, 4):
        job.feed(tl, t + i)
    (f,) = hangs(tl, t + 2.5)
    assert f.ranks == [1] and f.evidence["outlived_fault"] == {"exited_later": [2], "exit_times": "kernel"}


def test_what_a_rank_waits_in_follows_a_communicator_that_appears_later():
    """waits.blocked asks only the communicators a rank is a member of (an index, kept per timeline):
    one created after the index was built, and the rank's ops on it, must be seen at once."""
    from ccld.diagnose import waits
    job, tl, t = healthy()
    assert waits.blocked(tl, job.job, 2) is None  # between steps: nothing open (the index is built here)
    pp = f"{job.job}/gloo:7"
    job._put(2, ev.CommInit(pid=job.pid[2], rank=2, ts_ns=job.ts(2, t), backend="gloo", comm=pp,
                            group_rank=0, group_size=2))
    job.post(2, "recv", 1, 1, t + 0.01, comm=pp)  # from group rank 1 (rank 3), which never sends
    job.feed(tl, t + 0.02)
    b = waits.blocked(tl, job.job, 2)
    assert b is not None and b.comm.id == pp and b.op is not None and b.op.op == "recv"
    assert [c.id for c in waits.comms_of(tl, job.job, 2)] == [job.comm, pp]
    assert [c.id for c in waits.comms_of(tl, job.job, 0)] == [job.comm]


def test_a_communicator_replaced_by_a_reset_is_the_one_asked():
    """A reset makes a new Comm object of the same size: the index must not keep answering the old one."""
    from ccld.diagnose import waits
    from ccld.timeline.records import Comm
    job, tl, t = healthy()
    old = waits.comms_of(tl, job.job, 2)[0]
    new = tl.comms[job.comm] = Comm(id=job.comm, backend="gloo", group_size=4, job=job.job, members=set(old.members))
    job.state(2, t + 0.01, "S")  # any event: the index is checked again after ingest
    job.feed(tl, t + 0.02)
    assert waits.comms_of(tl, job.job, 2) == [new] and new is not old
