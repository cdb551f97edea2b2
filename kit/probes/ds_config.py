"""A user's DeepSpeed config, judged on the kit's tiny model: does every step apply the mean gradient?

    cfg = ds_config.resolve(json.load(open("ds_config.json")), world_size=2)   # "auto" resolved, notes kept
    recs = ds_config.run(cfg, loops=LOOPS, world_size=2)                    # one world, every loop style

Everything in the config that touches gradients is kept (ZeRO stage, bf16 / fp16, ``data_types``,
``communication_data_type``, offload, bucket sizes, ``gradient_predivide_factor``, ``prescale_gradients``,
``bf16.immediate_grad_update`` ...). What would hide the measurement is replaced, and said: the optimizer
becomes SGD (lr = 1, no momentum or weight decay), the scheduler goes, bucket sizes shrink so the tiny model
spans several buckets, fp16's dynamic loss scale becomes a static one. Clipping is kept: every loss is scaled so
the clip acts, and the expected step is the reference clipped. Each case takes ``steps`` optimizer steps, each
judged against the reference from that step's own starting weights (the module's weights, cross-checked against
the fp32 masters), with the previous step's micro-batches in the basis of its fitted weights.

Loop styles (each its own case, all in one world, ``N`` micro-batches per step):

==========  ==================================================================================
engine      DeepSpeed's own loop: config GA = N, ``backward(loss)`` + ``step()`` per micro-batch
boundary    config GA = N, ``set_gradient_accumulation_boundary(i == N-1)``, ``backward(loss)``,
            one ``step()`` (what Accelerate does)
manual      config GA = 1, ``backward(loss / N)`` N times, one ``step()`` (B3's pattern)
unmanaged   ``manual`` + ``managed_gradient_accumulation: false`` (DeepSpeed >= 0.19.4 only)
==========  ==================================================================================

The control runs in the same world without DeepSpeed: the bare fp32 module, local accumulation, one
``torch.distributed.all_reduce`` per gradient. Where a known bug predicts this configuration is hit, its
fix runs too (``fix:B3``: the manual loop with the boundary marked; ``fix:B4``: ``immediate_grad_update``).
"""
from __future__ import annotations

import copy
import json

from kit import config as kconfig
from kit import shapes
from kit.judge import oracle, records
from kit.judge.expectations import version_key
from kit.probes import common as c
from kit.probes import runner
from kit.probes.bf16_leak import bf16_accumulator
from kit.probes.probe import Probe
from kit.stacks import versions

LOOPS = ("engine", "boundary", "manual", "unmanaged")
UNMANAGED_SINCE = "0.19.4"
HIDDEN, DEPTH, MICRO_BATCH, SEED = 32, 2, 4, 0
PARAMS = DEPTH * (HIDDEN * HIDDEN + HIDDEN)  # the tiny model's parameter count
BUCKETS = 3  # the tiny model spans this many buckets
BUCKET_KEYS = ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size")
HYPOTHESES = ("global mean", "last micro-batch / N", "sum of micro-batches", "mean / N", "own rank's boundary micro-batch",
              "all but the first micro-batch", "first and last micro-batch")
FAULT_KEY = "gradkit_fault_kill_rank"  # a config key the kit reads, never DeepSpeed: that rank kills itself (tests)
TRAINER_MAX_GRAD_NORM = 1.0  # what HF Trainer's "auto" gradient_clipping becomes (TrainingArguments.max_grad_norm)
STEPS = 3  # optimizer steps per check or sweep point, each judged
# DeepSpeed optimizers that bring their own communication (deepspeed/runtime/config.py: ONEBIT_ADAM_OPTIMIZER,
# ONEBIT_LAMB_OPTIMIZER, ZERO_ONE_ADAM_OPTIMIZER), lower case without "_"
OWN_COMMUNICATION = ("onebitadam", "onebitlamb", "zerooneadam")
DROPPED = ("optimizer", "scheduler", "tensorboard", "wandb", "csv_monitor", "comet", "flops_profiler",
           "steps_per_print", "wall_clock_breakdown")


class Resolved(dict):
    """The config that will run (a dict), with ``notes``: every change made to the user's config, in words, and
    ``refused``: why the kit cannot judge it at all (None: it can)."""

    notes: list
    refused: str | None = None


