"""HF TrainingArguments files (JSON / YAML, as HfArgumentParser.parse_json_file / parse_yaml_file read them), TRL
configs (SFTConfig, DPOConfig, GRPOConfig ... subclass TrainingArguments), and script arguments read with
HfArgumentParser's rules (transformers 5.23.0 src/transformers/hf_argparser.py HfArgumentParser._parse_dataclass_field).
"""
from __future__ import annotations

import re

from gradkit.config import ConfigError
from gradkit.frameworks.run import Launch, TrainingRun, str_to_bool
from gradkit.frameworks.trainer import Case, flag_cases, resolve_trainer

# TrainingArguments fields a training config typically sets (training_args.py); any one marks an HF config
HF_KEYS = frozenset((
    "output_dir", "per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
    "learning_rate", "num_train_epochs", "max_steps", "bf16", "fp16", "tf32", "deepspeed", "fsdp", "fsdp_config",
    "logging_steps", "save_steps", "save_strategy", "eval_strategy", "evaluation_strategy", "do_train", "do_eval",
    "warmup_ratio", "warmup_steps", "lr_scheduler_type", "max_grad_norm", "optim", "weight_decay", "seed",
    "gradient_checkpointing", "activation_checkpointing", "report_to", "run_name", "logging_dir", "save_total_limit",
    "dataloader_num_workers", "ddp_timeout", "adam_beta1", "adam_beta2", "overwrite_output_dir"))
# keys only TRL's configs (and TrlParser's ScriptArguments) have (trl/trainer/*_config.py, v1.9.0); max_seq_length is
# SFTConfig's name before TRL 0.20 renamed it max_length
TRL_KEYS = frozenset((
    "max_seq_length", "max_length", "packing", "packing_strategy", "dataset_text_field", "completion_only_loss",
    "assistant_only_loss", "padding_free", "beta", "num_generations", "max_completion_length", "max_prompt_length",
    "use_vllm", "vllm_mode", "reward_funcs", "reward_weights", "precompute_ref_log_probs", "generation_batch_size",
    "steps_per_generation", "loss_type", "dataset_kwargs", "eos_token", "pad_token", "desirable_weight",
    "undesirable_weight", "center_rewards_coefficient", "num_iterations", "epsilon", "scale_rewards",
    "sync_ref_model", "ref_model_sync_steps", "dataset_train_split", "chat_template_path", "model_init_kwargs"))
# TRL keys that name the config class, for the note
TRL_CLASSES = (("num_generations", "GRPOConfig / RLOOConfig"), ("reward_funcs", "GRPOConfig"),
               ("beta", "DPOConfig / KTOConfig / GRPOConfig"), ("center_rewards_coefficient", "RewardConfig"),
               ("desirable_weight", "KTOConfig"), ("packing", "SFTConfig"), ("dataset_text_field", "SFTConfig"),
               ("completion_only_loss", "SFTConfig"), ("max_seq_length", "SFTConfig (TRL < 0.20)"))
HF_VIA = "TrainingArguments.{key}"
TRL_SINCE = ("trl/trainer/base_config.py _BaseConfig.__post_init__ in TRL 1.9.0: bf16 = not fp16; per config "
             "__post_init__ since TRL 0.19.0, huggingface/trl 32ffa1170 #3515")
BOOL_FIELDS = frozenset(("bf16", "fp16", "bf16_full_eval", "fp16_full_eval", "tf32", "use_cpu", "do_train", "do_eval",
                         "packing", "gradient_checkpointing", "activation_checkpointing"))
INT_RE = re.compile(r"-?\d+(\.\d+)?([eE][-+]?\d+)?$")


def is_trl(data: dict) -> bool:
    return bool(TRL_KEYS & set(data))


def trl_class(data: dict) -> str:
    for key, name in TRL_CLASSES:
        if key in data:
            return name
    return "a TRL config"


