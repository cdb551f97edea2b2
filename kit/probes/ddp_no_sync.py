"""DDP: torch ``DistributedDataParallel`` with ``no_sync()`` accumulation -- the same oracle, no DeepSpeed.

The accumulation path most training loops use without DeepSpeed: GA micro-batches per step, the first GA-1
inside ``model.no_sync()`` (no allreduce), the last outside it (DDP averages the accumulated gradient over
ranks), ``loss / GA`` each time, one ``optimizer.step()``. The ranks of this probe never import DeepSpeed.

==============  ==========================================================================  ==========
case            loop                                                                        role
==============  ==========================================================================  ==========
no_sync         DDP, ``no_sync()`` on the first GA-1 micro-batches                          measured
every_step      DDP without ``no_sync()``: an allreduce after every micro-batch              comparison
sum_not_mean    the ``no_sync`` loop without ``/ GA`` (a common loop bug: GA x the gradient)  comparison
control         the bare module: local accumulation, one ``all_reduce`` of every grad / W   control
==============  ==========================================================================  ==========
"""
from __future__ import annotations

import contextlib

from kit import config as kconfig
from kit import shapes
from kit.judge import oracle
from kit.probes import common as c
from kit.probes import runner
from kit.probes.probe import Probe

BUG = "DDP"
CASES = {"no_sync": "measured", "every_step": "comparison", "sum_not_mean": "comparison", "control": "control"}
DEPTH = 2


# ====================================================================== inside a rank

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

    out = c.judge_steps(case.get("steps", c.STEPS), lambda: c.plain_read(model), take, seed=seed, ga=ga,
                        micro_batch=mb, hidden=hidden, depth=DEPTH, shape=shape)
    return {**out, "imported_deepspeed": "deepspeed" in sys.modules}



def run_rank(payload: dict) -> list[dict]:
    return c.run_cases(payload, run_case)


# ====================================================================== in the caller

def plan(ga_values, micro_batch: int = 4, hidden: int = 32, seed: int = 0, models=("mlp",)) -> list[dict]:
    return [{"name": name, "role": role, "ga": ga, "dtype": "fp32", "micro_batch": micro_batch, "hidden": hidden,
             "seed": seed, "model": model} for model in models for ga in ga_values for name, role in CASES.items()]


def validate(world_sizes, ga_values, device: str, timeout_s: float, models=("mlp",)) -> None:
    kconfig.check_device(device)
    for name, values in (("WORLD_SIZES", world_sizes), ("GA_VALUES", ga_values), ("MODELS", models)):
        kconfig.check_list(name, values)
    for m in models:
        shapes.get(m)
    for w in world_sizes:
        kconfig.check_world_size(w, device)
    for ga in ga_values:
        kconfig.check_ga(ga)
    kconfig.check_timeout(timeout_s)


def run(world_sizes=(2,), ga_values=(1, 2, 4, 8), micro_batch: int = 4, hidden: int = 32, seed: int = 0,
        device: str = "cpu", timeout_s: float = kconfig.DEFAULT_TIMEOUT_S, stacks=({},), models=("mlp",)
        ) -> list[dict]:
    """Every case at every GA on every model shape (``kit.shapes``) in one plain-torch world per world size; each
    judged against the ``control`` of its GA and shape."""
    validate(world_sizes, ga_values, device, timeout_s, models)
    return runner.run(PROBE, plan(ga_values, micro_batch, hidden, seed, models), list(stacks), world_sizes, device,
                      timeout_s, meta={"seed": seed, "micro_batch": micro_batch, "hidden": hidden})


def violations(recs: list[dict]) -> list[str]:
    """What notebook 07 asserts: the control matches the reference; no rank imported DeepSpeed."""
    bad = [f"W={r['world_size']} GA={r['ga']} {r['config'].get('model', 'mlp')}: the control is {r['verdict']}: {r['reason']}"
           for r in recs if r["role"] == "control" and r["verdict"] != oracle.NOT_AFFECTED]
    bad += [f"W={r['world_size']} GA={r['ga']} {r['case']}: a rank imported DeepSpeed" for r in recs
            if r.get("imported_deepspeed")]
    return bad


# what the explorer offers every probe of a plain-torch path (notebook 07), and how it asks for one run
KNOBS = {"world_size": [2, 3, 4], "ga": [4, 1, 2, 8], "zero_stage": ["none"], "dtype": ["fp32"], "version": ["installed"]}


def explorer_kwargs(sel: dict, device: str, timeout_s: float) -> dict:
    return dict(world_sizes=[sel["world_size"]], ga_values=[sel["ga"]], device=device, timeout_s=timeout_s)


PROBE = Probe(
    id=BUG, title="torch DDP, no_sync() accumulation (no DeepSpeed)", module="ddp_no_sync",
    notebook="07_without_deepspeed.ipynb", measured_case="no_sync",
    ratio_meaning="effective / reference gradient of the no_sync() step",
    advice="the DDP no_sync() step is off the reference on this torch: compare with the every_step case and "
           "report it to PyTorch with notebook 07's numbers",
    run=run,
    quick_plan=lambda w: dict(world_sizes=(w,), ga_values=(4,)),
    knobs=KNOBS, explorer_kwargs=explorer_kwargs, init="torch", packages=("torch",), typical_s=8.0, violations=violations, order=10,
    control_key=lambda r: (r["ga"], r["config"].get("model")), annotate=lambda recs: [oracle_steps(r) for r in recs])


def oracle_steps(rec: dict) -> dict:
    """Each step named and described (per parameter group where the shape has several); ``model``: its shape."""
    rec["model"] = rec["config"].get("model") or "mlp"
    return oracle.annotate_steps(rec) if rec.get("steps") else rec
