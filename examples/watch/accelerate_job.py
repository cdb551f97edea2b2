"""An Accelerate training job with gradkit's watch on it: the one line is ``watch_accelerate``.

    torchrun --nproc-per-node 2 examples/watch/accelerate_job.py --sync-each-batch

``accelerator.accumulate(model)`` over GA micro-batches, AdamW, DDP on 2 ranks (CPU). ``--sync-each-batch``: the
plugin's ``sync_each_batch`` (Accelerate 0.28.0 - 0.30.1 step the optimizer on every micro-batch then: ACC).
"""
import argparse
import os
import sys

import torch
import torch.nn as nn
from accelerate import Accelerator
from accelerate.utils import GradientAccumulationPlugin

import gradkit

p = argparse.ArgumentParser()
p.add_argument("--sync-each-batch", action="store_true")
p.add_argument("--ga", type=int, default=4)
p.add_argument("--steps", type=int, default=2)
p.add_argument("--every", type=int, default=0, help="judge every this many steps after the first two")
p.add_argument("--out", default="gradkit-watch")
args = p.parse_args()

accelerator = Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(
    num_steps=args.ga, sync_each_batch=args.sync_each_batch))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = accelerator.prepare(model, optimizer)
criterion = nn.MSELoss()
watch = gradkit.watch.watch_accelerate(accelerator, model, optimizer, criterion=criterion, out=args.out,
                                     every=args.every)  # <- gradkit's one line

data = torch.Generator().manual_seed(100 + accelerator.process_index)
for _ in range(args.steps * args.ga):
    x, y = torch.randn(4, 8, generator=data), torch.randn(4, 4, generator=data)
    with accelerator.accumulate(model):
        loss = criterion(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
# Leave without the interpreter's tear-down (see examples/watch/deepspeed_job.py)
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
