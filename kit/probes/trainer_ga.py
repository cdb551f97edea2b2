"""B1 (work in progress): HF Trainer + DeepSpeed with a ``model_accepts_loss_kwargs=True`` model.

The seed (``000``) compares the Trainer's logged grad norm with and without DeepSpeed and concludes
that DeepSpeed sums micro-batch gradients. A ratio between two paths does not say which one is
wrong, so this probe judges every path against the reference: one real ``transformers.Trainer``
step (SGD, lr=1, constant schedule, no clipping, no weight decay) on a tiny ``Qwen3ForCausalLM``
built from a config (no download), on a synthetic token dataset whose samples have different
numbers of label tokens, compared with the plain fp32 gradient of the global batch's loss: the
mean over all its label tokens, which is what the Trainer means to apply.

Paths: ``no_ds`` (the Trainer alone) and ``ds_zero0`` / ``ds_zero2`` / ``ds_zero3``. Cases per path and GAS:

=================  ==========================================================================  ==========
case               what                                                                        role
=================  ==========================================================================  ==========
trainer            the Trainer as shipped                                                      measured
accepts_false      ``trainer.model_accepts_loss_kwargs = False`` (the seed's workaround)       workaround
fix_scale_gas      seed fix 1: under DeepSpeed pass ``scale_wrt_gas=True`` when the Trainer     fix
                   did not divide the loss itself
fix_always_divide  seed fix 2: always divide the loss by GAS, always ``scale_wrt_gas=False``    fix
gas1               the same path with GAS = 1 (nothing to accumulate)                          baseline
harness            the same model and rows through a plain PyTorch loop (no Trainer,            control
                   Accelerate or DeepSpeed): ``torch.distributed.all_reduce`` and SGD
=================  ==========================================================================  ==========

Two named verdicts per step:

- ``verdict`` -- *matches the reference*: the applied gradient against the fp32 reference of the global batch,
  with the ``harness`` step of the same GAS as the control. The control does not depend on the library under
  test: whatever transformers counts, the harness either reproduces the reference or the harness is suspect.
- ``gas_verdict`` -- *GAS-invariant*: the applied gradient against the same path's GAS = 1 step (``gas1``), the
  report's own question. A path can be GAS-invariant and still not match the reference (transformers 5.3.0
  counts one label token too many per sequence, so every path applies tokens / (tokens + sequences)).

The trace records, per micro-batch, what ``compute_loss`` returned and with which ``num_items_in_batch``
(against the label tokens the loss really sums over: labels are shifted by one inside the model), and
what ``accelerator.backward`` received, by wrapping the real calls. What its ranks run is
``gradkit.probes.ranks.trainer_ga`` (the trace: ``gradkit.probes.ranks.trainer_trace``).
"""
from __future__ import annotations

import math

from gradkit import config as kconfig
from gradkit.judge import oracle, tolerances
from gradkit.probes import runner
from gradkit.probes.probe import Probe
from gradkit.probes.ranks.trainer_ga import ARCHS, PATHS
from gradkit.stacks import versions
from gradkit.stacks.versions import PACKAGES

BUG = "B1"
CASES = {
    "trainer": {"role": "measured"},
    "accepts_false": {"role": "workaround"},
    "fix_scale_gas": {"role": "fix"},
    "fix_always_divide": {"role": "fix"},
    "gas1": {"role": "baseline"},
    "harness": {"role": "control"},
}
HARNESS_PATH = "harness"  # the plain-PyTorch control runs outside every Trainer path


