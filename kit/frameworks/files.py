"""``detect`` / ``read`` for a file: a framework config (by its keys) or a shell script holding a launch command."""
from __future__ import annotations

from pathlib import Path

import yaml

from gradkit.config import ConfigError
import gradkit.frameworks.command_line as command_line
from gradkit.frameworks.dispatch import detect_data, read_data
from gradkit.frameworks.run import TrainingRun, load_mapping

COMMAND_SUFFIXES = (".sh", ".bash", ".zsh", ".cmd")


def _is_command(p: Path) -> bool:
    if p.suffix in COMMAND_SUFFIXES:
        return True
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {p}: {getattr(e, 'strerror', None) or e}") from None
    if text.startswith("#!"):
        return True
    if p.suffix in (".yaml", ".yml", ".json"):
        return False
    try:  # a one-line command parses as a YAML string, never as a mapping
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        data = None
    if isinstance(data, dict):
        return False
    try:
        command_line.split_script(text, str(p))
    except ConfigError:
        return False
    return True


def _checked(path) -> Path:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: no such file" if not p.exists() else f"{p} is not a file")
    return p


def detect(path) -> str:
    """The framework of a config file, by its keys ("llamafactory", "axolotl", "trl", "hf-trainer", "accelerate",
    "deepspeed"), or "command-line" for a shell script holding a launch command; ``ConfigError`` for anything else."""
    p = _checked(path)
    if _is_command(p):
        return "command-line"
    return detect_data(load_mapping(p), str(p))


def read(path, cwd=None) -> TrainingRun:
    """A training config or launch script as its framework resolves it. Paths inside it are looked up relative to
    its folder, then ``cwd`` (default: the working directory)."""
    p = _checked(path)
    cwd = Path(cwd) if cwd is not None else Path.cwd()
    if _is_command(p):
        return command_line.read_command_file(p, cwd=cwd)
    data = load_mapping(p)
    return read_data(data, str(p), base_dir=p.parent, cwd=cwd, config_file=str(p))
