"""DeepSpeed ZeRO-3: a parameter a step (or its first micro-batch) does not reach is stepped with a stale gradient.

    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node=2 b6_repro.py   # GPUs: no DS_ACCELERATOR
Nothing zeroes grad_partitions_flat_buffer: partition_grads copies into the slices of the parameters the first
micro-batch of a window reaches and adds after it. Expert `rare` (even steps only) steps its last gradient in odd
steps; `late` (micro-batches 3, 4 of 4) adds each window onto the last. SGD, lr = 1. Exit status 1: a step applied
something else than the fp32 gradient of the same global batch.
"""
import os
import sys

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import safe_get_full_fp32_param


class Net(torch.nn.Module):  # a trunk and two experts routed by step and micro-batch, the same on every rank
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.late, self.rare, self.out = (torch.nn.Linear(16, n) for n in (16, 16, 16, 1))

    def forward(self, x, step, i):
        h = torch.tanh(self.inp(x))
        h = h + self.late(h) if i >= 2 else h
        return self.out(h + self.rare(h) if step % 2 == 0 else h)


def batch(r, s, i):  # rank r's micro-batch i of step s
    g = torch.Generator().manual_seed(1000 * s + 10 * i + r)
    return torch.randn(4, 16, generator=g), torch.randn(4, 1, generator=g)


deepspeed.init_distributed()
rank, world, dev = dist.get_rank(), dist.get_world_size(), get_accelerator().current_device_name()
GA, model = 4, Net()
cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": GA, "gradient_clipping": 0.0,
       "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": int(os.environ.get("STAGE", "3"))}}
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), config=cfg)
loss_of = lambda m, x, y, s, i: 0.1 * ((m(x, s, i) - y) ** 2).mean()
masters = lambda: {n: safe_get_full_fp32_param(p).detach().float().cpu().clone()  # a collective under ZeRO-3
                   for n, p in engine.module.named_parameters()}
bad = 0
for step in range(6):
    before, ref = masters(), Net()
    for i in range(GA):
        x, y = batch(rank, step, i)
        engine.backward(loss_of(engine, x.to(dev), y.to(dev), step, i))
        engine.step()
    after = masters()
    ref.load_state_dict(before)
    loss = sum(loss_of(ref, *batch(r, step, i), step, i) for r in range(world) for i in range(GA))
    grads = torch.autograd.grad(loss / (world * GA), list(ref.parameters()), materialize_grads=True)
    g = {n: gr.flatten() for (n, _), gr in zip(ref.named_parameters(), grads)}
    u = {n: (before[n] - after[n]).flatten() for n in g}
    update, grad = torch.cat(list(u.values())), torch.cat(list(g.values()))
    ratio, cos = (update.norm() / grad.norm()).item(), torch.cosine_similarity(update, grad, dim=0).item()
    bad += (off := abs(ratio - 1) > 0.01 or cos < 0.999)
    if rank == 0:
        late = torch.cosine_similarity(u["late.weight"], g["late.weight"], dim=0)
        print(f"step {step + 1}: applied / gradient {ratio:.4f}, cosine {cos:.5f}; rare "
              f"{('unused', 'used')[step % 2 == 0]} |update| {u['rare.weight'].norm():.4f} (gradient "
              f"{g['rare.weight'].norm():.4f}), late cosine {late:.4f}{'  <- off' * off}", flush=True)
if rank == 0:
    print(f"{'REPRODUCED' if bad else 'not reproduced'}: {bad} of 6 steps off (deepspeed {deepspeed.__version__})")
sys.exit(1 if bad else 0)
