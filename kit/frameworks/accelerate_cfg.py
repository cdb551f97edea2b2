"""``accelerate config`` YAML, read alone (framework "accelerate") or as the config of ``accelerate launch``
(``launch``), as huggingface/accelerate 1.15.0 (16cb6eb8) reads it:

- src/accelerate/commands/config/config_args.py ClusterConfig / BaseConfig.from_yaml_file (mixed_precision absent ->
  "fp16" for a legacy ``fp16: true``, else None);
- src/accelerate/commands/launch.py _validate_launch_command: distributed_type picks DeepSpeed / FSDP / multi-GPU
  unless a flag does, deepspeed_config / fsdp_config keys become launch args unless given on the command line,
  --mixed_precision wins over the file; launch_command: ACCELERATE_CONFIG_DS_FIELDS = the deepspeed_config keys
  (+ mixed_precision when it came from the file);
- src/accelerate/utils/launch.py prepare_deepspeed_cmd_env / prepare_multi_gpu_env: the ACCELERATE_* environment
  (num_processes is the total over all machines);
- src/accelerate/utils/dataclasses.py DeepSpeedPlugin (see ds_rules), accelerator.py Accelerator._prepare_deepspeed
  ("auto" micro-batch from the DataLoader, GA from Accelerator(gradient_accumulation_steps), clipping 1.0).
"""
from __future__ import annotations

import copy

from gradkit.config import ConfigError
import gradkit.frameworks.ds_rules as ds_rules
from gradkit.frameworks.run import (
    Launch,
    TrainingRun,
    load_ds_json,
    number,
    plain_path,
    positive_int,
    shown,
    str_to_bool,
    unique,
    zero_stage_of,
)

MULTI = ("MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA", "MULTI_XPU", "MULTI_HPU", "MULTI_NEURON",
         "MULTI_CPU")
TYPES = ("NO", "DEEPSPEED", "FSDP", *MULTI)
MIXED = ("no", "fp16", "bf16", "fp8")
DS_FIELDS = ("zero_stage", "gradient_accumulation_steps", "gradient_clipping", "offload_optimizer_device",
             "offload_param_device", "offload_optimizer_nvme_path", "offload_param_nvme_path", "zero3_save_16bit_model")
LOOP = ("loop: boundary (Accelerator.accumulate, or the HF Trainer driving accelerate: accelerate accelerator.py "
        "Accelerator.accumulate; under DeepSpeed utils/deepspeed.py DeepSpeedEngineWrapper.backward calls "
        "engine.set_gradient_accumulation_boundary)")
LAUNCH = "accelerate commands/launch.py _validate_launch_command"


def is_accelerate(data: dict) -> bool:
    return "distributed_type" in data or "compute_environment" in data


def _ds_field(name, value):
    if value is None:
        return None
    if name == "zero_stage":
        v = positive_int(value, "zero_stage") if value not in (0, "0") else 0
        if v not in (0, 1, 2, 3):
            raise ConfigError(f"zero_stage must be 0, 1, 2 or 3, got {value!r}")
        return v
    if name == "gradient_accumulation_steps":
        return "auto" if value == "auto" else positive_int(value, "gradient_accumulation_steps")
    if name == "gradient_clipping":
        return "auto" if value == "auto" else number(value, "gradient_clipping")
    if name in ("offload_optimizer_device", "offload_param_device"):
        if str(value).lower() not in ("none", "cpu", "nvme"):
            raise ConfigError(f"{name} must be none, cpu or nvme, got {value!r}")
        return str(value).lower()
    if name == "zero3_save_16bit_model":
        return str_to_bool(value, name)
    return value