def _auto(value) -> bool:
    return value == "auto"


def _enabled(section, name: str, notes: list, trainer_dtype: str) -> bool:
    if not isinstance(section, dict):
        raise kconfig.ConfigError(f'"{name}" must be an object like {{"enabled": true}}, got {section!r}')
    on = section.get("enabled", False)
    if _auto(on):
        on = trainer_dtype == name
        notes.append(f'{name}.enabled "auto" -> {str(on).lower()} (the Trainer takes it from --{name}; '
                     f"this check's --trainer-dtype is {trainer_dtype})")
    if not isinstance(on, bool):
        raise kconfig.ConfigError(f'"{name}.enabled" must be true, false or "auto", got {on!r}')
    return on


def resolve(user: dict, world_size: int = 2, ga: int = 4, trainer_dtype: str = "fp32") -> Resolved:
    """The user's config as the kit will run it; ``ConfigError`` (exit 2) on anything DeepSpeed would not accept.

    "auto" values are resolved as HF Trainer's ``HfTrainerDeepSpeedConfig`` does, from its arguments: the
    micro-batch from ``per_device_train_batch_size`` (the kit's ``MICRO_BATCH``), GA from
    ``gradient_accumulation_steps`` (``ga``), ``train_batch_size`` = micro-batch x GA x world size, fp16 / bf16
    from ``trainer_dtype``, ``reduce_bucket_size`` = hidden x hidden, ``stage3_prefetch_bucket_size`` =
    0.9 x hidden x hidden, ``stage3_param_persistence_threshold`` = 10 x hidden (hidden: the kit's model's).
    """
    if not isinstance(user, dict):
        raise kconfig.ConfigError(f"a DeepSpeed config is a JSON object, got {type(user).__name__}")
    kconfig.check_world_size(world_size)
    kconfig.check_ga(ga)
    if trainer_dtype not in ("fp32", "bf16", "fp16"):
        raise kconfig.ConfigError(f"--trainer-dtype must be fp32, bf16 or fp16, got {trainer_dtype!r}")
    cfg, notes = copy.deepcopy(user), []
    opt = (cfg.get("optimizer") or {}).get("type") if isinstance(cfg.get("optimizer"), dict) else None
    refused = None
    if isinstance(opt, str) and opt.lower().replace("_", "") in OWN_COMMUNICATION:
        refused = (f'the optimizer "{opt}" communicates its own compressed update (error feedback, a frozen variance '
                   "stage): the update it applies is not the averaged gradient, and an SGD stand-in would judge "
                   "another code path, so the kit cannot judge this config")
    for key in DROPPED:
        if key in cfg:
            cfg.pop(key)
            notes.append(f'"{key}" removed' + (": the optimizer is SGD, lr = 1, no momentum or weight decay, so "
                                               "the update is the gradient" if key == "optimizer" else ""))
    mb = cfg.get("train_micro_batch_size_per_gpu", MICRO_BATCH)
    if _auto(mb) or "train_micro_batch_size_per_gpu" not in cfg:
        notes.append(f"train_micro_batch_size_per_gpu {'auto' if _auto(mb) else 'absent'} -> {MICRO_BATCH}")
        mb = MICRO_BATCH
    g = cfg.get("gradient_accumulation_steps", ga)
    if _auto(g) or "gradient_accumulation_steps" not in cfg:
        notes.append(f"gradient_accumulation_steps {'auto' if _auto(g) else 'absent'} -> {ga}")
        g = ga
    kconfig.check_positive_int("train_micro_batch_size_per_gpu", mb)
    kconfig.check_ga(g)
    if g == 1:  # nothing to accumulate in the config: the user's own loop accumulates (B3's pattern)
        notes.append(f"gradient_accumulation_steps 1: every loop style takes N = {ga} micro-batches per step "
                     f"(--ga); engine and boundary run it as config GA = {ga}, manual and unmanaged as config GA = 1 "
                     f"with {ga} backward() calls")
        g = ga
    tbs = cfg.get("train_batch_size")
    if tbs is not None and not _auto(tbs) and tbs != mb * g * world_size:
        notes.append(f"train_batch_size {tbs} -> {mb * g * world_size} (micro-batch {mb} x GA {g} x {world_size} ranks)")
    cfg.update(train_micro_batch_size_per_gpu=mb, gradient_accumulation_steps=g, train_batch_size=mb * g * world_size)
    clip = cfg.get("gradient_clipping", 0.0)
    if _auto(clip):
        clip = TRAINER_MAX_GRAD_NORM
        notes.append(f"gradient_clipping auto -> {clip:g} (the Trainer's max_grad_norm default)")
    if not isinstance(clip, (int, float)) or clip < 0:
        raise kconfig.ConfigError(f"gradient_clipping must be a number >= 0 or \"auto\", got {clip!r}")
    if clip:
        notes.append(f"gradient_clipping {clip:g} kept: every loss is scaled so the first step's reference norm is "
                     f"twice the clip, so the clip acts in every step (the expected step is the reference clipped)")
    cfg["gradient_clipping"] = float(clip)
    cfg["steps_per_print"] = 10 ** 9
    cfg["zero_allow_untested_optimizer"] = True
    bf16 = _enabled(cfg.get("bf16", {}), "bf16", notes, trainer_dtype)
    fp16 = _enabled(cfg.get("fp16", {}), "fp16", notes, trainer_dtype)
    if bf16 and fp16:
        raise kconfig.ConfigError("bf16 and fp16 are both enabled: DeepSpeed accepts one of them")
    for name, on in (("bf16", bf16), ("fp16", fp16)):
        if name in cfg:
            cfg[name] = {**cfg[name], "enabled": on}
    if fp16:
        scale = cfg["fp16"].get("loss_scale", 0)
        if not scale:
            cfg["fp16"]["loss_scale"] = 256
            notes.append("fp16 dynamic loss scaling -> a static loss scale of 256 (a dynamic scale skips the "
                         "first steps on overflow; one step must be measurable)")
    zero = cfg.setdefault("zero_optimization", {})
    if not isinstance(zero, dict):
        raise kconfig.ConfigError(f'"zero_optimization" must be an object, got {zero!r}')
    stage = zero.setdefault("stage", 0)
    kconfig.check_zero_stage(stage)
    hidden_auto = {"reduce_bucket_size": HIDDEN * HIDDEN, "stage3_prefetch_bucket_size": int(0.9 * HIDDEN * HIDDEN),
                   "stage3_param_persistence_threshold": 10 * HIDDEN}
    for key, value in hidden_auto.items():
        if _auto(zero.get(key)):
            zero[key] = value
            notes.append(f"zero_optimization.{key} auto -> {value} (the Trainer's rule, on the kit's hidden size "
                         f"{HIDDEN})")
    small = max(PARAMS // BUCKETS, 64)
    for key in BUCKET_KEYS:
        value = zero.get(key)
        if value is not None and not isinstance(value, (int, float)):
            raise kconfig.ConfigError(f"zero_optimization.{key} must be a number, got {value!r}")
        if value is not None and value > small:
            zero[key] = small
            notes.append(f"zero_optimization.{key} {value:g} -> {small} (the kit's model has {PARAMS} parameters: "
                         f"{BUCKETS} buckets, as a large model spans many)")
    if "stage3_param_persistence_threshold" in zero and zero["stage3_param_persistence_threshold"] > 10 * HIDDEN:
        notes.append(f"zero_optimization.stage3_param_persistence_threshold {zero['stage3_param_persistence_threshold']:g}"
                     f" -> {10 * HIDDEN} (else every parameter of the kit's model would persist, unpartitioned)")
        zero["stage3_param_persistence_threshold"] = 10 * HIDDEN
    for key in ("offload_optimizer", "offload_param"):
        off = zero.get(key)
        if off is None:
            continue
        device = off.get("device", "none") if isinstance(off, dict) else None
        if device not in ("cpu", "none", "nvme"):
            raise kconfig.ConfigError(f'zero_optimization.{key}.device must be "cpu", "nvme" or "none", got {off!r}')
        if device == "nvme":
            raise kconfig.ConfigError(f"zero_optimization.{key} offloads to NVMe: the check runs in memory; "
                                      'set its device to "cpu" to judge the same code path up to the swap')
        if key == "offload_optimizer" and device == "cpu":
            cfg["zero_force_ds_cpu_optimizer"] = False
            notes.append("zero_force_ds_cpu_optimizer -> false (offloaded steps run the kit's SGD, not CPU Adam)")
    types = cfg.get("data_types", {})
    if not isinstance(types, dict) or types.get("grad_accum_dtype", "fp32") not in ("fp32", "bf16", "fp16"):
        raise kconfig.ConfigError(f'data_types.grad_accum_dtype must be "fp32", "bf16" or "fp16", got {types!r}')
    if cfg.get("communication_data_type") not in (None, "fp32", "bf16", "fp16"):
        raise kconfig.ConfigError(f'communication_data_type must be "fp32", "bf16" or "fp16", got '
                                  f"{cfg['communication_data_type']!r}")
    if "pipeline" in cfg or "pipe_parallel_size" in cfg:
        notes.append("pipeline keys ignored: the check runs data parallelism (notebook 02 judges the pipeline)")
    out = Resolved(cfg)
    out.notes = notes
    out.refused = refused
    return out


def dtype_of(cfg: dict) -> str:
    return "bf16" if cfg.get("bf16", {}).get("enabled") else "fp16" if cfg.get("fp16", {}).get("enabled") else "fp32"


_COARSENESS = ("fp32", "fp16", "bf16")  # finest to coarsest significand


def judge_dtype(cfg: dict) -> str:
    """The precision a step of ``cfg`` is judged at: the coarsest its gradient passes through -- the model's, the
    reduction's (``communication_data_type``) and the accumulator's (``data_types.grad_accum_dtype``). An fp32
    model reduced in bf16 carries bf16's rounding by design: judged at fp32's limits it would be called affected."""
    seen = [dtype_of(cfg), str(cfg.get("communication_data_type") or ""),
            str((cfg.get("data_types") or {}).get("grad_accum_dtype") or "")]
    return max((d for d in seen if d in _COARSENESS), key=_COARSENESS.index)


def known_fixes(cfg: dict, loop: str) -> list[str]:
    """The known bugs' fixes worth a re-run for this config and loop (cheap: one more case each)."""
    out = []
    if loop == "manual" and cfg["zero_optimization"]["stage"] in (1, 2):
        out.append("fix:B3")
    if (dtype_of(cfg) == "bf16" and cfg.get("data_types", {}).get("grad_accum_dtype") == "fp32"
            and not cfg["bf16"].get("immediate_grad_update", False)):
        out.append("fix:B4")
    return out


def with_ga(cfg: Resolved, n: int, why: str) -> Resolved:
    """The same resolved config at ``n`` micro-batches per step (train batch size to match), ``why`` in its notes."""
    out = Resolved(copy.deepcopy(dict(cfg)))
    mb, w = out["train_micro_batch_size_per_gpu"], out["train_batch_size"] // (
        out["train_micro_batch_size_per_gpu"] * out["gradient_accumulation_steps"])
    out.update(gradient_accumulation_steps=n, train_batch_size=mb * n * w)
    out.notes, out.refused = list(cfg.notes) + [f"gradient_accumulation_steps {cfg['gradient_accumulation_steps']} "
                                                f"-> {n} ({why})"], cfg.refused
    return out


