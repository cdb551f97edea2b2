"""B3 inside a rank (``gradkit.probes.zero_boundary``): each case's engine driven in its loop style, every step judged
(``common.judge_steps``) and explained by the named hypotheses ``HYPOTHESES``."""
from __future__ import annotations

from gradkit.probes.ranks import common as c
from gradkit.probes.ranks import judging

HYPOTHESES = ("global mean", "last micro-batch / N", "sum of micro-batches")


def hypothesis_weights(world_size: int, n: int) -> dict:
    """Weights over the rank-major basis (rank r, micro-batch i -> index r*n + i) for each hypothesis.

    - global mean: every micro-batch of every rank, 1/(W*N) each (what a correct engine applies);
    - last micro-batch / N: only each rank's last micro-batch, still divided by N (the reset);
    - sum of micro-batches: every micro-batch at 1/W, i.e. N times the mean (a missing 1/N).
    """
    k = world_size * n
    mean = [1.0 / k] * k
    last = [1.0 / k if i % n == n - 1 else 0.0 for i in range(k)]
    total = [1.0 / world_size] * k
    return dict(zip(HYPOTHESES, (mean, last, total)))


def ds_config(case: dict, world_size: int) -> dict:
    ga = case["n"] if case["config_ga"] == "N" else 1
    cfg = {
        "train_micro_batch_size_per_gpu": case["micro_batch"],
        "gradient_accumulation_steps": ga,
        "train_batch_size": case["micro_batch"] * ga * world_size,
        "gradient_clipping": 0.0,
        "steps_per_print": 10 ** 9,
        "zero_allow_untested_optimizer": True,  # torch.optim.SGD: the applied update is exactly the gradient
        "zero_optimization": {"stage": case["zero_stage"]},
    }
    if case["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
        cfg["communication_data_type"] = "fp32"  # keep bf16 rounding out of the reductions
    if not case["managed"]:
        cfg["managed_gradient_accumulation"] = False
    return cfg


def manual_accumulation_step(engine, micro_batches, loss_fn):
    """The pattern of the seed: N backward() calls, then one step(). Config says GA=1."""
    n = len(micro_batches)
    for x, y in micro_batches:
        loss = loss_fn(engine(x), y) / n  # a manual loop averages over its own micro-batches
        engine.backward(loss)
    engine.step()


def boundary_marked_step(engine, micro_batches, loss_fn):
    """The seed's fix: tell the engine which backward is the accumulation boundary."""
    n = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        engine.set_gradient_accumulation_boundary(is_boundary=(i == n - 1))
        loss = loss_fn(engine(x), y) / n
        engine.backward(loss)
    engine.step()


def engine_ga_step(engine, micro_batches, loss_fn):
    """DeepSpeed's own loop: config GA=N, the engine divides by GA and steps on its boundary."""
    for x, y in micro_batches:
        engine.backward(loss_fn(engine(x), y))
        engine.step()


LOOPS = {"manual": manual_accumulation_step, "boundary": boundary_marked_step, "engine_ga": engine_ga_step}


def run_case(case: dict) -> dict:
    import deepspeed

    w = c.world_size()
    n, mb, hidden, seed = case["n"], case["micro_batch"], case["hidden"], case["seed"]
    dtype = c.DTYPE[case["dtype"]]
    model = c.tiny_mlp(hidden, seed).to(dtype)  # bf16 weights rounded once; the reference starts from them
    with judging.phase("initialize"):
        engine, *_ = deepspeed.initialize(model=model, optimizer=c.sgd(model), config=ds_config(case, w))
    dev = c.device()
    knows_unmanaged = hasattr(engine, "managed_gradient_accumulation")

    def read():
        with judging.phase("read weights and masters"):
            return c.read_weights(engine.module, engine.optimizer, case["dtype"])

    def take(step, batches):
        with judging.phase("forward, backward, step"):
            LOOPS[case["loop"]](engine, [(x.to(dev, dtype), y.to(dev)) for x, y in batches], c.mse)
        return c.engine_norm(engine), None

    out = judging.judge_steps(case.get("steps", judging.STEPS), read, take, seed=seed, ga=n, micro_batch=mb, hidden=hidden,
                        dtype=case["dtype"], hypotheses=lambda ws, ns, prev, _update: hypothesis_weights(ws, ns))
    out.update(optimizer=type(engine.optimizer).__name__, knows_unmanaged=knows_unmanaged,
               engine_ga=engine.gradient_accumulation_steps())
    with judging.phase("release"):
        judging.release(engine)
    return out


def run_rank(payload: dict) -> list[dict]:
    """Entry point of ``gradkit.launch``: every case of the payload, one after another, in this world."""
    return judging.run_cases(payload, run_case)
