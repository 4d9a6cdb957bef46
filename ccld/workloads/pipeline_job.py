"""A pipeline-parallel CPU training-like job over gloo: world = --stages x --dp ranks.

Layout (Megatron's order, data-parallel index fastest): rank = stage * dp + d. Pipeline d is ranks
[s * dp + d for each stage s]; stage s's data-parallel group is ranks [s * dp + d for each d].
Each step runs --microbatches M through the stages: a forward sends activations stage s -> s+1, a
backward sends gradients s+1 -> s, in the order of --schedule:
  gpipe  all M forwards, then all M backwards
  1f1b   warm-up forwards (S - s - 1 on stage s, at most M), then one forward one backward, then the
         cool-down backwards. In the steady phase stage s receives the backward of micro-batch j
         before it sends the forward of j + warm-up (Megatron's send_forward_recv_backward): with
         blocking p2p, a send completes only once the peer receives, and the other order deadlocks
         neighbours (s sends a forward while s+1 sends it a backward).
--p2p blocking uses dist.send/recv; batch posts the consecutive p2p ops of a stage (those with no
compute between them) as one dist.batch_isend_irecv and waits on every request. --pp-group default
runs p2p on the default group; own on one dist.new_group per pipeline. Then, each step: with
--dp > 1 a gradient all_reduce in each stage's data-parallel group, and (unless --no-loss-allreduce)
a loss all_reduce over the default group.
Compute: --compute-ms per micro-batch forward, twice that per backward (jobkit's spin).
Faults (see jobkit.py for every line they print):
  --hang-rank R --hang-step K   rank R sleeps forever where it would next send in step K (a stage
                                that never sends: its neighbours block in recv, and the upstream
                                stage may block in its blocking send)
  --slow-rank R --slow-ms M     rank R computes M ms more per step, M / microbatches per forward
  --wrong-op-rank R --wrong-op-step K   rank R calls all_gather instead of the loss all_reduce
  and the common --io-*, --loader-*, --ckpt-*, --pause-*, --batch-change-* (activations and compute
  scale; the gradient and the loss keep their size, as when a user changes the batch size)
Prints "rank R done: N steps, ops {...}" at the end: send/recv (or send@pp/recv@pp with --pp-group
own), all_reduce (loss), all_reduce@dp (gradients).
"""
import argparse
import sys

if __package__:
    from . import jobkit
else:
    import jobkit

import torch
import torch.distributed as dist

FORWARD, BACKWARD = "F", "B"
SEND, RECV = "send", "recv"
LOSS_ELEMS = 1      # the loss all_reduce: one float per step
BACKWARD_COST = 2   # a backward computes twice a forward's time


def schedule(stage: int, stages: int, microbatches: int, kind: str):
    """The ordered actions of one stage for one step: ("compute", F|B, mb) and (send|recv, F|B, mb).
    A forward's activation goes s -> s+1, a backward's gradient s+1 -> s; a stage does only the p2p
    that has a peer. The same order on every stage cannot deadlock with rendezvous send/recv
    (tests/e2e/test_workloads.py simulates every small shape)."""
    first, last = stage == 0, stage == stages - 1
    out = []

    def fwd(i, recv_bwd_before_send=None):
        if not first:
            out.append((RECV, FORWARD, i))
        out.append(("compute", FORWARD, i))
        if recv_bwd_before_send is not None and not last:
            out.append((RECV, BACKWARD, recv_bwd_before_send))
        if not last:
            out.append((SEND, FORWARD, i))

    def bwd(j, received=False):
        if not last and not received:
            out.append((RECV, BACKWARD, j))
        out.append(("compute", BACKWARD, j))
        if not first:
            out.append((SEND, BACKWARD, j))

    if kind == "gpipe":
        for i in range(microbatches):
            fwd(i)
        for j in range(microbatches):
            bwd(j)
    elif kind == "1f1b":
        warm = min(stages - stage - 1, microbatches)
        for i in range(warm):
            fwd(i)
        for j in range(microbatches - warm):
            fwd(warm + j, recv_bwd_before_send=j)
            bwd(j, received=True)
        for j in range(microbatches - warm, microbatches):
            bwd(j)
    else:
        raise ValueError(f"unknown schedule {kind!r}")
    return out


def batches(actions):
    """Group consecutive p2p actions (no compute between them) for --p2p batch."""
    out, run = [], []
    for act in actions:
        if act[0] == "compute":
            if run:
                out.append(run)
                run = []
            out.append([act])
        else:
            run.append(act)
    if run:
        out.append(run)
    return out


