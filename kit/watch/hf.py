"""The watch in the HF Trainer and TRL's trainers, as a ``TrainerCallback``:

    trainer = Trainer(..., callbacks=[Callback()])

At ``on_train_begin`` it takes the Trainer's model and optimizer (whatever wraps it: Accelerate's, DeepSpeed's) and
puts a ``Watch`` on them; the loss is a causal LM's mean over label tokens across every rank and micro-batch
(``Tokens()``, what the Trainer means since transformers 4.46) unless ``loss=`` says otherwise; the Trainer's
``max_grad_norm`` is the clip and its ``bf16`` / ``fp16`` the precision the step is judged at. A step ends at
``on_step_end`` (skipped where the optimizer consumed nothing); the grad norm the Trainer logs for a judged step is
judged too (``on_log``: clipping makes the applied step right whatever the gradient's scale was, the logged norm is
what the user's curves show). ``stop=True`` ends training (``should_training_stop``)
after an affected step. Records go to ``<output_dir>/gradkit-watch``."""
from __future__ import annotations

import os

import torch
from transformers import TrainerCallback

from gradkit.judge import oracle
import gradkit.watch.known as known
from gradkit.watch.core import Watch
from gradkit.watch.losses import Tokens


def versions() -> dict:
    import accelerate
    import transformers

    out = {"transformers": transformers.__version__, "accelerate": accelerate.__version__, "torch": torch.__version__}
    try:
        import deepspeed  # only where the Trainer runs it
        out["deepspeed"] = deepspeed.__version__
    except ImportError:
        pass
    return out


def feed(loader, fed) -> bool:
    """Every batch ``loader`` makes goes to ``fed`` too: the labels of a micro-batch whose ``compute_loss`` takes them
    out before calling the model. The loader's ``collate_fn`` is wrapped (Accelerate's loaders wrap a torch
    ``DataLoader``, ``base_dataloader``, whose iterator calls it); with worker processes the batches are made there and
    cannot be seen: False."""
    base = getattr(loader, "base_dataloader", loader)
    collate = getattr(base, "collate_fn", None)
    if collate is None or getattr(base, "num_workers", 0) or getattr(collate, "_gradkit_fed", False):
        return bool(getattr(collate, "_gradkit_fed", False))

    def collate_fn(features):
        batch = collate(features)
        fed(batch)
        return batch

    collate_fn._gradkit_fed = True
    base.collate_fn = collate_fn
    return True


class Callback(TrainerCallback):
    """``callbacks=[Callback(...)]``; ``options`` as ``gradkit.watch.Watch`` takes them (``first``, ``every``, ``loss``,
    ``layers``, ``out``, ...)."""

    def __init__(self, stop: bool = False, **options):
        self.stop, self.options, self.watch = stop, options, None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        opts = dict(self.options)
        opts.setdefault("loss", Tokens())
        opts.setdefault("clip", args.max_grad_norm or None)
        opts.setdefault("dtype", "bf16" if args.bf16 else "fp16" if args.fp16 else None)
        opts.setdefault("out", os.path.join(args.output_dir, "gradkit-watch"))
        context = {"versions": versions(), "trainer_ga": args.gradient_accumulation_steps,
                   "average_tokens_across_devices": getattr(args, "average_tokens_across_devices", None),
                   **opts.pop("context", {})}
        try:
            self.watch = Watch(model, optimizer, finalize_on_post=False, context=context,
                               known=lambda rec: known.from_table(rec, "trainer"), **opts)
        except Exception as e:  # noqa: BLE001 - the watch never stops the job: it says why it cannot watch it
            print(f"gradkit watch: cannot watch this job ({type(e).__name__}: {e}); training goes on without it")
            return control
        loader = kwargs.get("train_dataloader")
        if loader is not None:
            self.watch.faults.run("capture", 1, feed, loader, self.watch.recorder.fed)

    def on_step_end(self, args, state, control, **kwargs):
        if self.watch is None:
            return control
        rec = self.watch.step_end()
        if rec and rec.get("verdict") == oracle.AFFECTED and self.stop:
            control.should_training_stop = True
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        logged = (logs or {}).get("grad_norm")
        if self.watch is not None and logged is not None:
            rec = self.watch.judge_logged_norm(state.global_step, float(logged))
            if rec and rec.get("verdict") == oracle.AFFECTED and self.stop:
                control.should_training_stop = True
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.watch is not None:
            self.watch.remove()
