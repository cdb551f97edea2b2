"""What a model shape is: one object per module of ``gradkit.shapes`` (``SHAPE = Shape(...)``), found by
``gradkit.shapes.registry()``.

Every probe that takes a model judges it through its shape: the model (``build``), its micro-batches (the
common samples, with the routing columns a conditional model reads), its loss, and its parameter groups (the
fitted weights and the errors are told per group, so "the expert's gradient from micro-batch 2 was lost" is
said as such). A shape's model is small and built from a seed, the same on every rank; its reference is the same
model in plain fp32 on the whole batch, in one process.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch

from gradkit.shapes.data import micro_batches, mse


def _no_routes(i: int, n: int, step: int) -> list[float]:
    return []


@dataclass(frozen=True)
class Shape:
    name: str
    title: str  # one line: what the shape is and where real training has it
    build: Callable  # (seed, hidden, depth) -> nn.Module, fp32, the same weights on every rank
    groups: Callable  # (module) -> {group: [parameter names]}: every parameter in exactly one group
    routes: Callable = _no_routes  # (micro-batch i, N, step) -> one 0/1 column per route; the model reads them
    route_names: tuple = ()  # the routes, in column order (empty: every parameter used by every micro-batch)
    loss: Callable | None = None  # (output, target) -> mean loss of the micro-batch; None: the probes' MSE
    batches: Callable | None = None  # (seed, rank, ga, micro_batch, hidden, step) -> [(x, y)]; None: the common
    shrunk: tuple = field(default=())  # lines: what was shrunk from the user's model (``--model``)
    unused_parameters: bool = False  # some parameter gets no gradient in some micro-batch (DDP must look for them)
    # (module, micro-batches, loss_fn) -> {group: {use: gradient of the whole batch's mean loss through that use}}:
    # where one parameter is used in several places (a tied weight), its gradient split by use, so that a step
    # that drops one use's contribution is fitted as such ("head use x0")
    uses: Callable | None = None
    # the module-level functions a standalone reproduction needs, in order (each imports only torch / peft inside):
    # it defines them and calls ``build(seed, hidden, depth)`` (and ``routes(i, n, step)`` for a routed shape)
    standalone: tuple = ()
    order: int = 100

    def micro_batches(self, seed: int, rank: int, ga: int, micro_batch: int, hidden: int, step: int = 0):
        """One rank's micro-batches of ``step``, each ``(x, y)``; a routed shape's ``x`` carries its route columns
        after the ``hidden`` features (the same value in every row of a micro-batch)."""
        if self.batches is not None:
            return self.batches(seed, rank, ga, micro_batch, hidden, step)
        out = micro_batches(seed, rank, ga, micro_batch, hidden, step)
        if not self.route_names:
            return out
        return [(torch.cat([x, torch.tensor([self.routes(i, ga, step)] * len(x), dtype=x.dtype)], dim=1), y)
                for i, (x, y) in enumerate(out)]

    def loss_fn(self, output, target):
        return (self.loss or mse)(output, target)

    def source(self) -> str:
        """The standalone Python source of this shape's model (and routes): what a reproduction script embeds."""
        return "\n\n".join(inspect.getsource(f) for f in self.standalone)
