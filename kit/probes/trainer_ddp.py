"""The HF Trainer without DeepSpeed on several ranks (DDP): the B1 question where token counts differ per rank.

A real ``transformers.Trainer`` on a tiny ``LlamaForCausalLM`` (built from a config; an architecture every release
the kit runs has) over rows whose label counts differ, so each rank and each micro-batch holds a different number of
label tokens. The reference is the mean over *every* label token of the global batch (plain fp32 PyTorch, one
process); the control is ``trainer_ga``'s plain-PyTorch harness on the same rows in the same world. The machinery
is B1's: the Trainer run and its call trace (``gradkit.probes.ranks.trainer_ga``), the token and GAS factors
(``gradkit.probes.trainer_ga``).

==============  =========================================================================  ==========
case            what                                                                       role
==============  =========================================================================  ==========
trainer         the Trainer as the release ships it (its own ``average_tokens_across_devices`` default)  measured
avg_tokens_on   ``average_tokens_across_devices=True``: one token count over every rank       measured
avg_tokens_off  ``average_tokens_across_devices=False``: each rank divides by its own count   comparison
sum_not_mean    the loss reaches backward multiplied by GAS (a ``compute_loss`` that forgot    comparison
                to divide): a loop bug the oracle must see
gas1            the Trainer at GAS = 1 (``gas_verdict``'s baseline)                            baseline
harness         the plain-PyTorch loop: ``all_reduce`` of sum-of-token-losses / global count   control
==============  =========================================================================  ==========

The releases are stacks of overlays: ``{"transformers": "4.45.2", "accelerate": "1.0.1"}`` (before the October 2024
gradient-accumulation loss fix, huggingface/transformers#34191 / #34198, first in 4.46.0), ``4.46.3`` (after it, and
the first with ``average_tokens_across_devices``, default off), and the installed one (default on). A release whose
``TrainingArguments`` lacks the argument makes the ``avg_tokens_*`` cases ``cannot-run`` with that sentence.
"""
from __future__ import annotations

from gradkit import config as kconfig
from gradkit.judge import naming, oracle
from gradkit.probes import runner, trainer_ga
from gradkit.probes.probe import Probe

BUG = "HFT"
CASES = {"trainer": ("measured", {}), "avg_tokens_on": ("measured", {"average_tokens_across_devices": True}),
         "avg_tokens_off": ("comparison", {"average_tokens_across_devices": False}),
         "sum_not_mean": ("comparison", {})}
STACKS = {"installed": {}, "transformers 4.46.3": {"transformers": "4.46.3", "accelerate": "1.0.1"},
          "transformers 4.45.2": {"transformers": "4.45.2", "accelerate": "1.0.1"}}