def plan(paths=tuple(PATHS), gas_values=(1, 2, 4, 8), cases=tuple(CASES), global_batch: int = 8,
         seed: int = 0, arch: str = "qwen3") -> list[dict]:
    """Per GAS the plain-PyTorch ``harness`` control; per path the GAS = 1 baseline, then every case at every GAS > 1
    (micro-batch = global_batch / GAS). ``arch``: the tiny model (Qwen3, as the report; ``llama`` runs on every
    transformers release the kit installs, Qwen3 from 4.51.0 only)."""
    if arch not in ARCHS:
        raise kconfig.ConfigError(f"unknown B1 model {arch!r}; known: {list(ARCHS)}")
    unknown = set(paths) - set(PATHS)
    if unknown:
        raise kconfig.ConfigError(f"unknown B1 path(s) {sorted(unknown)}; known: {list(PATHS)}")
    bad = set(cases) - set(CASES)
    if bad:
        raise kconfig.ConfigError(f"unknown B1 case(s) {sorted(bad)}; known: {list(CASES)}")
    out = []
    for gas in sorted({1, *gas_values}):
        kconfig.check_ga(gas)
        if global_batch % gas:
            raise kconfig.ConfigError(f"GAS {gas} does not divide the global batch {global_batch}")
        out.append({"name": "harness", **CASES["harness"], "path": HARNESS_PATH, "zero_stage": None,
                    "dtype": "fp32", "micro_batch": global_batch // gas, "ga": gas, "seed": seed, "arch": arch})
    for path in paths:
        out.append({"name": "gas1", **CASES["gas1"], "path": path, "zero_stage": PATHS[path],
                    "dtype": "fp32", "micro_batch": global_batch, "ga": 1, "seed": seed, "arch": arch})
        for gas in gas_values:
            if gas == 1:
                continue
            for name in cases:
                if name not in ("gas1", "harness"):
                    out.append({"name": name, **CASES[name], "path": path, "zero_stage": PATHS[path],
                                "dtype": "fp32", "micro_batch": global_batch // gas, "ga": gas, "seed": seed,
                                "arch": arch})
    return out


def validate(stacks, paths, gas_values, cases, world_size: int, global_batch: int, device: str,
             timeout_s: float) -> None:
    """Every knob of the B1 notebook, checked before the first launch (``ConfigError`` says which)."""
    kconfig.check_device(device)
    kconfig.check_world_size(world_size, device)
    kconfig.check_timeout(timeout_s)
    for name, values in (("STACKS", stacks), ("PATHS", paths), ("GAS_VALUES", gas_values), ("CASES", cases)):
        kconfig.check_list(name, values)
    for st in stacks:
        if not isinstance(st, dict):
            raise kconfig.ConfigError(f"a version stack is a mapping like {{'transformers': '5.3.0'}}, got {st!r}")
        for package, version in st.items():
            if package not in versions.PACKAGES:
                raise kconfig.ConfigError(f"stacks pin {versions.PACKAGES}, not {package!r}")
            kconfig.check_version(version)
    kconfig.check_positive_int("global_batch", global_batch)
    plan(paths, gas_values, cases, global_batch)


def check_notebook(p: dict) -> list:
    """Every parameter of notebook 01, by its name there (what the notebook and ``gradkit.notebooks.runall`` call
    first); returns the ``(probe, stack)`` pairs its worlds will run (``gradkit.stacks.prefetch``)."""
    validate(p["STACKS"], p["PATHS"], p["GAS_VALUES"], p["CASES"], p["WORLD_SIZE"], p["GLOBAL_BATCH"], p["DEVICE"],
             p["TIMEOUT_S"])
    return [(PROBE, stack) for stack in p["STACKS"]]


def violations(recs: list[dict]) -> list[str]:
    """The claims the B1 notebook asserts, each broken one as a sentence (empty list: all hold).

    0. every plain-PyTorch harness step (the control) is the reference: the harness itself is sound;
    1. every GAS = 1 step of the Trainer is the reference up to its token factor (the count ``num_items_in_batch``
       uses against the label tokens the loss sums, over every rank): whatever is off at GAS = 1 is that count,
       and the token factor is known for every step of a loss-kwargs model;
    2. every step the Trainer took as shipped has a GAS factor of GAS ** k for a whole k (k = 0 correct,
       +1 summed, -1 or -2: divided by GAS once or twice too often): its GAS handling is explained;
    3. the applied gradient keeps the reference's direction on every such step (cosine 1).
    """
    bad = []
    for r in recs:
        if r["case"] == "harness" and r["verdict"] == oracle.CANNOT_RUN:  # the world itself did not run
            bad.append(f"{r['version']} GAS={r['ga']}: the plain-PyTorch harness could not run, so nothing of this "
                       f"stack was measured: {r['reason'][:300]}")
        if r["verdict"] == oracle.CANNOT_RUN or not r.get("metrics"):
            continue
        where = f"{r['version']} {r['path']} GAS={r['ga']} {r['case']}"
        tol = tolerances.tolerance(r["dtype"]).norm_ratio
        if r["role"] == "control" and r["verdict"] != oracle.NOT_AFFECTED:
            bad.append(f"{where}: the plain-PyTorch harness is off the reference: {r['reason']}")
            continue
        if r["case"] in ("trainer", "gas1") and r.get("model_accepts_loss_kwargs") and r.get("token_factor") is None:
            bad.append(f"{where}: the token factor could not be computed from the ranks' traces")
        if r["role"] == "baseline" and r.get("gas_factor") is not None and abs(r["gas_factor"] - 1) > tol:
            bad.append(f"{where}: the GAS=1 step is off the reference by more than its token count explains "
                       f"({r['metrics']['norm_ratio']:.5f} vs token factor {r['token_factor']:.5f})")
        if r["case"] == "trainer" and r.get("gas_power") is not None:
            k = round(r["gas_power"])
            if abs(r["gas_factor"] / r["ga"] ** k - 1) > tol:
                bad.append(f"{where}: GAS factor {r['gas_factor']:.5f} is no whole power of GAS")
            if r["metrics"]["cosine"] < 1 - tol:
                bad.append(f"{where}: the applied gradient is rotated (cosine {r['metrics']['cosine']:.6f})")
    return bad


def stack_label(stack: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(stack.items())) or "installed"


def run(stacks=({},), paths=tuple(PATHS), gas_values=(1, 2, 4, 8), cases=tuple(CASES), world_size: int = 1,
        global_batch: int = 8, seed: int = 0, device: str = "cpu",
        timeout_s: float = 600, arch: str = "qwen3") -> list[dict]:
    """Every path x case x GAS under every version stack ({package: version}, {} = installed); one world each.

    Each record carries two verdicts: ``verdict`` (matches the reference; control: the plain-PyTorch ``harness``
    step of the same GAS from the same world) and ``gas_verdict`` (GAS-invariant: against the same path's GAS = 1
    step), plus ``token_factor`` (label tokens the loss sums over, on every rank / the ``num_items_in_batch`` it
    is divided by) and ``gas_factor`` (effective/reference ratio / token_factor: 1 correct, GAS summed, 1/GAS
    divided twice).
    """
    validate(stacks, paths, gas_values, cases, world_size, global_batch, device, timeout_s)
    todo = plan(paths, gas_values, cases, global_batch, seed, arch)
    return runner.run(PROBE, todo, [dict(st) for st in stacks], (world_size,), device, timeout_s, meta={"seed": seed},
                      label=stack_label)


def annotate_world(recs: list[dict]) -> list[dict]:
    baselines = {r["config"]["path"]: r for r in recs if r["case"] == "gas1"}
    return [_annotate(r, baselines.get(r["config"]["path"])) for r in recs]


def token_factor(rank_traces: list[list[dict]]) -> float | None:
    """Label tokens the loss really sums over, on every rank, over the count the Trainer divides by.

    The Trainer counts ``num_items_in_batch`` over a rank's whole accumulation window and, with
    ``average_tokens_across_devices``, sums it over ranks (every rank then holds the same global count);
    otherwise each rank divides by its own count and the ranks' gradients are averaged.
    """
    calls = [[t for t in trace or [] if t["call"] == "compute_loss"] for trace in rank_traces]
    if not calls or not all(calls) or any(c[0]["num_items_in_batch"] is None for c in calls):
        return None
    summed = [sum(t["label_tokens_shifted"] for t in c) for c in calls]
    items = [c[0]["num_items_in_batch"] for c in calls]
    if len(set(items)) == 1 and (len(calls) == 1 or items[0] > max(sum(t["label_tokens_unshifted"] for t in c)
                                                                   for c in calls)):
        return sum(summed) / items[0] if items[0] else None  # one global count
    return sum(s / n for s, n in zip(summed, items)) / len(items) if all(items) else None  # per-rank counts, averaged


def _annotate(rec: dict, baseline: dict | None = None) -> dict:
    """Token and GAS factors, and ``gas_verdict``: does GAS change the applied gradient at a fixed global batch?

    ``verdict`` (set by the records) judges the step against the reference, with the harness as control.
    ``gas_verdict`` judges it against the same path's GAS = 1 step: it answers the report's question even
    where that step is itself off the reference for a reason GAS does not change (the token count). Every judged
    step gets its own factors and ``gas_verdict`` (against the baseline's same step); the record's factors are its
    worst step's, its ``gas_verdict`` the worst of its steps'.
    """
    rec["path"] = rec["config"]["path"]
    steps = rec.get("steps") or [rec]
    base_steps = (baseline or {}).get("steps") or [baseline or {}]
    for i, st in enumerate(steps):
        _factors(st, rec["ga"])
        st["gas_verdict"] = _gas_verdict(rec, st, base_steps[min(i, len(base_steps) - 1)])
    if rec.get("steps"):
        worst = steps[rec.get("worst_step", 0)]
        for k in ("token_factor", "gas_factor", "gas_power", "ratio_vs_control"):
            if k in worst:
                rec[k] = worst[k]
        rec["gas_verdict"] = min((st["gas_verdict"] for st in steps),
                                 key=lambda v: oracle.WORST_FIRST.index(v) if v in oracle.WORST_FIRST else 99)
    elif not rec.get("metrics"):
        rec["gas_verdict"] = "n/a" if rec["role"] in ("control", "baseline") else oracle.CANNOT_RUN
    return rec


def _factors(part: dict, ga: int) -> None:
    """A step's ``token_factor`` (from every rank's trace of that step), ``gas_factor`` and ``gas_power``."""

    factor = token_factor(part.get("rank_traces") or [part.get("trace")]) if part.get("metrics") else None
    if factor:
        part["token_factor"] = factor
        part["gas_factor"] = part["metrics"]["norm_ratio"] / factor
        if ga > 1:  # GAS ** power: +1 summed, -1 divided once too often, ...
            part["gas_power"] = math.log(part["gas_factor"]) / math.log(ga)


def _gas_verdict(rec: dict, part: dict, base: dict) -> str:
    """One step against the same path's GAS = 1 step (same rows): is it GAS-invariant?"""
    if rec["role"] in ("control", "baseline"):
        return "n/a"
    if not part.get("metrics") or not base.get("metrics"):
        return oracle.CANNOT_RUN if not part.get("metrics") else oracle.INCONCLUSIVE
    vs = part["metrics"]["norm_ratio"] / base["metrics"]["norm_ratio"]
    part["ratio_vs_control"] = vs
    ok = abs(vs - 1) <= tolerances.tolerance(rec["dtype"]).norm_ratio and part["metrics"]["cosine"] > 0.9999
    return oracle.NOT_AFFECTED if ok else oracle.AFFECTED


STACKS = {"installed": {}, "transformers 5.3.0 + DeepSpeed 0.18.9": {"transformers": "5.3.0", "deepspeed": "0.18.9"}}


def explorer_kwargs(sel: dict, device: str, timeout_s: float) -> dict:
    path = "no_ds" if sel["zero_stage"] == "none" else f"ds_zero{sel['zero_stage']}"
    return {"stacks": [STACKS[sel["version"]]], "paths": [path], "gas_values": [1, sel["ga"]],
            "cases": ["trainer", "accepts_false"], "world_size": sel["world_size"], "device": device,
            "timeout_s": timeout_s}


PROBE = Probe(
    id=BUG, title="HF Trainer + DeepSpeed + model_accepts_loss_kwargs=True", module="trainer_ga",
    notebook="01_trainer_loss_kwargs.ipynb", measured_case="trainer",
    ratio_meaning="effective / reference gradient of the Trainer's step (GAS > 1)",
    advice="the Trainer's step is off the reference: read notebook 01 for which path GAS changes and what the token "
           "count costs; upgrade transformers (see the upstream table in kit/judge/expectations.py), and never add the "
           "report's extra division by GAS",
    run=run, check_notebook=check_notebook,
    quick_plan=lambda w: dict(paths=("no_ds", "ds_zero0"), gas_values=(1, 4), cases=("trainer",), world_size=1),
    knobs={"world_size": [1, 2], "ga": [4, 2, 8], "zero_stage": ["none", 0, 2, 3], "dtype": ["fp32"],
           "version": list(STACKS)},
    explorer_kwargs=explorer_kwargs, packages=PACKAGES, typical_s=45.0, annotate=annotate_world,
    violations=violations, order=1)
