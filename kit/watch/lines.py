"""What the watch writes of a judged step: its line in the training log (``line``), its JSON record (``plain``, and
``keep_earlier``: an earlier run's file moved aside), and what a record says of the step's precision and inputs."""
from __future__ import annotations

import datetime
from pathlib import Path

import torch
import torch.nn as nn

from gradkit.judge import oracle

DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def keep_earlier(path: Path) -> Path | None:
    """An earlier run's records file moved aside (``watch-<its time>.jsonl``, never overwritten), so that the file a
    run writes holds that run's records only; the moved file's path, or None where there was none."""
    if not path.is_file() or not path.stat().st_size:
        return None
    stamp = datetime.datetime.fromtimestamp(path.stat().st_mtime).strftime("%Y%m%dT%H%M%S")
    kept, n = path.with_name(f"{path.stem}-{stamp}{path.suffix}"), 1
    while kept.exists():
        n += 1
        kept = path.with_name(f"{path.stem}-{stamp}-{n}{path.suffix}")
    path.rename(kept)
    return kept


def line(rec: dict) -> str:
    """The training log's line for a judged step."""
    if "logged_norm" in rec:
        return f"gradkit watch: step {rec['step']}: logged grad norm {rec['verdict']}: {rec['why']}"
    head = f"gradkit watch: step {rec['step']}: {rec['verdict']}"
    m = ((rec.get("measured") or {}).get("metrics")) or {}
    if not m:
        return f"{head} ({rec.get('why', '')})"
    att = (rec.get("measured") or {}).get("attribution") or {}
    text = (f"{head} (ratio {m['norm_ratio']:.4f}, cosine {m['cosine']:.5f}, rel. error {m['rel_l2']:.2e}, "
            f"misplaced weight {att.get('misplaced_weight', float('nan')):.2e}; {rec['ga']} micro-batches x "
            f"{rec['world_size']} ranks, {rec['loss']} over {rec['global_count']:g})")
    if rec.get("short_window"):
        text += f"; {rec['short_window']}"
    if rec["verdict"] == oracle.AFFECTED:
        text += f"; the step is {rec.get('matches')!r}: {rec.get('shape')}"
        if rec.get("known"):
            text += f"; {rec['known']}"
    elif rec["verdict"] != oracle.NOT_AFFECTED:
        text += f"; {rec['why']}"
    elif "not identifiable" in rec.get("why", ""):  # exact on every exact signal; the fit's weights free
        text += "; the fitted weights are not identifiable on these micro-batches (alike ones)"
    return text


def dtype_of(model: nn.Module, window) -> str:
    autocast = next((mb.autocast for mb in window.micro_batches if mb.autocast), None)
    if autocast:
        return autocast
    dt = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return DTYPES.get(dt, "fp32")


def nbytes(x) -> int:
    """Bytes of the tensors in a recorded micro-batch's arguments."""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(nbytes(v) for v in x)
    if isinstance(x, dict):
        return sum(nbytes(v) for v in x.values())
    return 0


def plain(x):
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    if isinstance(x, float) and x != x:
        return None
    return x
