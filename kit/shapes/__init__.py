"""The model shapes: every module of this package that defines ``SHAPE = kit.shape.Shape(...)``.

    from kit import shapes
    shapes.registry()              # {"mlp": Shape, "frozen": Shape, ...}, in order
    shapes.get("conditional")
    shapes.of_case(case)           # a probe case's shape: a registered one, or the user's own (``--model``)

A shape is found by being here: adding one edits no list.
"""
from __future__ import annotations

import importlib
import pkgutil

from kit.shape import Shape

_FOUND: dict[str, Shape] | None = None
DEFAULT = "mlp"


def registry() -> dict[str, Shape]:
    """Every registered shape, ``{name: Shape}``, by (order, name)."""
    global _FOUND
    if _FOUND is None:
        found = {}
        for info in pkgutil.iter_modules(__path__):
            if info.name.startswith("_"):
                continue
            shape = getattr(importlib.import_module(f"{__name__}.{info.name}"), "SHAPE", None)
            if isinstance(shape, Shape):
                if shape.name in found:
                    raise RuntimeError(f"two shapes are named {shape.name!r}")
                found[shape.name] = shape
        _FOUND = found
    return {s.name: s for s in sorted(_FOUND.values(), key=lambda s: (s.order, s.name))}


def get(name: str) -> Shape:
    from kit import config as kconfig

    every = registry()
    if name not in every:
        raise kconfig.ConfigError(f"unknown model shape {name!r}; the kit knows {list(every)}")
    return every[name]


def of_case(case: dict) -> Shape:
    """The shape a case names (``model``; the MLP when it names none); the user's own architecture when the case
    carries its shrunk Hugging Face config (``model_config``, from ``gradkit check --model``)."""
    if case.get("model_config"):
        from kit.shapes import _hf

        return _hf.shape(case["model_config"], case.get("adapter_config"))
    return get(case.get("model") or DEFAULT)
