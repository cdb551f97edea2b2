"""DeepSpeed, fp16 with a dynamic loss scale: the step on which the scale grows applies half the update (ZeRO 0-3).

    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node=2 b10_repro.py   # GPUs: no DS_ACCELERATOR; STAGE=0..3
step() raises the scale (_update_scale) before unscale_and_clip_grads divides the gradient by it; backward scaled
the gradient by the old scale, so that step applies old / new = 1/2 of it. SGD, lr = 1: the update is the gradient.
(ZeRO-0, FP16_UnfusedOptimizer: from 0.18.3 every step there is 1 / loss scale first, deepspeedai/DeepSpeed#8393.)
Exit status 1: a step applied something else than the fp32 gradient of the same global batch.
"""
import os
import sys

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import safe_get_full_fp32_param

acc = get_accelerator()
if acc.device_name() == "cpu":  # DeepSpeed's CPU accelerator declares fp16 only with fp16 kernels; torch has half
    acc.is_fp16_supported = lambda: True
deepspeed.init_distributed()
rank, world, dev = dist.get_rank(), dist.get_world_size(), acc.current_device_name()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).half()
cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
       "zero_allow_untested_optimizer": True,
       "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 2},
       "zero_optimization": {"stage": int(os.environ.get("STAGE", "2"))}}
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), config=cfg)


def data(r, step):
    g = torch.Generator().manual_seed(1000 * step + r)
    return torch.randn(4, 16, generator=g), torch.randn(4, 1, generator=g)


def masters():  # the fp32 weights the optimizer steps (a collective under ZeRO-3; ZeRO-0: FP16_UnfusedOptimizer's own)
    ws = [safe_get_full_fp32_param(p) for p in engine.module.parameters()] if cfg["zero_optimization"]["stage"] else \
        [p for group in engine.optimizer.fp32_groups for p in group]
    return [w.detach().float().cpu().clone() for w in ws]


bad = 0
for step in range(6):
    before, scale = masters(), engine.optimizer.loss_scale
    x, y = data(rank, step)
    engine.backward(0.1 * ((engine(x.half().to(dev)).float() - y.to(dev)) ** 2).mean())
    engine.step()
    after = masters()
    ref = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    for p, w in zip(ref.parameters(), before):
        p.data.copy_(w)
    loss = 0.1 * sum(((ref(x_) - y_) ** 2).mean() for x_, y_ in (data(r, step) for r in range(world))) / world
    grad = torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(ref.parameters()))])
    update = torch.cat([(b - a).flatten() for b, a in zip(before, after)])
    ratio = (update.norm() / grad.norm()).item()
    cos = torch.nn.functional.cosine_similarity(update, grad, dim=0).item()
    off = abs(ratio - 1) > 0.01 or cos < 0.999
    bad += off
    if rank == 0:
        print(f"step {step + 1}: loss scale {scale:g} -> {engine.optimizer.loss_scale:g}, applied / gradient "
              f"{ratio:.4f}, cosine {cos:.5f}{'  <- off' if off else ''}", flush=True)
if rank == 0:
    print(f"{'REPRODUCED' if bad else 'not reproduced'}: {bad} of 6 steps off (deepspeed {deepspeed.__version__})")
sys.exit(1 if bad else 0)
