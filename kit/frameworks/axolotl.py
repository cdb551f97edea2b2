"""axolotl YAML (``axolotl train x.yml``), read as axolotl-ai-cloud/axolotl 067b021c (v0.18.0-9, 2026-07-24) reads it:

- src/axolotl/utils/schemas/training.py HyperparametersConfig: gradient_accumulation_steps and micro_batch_size
  default to 1, batch_size to None; src/axolotl/utils/schemas/validation.py check_batch_size_fields (at least two
  of the three set) and check_gas_bsz (not both GA and batch_size); src/axolotl/utils/config/__init__.py
  validate_config dumps the validated model (defaults filled, None dropped), then normalize_config:
  GA = GA or batch_size // micro_batch_size;
- src/axolotl/utils/schemas/config.py: bf16 "auto" | bool (default "auto"), fp16, bfloat16, float16 (no AMP);
  utils/config/__init__.py resolve_dtype: bf16 "auto" -> true on a GPU with bf16 (Ampere or newer), else false with
  fp16 true unless fp16 is set or float16; fp16 with bf16 "auto" -> bf16 false; bf16 turns fp16 off;
- src/axolotl/core/builders/base.py (TrainerBuilderBase): per_device_train_batch_size = micro_batch_size,
  fp16 = fp16 and not bf16, bf16 = bf16 or bfloat16, max_grad_norm / gradient_accumulation_steps passed only when
  set, fsdp = fsdp or True with fsdp_config; core/builders/causal.py: deepspeed -> TrainingArguments.deepspeed.
The trainer is the HF Trainer (AxolotlTrainer subclasses it).
"""
from __future__ import annotations

import yaml

from gradkit.config import ConfigError
from gradkit.frameworks.run import Launch, TrainingRun, positive_int, shown, str_to_bool
from gradkit.frameworks.trainer import Case, resolve_trainer

KEYS = frozenset(("base_model", "micro_batch_size", "sequence_len", "sample_packing", "num_epochs", "val_set_size",
                  "lora_r", "pad_to_sequence_len", "base_model_config", "datasets", "adapter", "load_in_4bit",
                  "wandb_project", "bfloat16", "float16", "eval_sample_packing", "flash_attention"))
SCHEMA = "axolotl utils/schemas/training.py HyperparametersConfig default"
NORMALIZE = "axolotl utils/config/__init__.py normalize_config"
DTYPE = "axolotl utils/config/__init__.py resolve_dtype"
BUILDER = "axolotl core/builders/base.py TrainerBuilderBase._configure_precision_settings"
VIA = "axolotl passes it to TrainingArguments.{key}: core/builders/base.py"


def is_axolotl(data: dict) -> bool:
    strong = {"base_model", "micro_batch_size", "sequence_len", "sample_packing", "num_epochs", "lora_r"}
    return bool(strong & set(data)) or len(KEYS & set(data)) >= 2


def _batch(data: dict, notes: list) -> tuple[int, int]:
    fields = ("micro_batch_size", "gradient_accumulation_steps", "batch_size")
    if sum(1 for f in fields if data.get(f)) < 2:
        raise ConfigError("axolotl needs at least two of micro_batch_size, gradient_accumulation_steps and batch_size "
                          "(axolotl utils/schemas/validation.py check_batch_size_fields)")
    if data.get("gradient_accumulation_steps") and data.get("batch_size"):
        raise ConfigError("axolotl takes gradient_accumulation_steps or batch_size, not both "
                          "(axolotl utils/schemas/validation.py check_gas_bsz)")
    # set: the two checks above leave none without it (two of the three, and not both of the other two)
    mb = positive_int(data["micro_batch_size"], "micro_batch_size")
    notes.append(f"micro_batch_size: {mb} -> per_device_train_batch_size {mb} (axolotl core/builders/base.py)")
    if "gradient_accumulation_steps" not in data:
        ga = 1
        extra = ""
        if data.get("batch_size"):
            extra = (f"; batch_size {data['batch_size']} does not change it: the schema default fills GA before "
                     f"{NORMALIZE} could derive batch_size // micro_batch_size")
        notes.append(f"gradient_accumulation_steps: absent -> 1 ({SCHEMA}{extra})")
    elif data["gradient_accumulation_steps"] is None:
        bs = positive_int(data.get("batch_size"), "batch_size")
        ga = bs // mb
        if ga < 1:
            raise ConfigError(f"batch_size {bs} // micro_batch_size {mb} is 0: gradient_accumulation_steps must be >= 1")
        notes.append(f"gradient_accumulation_steps: null -> batch_size {bs} // micro_batch_size {mb} = {ga} ({NORMALIZE})")
    else:
        ga = positive_int(data["gradient_accumulation_steps"], "gradient_accumulation_steps")
        notes.append(f"gradient_accumulation_steps: {ga} -> {ga} ({VIA.format(key='gradient_accumulation_steps')})")
    return mb, ga


def _flag(data, key):
    v = data.get(key)
    return None if v is None else str_to_bool(v, key)


