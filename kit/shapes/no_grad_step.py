"""``no_grad_step``: a parameter that gets no gradient at all in some optimizer steps and does in others: a head
used on every other step (steps 1, 3, ...: none of their micro-batches reach it; step 2: all of them). A stale
gradient kept from the step before, or a step applied to a parameter that had none, shows on the steps without."""
from __future__ import annotations

from gradkit.shapes.conditional import groups_of, routed
from gradkit.shapes.mlp import tiny_mlp
from gradkit.shapes.shape import Shape

HEADS = ("every_other_step",)


def routes(i: int, n: int, step: int) -> list:
    """Optimizer step ``step`` (0-based): the head is used by every micro-batch of steps 1, 3, ... and by none of
    steps 0, 2, ..."""
    return [float(step % 2 == 1)]


def build(seed: int, hidden: int, depth: int):
    return routed(seed, hidden, depth, ("every_other_step",))


SHAPE = Shape(name="no_grad_step", title="a head with no gradient in every other optimizer step", build=build,
              groups=groups_of(HEADS), routes=routes, route_names=HEADS, unused_parameters=True,
              standalone=(tiny_mlp, routed, build, routes), order=4)
