"""``gradkit watch``: the oracle inside the user's own training job, on their real model and data.

One line in the job, in each ecosystem's own convention:

    watch = Watch(model, optimizer)                        # a plain torch loop (DDP, no_sync)
    engine = watch_engine(engine)                           # a DeepSpeed engine, any of its loops
    trainer = Trainer(..., callbacks=[Callback()])          # the HF Trainer and TRL (gradkit.watch.hf)
    watch = watch_accelerate(accelerator, model, optimizer) # an Accelerate loop (gradkit.watch.accelerate)
    python -m gradkit.watch.attach trl.scripts.sft ...      # a framework's CLI that takes no callback (attach)

At a judged step (the first two, then every 100th, or on request) the gradient the optimizer consumes is judged
against the exact gradient of the global batch as the user's loss defines it, per micro-batch and rank, with the
kit's tolerances; one line goes to the training log and one record to ``gradkit-watch/watch.jsonl``.

Where things are: ``schedule`` (which steps), ``capture`` (what each micro-batch was fed), ``losses`` (the loss the
reference is the gradient of), ``reference`` (the reference copy, its gradients and the collectives), ``sharded`` (the reference
sharded over the ranks under FSDP2, where the engine shards the model), ``sketch``
(the random projection for the fitted weights), ``reads`` (where the consumed gradient is read, per engine),
``judge`` (the judgement and its control), ``known`` (the Trainer's and Accelerate's known bugs from the table),
``core`` (``Watch``), ``deepspeed`` (the engine's adapter), ``accelerate`` and ``hf`` (the Accelerate wrapper and the
Trainer's callback, imported when first asked for, so that a job without them never imports Accelerate or
transformers), ``attach`` (that callback put into a framework's own entry point, ``python -m gradkit.watch.attach``).
"""
from gradkit.watch.core import Affected, Watch
from gradkit.watch.deepspeed import watch_engine
from gradkit.watch.losses import Criterion, Returned, Tokens

__all__ = ["Affected", "Callback", "Criterion", "Returned", "Tokens", "Watch", "watch_accelerate", "watch_engine"]


def __getattr__(name):
    if name == "Callback":
        from gradkit.watch.hf import Callback
        return Callback
    if name == "watch_accelerate":
        from gradkit.watch.accelerate import watch_accelerate
        return watch_accelerate
    raise AttributeError(f"module 'gradkit.watch' has no attribute {name!r}")
