"""Pieces every probe shares, run inside a rank: the tiny model, the data, the engine, the measurements.

Data is a deterministic function of (seed, rank, step), so any rank (and the
oracle) can rebuild every other rank's micro-batches without communication.
"""
from __future__ import annotations

import contextlib
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16}


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def device() -> torch.device:
    if os.environ.get("DS_ACCELERATOR") == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def tiny_mlp(hidden: int, seed: int, depth: int = 2) -> nn.Sequential:
    """``depth`` Linear layers of width ``hidden`` with GELU between; fp32, same weights on every rank."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i in range(depth):
        layers.append(nn.Linear(hidden, hidden))
        if i < depth - 1:
            layers.append(nn.GELU())
    return nn.Sequential(*layers)


def rank_samples(seed: int, rank_id: int, n: int, hidden: int, step: int = 0):
    """``n`` (input, target) samples of one rank: targets from a fixed random teacher plus noise."""
    teacher = torch.Generator().manual_seed(seed)
    t = torch.randn(hidden, hidden, generator=teacher) / hidden ** 0.5
    g = torch.Generator().manual_seed(seed * 100_003 + 7919 * rank_id + 104_729 * step + 1)
    x = torch.randn(n, hidden, generator=g)
    y = x @ t + 0.1 * torch.randn(n, hidden, generator=g)
    return x, y


def micro_batches(seed: int, rank_id: int, ga: int, micro_batch: int, hidden: int, step: int = 0):
    """One rank's global-step data, split into ``ga`` micro-batches of ``micro_batch`` samples."""
    x, y = rank_samples(seed, rank_id, ga * micro_batch, hidden, step)
    return [(x[i * micro_batch:(i + 1) * micro_batch], y[i * micro_batch:(i + 1) * micro_batch]) for i in range(ga)]


def mse(output, target):
    """Mean squared error, computed in fp32 whatever the model's dtype."""
    return ((output.float() - target.float()) ** 2).mean()


def sgd(model: nn.Module, lr: float = 1.0) -> torch.optim.SGD:
    """Plain SGD: the applied update is exactly lr * gradient (no momentum, no weight decay)."""
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.0, weight_decay=0.0)


def flat_params(model: nn.Module) -> torch.Tensor:
    """Every parameter of a plain (non-DeepSpeed) module, flat, in module order, as float64."""
    return torch.cat([p.detach().double().reshape(-1).clone() for p in model.parameters()])


def average_grads(model: nn.Module) -> None:
    """Every gradient averaged over the ranks with plain ``torch.distributed``: a control's step, no library."""
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world_size()


def full_fp32_params(module: nn.Module, optimizer=None) -> torch.Tensor:
    """Every parameter as the optimizer holds it (fp32 master where there is one), flat, in module order.

    ZeRO and BF16_Optimizer expose their masters through ``safe_get_full_fp32_param``; the
    unfused fp16/bf16 optimizer of ZeRO-0 keeps them in ``fp32_groups`` (pass ``optimizer``),
    otherwise a bf16 model's own rounded weights would hide the update's low bits.
    A collective under ZeRO: every rank must call it.
    """
    from deepspeed.utils import safe_get_full_fp32_param

    masters = {}
    for lows, highs in zip(getattr(optimizer, "fp16_groups", []) or [], getattr(optimizer, "fp32_groups", []) or []):
        if isinstance(lows, (list, tuple)) and isinstance(highs, (list, tuple)):
            masters.update({id(lo): hi for lo, hi in zip(lows, highs)})
    parts = []
    for p in module.parameters():
        full = safe_get_full_fp32_param(p)
        if full is None:
            full = masters.get(id(p), p.detach())
        parts.append(full.detach().float().reshape(-1).cpu().clone())
    return torch.cat(parts).double()


