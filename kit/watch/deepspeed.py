"""The watch on a DeepSpeed engine, whatever loop drives it (its own ``backward`` / ``step`` per micro-batch, the
boundary set by hand, several ``backward`` per ``step`` with GA 1 in the config, Accelerate or the Trainer above it):

    engine = watch_engine(engine)          # after deepspeed.initialize, before the loop

The consumed gradient is read in the engine's innermost torch optimizer (``gradkit.watch.reads``); a step ends when
``engine.step()`` returns at a boundary, skipped where the fp16 loss scale overflowed. The engine's own settings
(clipping, precision) set the expected step; an affected step is matched against the known bugs of the engine's
release and stage (``gradkit.commands.check.known``), with their fix."""
from __future__ import annotations

import torch

from gradkit.commands.check import known as kknown
from gradkit.probes.ranks.ds_config import own_loss_scale
from gradkit.watch.core import Watch


def settings(engine) -> dict:
    """What the records say of the engine: release, stage, optimizer, precision, accumulation, clipping."""
    import deepspeed

    dtype = "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else None
    return {"versions": {"deepspeed": deepspeed.__version__, "torch": torch.__version__},
            "zero_stage": int(engine.zero_optimization_stage()), "optimizer": type(engine.optimizer).__name__,
            "engine_ga": int(engine.gradient_accumulation_steps()), "engine_dtype": dtype,
            "clip": float(engine.gradient_clipping() or 0.0)}


def explain(rec: dict) -> str | None:
    """The known bug the step matches on this engine, with its fix, or a sentence saying none does."""
    loop = "manual" if rec.get("engine_ga") == 1 and rec.get("ga", 1) > 1 else "engine"
    # the user's own model: whether a step reaches every parameter is not known, so B6 and B7 stay candidates
    as_check = {**rec, "config": {"loop": loop, "ds_config": rec.get("ds_config") or {}, "model_config": "user's"},
                "ga": rec.get("ga")}
    return kknown.explain(as_check)[1]


def watch_engine(engine, **options):
    """``engine`` with a ``Watch`` on it (``engine.gradkit_watch``); ``options`` as ``Watch`` takes them. Where the
    watch cannot be put on this engine, the engine comes back as it was, and the log says why."""
    try:
        info = settings(engine)
        info["ds_config"] = getattr(engine, "_config", None) and getattr(engine._config, "_param_dict", None) or {}
        info["loss_scale"] = own_loss_scale(engine.optimizer) if info["engine_dtype"] == "fp16" else 1.0
        options.setdefault("clip", info["clip"] or None)
        options.setdefault("dtype", info["engine_dtype"])
        watch = Watch(engine.module, engine.optimizer, finalize_on_post=False, known=explain,
                      context={**info, **options.pop("context", {})}, **options)
    except Exception as e:  # noqa: BLE001 - the watch never stops the job: it says why it cannot watch it
        print(f"gradkit watch: cannot watch this engine ({type(e).__name__}: {e}); training goes on without it")
        return engine
    original = engine.step

    def step(*args, **kwargs):
        boundary = engine.is_gradient_accumulation_boundary()
        skipped_before = getattr(engine, "skipped_steps", 0)
        out = original(*args, **kwargs)
        if boundary:
            watch.step_end(skipped=getattr(engine, "skipped_steps", 0) > skipped_before)
        return out

    engine.step = step
    engine.gradkit_watch = watch
    return engine
