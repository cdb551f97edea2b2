"""The loss the reference is the gradient of, as the user means it, over the whole global batch: a sum over every
micro-batch of every rank divided by one global count. Each definition gives, for one recorded micro-batch and the
reference copy's output, that micro-batch's *sum* and its *count*; the reference is the sum of the sums' gradients
over the global count. None of them runs the loss code under test (a Trainer's ``compute_loss``, a model's
``loss_function`` with its ``num_items_in_batch``): the reference copy is fed the inputs without the labels, and the
loss is taken here, in fp32.

- ``Tokens()``: a causal language model's mean over label tokens, across every rank and micro-batch (what the HF
  Trainer and TRL mean since transformers 4.46): the labels shifted by one (or the ``shift_labels`` the batch
  carries), -100 ignored, and in packed rows (``position_ids``) no token predicted across the start of a sequence;
  cross entropy summed; the count is the label tokens left.
- ``Criterion(fn)``: the user's own mean loss ``fn(output, *targets)`` of a micro-batch (e.g. ``nn.MSELoss()``),
  its targets taken from the user's own call of that criterion: a mean over samples (the count is the targets'
  first dimension; for ``nn.CrossEntropyLoss`` the targets not ignored).
- ``Returned()``: the model's forward returns its micro-batch's mean loss itself; a mean over samples (the count is
  the first input's first dimension).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

LABEL_KEYS = ("labels", "shift_labels", "num_items_in_batch", "return_loss")


def _logits(output):
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, (tuple, list)):
        return output[0]
    return output["logits"]


def _n(x) -> int:
    while isinstance(x, (tuple, list)) and x:
        x = x[0]
    if isinstance(x, dict):
        x = next(iter(x.values()))
    return int(x.shape[0]) if isinstance(x, torch.Tensor) and x.dim() else 1


class Tokens:
    """Mean over label tokens of a causal LM, over the whole global batch."""

    name = "mean over label tokens"

    def __init__(self, ignore_index: int = -100):
        self.ignore_index = ignore_index

    def inputs(self, mb) -> tuple[tuple, dict]:
        return mb.args, {k: v for k, v in mb.kwargs.items() if k not in LABEL_KEYS}

    def sum_and_count(self, output, mb) -> tuple[torch.Tensor, int]:
        logits = _logits(output).float()
        if mb.kwargs.get("shift_labels") is not None:
            target = mb.kwargs["shift_labels"].to(logits.device)
        else:
            labels = mb.kwargs.get("labels")
            if labels is None:
                raise ValueError("gradkit watch: a micro-batch has no labels, so its mean over label tokens is not "
                                 "defined; pass loss=gradkit.watch.Criterion(fn) or loss=gradkit.watch.Returned()")
            labels = labels.to(logits.device)
            target = F.pad(labels, (0, 1), value=self.ignore_index)[..., 1:]
            pos = mb.kwargs.get("position_ids")
            if pos is not None:  # packed rows: a token that starts a sequence is never predicted from the one before
                starts = F.pad(pos.to(logits.device)[..., 1:] == 0, (0, 1), value=True)
                target = target.masked_fill(starts, self.ignore_index)
        flat = target.reshape(-1)
        total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), flat, ignore_index=self.ignore_index,
                                reduction="sum")
        return total, int((flat != self.ignore_index).sum())


class Criterion:
    """The user's own mean loss of a micro-batch, a mean over samples across the global batch."""

    name = "mean over samples"

    def __init__(self, fn):
        self.fn = fn

    def inputs(self, mb) -> tuple[tuple, dict]:
        return mb.args, mb.kwargs

    def sum_and_count(self, output, mb) -> tuple[torch.Tensor, int]:
        if mb.targets is None:
            raise ValueError("gradkit watch: the criterion given as loss= was not called on this micro-batch's output "
                             "(call it as fn(output, target) in the training step)")
        args, kwargs = mb.targets
        args = tuple(a.to(_logits(output).device) if isinstance(a, torch.Tensor) else a for a in args)
        out = output.float() if isinstance(output, torch.Tensor) else output
        mean = self.fn(out, *(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                              for a in args), **kwargs)
        ignore = getattr(self.fn, "ignore_index", None)
        if isinstance(self.fn, nn.CrossEntropyLoss) and args and isinstance(args[0], torch.Tensor) \
                and not args[0].is_floating_point():
            n = int((args[0] != ignore).sum())
        else:
            n = _n(args)
        return mean * n, n


class Returned:
    """The forward returns its micro-batch's mean loss: a mean over samples."""

    name = "mean over samples (the forward's own loss)"

    def inputs(self, mb) -> tuple[tuple, dict]:
        return mb.args, mb.kwargs

    def sum_and_count(self, output, mb) -> tuple[torch.Tensor, int]:
        loss = output if isinstance(output, torch.Tensor) else getattr(output, "loss", None)
        if not isinstance(loss, torch.Tensor) or loss.dim():
            raise ValueError("gradkit watch: loss=Returned() needs the forward to return a scalar mean loss")
        n = _n(mb.args or tuple(mb.kwargs.values()))
        return loss.float() * n, n


def guess(mb, criterion) -> object:
    """The definition a first micro-batch implies: labels in its inputs -> Tokens; a criterion given -> Criterion."""
    if criterion is not None:
        return Criterion(criterion)
    if "labels" in mb.kwargs or "shift_labels" in mb.kwargs:
        return Tokens()
    return Returned()
