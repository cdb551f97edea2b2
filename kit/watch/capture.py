"""What the watch keeps of a judged window: each micro-batch the user's model was fed (its arguments, as the forward
got them, and the random-number state it ran with, so that dropout draws the same masks again), and the targets the
user's criterion got for it. Nothing is kept on a window that is not judged: the hooks return at once."""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch
import torch.nn as nn


LABELS = ("labels", "shift_labels")


@dataclass
class MicroBatch:
    args: tuple
    kwargs: dict
    rng: dict  # {"cpu": state, "cuda": state or None}
    autocast: str | None  # the dtype the forward ran under autocast in ("bf16", "fp16"), None without autocast
    targets: tuple | None = None  # what the user's criterion got after the model's output, where one is watched


@dataclass
class Window:
    """The micro-batches of one optimizer step, in the order they ran."""

    micro_batches: list[MicroBatch] = field(default_factory=list)


def _detached(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (list, tuple)):
        return type(x)(_detached(v) for v in x) if not hasattr(x, "_fields") else type(x)(*(_detached(v) for v in x))
    if isinstance(x, dict):
        return {k: _detached(v) for k, v in x.items()}
    if hasattr(x, "items") and hasattr(x, "keys"):  # a BatchEncoding or another mapping
        return {k: _detached(v) for k, v in x.items()}
    return x


def _autocast() -> str | None:
    for device in ("cuda", "cpu"):
        try:
            if torch.is_autocast_enabled(device):
                return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(torch.get_autocast_dtype(device), None)
        except (TypeError, RuntimeError, AttributeError):
            continue
    return None


def rng_state() -> dict:
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None}


class Recorder:
    """Forward pre-hooks on the user's model (and criterion): while ``recording``, every training forward (the module
    in training mode, autograd on) starts a micro-batch of ``window``; the criterion's call adds its targets to the
    last one."""

    def __init__(self, model: nn.Module, criterion: nn.Module | None = None, guard=None):
        self.guard = guard or (lambda fn, *args: fn(*args))  # the watch's errors are its step's, never the job's
        self.recording = False
        self.window = Window()
        self.batches: collections.deque = collections.deque()  # what a data loader yielded, one per forward (fed())
        self.forwards = 0  # training forwards since the last consumed step, recorded or not
        self._handles = [model.register_forward_pre_hook(self._on_forward, with_kwargs=True)]
        if isinstance(criterion, nn.Module):
            self._handles.append(criterion.register_forward_pre_hook(self._on_criterion, with_kwargs=True))

    def _on_forward(self, module, args, kwargs):
        self.guard(self._forward, module, args, kwargs)  # a pre-hook that returns None changes nothing of the call

    def _forward(self, module, args, kwargs):
        if not (module.training and torch.is_grad_enabled()):
            return None
        self.forwards += 1
        batch = self.batches.popleft() if self.batches else None
        if self.recording:
            mb = MicroBatch(_detached(args), _detached(kwargs), rng_state(), _autocast())
            for key in LABELS:  # a compute_loss that takes the labels out before the forward: from the batch
                if key not in mb.kwargs and isinstance(batch, dict) and batch.get(key) is not None:
                    mb.kwargs[key] = _detached(batch[key])
            self.window.micro_batches.append(mb)
        return None

    def fed(self, batch) -> None:
        """A data loader yielded ``batch`` for the next training forward (the Trainer's, wrapped by its callback)."""
        self.guard(self._fed, batch)

    def _fed(self, batch) -> None:
        self.batches.append({k: batch[k] for k in LABELS if hasattr(batch, "get") and batch.get(k) is not None})
        while len(self.batches) > 64:  # forwards that never came (an evaluation loop's data): keep the newest
            self.batches.popleft()

    def _on_criterion(self, module, args, kwargs):
        self.guard(self._criterion, args, kwargs)

    def _criterion(self, args, kwargs):
        if self.recording and self.window.micro_batches and torch.is_grad_enabled():
            self.window.micro_batches[-1].targets = (_detached(tuple(args[1:])), _detached(kwargs))
        return None

    def start(self) -> None:
        """From now on, record (the window of a judged step)."""
        self.window, self.recording = Window(), True

    def take(self) -> Window:
        """The window recorded so far, and stop recording."""
        window, self.window, self.recording = self.window, Window(), False
        return window

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
