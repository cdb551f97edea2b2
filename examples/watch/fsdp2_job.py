"""A torch FSDP2 training job with gradkit's watch on it: the one line is ``gradkit.watch.Watch(model, optimizer)``.

    torchrun --nproc-per-node 2 examples/watch/fsdp2_job.py [--loop sum]

``fully_shard`` on each layer and the root, AdamW, GA micro-batches per step with the gradient sync off until the
last (``set_requires_gradient_sync``); ``--loop sum``: the loss not divided by GA (a loop bug: the step is GA x too
large). The watch reads each ``DTensor`` gradient whole (``full_tensor()``) where the optimizer takes it.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

import gradkit

p = argparse.ArgumentParser()
p.add_argument("--loop", choices=("mean", "sum"), default="mean")
p.add_argument("--ga", type=int, default=4)
p.add_argument("--steps", type=int, default=2)
p.add_argument("--every", type=int, default=0, help="judge every this many steps after the first two")
p.add_argument("--out", default="gradkit-watch")
p.add_argument("--shard", choices=("auto", "on", "off"), default="auto",
               help="the watch's reference sharded over the ranks (auto: where the engine shards the model)")
args = p.parse_args()

dist.init_process_group()  # torch's default backends: nccl for CUDA tensors, gloo for CPU ones
device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)).to(device)
for layer in model:
    if isinstance(layer, nn.Linear):
        fully_shard(layer)
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
criterion = nn.MSELoss()
watch = gradkit.watch.Watch(model, optimizer, criterion=criterion, out=args.out, every=args.every,
                            shard={"on": True, "off": False}.get(args.shard))  # <- the line

data = torch.Generator().manual_seed(100 + dist.get_rank())
for step in range(args.steps):
    for i in range(args.ga):
        model.set_requires_gradient_sync(i == args.ga - 1)
        x, y = (torch.randn(4, k, generator=data).to(device) for k in (8, 4))
        loss = criterion(model(x), y)
        (loss if args.loop == "sum" else loss / args.ga).backward()
    optimizer.step()
    optimizer.zero_grad()
# Leave without the interpreter's tear-down (see examples/watch/deepspeed_job.py)
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
