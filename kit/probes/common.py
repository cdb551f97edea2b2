"""Pieces every probe shares, run inside a rank: the tiny model, the data, the engine, the measurements.

The data (``kit.shapes.data``) is a deterministic function of (seed, rank, step), so any rank (and the oracle) can
rebuild every other rank's micro-batches without communication.
"""
from __future__ import annotations

import contextlib
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from kit import shapes
from kit.judge import oracle
from kit.launch import worker
from kit.shapes.data import micro_batches, mse, rank_samples  # noqa: F401 - the data every probe shares
from kit.shapes.mlp import tiny_mlp  # noqa: F401 - the probes' model, defined once with its shape

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
    """The releases this rank runs: torch, and every stack package it imported (``kit.launch.worker.check_stack``
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


def read_weights(module: nn.Module, optimizer, dtype: str) -> dict:
    """What the model will use and what the optimizer holds, read both ways (collectives under ZeRO):
    ``{"module", "masters", "agree", "max_diff"}``. ``agree``: every module weight is its fp32 master up to the
    module dtype's rounding; where they disagree the master read (``safe_get_full_fp32_param``) misreports, and
    the step must be judged from the weights the model really uses."""
    parts = module_parts(module)
    mod, mast = torch.cat(parts), full_fp32_params(module, optimizer, parts)
    diff = (mod - mast).abs()
    limit = oracle.ROUNDING[dtype] * mast.abs() + 1e-30
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
    return (weights.abs() * oracle.ROUNDING[dtype] / 2).norm().item() / step_norm


def load_flat(module: nn.Module, flat: torch.Tensor) -> nn.Module:
    """``module`` with its parameters set from ``flat`` (module order): a step's starting weights, for its reference."""
    torch.nn.utils.vector_to_parameters(flat.to(next(module.parameters()).dtype), module.parameters())
    return module


def judge(effective: torch.Tensor, start: nn.Module, seed: int, ga: int, micro_batch: int, hidden: int,
          step: int = 0, prev_basis=None, clip: float = 0.0, loss_scale: float = 1.0, shape=None):
    """The oracle's view of one step's effective gradient. A collective: every rank calls it.

    Rank 0 rebuilds every rank's micro-batches of ``step`` (rank-major), takes the fp32 reference from that step's
    starting weights ``start`` and returns ``(out, basis, weights, reference)`` with ``out`` holding ``metrics``,
    ``attribution`` and ``rank_spread`` (every rank must have applied the same update); other ranks get
    ``({}, None, None, None)``. ``prev_basis`` (the previous step's micro-batch gradients) joins the basis with an
    expected weight of 0, so a previous step's gradient applied again is fitted, not guessed. ``clip``: the
    engine clips at that norm, so the expected step is the reference clipped (``clip_coef`` in ``out``);
    ``loss_scale`` multiplies every micro-batch's loss (the engine's loss is scaled the same way). ``shape``
    (``kit.shapes.shape.Shape``, the MLP by default) makes the micro-batches and the loss; where it has several parameter
    groups each is judged on its own too (``groups``: ``oracle.judge_groups``).
    """
    shape = shape or _mlp()
    per_rank = all_gather_flat(effective)
    if rank() != 0:
        return {}, None, None, None
    every = [b for rr in range(world_size()) for b in shape.micro_batches(seed, rr, ga, micro_batch, hidden, step)]
    basis, weights, reference = reference_at(start, every, shape, loss_scale, (seed, ga, micro_batch, hidden, step))
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
    groups = group_index(start, shape)
    if len(groups) > 1:
        uses = shape.uses(start, every, lambda o, y: shape.loss_fn(o, y) * loss_scale) if shape.uses else {}
        out["groups"] = oracle.judge_groups(effective, full, expected, reference * coef, groups, world_size(), ga,
                                            {g: {u: v * coef for u, v in by.items()} for g, by in uses.items()})
    return out, full, weights, reference


_SKELETONS: dict = {}  # (id(shape), seed, hidden, depth) -> (shape, module): rank 0 rebuilds no model per judged step
_REFERENCES: dict = {}  # key -> (basis, weights, reference, shape), newest last, at most _REFERENCE_BYTES in all
_REFERENCE_BYTES = 256 << 20


