"""How a DeepSpeed config is filled between the file and ``deepspeed.initialize``, re-implemented from:

- transformers src/transformers/integrations/deepspeed.py (5.23.0): HfTrainerDeepSpeedConfig.fill_match /
  trainer_config_process (the Trainer fills "auto" from TrainingArguments; a non-"auto" value that differs is a
  mismatch, raised in trainer_config_finalize),
- accelerate src/accelerate/utils/dataclasses.py (1.15.0 = huggingface/accelerate 16cb6eb8): DeepSpeedPlugin.__post_init__
  (the config built from ``accelerate config`` fields; a file gets gradient_accumulation_steps 1 where it has none),
  DeepSpeedPlugin._deepspeed_config_checks, DeepSpeedPlugin.set_mixed_precision,
- deepspeed/runtime/config.py (0.19.8): DeepSpeedConfig._batch_assertion,

and the bare-JSON reading (``read_bare``) for a config nobody drives yet.
"""
from __future__ import annotations

import copy

from gradkit.config import ConfigError
from gradkit.frameworks.run import TrainingRun, shown, unique, zero_stage_of

TRAINER = "transformers integrations/deepspeed.py HfTrainerDeepSpeedConfig.trainer_config_process"
PLUGIN = "accelerate utils/dataclasses.py DeepSpeedPlugin.__post_init__"
SET_MP = "accelerate utils/dataclasses.py DeepSpeedPlugin.set_mixed_precision"
# the plugin fields and the config keys they fill (DeepSpeedPlugin.__post_init__ plugin_to_config_mapping)
PLUGIN_KEYS = {"gradient_accumulation_steps": "gradient_accumulation_steps", "gradient_clipping": "gradient_clipping",
               "zero_stage": "zero_optimization.stage",
               "offload_optimizer_device": "zero_optimization.offload_optimizer.device",
               "offload_param_device": "zero_optimization.offload_param.device",
               "offload_param_nvme_path": "zero_optimization.offload_param.nvme_path",
               "offload_optimizer_nvme_path": "zero_optimization.offload_optimizer.nvme_path",
               "zero3_save_16bit_model": "zero_optimization.stage3_gather_16bit_weights_on_model_save"}
# accelerate config fields that a deepspeed_config_file makes an error (DeepSpeedPlugin._deepspeed_config_checks)
IGNORED_WITH_FILE = ("gradient_accumulation_steps", "gradient_clipping", "zero_stage", "offload_optimizer_device",
                     "offload_param_device", "offload_param_nvme_path", "offload_optimizer_nvme_path",
                     "zero3_save_16bit_model", "mixed_precision")
WATCHED = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "gradient_clipping",
           "bf16.enabled", "fp16.enabled")


def _node(cfg: dict, key_long: str):
    """accelerate utils/deepspeed.py HfDeepSpeedConfig.find_config_node: (the dict holding the key, the key)."""
    *nodes, key = key_long.split(".")
    for n in nodes:
        cfg = cfg.get(n) if isinstance(cfg, dict) else None
        if cfg is None:
            return None, key
    return (cfg if isinstance(cfg, dict) else None), key


def get(cfg: dict, key_long: str, default=None):
    node, key = _node(cfg, key_long)
    return default if node is None else node.get(key, default)


def fill_match(cfg: dict, key_long: str, value, mismatches: list | None, hf_key: str = "") -> None:
    """HfTrainerDeepSpeedConfig.fill_match: "auto" takes ``value``; another value that differs is a mismatch
    (``mismatches`` None: must_match=False, fill only)."""
    node, key = _node(cfg, key_long)
    if node is None:
        return
    if node.get(key) == "auto":
        node[key] = value
        return
    if mismatches is not None and node.get(key) is not None and node.get(key) != value:
        mismatches.append(f"ds {key_long}={shown(node.get(key))} vs TrainingArguments {hf_key}={shown(value)}")