def case_config(cfg: dict, loop: str, fix: str | None = None) -> dict:
    """The config one case runs: the loop's GA, the fix applied."""
    n = cfg["gradient_accumulation_steps"]
    out = copy.deepcopy(dict(cfg))
    if loop in ("manual", "unmanaged") or fix == "fix:B3":
        out["gradient_accumulation_steps"] = 1
        out["train_batch_size"] //= n
    if loop == "unmanaged":
        out["managed_gradient_accumulation"] = False
    if fix == "fix:B4":
        out["bf16"] = {**out["bf16"], "immediate_grad_update": True}
    return out


# ====================================================================== inside a rank

def hypothesis_weights(w: int, n: int, own: int = 0, previous: bool = False) -> dict:
    """Weights over the rank-major basis (rank r, micro-batch i -> r*n + i), as seen from rank ``own``;
    ``previous``: the basis goes on with the previous step's micro-batches (weight 0 unless a hypothesis says)."""
    k = w * n
    last = [1.0 / k if i % n == n - 1 else 0.0 for i in range(k)]
    own_boundary = [(1.0 / n if i // n == own else 0.0) if i % n == n - 1 else 1.0 / k for i in range(k)]
    first_lost = [0.0 if i % n == 0 else 1.0 / k for i in range(k)]
    ends = [1.0 / k if i % n in (0, n - 1) else 0.0 for i in range(k)] if n > 2 else [0.0] * k  # n <= 2: the mean
    out = dict(zip(HYPOTHESES, ([1.0 / k] * k, last, [1.0 / w] * k, [1.0 / (k * n)] * k, own_boundary, first_lost,
                                ends)))
    if previous:
        out[STALE] = [1.0 / k] * (2 * k)
    return out


STALE = "the previous step's gradient applied again"
STALE_FAULT_KEY = "gradkit_fault_keep_grads"  # tests: the plain-torch loop forgets zero_grad (a stale-state bug)
# tests: the plain-torch loop breaks a shape's parameters on purpose: "drop:<group>:<i>" (micro-batch i's gradient
# of that group lost), "train_frozen" (frozen weights trained), "untie" (the tied weight's head use not summed)
LOOP_FAULT_KEY = "gradkit_fault_loop"


def _step(engine, loop: str, batches, loss_fn, before_step=lambda: None) -> None:
    """One optimizer step in the loop style ``loop``; ``before_step()`` runs just before the step that applies."""
    n = len(batches)
    for i, (x, y) in enumerate(batches):
        if loop == "engine":
            engine.backward(loss_fn(engine(x), y))
            if i == n - 1:
                before_step()
            engine.step()
            continue
        if loop in ("boundary", "fix:B3"):
            engine.set_gradient_accumulation_boundary(is_boundary=(i == n - 1))
        loss = loss_fn(engine(x), y)
        engine.backward(loss if loop == "boundary" else loss / n)
    if loop != "engine":
        before_step()
        engine.step()


def loss_scale(w: int, n: int, clip: float, shape=None) -> float:
    """The factor every micro-batch's loss is multiplied by: 1 without clipping; with clipping, the one that puts
    the first step's reference norm at twice the clip, so the clip acts in every step (the kit's tiny model's
    gradients are far below a usual clip of 1.0). The same on every rank (computed from the shared data)."""
    if not clip:
        return 1.0
    shape = shape or shapes.get(shapes.DEFAULT)
    every = [b for rr in range(w) for b in shape.micro_batches(SEED, rr, n, MICRO_BATCH, HIDDEN, 0)]
    _, _, reference = oracle.reference_gradients(shape.build(SEED, HIDDEN, DEPTH), every, shape.loss_fn)
    return 2.0 * clip / reference.norm().item()


class _TorchLoop:
    """The control's loop (and the tests' deliberately broken ones): the bare fp32 module, local accumulation, one
    ``torch.distributed.all_reduce`` per gradient, torch's own clipping; no DeepSpeed anywhere in the step."""

    def __init__(self, model, clip: float, keep_grads: bool, fault: str | None = None, shape=None):
        self.fault, self.shape = fault or "", shape
        if self.fault == "train_frozen":  # tests: the frozen weights handed to the optimizer and trained
            for p in model.parameters():
                p.requires_grad_(True)
        if self.fault == "untie":  # tests: the tied weight gets its embedding use's gradient only
            model.untie_fault = True
        self.model, self.opt, self.clip, self.keep = model, c.sgd(model), clip, keep_grads

    def read(self):
        return c.plain_read(self.model)

    def step(self, batches, loss_fn) -> float:
        import torch

        n = len(batches)
        drop = self.fault.split(":") if self.fault.startswith("drop:") else None  # "drop:<group>:<micro-batch>"
        for i, (x, y) in enumerate(batches):
            kept = None
            if drop and i == int(drop[2]):  # tests: this micro-batch's gradient of one group is lost
                names = set(self.shape.groups(self.model)[drop[1]])
                kept = {n_: (p.grad.clone() if p.grad is not None else None)
                        for n_, p in self.model.named_parameters() if n_ in names}
            (loss_fn(self.model(x), y) / n).backward()
            for n_, p in self.model.named_parameters():
                if kept is not None and n_ in kept:
                    p.grad = kept[n_]
        c.average_grads(self.model)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip if self.clip else float("inf"))
        self.opt.step()
        if not self.keep:
            self.opt.zero_grad(set_to_none=True)
        return float(norm)


def run_case(case: dict) -> dict:
    import deepspeed

    r, w, n = c.rank(), c.world_size(), case["ga"]
    steps, clip = int(case.get("steps", 1)), float(case.get("clip") or 0.0)
    shape = shapes.of_case(case)
    scale = loss_scale(w, n, clip, shape)

    def loss_fn(out, y):
        return shape.loss_fn(out, y) * scale

    model = shape.build(SEED, HIDDEN, DEPTH)
    cfg = case.get("ds_config") or {}
    engine, dtype = None, c.DTYPE.get(case["dtype"]) or __import__("torch").float16
    if case["loop"] == "torch":  # the control: plain torch.distributed, no DeepSpeed in the step
        loop = _TorchLoop(model, clip, bool(cfg.get(STALE_FAULT_KEY)), cfg.get(LOOP_FAULT_KEY), shape)
    else:
        if cfg.get(FAULT_KEY) == r:  # fault injection (the sweep's crash-survival test): die like a segfault
            import os
            import signal
            os.kill(os.getpid(), signal.SIGKILL)
        model = model.to(dtype)
        ds = {k: v for k, v in cfg.items() if k not in (FAULT_KEY, STALE_FAULT_KEY, LOOP_FAULT_KEY)}
        with c.phase("initialize"):
            engine, *_ = deepspeed.initialize(model=model, optimizer=c.sgd(model), config=ds)
        if case["loop"] == "unmanaged" and not hasattr(engine, "managed_gradient_accumulation"):
            c.release(engine)
            raise RuntimeError(f"this DeepSpeed has no managed_gradient_accumulation (added in {UNMANAGED_SINCE})")
    dev = c.device()
    held, state = {}, {"skipped": 0}  # held: BF16_Optimizer's own fp32 accumulator on this rank, going into the step

    def take(s, batches):
        if engine is None:
            return loop.step(batches, loss_fn), None
        held.clear()
        _step(engine, case["fix"] if case.get("fix") == "fix:B3" else case["loop"],
              [(c.to_device(x, dev, dtype), y.to(dev)) for x, y in batches], loss_fn,
              before_step=lambda: held.update(buffer=bf16_accumulator(engine)))
        state["skipped"] = int(getattr(engine, "skipped_steps", 0) or 0)
        # a leak is per rank: every rank's accumulator (a collective), attributed on rank 0
        return c.engine_norm(engine), (c.all_gather_flat(held["buffer"]) if held.get("buffer") is not None else None)

    def accumulators(judged, s, buffers, basis, weights, reference):
        if buffers is not None:  # each rank's accumulator, attributed and explained from that rank's view
            judged["rank_buffers"] = [{"metrics": oracle.compare(b, reference),
                                       "attribution": oracle.attribute(b, basis, weights),
                                       "hypotheses": oracle.explain(b, basis, hypothesis_weights(w, n, own=q),
                                                                    case["dtype"], reference)}
                                      for q, b in enumerate(buffers)]
            judged["rank_spread"]["fp32 accumulators"] = oracle.spread(buffers)

    read = loop.read if engine is None else lambda: c.read_weights(engine.module, engine.optimizer, case["dtype"])
    out = c.judge_steps(steps, read, take, seed=SEED, ga=n, micro_batch=MICRO_BATCH, hidden=HIDDEN, depth=DEPTH,
                        dtype=case.get("judge_dtype", case["dtype"]), clip=clip, loss_scale=scale, extra=accumulators,
                        hypotheses=lambda ws, ns, prev: hypothesis_weights(ws, ns, previous=prev), shape=shape)
    engine_ga = n if engine is None else engine.gradient_accumulation_steps()
    optimizer = "torch.optim.SGD" if engine is None else type(engine.optimizer).__name__
    if engine is not None:
        with c.phase("release"):
            c.release(engine)
    if state["skipped"]:
        raise RuntimeError("a step was skipped (fp16 overflow): nothing was applied, nothing can be judged")
    return {**out, "optimizer": optimizer, "engine_ga": engine_ga} if r == 0 else {}


def bf16_accumulator(engine):
    """This rank's fp32 accumulator of a BF16_Optimizer, flat in module order (None for other optimizers)."""
    return bf16_accumulator(engine, engine.module)



def run_rank(payload: dict) -> list[dict]:
    return c.run_cases(payload, run_case)


# ====================================================================== in the caller

def plan(cfg: Resolved, loops=LOOPS, deepspeed_version: str | None = None, steps: int = STEPS, model=None
         ) -> tuple[list[dict], list[str]]:
    """The cases of one check (the control first) and a note per loop style left out; each case takes ``steps``
    optimizer steps, each judged, on ``model``: a shape's name (``kit.shapes``; the MLP by default) or the
    user's architecture (``{"model_config": ..., "adapter_config": ...}`` from ``kit.shapes.user_model``)."""
    unknown = sorted(set(loops) - set(LOOPS))
    if unknown or not loops:
        raise kconfig.ConfigError(f"unknown loop style(s) {unknown or loops}; known: {', '.join(LOOPS)} (or all)")
    kconfig.check_positive_int("steps", steps)
    n, dtype, notes = cfg["gradient_accumulation_steps"], dtype_of(cfg), []
    stage, clip = cfg["zero_optimization"]["stage"], cfg.get("gradient_clipping", 0.0)
    on = model_keys(model)
    out = [{"name": "control", "role": "control", "loop": "torch", "ga": n, "dtype": "fp32", "zero_stage": None,
            "steps": steps, "clip": clip, **on}]
    for loop in loops:
        if loop == "unmanaged" and deepspeed_version and version_key(deepspeed_version) < version_key(UNMANAGED_SINCE):
            notes.append(f"unmanaged: left out, DeepSpeed {deepspeed_version} has no managed_gradient_accumulation "
                         f"(added in {UNMANAGED_SINCE}; older releases ignore the key silently)")
            continue
        for fix in (None, *known_fixes(cfg, loop)):
            out.append({"name": loop if fix is None else f"{loop} {fix}", "role": "measured" if fix is None else "fix",
                        "loop": loop, "fix": fix, "ga": n, "dtype": dtype, "judge_dtype": judge_dtype(cfg),
                        "zero_stage": stage, "steps": steps, "clip": clip, "ds_config": case_config(cfg, loop, fix),
                        **on})
    return out, notes


def model_keys(model) -> dict:
    """The case keys that name a model: ``{"model": name}`` for a registered shape (checked), the user's
    architecture's keys as they are."""
    if isinstance(model, dict):
        return dict(model)
    return {"model": shapes.get(model or shapes.DEFAULT).name}


def _annotate(recs: list[dict]) -> list[dict]:
    """Per record: ``matches`` (the named hypothesis the worst step is -- every rank's own accumulator's where the
    probe read them: under ZeRO the effective gradient mixes partitions stepped by different ranks), ``shape`` (the
    step in words, from its fitted weights), per step the same, and ``norm_verdict`` (the logged grad norm judged
    against the reference's, the worst step's); ``read_finding`` where the fp32 masters read through DeepSpeed's
    API disagreed with the weights the model uses."""
    for r in recs:
        oracle.annotate_steps(r)
        for s in r.get("steps") or [r]:
            per_rank = [b["hypotheses"] for b in s.get("rank_buffers") or []]
            if per_rank and s["matches"] in (None, "none"):
                names = {oracle.step_name(x) for x in per_rank}
                s["matches"] = names.pop() if len(names) == 1 else "none"
                s["ties"] = list(per_rank[0].get("ambiguous") or []) if len(names) == 0 or s["matches"] != "none" \
                    else []
        if r.get("steps"):
            r["matches"], r["ties"] = r["steps"][r["worst_step"]]["matches"], r["steps"][r["worst_step"]]["ties"]
            bad = [s for s in r["steps"] if not (s.get("read") or {}).get("masters_agree", True)]
            if bad:
                r["read_finding"] = (
                    f"the fp32 masters read through deepspeed.utils.safe_get_full_fp32_param disagree with the weights "
                    f"the model uses (max difference {max(s['read']['max_diff'] for s in bad):.3g}, steps "
                    f"{', '.join(str(s['step'] + 1) for s in bad)}): the read API misreports here; every step is "
                    "judged from the module's own weights")
        _floor(r)
    return recs


def _floor(r: dict) -> None:
    """A ``not-affected`` says the smallest misplaced weight it could have seen; where that is above what one lost
    micro-batch weighs (1 / (2 W N) of the step), it could not have seen one lost: ``inconclusive``."""
    if r.get("verdict") != oracle.NOT_AFFECTED or not r.get("metrics"):
        return
    seen = oracle.detectable_weight(records.judged(r))
    one = 1.0 / (2 * r["world_size"] * r["ga"])
    r["detectable_weight"] = seen
    if seen >= one:
        r["verdict"], r["below_floor"] = oracle.INCONCLUSIVE, True
        r["reason"] = (f"no signal is off, but the smallest misplaced weight this {r['dtype']} measurement can see "
                       f"({seen:.2g}) is above what one lost micro-batch weighs at W = {r['world_size']}, "
                       f"N = {r['ga']} ({one:.2g}): " + r["reason"])
    else:
        r["reason"] += f"; it would have seen a misplaced weight of {seen:.2g} (one lost micro-batch: {one:.2g})"


def run(cfg: Resolved, loops=LOOPS, world_size: int = 2, stack: dict | None = None, device: str = "cpu",
        timeout_s: float = kconfig.DEFAULT_TIMEOUT_S, steps: int = STEPS, model=None) -> list[dict]:
    """Every loop style of one resolved config in one world (with the control and the known fixes), on ``model``
    (``plan``)."""
    stack = dict(stack or {})
    kconfig.check_device(device)
    kconfig.check_world_size(world_size, device)
    kconfig.check_timeout(timeout_s)
    ds = stack.get("deepspeed") or versions.installed_version("deepspeed")
    cases, notes = plan(cfg, loops, ds, steps, model)
    meta = {"config_notes": list(cfg.notes) + notes, "resolved_config": dict(cfg), "step_count": steps}
    why = getattr(cfg, "refused", None)
    if dtype_of(cfg) == "fp16" and device == "cpu":  # said plainly, before anything launches
        why = ("fp16 cannot run here: DeepSpeed's CPU accelerator refuses it (\"Type fp16 is not supported on your "
               "device\"); run this check on a GPU (--device cuda)")
    if why:
        return records.failed_records(cases, {**meta, "bug": CHECK.id, "probe": CHECK.module, "world_size": world_size,
                                              "device": device, "stack": stack}, runner.stack_label(stack), why,
                                      versions={"deepspeed": ds, "torch": versions.installed_version("torch")})
    recs = runner.run(CHECK, cases, [stack], (world_size,), device, timeout_s, meta=meta)
    for r in recs:
        if r["verdict"] == oracle.CANNOT_RUN and "managed_gradient_accumulation" in (r.get("error") or ""):
            r["reason"] = f"not available: {r['error']}"
    return recs


CHECK = Probe(  # not registered (no ``PROBE`` name): the check and the sweep run it, the matrix does not
    id="CFG", title="a user's DeepSpeed config", module="ds_config", notebook="06_sweep.ipynb",
    measured_case="engine", ratio_meaning="effective / reference gradient of one step",
    advice="see `gradkit check` for the loop style and the fix", run=run,
    quick_plan=lambda w: {}, knobs={}, explorer_kwargs=lambda sel, d, t: {}, annotate=_annotate,
    control_key=lambda r: (r["ga"], r["config"].get("model"), bool(r["config"].get("model_config"))))


def load(path) -> dict:
    """A DeepSpeed JSON config from a file; ``ConfigError`` names what is wrong with it."""
    from pathlib import Path

    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise kconfig.ConfigError(f"cannot read {p}: {e.strerror or e}") from None
    try:
        return json.loads(text)
    except ValueError as e:
        raise kconfig.ConfigError(f"{p} is not valid JSON: {e}") from None
