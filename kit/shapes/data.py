"""The data every shape starts from: a deterministic function of (seed, rank, step), so any rank (and the oracle) can
rebuild every other rank's micro-batches without communication; and the probes' loss."""
from __future__ import annotations

import torch


def rank_samples(seed: int, rank_id: int, n: int, hidden: int, step: int = 0):
    """``n`` (input, target) samples of one rank: targets from a fixed random teacher plus noise."""
    teacher = torch.Generator().manual_seed(seed)
    t = torch.randn(hidden, hidden, generator=teacher) / hidden ** 0.5
    g = torch.Generator().manual_seed(seed * 100_003 + 7919 * rank_id + 104_729 * step + 1)
    x = torch.randn(n, hidden, generator=g)
    y = x @ t + 0.1 * torch.randn(n, hidden, generator=g)
    return x, y


def micro_batches(seed: int, rank_id: int, ga: int, micro_batch: int, hidden: int, step: int = 0):
    """One rank's global-step data, split into ``ga`` micro-batches of ``micro_batch`` samples."""
    x, y = rank_samples(seed, rank_id, ga * micro_batch, hidden, step)
    return [(x[i * micro_batch:(i + 1) * micro_batch], y[i * micro_batch:(i + 1) * micro_batch]) for i in range(ga)]


def mse(output, target):
    """Mean squared error, computed in fp32 whatever the model's dtype."""
    return ((output.float() - target.float()) ** 2).mean()