def plan(gas_values=(4,), cases=tuple(CASES), global_batch: int = 8, seed: int = 0) -> list[dict]:
    """Per GAS the harness; the GAS = 1 baseline; every case at every GAS > 1 (micro-batch = global_batch / GAS
    rows per rank)."""
    bad = set(cases) - set(CASES)
    if bad:
        raise kconfig.ConfigError(f"unknown Trainer-DDP case(s) {sorted(bad)}; known: {list(CASES)}")
    common = {"path": "no_ds", "zero_stage": None, "dtype": "fp32", "seed": seed, "arch": "llama", "attribute": True}
    out = []
    for gas in sorted({1, *gas_values}):
        kconfig.check_ga(gas)
        if global_batch % gas:
            raise kconfig.ConfigError(f"GAS {gas} does not divide the global batch {global_batch}")
        out.append({"name": "harness", "role": "control", **common, "path": trainer_ga.HARNESS_PATH,
                    "micro_batch": global_batch // gas, "ga": gas})
    out.append({"name": "gas1", "role": "baseline", **common, "micro_batch": global_batch, "ga": 1})
    for gas in gas_values:
        for name in cases:
            if gas > 1:
                role, args = CASES[name]
                out.append({"name": name, "role": role, **common, "micro_batch": global_batch // gas, "ga": gas,
                            "trainer_args": args, **({"fix": "fault_undivided"} if name == "sum_not_mean" else {})})
    return out


def validate(stacks, gas_values, cases, world_sizes, global_batch: int, device: str, timeout_s: float) -> None:
    kconfig.check_device(device)
    kconfig.check_timeout(timeout_s)
    for name, values in (("STACKS", stacks), ("GAS_VALUES", gas_values), ("CASES", cases),
                         ("WORLD_SIZES", world_sizes)):
        kconfig.check_list(name, values)
    for w in world_sizes:
        kconfig.check_world_size(w, device)
    for st in stacks:
        if not isinstance(st, dict) or set(st) - {"transformers", "accelerate"}:
            raise kconfig.ConfigError(f"a Trainer-DDP stack pins transformers and accelerate only, got {st!r}")
        for version in st.values():
            kconfig.check_version(version)
    kconfig.check_positive_int("global_batch", global_batch)
    plan(gas_values, cases, global_batch)


def run(stacks=({},), gas_values=(4,), cases=tuple(CASES), world_sizes=(2,), global_batch: int = 8, seed: int = 0,
        device: str = "cpu", timeout_s: float = kconfig.DEFAULT_TIMEOUT_S) -> list[dict]:
    """Every case at every GAS under every stack and world size; ``verdict`` against the harness of the same GAS,
    ``gas_verdict`` against the GAS = 1 Trainer step, ``token_factor`` / ``gas_factor`` as in B1."""
    validate(stacks, gas_values, cases, world_sizes, global_batch, device, timeout_s)
    return runner.run(PROBE, plan(gas_values, cases, global_batch, seed), [dict(s) for s in stacks], world_sizes,
                      device, timeout_s, meta={"seed": seed}, label=trainer_ga.stack_label)


def violations(recs: list[dict]) -> list[str]:
    """What the notebook asserts of the Trainer on several ranks: the harness is exact; the loop bug is seen (its
    first step GAS x the same release's first ``trainer`` step); a run that raised is ``cannot-run``."""
    bad = []
    trainer = {(r["version"], r["world_size"], r["ga"]): r for r in recs if r["case"] == "trainer"}
    for r in recs:
        where = f"{r['version']} W={r['world_size']} GAS={r['ga']} {r['case']}"
        if r["role"] == "control" and r["verdict"] != oracle.NOT_AFFECTED:
            bad.append(f"{where}: the plain-PyTorch harness is {r['verdict']}: {r['reason'][:300]}")
        if r.get("error") and r["verdict"] != oracle.CANNOT_RUN:
            bad.append(f"{where}: it raised but its verdict is {r['verdict']}")
        base = trainer.get((r["version"], r["world_size"], r["ga"]))
        if r["case"] == "sum_not_mean" and not r.get("error") and base and base.get("steps"):
            # the first step: the same rows from the same weights (later steps start where each loop left them;
            # a record's own numbers are its worst step's)
            times = [a["metrics"]["norm_ratio"] / b["metrics"]["norm_ratio"] for a, b in zip(r["steps"], base["steps"])][:1]
            if r["verdict"] != oracle.AFFECTED or not times or any(abs(t / r["ga"] - 1) > 1e-3 for t in times):
                bad.append(f"{where}: the undivided loss is {r['verdict']} at "
                           f"{', '.join(f'{t:.4f}' for t in times)}x the Trainer's steps (GAS = {r['ga']} expected)")
    return bad


def annotate_world(recs: list[dict]) -> list[dict]:
    """B1's token and GAS factors and GAS verdict, then each step's fitted weights in words (``shape``: which
    rank's micro-batches weighed what)."""
    out = [naming.annotate_steps(r) if r.get("steps") else r for r in trainer_ga.annotate_world(recs)]
    for r in out:
        config = r.get("config") or {}
        args = {**(config.get("trainer_args") or {}), **(config.get("trainer_attrs") or {})}
        if r["case"] == "trainer" and args:  # a check's own TrainingArguments (and what a framework sets on the Trainer)
            r["setting"] = ", ".join(f"{k}={v}" for k, v in sorted(args.items()))
            continue
        r["setting"] = {"trainer": "as shipped", "avg_tokens_on": "average_tokens_across_devices=True",
                        "avg_tokens_off": "average_tokens_across_devices=False",
                        "sum_not_mean": "loss x GAS (loop bug)"}.get(r["case"], r["case"])
    return out


def explorer_kwargs(sel: dict, device: str, timeout_s: float) -> dict:
    return {"stacks": [STACKS[sel["version"]]], "gas_values": [sel["ga"]], "cases": ["trainer"],
            "world_sizes": [sel["world_size"]], "device": device, "timeout_s": timeout_s}


PROBE = Probe(
    id=BUG, title="HF Trainer on several ranks without DeepSpeed (DDP), token counts differing per rank",
    module="trainer_ddp", notebook="07_without_deepspeed.ipynb", measured_case="trainer",
    ratio_meaning="effective / reference gradient of the Trainer's DDP step (GAS > 1), reference: mean over every "
                  "label token of the global batch",
    advice="the Trainer's step on several ranks is off the global token mean: set average_tokens_across_devices=True "
           "(transformers >= 4.46.3; the default from 5.0) and upgrade past 4.46.0 (huggingface/transformers#34191)",
    run=run,
    quick_plan=lambda w: dict(world_sizes=(max(w, 2),), gas_values=(4,), cases=("trainer",)),
    knobs={"world_size": [2, 3], "ga": [4, 2, 8], "zero_stage": ["none"], "dtype": ["fp32"], "version": list(STACKS)},
    explorer_kwargs=explorer_kwargs, init="torch", packages=("torch", "transformers", "accelerate"), typical_s=40.0,
    annotate=annotate_world, violations=violations, order=13, control_key=lambda r: r["ga"])