class Pipeline:
    def __init__(self, job, a):
        self.job, self.a = job, a
        rank = job.rank
        self.stage, self.d = divmod(rank, a.dp)
        self.stages = a.stages
        # Every rank takes part in every new_group call, in the same order.
        pipes = [[s * a.dp + d for s in range(a.stages)] for d in range(a.dp)]
        self.pp_group, self.pp_name = None, ""
        if a.pp_group == "own":
            groups = [dist.new_group(p) for p in pipes]
            self.pp_group, self.pp_name = groups[self.d], "pp"
        self.dp_group = None
        if a.dp > 1:
            groups = [dist.new_group([s * a.dp + d for d in range(a.dp)]) for s in range(a.stages)]
            self.dp_group = groups[self.stage]
        self.plan = schedule(self.stage, a.stages, a.microbatches, a.schedule)
        self.units = batches(self.plan) if a.p2p == "batch" else [[act] for act in self.plan]

    def peer(self, op: str, phase: str) -> int:
        """The global rank on the other end of a p2p action of this stage."""
        up = (op == SEND) == (phase == FORWARD)  # forward sends and backward receives go up a stage
        return (self.stage + (1 if up else -1)) * self.a.dp + self.d

    def step(self, step: int) -> None:
        job, a = self.job, self.a
        elems = job.elems(step)
        extra_ms = job.slow_ms(step) / a.microbatches
        sent = False
        for unit in self.units:
            if unit[0][0] == "compute":
                _, phase, _ = unit[0]
                if phase == FORWARD:
                    job.spin(a.compute_ms, step)
                    job.compute.spin(extra_ms)
                else:
                    job.spin(BACKWARD_COST * a.compute_ms, step)
                continue
            sends = [act for act in unit if act[0] == SEND]
            if sends and not sent:
                sent = True
                job.hang_point(step, f"before send to rank {self.peer(SEND, sends[0][1])}")
            bufs = [torch.ones(elems) if op == SEND else torch.empty(elems) for op, _, _ in unit]
            if a.p2p == "batch":
                p2p = [dist.P2POp(dist.isend if op == SEND else dist.irecv, buf, self.peer(op, phase),
                                  group=self.pp_group) for (op, phase, _), buf in zip(unit, bufs)]
                for req in dist.batch_isend_irecv(p2p):
                    req.wait()
            else:
                for (op, phase, _), buf in zip(unit, bufs):
                    if op == SEND:
                        dist.send(buf, self.peer(op, phase), group=self.pp_group)
                    else:
                        dist.recv(buf, self.peer(op, phase), group=self.pp_group)
            for op, _, _ in unit:
                job.ops.add(op, self.pp_name)
        if self.dp_group is not None:
            dist.all_reduce(torch.ones(a.elems), group=self.dp_group)
            job.ops.add("all_reduce", "dp")
        if a.loss_allreduce:
            loss = torch.ones(LOSS_ELEMS)
            if job.wrong_op(step, "default", "all_reduce"):
                dist.all_gather([torch.empty(LOSS_ELEMS) for _ in range(job.world)], loss)
                job.ops.add("all_gather")
            else:
                dist.all_reduce(loss)
                job.ops.add("all_reduce")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    jobkit.add_common_flags(ap)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--dp", type=int, default=1, help="data-parallel replicas of the pipeline")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--schedule", choices=("gpipe", "1f1b"), default="gpipe")
    ap.add_argument("--p2p", choices=("blocking", "batch"), default="blocking")
    ap.add_argument("--pp-group", choices=("default", "own"), default="default")
    ap.add_argument("--no-loss-allreduce", dest="loss_allreduce", action="store_false")
    ap.set_defaults(compute_ms=1.0)
    a = ap.parse_args()
    jobkit.check_common_flags(ap, a, ("default",))
    if a.stages < 2 or a.dp < 1 or a.microbatches < 1:
        ap.error("--stages must be >= 2, --dp and --microbatches >= 1")
    if a.wrong_op_rank >= 0 and not a.loss_allreduce:
        ap.error("--wrong-op-rank replaces the loss all_reduce: not with --no-loss-allreduce")
    job = jobkit.Job(a)
    job.check_world(a.stages * a.dp, f"--stages {a.stages} x --dp {a.dp}")
    pipe = Pipeline(job, a)
    job.ready()
    return job.run(pipe.step)


if __name__ == "__main__":
    sys.exit(main())