def launch(cfg: dict | None, flags: dict, *, base_dir=None, cwd=None, source: str = "accelerate config") -> Launch:
    """The Launch ``accelerate launch`` sets up from its config file (``cfg``, may be None) and its flags."""
    out = Launch(launcher="accelerate")
    cfg = dict(cfg or {})
    dt = str(cfg.get("distributed_type", "NO")).upper()
    if dt not in TYPES:
        raise ConfigError(f"distributed_type {cfg.get('distributed_type')!r}: the kit reads "
                          f"{', '.join(TYPES[:3])} and MULTI_* configs")
    use_ds = str_to_bool(flags.get("use_deepspeed", False), "--use_deepspeed")
    use_fsdp = str_to_bool(flags.get("use_fsdp", False), "--use_fsdp")
    multi = str_to_bool(flags.get("multi_gpu", False), "--multi_gpu")
    if cfg and not (use_ds or use_fsdp or multi):
        use_ds, use_fsdp, multi = dt == "DEEPSPEED", dt == "FSDP", dt in MULTI
        if dt != "NO":
            out.notes.append(f"distributed_type: {dt} -> {'DeepSpeed' if use_ds else 'FSDP' if use_fsdp else 'DDP'} "
                             f"({LAUNCH})")
    if sum((use_ds, use_fsdp, multi)) > 1:
        raise ConfigError("accelerate launch takes one of --multi_gpu, --use_deepspeed, --use_fsdp (" + LAUNCH + ")")
    ds_cfg = cfg.get("deepspeed_config") or {}
    if not isinstance(ds_cfg, dict):
        raise ConfigError(f"{source}: deepspeed_config must be a mapping, got {ds_cfg!r}")
    fields = {k: v for k, v in ds_cfg.items()}
    fields.update({k: v for k, v in flags.items() if k in DS_FIELDS or k == "deepspeed_config_file"})
    mp = flags.get("mixed_precision")
    from_config = list(ds_cfg)
    if mp is None:
        mp = cfg.get("mixed_precision")
        if mp is None and "mixed_precision" not in cfg and cfg.get("fp16"):
            mp = "fp16"  # config_args.py BaseConfig.from_yaml_file, the legacy fp16 key
        if mp is not None:
            from_config.append("mixed_precision")
            out.notes.append(f"mixed_precision: {shown(mp)} (the accelerate config; ACCELERATE_MIXED_PRECISION)")
    else:
        out.notes.append(f"mixed_precision: {mp} (--mixed_precision, over the config file)")
    mp = "no" if mp is None else str(mp).lower()
    if mp not in MIXED:
        raise ConfigError(f"mixed_precision {mp!r}: accelerate takes {', '.join(MIXED)}")
    out.mixed_precision = mp
    n = flags.get("num_processes", cfg.get("num_processes"))
    if n is not None and str(n) != "-1":
        out.world_size = positive_int(n, "num_processes")
        machines = flags.get("num_machines", cfg.get("num_machines", 1))
        out.notes.append(f"num_processes: {n} -> world size {out.world_size} (accelerate counts processes over all "
                         f"{machines} machine(s): utils/launch.py prepare_multi_gpu_env)")
    else:
        out.notes.append("num_processes: not given -> the visible device count at launch (unknown here)")
    if use_ds:
        out.deepspeed = True
        out.ds_fields = {k: _ds_field(k, fields.get(k)) for k in DS_FIELDS if fields.get(k) is not None}
        out.ds_fields_from_config = tuple(from_config)
        if fields.get("deepspeed_config_file"):
            where = base_dir if "deepspeed_config_file" in ds_cfg else cwd
            cfg_ds, file = load_ds_json(str(fields["deepspeed_config_file"]), "deepspeed_config_file", where, cwd)
            out.ds_file, out.ds_file_config = file, cfg_ds
    elif use_fsdp:
        out.fsdp = True
        fsdp_cfg = cfg.get("fsdp_config") or {}
        if not isinstance(fsdp_cfg, dict):
            raise ConfigError(f"{source}: fsdp_config must be a mapping, got {fsdp_cfg!r}")
        out.fsdp_config = {**fsdp_cfg, **{k: v for k, v in flags.items() if k.startswith("fsdp_")}}
    return out


def read(data: dict, source: str, *, base_dir=None, cwd=None) -> TrainingRun:
    """An accelerate config on its own: the script that runs under it (Accelerator or the HF Trainer) is unknown."""
    return from_launch(launch(data, {}, base_dir=base_dir, cwd=cwd, source=source), source)


