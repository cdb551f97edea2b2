"""DeepSpeed, offload_optimizer cpu: a part the window's last micro-batch skips steps a stale gradient (ZeRO 1-3).

    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node=2 b7_repro.py   # GPUs: no DS_ACCELERATOR; STAGE=1..3
The fp32 gradient on the CPU is written per parameter by the boundary micro-batch's hooks and never cleared, and the
CPU accumulator is restarted only by micro-batch 0 (ZeRO-3: the reduced partition, never zeroed: B6, fixed first): a
part used by micro-batch m where m % 3 == 0 (GA 2) loses its window where the boundary skips it, adds its last window
where micro-batch 0 skips it, and steps its last gradient again in a window that skips it entirely. SGD, lr = 1. Exit status 1: a step applied something else than the fp32
gradient of the same global batch.
"""
import os
import sys

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import safe_get_full_fp32_param

GA, STEPS = 2, 6


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.part = torch.nn.Linear(16, 1)

    def forward(self, x, use_part):  # the part is in the graph of micro-batch m only where m % 3 == 0
        return self.trunk(x) + self.part(x) if use_part else self.trunk(x)


def data(r, step, i):  # rank r's micro-batch i of the step: x, y, whether it uses the part
    g = torch.Generator().manual_seed(1000 * step + 10 * i + r)
    return torch.randn(4, 16, generator=g), torch.randn(4, 1, generator=g), (step * GA + i) % 3 == 0


deepspeed.init_distributed()
rank, world, dev = dist.get_rank(), dist.get_world_size(), get_accelerator().current_device_name()
cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": GA, "gradient_clipping": 0.0,
       "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False, "zero_optimization": {
           "stage": int(os.environ.get("STAGE", "2")), "offload_optimizer": {"device": "cpu"}}}
model = Net()
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), config=cfg)
masters = lambda: [safe_get_full_fp32_param(p).detach().float().cpu().clone() for p in engine.module.parameters()]
bad = 0
for step in range(STEPS):
    before, ref = masters(), Net()
    for i in range(GA):  # DeepSpeed's own loop: backward and step per micro-batch, the engine steps at the boundary
        x, y, use = data(rank, step, i)
        engine.backward(0.1 * ((engine(x.to(dev), use) - y.to(dev)) ** 2).mean())
        engine.step()
    after = masters()
    for p, w in zip(ref.parameters(), before):
        p.data.copy_(w)
    loss = 0.1 * sum(((ref(x_, u) - y_) ** 2).mean() for r in range(world) for x_, y_, u in
               (data(r, step, i) for i in range(GA))) / (world * GA)
    grad = torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(ref.parameters()), materialize_grads=True)])
    update = torch.cat([(b - a).flatten() for b, a in zip(before, after)])
    ratio, cos = (update.norm() / grad.norm()).item(), torch.cosine_similarity(update, grad, dim=0).item()
    bad += (off := abs(ratio - 1) > 0.01 or cos < 0.999)
    if rank == 0:
        used = [i for i in range(GA) if (step * GA + i) % 3 == 0]
        print(f"step {step + 1}: part used by micro-batch {used or 'none'} of {GA}, applied / gradient {ratio:.4f}, "
              f"cosine {cos:.5f}{'  <- off' * off}", flush=True)
if rank == 0:
    print(f"{'REPRODUCED' if bad else 'not reproduced'}: {bad} of {STEPS} steps off (deepspeed {deepspeed.__version__})")
sys.exit(1 if bad else 0)
