"""LLaMA-Factory training YAML (``llamafactory-cli train x.yaml``), read as hiyouga/LLaMA-Factory
ff6d4d12 (v0.9.5-54, 2026-08-18) reads it:

- src/llamafactory/hparams/parser.py read_args / get_train_args: one HfArgumentParser over ModelArguments,
  DataArguments, TrainingArguments (hparams/training_args.py: transformers' Seq2SeqTrainingArguments, so its
  defaults and the Trainer's DeepSpeed "auto" filling), FinetuningArguments, GeneratingArguments; ``key=value``
  after the YAML overrides it (OmegaConf.from_cli);
- hparams/finetuning_args.py FinetuningArguments: stage (default sft), finetuning_type (default lora), pure_bf16;
- get_train_args: compute_dtype bf16 for bf16 or pure_bf16, fp16 for fp16; pure_bf16 is refused with ZeRO-3;
- model/adapter.py init_adapter: with pure_bf16 the trainable parameters stay bf16 (no fp32 upcast);
- src/llamafactory/launcher.py launch: ``train`` runs torchrun (NNODES, NPROC_PER_NODE, default the device count)
  when FORCE_TORCHRUN is set or more than one device is visible.
"""
from __future__ import annotations

import yaml

from gradkit.config import ConfigError
from gradkit.frameworks.run import Launch, TrainingRun, str_to_bool
from gradkit.frameworks.trainer import Case, flag_cases, resolve_trainer

STAGES = ("pt", "sft", "rm", "ppo", "dpo", "kto")
FINETUNING_TYPES = ("lora", "oft", "freeze", "full")
# keys only LLaMA-Factory's argument classes have (hparams/*.py)
KEYS = frozenset(("finetuning_type", "cutoff_len", "pure_bf16", "lora_target", "lora_rank", "pref_beta", "pref_loss",
                  "dataset_dir", "template", "quantization_bit", "use_badam", "use_galore", "freeze_trainable_layers",
                  "additional_target", "plot_loss", "neat_packing", "train_on_prompt", "mask_history", "val_size"))
VIA = "LLaMA-Factory passes it to TrainingArguments.{key}"
PARSER = "LLaMA-Factory hparams/parser.py get_train_args"


def is_llamafactory(data: dict) -> bool:
    return bool(KEYS & set(data)) or data.get("stage") in STAGES and ("model_name_or_path" in data or "dataset" in data)


def read(data: dict, source: str, *, base_dir=None, cwd=None, launch: Launch | None = None,
         config_file: str | None = None) -> TrainingRun:
    notes: list[str] = []
    stage = data.get("stage", "sft")
    if stage not in STAGES:
        raise ConfigError(f"stage: {stage!r} is not a LLaMA-Factory stage ({', '.join(STAGES)})")
    runner = "LLaMA-Factory train/ppo/trainer.py CustomPPOTrainer: its own loop, accumulating with accelerate" \
        if stage == "ppo" else "the HF Trainer (Seq2SeqTrainer subclass) runs it"
    notes.append(f"stage: {'absent -> sft (FinetuningArguments default)' if 'stage' not in data else stage} ({runner})")
    ftype = data.get("finetuning_type", "lora")
    if ftype not in FINETUNING_TYPES:
        raise ConfigError(f"finetuning_type: {ftype!r} is not one of {', '.join(FINETUNING_TYPES)}")
    qbit = data.get("quantization_bit")
    if qbit is not None and ftype not in ("lora", "oft"):
        raise ConfigError(f"quantization_bit {qbit} with finetuning_type {ftype}: LLaMA-Factory trains quantized models "
                          "with LoRA or OFT only (model/adapter.py init_adapter)")
    adapter = None if ftype == "full" else "qlora" if ftype == "lora" and qbit is not None else ftype
    was = "absent -> lora (FinetuningArguments default)" if "finetuning_type" not in data else ftype
    notes.append(f"finetuning_type: {was} -> adapter {adapter or 'none (all parameters train)'}"
                 + (f" (quantization_bit {qbit}: QLoRA)" if adapter == "qlora" else ""))
    pure = str_to_bool(data["pure_bf16"], "pure_bf16") if data.get("pure_bf16") is not None else False
    cases = flag_cases(data, notes, VIA)
    if pure:
        notes.append("pure_bf16: true -> bf16 weights and gradients, no autocast: TrainingArguments.bf16 stays as "
                     f"given, a DeepSpeed bf16 \"auto\" follows it ({PARSER} sets compute_dtype bf16; "
                     "model/adapter.py init_adapter keeps trainable parameters bf16)")
        cases = [Case(c.label, c.bf16, c.fp16, pure="bf16") for c in cases]
    if data.get("fp8") is not None and str_to_bool(data["fp8"], "fp8"):
        notes.append("fp8: true -> LLaMA-Factory's FP8 training (hparams/training_args.py Fp8Arguments), not "
                     "modelled: the bf16 / fp16 flags are read")
    if data.get("deepspeed") and launch is None:
        notes.append(f"deepspeed: needs a distributed launch (llamafactory-cli with FORCE_TORCHRUN=1 or several "
                     f"devices, or torchrun), else {PARSER} stops")
    if data.get("deepspeed") and launch is not None and launch.world_size == 1 and \
            launch.launcher in ("llamafactory-cli", "python"):
        raise ConfigError(f"DeepSpeed in one process without torchrun, which LLaMA-Factory refuses ({PARSER}: "
                          "'Please use FORCE_TORCHRUN=1 to launch DeepSpeed training')")
    run = resolve_trainer("llamafactory", source, data, notes, via=VIA, launch=launch, base_dir=base_dir, cwd=cwd,
                          cases=cases, adapter=adapter, config_file=config_file)
    if pure and run.zero_stage == 3:
        raise ConfigError(f"pure_bf16 with DeepSpeed ZeRO-3, which LLaMA-Factory refuses ({PARSER})")
    return run


def overrides(tokens: list[str]) -> dict:
    """``key=value`` after the YAML (read_args: OmegaConf.from_cli merged over the file); values as YAML scalars."""
    out = {}
    for tok in tokens:
        key, eq, value = tok.partition("=")
        if not eq or not key:
            raise ConfigError(f"{tok!r} after the LLaMA-Factory YAML: overrides are key=value (OmegaConf.from_cli)")
        try:
            out[key.lstrip("-")] = yaml.safe_load(value) if value else None
        except yaml.YAMLError:
            out[key.lstrip("-")] = value
    return out