def trainer_config_process(cfg: dict, args: dict, world_size: int | None, mismatches: list) -> None:
    """HfTrainerDeepSpeedConfig.trainer_config_process, the keys that touch gradients. ``train_batch_size`` needs
    the world size: where it is unknown it stays as is and is not compared."""
    mb, ga = args["per_device_train_batch_size"], args["gradient_accumulation_steps"]
    fill_match(cfg, "train_micro_batch_size_per_gpu", mb, mismatches, "per_device_train_batch_size")
    fill_match(cfg, "gradient_accumulation_steps", ga, mismatches, "gradient_accumulation_steps")
    if world_size is not None:
        fill_match(cfg, "train_batch_size", world_size * mb * ga, mismatches, "train_batch_size (calculated)")
    fill_match(cfg, "gradient_clipping", args["max_grad_norm"], mismatches, "max_grad_norm")
    fill_match(cfg, "fp16.enabled", bool(args["fp16"] or args.get("fp16_full_eval")), mismatches, "fp16|fp16_full_eval")
    fill_match(cfg, "bf16.enabled", bool(args["bf16"] or args.get("bf16_full_eval")), mismatches, "bf16|bf16_full_eval")


def check_file_fields(from_config) -> None:
    """DeepSpeedPlugin._deepspeed_config_checks: with a deepspeed_config_file, the accelerate YAML may not set the
    fields the file owns."""
    bad = [f for f in from_config if f in IGNORED_WITH_FILE]
    if bad:
        raise ConfigError(f"the accelerate config sets {', '.join(bad)} next to deepspeed_config_file, which accelerate "
                          f"refuses ({PLUGIN.replace('__post_init__', '_deepspeed_config_checks')}): set them in the "
                          "DeepSpeed JSON instead")


def plugin_with_file(cfg: dict, fields: dict, source: str) -> None:
    """DeepSpeedPlugin.__post_init__ given a config: gradient_accumulation_steps 1 where absent, zero_optimization
    required, "auto" values filled from the plugin's fields (env defaults: GA / clipping "auto", stage 2, offload
    "none")."""
    if "zero_optimization" not in cfg:
        raise ConfigError(f"{source} has no zero_optimization section, which accelerate requires ({PLUGIN})")
    if "gradient_accumulation_steps" not in cfg:
        cfg["gradient_accumulation_steps"] = 1
    values = plugin_fields(fields)
    for name, key_long in PLUGIN_KEYS.items():
        if values.get(name) is not None:
            fill_match(cfg, key_long, values[name], None)


def plugin_fields(fields: dict) -> dict:
    """DeepSpeedPlugin.__post_init__ defaults for the fields an accelerate config did not set."""
    out = {"gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "zero_stage": 2,
           "offload_optimizer_device": "none", "offload_param_device": "none", "offload_optimizer_nvme_path": "none",
           "offload_param_nvme_path": "none", "zero3_save_16bit_model": False}
    out.update({k: v for k, v in fields.items() if v is not None})
    return out


def plugin_build(fields: dict) -> dict:
    """DeepSpeedPlugin.__post_init__ without a config file: the config accelerate builds from its fields."""
    f = plugin_fields(fields)
    cfg = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
           "gradient_accumulation_steps": f["gradient_accumulation_steps"],
           "zero_optimization": {
               "stage": f["zero_stage"],
               "offload_optimizer": {"device": f["offload_optimizer_device"],
                                     "nvme_path": f["offload_optimizer_nvme_path"]
                                     if f["offload_optimizer_device"] == "nvme" else None},
               "offload_param": {"device": f["offload_param_device"],
                                 "nvme_path": f["offload_param_nvme_path"] if f["offload_param_device"] == "nvme" else None},
               "stage3_gather_16bit_weights_on_model_save": f["zero3_save_16bit_model"]}}
    if f["gradient_clipping"]:  # "auto" is truthy: it stays, for the Trainer (max_grad_norm) or accelerate (1.0)
        cfg["gradient_clipping"] = f["gradient_clipping"]
    return cfg


