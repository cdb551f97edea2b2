"""Accelerate: ``accelerator.accumulate(model)`` over DDP -- the same oracle, no DeepSpeed.

The loop Accelerate documents: every micro-batch inside ``with accelerator.accumulate(model):``, the loss through
``accelerator.backward`` (which divides it by ``gradient_accumulation_steps``), ``optimizer.step()`` and
``zero_grad()`` on every micro-batch (the prepared optimizer acts only when Accelerate says the gradients are in
sync). Accelerate wraps the model in DDP and skips the allreduce (``no_sync``) until the window's last micro-batch.

===============  ===========================================================================  ==========
case             loop                                                                         role
===============  ===========================================================================  ==========
accumulate       the documented loop, GA micro-batches per window                             measured
sync_each_batch  the same with ``GradientAccumulationPlugin(sync_each_batch=True)``             measured
                 (an allreduce every micro-batch; 0.28 - 0.30 also stepped the optimizer there)
accumulate_fsdp2 the documented loop on FSDP2 (``FullyShardedDataParallelPlugin(fsdp_version=2)``)  measured
                 -- Accelerate selects FSDP on a GPU only: on CPU it is ``cannot-run``, said so
last_window      a dataloader that ends after ``ga`` < GA micro-batches: the last, incomplete  comparison
                 window (its loss still divided by the full GA: documented, huggingface/accelerate#1847)
last_window_     ``last_window`` with the loss scaled by GA / (micro-batches in the window) before     fix
fixed            ``accelerator.backward``: the user's fix for the last window, verified
sum_not_mean     ``loss.backward()`` instead of ``accelerator.backward(loss)`` (a loop bug: x GA)   comparison
accumulate_      the documented loop on micro-batches of different sizes (``kit/shapes/ragged``):  comparison
ragged           each micro-batch's mean loss weighs alike, not by its samples (tokens)
tokens_global    Accelerate's documented loss normalisation: each micro-batch's *summed* loss      measured
                 over the window's item count gathered from every rank, x W x GA
tokens_local     the same over the rank's own item count (no gather): ranks weigh alike          comparison
control          the bare module: local accumulation, one ``all_reduce`` of every grad / W    control
===============  ===========================================================================  ==========

``last_window``'s record has ``ga`` = the micro-batches the window holds and ``accumulation_steps`` = the GA
Accelerate was given (``ga + 1``): each judged step is one pass over a dataloader of ``ga`` micro-batches, so the
expected update is ``ga / (ga + 1)`` of the reference. The releases are overlays of the ``accelerate`` package
(``stacks=[{"accelerate": "0.30.1"}]``); torch stays the installed one, and every record says which ran.

What its ranks run is ``gradkit.probes.ranks.accelerate_ga``.
"""
from __future__ import annotations

from gradkit import config as kconfig
from gradkit.judge import oracle
from gradkit.probes import ddp_no_sync, runner, shared

BUG = "ACC"
CASES = {"accumulate": "measured", "sync_each_batch": "measured", "accumulate_fsdp2": "measured",
         "last_window": "comparison", "last_window_fixed": "fix",
         "sum_not_mean": "comparison", "accumulate_ragged": "comparison", "tokens_global": "measured",
         "tokens_local": "comparison", "control": "control"}
RAGGED = ("accumulate_ragged", "tokens_global", "tokens_local")  # run on the ``ragged`` shape whatever the models


def plan(ga_values, micro_batch: int = 4, hidden: int = 32, seed: int = 0, models=("mlp",), cases=None) -> list[dict]:
    out = []
    for model in models:
        for ga in ga_values:
            for name, role in CASES.items():
                if cases is not None and name not in cases and name != "control":
                    continue
                if name in RAGGED and model != models[0]:  # once per GA, on the ragged shape
                    continue
                case = {"name": name, "role": role, "ga": ga, "dtype": "fp32", "micro_batch": micro_batch,
                        "hidden": hidden, "seed": seed, "model": "ragged" if name in RAGGED else model}
                if name.startswith("last_window"):
                    case["accumulation_steps"] = ga + 1
                out.append(case)
    for ga in ga_values:  # the ragged cases' own control, where the models did not bring one
        if any(c["model"] == "ragged" and c["ga"] == ga for c in out) and not any(
                c["model"] == "ragged" and c["ga"] == ga and c["role"] == "control" for c in out):
            out.append({"name": "control", "role": "control", "ga": ga, "dtype": "fp32", "micro_batch": micro_batch,
                        "hidden": hidden, "seed": seed, "model": "ragged"})
    return out


