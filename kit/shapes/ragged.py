"""``ragged``: micro-batches of different sizes, as sequences of different token counts make them. The MLP's
samples stand for tokens: micro-batch i of a rank holds between 1 and 2 x ``micro_batch`` of them (drawn from the
seed, the rank, the step and i). The reference is the mean over every sample of the global batch, so each micro-batch
weighs its share of the samples; a loop that takes each micro-batch's mean and divides by GA weighs them all alike
(the gradient-accumulation loss bug of token-level losses), and one that divides by a rank's own count weighs the
ranks alike."""
from __future__ import annotations

import torch

from gradkit.shapes.data import rank_samples
from gradkit.shapes.mlp import build, groups, tiny_mlp
from gradkit.shapes.shape import Shape


def sizes(seed: int, rank: int, ga: int, micro_batch: int, step: int) -> list[int]:
    """The sizes of one rank's ``ga`` micro-batches of ``step``: 1 .. 2 x ``micro_batch`` each."""
    g = torch.Generator().manual_seed(seed * 7919 + rank * 131 + step * 17 + 3)
    return [int(n) for n in torch.randint(1, 2 * micro_batch + 1, (ga,), generator=g)]


def batches(seed: int, rank: int, ga: int, micro_batch: int, hidden: int, step: int = 0):
    n = sizes(seed, rank, ga, micro_batch, step)
    x, y = rank_samples(seed, rank, sum(n), hidden, step)
    out, k = [], 0
    for m in n:
        out.append((x[k:k + m], y[k:k + m]))
        k += m
    return out


SHAPE = Shape(name="ragged", title="micro-batches of 1 to 2x the micro-batch size (token counts that differ)",
              build=build, groups=groups, batches=batches, standalone=(tiny_mlp, build), order=5)
