"""The resolved training run (``TrainingRun``), what a launcher adds to it (``Launch``), and the small readers every
framework module shares: files, paths inside configs, and values as the frameworks parse them.

Nothing here imports a training framework: each rule is re-implemented from the upstream source it cites.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from gradkit.config import ConfigError

PRECISIONS = ("fp32", "bf16", "fp16")
FRAMEWORKS = ("hf-trainer", "trl", "llamafactory", "axolotl", "accelerate", "deepspeed")
PATHS = ("deepspeed", "fsdp", "ddp", "single")


@dataclass
class TrainingRun:
    """A training config as its framework resolves it; ``notes`` says each resolution in one line."""

    framework: str
    source: str
    loops: tuple[str, ...]
    precision: str | None
    precisions: tuple[str, ...]
    ga: int | None
    micro_batch: int | None
    world_size: int | None
    path: str
    ds_config: dict | None = None
    ds_config_file: str | None = None
    max_grad_norm: float | None = None
    adapter: str | None = None
    notes: list[str] = field(default_factory=list)
    # what TrainingArguments' bf16 / fp16 say, i.e. what fills a DeepSpeed config's "auto" precision (the
    # ``trainer_dtype`` of gradkit.probes.ds_resolve); differs from ``precision`` for LLaMA-Factory's pure_bf16, and is
    # None where it is not resolved (or no Trainer runs)
    trainer_dtype: str | None = None
    zero_stage: int | None = None       # zero_optimization.stage of ds_config (None: not DeepSpeed, or "auto")
    launcher: str | None = None          # torchrun / deepspeed / accelerate / llamafactory-cli / axolotl / python
    config_file: str | None = None       # the framework config a command line names
    # what the framework sets on its Trainer whatever the config says (axolotl: average_tokens_across_devices and
    # model_accepts_loss_kwargs False); the path check runs the Trainer so
    trainer_overrides: dict = field(default_factory=dict)


@dataclass
class Launch:
    """What the launch adds to a framework config: ranks, and the environment ``accelerate launch`` sets
    (accelerate/utils/launch.py prepare_multi_gpu_env / prepare_deepspeed_cmd_env)."""

    launcher: str | None = None
    world_size: int | None = None
    mixed_precision: str | None = None  # ACCELERATE_MIXED_PRECISION
    deepspeed: bool = False              # ACCELERATE_USE_DEEPSPEED
    ds_fields: dict = field(default_factory=dict)  # DeepSpeedPlugin fields (zero_stage, gradient_accumulation_steps ...)
    ds_fields_from_config: tuple = ()   # ACCELERATE_CONFIG_DS_FIELDS: the fields the accelerate YAML itself set
    ds_file: str | None = None           # ACCELERATE_DEEPSPEED_CONFIG_FILE, found
    ds_file_config: dict | None = None
    fsdp: bool = False                   # ACCELERATE_USE_FSDP
    fsdp_config: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def load_mapping(path, what: str = "config") -> dict:
    """A YAML or JSON file that must hold a mapping, read by its content: as JSON wherever the text parses as JSON
    (as DeepSpeed reads its config, whatever the file is called: YAML would read JSON's ``1e9`` as a string), else as
    YAML (a ``.json`` file must be JSON); ``ConfigError`` in one sentence otherwise."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read {p}: {e.strerror or e}") from None
    data, error = None, None
    try:
        data = json.loads(text)
    except ValueError as e:
        error = e
    if error is not None and p.suffix != ".json":
        try:
            data, error = yaml.safe_load(text), None
        except yaml.YAMLError as e:
            error = e
    if error is not None:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"{p} is not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {first}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p} must hold a {what} mapping (key: value), got {type(data).__name__}")
    return data


