"""How each known bug is measured on one release: its **recipe** (the configuration or the probe that shows it, the
loop or case judged, the model, the package whose releases decide and what the rest of the stack holds). Notebook
08, ``gradkit bisect --known`` and the pins of ``gradkit.judge.expectations`` all measure a bug this one way, so a pin
found by one is re-measured by the others exactly as it was found.

``measure(recipe)`` is a bisect's ``measure(release) -> result``; ``command(recipe)`` the ``gradkit bisect`` line
that runs the same search by hand; ``needs(recipe, releases)`` the ``(probe, stack)`` pairs to prefetch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from gradkit import config as kconfig
from gradkit import probes
import gradkit.commands.bisect.listing as listing
import gradkit.commands.bisect.result as result
from gradkit.probes import ds_config


@dataclass(frozen=True)
class Recipe:
    name: str  # "B5", "B3 opt-out", "B1 on DeepSpeed": the series' name in the release history
    bug: str  # the entry of gradkit.judge.expectations.KNOWN it measures
    axis: str  # the package whose releases are bisected
    oldest: str  # the oldest release looked at: older ones do not run here (said in ``older``)
    older: str  # why releases older than ``oldest`` are not looked at
    config: dict | None = None  # a DeepSpeed config, judged through gradkit check's probe ...
    loop: str = "engine"
    model: str | None = None
    probe: str | None = None  # ... or a registered probe's run, judged on ``case``
    plan: dict = field(default_factory=dict)  # the probe's run keywords (its quick plan where empty)
    case: str | None = None
    fixed: tuple = ()  # ((package, release), ...) held in every stack: the other side of a two-package bug


MB4 = {"train_micro_batch_size_per_gpu": 4}
TF_OLDEST = ("4.45.2", "transformers before 4.45 is not installable beside torch 2.13 and accelerate 1.0.1 here")
DS_OLDEST = ("0.14.4", "DeepSpeed 0.14.0 - 0.14.3 do not import on torch 2.13 (gradkit bisect, B5's search)")
RECIPES = {r.name: r for r in (
    Recipe("B1", "B1", "transformers", *TF_OLDEST, probe="B1", case="trainer",  # Llama: Qwen3 arrives in 4.51.0
           plan={"paths": ("no_ds", "ds_zero0"), "gas_values": (1, 4), "cases": ("trainer",), "world_size": 1,
                 "arch": "llama"}),
    Recipe("B1 on DeepSpeed", "B1", "deepspeed", *DS_OLDEST, probe="B1", case="trainer",
           plan={"paths": ("ds_zero0",), "gas_values": (4,), "cases": ("trainer",), "world_size": 1},
           fixed=(("transformers", "5.3.0"),)),
    Recipe("B2", "B2", "deepspeed", *DS_OLDEST, probe="B2", case="pipeline",
           plan={"splits": ((2, 4),), "dtypes": ("fp32",), "zero_stages": (0,), "world_sizes": (2,)}),
    Recipe("B3", "B3", "deepspeed", *DS_OLDEST, config={**MB4, "gradient_accumulation_steps": 4,
                                                        "zero_optimization": {"stage": 1}}, loop="manual"),
    Recipe("B3 opt-out", "B3", "deepspeed", "0.19.0", "the key \"managed_gradient_accumulation\" arrives in 0.19.4 "
           "(deepspeedai/DeepSpeed#8184): the check runs its loop from there only", config={
               **MB4, "gradient_accumulation_steps": 4, "zero_optimization": {"stage": 1}}, loop="unmanaged"),
    Recipe("B4", "B4", "deepspeed", *DS_OLDEST, config={**MB4, "gradient_accumulation_steps": 4, "bf16": {"enabled": True},
                                                        "data_types": {"grad_accum_dtype": "fp32"},
                                                        "zero_optimization": {"stage": 1}}),
    Recipe("B5", "B5", "deepspeed", *DS_OLDEST, config={**MB4, "gradient_accumulation_steps": 8, "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu"}}}),
    Recipe("B6", "B6", "deepspeed", *DS_OLDEST, config={**MB4, "gradient_accumulation_steps": 4,
                                                        "zero_optimization": {"stage": 3}}, model="conditional"),
    Recipe("B7", "B7", "deepspeed", *DS_OLDEST, config={**MB4, "gradient_accumulation_steps": 4, "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu"}}}, model="conditional"),
    Recipe("B8", "B8", "deepspeed", *DS_OLDEST, config={**MB4, "gradient_accumulation_steps": 4,
                                                        "communication_data_type": "fp32",
                                                        "zero_optimization": {"stage": 1, "contiguous_gradients": False}}),
    Recipe("B9", "B9", "deepspeed", *DS_OLDEST, config={**MB4, "gradient_accumulation_steps": 4, "fp16": {
        "enabled": True, "loss_scale": 256}}),  # static: B10's growth steps are B10's recipe
    Recipe("B10", "B10", "deepspeed", *DS_OLDEST, config={**MB4, "gradient_accumulation_steps": 4, "fp16": {
        "enabled": True, "loss_scale": 0, "initial_scale_power": 16}, "zero_optimization": {"stage": 2}}),
    Recipe("B11", "B11", "deepspeed", *DS_OLDEST, config={**MB4, "gradient_accumulation_steps": 4, "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu"}}}, loop="manual"),
    Recipe("B12", "B12", "deepspeed", *DS_OLDEST, config={**MB4, "gradient_accumulation_steps": 4,
                                                         "zero_optimization": {"stage": 2}}),
    Recipe("B13", "B13", "deepspeed", *DS_OLDEST, config={**MB4, "gradient_accumulation_steps": 4, "bf16": {"enabled": True},
                                                         "data_types": {"grad_accum_dtype": "fp32"}, "zero_optimization": {
                                                             "stage": 1, "offload_optimizer": {"device": "cpu"}}}),
    Recipe("ACC", "ACC", "accelerate", "0.27.0", "accelerate before 0.27 is not installed here (sync_each_batch "
           "arrives in 0.28.0)", probe="ACC", case="sync_each_batch",
           plan={"world_sizes": (2,), "ga_values": (4,), "cases": ("control", "sync_each_batch")}),
    Recipe("HFT", "HFT", "transformers", *TF_OLDEST, probe="HFT", case="trainer"),
    Recipe("HFT gas1", "HFT", "transformers", *TF_OLDEST, probe="HFT", case="gas1"),
    Recipe("HFT avg_tokens_on", "HFT", "transformers", *TF_OLDEST, probe="HFT", case="avg_tokens_on",
           plan={"world_sizes": (2,), "gas_values": (4,), "cases": ("trainer", "avg_tokens_on")}),
)}


def stack_of(recipe: Recipe, release: str) -> dict:
    """The world stack that measures ``release`` for ``recipe``: the release (or the installed one) and what the
    recipe holds fixed."""
    return {**dict(recipe.fixed), **listing.stack_of(release, recipe.axis)}


def measure(recipe: Recipe, world_size: int = 2, device: str = "cpu", timeout_s: float = 600,
            steps: int = ds_config.STEPS):
    """``measure(release) -> result`` for ``recipe`` (``gradkit.commands.bisect.result``)."""
    if recipe.probe:
        probe = probes.get(recipe.probe)
        plan = dict(recipe.plan) or probe.quick_plan(world_size)
        return result.probe_measure(probe, {**plan, "device": device, "timeout_s": timeout_s}, recipe.case or
                                    probe.measured_case, recipe.axis, fixed=dict(recipe.fixed))
    cfg = resolved(recipe, world_size)
    return result.measure_with(cfg, recipe.loop, world_size, device, timeout_s, steps, recipe.model,
                               fixed=dict(recipe.fixed))


def resolved(recipe: Recipe, world_size: int = 2) -> ds_config.Resolved:
    user = recipe.config
    return ds_config.resolve(user, world_size, user.get("gradient_accumulation_steps", 4), ds_config.dtype_of(user))


def probe_of(recipe: Recipe):
    return probes.get(recipe.probe) if recipe.probe else ds_config.CHECK


def needs(recipe: Recipe, releases) -> list:
    """The ``(probe, stack)`` pairs measuring ``releases`` takes (``gradkit.stacks.prefetch``)."""
    installed = [kconfig.INSTALLED]
    return [(probe_of(recipe), stack_of(recipe, r) if r not in installed else dict(recipe.fixed)) for r in releases]


def command(recipe: Recipe, frm: str | None = None, to: str | None = None) -> str:
    """The ``gradkit bisect`` line that measures ``recipe`` the same way, over ``frm`` .. ``to``."""
    return f"gradkit bisect --known '{recipe.name}' --from {frm or recipe.oldest}" + (f" --to {to}" if to else "")
