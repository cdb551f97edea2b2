"""A user's DeepSpeed config as the check (``gradkit.probes.ds_config``) runs it: read (``load``) and resolved
(``resolve``).

    cfg = ds_config.resolve(ds_config.load("ds_config.json"), world_size=2)   # through the check's module

Everything in the config that touches gradients is kept (ZeRO stage, bf16 / fp16, ``data_types``,
``communication_data_type``, offload, bucket sizes, ``gradient_predivide_factor``, ``prescale_gradients``,
``bf16.immediate_grad_update`` ...). What would hide the measurement is replaced, and said: the optimizer
becomes SGD (lr = 1, no momentum or weight decay), the scheduler goes, bucket sizes shrink so the tiny model
spans several buckets, fp16's dynamic loss scale raises its scale every ``WINDOW`` steps. Clipping is kept: every loss is scaled so
the clip acts, and the expected step is the reference clipped.
"""
from __future__ import annotations

import copy
import json

from gradkit import config as kconfig
from gradkit.probes import ds_features
from gradkit.probes.ranks.ds_config import DEPTH, HIDDEN, MICRO_BATCH

PARAMS = DEPTH * (HIDDEN * HIDDEN + HIDDEN)  # the tiny model's parameter count
BUCKETS = 3  # the tiny model spans this many buckets
BUCKET_KEYS = ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size")
TRAINER_MAX_GRAD_NORM = 1.0  # what HF Trainer's "auto" gradient_clipping becomes (TrainingArguments.max_grad_norm)
DROPPED = ("optimizer", "scheduler", "tensorboard", "wandb", "csv_monitor", "comet", "flops_profiler",
           "steps_per_print", "wall_clock_breakdown")


class Resolved(dict):
    """The config that will run (a dict), with ``notes``: every change made to the user's config, in words, and
    ``refused``: why the kit cannot judge it at all (None: it can)."""

    notes: list
    refused: str | None = None
    model: object = None  # what ``gradkit.commands.check`` runs it on (a shape's name, or an architecture's keys)
    # the user's config as written, only what any run here needs resolved (``as_written``): where DeepSpeed refuses
    # the config the kit runs, the ranks hand it this one, and only its refusal is DeepSpeed's refusal of the config
    as_written: dict | None = None
    world_size: int | None = None  # the ranks ``gradkit.commands.check`` runs it on (the run's own, where known)


WINDOW = 2  # the loss_scale_window a dynamic fp16 scale is judged with: an increase every 2 overflow-free steps


def dynamic_scale(cfg: dict) -> bool:
    """fp16 with DeepSpeed's dynamic loss scale (``fp16.loss_scale`` 0 or absent)."""
    f = cfg.get("fp16") or {}
    return f.get("enabled") is True and not f.get("loss_scale", 0)


def _auto(value) -> bool:
    return value == "auto"


def _enabled(section, name: str, notes: list, trainer_dtype: str) -> bool:
    if not isinstance(section, dict):
        raise kconfig.ConfigError(f'"{name}" must be an object like {{"enabled": true}}, got {section!r}')
    on = section.get("enabled", False)
    if _auto(on):
        on = trainer_dtype == name
        notes.append(f'{name}.enabled "auto" -> {str(on).lower()} (the Trainer takes it from --{name}; '
                     f"this check's --trainer-dtype is {trainer_dtype})")
    if not isinstance(on, bool):
        raise kconfig.ConfigError(f'"{name}.enabled" must be true, false or "auto", got {on!r}')
    return on


