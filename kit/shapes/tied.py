"""``tied``: one weight used twice, as a language model ties its input embedding and its output head: the input
goes through ``embed`` (x W^T), the MLP, then ``head``, whose weight *is* ``embed``'s. The right gradient of the
tied weight is the sum of its two uses' contributions."""
from __future__ import annotations

from gradkit.shapes.mlp import tiny_mlp
from gradkit.shapes.shape import Shape

TIED = "tied weight (embedding and head)"


def build(seed: int, hidden: int, depth: int):
    """embed (hidden x hidden, no bias), GELU, the MLP, GELU, head: the same weight as embed."""
    import torch
    import torch.nn as nn

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(seed)
            self.embed = nn.Linear(hidden, hidden, bias=False)
            self.body = tiny_mlp(hidden, seed + 1, max(1, depth - 1))
            self.head = nn.Linear(hidden, hidden, bias=False)
            self.head.weight = self.embed.weight  # tie_word_embeddings

        def forward(self, x):
            h = nn.functional.gelu(self.body(nn.functional.gelu(self.embed(x))))
            if getattr(self, "untie_fault", False):  # tests' broken loop: the head's use adds no gradient
                return nn.functional.linear(h, self.embed.weight.detach())
            return self.head(h)

    return Tied()


def groups(module) -> dict:
    names = [n for n, _ in module.named_parameters()]  # the tied weight is listed once, as embed.weight
    return {TIED: ["embed.weight"], "the rest": [n for n in names if n != "embed.weight"]}


def uses(module, every, loss_fn) -> dict:
    """The tied weight's gradient through each of its two uses: the same weights with the tie cut (two separate
    copies of one value), the whole batch's mean loss differentiated by each copy."""
    import copy

    import torch

    untied = copy.deepcopy(module).float()
    untied.head.weight = torch.nn.Parameter(untied.embed.weight.detach().clone())
    total = float(sum(len(x) for x, _ in every))
    loss = sum(len(x) / total * loss_fn(untied(x.float()), y.float()) for x, y in every)
    g_embed, g_head = torch.autograd.grad(loss, [untied.embed.weight, untied.head.weight])
    return {TIED: {"embedding use": g_embed.reshape(-1).double(), "head use": g_head.reshape(-1).double()}}


SHAPE = Shape(name="tied", title="one weight used twice (tied input embedding and output head)", build=build,
              groups=groups, uses=uses, standalone=(tiny_mlp, build), order=2)
