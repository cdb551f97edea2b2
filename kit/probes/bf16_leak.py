"""B4: does DeepSpeed's BF16_Optimizer leave the boundary micro-batch out of the cross-rank average?

The configuration under test (seed ``003``): bf16 model, ``data_types.grad_accum_dtype: fp32``,
ZeRO stage 1 -> DeepSpeed wraps the optimizer in ``BF16_Optimizer``, which keeps its own fp32
gradient accumulator. The suspected mechanism: ``_backward_epilogue`` allreduces that
accumulator *before* ``optimizer.backward_epilogue()`` adds the boundary micro-batch to it, so
each rank steps with avg(earlier micro-batches) + its *own* last micro-batch.

One world runs every case, for every GA, back to back:

=================  =========================================================  ===========
case               config                                                     role
=================  =========================================================  ===========
leak               bf16, grad_accum_dtype fp32, ZeRO-1 (BF16_Optimizer)       measured
workaround         the same + ``bf16.immediate_grad_update: true``            fix check
bf16_accum         bf16, grad_accum_dtype bf16, ZeRO-1 (no BF16_Optimizer)    comparison
control            fp32, ZeRO-0 (no optimizer wrapper at all)                 control
=================  =========================================================  ===========

Per case, ``steps`` optimizer steps (``common.STEPS`` by default); per step and rank the probe records the fp32
accumulator norm after each micro-batch (the seed's view), each rank's accumulator just before ``step()``, and
the effective gradient ``step()`` applied (SGD, lr=1, read from the fp32 masters, cross-checked against the
module's weights). Rank 0 judges both against the oracle's fp32 reference of the same global batch from that
step's starting weights; the record is the worst step's, with every step in ``steps``. What its ranks run is
``gradkit.probes.ranks.bf16_leak``.
"""
from __future__ import annotations

from gradkit import config as kconfig
from gradkit.judge import expectations, oracle, tolerances
from gradkit.probes import runner, shared
from gradkit.probes.probe import Probe

CASES = {
    "leak": {"role": "measured", "dtype": "bf16", "zero_stage": 1, "grad_accum_dtype": "fp32",
             "immediate_grad_update": False},
    "workaround": {"role": "workaround", "dtype": "bf16", "zero_stage": 1, "grad_accum_dtype": "fp32",
                   "immediate_grad_update": True},
    "bf16_accum": {"role": "comparison", "dtype": "bf16", "zero_stage": 1, "grad_accum_dtype": "bf16",
                   "immediate_grad_update": False},
    "control": {"role": "control", "dtype": "fp32", "zero_stage": 0, "grad_accum_dtype": None,
                "immediate_grad_update": False},
}
BUG = "B4"


def predicted_misplaced_weight(world_size: int, ga: int) -> float:
    """The seed's formula: the boundary micro-batch (1/GA of the step) keeps only its own rank's share."""
    return (world_size - 1) / world_size / ga


def violations(recs: list[dict], code_order: dict | None = None) -> list[str]:
    """The claims the B4 notebook asserts, each broken one as a sentence (empty list: all hold).

    1. every control (fp32, ZeRO-0) matches the reference, and the reported configuration ran;
    2. where the code order of ``_backward_epilogue`` was read (``code_order``: version -> allreduce first?),
       the measured verdicts of that release follow it;
    3. every measured verdict -- every world size of the grid included -- is what the upstream table says of
       its release (``gradkit.judge.expectations``; releases newer than the table are findings, not violations);
    4. on every affected record each rank's accumulator misplaces (W-1)/W * 1/GA of the weight, to within the
       attribution noise (the bf16 misplaced-weight limit of ``gradkit.judge.oracle``, set against the measured noise);
    5. the ``immediate_grad_update`` workaround matches the reference wherever it ran.
    """
    bad, tol = [], tolerances.tolerance("bf16")
    for r in recs:
        where = f"ds {r['version']} W={r['world_size']} GA={r['ga']} {r['case']}"
        if r["role"] == "control" and r["verdict"] != oracle.NOT_AFFECTED:
            bad.append(f"{where}: the control is {r['verdict']}: {r['reason']}")
        if r["role"] == "measured" and r["verdict"] == oracle.CANNOT_RUN:
            bad.append(f"{where}: the reported configuration did not run: {r['reason'][:300]}")
        if r["role"] == "workaround" and r["verdict"] not in (oracle.NOT_AFFECTED, oracle.CANNOT_RUN):
            bad.append(f"{where}: the workaround is {r['verdict']}: {r['reason']}")
        if r["role"] == "measured" and (code_order or {}).get(r["version"]) is not None:
            want = oracle.AFFECTED if code_order[r["version"]] else oracle.NOT_AFFECTED
            if r["verdict"] != want:
                bad.append(f"{where}: the code order says {want}, measured {r['verdict']}")
        if r["role"] == "measured" and r["verdict"] == oracle.AFFECTED:
            for k, b in enumerate(r.get("rank_buffers") or []):
                got, want = b["attribution"]["misplaced_weight"], r["predicted_misplaced_weight"]
                if abs(got - want) > tol.misplaced_weight:
                    bad.append(f"{where}: rank {k}'s accumulator misplaces {got:.4f}, the formula {want:.4f} "
                               f"(more than the {tol.misplaced_weight:g} attribution noise apart)")
    bad += expectations.mismatches(BUG, recs, role="measured")[0]
    return bad


def plan(ga_values, micro_batch: int = 4, hidden: int = 32, seed: int = 0, cases=tuple(CASES)) -> list[dict]:
    for ga in ga_values:
        kconfig.check_ga(ga)
    unknown = set(cases) - set(CASES)
    if unknown:
        raise kconfig.ConfigError(f"unknown B4 case(s) {sorted(unknown)}; known: {sorted(CASES)}")
    if "control" not in cases:
        raise kconfig.ConfigError("the 'control' case is required: without it no verdict can be trusted")
    return [{"name": name, **CASES[name], "ga": ga, "micro_batch": micro_batch, "hidden": hidden, "seed": seed}
            for ga in ga_values for name in cases]


