"""DeepSpeed, fp16 at ZeRO-0 with a torch optimizer (FP16_UnfusedOptimizer): every update is 1 / loss_scale of the right one.

    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node=2 b9_repro.py   # GPUs: no DS_ACCELERATOR; STAGE=0
From 0.18.3 (deepspeedai/DeepSpeed#7665) engine.backward scales the loss for a ZeRO optimizer only, while
FP16_UnfusedOptimizer.step still divides the gradient by its loss scale (static 256 here). SGD, lr = 1: the update
is the gradient. Exit status 1: a step applied something else than the fp32 gradient of the same global batch.
"""
import os
import sys

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

acc = get_accelerator()
if acc.device_name() == "cpu":  # DeepSpeed's CPU accelerator declares fp16 only with fp16 kernels; torch has half
    acc.is_fp16_supported = lambda: True
deepspeed.init_distributed()
rank, world, dev = dist.get_rank(), dist.get_world_size(), acc.current_device_name()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).half()
GA = 2
cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": GA, "gradient_clipping": 0.0,
       "fp16": {"enabled": True, "loss_scale": 256}, "zero_optimization": {"stage": int(os.environ.get("STAGE", "0"))}}
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), config=cfg)


def data(r, step, micro):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + r)
    return torch.randn(4, 16, generator=g), torch.randn(4, 1, generator=g)


def masters():  # the fp32 weights FP16_UnfusedOptimizer steps (safe_get_full_fp32_param knows ZeRO-1/2/3 and bf16 only)
    return [p.detach().float().cpu().clone() for group in engine.optimizer.fp32_groups for p in group]


bad = 0
for step in range(4):
    before = masters()
    for micro in range(GA):
        x, y = data(rank, step, micro)
        engine.backward(0.1 * ((engine(x.half().to(dev)).float() - y.to(dev)) ** 2).mean())
        engine.step()
    after = masters()
    ref = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    for p, w in zip(ref.parameters(), before):
        p.data.copy_(w)
    batches = [data(r, step, m) for r in range(world) for m in range(GA)]
    loss = 0.1 * sum(((ref(x_) - y_) ** 2).mean() for x_, y_ in batches) / len(batches)
    grad = torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(ref.parameters()))])
    update = torch.cat([(b - a).flatten() for b, a in zip(before, after)])
    ratio = (update.norm() / grad.norm()).item()
    cos = torch.nn.functional.cosine_similarity(update, grad, dim=0).item()
    off = abs(ratio - 1) > 0.01 or cos < 0.999
    bad += off
    if rank == 0:
        print(f"step {step + 1}: {type(engine.optimizer).__name__}, loss scale {engine.optimizer.loss_scale:g}, "
              f"applied / gradient {ratio:.4f}, cosine {cos:.5f}{'  <- off' if off else ''}", flush=True)
if rank == 0:
    print(f"{'REPRODUCED' if bad else 'not reproduced'}: {bad} of 4 steps off (deepspeed {deepspeed.__version__})")
sys.exit(1 if bad else 0)
