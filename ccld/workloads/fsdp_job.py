"""An FSDP-style CPU training-like job over gloo: every rank holds a 1/world shard of each layer.

Each step, for --layers L layers with --elems floats of parameters per rank per layer:
  forward   per layer: all_gather_into_tensor of the parameter shards, then --compute-ms of compute
  backward  per layer, last first: all_gather_into_tensor again (parameters are resharded after the
            forward, as FSDP does by default), 2 x --compute-ms, reduce_scatter_tensor of the gradients
  optimizer each rank updates its own shards (no communication)
So 2L all_gather_into_tensor and L reduce_scatter_tensor per step, all on the default group.
--torch-fsdp runs torch's own FSDP2 instead (torch.distributed.fsdp.fully_shard on a CPU device mesh,
an nn.Sequential of L Linear layers, each fully_shard'ed, SGD): it runs on CPU + gloo in torch 2.13.
What it calls is torch's business (2.13, 3 layers: 2 all_gather_single per layer and 1
reduce_scatter_single per layer per step, on the default group), so its done line counts steps
("fsdp_step"). The older FullyShardedDataParallel wrapper does not run on CPU in torch 2.13:
"RuntimeError: FSDP needs a non-CPU accelerator device, but no accelerator device is detected."
Faults (see jobkit.py for the lines they print): --hang-rank sleeps before the step's first
collective; --slow-ms spreads over the L forwards; --wrong-op-rank R --wrong-op-step K makes rank R
call all_reduce instead of the forward all_gather of layer --wrong-op-layer (not with --torch-fsdp);
--batch-change-* scales compute (and --torch-fsdp's input batch), not the parameters; the common
--io-*, --loader-*, --ckpt-*, --pause-*.
"""
import argparse
import sys
import warnings

if __package__:
    from . import jobkit
else:
    import jobkit

import torch
import torch.distributed as dist

BACKWARD_COST = 2      # a backward computes twice a forward's time
LR = 0.01              # the optimizer-ish step's learning rate
TORCH_FSDP_DIM = 64    # --torch-fsdp: Linear(64, 64) layers (4160 parameters each)
TORCH_FSDP_BATCH = 8   # --torch-fsdp: input rows per step (times --batch-factor after the change)

# torch 2.13 renamed these two (all_gather_single, reduce_scatter_single) and warns once per call site;
# the old names are what most FSDP-style code calls, and the same c10d operation underneath.
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` "
                        r"is deprecated", category=FutureWarning)


class ShardedLayers:
    """Hand-written FSDP: parameter and gradient shards, gathered and scattered per layer."""

    def __init__(self, job, a):
        self.job, self.a = job, a
        self.shards = [torch.randn(a.elems) for _ in range(a.layers)]
        self.grads = [torch.zeros(a.elems) for _ in range(a.layers)]
        self.full = torch.empty(a.elems * job.world)

    def gather(self, layer: int, step: int, forward: bool) -> None:
        job = self.job
        if forward and layer == self.a.wrong_op_layer and job.wrong_op(step, "default", "all_gather_into_tensor",
                                                                       calls="all_reduce"):
            dist.all_reduce(self.shards[layer])
            job.ops.add("all_reduce")
            return
        dist.all_gather_into_tensor(self.full, self.shards[layer])
        job.ops.add("all_gather_into_tensor")

    def step(self, step: int) -> None:
        job, a = self.job, self.a
        job.hang_point(step, "before its first collective")
        extra_ms = job.slow_ms(step) / a.layers
        for layer in range(a.layers):
            self.gather(layer, step, forward=True)
            job.spin(a.compute_ms, step)
            job.compute.spin(extra_ms)
        for layer in reversed(range(a.layers)):
            self.gather(layer, step, forward=False)
            job.spin(BACKWARD_COST * a.compute_ms, step)
            full_grad = torch.ones(a.elems * job.world)
            dist.reduce_scatter_tensor(self.grads[layer], full_grad)
            job.ops.add("reduce_scatter_tensor")
        for shard, grad in zip(self.shards, self.grads):
            shard.add_(grad, alpha=-LR).clamp_(-1, 1)


class TorchFsdp:
    """torch's FSDP2 (fully_shard) on a CPU mesh; compute-ms spins inside each layer's forward."""

    def __init__(self, job, a):
        from torch import nn
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        self.job, self.a = job, a
        self.slow = 0.0

        class Layer(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(TORCH_FSDP_DIM, TORCH_FSDP_DIM)

            def forward(inner, x):
                job.spin(a.compute_ms, self.current)
                job.compute.spin(self.slow)
                return torch.relu(inner.lin(x))

        torch.manual_seed(0)
        self.current = 0
        self.model = nn.Sequential(*[Layer() for _ in range(a.layers)])
        mesh = init_device_mesh("cpu", (job.world,))
        for layer in self.model:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR)

    def step(self, step: int) -> None:
        job, a = self.job, self.a
        job.hang_point(step, "before its first collective")
        self.current = step
        self.slow = job.slow_ms(step) / a.layers
        rows = max(1, round(TORCH_FSDP_BATCH * job.scale(step)))
        loss = self.model(torch.randn(rows, TORCH_FSDP_DIM)).sum()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        job.ops.add("fsdp_step")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    jobkit.add_common_flags(ap)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--torch-fsdp", action="store_true", help="torch's FSDP2 (fully_shard) instead")
    ap.add_argument("--wrong-op-layer", type=int, default=0, help="the layer whose forward all_gather "
                                                                  "--wrong-op-rank replaces")
    ap.set_defaults(compute_ms=1.0)
    a = ap.parse_args()
    jobkit.check_common_flags(ap, a, ("default",))
    if a.layers < 1 or not 0 <= a.wrong_op_layer < a.layers:
        ap.error("--layers must be >= 1 and --wrong-op-layer one of them")
    if a.torch_fsdp and a.wrong_op_rank >= 0:
        ap.error("--wrong-op-rank needs the hand-written layers (torch's FSDP makes its own calls)")
    job = jobkit.Job(a)
    job.check_world()
    model = TorchFsdp(job, a) if a.torch_fsdp else ShardedLayers(job, a)
    job.ready()
    return job.run(model.step)


if __name__ == "__main__":
    sys.exit(main())
