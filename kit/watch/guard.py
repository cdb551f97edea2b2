"""The watch's first rule: it never hurts the job it watches. An error of the watch's own, in any of its phases, is
kept as the judged step's fault and never raised into the job; the ranks agree on it at fixed points of the step
(every rank calls ``agree`` at the same place, before the step's next collective), so that the step ends as
``cannot-run`` with the fault's sentence on every rank and training goes on with nothing of the user's changed. An
error raised by the user's own code is not the watch's: it is never caught here and reaches the user as it would
without the watch.

The phases: ``capture`` (what each micro-batch was fed: the forward pre-hooks, the loader's batches), ``read``
(where the optimizer holds the consumed gradient, and reading it), ``copy`` (the reference's fp32 copy), ``reference``
(its gradients), ``judgement``, ``records`` (the JSON record written), ``report`` (the explanation and the log line).
Tests plant a fault in a phase with ``GRADKIT_WATCH_FAULT=phase[@step],...`` (on rank 0; nothing else reads it)."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

import gradkit.watch.reference as reference

PHASES = ("capture", "read", "copy", "reference", "judgement", "records", "report")
FAULT_ENV = "GRADKIT_WATCH_FAULT"


def planted(phase: str, step: int) -> None:
    """Raises where a test planted a fault in ``phase`` (at ``step``, or at every step) on rank 0."""
    for item in filter(None, os.environ.get(FAULT_ENV, "").split(",")):
        name, _, at = item.partition("@")
        if name == phase and (not at or int(at) == step) and reference.world()[0] == 0:
            raise RuntimeError(f"a fault planted in the watch's {phase} at step {step}")


def failed(fault: str) -> str:
    """The sentence of a step ended by the watch's own fault."""
    return f"the watch failed ({fault}); training went on"[:600]


class Faults:
    """This rank's first fault of the watch in the step under way, and the ranks' agreement on it."""

    def __init__(self):
        self.first: str | None = None

    def run(self, phase: str, step: int, fn, *args, default=None):
        """``fn(*args)``, or ``default`` where it raised: the error kept as this step's fault, never raised."""
        try:
            planted(phase, step)
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - the watch's own error: its step's cannot-run, never the job's
            self.note(phase, e)
            return default

    def note(self, phase: str, error: BaseException) -> None:
        if self.first is None:
            self.first = f"{phase}: {type(error).__name__}: {error}"[:400]

    def agree(self) -> str:
        """Every rank's fault, one sentence ('' where none): a collective, so every rank calls it at the same point."""
        w = reference.world()[1]
        said = [self.first or ""]
        if w > 1 and dist.is_available() and dist.is_initialized():
            mine = torch.tensor(list(said[0].encode()), dtype=torch.uint8)
            said = [bytes(r.tolist()).decode(errors="replace") for r in reference.all_gather_ragged(mine)]
        return "; ".join(f"rank {r}'s {s}" for r, s in enumerate(said) if s)

    def clear(self) -> None:
        self.first = None
