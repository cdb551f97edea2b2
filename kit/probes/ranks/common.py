"""Pieces every probe shares, run inside a rank: the tiny model, the data, the device, reading the weights a model will
use and the fp32 masters, the collectives. Judging each step and running a world's cases:
``gradkit.probes.ranks.judging``.

The data (``gradkit.shapes.data``) is a deterministic function of (seed, rank, step), so any rank (and the oracle) can
rebuild every other rank's micro-batches without communication.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn

from gradkit.judge import tolerances
from gradkit.shapes.data import micro_batches, mse, rank_samples  # noqa: F401 - the data every probe shares
from gradkit.shapes.mlp import tiny_mlp  # noqa: F401 - the probes' model, defined once with its shape

DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16}


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def device() -> torch.device:
    if os.environ.get("DS_ACCELERATOR") == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def to_device(x: torch.Tensor, dev, dtype) -> torch.Tensor:
    """A micro-batch's input on ``dev``: features in the model's ``dtype``, token ids (integers) as they are."""
    return x.to(dev, dtype) if x.is_floating_point() else x.to(dev)


def sgd(model: nn.Module, lr: float = 1.0) -> torch.optim.SGD:
    """Plain SGD over the trainable parameters (as a LoRA fine-tune hands its optimizer only the adapters): the
    applied update is exactly lr * gradient (no momentum, no weight decay)."""
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr, momentum=0.0, weight_decay=0.0)


def flat_params(model: nn.Module) -> torch.Tensor:
    """Every parameter of a plain (non-DeepSpeed) module, flat, in module order, as float64."""
    return torch.cat([p.detach().double().reshape(-1).clone() for p in model.parameters()])


def average_grads(model: nn.Module) -> None:
    """Every gradient averaged over the ranks with plain ``torch.distributed``: a control's step, no library. A
    trainable parameter no micro-batch of this rank reached has a gradient of 0 here (another rank's may not be)."""
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad /= world_size()


def sample_shares(batches) -> list[float]:
    """What each of this rank's micro-batches' *mean* loss is multiplied by so that the ranks' gradients, averaged,
    are the gradient of the mean over every sample of the global batch: ``n_k * W / N`` (N counted over every rank
    with plain ``torch.distributed``; a collective). For equal micro-batches it is ``1 / GA``."""
    n = [len(x) for x, _ in batches]
    total = torch.tensor([float(sum(n))], dtype=torch.float64)
    if dist.is_initialized() and world_size() > 1:
        dist.all_reduce(total)
    return [k * world_size() / total.item() for k in n]


def full_fp32_params(module: nn.Module, optimizer=None, fallback: list | None = None) -> torch.Tensor:
    """Every parameter as the optimizer holds it (fp32 master where there is one), flat, in module order.

    ZeRO and BF16_Optimizer expose their masters through ``safe_get_full_fp32_param``; the
    unfused fp16/bf16 optimizer of ZeRO-0 keeps them in ``fp32_groups`` (pass ``optimizer``),
    otherwise a bf16 model's own rounded weights would hide the update's low bits.
    A collective under ZeRO: every rank must call it. A parameter with no master (frozen: the optimizer does not
    hold it) is read as the model holds it: ``fallback[i]`` (``module_weights``' part, full under ZeRO-3, where
    ``p.data`` is an empty partition), else ``p`` itself.
    """
    from deepspeed.utils import safe_get_full_fp32_param

    masters = {}
    for lows, highs in zip(getattr(optimizer, "fp16_groups", []) or [], getattr(optimizer, "fp32_groups", []) or []):
        if isinstance(lows, (list, tuple)) and isinstance(highs, (list, tuple)):
            masters.update({id(lo): hi for lo, hi in zip(lows, highs)})
    parts = []
    for i, p in enumerate(module.parameters()):
        full = safe_get_full_fp32_param(p)
        if full is None:
            full = masters.get(id(p), fallback[i] if fallback is not None else p.detach())
        parts.append(full.detach().float().reshape(-1).cpu().clone())
    return torch.cat(parts).double()


def all_gather_flat(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's copy of an equally-sized tensor (gloo and nccl both do all_gather)."""
    t = t.contiguous().to(device())
    out = [torch.empty_like(t) for _ in range(world_size())]
    dist.all_gather(out, t)
    return [o.cpu() for o in out]


def engine_norm(engine) -> float | None:
    """The gradient norm a DeepSpeed engine reports for its last step (what a user's grad-norm curve shows), or
    None where it keeps none (e.g. ZeRO-0 with a plain torch optimizer)."""
    norm = engine.get_global_grad_norm() if hasattr(engine, "get_global_grad_norm") else None
    return None if norm is None else float(norm)


def all_finite(t: torch.Tensor) -> bool:
    """Is ``t`` finite on every rank? (A collective: every rank gets the same answer, so all stop together.)"""
    bad = torch.tensor([0.0 if bool(torch.isfinite(t).all()) else 1.0], dtype=torch.float64, device=device())
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bad.item() == 0.0


def all_gather_floats(values: list[float]) -> list[list[float]]:
    t = torch.tensor(values, dtype=torch.float64)
    return [o.tolist() for o in all_gather_flat(t)]


def versions() -> dict:
    """The releases this rank runs: torch, and every stack package it imported (``gradkit.launch.worker.check_stack``
    imports what the world's stack names; a plain-torch probe's ranks never import DeepSpeed)."""
    import sys

    out = {"torch": torch.__version__}
    for name in ("deepspeed", "transformers", "accelerate"):
        if name in sys.modules:
            out[name] = getattr(sys.modules[name], "__version__", "?")
    return out


def module_weights(module: nn.Module) -> torch.Tensor:
    """Every parameter as the model will compute with it (its own, possibly low-precision, weights), flat, in module
    order, as float64. Under ZeRO-3 each rank holds a partition of each parameter (``ds_tensor``, what DeepSpeed
    gathers for the forward): the partitions are gathered with plain ``torch.distributed`` (a collective: every rank
    must call it), never through DeepSpeed's own gathering, which would touch the engine's parameter state (its
    prefetch and release bookkeeping) between steps. A persistent parameter is read from its partitions too: its
    full ``p.data`` exists before its first fetch but is not filled yet (0.18.6 showed values of 1e38 there)."""
    return torch.cat(module_parts(module))


def module_parts(module: nn.Module) -> list:
    """``module_weights``, one float64 tensor per parameter (a collective under ZeRO-3)."""
    params = list(module.parameters())
    if not (params and hasattr(params[0], "ds_id")):
        return [p.detach().double().reshape(-1).cpu().clone() for p in params]
    parts = []
    for p in params:
        shards = all_gather_flat(p.ds_tensor.detach().reshape(-1))
        parts.append(torch.cat(shards)[:p.ds_numel].double())
    return parts


def _tp_whole(module: nn.Module, value) -> list:
    """One float64 tensor per parameter, module order: ``value(p)`` of each (the module's weight, or its fp32
    master), where AutoTP sharded the parameter gathered whole by its own layer's ``gather_params`` on a copy (the
    parameters the model computes with are left as they are), so that it lines up with the unsharded reference
    model's. A collective within the tensor-parallel group."""
    whole = {}
    for layer in module.modules():
        if hasattr(layer, "gather_params") and hasattr(layer, "tp_world_size") and hasattr(layer, "weight"):
            mine = [getattr(layer, "weight", None), getattr(layer, "bias", None)]
            copies = [None if q is None else nn.Parameter(value(q).detach().clone(), requires_grad=False) for q in mine]
            layer.gather_params(copies)
            whole.update({id(q): c.data for q, c in zip(mine, copies) if q is not None})
    return [whole[id(q)] if id(q) in whole else value(q).detach() for q in module.parameters()]


def read_tp_weights(module: nn.Module, dtype: str) -> dict:
    """``read_weights`` under AutoTP: the weights the model computes with and the fp32 masters (each a shard under
    AutoTP, read through ``safe_get_full_fp32_param`` and gathered whole the same way), compared as ``read_weights``
    compares them."""
    from deepspeed.utils import safe_get_full_fp32_param

    def master(p):
        full = safe_get_full_fp32_param(p)
        return (p if full is None else full.reshape(p.shape)).float()

    mod = torch.cat([t.double().reshape(-1).cpu() for t in _tp_whole(module, lambda p: p)])
    mast = torch.cat([t.double().reshape(-1).cpu() for t in _tp_whole(module, master)])
    diff = (mod - mast).abs()
    limit = tolerances.ROUNDING[dtype] * mast.abs() + tolerances.SUBNORMAL.get(dtype, 1e-30)
    return {"module": mod, "masters": mast, "agree": bool((diff <= limit).all()), "max_diff": diff.max().item()}


def read_weights(module: nn.Module, optimizer, dtype: str) -> dict:
    """What the model will use and what the optimizer holds, read both ways (collectives under ZeRO):
    ``{"module", "masters", "agree", "max_diff"}``. ``agree``: every module weight is its fp32 master up to the
    module dtype's rounding; where they disagree the master read (``safe_get_full_fp32_param``) misreports, and
    the step must be judged from the weights the model really uses."""
    parts = module_parts(module)
    mod, mast = torch.cat(parts), full_fp32_params(module, optimizer, parts)
    diff = (mod - mast).abs()
    limit = tolerances.ROUNDING[dtype] * mast.abs() + tolerances.SUBNORMAL.get(dtype, 1e-30)
    return {"module": mod, "masters": mast, "agree": bool((diff <= limit).all()), "max_diff": diff.max().item()}


def applied(before: dict, after: dict):
    """One step's update (lr = 1) between two ``read_weights`` reads: ``(effective, agree)``, from the fp32 masters
    where both reads agree with the module's weights, else from the weights the model uses."""
    agree = before["agree"] and after["agree"]
    return (before["masters"] - after["masters"] if agree else before["module"] - after["module"]), agree


def rounding_floor(weights: torch.Tensor, dtype: str, step_norm: float) -> float:
    """The relative size of rounding ``weights`` to ``dtype`` against a step of norm ``step_norm``: how precisely
    a step read from those rounded weights is known (0 for fp32 weights, read exactly)."""
    if dtype == "fp32" or step_norm <= 0:
        return 0.0
    return (weights.abs() * tolerances.ROUNDING[dtype] / 2).norm().item() / step_norm


def load_flat(module: nn.Module, flat: torch.Tensor) -> nn.Module:
    """``module`` with its parameters set from ``flat`` (module order): a step's starting weights, for its reference."""
    torch.nn.utils.vector_to_parameters(flat.to(next(module.parameters()).dtype), module.parameters())
    return module
