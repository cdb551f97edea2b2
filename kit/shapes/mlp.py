"""``mlp``: Linear layers with GELU between them; every parameter gets a gradient from every micro-batch."""
from __future__ import annotations

from gradkit.shapes.shape import Shape


def tiny_mlp(hidden: int, seed: int, depth: int = 2):
    """``depth`` Linear layers of width ``hidden`` with GELU between; fp32, same weights on every rank."""
    import torch
    import torch.nn as nn

    torch.manual_seed(seed)
    layers = []
    for i in range(depth):
        layers.append(nn.Linear(hidden, hidden))
        if i < depth - 1:
            layers.append(nn.GELU())
    return nn.Sequential(*layers)


def build(seed: int, hidden: int, depth: int):
    return tiny_mlp(hidden, seed, depth)


def groups(module) -> dict:
    return {"every layer": [n for n, _ in module.named_parameters()]}


SHAPE = Shape(name="mlp", title="a small MLP: every parameter gets a gradient from every micro-batch", build=build,
              groups=groups, standalone=(tiny_mlp, build), order=0)
