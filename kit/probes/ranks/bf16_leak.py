"""B4 inside a rank (``gradkit.probes.bf16_leak``): each case's engine, every step judged with each rank's own fp32
accumulator going into ``step()`` (``bf16_accumulator``, which the check's ranks read too), and the symptom's
trajectory of losses and grad norms."""
from __future__ import annotations

from gradkit.judge import oracle
from gradkit.probes.ranks import common as c
from gradkit.probes.ranks import judging


def ds_config(case: dict, world_size: int) -> dict:
    ga, mb = case["ga"], case["micro_batch"]
    cfg = {
        "train_micro_batch_size_per_gpu": mb,
        "gradient_accumulation_steps": ga,
        "train_batch_size": mb * ga * world_size,
        "gradient_clipping": 0.0,
        "steps_per_print": 10 ** 9,
        "zero_allow_untested_optimizer": True,  # torch.optim.SGD: the applied update is exactly the gradient
        "zero_optimization": {"stage": case["zero_stage"]},
    }
    if case["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True, "immediate_grad_update": case["immediate_grad_update"]}
        cfg["communication_data_type"] = "fp32"  # keep bf16 rounding out of the allreduce, as the seed did
    if case.get("grad_accum_dtype"):
        cfg["data_types"] = {"grad_accum_dtype": case["grad_accum_dtype"]}
    return cfg


def bf16_accumulator(engine, module):
    """This rank's fp32 accumulator of a BF16_Optimizer, flat in module parameter order (else None); a parameter the
    optimizer does not hold (frozen) is 0 there."""
    opt = engine.optimizer
    if type(opt).__name__ != "BF16_Optimizer":
        return None
    import torch
    by_param = {}
    for group_params, group_grads in zip(opt.bf16_groups, opt.fp32_groups_gradients):
        for p, g in zip(group_params, group_grads):
            by_param[id(p)] = g
    return torch.cat([(by_param[id(p)].detach() if id(p) in by_param else torch.zeros(p.numel())).float().reshape(-1).cpu()
                      for p in module.parameters()]).double()


def run_case(case: dict) -> dict:
    import deepspeed

    w = c.world_size()
    ga, mb, hidden, seed = case["ga"], case["micro_batch"], case["hidden"], case["seed"]
    dtype = c.DTYPE[case["dtype"]]
    model = c.tiny_mlp(hidden, seed).to(dtype)  # weights rounded to bf16 once; the reference starts from these
    engine, *_ = deepspeed.initialize(model=model, optimizer=c.sgd(model), config=ds_config(case, w))
    dev, norms = c.device(), []

    def take(step, batches):
        acc_norms = []
        for i, (x, y) in enumerate(batches):
            engine.set_gradient_accumulation_boundary(is_boundary=(i == ga - 1))  # what accelerate does
            engine.backward(c.mse(engine(x.to(dev, dtype)), y.to(dev)))
            acc = bf16_accumulator(engine, engine.module)
            acc_norms.append(acc.norm().item() if acc is not None else float("nan"))
        buffer = bf16_accumulator(engine, engine.module)  # this rank's accumulator going into step()
        engine.step()
        norms.append(c.all_gather_floats(acc_norms))  # [rank][micro-batch]
        return c.engine_norm(engine), c.all_gather_flat(buffer) if buffer is not None else None

    def accumulators(judged, step, buffers, basis, weights, reference):
        judged["accumulator_norms"] = norms[step]
        if buffers is not None:  # the leak is per rank: judge each rank's own accumulator, and their spread
            judged["rank_buffers"] = [{"metrics": oracle.compare(b, reference),
                                       "attribution": oracle.attribute(b, basis, weights)} for b in buffers]
            judged["rank_spread"]["fp32 accumulators"] = oracle.spread(buffers)

    out = judging.judge_steps(case.get("steps", judging.STEPS), lambda: c.read_weights(engine.module, engine.optimizer,
                                                                             case["dtype"]),
                        take, seed=seed, ga=ga, micro_batch=mb, hidden=hidden, dtype=case["dtype"], extra=accumulators)
    out["optimizer"] = type(engine.optimizer).__name__
    judging.release(engine)
    return out


def run_trajectory(case: dict) -> dict:
    """The user's view: ``steps`` SGD steps of this split (micro_batch x GA), the loss and grad norm per step."""
    import deepspeed
    import torch
    import torch.distributed as dist

    r, w = c.rank(), c.world_size()
    ga, mb, hidden, seed, lr = case["ga"], case["micro_batch"], case["hidden"], case["seed"], case["lr"]
    dtype = c.DTYPE[case["dtype"]]
    model = c.tiny_mlp(hidden, seed).to(dtype)
    engine, *_ = deepspeed.initialize(model=model, optimizer=c.sgd(model, lr), config=ds_config(case, w))
    dev, losses, grad_norms = c.device(), [], []
    for step in range(case["steps"]):
        before = c.full_fp32_params(engine.module)
        total = torch.zeros((), dtype=torch.float64, device=dev)
        for i, (x, y) in enumerate(c.micro_batches(seed, r, ga, mb, hidden, step=step + 1)):
            engine.set_gradient_accumulation_boundary(is_boundary=(i == ga - 1))
            loss = c.mse(engine(x.to(dev, dtype)), y.to(dev))
            engine.backward(loss)
            total += loss.detach().double() / ga
        engine.step()
        dist.all_reduce(total)
        losses.append(total.item() / w)
        grad_norms.append(((before - c.full_fp32_params(engine.module)) / lr).norm().item())
    out = {"optimizer": type(engine.optimizer).__name__, "losses": losses, "grad_norms": grad_norms}
    judging.release(engine)
    return out


def run_rank(payload: dict) -> list[dict]:
    """Entry point of ``gradkit.launch``: every case of the payload, one after another, in this world."""
    return judging.run_cases(payload, lambda case: run_trajectory(case) if "lr" in case else run_case(case))
