"""A DeepSpeed training job with gradkit's watch on it: the one line is ``watch_engine``.

    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 examples/watch/deepspeed_job.py --stage 2 --loop manual
    torchrun --nproc-per-node 8 examples/watch/deepspeed_job.py --stage 2 --loop manual    # GPUs: the same file

``--loop engine``: DeepSpeed's own loop (``backward`` and ``step`` every micro-batch, GA in the config);
``--loop manual``: GA 1 in the config, GA ``backward`` calls, then one ``step`` (ZeRO-1/2 from 0.18.3 keep only
the last micro-batch there: B3; no release fixes it, 0.19.4 added the opt-out ``"managed_gradient_accumulation":
false``). AdamW and dropout, as a real job has them.
"""
import argparse
import os
import sys

import deepspeed
import torch
import torch.nn as nn

import gradkit

p = argparse.ArgumentParser()
p.add_argument("--stage", type=int, default=2)
p.add_argument("--loop", choices=("engine", "manual"), default="engine")
p.add_argument("--ga", type=int, default=4)
p.add_argument("--steps", type=int, default=3)
p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
p.add_argument("--model", choices=("mlp", "heads"), default="mlp",
               help="heads: a trunk and two heads; step 1 uses both, later steps only the first (ZeRO-3: B6)")
p.add_argument("--grad-accum-dtype", choices=("fp32", "bf16"), help="bf16 + ZeRO-0 + fp32 here: BF16_Optimizer")
p.add_argument("--offload", action="store_true",
               help="the optimizer's state and fp32 partitions offloaded to the CPU (ZeRO-1/2/3), a torch optimizer")
p.add_argument("--every", type=int, default=0, help="judge every this many steps after the first two")
p.add_argument("--out", default="gradkit-watch")
p.add_argument("--shard", choices=("auto", "on", "off"), default="auto",
               help="the watch's reference sharded over the ranks (auto: where the engine shards the model)")
args = p.parse_args()

deepspeed.init_distributed()  # the accelerator's backend: nccl on GPUs, gloo under DS_ACCELERATOR=cpu
rank = torch.distributed.get_rank()
torch.manual_seed(0)


class Heads(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 32), nn.Tanh())
        self.heads = nn.ModuleList([nn.Linear(32, 4), nn.Linear(32, 4)])

    def forward(self, x, head: int = 0):
        return self.heads[head](self.trunk(x))


model = Heads() if args.model == "heads" else nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.1),
                                                             nn.Linear(32, 4))
config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": args.ga if args.loop == "engine" else 1,
          "zero_optimization": {"stage": args.stage}, "gradient_clipping": 0.0,
          "bf16": {"enabled": args.dtype == "bf16"}}
if args.offload:  # a torch optimizer, not DeepSpeedCPUAdam (a C++ op to build)
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    config["zero_force_ds_cpu_optimizer"] = False
if args.grad_accum_dtype:
    config["data_types"] = {"grad_accum_dtype": args.grad_accum_dtype}
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                  config=config)
criterion = nn.MSELoss()
engine = gradkit.watch.watch_engine(engine, criterion=criterion, out=args.out,
                                    every=args.every, shard={"on": True, "off": False}.get(args.shard))  # <- the line

data = torch.Generator().manual_seed(100 + rank)
dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
for step in range(args.steps):
    for i in range(args.ga):
        n = 4
        x, y = (torch.randn(n, k, generator=data).to(engine.device, dtype) for k in (8, 4))
        kwargs = {"head": i % 2 if step == 0 else 0} if args.model == "heads" else {}
        loss = criterion(engine(x, **kwargs), y)
        if args.loop == "engine":
            engine.backward(loss)
            engine.step()
        else:
            engine.backward(loss / args.ga)
    if args.loop == "manual":
        engine.step()
# Leave without the interpreter's tear-down: on CPU its C++ destructors (gloo, DeepSpeed's comm op) abort a rank now
# and then after the work is done ("terminate called without an active exception"), as kit/launch/worker.py says.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
