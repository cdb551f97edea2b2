"""What a rank does with its steps, every probe alike: judge each optimizer step against the reference of that step's
starting weights (``judge``, ``judge_steps``, with the references and model skeletons rank 0 keeps between steps), and
run a world's cases one after another, every rank in step with the others (``run_cases``, the phases each case's time
goes to). The basics they read weights and talk to the other ranks with are ``gradkit.probes.ranks.common``."""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from gradkit import shapes
from gradkit.judge import naming, oracle
from gradkit.judge import parts as kparts
from gradkit.judge.tolerances import ROUNDING
from gradkit.launch import worker
from gradkit.probes.ranks import common as c


def judge(effective: torch.Tensor, start: nn.Module, seed: int, ga: int, micro_batch: int, hidden: int,
          step: int = 0, prev_basis=None, clip: float = 0.0, loss_scale: float = 1.0, shape=None,
          replicas: int | None = None):
    """The oracle's view of one step's effective gradient. A collective: every rank calls it.

    Rank 0 rebuilds every rank's micro-batches of ``step`` (rank-major), takes the fp32 reference from that step's
    starting weights ``start`` and returns ``(out, basis, weights, reference)`` with ``out`` holding ``metrics``,
    ``attribution`` and ``rank_spread`` (every rank must have applied the same update); other ranks get
    ``({}, None, None, None)``. ``prev_basis`` (the previous step's micro-batch gradients) joins the basis with an
    expected weight of 0, so a previous step's gradient applied again is fitted, not guessed. ``clip``: the
    engine clips at that norm, so the expected step is the reference clipped (``clip_coef`` in ``out``);
    ``loss_scale`` multiplies every micro-batch's loss (the engine's loss is scaled the same way). ``shape``
    (``gradkit.shapes.shape.Shape``, the MLP by default) makes the micro-batches and the loss; where it has several parameter
    groups each is judged on its own too (``groups``: ``kparts.judge_groups``). ``replicas``: the data-parallel ranks
    whose micro-batches make the step (every rank by default; under tensor parallelism the ranks of one group share
    theirs).
    """
    shape = shape or _mlp()
    w = replicas or c.world_size()
    per_rank = c.all_gather_flat(effective)
    if c.rank() != 0:
        return {}, None, None, None
    every = [b for rr in range(w) for b in shape.micro_batches(seed, rr, ga, micro_batch, hidden, step)]
    basis, weights, reference = reference_at(start, every, shape, loss_scale,
                                             (seed, ga, micro_batch, hidden, step, replicas))
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
        out["groups"] = kparts.judge_groups(effective, full, expected, reference * coef, groups, w, ga,
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
    return c.load_flat(_SKELETONS[key][1], flat)


def reference_at(start: nn.Module, every: list, shape, loss_scale: float, data_key: tuple):
    """``oracle.reference_gradients`` of ``start`` over the micro-batches ``every`` (the data named by
    ``data_key``), remembered by the exact starting weights: every point of a sweep world starts from the same
    weights, so step 1's reference and the whole reference trajectory are computed once per shape, GA and
    precision, not once per point. The same weights, data and loss give the same numbers: nothing is approximated."""
    flat = c.flat_params(start).cpu().contiguous()  # its bytes, read in place (numpy is not a requirement of the kit)
    raw = ctypes.string_at(flat.data_ptr(), flat.numel() * flat.element_size())
    key = (id(shape), float(loss_scale), data_key, flat.numel(), hashlib.blake2b(raw).hexdigest())
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
    flat = c.flat_params(model)
    return {"module": flat, "masters": flat, "agree": True, "max_diff": 0.0}


def judge_steps(steps: int, read, take_step, *, seed: int, ga: int, micro_batch: int, hidden: int, depth: int = 2,
                dtype: str = "fp32", clip: float = 0.0, loss_scale: float = 1.0, hypotheses=None, extra=None,
                shape=None, masters_dtype: str = "fp32", data_rank: int | None = None,
                replicas: int | None = None, facts=None) -> dict:
    """``steps`` optimizer steps on fresh micro-batches, **each** judged against the reference built from that
    step's own starting weights. A collective: every rank calls it.

    ``read()`` -> ``read_weights``'s dict (what the model will use and the fp32 masters); ``take_step(step,
    batches)`` -> ``(logged grad norm or None, anything gathered on every rank for rank 0)``: one optimizer step on
    this rank's micro-batches of that step. Each step is read from the fp32 masters where they agree with the
    module's weights, else from the module's weights (known to within their rounding: ``read_floor``); its basis
    holds the previous step's micro-batch gradients too (expected weight 0), so a gradient applied again is fitted.
    ``hypotheses(W, N, previous, previous_update)`` -> ``{name: weights or a function of the basis}`` explains each
    step (``naming.explain``; ``previous_update``: the update the previous step applied, None on the first); ``extra(judged,
    step, gathered, basis, weights, reference)`` adds a probe's own measurements (rank 0). Rank 0 returns the worst
    step's measurement with ``steps`` (every step's), ``worst_step`` and ``trajectory`` (the weights after every
    step against the reference's own steps from the same start); the other ranks ``{}``. ``shape``: the model
    and data (``gradkit.shapes.shape.Shape``; the MLP by default). ``masters_dtype``: the masters' own precision
    (bf16 under ``bf16_master_weights_and_grads``): a step read from them is known to within their rounding too.
    ``data_rank`` / ``replicas``: this rank's data-parallel index and how many there are (under tensor parallelism
    the ranks of one group feed the same micro-batches); the rank and the world size by default. ``facts(step)`` ->
    what the engine says of the step just taken, kept with its judgement (an fp16 loss scale); ``"skipped": True``
    there is a step the engine skipped by design (an fp16 overflow): it applies nothing, is said as skipped, is not
    the worst step, and the trajectory's reference skips it too.
    """
    shape = shape or _mlp()
    r, w = c.rank(), replicas or c.world_size()
    k, own = w * ga, r if data_rank is None else data_rank
    judged_steps, prev, first, last, failed, taken = [], None, None, None, None, 0
    previous_update = None  # the update the previous step applied (rank 0): a hypothesis may apply it again
    after = None
    for s in range(steps):
        with phase("read weights"):
            before = read() if after is None else after  # nothing moves the weights between a step's end and the next
            if s and not c.all_finite(before["module"]):  # the last step left NaN / inf: it was judged, nothing after is
                break
        with phase("steps"):
            logged, gathered = take_step(s, shape.micro_batches(seed, own, ga, micro_batch, hidden, s))
        with phase("read weights"):
            after, taken = read(), s + 1
        first, last = (before["module"] if first is None else first), after["module"]
        effective, agree = c.applied(before, after)
        try:  # rank 0 alone judges; if that fails it still takes the next steps' collectives with the others
            with phase("judge"):
                start = skeleton(shape, seed, hidden, depth, before["module"]) if r == 0 else None
                judged, basis, weights, reference = judge(effective, start, seed, ga, micro_batch, hidden, s, prev,
                                                          clip, loss_scale, shape, replicas)  # its one collective comes first
            if r != 0 or failed is not None:
                continue
            with phase("judge"):
                judged_steps.append(_judge_step(judged, s, effective, basis, weights, reference, before, after, agree,
                                                logged, gathered, prev, dtype, clip, w, ga, hypotheses, extra,
                                                masters_dtype, previous_update))
                said = facts(s) if facts else {}
                if said.get("skipped") and float(effective.abs().max()) != 0.0:  # said skipped, yet the weights moved
                    said = {**said, "skipped": False, "moved_while_skipped": float(effective.norm())}
                judged_steps[-1].update(said)
            prev, previous_update = basis[:k], unclipped_update(effective, logged, clip)
        except Exception as e:  # noqa: BLE001 - raised below, once every rank is past its collectives
            if r != 0:
                raise
            failed = failed or e
    if r != 0:
        return {}
    if failed is not None:
        raise failed
    applied = [q for q, j in enumerate(judged_steps) if not j.get("skipped")]
    worst = max(applied or range(len(judged_steps)), key=lambda q: oracle.severity({**judged_steps[q], "dtype": dtype}))
    with phase("trajectory"):
        path = trajectory(first, last, seed, ga, micro_batch, hidden, depth, taken, clip, loss_scale, replicas, shape,
                          skipped={q for q, j in enumerate(judged_steps) if j.get("skipped")})
    return {**judged_steps[worst], "steps": judged_steps, "worst_step": worst, "trajectory": path}


def _judge_step(judged, s, effective, basis, weights, reference, before, after, agree, logged, gathered, prev,
                dtype, clip, w, ga, hypotheses, extra, masters_dtype="fp32", previous_update=None) -> dict:
    """Rank 0's judgement of one step of ``judge_steps`` (its notes, read floor, hypotheses, extra measurements)."""
    target = reference * judged.get("clip_coef", 1.0)
    judged.update(step=s, logged_norm=logged, reference_norm=reference.norm().item(),
                  read={"judged_from": "fp32 masters" if agree else "module weights", "masters_agree": agree,
                        "max_diff": max(before["max_diff"], after["max_diff"])})
    if not agree:  # the master read misreports: the step the model really took, known to within its rounding
        judged["read_floor"] = c.rounding_floor(after["module"], dtype, target.norm().item())
    elif masters_dtype != "fp32":  # low-precision masters: the step read from them is known to within their rounding
        judged["read_floor"] = c.rounding_floor(after["masters"], masters_dtype, target.norm().item())
    if hypotheses is not None:
        # the step is read as the difference of two rounded weight vectors: known to within their rounding, which a
        # hypothesis of a step far smaller than the weights' own (B9's 1 / loss scale) may sit below
        floor = (after["masters" if agree else "module"].abs() * ROUNDING[masters_dtype if agree else dtype]
                 / 2).norm().item()
        judged["hypotheses"] = naming.explain(effective, basis, hypotheses(w, ga, prev is not None, previous_update),
                                              dtype, target, clip=clip, floor=floor)
    if extra is not None:
        extra(judged, s, gathered, basis[:w * ga], weights, reference)
    return judged


def unclipped_update(effective: torch.Tensor, logged: float | None, clip: float) -> torch.Tensor:
    """A step's update before the engine's clip: where it clipped (its logged norm above the clip), the applied update
    scaled back up to that norm (a carried gradient is carried unclipped, B11's)."""
    out = effective.to(torch.float64)
    norm = out.norm().item()
    if clip and logged and logged > clip and norm > 0:
        out = out * (logged / norm)
    return out


def trajectory(first, last, seed: int, ga: int, micro_batch: int, hidden: int, depth: int, steps: int, clip: float,
               loss_scale: float, replicas: int | None = None, shape=None, skipped=()) -> dict:
    """The weights after every step against the reference's own ``steps`` steps from the same start (fp32, one
    process): how far the run drifted in all, errors of every step compounded. ``replicas``: the data-parallel
    ranks whose micro-batches make a step (every rank by default); ``skipped``: the steps the engine skipped by
    design, which the reference skips too."""
    shape = shape or _mlp()
    ref = first.clone()
    for s in range(steps):
        if s in skipped:
            continue
        every = [b for rr in range(replicas or c.world_size())
                 for b in shape.micro_batches(seed, rr, ga, micro_batch, hidden, s)]
        model = skeleton(shape, seed, hidden, depth, ref)
        _, _, reference = reference_at(model, every, shape, loss_scale, (seed, ga, micro_batch, hidden, s, replicas))
        ref = ref - oracle.clipped(reference, clip)
    if len(skipped) >= steps:  # every step skipped by design: no path to compare
        return {"steps": steps, "skipped": len(skipped)}
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
    (``gradkit.launch.worker.report_partial``) and the records mark the rest ``cannot-run``.
    """
    import datetime

    wait_s = float(os.environ.get(SYNC_TIMEOUT_ENV, "120"))
    sync = None
    if dist.is_initialized() and c.world_size() > 1:  # its own timeout also bounds the non-zero ranks' wait
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
        _FAILED_IN.clear()
        try:
            res = run_one(case)
        except Exception as e:  # noqa: BLE001 - see the docstring
            import traceback
            res = {"error": f"{type(e).__name__}: {str(e)[:500]}", "traceback": traceback.format_exc()[-3000:],
                   "failed_in": _FAILED_IN[0] if _FAILED_IN else None}
        res.update(case=case["name"], ga=case["ga"], wall_s=clock(), versions=c.versions())
        if _PHASES:
            res["phases"] = {k: round(v, 4) for k, v in _PHASES.items()}
            res["phases"]["other"] = round(max(0.0, res["wall_s"] - sum(_PHASES.values())), 4)
        if sync is not None:
            try:
                dist.monitored_barrier(group=sync, timeout=datetime.timedelta(seconds=wait_s),
                                       wait_all_ranks=True)
            except RuntimeError as e:
                raise WorldDesynchronised(
                    f"case {case['name']!r} (GA={case['ga']}) ended on rank {c.rank()} "
                    f"({'error: ' + res['error'] if 'error' in res else 'ok'}) but not on every rank within "
                    f"{wait_s:g} s: {str(e).splitlines()[0][:300]}") from e
        worker.report_partial(res)
        results.append(res)
    return results


_PHASES: dict = {}
_FAILED_IN: list = []  # the phases a case's error passed through, innermost first


@contextlib.contextmanager
def phase(name: str):
    """Time a part of the running case (``initialize``, ``step``, ``read masters``, ``reference`` ...): each case's
    result carries ``phases`` in seconds, with ``other`` for the rest (``scripts/bench.py --profile`` reads them)."""
    t0 = time.perf_counter()
    try:
        yield
    except BaseException:
        _FAILED_IN.append(name)  # the innermost phase an error passed through comes first
        raise
    finally:
        _PHASES[name] = _PHASES.get(name, 0.0) + time.perf_counter() - t0


class Stopwatch:
    def __init__(self):
        self.t0 = time.perf_counter()

    def __call__(self) -> float:
        return round(time.perf_counter() - self.t0, 3)