def trl_cases(given: dict, notes: list, via: str) -> list[Case]:
    """TRL's bf16 default: None -> not fp16 (TRL >= 0.19.0), False before; fp16 as given."""
    if given.get("bf16") is not None:
        return flag_cases(given, notes, via)
    fp16 = str_to_bool(given["fp16"], "fp16") if given.get("fp16") is not None else False
    was = "absent -> off (TrainingArguments default False)" if given.get("fp16") is None else \
        f"{str(given['fp16']).lower()} -> {'on' if fp16 else 'off'}"
    notes.append(f"fp16: {was}")
    if fp16:
        notes.append(f"bf16: absent -> off, as fp16 is on ({TRL_SINCE})")
        return [Case("", False, True)]
    notes.append(f"bf16: absent -> true on TRL >= 0.19.0, false on older TRL ({TRL_SINCE})")
    return [Case("TRL >= 0.19.0", True, False), Case("TRL < 0.19.0", False, False)]


def read_hf(data: dict, source: str, *, base_dir=None, cwd=None, launch: Launch | None = None,
            config_file: str | None = None, trl_command: str | None = None) -> TrainingRun:
    """A TrainingArguments file (or script arguments), HF Trainer or TRL by its keys (or ``trl <command>``)."""
    notes: list[str] = []
    if is_trl(data) or trl_command:
        what = f"trl {trl_command}" if trl_command else \
            f"{trl_class(data)}; keys {', '.join(sorted(TRL_KEYS & set(data)))}"
        notes.append(f"framework: TRL ({what}), a TrainingArguments subclass run by the HF Trainer's loop")
        via = "TrainingArguments.{key}, which TRL's config inherits"
        cases = trl_cases(data, notes, via)
        return resolve_trainer("trl", source, data, notes, via=via, launch=launch, base_dir=base_dir, cwd=cwd,
                               cases=cases, config_file=config_file)
    notes.append("framework: HF Trainer (TrainingArguments keys, no TRL-only keys)")
    return resolve_trainer("hf-trainer", source, data, notes, via=HF_VIA, launch=launch, base_dir=base_dir, cwd=cwd,
                           config_file=config_file)


def parse_cli(tokens: list[str]) -> tuple[list[str], dict]:
    """Script arguments as argparse / HfArgumentParser read them: ``--flag value``, ``--flag=value``, a bare
    ``--flag`` (a bool field given alone is True: nargs="?", const=True), ``--flag-name`` == ``--flag_name``.
    Returns (positionals, {name: value or True}); the last of a repeated flag wins, as in argparse."""
    positionals, options = [], {}
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok == "--":
            positionals.extend(tokens[i + 1:])
            break
        if tok.startswith("--") and len(tok) > 2:
            name, eq, value = tok[2:].partition("=")
            name = name.replace("-", "_")
            if eq:
                options[name] = value
            elif i + 1 < len(tokens) and (not tokens[i + 1].startswith("-") or INT_RE.match(tokens[i + 1])):
                options[name] = tokens[i + 1]
                i += 1
            else:
                options[name] = True
        elif tok.startswith("-") and len(tok) > 1 and not INT_RE.match(tok):
            # a short option (-m, -e): its value, if any, is the next token that is not an option
            if i + 1 < len(tokens) and not tokens[i + 1].startswith("-"):
                i += 1
        else:
            positionals.append(tok)
        i += 1
    return positionals, options


def cli_values(options: dict) -> dict:
    """Script options as TrainingArguments values: a bare bool flag is True, a bare --fsdp is True
    (nargs="?", const=True), a bare --deepspeed is an error (it takes a path or JSON)."""
    out = {}
    for name, value in options.items():
        if value is True and name not in BOOL_FIELDS and name != "fsdp":
            if name == "deepspeed":
                raise ConfigError("--deepspeed needs a value: a DeepSpeed JSON path or an inline JSON object")
            continue  # an unknown bare flag of the script's own
        if name in BOOL_FIELDS and value is not True:
            value = str_to_bool(value, f"--{name}")
        out[name] = value
    return out