def set_mixed_precision(cfg: dict, mp: str) -> None:
    """DeepSpeedPlugin.set_mixed_precision (AcceleratorState.__init__ calls it with the Accelerator's mixed_precision):
    adds a missing fp16 / bf16 section, fills "auto" enabled values, refuses the other dtype enabled."""
    if mp == "fp16" and "fp16" not in cfg:
        cfg["fp16"] = {"enabled": True, "auto_cast": True}
    elif mp in ("bf16", "fp8") and "bf16" not in cfg:
        cfg["bf16"] = {"enabled": True}
    if mp != "no":
        other = "bf16" if mp == "fp16" else "fp16"
        section = cfg.get(other)
        if isinstance(section, dict) and str(section.get("enabled", "False")).lower() == "true":
            raise ConfigError(f"mixed precision {mp} with {other} enabled in the DeepSpeed config: accelerate refuses "
                              f"it ({SET_MP})")
    for dtype in ("fp16", "bf16"):
        cfg.setdefault(dtype, {"enabled": False})
    fill_match(cfg, "fp16.enabled", mp == "fp16", None)
    fill_match(cfg, "bf16.enabled", mp in ("bf16", "fp8"), None)


def check_shape(cfg: dict, source: str) -> None:
    """The sections the rules read are objects (DeepSpeed's config parser would refuse them otherwise)."""
    for key in ("zero_optimization", "bf16", "fp16"):
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            raise ConfigError(f'{source}: "{key}" must be an object, got {cfg[key]!r}')
    stage = (cfg.get("zero_optimization") or {}).get("stage", 0)
    if stage not in (0, 1, 2, 3, "auto") or isinstance(stage, bool):
        raise ConfigError(f"{source}: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")


def engine_precision(cfg: dict, source: str) -> str:
    bf16, fp16 = get(cfg, "bf16.enabled", False), get(cfg, "fp16.enabled", False)
    for name, on in (("bf16", bf16), ("fp16", fp16)):
        if on not in (True, False, "auto"):
            raise ConfigError(f'{source}: {name}.enabled must be true, false or "auto", got {on!r}')
    if bf16 is True and fp16 is True:
        raise ConfigError(f"{source} enables both bf16 and fp16: DeepSpeed accepts one of them")
    return "bf16" if bf16 is True else "fp16" if fp16 is True else "fp32"


def batch_assertion(cfg: dict, world_size: int | None, source: str) -> None:
    """deepspeed/runtime/config.py DeepSpeedConfig._batch_assertion, where all three numbers are known."""
    tb, mb, ga = (cfg.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                       "gradient_accumulation_steps"))
    if world_size is None or not all(isinstance(v, int) and not isinstance(v, bool) for v in (tb, mb, ga)):
        return
    if tb != mb * ga * world_size:
        raise ConfigError(f"{source}: train_batch_size {tb} != micro-batch {mb} x GA {ga} x {world_size} ranks, which "
                          "DeepSpeed refuses (deepspeed/runtime/config.py DeepSpeedConfig._batch_assertion)")


def refuse_mismatches(mismatches: list, source: str) -> None:
    if mismatches:
        raise ConfigError(f"{source} disagrees with the TrainingArguments ({'; '.join(mismatches)}), which the Trainer "
                          "refuses (transformers integrations/deepspeed.py HfTrainerDeepSpeedConfig."
                          'trainer_config_finalize); set those DeepSpeed values to "auto"')


def describe(raw: dict, final: dict, why: dict, notes: list, label: str = "", keys=WATCHED) -> None:
    """One note per watched key that changed between the file and ``deepspeed.initialize``."""
    for key in keys:
        before, after = get(raw, key, None), get(final, key, None)
        section = key.split(".")[0] if "." in key else None
        if section and section not in raw and section in final:
            if after is not True:  # an added {"enabled": false} changes nothing
                continue
            notes.append(f"{section}: absent -> {{\"enabled\": {shown(after)}}}{label} ({SET_MP})")
            continue
        if before == after:
            continue
        was = "absent" if before is None and get(raw, key, "x") == "x" else shown(before)
        now = shown(after) if after is not None else "unset"
        notes.append(f"{key}: {was} -> {now}{label} ({why.get(key, TRAINER)})")