def find_file(value, key: str, base_dir, cwd) -> Path:
    """A path a config names (``key``), looked up relative to the config's folder, then ``cwd``; ``ConfigError``
    naming the key, the path and where it looked when it is in neither."""
    if not isinstance(value, (str, Path)) or not str(value).strip():
        raise ConfigError(f"{key} must be a file path, got {value!r}")
    p = Path(str(value)).expanduser()
    if p.is_absolute():
        if p.is_file():
            return p
        raise ConfigError(f"{key}: {value} does not exist")
    places = []
    for base in (base_dir, cwd):
        if base is None:
            continue
        base = Path(base)
        if base not in places:
            places.append(base)
    for base in places:
        if (base / p).is_file():
            return (base / p).resolve()
    where = " or ".join(str(b) for b in places) or "no folder (no config folder or cwd given)"
    raise ConfigError(f"{key}: {value} is not found relative to {where}")


def load_ds_json(value, key: str, base_dir, cwd) -> tuple[dict, str | None]:
    """A DeepSpeed config as HF accepts it (transformers integrations/deepspeed.py HfDeepSpeedConfig.__init__ ->
    accelerate utils/deepspeed.py HfDeepSpeedConfig.__init__): a dict, a path to a JSON file, or a JSON string.
    Returns (config, the file's path or None)."""
    if isinstance(value, dict):
        return dict(value), None
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            data = json.loads(value)
        except ValueError as e:
            raise ConfigError(f"{key} is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{key} must be a JSON object")
        return data, None
    p = find_file(value, key, base_dir, cwd)
    try:
        data = json.loads(p.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read {p} ({key}): {e.strerror or e}") from None
    except ValueError as e:
        raise ConfigError(f"{p} ({key}) is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p} ({key}) must hold a JSON object, got {type(data).__name__}")
    return data, str(p)


def str_to_bool(value, key: str) -> bool:
    """A boolean as HfArgumentParser reads one (transformers hf_argparser.py string_to_bool); YAML booleans as is."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        if value.lower() in ("yes", "true", "t", "y", "1"):
            return True
        if value.lower() in ("no", "false", "f", "n", "0"):
            return False
    if value in (0, 1) and not isinstance(value, float):
        return bool(value)
    raise ConfigError(f"{key} must be true or false, got {value!r}")


def positive_int(value, key: str) -> int:
    """An int >= 1 (a GA or a batch size); strings of digits as a command line gives them."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key} must be a positive integer, got {value!r}")
    return value


def number(value, key: str) -> float:
    """A float (max_grad_norm, gradient_clipping); strings as a command line gives them."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key} must be a number, got {value!r}")
    return float(value)


def shown(value) -> str:
    """A value as a note shows it: YAML's spelling (true, null, 8)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str) and value == "auto":
        return '"auto"'
    return str(value)


def unique(values) -> tuple:
    out = []
    for v in values:
        if v not in out:
            out.append(v)
    return tuple(out)


def zero_stage_of(ds: dict | None) -> int | None:
    """zero_optimization.stage (0 where the section or key is absent: DeepSpeed's default); None for "auto"."""
    zero = (ds or {}).get("zero_optimization") if ds is not None else None
    if ds is None or (zero is not None and not isinstance(zero, dict)):
        return None
    stage = (zero or {}).get("stage", 0)
    return stage if isinstance(stage, int) and not isinstance(stage, bool) else None


def world_note(world_size: int | None) -> str:
    if world_size is None:
        return ("world size: not in the file -> unknown (the launcher sets it: torchrun --nproc_per_node, "
                "accelerate num_processes, deepspeed --num_gpus)")
    return f"world size: {world_size}"


def plain_path(world_size: int | None) -> tuple[str, str]:
    """DDP or one process, for a run with neither DeepSpeed nor FSDP."""
    if world_size == 1:
        return "single", "path: single (one process, no DeepSpeed or FSDP)"
    if world_size is None:
        return "ddp", ("path: ddp (no DeepSpeed or FSDP; the Trainer wraps the model in DDP once launched on "
                       "several processes, one process runs it bare)")
    return "ddp", f"path: ddp ({world_size} processes, no DeepSpeed or FSDP: the Trainer wraps the model in DDP)"