def validate(world_sizes, ga_values, device: str, timeout_s: float, models=("mlp",), stacks=({},)) -> None:
    ddp_no_sync.validate(world_sizes, ga_values, device, timeout_s, models)
    for s in stacks:
        extra = sorted(set(s) - {"accelerate"})
        if extra:
            raise kconfig.ConfigError(f"the Accelerate probe runs accelerate releases only; it was given {extra}")


def run(world_sizes=(2,), ga_values=(1, 4), micro_batch: int = 4, hidden: int = 32, seed: int = 0,
        device: str = "cpu", timeout_s: float = kconfig.DEFAULT_TIMEOUT_S, stacks=({},), models=("mlp",),
        cases=None) -> list[dict]:
    """Every case at every GA on every model shape, one world per (accelerate release, world size); each judged
    against the ``control`` of its GA and shape."""
    validate(world_sizes, ga_values, device, timeout_s, models, stacks)
    return runner.run(PROBE, plan(ga_values, micro_batch, hidden, seed, models, cases), list(stacks), world_sizes,
                      device, timeout_s, meta={"seed": seed, "micro_batch": micro_batch, "hidden": hidden})


def violations(recs: list[dict]) -> list[str]:
    """What the notebook asserts of Accelerate: the control is exact, no rank imported DeepSpeed, the loop bug is
    seen (``sum_not_mean``: ratio GA where GA > 1), and the last incomplete window applies ``ga / GA`` of the
    reference (Accelerate's documented behaviour; a release that changed it is a finding to look at)."""
    bad = [f"{v}: no control ran on this release, so nothing of it was measured"
           for v in sorted({r["version"] for r in recs})
           if not any(r["version"] == v and r["role"] == "control" and r["verdict"] == oracle.NOT_AFFECTED for r in recs)]
    for r in recs:
        where = f"W={r['world_size']} GA={r['ga']} {r['config'].get('model', 'mlp')} {r['case']} on {r['version']}"
        m = r.get("metrics") or {}
        if r["role"] == "control" and r["verdict"] not in (oracle.NOT_AFFECTED, oracle.CANNOT_RUN):
            # a control that ran must be exact; one that could not run (e.g. the installed PEFT needs a newer
            # accelerate than the overlay) makes its cases cannot-run too, said as such
            bad.append(f"{where}: the control is {r['verdict']}: {r['reason']}")
        if r.get("imported_deepspeed"):
            bad.append(f"{where}: a rank imported DeepSpeed")
        if r["case"] == "sum_not_mean" and r["ga"] > 1 and not r.get("error") and (
                r["verdict"] != oracle.AFFECTED or abs(m["norm_ratio"] / r["ga"] - 1) > 1e-3):
            bad.append(f"{where}: the loop without accelerator.backward is {r['verdict']} (ratio {m.get('norm_ratio')})")
        if r["case"] == "last_window" and not r.get("error"):
            want = r["ga"] / r["config"]["accumulation_steps"]
            if r["verdict"] != oracle.AFFECTED or abs(m["norm_ratio"] / want - 1) > 1e-3:
                bad.append(f"{where}: the last incomplete window is {r['verdict']} with ratio {m.get('norm_ratio')} "
                           f"({want:.4f} documented)")
    return bad


def annotate(rec: dict) -> dict:
    extra = max(rec.get("optimizer_steps_per_window") or [1])
    if extra > 1:  # the fitted weights see one step's worth of gradient; the count says how it was applied
        rec["reason"] += (f"; the optimizer stepped {extra} times in one accumulation window of {rec['ga']} "
                          "micro-batches (once per micro-batch), each on a partial gradient")
    return shared.annotate(rec, setting=f"accelerate {(rec.get('versions') or {}).get('accelerate', rec['version'])}")


PROBE = shared.torch_path_probe(
    id=BUG, title="Accelerate accumulate() over DDP (no DeepSpeed)", module="accelerate_ga",
    measured_case="accumulate",
    ratio_meaning="effective / reference gradient of the accelerator.accumulate() step",
    advice="the accelerator.accumulate() step is off the reference on this accelerate: compare sync_each_batch and "
           "the control in notebook 07 and report it to huggingface/accelerate with those numbers",
    run=run, quick_plan=lambda w: dict(world_sizes=(w,), ga_values=(4,)), packages=("torch", "accelerate"),
    typical_s=10.0, violations=violations, order=12, annotate_record=annotate)
