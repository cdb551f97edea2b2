"""``conditional``: parameters used by only some micro-batches, kept as separate modules: a vision tower in the
text-only micro-batches of a multimodal fine-tune, a value head in some passes of RLHF, experts as older MoE code
and DeepSpeed-MoE keep them. A shared MLP (the trunk) sees every micro-batch; beside it five experts, each added
to the output only where the micro-batch's route says so. Within an accumulation window of N micro-batches (i =
0 .. N-1):

=============  ===============================================
expert         micro-batches that skip it
=============  ===============================================
skip_first     the first (i = 0)
skip_middle    the middle one (i = N // 2)
skip_last      the last (i = N - 1)
only_first     all but the first: one micro-batch uses it
idle           every one: no gradient in the whole step
=============  ===============================================

The route is data (one 0/1 column per expert after the features, the same in every row of a micro-batch), so
the engine's model and the one-process reference take the same path through the same code.
"""
from __future__ import annotations

from gradkit.shapes.mlp import tiny_mlp
from gradkit.shapes.shape import Shape

EXPERTS = ("skip_first", "skip_middle", "skip_last", "only_first", "idle")


def routes(i: int, n: int, step: int) -> list:
    """Micro-batch i of n, at any step: 1.0 for each expert (in EXPERTS order) it uses."""
    return [float(i != 0), float(i != n // 2), float(i != n - 1), float(i == 0), 0.0]


def routed(seed: int, hidden: int, depth: int, experts: tuple):
    """The trunk MLP plus one Linear expert per route; an expert joins a micro-batch where its column is 1."""
    import torch
    import torch.nn as nn

    class Routed(nn.Module):
        def __init__(self):
            super().__init__()
            self.trunk = tiny_mlp(hidden, seed, depth)
            torch.manual_seed(seed + 1)
            self.experts = nn.ModuleDict({e: nn.Linear(hidden, hidden) for e in experts})

        def forward(self, x):
            z, route = x[:, :hidden], x[:, hidden:]
            out = self.trunk(z)
            for k, expert in enumerate(self.experts.values()):
                if bool(route[0, k] > 0.5):  # a Python branch: the expert's parameters are not in this graph
                    out = out + expert(z)
            return out

    return Routed()


def groups_of(experts: tuple):
    def groups(module) -> dict:
        names = [n for n, _ in module.named_parameters()]
        out = {"trunk": [n for n in names if n.startswith("trunk.")]}
        out.update({f"expert {e}": [n for n in names if n.startswith(f"experts.{e}.")] for e in experts})
        return out

    return groups


def build(seed: int, hidden: int, depth: int):
    return routed(seed, hidden, depth, ("skip_first", "skip_middle", "skip_last", "only_first", "idle"))


SHAPE = Shape(name="conditional", title="experts used by some micro-batches only (first, middle, last skipped; "
                                         "one used once; one idle)",
              build=build, groups=groups_of(EXPERTS), routes=routes, route_names=EXPERTS, unused_parameters=True,
              standalone=(tiny_mlp, routed, build, routes), order=3)
