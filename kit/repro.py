"""A standalone reproduction of one swept configuration: plain DeepSpeed + torch, no kit import, ready to file.

    path = repro.write(record, folder / "repro_<group>.py", title)   # the record of one affected point
    rc, output = repro.verify(path, world_size=2, stack={})             # rc 1: it reproduces

The script builds its own tiny MLP and data, runs the point's loop style with the point's config (SGD,
lr = 1, so the update is the gradient), computes the fp32 reference of the same global batch on rank 0,
prints the ratio / cosine / relative error and exits 1 when the step is off the reference.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kit import config as kconfig
from kit import launch, oracle
from kit import versions as kversions

TEMPLATE = '''"""{title}

Written by gradkit's sweep on {date}; needs only torch and deepspeed ({deepspeed} here).
    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node={world_size} {name}    # on GPUs: drop DS_ACCELERATOR
Exit status 1: the step DeepSpeed applied is off the fp32 reference of the same global batch (reproduced).
"""
import copy, json, os, sys
import torch, torch.distributed as dist, deepspeed
from deepspeed.utils import safe_get_full_fp32_param

CONFIG = json.loads({config!r})
LOOP, N, MB, H, SEED, TOL = {loop!r}, {n}, {mb}, 32, 0, {tol}  # loop style, micro-batches per step, tolerance

def batches(rank):  # N micro-batches of MB samples for one rank, the same on every run
    g = torch.Generator().manual_seed(1000 + rank)
    x, y = torch.randn(N * MB, H, generator=g), torch.randn(N * MB, H, generator=g)
    return [(x[i * MB:(i + 1) * MB], y[i * MB:(i + 1) * MB]) for i in range(N)]

def flat(engine):  # the fp32 master of every parameter (a collective under ZeRO-3)
    return torch.cat([(safe_get_full_fp32_param(p) if safe_get_full_fp32_param(p) is not None else p).detach()
                      .double().reshape(-1).cpu() for p in engine.module.parameters()])

cpu = os.environ.get("DS_ACCELERATOR") == "cpu"
deepspeed.init_distributed(dist_backend="gloo" if cpu else "nccl")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(SEED)
model = torch.nn.Sequential(torch.nn.Linear(H, H), torch.nn.GELU(), torch.nn.Linear(H, H))
dtype = torch.bfloat16 if CONFIG.get("bf16", {{}}).get("enabled") else torch.float32
model = model.to(dtype)
start = copy.deepcopy(model).double()
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), config=CONFIG)
mse = lambda out, y: ((out.float() - y) ** 2).mean()
before = flat(engine)
for i, (x, y) in enumerate(batches(rank)):
    x, y = x.to(engine.device, dtype), y.to(engine.device)
    if LOOP == "engine":  # DeepSpeed's own loop: config GA = N, backward + step per micro-batch
        engine.backward(mse(engine(x), y)); engine.step(); continue
    if LOOP == "boundary":  # config GA = N, the boundary marked, one step
        engine.set_gradient_accumulation_boundary(is_boundary=(i == N - 1))
        engine.backward(mse(engine(x), y))
    else:  # manual: config GA = 1, N backward(loss / N), one step
        engine.backward(mse(engine(x), y) / N)
if LOOP != "engine":
    engine.step()
effective = before - flat(engine)
if rank == 0:
    every = [b for r in range(world) for b in batches(r)]  # the global batch, in fp32, in one process
    loss = sum(((start(x.double()) - y.double()) ** 2).mean() for x, y in every) / len(every)
    loss.backward()
    reference = torch.cat([p.grad.reshape(-1) for p in start.parameters()])
    ratio, rel = effective.norm().item() / reference.norm().item(), ((effective - reference).norm() / reference.norm()).item()
    cos = torch.nn.functional.cosine_similarity(effective, reference, dim=0).item()
    off = rel > TOL
    print(json.dumps({{"deepspeed": deepspeed.__version__, "loop": LOOP, "N": N, "world": world, "ratio": ratio,
                      "cosine": cos, "rel_error": rel, "reproduced": off}}))
    print("REPRODUCED: the applied step is off the reference" if off else "not reproduced: the step matches")
    sys.exit(1 if off else 0)
'''


def write(rec: dict, path, title: str) -> Path:
    """The reproduction script of one affected record (its resolved DeepSpeed config and loop style)."""
    import datetime

    case = rec["config"]
    cfg = dict(case["ds_config"])
    path = Path(path)
    path.write_text(TEMPLATE.format(
        title=title, date=datetime.date.today().isoformat(), deepspeed=(rec.get("versions") or {}).get("deepspeed"),
        world_size=rec["world_size"], name=path.name, config=json.dumps(cfg, sort_keys=True),
        loop=case["loop"], n=case["ga"], mb=cfg["train_micro_batch_size_per_gpu"],
        tol=oracle.tolerance(case["dtype"]).rel_l2))
    return path


def reproduced(rc: int, output: str) -> bool:
    """Did the script reproduce? Only by its own judgement: its printed verdict line says so (and its exit status
    agrees). A script that crashed, or printed nothing judged, did not reproduce anything, whatever its exit code."""
    said = [json.loads(line) for line in output.splitlines() if line.startswith('{"deepspeed"')]
    return len(said) == 1 and said[0].get("reproduced") is True and rc == 1


def verify(path, world_size: int = 2, stack: dict | None = None, device: str = "cpu", timeout_s: float = 300):
    """Run the script as a user would (torchrun, W ranks); ``(exit status, output)``. 1 means reproduced."""
    resolved = kversions.resolve_stack(stack or {}, ("deepspeed",))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(resolved.pythonpath), OMP_NUM_THREADS="1",
               TORCH_EXTENSIONS_DIR=str(kconfig.cache_dir() / "torch_extensions" / resolved.extensions_key))
    if device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world_size}", str(path)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=str(Path(path).parent),
                             preexec_fn=launch.die_with_parent)
    except subprocess.TimeoutExpired as e:
        return 124, f"timed out after {timeout_s:g} s: {(e.stdout or b'')[-2000:]!r}"
    text = "\n".join(line for line in (out.stdout + out.stderr).splitlines()
                     if "REPRODUCED" in line or "reproduced" in line or line.startswith("{\"deepspeed\""))
    return out.returncode, text or (out.stdout + out.stderr)[-2000:]