def read_bare(ds: dict, source: str, file: str | None) -> TrainingRun:
    """A DeepSpeed JSON on its own: whoever drives it (the engine's own loop, or a Trainer's boundary loop) is
    unknown, so both loops; every precision an "auto" could become."""
    notes = [(f"{source}: a bare DeepSpeed config (zero_optimization / batch keys, no framework keys): the engine's own "
             "loop or a Trainer / Accelerate boundary loop may drive it")]
    precisions = []
    for name in ("bf16", "fp16"):
        section = ds.get(name)
        if section is None:
            continue
        if not isinstance(section, dict):
            raise ConfigError(f'{source}: "{name}" must be an object like {{"enabled": true}}, got {section!r}')
        on = section.get("enabled", False)
        if on == "auto":
            precisions.append(name)
            notes.append(f'{name}.enabled: "auto" -> {name} where the driver asks for {name} (TrainingArguments.{name} '
                         f"or accelerate mixed_precision {name}: {TRAINER}; {SET_MP}), else off")
        elif on is True:
            notes.append(f"{name}.enabled: true -> {name}")
        elif on is not False:
            raise ConfigError(f'{source}: {name}.enabled must be true, false or "auto", got {on!r}')
    enabled = [n for n in ("bf16", "fp16") if (ds.get(n) or {}).get("enabled") is True]
    if len(enabled) == 2:
        raise ConfigError(f"{source} enables both bf16 and fp16: DeepSpeed accepts one of them")
    if enabled:
        precision, precisions = enabled[0], [enabled[0]]
    else:
        precisions = ["fp32"] + precisions
        precision = "fp32" if len(precisions) == 1 else None
        if precision:
            notes.append("bf16 / fp16: not enabled -> fp32")
    ga = ds.get("gradient_accumulation_steps")
    mb = ds.get("train_micro_batch_size_per_gpu")
    for key, v in (("gradient_accumulation_steps", ga), ("train_micro_batch_size_per_gpu", mb),
                   ("train_batch_size", ds.get("train_batch_size"))):
        if v is not None and v != "auto" and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ConfigError(f'{source}: {key} must be a positive integer or "auto", got {v!r}')
    if ga is None and ds.get("train_batch_size") is None and isinstance(mb, int):
        ga = 1
        notes.append("gradient_accumulation_steps: absent -> 1 (only the micro-batch is given: deepspeed/runtime/"
                     "config.py DeepSpeedConfig._set_batch_related_parameters)")
    elif ga == "auto" or ga is None:
        notes.append(f"gradient_accumulation_steps: {'absent' if ga is None else shown(ga)} -> set by the driver "
                     "(TrainingArguments.gradient_accumulation_steps, or 1 where accelerate finds none)")
        ga = None
    else:
        notes.append(f"gradient_accumulation_steps: {ga}")
    if not isinstance(mb, int):
        notes.append(f"train_micro_batch_size_per_gpu: {'absent' if mb is None else shown(mb)} -> set by the driver "
                     "(TrainingArguments.per_device_train_batch_size, or the DataLoader's batch size under accelerate)")
        mb = None
    clip = ds.get("gradient_clipping")
    if clip == "auto":
        notes.append("gradient_clipping: \"auto\" -> the driver's max_grad_norm (1.0 by default, both for the Trainer and "
                     "accelerate's Accelerator._prepare_deepspeed)")
        clip = 1.0
    elif clip is None:
        notes.append("gradient_clipping: absent -> 0 (DeepSpeed clips only when the config says so)")
        clip = 0.0
    elif isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0:
        raise ConfigError(f'{source}: gradient_clipping must be a number >= 0 or "auto", got {clip!r}')
    zero = ds.get("zero_optimization")
    if zero is not None and not isinstance(zero, dict):
        raise ConfigError(f"{source}: zero_optimization must be an object, got {zero!r}")
    raw_stage = (zero or {}).get("stage", 0) if zero is not None else None
    if raw_stage not in (None, 0, 1, 2, 3, "auto") or isinstance(raw_stage, bool):
        raise ConfigError(f"{source}: zero_optimization.stage must be 0, 1, 2 or 3, got {raw_stage!r}")
    stage = zero_stage_of(ds)
    notes.append(f"zero_optimization.stage: {shown(raw_stage) if raw_stage is not None else 'absent'} -> "
                 f"{'ZeRO-' + str(stage) if stage is not None else 'set by the driver'}")
    return TrainingRun(framework="deepspeed", source=source, loops=("engine", "boundary"), precision=precision,
                       precisions=unique(precisions), ga=ga, micro_batch=mb, world_size=None, path="deepspeed",
                       ds_config=copy.deepcopy(ds), ds_config_file=file, max_grad_norm=float(clip), adapter=None,
                       notes=notes, trainer_dtype=None, zero_stage=stage)
