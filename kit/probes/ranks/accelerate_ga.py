"""Accelerate inside a rank (``gradkit.probes.accelerate_ga``): each case's loop through ``accelerator.accumulate`` (or
the bare control), Accelerate's process-wide state reset around it; every step judged (``common.judge_steps``). It
never imports DeepSpeed."""
from __future__ import annotations

from gradkit import shapes
from gradkit.probes.ranks import common as c
from gradkit.probes.ranks import judging
from gradkit.probes.ranks.fsdp2 import full_read

DEPTH = 2


def _fresh_state():
    """Accelerate keeps its state in process-wide singletons: each case starts from none (the process group, which
    the world owns, stays)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(False)
    GradientState._reset_state()


def run_case(case: dict) -> dict:
    import sys

    ga, mb, hidden, seed, name = case["ga"], case["micro_batch"], case["hidden"], case["seed"], case["name"]
    shape = shapes.of_case(case)
    model = shape.build(seed, hidden, DEPTH)
    if name == "control":
        opt = c.sgd(model)

        def take(step, batches):
            for share, (x, y) in zip(c.sample_shares(batches), batches):  # 1 / GA for equal micro-batches
                (shape.loss_fn(model(x), y) * share).backward()
            c.average_grads(model)  # plain torch.distributed: what every Accelerate case is judged against
            opt.step()
            opt.zero_grad(set_to_none=True)
            return None, None

        out = judging.judge_steps(case.get("steps", judging.STEPS), lambda: judging.plain_read(model), take, seed=seed, ga=ga,
                            micro_batch=mb, hidden=hidden, depth=DEPTH, shape=shape)
        return {**out, "imported_deepspeed": "deepspeed" in sys.modules}

    from accelerate import Accelerator
    from accelerate.data_loader import DataLoaderShard
    from accelerate.utils import DistributedDataParallelKwargs, GradientAccumulationPlugin

    _fresh_state()
    steps_given = case.get("accumulation_steps", ga)
    plugin = GradientAccumulationPlugin(num_steps=steps_given,
                                        **({"sync_each_batch": True} if name == "sync_each_batch" else {}))
    kw = {"kwargs_handlers": [DistributedDataParallelKwargs(find_unused_parameters=shape.unused_parameters)]}
    if name == "accumulate_fsdp2":
        from accelerate.utils import FullyShardedDataParallelPlugin

        kw = {"fsdp_plugin": FullyShardedDataParallelPlugin(fsdp_version=2)}
    acc = Accelerator(gradient_accumulation_plugin=plugin, cpu=c.device().type == "cpu", **kw)
    if name == "accumulate_fsdp2" and acc.distributed_type.name != "FSDP":
        raise RuntimeError(f"Accelerate selects FSDP on a GPU only: on {c.device().type} it gave "
                           f"{acc.distributed_type} (the model would be wrapped in DDP, not sharded)")
    opt = c.sgd(model)
    wrapped, opt = acc.prepare(model, opt) if name != "accumulate_fsdp2" else (acc.prepare(model), None)
    if opt is None:  # FSDP2 replaces the parameters: the optimizer is built on the sharded ones
        opt = acc.prepare(c.sgd(wrapped))
    model = wrapped if name == "accumulate_fsdp2" else model
    stepped = []

    def take(step, batches):
        # last_window: the step's micro-batches are the whole dataloader (Accelerate syncs at its end); the others
        # iterate a plain list (Accelerate syncs by its own count of micro-batches)
        window = name.startswith("last_window")
        source = DataLoaderShard(batches, batch_size=None) if window else batches
        moved = 0
        if name.startswith("tokens_"):  # the window's items (samples: tokens), on this rank or on every rank
            import torch

            items = torch.tensor([sum(len(x) for x, _ in batches)], dtype=torch.float64)
            items = acc.gather(items).sum() if name == "tokens_global" else items.sum()
            scale = (acc.num_processes if name == "tokens_global" else 1) * steps_given / items
        for x, y in source:
            with acc.accumulate(wrapped):
                pred = wrapped(x)  # one forward: DDP prepares its reduction for the graph backward will walk
                if name.startswith("tokens_"):  # the summed per-item loss, normalised as Accelerate documents
                    loss = ((pred.float() - y.float()) ** 2).mean(dim=1).sum() * scale
                else:
                    loss = shape.loss_fn(pred, y)
                if name == "last_window_fixed":  # Accelerate divides by the GA it was given: undo it for this window
                    loss = loss * steps_given / len(batches)
                loss.backward() if name == "sum_not_mean" else acc.backward(loss)
                before = [p.detach().clone() for p in opt.optimizer.param_groups[0]["params"]]
                opt.step()  # lr = 1: the update is the gradient; a no-op until Accelerate says the window is in sync
                opt.zero_grad()
                moved += any(not bool((b == p.detach()).all())
                             for b, p in zip(before, opt.optimizer.param_groups[0]["params"]))
        stepped.append(moved)
        return None, None

    read = (lambda: full_read(model)) if name == "accumulate_fsdp2" else (lambda: judging.plain_read(model))
    try:
        out = judging.judge_steps(case.get("steps", judging.STEPS), read, take, seed=seed, ga=ga,
                            micro_batch=mb, hidden=hidden, depth=DEPTH, shape=shape)
    finally:
        _fresh_state()
    return {**out, "optimizer_steps_per_window": stepped, "accumulation_steps": steps_given,
            "imported_deepspeed": "deepspeed" in sys.modules}


def run_rank(payload: dict) -> list[dict]:
    return judging.run_cases(payload, run_case)