def resolve(user: dict, world_size: int = 2, ga: int = 4, trainer_dtype: str = "fp32", micro_batch: int | None = None,
            max_grad_norm: float | None = None, ga_from_run: bool = False) -> Resolved:
    """The user's config as the kit will run it; ``ConfigError`` (exit 2) on anything DeepSpeed would not accept.

    "auto" values are resolved as HF Trainer's ``HfTrainerDeepSpeedConfig`` does, from its arguments: the
    micro-batch from ``per_device_train_batch_size`` (the kit's ``MICRO_BATCH``), GA from
    ``gradient_accumulation_steps`` (``ga``), ``train_batch_size`` = micro-batch x GA x world size, fp16 / bf16
    from ``trainer_dtype``, ``reduce_bucket_size`` = hidden x hidden, ``stage3_prefetch_bucket_size`` =
    0.9 x hidden x hidden, ``stage3_param_persistence_threshold`` = 10 x hidden (hidden: the kit's model's).
    ``micro_batch`` / ``max_grad_norm``: the training run's ``per_device_train_batch_size`` / ``max_grad_norm``
    where it is known (``gradkit.frameworks``). ``ga_from_run``: ``ga`` is the run's own GA, so a GA of 1 is judged as
    such (a bare config's GA 1 means the user's own loop accumulates: every loop style then takes ``ga``).
    The shipped-config features the kit judges differently or cannot judge are ``gradkit.probes.ds_features``'s.
    """
    if not isinstance(user, dict):
        raise kconfig.ConfigError(f"a DeepSpeed config is a JSON object, got {type(user).__name__}")
    kconfig.check_world_size(world_size)
    kconfig.check_ga(ga)
    if trainer_dtype not in ("fp32", "bf16", "fp16"):
        raise kconfig.ConfigError(f"--trainer-dtype must be fp32, bf16 or fp16, got {trainer_dtype!r}")
    cfg, notes = copy.deepcopy(user), []
    refused = ds_features.optimizer_refusal(cfg)  # before the kit's SGD takes the optimizer's place
    for key in DROPPED:
        if key in cfg:
            cfg.pop(key)
            notes.append(f'"{key}" removed' + (": the optimizer is SGD, lr = 1, no momentum or weight decay, so "
                                               "the update is the gradient" if key == "optimizer" else ""))
    mb = cfg.get("train_micro_batch_size_per_gpu", MICRO_BATCH)
    if _auto(mb) or "train_micro_batch_size_per_gpu" not in cfg:
        notes.append(f"train_micro_batch_size_per_gpu {'auto' if _auto(mb) else 'absent'} -> {MICRO_BATCH}"
                     + (f" (the run's per_device_train_batch_size is {micro_batch}: the kit's micro-batches hold "
                        f"{MICRO_BATCH} samples; how many rows a micro-batch holds does not change how micro-batches "
                        "are accumulated)" if micro_batch and micro_batch != MICRO_BATCH else ""))
        mb = MICRO_BATCH
    g = cfg.get("gradient_accumulation_steps", ga)
    if _auto(g) or "gradient_accumulation_steps" not in cfg:
        notes.append(f"gradient_accumulation_steps {'auto' if _auto(g) else 'absent'} -> {ga}")
        g = ga
    kconfig.check_positive_int("train_micro_batch_size_per_gpu", mb)
    kconfig.check_ga(g)
    if g == 1 and not ga_from_run:  # nothing to accumulate in the config: the user's own loop accumulates (B3's pattern)
        notes.append(f"gradient_accumulation_steps 1: every loop style takes N = {ga} micro-batches per step "
                     f"(--ga); engine and boundary run it as config GA = {ga}, manual and unmanaged as config GA = 1 "
                     f"with {ga} backward() calls")
        g = ga
    tbs = cfg.get("train_batch_size")
    if tbs is not None and not _auto(tbs) and tbs != mb * g * world_size:
        notes.append(f"train_batch_size {tbs} -> {mb * g * world_size} (micro-batch {mb} x GA {g} x {world_size} ranks)")
    cfg.update(train_micro_batch_size_per_gpu=mb, gradient_accumulation_steps=g, train_batch_size=mb * g * world_size)
    clip = cfg.get("gradient_clipping", 0.0)
    if _auto(clip):
        clip = TRAINER_MAX_GRAD_NORM if max_grad_norm is None else max_grad_norm
        notes.append(f"gradient_clipping auto -> {clip:g} (" + ("the Trainer's max_grad_norm default)" if max_grad_norm
                                                                 is None else "the run's max_grad_norm)"))
    if not isinstance(clip, (int, float)) or clip < 0:
        raise kconfig.ConfigError(f"gradient_clipping must be a number >= 0 or \"auto\", got {clip!r}")
    if clip:
        notes.append(f"gradient_clipping {clip:g} kept: every loss is scaled so the first step's reference norm is "
                     f"twice the clip, so the clip acts in every step (the expected step is the reference clipped)")
    cfg["gradient_clipping"] = float(clip)
    cfg["steps_per_print"] = 10 ** 9
    cfg["zero_allow_untested_optimizer"] = True
    bf16 = _enabled(cfg.get("bf16", {}), "bf16", notes, trainer_dtype)
    fp16 = _enabled(cfg.get("fp16", {}), "fp16", notes, trainer_dtype)
    if bf16 and fp16:
        raise kconfig.ConfigError("bf16 and fp16 are both enabled: DeepSpeed accepts one of them")
    for name, on in (("bf16", bf16), ("fp16", fp16)):
        if name in cfg:
            cfg[name] = {**cfg[name], "enabled": on}
    refused = refused or ds_features.apply(cfg, notes, fp16, world_size)
    if fp16 and dynamic_scale(cfg):
        window = cfg["fp16"].get("loss_scale_window", 1000)
        if not isinstance(window, (int, float)) or window < 1:
            raise kconfig.ConfigError(f"fp16.loss_scale_window must be a number >= 1, got {window!r}")
        if window > WINDOW:
            cfg["fp16"]["loss_scale_window"] = WINDOW
            notes.append(f"fp16.loss_scale_window {window:g} -> {WINDOW}: DeepSpeed's own dynamic loss scaler runs "
                         f"(initial scale, hysteresis and floor as configured); with this window it raises the scale "
                         f"after every {WINDOW} steps without an overflow, so its increases (one step in {window:g} "
                         "of the run) and any overflow skip fall inside the judged steps")
    zero = cfg.setdefault("zero_optimization", {})
    if not isinstance(zero, dict):
        raise kconfig.ConfigError(f'"zero_optimization" must be an object, got {zero!r}')
    stage = zero.setdefault("stage", 0)
    kconfig.check_zero_stage(stage)
    hidden_auto = {"reduce_bucket_size": HIDDEN * HIDDEN, "stage3_prefetch_bucket_size": int(0.9 * HIDDEN * HIDDEN),
                   "stage3_param_persistence_threshold": 10 * HIDDEN}
    for key, value in hidden_auto.items():
        if _auto(zero.get(key)):
            zero[key] = value
            notes.append(f"zero_optimization.{key} auto -> {value} (the Trainer's rule, on the kit's hidden size "
                         f"{HIDDEN})")
    small = max(PARAMS // BUCKETS, 64)
    for key in BUCKET_KEYS:
        value = zero.get(key)
        if value is not None and not isinstance(value, (int, float)):
            raise kconfig.ConfigError(f"zero_optimization.{key} must be a number, got {value!r}")
        if value is not None and value > small:
            zero[key] = small
            notes.append(f"zero_optimization.{key} {value:g} -> {small} (small buckets: the kit's MLP of {PARAMS} "
                         f"parameters spans {BUCKETS}, as a large model spans many)")
    if "stage3_param_persistence_threshold" in zero and zero["stage3_param_persistence_threshold"] > 10 * HIDDEN:
        notes.append(f"zero_optimization.stage3_param_persistence_threshold {zero['stage3_param_persistence_threshold']:g}"
                     f" -> {10 * HIDDEN} (else every parameter of the kit's model would persist, unpartitioned)")
        zero["stage3_param_persistence_threshold"] = 10 * HIDDEN
    if zero.get("cpu_offload") is True:  # the pre-0.5 spelling of offload_optimizer: {"device": "cpu"}
        cfg["zero_force_ds_cpu_optimizer"] = False
        notes.append("zero_optimization.cpu_offload true kept (offload_optimizer cpu in today's spelling); "
                     "zero_force_ds_cpu_optimizer -> false (offloaded steps run the kit's SGD, not CPU Adam)")
    for key in ("offload_optimizer", "offload_param"):
        off = zero.get(key)
        if off is None:
            continue
        device = off.get("device", "none") if isinstance(off, dict) else None
        if device not in ("cpu", "none", "nvme"):
            raise kconfig.ConfigError(f'zero_optimization.{key}.device must be "cpu", "nvme" or "none", got {off!r}')
        if key == "offload_optimizer" and device == "cpu":
            cfg["zero_force_ds_cpu_optimizer"] = False
            notes.append("zero_force_ds_cpu_optimizer -> false (offloaded steps run the kit's SGD, not CPU Adam)")
    types = cfg.get("data_types", {})
    if not isinstance(types, dict) or types.get("grad_accum_dtype", "fp32") not in ("fp32", "bf16", "fp16"):
        raise kconfig.ConfigError(f'data_types.grad_accum_dtype must be "fp32", "bf16" or "fp16", got {types!r}')
    if cfg.get("communication_data_type") not in (None, "fp32", "bf16", "fp16"):
        raise kconfig.ConfigError(f'communication_data_type must be "fp32", "bf16" or "fp16", got '
                                  f"{cfg['communication_data_type']!r}")
    out = Resolved(cfg)
    out.notes = notes
    out.refused = refused
    out.as_written = as_written(user, cfg)
    return out


def as_written(user: dict, resolved: dict) -> dict:
    """``user`` as written, with only what any run here must change: every "auto" takes its resolved value (dropped
    where the resolved config has none), the batch sizes are the ones resolved for this world (micro-batch x GA x
    ranks), and the optimizer, scheduler and monitors go (the kit's SGD steps; no monitor touches a gradient)."""
    def fill(mine, theirs):
        if not isinstance(mine, dict):
            return mine
        out = {}
        for key, value in mine.items():
            there = theirs.get(key) if isinstance(theirs, dict) else None
            if _auto(value):
                if there is not None and not _auto(there):
                    out[key] = there
            else:
                out[key] = fill(value, there)
        return out

    out = fill({k: v for k, v in user.items() if k not in DROPPED}, resolved)
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
                "zero_allow_untested_optimizer"):
        out[key] = resolved[key]
    return out


def load(path) -> dict:
    """A DeepSpeed JSON config from a file; ``ConfigError`` names what is wrong with it."""
    from pathlib import Path

    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise kconfig.ConfigError(f"cannot read {p}: {e.strerror or e}") from None
    try:
        return json.loads(text)
    except ValueError as e:
        raise kconfig.ConfigError(f"{p} is not valid JSON: {e}") from None
