"""B2 inside a rank (``gradkit.probes.pipeline_ga``): a real ``PipelineModule`` over ``STAGES`` stages, its
``train_batch`` steps, and rank 0's judgement of each step per stage against the reference of that stage's own
parameters, explained by the named hypotheses ``HYPOTHESES``."""
from __future__ import annotations

from gradkit.judge import naming, oracle
from gradkit.probes.ranks import common as c
from gradkit.probes.ranks import judging

STAGES = 2
DEPTH = 4  # Linear layers; GELU between them; split over the stages by layer count
HYPOTHESES = ("mean", "sum (x GA)", "mean / GA")
PARTITIONED = ("DeepSpeedZeroOptimizer", "BF16_Optimizer")  # optimizers that split the fp32 master over replicas
STALE = ", and the previous step's again"  # a hypothesis of state carried across steps: its name ends so


def hypothesis_weights(dp: int, ga: int, previous: bool = False) -> dict:
    """Weights over the basis (replica d, micro-batch i -> index d*ga + i; with ``previous``, the previous step's
    micro-batches after them) for each hypothesis; with ``previous`` each also "..., and the previous step's again"
    (a gradient not cleared after the step, applied once more)."""
    k = dp * ga
    out = {"mean": [1.0 / k] * k, "sum (x GA)": [1.0 / dp] * k, "mean / GA": [1.0 / (k * ga)] * k}
    if previous:
        out.update({name + STALE: w + w for name, w in list(out.items())})
    return out


