"""DDP inside a rank (``gradkit.probes.ddp_no_sync``): the model in torch's ``DistributedDataParallel``, accumulated
with and without ``no_sync()``, or bare (the control); every step judged (``common.judge_steps``). It never imports
DeepSpeed."""
from __future__ import annotations

import contextlib

from gradkit import shapes
from gradkit.probes.ranks import common as c
from gradkit.probes.ranks import judging

DEPTH = 2


def run_case(case: dict) -> dict:
    import sys

    from torch.nn.parallel import DistributedDataParallel as DDP

    ga, mb, hidden, seed = case["ga"], case["micro_batch"], case["hidden"], case["seed"]
    shape = shapes.of_case(case)
    model = shape.build(seed, hidden, DEPTH)
    # a model some micro-batches use only in part needs DDP told so (else its reducer waits for gradients that
    # never come), as every user of such a model sets it
    wrapped = model if case["name"] == "control" else DDP(model, find_unused_parameters=shape.unused_parameters)
    opt = c.sgd(model)
    div = 1 if case["name"] == "sum_not_mean" else ga

    def take(step, batches):
        for i, (x, y) in enumerate(batches):
            quiet = case["name"] in ("no_sync", "sum_not_mean") and i < ga - 1
            with wrapped.no_sync() if quiet else contextlib.nullcontext():
                (shape.loss_fn(wrapped(x), y) / div).backward()
        if case["name"] == "control":  # the plain-torch.distributed average every other case is judged against
            c.average_grads(model)
        opt.step()  # lr = 1: the update is the gradient
        opt.zero_grad(set_to_none=True)
        return None, None

    out = judging.judge_steps(case.get("steps", judging.STEPS), lambda: judging.plain_read(model), take, seed=seed, ga=ga,
                        micro_batch=mb, hidden=hidden, depth=DEPTH, shape=shape)
    return {**out, "imported_deepspeed": "deepspeed" in sys.modules}


def run_rank(payload: dict) -> list[dict]:
    return judging.run_cases(payload, run_case)