def skeleton(shape, seed: int, hidden: int, depth: int, flat: torch.Tensor) -> nn.Module:
    """The shape's model holding the weights ``flat`` (module order): one module per shape and size in this
    process, its weights set anew each time (a step's reference starts from them). Building it again for every
    judged step cost rank 0 more than judging did (the build seeds torch's RNG, which formats a stack per device
    kind)."""
    key = (id(shape), seed, hidden, depth)
    if key not in _SKELETONS:
        while len(_SKELETONS) >= 8:  # a world of user models (check --model) builds one shape per case
            del _SKELETONS[next(iter(_SKELETONS))]
        _SKELETONS[key] = (shape, shape.build(seed, hidden, depth))  # the shape is kept alive: its id stays its own
    return load_flat(_SKELETONS[key][1], flat)


def reference_at(start: nn.Module, every: list, shape, loss_scale: float, data_key: tuple):
    """``oracle.reference_gradients`` of ``start`` over the micro-batches ``every`` (the data named by
    ``data_key``), remembered by the exact starting weights: every point of a sweep world starts from the same
    weights, so step 1's reference and the whole reference trajectory are computed once per shape, GA and
    precision, not once per point. The same weights, data and loss give the same numbers: nothing is approximated."""
    import hashlib

    flat = flat_params(start)
    key = (id(shape), float(loss_scale), data_key, flat.numel(), hashlib.blake2b(flat.numpy().tobytes()).hexdigest())
    hit = _REFERENCES.pop(key, None)
    if hit is None:  # the shape is kept with its numbers: its id stays its own while the key lives
        hit = (*oracle.reference_gradients(start, every, lambda o, y: shape.loss_fn(o, y) * loss_scale), shape)
    _REFERENCES[key] = hit
    while sum(h[0].numel() * 8 for h in _REFERENCES.values()) > _REFERENCE_BYTES and len(_REFERENCES) > 1:
        del _REFERENCES[next(iter(_REFERENCES))]
    return hit[:3]


def _mlp():
    return shapes.get("mlp")


def group_index(module: nn.Module, shape) -> dict:
    """``{group: flat indices}`` of a shape's parameter groups in ``module``'s flat (module-order) vector."""
    spans, k = {}, 0
    for name, p in module.named_parameters():
        spans[name] = (k, k + p.numel())
        k += p.numel()
    return {g: torch.cat([torch.arange(*spans[n]) for n in names]) for g, names in shape.groups(module).items()
            if names}


STEPS = 2  # optimizer steps a probe case takes by default, each judged (a bug that carries state shows from step 2)


def plain_read(model: nn.Module) -> dict:
    """``read_weights`` of a module without masters (a plain torch loop): the module is its own master."""
    flat = flat_params(model)
    return {"module": flat, "masters": flat, "agree": True, "max_diff": 0.0}


