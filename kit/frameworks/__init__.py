"""The training config a user launches with, read as its framework resolves it.

    from gradkit import frameworks
    run = frameworks.read("examples/train_full/qwen3_full_sft.yaml")      # LLaMA-Factory, axolotl, TRL, HF, ...
    run = frameworks.read_command_line(shlex.split("torchrun --nproc_per_node 8 train.py --deepspeed ds.json --bf16"))
    run.framework, run.precision, run.ga, run.path, run.ds_config; print("\\n".join(run.notes))

``detect(path)`` names the framework by the file's keys; ``read`` dispatches on it (a shell script holding a
launch command goes to ``read_command_line``). Bad input raises ``gradkit.config.ConfigError`` (exit 2) in one sentence.
No framework is imported: each rule is re-implemented from the upstream source its module cites.
"""
from gradkit.frameworks.command_line import read_command_line
from gradkit.frameworks.files import detect, read
from gradkit.frameworks.run import TrainingRun

__all__ = ["TrainingRun", "detect", "read", "read_command_line"]
