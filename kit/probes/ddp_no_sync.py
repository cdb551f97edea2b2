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

What its ranks run is ``gradkit.probes.ranks.ddp_no_sync``.
"""
from __future__ import annotations

from gradkit import config as kconfig
from gradkit import shapes
from gradkit.judge import oracle
from gradkit.probes import runner, shared

BUG = "DDP"
CASES = {"no_sync": "measured", "every_step": "comparison", "sum_not_mean": "comparison", "control": "control"}


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
    """Every case at every GA on every model shape (``gradkit.shapes``) in one plain-torch world per world size; each
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


PROBE = shared.torch_path_probe(
    id=BUG, title="torch DDP, no_sync() accumulation (no DeepSpeed)", module="ddp_no_sync", measured_case="no_sync",
    ratio_meaning="effective / reference gradient of the no_sync() step",
    advice="the DDP no_sync() step is off the reference on this torch: compare with the every_step case and "
           "report it to PyTorch with notebook 07's numbers",
    run=run, quick_plan=lambda w: dict(world_sizes=(w,), ga_values=(4,)), packages=("torch",), typical_s=8.0,
    violations=violations, order=10)