def plan_symptom(splits, steps: int, lr: float, hidden: int = 32, seed: int = 0, cases=("leak", "workaround")):
    """Trajectory cases: the same global batch split as (micro_batch, GA) in different ways."""
    out = []
    for split in splits:
        mb, ga = shared.check_split(split)
        for name in cases:
            out.append({"name": name, **CASES[name], "role": "symptom", "ga": ga, "micro_batch": mb,
                        "hidden": hidden, "seed": seed, "steps": steps, "lr": lr})
    if len({mb * ga for mb, ga in splits}) != 1:
        raise kconfig.ConfigError(f"the splits {splits} do not share one global batch per rank (micro_batch x GA)")
    return out


def validate(world_size: int, ga_values, versions, device: str, timeout_s: float, grid_world_sizes=(),
             splits=(), micro_batch: int = 4, hidden: int = 32) -> None:
    """Every knob of the B4 notebook, checked before the first launch (``ConfigError`` says which)."""
    kconfig.check_device(device)
    for w in (world_size, *grid_world_sizes):
        kconfig.check_world_size(w, device)
    if not ga_values:
        raise kconfig.ConfigError("GA_VALUES is empty: give at least one gradient-accumulation value")
    for ga in ga_values:
        kconfig.check_ga(ga)
    if not versions:
        raise kconfig.ConfigError("VERSIONS is empty: give at least one DeepSpeed version (or 'installed')")
    for v in versions:
        kconfig.check_version(v)
    kconfig.check_timeout(timeout_s)
    kconfig.check_positive_int("micro_batch", micro_batch)
    kconfig.check_positive_int("hidden", hidden)
    if splits:
        plan_symptom(splits, steps=1, lr=0.1)


def check_notebook(p: dict) -> list:
    """Every parameter of notebook 04, by its name there (what the notebook and ``gradkit.notebooks.runall`` call
    first); returns the ``(probe, stack)`` pairs its worlds will run (``gradkit.stacks.prefetch``)."""
    for name in ("GA_VALUES", "VERSIONS", "GRID_WORLD_SIZES", "SYMPTOM_SPLITS"):
        kconfig.check_list(name, p[name])
    kconfig.check_timeout(p["TIMEOUT_S"])
    validate(p["WORLD_SIZE"], p["GA_VALUES"], p["VERSIONS"], p["DEVICE"], p["TIMEOUT_S"], p["GRID_WORLD_SIZES"],
             p["SYMPTOM_SPLITS"], p["MICRO_BATCH"], p["HIDDEN"])
    kconfig.check_positive_int("SYMPTOM_STEPS", p["SYMPTOM_STEPS"])
    if not isinstance(p["SYMPTOM_LR"], (int, float)) or isinstance(p["SYMPTOM_LR"], bool) or p["SYMPTOM_LR"] <= 0:
        raise kconfig.ConfigError(f"SYMPTOM_LR must be a number > 0, got {p['SYMPTOM_LR']!r}")
    return [(PROBE, stack) for stack in runner.stacks_of(p["VERSIONS"])]


def run(world_size: int = 2, ga_values=(1, 2, 4, 8), versions=("installed",), micro_batch: int = 4, hidden: int = 32,
        seed: int = 0, device: str = "cpu", timeout_s: float = kconfig.DEFAULT_TIMEOUT_S, cases=tuple(CASES),
        symptom: list[dict] | None = None, stacks=None) -> list[dict]:
    """Run every case for every GA under every DeepSpeed version (or ``stacks``); one world per version.

    Returns one record per (version, GA, case), each with its verdict (see ``gradkit.probes.runner``).
    Everything is validated before the first launch.
    """
    stacks = runner.stacks_of(versions) if stacks is None else list(stacks)
    validate(world_size, ga_values, runner.versions_of(stacks), device, timeout_s, micro_batch=micro_batch,
             hidden=hidden)
    todo = plan(ga_values, micro_batch, hidden, seed, cases) + (symptom or [])
    return runner.run(PROBE, todo, stacks, (world_size,), device, timeout_s,
                      meta={"seed": seed, "micro_batch": micro_batch, "hidden": hidden},
                      predicted=lambda case, w: predicted_misplaced_weight(w, case["ga"]))


def explorer_kwargs(sel: dict, device: str, timeout_s: float) -> dict:
    return {"world_size": sel["world_size"], "ga_values": [sel["ga"]], "versions": [sel["version"]],
            "cases": ["leak", "workaround", "control"], "device": device, "timeout_s": timeout_s}


PROBE = Probe(
    id=BUG, title="BF16_Optimizer (bf16 + grad_accum_dtype fp32 + ZeRO-1)", module="bf16_leak",
    notebook="04_bf16_leak.ipynb", measured_case="leak",
    ratio_meaning="effective / reference gradient of the reported configuration",
    advice="set \"bf16\": {\"enabled\": true, \"immediate_grad_update\": true}, or upgrade to DeepSpeed >= 0.19.0",
    run=run, check_notebook=check_notebook,
    quick_plan=lambda w: dict(world_size=w, ga_values=(4,), cases=("leak", "workaround", "control")),
    knobs={"world_size": [2, 3, 4], "ga": [4, 1, 2, 8], "zero_stage": [1], "dtype": ["bf16"],
           "version": ["installed", "0.18.9"]},
    explorer_kwargs=explorer_kwargs, typical_s=15.0, violations=violations, order=4)