def judge_steps(steps: int, read, take_step, *, seed: int, ga: int, micro_batch: int, hidden: int, depth: int = 2,
                dtype: str = "fp32", clip: float = 0.0, loss_scale: float = 1.0, hypotheses=None, extra=None,
                shape=None) -> dict:
    """``steps`` optimizer steps on fresh micro-batches, **each** judged against the reference built from that
    step's own starting weights. A collective: every rank calls it.

    ``read()`` -> ``read_weights``'s dict (what the model will use and the fp32 masters); ``take_step(step,
    batches)`` -> ``(logged grad norm or None, anything gathered on every rank for rank 0)``: one optimizer step on
    this rank's micro-batches of that step. Each step is read from the fp32 masters where they agree with the
    module's weights, else from the module's weights (known to within their rounding: ``read_floor``); its basis
    holds the previous step's micro-batch gradients too (expected weight 0), so a gradient applied again is fitted.
    ``hypotheses(W, N, previous)`` -> ``{name: weights}`` explains each step (``oracle.explain``); ``extra(judged,
    step, gathered, basis, weights, reference)`` adds a probe's own measurements (rank 0). Rank 0 returns the worst
    step's measurement with ``steps`` (every step's), ``worst_step`` and ``trajectory`` (the weights after every
    step against the reference's own steps from the same start); the other ranks ``{}``. ``shape``: the model
    and data (``kit.shapes.shape.Shape``; the MLP by default).
    """
    shape = shape or _mlp()
    r, w, k = rank(), world_size(), world_size() * ga
    judged_steps, prev, first, last, failed, taken = [], None, None, None, None, 0
    after = None
    for s in range(steps):
        with phase("read weights"):
            before = read() if after is None else after  # nothing moves the weights between a step's end and the next
            if s and not all_finite(before["module"]):  # the last step left NaN / inf: it was judged, nothing after is
                break
        with phase("steps"):
            logged, gathered = take_step(s, shape.micro_batches(seed, r, ga, micro_batch, hidden, s))
        with phase("read weights"):
            after, taken = read(), s + 1
        first, last = (before["module"] if first is None else first), after["module"]
        effective, agree = applied(before, after)
        try:  # rank 0 alone judges; if that fails it still takes the next steps' collectives with the others
            with phase("judge"):
                start = skeleton(shape, seed, hidden, depth, before["module"]) if r == 0 else None
                judged, basis, weights, reference = judge(effective, start, seed, ga, micro_batch, hidden, s, prev,
                                                          clip, loss_scale, shape)  # its one collective comes first
            if r != 0 or failed is not None:
                continue
            with phase("judge"):
                judged_steps.append(_judge_step(judged, s, effective, basis, weights, reference, before, after, agree,
                                                logged, gathered, prev, dtype, clip, w, ga, hypotheses, extra))
            prev = basis[:k]
        except Exception as e:  # noqa: BLE001 - raised below, once every rank is past its collectives
            if r != 0:
                raise
            failed = failed or e
    if r != 0:
        return {}
    if failed is not None:
        raise failed
    worst = max(range(len(judged_steps)), key=lambda q: oracle.severity({**judged_steps[q], "dtype": dtype}))
    with phase("trajectory"):
        path = trajectory(first, last, seed, ga, micro_batch, hidden, depth, taken, clip, loss_scale, shape=shape)
    return {**judged_steps[worst], "steps": judged_steps, "worst_step": worst, "trajectory": path}


def _judge_step(judged, s, effective, basis, weights, reference, before, after, agree, logged, gathered, prev,
                dtype, clip, w, ga, hypotheses, extra) -> dict:
    """Rank 0's judgement of one step of ``judge_steps`` (its notes, read floor, hypotheses, extra measurements)."""
    target = reference * judged.get("clip_coef", 1.0)
    judged.update(step=s, logged_norm=logged, reference_norm=reference.norm().item(),
                  read={"judged_from": "fp32 masters" if agree else "module weights", "masters_agree": agree,
                        "max_diff": max(before["max_diff"], after["max_diff"])})
    if not agree:  # the master read misreports: the step the model really took, known to within its rounding
        judged["read_floor"] = rounding_floor(after["module"], dtype, target.norm().item())
    if hypotheses is not None:
        judged["hypotheses"] = oracle.explain(effective, basis, hypotheses(w, ga, prev is not None), dtype, target,
                                              clip=clip)
    if extra is not None:
        extra(judged, s, gathered, basis[:w * ga], weights, reference)
    return judged


def trajectory(first, last, seed: int, ga: int, micro_batch: int, hidden: int, depth: int, steps: int, clip: float,
               loss_scale: float, replicas: int | None = None, shape=None) -> dict:
    """The weights after every step against the reference's own ``steps`` steps from the same start (fp32, one
    process): how far the run drifted in all, errors of every step compounded. ``replicas``: the data-parallel
    ranks whose micro-batches make a step (every rank by default)."""
    shape = shape or _mlp()
    ref = first.clone()
    for s in range(steps):
        every = [b for rr in range(replicas or world_size())
                 for b in shape.micro_batches(seed, rr, ga, micro_batch, hidden, s)]
        model = skeleton(shape, seed, hidden, depth, ref)
        _, _, reference = reference_at(model, every, shape, loss_scale, (seed, ga, micro_batch, hidden, s, replicas))
        ref = ref - oracle.clipped(reference, clip)
    return {"steps": steps, **oracle.compare(first - last, first - ref)}


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
    (``kit.launch.worker.report_partial``) and the records mark the rest ``cannot-run``.
    """
    import datetime

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
