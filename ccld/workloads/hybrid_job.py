"""A 3-D parallel CPU training-like job over gloo: tensor x pipeline x data parallel (default 2 x 2 x 2,
8 ranks), with three kinds of process groups.

Rank layout (Megatron's order: tensor-parallel index fastest, then data, then pipeline):
  rank = stage * (dp * tp) + d * tp + t
  with 2 x 2 x 2:  stage 0: d0 = ranks 0,1   d1 = ranks 2,3     stage 1: d0 = ranks 4,5   d1 = ranks 6,7
  tp groups (same stage and d):   {0,1} {2,3} {4,5} {6,7}
  dp groups (same stage and t):   {0,2} {1,3} {4,6} {5,7}
  pp groups (same d and t):       {0,4} {1,5} {2,6} {3,7}
Each step runs --microbatches M GPipe-style through the --pp stages: per micro-batch forward, each of
the stage's --layers layers computes --compute-ms and all_reduces its activations in the tp group
(row-parallel layers); the stage then sends its activations to the next stage with a blocking send
on its pp group (the next stage receives first). The backward mirrors it (2 x compute, a tp
all_reduce per layer, gradients sent to the previous stage). At the end of the step, one gradient
all_reduce in the dp group. Per rank per step: 2 * layers * M all_reduce@tp; M send@pp and M
recv@pp per neighbouring stage (an end stage has one neighbour); 1 all_reduce@dp.
Faults (see jobkit.py for the lines they print): --hang-rank sleeps before its first collective of
the step; --slow-ms spreads over the micro-batch forwards; --wrong-op-rank R --wrong-op-step K
--wrong-op-group tp|dp makes rank R call all_gather in that group, instead of its first tp
all_reduce of the step or of the dp all_reduce, while the other groups carry on; --batch-change-*
scales compute and activations (tp all_reduce, p2p), not the dp gradients; the common --io-*,
--loader-*, --ckpt-*, --pause-*. Light on purpose: 8 ranks share 2 cores here.
"""
import argparse
import sys

if __package__:
    from . import jobkit
else:
    import jobkit

import torch
import torch.distributed as dist

BACKWARD_COST = 2  # a backward computes twice a forward's time


class Hybrid:
    def __init__(self, job, a):
        self.job, self.a = job, a
        tp, dp, pp = a.tp, a.dp, a.pp
        self.stage, rest = divmod(job.rank, dp * tp)
        self.d, self.t = divmod(rest, tp)

        def rank(s, d, t):
            return s * dp * tp + d * tp + t
        # Every rank takes part in every new_group call, in the same order.
        self.tp_group = self._mine([[rank(s, d, t) for t in range(tp)] for s in range(pp) for d in range(dp)])
        self.dp_group = self._mine([[rank(s, d, t) for d in range(dp)] for s in range(pp) for t in range(tp)])
        self.pp_group = self._mine([[rank(s, d, t) for s in range(pp)] for d in range(dp) for t in range(tp)])
        self.prev = rank(self.stage - 1, self.d, self.t) if self.stage > 0 else None
        self.next = rank(self.stage + 1, self.d, self.t) if self.stage < pp - 1 else None

    def _mine(self, groups):
        mine = None
        for ranks in groups:
            g = dist.new_group(ranks)
            if self.job.rank in ranks:
                mine = (g, len(ranks))
        return mine

    def tp_all_reduce(self, t, step: int, first: bool) -> None:
        job = self.job
        group, size = self.tp_group
        if first and job.wrong_op(step, "tp", "all_reduce"):
            dist.all_gather([torch.empty_like(t) for _ in range(size)], t, group=group)
            job.ops.add("all_gather", "tp")
            return
        dist.all_reduce(t, group=group)
        job.ops.add("all_reduce", "tp")

    def step(self, step: int) -> None:
        job, a = self.job, self.a
        job.hang_point(step, "before its first collective")
        elems = job.elems(step)
        extra_ms = job.slow_ms(step) / a.microbatches
        pp_group = self.pp_group[0]
        first = True
        for _ in range(a.microbatches):
            act = torch.ones(elems)
            if self.prev is not None:
                dist.recv(act, self.prev, group=pp_group)
                job.ops.add("recv", "pp")
            for _ in range(a.layers):
                job.spin(a.compute_ms, step)
                job.compute.spin(extra_ms / a.layers)
                self.tp_all_reduce(act.clamp_(-1, 1), step, first)
                first = False
            if self.next is not None:
                dist.send(act, self.next, group=pp_group)
                job.ops.add("send", "pp")
        for _ in range(a.microbatches):
            grad = torch.ones(elems)
            if self.next is not None:
                dist.recv(grad, self.next, group=pp_group)
                job.ops.add("recv", "pp")
            for _ in range(a.layers):
                job.spin(BACKWARD_COST * a.compute_ms, step)
                self.tp_all_reduce(grad.clamp_(-1, 1), step, False)
            if self.prev is not None:
                dist.send(grad, self.prev, group=pp_group)
                job.ops.add("send", "pp")
        group, size = self.dp_group
        grads = torch.ones(a.elems)
        if job.wrong_op(step, "dp", "all_reduce"):
            dist.all_gather([torch.empty_like(grads) for _ in range(size)], grads, group=group)
            job.ops.add("all_gather", "dp")
        else:
            dist.all_reduce(grads, group=group)
            job.ops.add("all_reduce", "dp")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    jobkit.add_common_flags(ap)
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks per stage replica")
    ap.add_argument("--pp", type=int, default=2, help="pipeline stages")
    ap.add_argument("--dp", type=int, default=2, help="data-parallel replicas")
    ap.add_argument("--layers", type=int, default=2, help="layers per stage (a tp all_reduce each)")
    ap.add_argument("--microbatches", type=int, default=2)
    ap.set_defaults(compute_ms=1.0)
    a = ap.parse_args()
    jobkit.check_common_flags(ap, a, ("tp", "dp"))
    if min(a.tp, a.pp, a.dp, a.layers, a.microbatches) < 1:
        ap.error("--tp, --pp, --dp, --layers and --microbatches must be >= 1")
    job = jobkit.Job(a)
    job.check_world(a.tp * a.pp * a.dp, f"--tp {a.tp} x --pp {a.pp} x --dp {a.dp}")
    model = Hybrid(job, a)
    job.ready()
    return job.run(model.step)


if __name__ == "__main__":
    sys.exit(main())