def ds_config(case: dict, dp: int) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": case["micro_batch"],
        "gradient_accumulation_steps": case["ga"],
        "train_batch_size": case["micro_batch"] * case["ga"] * dp,
        "gradient_clipping": 0.0,
        "steps_per_print": 10 ** 9,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": case["zero_stage"]},
    }
    if case["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
        cfg["communication_data_type"] = "fp32"
    return cfg


class LoggingSGD:
    """Factory of a plain SGD that records the norm of the gradients it is handed, as a user's optimizer would."""

    @staticmethod
    def make(params, lr: float = 1.0):
        import torch

        class GradNormSGD(torch.optim.SGD):
            last_sq_norm = 0.0

            @torch.no_grad()
            def step(self, closure=None):
                sq = 0.0
                for group in self.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            sq += p.grad.detach().double().pow(2).sum().item()
                self.last_sq_norm = sq
                return super().step(closure)

        return GradNormSGD(params, lr=lr, momentum=0.0, weight_decay=0.0)


def full_model(hidden: int, seed: int):
    return c.tiny_mlp(hidden, seed, depth=DEPTH)


def run_case(case: dict) -> dict:
    """``case["steps"]`` (``common.STEPS`` by default) ``train_batch`` steps on fresh micro-batches, each judged per
    stage against the reference from that step's own starting weights (rank 0)."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule

    ga, mb, hidden, seed = case["ga"], case["micro_batch"], case["hidden"], case["seed"]
    dtype = c.DTYPE[case["dtype"]]
    div = ga if case["loss_div_ga"] else 1

    def loss_fn(out, y):
        return c.mse(out, y) / div

    full = full_model(hidden, seed).to(dtype)  # same weights on every rank; bf16 rounded once
    module = PipelineModule(layers=list(full), num_stages=STAGES, loss_fn=loss_fn, partition_method="uniform")
    opt = LoggingSGD.make([p for p in module.parameters() if p.requires_grad])
    engine, *_ = deepspeed.initialize(model=module, optimizer=opt, config=ds_config(case, c.world_size() // STAGES))
    stage, dp_rank, dp = engine.stage_id, engine.grid.get_data_parallel_rank(), engine.grid.get_data_parallel_world_size()
    names = [n for n, _ in engine.module.named_parameters()]
    dev = c.device()
    steps, prev, first, judged = case.get("steps", judging.STEPS), None, None, []
    before = c.read_weights(engine.module, engine.optimizer, case["dtype"])
    for s in range(steps):
        start = c.flat_params(engine.module)  # the weights this stage computes with (bf16: rounded)
        batches = [(x.to(dev, dtype), y.to(dev)) for x, y in c.micro_batches(seed, dp_rank, ga, mb, hidden, s)]
        loss = engine.train_batch(data_iter=iter(batches))
        after = c.read_weights(engine.module, engine.optimizer, case["dtype"])
        # lr = 1; from the fp32 masters where they agree with the weights the model uses, else from those weights
        # (known to within their rounding: read_floor), as every probe of common.judge_steps reads a step
        effective, agree = c.applied(before, after)
        floor = 0.0 if agree else c.rounding_floor(after["module"], case["dtype"], effective.norm().item())
        before = after
        reported = engine.get_global_grad_norm() if hasattr(engine, "get_global_grad_norm") else None
        mine = {"stage": stage, "dp_rank": dp_rank, "names": names, "effective": effective.tolist(),
                "masters_agree": agree, "read_floor": floor,
                "start": start.tolist(), "end": c.flat_params(engine.module).tolist(),
                "logged_sq_norm": _logged_sq_norm(engine.optimizer), "optimizer": type(engine.optimizer).__name__,
                "reported_grad_norm": None if reported is None else float(reported),
                "loss": None if loss is None else float(loss)}
        every = [None] * c.world_size()
        dist.all_gather_object(every, mine)
        if c.rank() == 0:
            begin = _assemble(every, hidden, seed, "start")
            first = begin if first is None else first
            one, basis = _judge(every, begin, case, dp, s, prev)
            judged.append(one)
            prev = basis
    out = {"optimizer": type(engine.optimizer).__name__, "dp": dp}
    if c.rank() == 0:
        last = c.flat_params(_assemble(every, hidden, seed, "end"))
        worst = max(range(len(judged)), key=lambda q: max(oracle.severity({**x, "dtype": case["dtype"]})
                                                            for x in [judged[q], *judged[q]["stages"]]))
        out.update(judged[worst], steps=judged, worst_step=worst,
                   trajectory=judging.trajectory(c.flat_params(first), last, seed, ga, mb, hidden, DEPTH, steps, 0.0, 1.0,
                                           dp))
    judging.release(engine)
    return out


def _assemble(every: list[dict], hidden: int, seed: int, key: str):
    """The whole model (every stage's parameters as replica 0 of that stage holds them under ``key``), as one
    plain fp32 module: a step's starting weights, for its reference."""
    import torch

    model = full_model(hidden, seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for e in every:
            if e["dp_rank"] != 0:
                continue
            flat, k = torch.tensor(e[key], dtype=torch.float64), 0
            for n in e["names"]:
                p = params[n]
                p.copy_(flat[k:k + p.numel()].reshape(p.shape).to(p.dtype))
                k += p.numel()
    return model


def _logged_sq_norm(optimizer):
    """The squared norm the user's SGD logged, also when DeepSpeed wraps it (ZeRO-1, BF16_Optimizer)."""
    for _ in range(3):
        if optimizer is None or hasattr(optimizer, "last_sq_norm"):
            break
        optimizer = getattr(optimizer, "optimizer", None)
    return getattr(optimizer, "last_sq_norm", None)


def _judge(every: list[dict], start, case: dict, dp: int, step: int = 0, prev=None) -> tuple[dict, object]:
    """Rank 0: per stage, one step's effective gradient against the reference of that stage's parameters from the
    step's own starting weights ``start``; ``prev`` (the previous step's micro-batch gradients) joins the basis with
    an expected weight of 0. Returns the step's measurement and its basis (the next step's ``prev``)."""
    import torch

    ga, mb, hidden, seed = case["ga"], case["micro_batch"], case["hidden"], case["seed"]
    micro = [b for d in range(dp) for b in c.micro_batches(seed, d, ga, mb, hidden, step)]  # replica-major
    basis, weights, reference = oracle.reference_gradients(start, micro, c.mse)
    full, expected = basis, weights
    if prev is not None:
        full = torch.cat([basis, prev])
        expected = torch.cat([weights, torch.zeros(len(prev), dtype=torch.float64)])
    offsets, k = {}, 0
    for name, p in start.named_parameters():
        offsets[name] = (k, k + p.numel())
        k += p.numel()
    per_stage, full_eff = [], torch.zeros_like(reference)
    logged_sq = 0.0
    for s in range(STAGES):
        replicas = [e for e in every if e["stage"] == s]
        first = next(e for e in replicas if e["dp_rank"] == 0)
        idx = torch.cat([torch.arange(*offsets[n]) for n in first["names"]])
        eff = torch.tensor(first["effective"], dtype=torch.float64)
        full_eff[idx] = eff
        sub_basis, sub_ref = basis[:, idx], reference[idx]
        per_stage.append({
            "stage": s, "params": first["names"], "metrics": oracle.compare(eff, sub_ref),
            "read_floor": max(e["read_floor"] for e in replicas), "masters_agree": all(e["masters_agree"] for e in replicas),
            # fitted over this step's micro-batches (a stage's basis with the previous step's too is ill-conditioned
            # at bf16: its noise alone passed the misplaced-weight limit); a previous gradient applied again is named
            # by the hypotheses below, which predict it whole
            "attribution": oracle.attribute(eff, sub_basis, weights),
            "hypotheses": naming.explain(eff, full[:, idx], hypothesis_weights(dp, ga, prev is not None),
                                         case["dtype"], sub_ref),
            "rank_spread": {"data-parallel replicas": oracle.spread([e["effective"] for e in replicas])}})
        # ZeRO-1 and BF16_Optimizer partition the fp32 master over replicas, so every rank logs its own
        # share; otherwise each replica holds (and logs) the whole stage
        logged = [e["logged_sq_norm"] for e in (replicas if first["optimizer"] in PARTITIONED else [first])]
        logged_sq = None if logged_sq is None or None in logged else logged_sq + sum(logged)
    with torch.no_grad():
        ref_loss = sum(c.mse(start.float()(x.float()), y.float()).item() for x, y in micro) / len(micro)
    last = next(e for e in every if e["stage"] == STAGES - 1 and e["dp_rank"] == 0)
    return {"step": step, "stages": per_stage, "metrics": oracle.compare(full_eff, reference),
            "attribution": oracle.attribute(full_eff, full, expected),
            "logged_grad_norm": None if logged_sq is None else logged_sq ** 0.5,
            "reported_grad_norm": last["reported_grad_norm"], "reference_grad_norm": reference.norm().item(),
            "logged_norm": last["reported_grad_norm"], "reference_norm": reference.norm().item(),
            "engine_loss": last["loss"], "reference_loss": ref_loss}, basis


def run_rank(payload: dict) -> list[dict]:
    """Entry point of ``gradkit.launch``: every case of the payload, one after another, in this world."""
    return judging.run_cases(payload, run_case)
