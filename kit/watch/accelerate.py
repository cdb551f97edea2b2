"""The watch in an Accelerate loop, after ``accelerator.prepare``:

    watch = watch_accelerate(accelerator, model, optimizer, criterion=criterion)

Under Accelerate's DeepSpeed plugin the prepared model is DeepSpeed's engine, and the engine's adapter
(``gradkit.watch.deepspeed.watch_engine``) takes it. Otherwise the ``Watch`` goes on the unwrapped model and the
optimizer Accelerate wraps; a step ends when the torch optimizer has stepped. The accumulation the user declared
(``gradient_accumulation_steps``, ``sync_each_batch``) goes into every record: a step taken after fewer micro-batches
than declared is said, and matched against Accelerate's known bug of that release (ACC)."""
from __future__ import annotations

import accelerate
import torch

import gradkit.watch.known as known
from gradkit.watch.core import Watch
from gradkit.watch.deepspeed import watch_engine


def watch_accelerate(accelerator, model, optimizer, **options):
    """A ``Watch`` on an Accelerate loop (the engine under DeepSpeed: ``engine.gradkit_watch``)."""
    if str(getattr(accelerator, "distributed_type", "")).endswith("DEEPSPEED"):
        return watch_engine(model, **options).gradkit_watch
    plugin = getattr(accelerator, "gradient_state", None)
    plugin = getattr(plugin, "plugin_kwargs", None) or {}
    context = {"versions": {"accelerate": accelerate.__version__, "torch": torch.__version__},
               "declared_ga": int(accelerator.gradient_accumulation_steps),
               "sync_each_batch": bool(plugin.get("sync_each_batch", False)), **options.pop("context", {})}
    return Watch(accelerator.unwrap_model(model), optimizer, context=context,
                 known=lambda rec: known.from_table(rec, "accelerate"), **options)
