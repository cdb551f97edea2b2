"""The Trainer under test, observed from inside a rank (``gradkit.probes.ranks.trainer_ga``): what ``compute_loss`` was
handed and returned, what ``accelerator.backward`` received, by wrapping the real calls; and, where a case asks, one
of the seed's fixes (or a loop bug) applied where its patch would act."""
from __future__ import annotations


def probe_trainer_class(trainer_cls):
    """A subclass of the Trainer under test that records its calls and, if asked, applies one of the seed's fixes."""

    class ProbeTrainer(trainer_cls):
        def __init__(self, *args, fix: str | None = None, **kwargs):
            super().__init__(*args, **kwargs)
            self.gradkit_trace = _observe(self, fix)

    return ProbeTrainer


def _observe(trainer, fix: str | None = None) -> list[dict]:
    """Wrap the real calls (not re-implement them): what compute_loss got, what accelerator.backward got.

    ``fix`` applies one of the seed's proposed fixes at the same place its patch would act, the call
    into ``accelerator.backward`` (the Trainer's own division has happened by then):
    ``fix_scale_gas`` lets DeepSpeed divide when the Trainer did not; ``fix_always_divide`` divides by
    GAS whenever the Trainer did not and keeps DeepSpeed's scaling off. ``fault_undivided`` is a loop bug, not a fix:
    the loss reaches backward multiplied by GAS (a custom ``compute_loss`` that forgot to divide).
    """
    trace: list[dict] = []
    compute_loss, backward = trainer.compute_loss, trainer.accelerator.backward

    def seen_compute_loss(model, inputs, *a, num_items_in_batch=None, **kw):
        if num_items_in_batch is not None:
            kw["num_items_in_batch"] = num_items_in_batch  # a Trainer before 4.46 neither passes nor takes it
        out = compute_loss(model, inputs, *a, **kw)
        loss = out[0] if isinstance(out, tuple) else out
        labels = inputs["labels"]
        ids = getattr(trainer, "gradkit_rows", {})
        trace.append({"call": "compute_loss", "loss": float(loss.detach()), "step": trainer.state.global_step,
                      "rows": [ids.get(tuple(x.tolist()), -1) for x in inputs["input_ids"].cpu()],
                      "num_items_in_batch": None if num_items_in_batch is None else int(num_items_in_batch),
                      "label_tokens_unshifted": int((labels != -100).sum()),
                      "label_tokens_shifted": int((labels[:, 1:] != -100).sum())})
        return out

    def seen_backward(loss, **kw):
        last = next((t for t in reversed(trace) if t["call"] == "compute_loss"), {})
        trainer_divided = not (getattr(trainer, "model_accepts_loss_kwargs", False)
                               and last.get("num_items_in_batch") is not None)
        gas = trainer.args.gradient_accumulation_steps
        if fix == "fix_scale_gas" and "scale_wrt_gas" in kw:
            kw["scale_wrt_gas"] = not trainer_divided
        elif fix == "fault_undivided":
            loss = loss * gas
        elif fix == "fix_always_divide" and not trainer_divided:
            loss = loss / gas
            if "scale_wrt_gas" in kw:
                kw["scale_wrt_gas"] = False
        import torch

        backpropagated: list[float] = []
        tensor_backward = torch.Tensor.backward

        def seen_tensor_backward(self, *a, **k):  # the scalar autograd really starts from, after Accelerate/DS
            if self.dim() == 0:
                backpropagated.append(float(self.detach()))
            return tensor_backward(self, *a, **k)

        torch.Tensor.backward = seen_tensor_backward
        try:
            result = backward(loss, **kw)
        finally:
            torch.Tensor.backward = tensor_backward
        trace.append({"call": "accelerator.backward", "step": trainer.state.global_step,
                      "loss": float(loss.detach()), "trainer_divided": trainer_divided,
                      "kwargs": {k: v for k, v in kw.items() if isinstance(v, (bool, int, float, str))},
                      "backpropagated": backpropagated[-1] if backpropagated else None})
        return result

    trainer.compute_loss, trainer.accelerator.backward = seen_compute_loss, seen_backward
    return trace
