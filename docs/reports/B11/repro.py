"""DeepSpeed, offload_optimizer cpu, several backward() per step() at config GA 1: a step loses its first micro-batch
and applies the previous step's update again (ZeRO 1-2).

    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node=2 b11_repro.py   # GPUs: no DS_ACCELERATOR; STAGE=1..2
At GA 1 every backward is a boundary: the first one writes the fp32 gradient directly and skips the CPU accumulator,
which each later one adds to its own gradient; the accumulator still holds the previous step's sum and never received
micro-batch 0. SGD, lr = 1: the update is the gradient.
Exit status 1: a step applied something else than the fp32 gradient of the same global batch.
"""
import os
import sys

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import safe_get_full_fp32_param

deepspeed.init_distributed()
rank, world, dev = dist.get_rank(), dist.get_world_size(), get_accelerator().current_device_name()
N, STEPS = 4, 4  # backward() calls per step()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
       "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False, "zero_optimization": {
           "stage": int(os.environ.get("STAGE", "2")), "offload_optimizer": {"device": "cpu"}}}
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), config=cfg)


def data(r, step, i):
    g = torch.Generator().manual_seed(1000 * step + 10 * i + r)
    return torch.randn(4, 16, generator=g), torch.randn(4, 1, generator=g)


bad = 0
for step in range(STEPS):
    before = [safe_get_full_fp32_param(p).detach().float().cpu().clone() for p in engine.module.parameters()]
    for i in range(N):  # the user's own accumulation: N backward() calls, then one step()
        x, y = data(rank, step, i)
        engine.backward(0.1 * ((engine(x.to(dev)) - y.to(dev)) ** 2).mean() / N)
    engine.step()
    after = [safe_get_full_fp32_param(p).detach().float().cpu().clone() for p in engine.module.parameters()]
    ref = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    for p, w in zip(ref.parameters(), before):
        p.data.copy_(w)
    loss = 0.1 * sum(((ref(x_) - y_) ** 2).mean() for r in range(world) for x_, y_ in
                     (data(r, step, i) for i in range(N))) / (world * N)
    grad = torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(ref.parameters()))])
    update = torch.cat([(b - a).flatten() for b, a in zip(before, after)])
    ratio = (update.norm() / grad.norm()).item()
    cos = torch.nn.functional.cosine_similarity(update, grad, dim=0).item()
    off = abs(ratio - 1) > 0.01 or cos < 0.999
    bad += off
    if rank == 0:
        print(f"step {step + 1}: {N} backward() per step(), applied / gradient {ratio:.4f}, cosine {cos:.5f}"
              f"{'  <- off' if off else ''}", flush=True)
if rank == 0:
    print(f"{'REPRODUCED' if bad else 'not reproduced'}: {bad} of {STEPS} steps off (deepspeed {deepspeed.__version__})")
sys.exit(1 if bad else 0)