def all_gather_flat(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's copy of an equally-sized tensor (gloo and nccl both do all_gather)."""
    t = t.contiguous().to(device())
    out = [torch.empty_like(t) for _ in range(world_size())]
    dist.all_gather(out, t)
    return [o.cpu() for o in out]


def all_gather_floats(values: list[float]) -> list[list[float]]:
    t = torch.tensor(values, dtype=torch.float64)
    return [o.tolist() for o in all_gather_flat(t)]


def versions() -> dict:
    """The releases this rank runs: torch, and every stack package it imported (``kit.worker.check_stack``
    imports what the world's stack names; a plain-torch probe's ranks never import DeepSpeed)."""
    import sys

    out = {"torch": torch.__version__}
    for name in ("deepspeed", "transformers", "accelerate"):
        if name in sys.modules:
            out[name] = getattr(sys.modules[name], "__version__", "?")
    return out


def module_weights(module: nn.Module) -> torch.Tensor:
    """Every parameter as the model will compute with it (its own, possibly low-precision, weights), flat, in module
    order, as float64. Under ZeRO-3 the parameters are gathered first (a collective: every rank must call it)."""
    params = list(module.parameters())
    if params and hasattr(params[0], "ds_id"):  # ZeRO-3 partitions the module's own weights
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            return torch.cat([p.detach().double().reshape(-1).cpu().clone() for p in params])
    return torch.cat([p.detach().double().reshape(-1).cpu().clone() for p in params])


# How far a module's weight may sit from its fp32 master: its own rounding (half an ulp, with room for a
# round-to-nearest-even tie) relative to the master. fp32 modules are the masters' own copies: bit-equal.
_ROUNDING = {"fp32": 2.0 ** -23, "bf16": 2.0 ** -8, "fp16": 2.0 ** -10}


def read_weights(module: nn.Module, optimizer, dtype: str) -> dict:
    """What the model will use and what the optimizer holds, read both ways (collectives under ZeRO):
    ``{"module", "masters", "agree", "max_diff"}``. ``agree``: every module weight is its fp32 master up to the
    module dtype's rounding; where they disagree the master read (``safe_get_full_fp32_param``) misreports, and
    the step must be judged from the weights the model really uses."""
    mod, mast = module_weights(module), full_fp32_params(module, optimizer)
    diff = (mod - mast).abs()
    limit = _ROUNDING[dtype] * mast.abs() + 1e-30
    return {"module": mod, "masters": mast, "agree": bool((diff <= limit).all()), "max_diff": diff.max().item()}


def rounding_floor(weights: torch.Tensor, dtype: str, step_norm: float) -> float:
    """The relative size of rounding ``weights`` to ``dtype`` against a step of norm ``step_norm``: how precisely
    a step read from those rounded weights is known (0 for fp32 weights, read exactly)."""
    if dtype == "fp32" or step_norm <= 0:
        return 0.0
    return (weights.abs() * _ROUNDING[dtype] / 2).norm().item() / step_norm


def load_flat(module: nn.Module, flat: torch.Tensor) -> nn.Module:
    """``module`` with its parameters set from ``flat`` (module order): a step's starting weights, for its reference."""
    torch.nn.utils.vector_to_parameters(flat.to(next(module.parameters()).dtype), module.parameters())
    return module


def judge(effective: torch.Tensor, start: nn.Module, seed: int, ga: int, micro_batch: int, hidden: int,
          step: int = 0, prev_basis=None, clip: float = 0.0, loss_scale: float = 1.0):
    """The oracle's view of one step's effective gradient. A collective: every rank calls it.

    Rank 0 rebuilds every rank's micro-batches of ``step`` (rank-major), takes the fp32 reference from that step's
    starting weights ``start`` and returns ``(out, basis, weights, reference)`` with ``out`` holding ``metrics``,
    ``attribution`` and ``rank_spread`` (every rank must have applied the same update); other ranks get
    ``({}, None, None, None)``. ``prev_basis`` (the previous step's micro-batch gradients) joins the basis with an
    expected weight of 0, so a previous step's gradient applied again is fitted, not guessed. ``clip``: the
    engine clips at that norm, so the expected step is the reference clipped (``clip_coef`` in ``out``);
    ``loss_scale`` multiplies every micro-batch's loss (the engine's loss is scaled the same way).
    """
    from kit import oracle

    per_rank = all_gather_flat(effective)
    if rank() != 0:
        return {}, None, None, None
    every = [b for rr in range(world_size()) for b in micro_batches(seed, rr, ga, micro_batch, hidden, step)]
    basis, weights, reference = oracle.reference_gradients(start, every, lambda o, y: mse(o, y) * loss_scale)
    coef = oracle.clipped(reference, clip).norm().item() / reference.norm().item()
    full, expected = basis, weights * coef
    if prev_basis is not None:
        full = torch.cat([basis, prev_basis])
        expected = torch.cat([expected, torch.zeros(len(prev_basis), dtype=torch.float64)])
    out = {"metrics": oracle.compare(effective, reference * coef),
           "attribution": oracle.attribute(effective, full, expected),
           "rank_spread": {"effective gradients": oracle.spread(per_rank)}}
    if clip:
        out["clip_coef"] = coef
    return out, full, weights, reference


def release(engine) -> None:
    """Free an engine before the next case of the same world builds its own."""
    import gc

    if hasattr(engine, "destroy"):
        engine.destroy()
    gc.collect()  # this case's garbage only: what lived before is frozen (below, and in run_cases)
    gc.freeze()  # what survived is live (modules imported on the way): later collections skip it
    torch.manual_seed(0)


SYNC_TIMEOUT_ENV = "GRADKIT_SYNC_TIMEOUT_S"  # how long ranks wait for each other after a case (default 120 s)


class WorldDesynchronised(RuntimeError):
    """A case failed on some ranks only: the others may be inside a collective, so nothing after it can be trusted."""


def run_cases(payload: dict, run_one) -> list[dict]:
    """Every case of a world's payload, one after another; a case that raises becomes an ``error`` result.

    One broken case must not hide the others' results: its exception and traceback are kept in its
    result and the records turn it into ``cannot-run``. That is only safe when *every* rank failed
    at the same case: after each case the ranks meet at a monitored barrier on a side gloo group.
    If a peer does not arrive within ``$GRADKIT_SYNC_TIMEOUT_S`` (it is stuck in a collective the failed rank
    left), the world stops with ``WorldDesynchronised``; the cases finished before it are kept
    (``kit.worker.report_partial``) and the records mark the rest ``cannot-run``.
    """
    import datetime

    from kit import worker

    wait_s = float(os.environ.get(SYNC_TIMEOUT_ENV, "120"))
    sync = None
    if dist.is_initialized() and world_size() > 1:  # its own timeout also bounds the non-zero ranks' wait
        sync = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=wait_s))
    import gc

    # A full collection in a process holding torch and DeepSpeed walks millions of objects (~0.2 s); the engines
    # (and DeepSpeed itself) collect after every case. Freezing what exists now leaves them only the new objects.
    gc.collect()
    gc.freeze()
    results = []
    for case in payload["cases"]:
        clock = Stopwatch()
        _PHASES.clear()
        try:
            res = run_one(case)
        except Exception as e:  # noqa: BLE001 - see the docstring
            import traceback
            res = {"error": f"{type(e).__name__}: {str(e)[:500]}", "traceback": traceback.format_exc()[-3000:]}
        res.update(case=case["name"], ga=case["ga"], wall_s=clock(), versions=versions())
        if _PHASES:
            res["phases"] = {k: round(v, 4) for k, v in _PHASES.items()}
            res["phases"]["other"] = round(max(0.0, res["wall_s"] - sum(_PHASES.values())), 4)
        if sync is not None:
            try:
                dist.monitored_barrier(group=sync, timeout=datetime.timedelta(seconds=wait_s),
                                       wait_all_ranks=True)
            except RuntimeError as e:
                raise WorldDesynchronised(
                    f"case {case['name']!r} (GA={case['ga']}) ended on rank {rank()} "
                    f"({'error: ' + res['error'] if 'error' in res else 'ok'}) but not on every rank within "
                    f"{wait_s:g} s: {str(e).splitlines()[0][:300]}") from e
        worker.report_partial(res)
        results.append(res)
    return results


_PHASES: dict = {}


@contextlib.contextmanager
def phase(name: str):
    """Time a part of the running case (``initialize``, ``step``, ``read masters``, ``reference`` ...): each case's
    result carries ``phases`` in seconds, with ``other`` for the rest (``scripts/bench.py --profile`` reads them)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _PHASES[name] = _PHASES.get(name, 0.0) + time.perf_counter() - t0


class Stopwatch:
    def __init__(self):
        self.t0 = time.perf_counter()

    def __call__(self) -> float:
        return round(time.perf_counter() - self.t0, 3)