def _cases(data: dict, notes: list) -> list[Case]:
    raw = data.get("bf16", "auto")
    if isinstance(raw, str) and raw.lower() == "auto":
        raw = "auto"
    elif raw is not None:
        try:
            raw = str_to_bool(raw, "bf16")
        except ConfigError:
            raise ConfigError(f'bf16 must be true, false or "auto" (axolotl utils/schemas/config.py), got {raw!r}') \
                from None
    fp16, float16, bfloat16 = _flag(data, "fp16"), _flag(data, "float16"), _flag(data, "bfloat16")
    said = 'absent -> "auto" (axolotl utils/schemas/config.py default)' if "bf16" not in data else shown(data["bf16"])

    def args(bf16, fp16_):  # resolve_dtype's "bf16 turns fp16 off", then the builder's TrainingArguments flags
        if bf16:
            fp16_ = False
        ta_fp16 = bool(fp16_ and not bf16)
        ta_bf16 = bool(bf16 or bfloat16)
        pure = "fp16" if float16 and not ta_fp16 and not ta_bf16 else None
        return ta_bf16, ta_fp16, pure

    if raw == "auto" and not fp16:
        fp16_b = True if fp16 is None and not float16 else fp16
        a, b = args(True, fp16), args(False, fp16_b)
        if a == b:
            return [Case("", *a)]
        notes.append(f"bf16: {said} -> bf16 on a GPU with bf16 support (Ampere or newer), else "
                     f"{'fp16' if b[1] else 'fp32'} ({DTYPE})")
        return [Case("a GPU with bf16 support", *a), Case("a GPU without bf16 support", *b)]
    bf16 = False if raw == "auto" else bool(raw)
    if raw == "auto":
        notes.append(f"bf16: {said} -> false, as fp16 is true ({DTYPE})")
    else:
        notes.append(f"bf16: {said} -> {shown(bf16)} ({BUILDER})")
    ta_bf16, ta_fp16, pure = args(bf16, fp16)
    if fp16 is not None:
        notes.append(f"fp16: {shown(fp16)} -> TrainingArguments.fp16 {shown(ta_fp16)} ({BUILDER}: fp16 and not bf16)")
    if bfloat16:
        notes.append(f"bfloat16: true -> bf16 weights, TrainingArguments.bf16 true ({BUILDER}: bf16 or bfloat16)")
    if pure:
        notes.append(f"float16: true -> fp16 weights without AMP ({DTYPE}: torch_dtype float16)")
    return [Case("", ta_bf16, ta_fp16, pure)]


# what axolotl 0.19.0 sets on the Trainer whatever the YAML says (the path check runs the Trainer with them)
OVERRIDES = {"average_tokens_across_devices": False, "model_accepts_loss_kwargs": False}


def read(data: dict, source: str, *, base_dir=None, cwd=None, launch: Launch | None = None,
         config_file: str | None = None) -> TrainingRun:
    notes: list[str] = []
    mb, ga = _batch(data, notes)
    cases = _cases(data, notes)
    given = {"per_device_train_batch_size": mb, "gradient_accumulation_steps": ga}
    said = {"per_device_train_batch_size", "gradient_accumulation_steps"}
    if data.get("max_grad_norm") is not None:
        given["max_grad_norm"] = data["max_grad_norm"]
    else:
        said.add("max_grad_norm")
        given["max_grad_norm"] = 1.0
        notes.append(f"max_grad_norm: {'absent' if 'max_grad_norm' not in data else 'null'} -> 1.0 (axolotl passes it "
                     "only when set: the TrainingArguments default)")
    if data.get("deepspeed"):
        given["deepspeed"] = data["deepspeed"]
    if data.get("fsdp_config") or data.get("fsdp"):
        if not isinstance(data.get("fsdp_config") or {}, dict):
            raise ConfigError(f"fsdp_config must be a mapping, got {data['fsdp_config']!r}")
        fsdp_config = dict(data.get("fsdp_config") or {})
        if data.get("fsdp_version") is not None and not {"fsdp_version", "version"} & set(fsdp_config):
            fsdp_config["fsdp_version"] = data["fsdp_version"]
            notes.append(f"fsdp_version: {data['fsdp_version']} -> fsdp_config (axolotl utils/schemas/config.py)")
        given["fsdp"] = data.get("fsdp") or True
        given["fsdp_config"] = fsdp_config
    adapter = data.get("adapter") or None
    if adapter is not None and not isinstance(adapter, str):
        raise ConfigError(f"adapter must be a name like lora or qlora, got {adapter!r}")
    quant = " (load_in_4bit)" if data.get("load_in_4bit") else " (load_in_8bit)" if data.get("load_in_8bit") else ""
    notes.append(f"adapter: {adapter or 'absent -> none (all parameters train)'}{quant if adapter else ''}")
    if data.get("rl"):
        notes.append(f"rl: {data['rl']} -> TRL's trainer for it, built by axolotl core/builders/rl.py with the "
                     "precision flags above (TRL's bf16 default does not apply); the HF Trainer's loop")
    run = resolve_trainer("axolotl", source, given, notes, via=VIA, launch=launch, base_dir=base_dir, cwd=cwd,
                          cases=cases, said=said, adapter=adapter, config_file=config_file)
    run.trainer_overrides = dict(OVERRIDES)
    run.notes.append("axolotl sets average_tokens_across_devices False (core/builders/base.py) and, for a model whose "
                     "forward takes num_items_in_batch through **kwargs (transformers' own), model_accepts_loss_kwargs "
                     "False (core/trainers/base.py; axolotl-ai-cloud/axolotl#3982): each micro-batch's loss is its own "
                     "token mean (axolotl 0.19.0, measured by tests/test_recipes.py); the Trainer's path check runs "
                     "its Trainer so" + (", after the DeepSpeed check of the engine" if run.ds_config is not None else ""))
    return run


def overrides(options: dict) -> dict:
    """``axolotl train x.yml --key value`` / ``--key=value``: CLI values over the YAML (axolotl cli/config.py
    load_cfg), dashes read as underscores, values as YAML scalars."""
    out = {}
    for key, value in options.items():
        if key in ("launcher", "num_processes", "main_process_port", "cloud", "sweep", "use_exec"):
            continue
        out[key] = yaml.safe_load(value) if isinstance(value, str) and value else value
    return out
