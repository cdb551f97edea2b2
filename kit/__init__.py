"""gradkit: make gradient-accumulation bugs in the DeepSpeed / HF Trainer stack visible and checkable.

The one import name is ``gradkit``; its code is the folder ``kit/``: ``gradkit.X.Y`` is ``kit/X/Y.py`` (setup.py maps
the name onto the folder). Data flow: config -> ``gradkit.launch`` W ranks -> probe (``gradkit.probes``; what a rank
runs: ``gradkit.probes.ranks``) -> JSON records (``gradkit.judge.records``) -> verdict (``gradkit.judge.oracle``) ->
tables and figures (``gradkit.notebooks``). The commands (``gradkit check`` / ``bisect`` / ``report``, the sweep) are
``gradkit.commands``; the release stacks (overlays, prefetch, source) ``gradkit.stacks``; the model shapes
``gradkit.shapes``; the oracle inside a user's own job ``gradkit.watch``. ``docs/layout.md`` draws it.

Importing ``gradkit`` imports nothing else: ``gradkit.watch`` (torch only) is loaded when first used, and
transformers, DeepSpeed, accelerate, PEFT and TRL only where a job uses them.
"""
import importlib

__version__ = "0.1.0"  # the one place the version is written (pyproject.toml reads it)


def __getattr__(name):  # ``import gradkit`` then ``gradkit.watch.Callback()``
    if name == "watch":
        return importlib.import_module("gradkit.watch")
    raise AttributeError(f"module 'gradkit' has no attribute {name!r}")
