"""The model shapes: every module of this package that defines ``SHAPE = gradkit.shapes.shape.Shape(...)``.

    from gradkit import shapes
    shapes.registry()              # {"mlp": Shape, "frozen": Shape, ...}, in order
    shapes.get("conditional")
    shapes.of_case(case)           # a probe case's shape: a registered one, or the user's own (``--model``)

A shape is found by being here: adding one edits no list.
"""
from __future__ import annotations

from gradkit.registry import Registry
from gradkit.shapes import hf
from gradkit.shapes.shape import Shape

DEFAULT = "mlp"
_REGISTRY: Registry[Shape] = Registry(__name__, "SHAPE", Shape, lambda s: s.name, "model shape")
registry = _REGISTRY.all
get = _REGISTRY.get


def of_case(case: dict) -> Shape:
    """The shape a case names (``model``; the MLP when it names none); the user's own architecture when the case
    carries its shrunk Hugging Face config (``model_config``, from ``gradkit check --model``)."""
    if case.get("model_config"):
        return hf.shape(case["model_config"], case.get("adapter_config"))
    return get(case.get("model") or DEFAULT)
