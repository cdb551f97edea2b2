"""FSDP2 inside a rank (``gradkit.probes.fsdp2``): the model under ``fully_shard`` in a setting of ``SETTINGS``, its
gradient sync turned off and on by the case's loop, the full parameters read back (``full_read``, which the Accelerate
probe's ranks use too); every step judged (``common.judge_steps``). It never imports DeepSpeed."""
from __future__ import annotations

from gradkit import shapes
from gradkit.probes.ranks import common as c
from gradkit.probes.ranks import judging

# setting -> (reshard_after_forward, param dtype, reduce dtype, units); the record's dtype is the param dtype
SETTINGS = {
    "fp32": (True, "fp32", "fp32", "layers"),
    "fp32 no-reshard": (False, "fp32", "fp32", "layers"),
    "bf16 / fp32 reduce": (True, "bf16", "fp32", "layers"),
    "bf16 / bf16 reduce": (True, "bf16", "bf16", "layers"),
    "bf16 / fp32 reduce, one unit": (True, "bf16", "fp32", "one"),
}
DEPTH = 2


def shard(model, spec):
    """``model`` under ``fully_shard`` with ``spec`` = (reshard_after_forward, param dtype, reduce dtype, units):
    every submodule that holds parameters of its own (none shared with another module: a tied weight stays with the
    root) as one unit, then the root -- or the root alone (``units == "one"``)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    reshard, param, reduce, units = spec
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}
    mp = MixedPrecisionPolicy(param_dtype=dt[param], reduce_dtype=dt[reduce]) if param != "fp32" else MixedPrecisionPolicy()
    kw = {"reshard_after_forward": reshard, "mp_policy": mp}
    if units == "layers":
        owners: dict = {}
        for name, module in model.named_modules():
            for p in module.parameters(recurse=False):
                owners.setdefault(id(p), []).append(name)
        for name, module in model.named_modules():
            mine = list(module.parameters(recurse=False))
            if name and mine and all(len(owners[id(p)]) == 1 for p in mine):
                fully_shard(module, **kw)
    fully_shard(model, **kw)
    return model


def full_read(model) -> dict:
    """Every parameter whole (a collective: each sharded one is gathered with ``full_tensor``), flat, module order,
    float64: the fp32 parameters FSDP keeps (under mixed precision the model computes with their bf16 casts)."""
    import torch

    parts = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().double().reshape(-1).cpu()
             for p in model.parameters()]
    flat = torch.cat(parts)
    return {"module": flat, "masters": flat, "agree": True, "max_diff": 0.0}


def run_case(case: dict) -> dict:
    import sys

    ga, mb, hidden, seed, loop = case["ga"], case["micro_batch"], case["hidden"], case["seed"], case["name"]
    shape = shapes.of_case(case)
    model = shape.build(seed, hidden, DEPTH)
    if loop != "control":
        shard(model, case.get("fsdp") or SETTINGS[case["setting"]])
    opt = c.sgd(model)
    div = 1 if loop == "sum_not_mean" else ga

    def take(step, batches):
        for i, (x, y) in enumerate(batches):
            if loop != "control":
                last = i == ga - 1
                model.set_requires_gradient_sync(loop == "sync_every" or (last and loop != "sync_kept_off"))
            (shape.loss_fn(model(x), y) / div).backward()
        if loop == "control":  # plain torch.distributed: what every FSDP case is judged against
            c.average_grads(model)
        opt.step()  # lr = 1: the update is the gradient
        opt.zero_grad(set_to_none=True)
        return None, None

    read = (lambda: judging.plain_read(model)) if loop == "control" else (lambda: full_read(model))
    out = judging.judge_steps(case.get("steps", judging.STEPS), read, take, seed=seed, ga=ga, micro_batch=mb, hidden=hidden,
                        depth=DEPTH, dtype=case["dtype"], shape=shape)
    return {**out, "imported_deepspeed": "deepspeed" in sys.modules}


def run_rank(payload: dict) -> list[dict]:
    return judging.run_cases(payload, run_case)
