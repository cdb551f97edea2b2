"""``frozen``: the MLP's weights frozen (``requires_grad=False``), small LoRA adapters beside every Linear layer
trained: what a LoRA fine-tune looks like. Built with PEFT itself (``peft.get_peft_model``), its B matrices drawn
at random (``init_lora_weights=False``) so that both adapter matrices get a gradient from the first step. A
frozen weight's right update is exactly 0."""
from __future__ import annotations

from gradkit.shapes.mlp import tiny_mlp
from gradkit.shapes.shape import Shape


def build(seed: int, hidden: int, depth: int):
    """The MLP frozen, a rank-2 LoRA adapter (PEFT) on each of its Linear layers."""
    import peft
    import torch

    base = tiny_mlp(hidden, seed, depth)
    targets = [n for n, m in base.named_modules() if isinstance(m, torch.nn.Linear)]
    torch.manual_seed(seed + 1)  # the adapters: the same on every rank
    cfg = peft.LoraConfig(r=2, lora_alpha=2, target_modules=targets, init_lora_weights=False, lora_dropout=0.0)
    return peft.get_peft_model(base, cfg)


def groups(module) -> dict:
    names = [n for n, _ in module.named_parameters()]
    return {"adapters": [n for n in names if ".lora_" in n], "frozen weights": [n for n in names if ".lora_" not in n]}


SHAPE = Shape(name="frozen", title="LoRA (PEFT) adapters trained beside frozen weights", build=build, groups=groups,
              standalone=(tiny_mlp, build), order=1)
