"""An Accelerate training job with gradkit's watch on it: the one line is ``watch_accelerate``.

    torchrun --nproc-per-node 2 examples/watch/accelerate_job.py --sync-each-batch

``accelerator.accumulate(model)`` over GA micro-batches, AdamW, DDP on 2 ranks (CPU). ``--sync-each-batch``: the
plugin's ``sync_each_batch`` (Accelerate 0.28.0 - 0.30.1 step the optimizer on every micro-batch then: ACC).
``--deepspeed STAGE``: Accelerate's DeepSpeed plugin (the watch hands over to the engine's adapter).
"""
import argparse
import os
import sys

import torch
import torch.nn as nn
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin, GradientAccumulationPlugin

import gradkit

p = argparse.ArgumentParser()
p.add_argument("--sync-each-batch", action="store_true")
p.add_argument("--deepspeed", type=int, choices=(0, 1, 2, 3), help="Accelerate's DeepSpeed plugin, this ZeRO stage")
p.add_argument("--ga", type=int, default=4)
p.add_argument("--steps", type=int, default=2)
p.add_argument("--every", type=int, default=0, help="judge every this many steps after the first two")
p.add_argument("--out", default="gradkit-watch")
args = p.parse_args()

plugin = None if args.deepspeed is None else DeepSpeedPlugin(zero_stage=args.deepspeed, gradient_accumulation_steps=args.ga)
accelerator = Accelerator(cpu=plugin is None and not torch.cuda.is_available(), deepspeed_plugin=plugin,
                          gradient_accumulation_plugin=GradientAccumulationPlugin(
                              num_steps=args.ga, sync_each_batch=args.sync_each_batch))
if plugin is not None:  # no data loader goes through prepare(): DeepSpeed is told the batch sizes
    plugin.deepspeed_config.update(train_micro_batch_size_per_gpu=4,
                                   train_batch_size=4 * args.ga * torch.distributed.get_world_size())
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = accelerator.prepare(model, optimizer)
criterion = nn.MSELoss()
watch = gradkit.watch.watch_accelerate(accelerator, model, optimizer, criterion=criterion, out=args.out,
                                     every=args.every)  # <- gradkit's one line

# each rank its own data (under the DeepSpeed plugin on a CPU, Accelerate counts one process: the rank is torch's)
data = torch.Generator().manual_seed(100 + int(os.environ.get("RANK", accelerator.process_index)))
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
