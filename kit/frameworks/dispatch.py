"""Which framework a config mapping is (by its keys), and the reader for it."""
from __future__ import annotations

from gradkit.config import ConfigError
import gradkit.frameworks.accelerate_cfg as accelerate_cfg
import gradkit.frameworks.axolotl as axolotl
import gradkit.frameworks.ds_rules as ds_rules
import gradkit.frameworks.hf_args as hf_args
import gradkit.frameworks.llamafactory as llamafactory
from gradkit.frameworks.run import Launch, TrainingRun

# keys only a DeepSpeed JSON has (deepspeed/runtime/constants.py); HF's bf16 / fp16 are booleans, DeepSpeed's objects
DS_KEYS = frozenset(("zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size", "gradient_clipping",
                     "zero_allow_untested_optimizer", "steps_per_print", "wall_clock_breakdown", "data_types",
                     "communication_data_type", "zero_force_ds_cpu_optimizer", "prescale_gradients",
                     "gradient_predivide_factor", "bfloat16", "amp"))


def is_deepspeed(data: dict) -> bool:
    return bool(DS_KEYS & set(data)) or any(isinstance(data.get(k), dict) and "enabled" in data[k]
                                            for k in ("bf16", "fp16"))


def detect_data(data: dict, source: str) -> str:
    """The framework of a config mapping, by keys: accelerate, LLaMA-Factory, axolotl, a bare DeepSpeed JSON, TRL,
    HF TrainingArguments (in that order: the later ones share keys with the earlier)."""
    if accelerate_cfg.is_accelerate(data):
        return "accelerate"
    if llamafactory.is_llamafactory(data):
        return "llamafactory"
    if axolotl.is_axolotl(data):
        return "axolotl"
    if is_deepspeed(data):
        return "deepspeed"
    if hf_args.is_trl(data):
        return "trl"
    if hf_args.HF_KEYS & set(data):
        return "hf-trainer"
    shown = ", ".join(sorted(map(str, data))[:8]) or "none"
    raise ConfigError(f"{source} is no training config the kit reads (keys: {shown}): expected a LLaMA-Factory or "
                      "axolotl YAML, HF TrainingArguments / TRL config, accelerate config or DeepSpeed JSON")


def read_data(data: dict, source: str, *, base_dir=None, cwd=None, launch: Launch | None = None,
              config_file: str | None = None, framework: str | None = None) -> TrainingRun:
    framework = framework or detect_data(data, source)
    kw = {"base_dir": base_dir, "cwd": cwd, "launch": launch, "config_file": config_file}
    if framework == "llamafactory":
        return llamafactory.read(data, source, **kw)
    if framework == "axolotl":
        return axolotl.read(data, source, **kw)
    if framework in ("trl", "hf-trainer"):
        return hf_args.read_hf(data, source, **kw)
    if launch is not None and launch.launcher:
        what = "an accelerate config: pass it with accelerate launch --config_file" if framework == "accelerate" else \
            "a DeepSpeed JSON: pass it with --deepspeed (HF scripts) or --deepspeed_config (DeepSpeed scripts)"
        raise ConfigError(f"{config_file or source} is {what}")
    if framework == "accelerate":
        return accelerate_cfg.read(data, source, base_dir=base_dir, cwd=cwd)
    return ds_rules.read_bare(data, source, config_file)