def from_launch(lau: Launch, source: str) -> TrainingRun:
    """What an accelerate launch alone says (its script's arguments name no TrainingArguments)."""
    notes = list(lau.notes)
    mp = lau.mixed_precision
    ga = mb = clip = None
    ds_out, file, precision, precisions = None, None, None, ()
    if lau.deepspeed:
        path = "deepspeed"
        if lau.ds_file_config is not None:
            ds_rules.check_file_fields(lau.ds_fields_from_config)
            raw, file = copy.deepcopy(lau.ds_file_config), lau.ds_file
            ds_rules.check_shape(raw, file)
            notes.append(f"deepspeed_config_file: {file} (DeepSpeedPlugin(hf_ds_config=...): {ds_rules.PLUGIN})")
            final = copy.deepcopy(raw)
            ds_rules.plugin_with_file(final, lau.ds_fields, file)
            ds_rules.describe(raw, final, {"gradient_accumulation_steps": f"{ds_rules.PLUGIN} sets 1 where the file "
                                                                          "has none"}, notes)
            ds_out = raw
        else:
            final = ds_rules.plugin_build(lau.ds_fields)
            notes.append("deepspeed_config: " + (", ".join(f"{k} {shown(v)}" for k, v in sorted(lau.ds_fields.items()))
                                                 or "no fields") + f" -> a DeepSpeed config built by {ds_rules.PLUGIN}"
                         + ("" if "zero_stage" in lau.ds_fields else " (zero_stage absent -> 2)"))
            ds_rules.set_mixed_precision(final, mp)
            ds_out = copy.deepcopy(final)
        autos = [d for d in ("bf16", "fp16") if ds_rules.get(final, f"{d}.enabled") == "auto"]
        if autos:
            precisions = ("fp32", *autos)
            notes.append(f"{'/'.join(autos)}.enabled: \"auto\" -> set by the script's mixed precision (Accelerator("
                         f"mixed_precision=...) or TrainingArguments bf16 / fp16: {ds_rules.SET_MP}), fp32 without")
        else:
            precision = ds_rules.engine_precision(final, file or source)
            precisions = (precision,)
            notes.append(f"precision: {precision} (the DeepSpeed engine's"
                         + (f"; mixed_precision {mp}: {ds_rules.SET_MP})" if file is None else ")"))
        g = final.get("gradient_accumulation_steps")
        if g == "auto":
            notes.append("gradient_accumulation_steps: \"auto\" -> the script's Accelerator(gradient_accumulation_steps"
                         "=...) or TrainingArguments.gradient_accumulation_steps (accelerate accelerator.py "
                         "Accelerator._prepare_deepspeed)")
        else:
            ga = g
            if file is None:
                notes.append(f"gradient_accumulation_steps: {ga} (deepspeed_config; accelerate launch also exports "
                             "ACCELERATE_GRADIENT_ACCUMULATION_STEPS, which Accelerator() reads)")
        m = final.get("train_micro_batch_size_per_gpu")
        mb = m if isinstance(m, int) and not isinstance(m, bool) else None
        if mb is None:
            notes.append("train_micro_batch_size_per_gpu: \"auto\" -> the DataLoader's batch size "
                         "(Accelerator._prepare_deepspeed) or TrainingArguments.per_device_train_batch_size")
        c = final.get("gradient_clipping")
        if c == "auto":
            clip = 1.0
            notes.append("gradient_clipping: \"auto\" -> 1.0 (Accelerator._prepare_deepspeed fills 1.0; the HF Trainer "
                         "fills max_grad_norm, 1.0 by default)")
        elif c is None:
            clip = 0.0
            notes.append("gradient_clipping: absent -> 0, no clipping (DeepSpeed clips only when the config says so)")
        else:
            clip = float(c)
        stage = zero_stage_of(final)
    else:
        stage = None
        if lau.fsdp:
            path = "fsdp"
            notes.append(f"path: fsdp (fsdp_version {(lau.fsdp_config or {}).get('fsdp_version', 1)}: accelerate "
                         "utils/dataclasses.py FullyShardedDataParallelPlugin.__post_init__ defaults to 1)")
        else:
            path, said = plain_path(lau.world_size)
            notes.append(said)
        if mp == "fp8":
            raise ConfigError(f"{source}: mixed_precision fp8 without DeepSpeed: the kit measures fp32, bf16 and fp16 "
                              "runs only")
        precision = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}[mp]
        precisions = (precision,)
        notes.append(f"precision: {precision} (mixed_precision {mp}: Accelerator autocast)")
        notes.append("gradient_accumulation_steps: not in an accelerate config without DeepSpeed -> the script's "
                     "Accelerator(gradient_accumulation_steps=...) or TrainingArguments")
    notes.append(LOOP)
    td = {"no": "fp32", "bf16": "bf16", "fp16": "fp16", "fp8": "bf16"}[mp] if (file is None) else None
    return TrainingRun(framework="accelerate", source=source, loops=("boundary",), precision=precision,
                       precisions=unique(precisions), ga=ga, micro_batch=mb, world_size=lau.world_size, path=path,
                       ds_config=ds_out, ds_config_file=file, max_grad_norm=clip, adapter=None, notes=notes,
                       trainer_dtype=td, zero_stage=stage)
