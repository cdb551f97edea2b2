"""The check of a user's DeepSpeed config inside a rank (``gradkit.probes.ds_config``): the engine in each loop style on
a shape's tiny model (or the plain-torch control loop), every step judged (``common.judge_steps``) and explained by the
named hypotheses ``HYPOTHESES``, each rank's BF16_Optimizer accumulator read where there is one."""
from __future__ import annotations

import json

from gradkit import shapes
from gradkit.judge import naming, oracle
from gradkit.probes.ranks import common as c
from gradkit.probes.ranks import judging
from gradkit.probes.ranks.bf16_leak import bf16_accumulator

UNMANAGED_SINCE = "0.19.4"
HIDDEN, DEPTH, MICRO_BATCH, SEED = 32, 2, 4, 0
HYPOTHESES = ("global mean", "last micro-batch / N", "sum of micro-batches", "mean / N", "own rank's boundary micro-batch",
              "all but the first micro-batch", "first and last micro-batch")
STALE = "the previous step's gradient applied again"
FAULT_KEY = "gradkit_fault_kill_rank"  # a config key the kit reads, never DeepSpeed: that rank kills itself (tests)
STALE_FAULT_KEY = "gradkit_fault_keep_grads"  # tests: the plain-torch loop forgets zero_grad (a stale-state bug)
# tests: the plain-torch loop breaks a shape's parameters on purpose: "drop:<group>:<i>" (micro-batch i's gradient
# of that group lost), "train_frozen" (frozen weights trained), "untie" (the tied weight's head use not summed)
LOOP_FAULT_KEY = "gradkit_fault_loop"


UNSCALED = naming.UNSCALED  # B9: the optimizer unscales a loss the engine did not scale
SCALE_GREW = naming.SCALE_GREW  # B10: the scale grew between the backward and the unscale
CARRIED, OWN_PARTITION = naming.CARRIED, naming.OWN_PARTITION  # B11, B8: see ``stepwise_hypotheses``


def hypothesis_weights(w: int, n: int, own: int = 0, previous: bool = False, loss_scale: float = 1.0,
                       scale_change: float = 1.0) -> dict:
    """Weights over the rank-major basis (rank r, micro-batch i -> r*n + i), as seen from rank ``own``;
    ``previous``: the basis goes on with the previous step's micro-batches (weight 0 unless a hypothesis says).
    ``loss_scale``: the optimizer's own loss scale when it unscaled (an fp16 optimizer's ``cur_scale``); above 1,
    the step it gives when it divides by a scale the loss never got (``UNSCALED``) is a hypothesis too.
    ``scale_change``: the scale the step's losses got over the one it was unscaled by; where it is not 1 (the
    dynamic scaler moved in between), each named step as that leaves it is one too (``naming.grown``: the mean's,
    ``SCALE_GREW``, is B10 alone; another's is B10 on top of that step's bug)."""
    k = w * n
    last = [1.0 / k if i % n == n - 1 else 0.0 for i in range(k)]
    own_boundary = [(1.0 / n if i // n == own else 0.0) if i % n == n - 1 else 1.0 / k for i in range(k)]
    first_lost = [0.0 if i % n == 0 else 1.0 / k for i in range(k)]
    ends = [1.0 / k if i % n in (0, n - 1) else 0.0 for i in range(k)] if n > 2 else [0.0] * k  # n <= 2: the mean
    out = dict(zip(HYPOTHESES, ([1.0 / k] * k, last, [1.0 / w] * k, [1.0 / (k * n)] * k, own_boundary, first_lost,
                                ends)))
    out.update(naming.grown(out, scale_change))
    if previous:
        out[STALE] = [1.0 / k] * (2 * k)
    if loss_scale > 1.0:
        out[UNSCALED] = [1.0 / (k * loss_scale)] * k
    return out


def stepwise_hypotheses(w: int, n: int, update, stage, named: dict) -> dict:
    """The named steps no single weighting of the basis gives, each a function of it (``naming.explain``):
    ``CARRIED`` (B11: this step's micro-batches but each rank's first, plus ``update``, the update the previous step
    applied; from the second step) and, at ZeRO-1/2, ``OWN_PARTITION`` (B8: no all-reduce; rank r's partition of the
    flat parameters, split as ZeRO-1/2 split it, is the sum of rank r's own micro-batches, each divided by N), with
    each step of ``named`` as B8 leaves it (``naming.local``: B3's last micro-batch, each rank's own)."""
    k, out = w * n, {}
    if update is not None:
        lost_first = [0.0 if i % n == 0 else 1.0 / k for i in range(k)]
        out[CARRIED] = lambda b: b.new_tensor(lost_first) @ b[:k] + update
    if stage in (1, 2) and w > 1:
        def split(size):
            part = -(-size // (2 * w)) * 2  # the flat group padded to a multiple of 2 W, split evenly
            return [(r * part, min((r + 1) * part, size)) for r in range(w)]
        out.update(naming.local(named, w, n, split))
    return out


def own_loss_scale(optimizer) -> float:
    """An fp16 optimizer's own loss scale: its ``loss_scale`` property (FP16_(Unfused)Optimizer, every release), else
    ``cur_scale`` (older ones) or ``loss_scale_config.cur_scale`` (0.19); 1 where it has none (not a number)."""
    for get in (lambda o: o.loss_scale, lambda o: o.cur_scale, lambda o: o.loss_scale_config.cur_scale):
        try:
            value = float(get(optimizer))
        except (AttributeError, TypeError, ValueError):
            continue
        return value if value > 0 else 1.0
    return 1.0


OVERFLOW = 2.0 ** 24  # the factor on one micro-batch's loss that makes its fp16 gradient overflow at any loss scale


def overflowing(loss_fn):
    """``loss_fn`` whose first micro-batch's loss is multiplied by ``OVERFLOW`` (a ``gradkit check`` of a dynamic fp16
    scale puts one overflow in the judged steps: the scaler must skip that step on every rank, applying nothing)."""
    calls = []

    def fn(out, y):
        calls.append(1)
        return loss_fn(out, y) * (OVERFLOW if len(calls) == 1 else 1.0)
    return fn


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


MASTERS_STEP = 0.25  # low-precision masters: the first step's reference norm, as a share of the weights' norm


_SCALES: dict = {}  # loss_scale's answers in this rank: a warm world's cases (a folder's configs) ask the same again


def case_loss_scale(case: dict, w: int, n: int, clip: float, shape) -> float:
    """``loss_scale`` for ``case``, whose ``shape`` is ``shapes.of_case(case)``: computed once per rank for each shape
    (what ``of_case`` reads), world, GA, clip and masters (a whole reference gradient each time: 13 % of a folder's
    check)."""
    masters = case.get("masters_dtype", "fp32")
    if not clip and masters == "fp32":
        return 1.0
    key = json.dumps([case.get("model") or shapes.DEFAULT, case.get("model_config"), case.get("adapter_config"), w, n,
                      clip, masters], sort_keys=True, default=str)
    if key not in _SCALES:
        _SCALES[key] = loss_scale(w, n, clip, shape, masters)
    return _SCALES[key]


def loss_scale(w: int, n: int, clip: float, shape=None, masters_dtype: str = "fp32") -> float:
    """The factor every micro-batch's loss is multiplied by: 1 without clipping; with clipping, the one that puts
    the first step's reference norm at twice the clip, so the clip acts in every step (the kit's tiny model's
    gradients are far below a usual clip of 1.0). With bf16 / fp16 masters and no clip, the one that puts it at
    ``MASTERS_STEP`` of the weights' norm: a step read from rounded masters is known to within their rounding
    (2**-9 of the weights in bf16), so a step as small as the tiny model's own would be lost in it. The same on
    every rank (computed from the shared data)."""
    if not clip and masters_dtype == "fp32":
        return 1.0
    shape = shape or shapes.get(shapes.DEFAULT)
    every = [b for rr in range(w) for b in shape.micro_batches(SEED, rr, n, MICRO_BATCH, HIDDEN, 0)]
    model = shape.build(SEED, HIDDEN, DEPTH)
    _, _, reference = oracle.reference_gradients(model, every, shape.loss_fn)
    if clip:
        return 2.0 * clip / reference.norm().item()
    return MASTERS_STEP * c.flat_params(model).norm().item() / reference.norm().item()


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
        return judging.plain_read(self.model)

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


def allow_fp16_on_cpu() -> None:
    """DeepSpeed's CPU accelerator declares fp16 only where oneDNN has fp16 kernels (``is_fp16_supported``:
    AVX512-FP16 / AMX-FP16) and the engine refuses it elsewhere ("Type fp16 is not supported on your device");
    torch computes half on any CPU. Told fp16 is supported (``supported_dtypes`` follows), DeepSpeed's own fp16
    paths run here: the loss scaler, the overflow check, the fp16 optimizers and ZeRO's unscale-and-clip (none of
    them calls a CUDA-only op; streams are no-ops on CPU, so a bug of stream ordering cannot show here)."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu" and not accelerator.is_fp16_supported():
        accelerator.is_fp16_supported = lambda: True


def tp_size(case: dict) -> int:
    """The tensor-parallel degree a case's DeepSpeed config asks for (``tensor_parallel.autotp_size``; 1 without)."""
    if case.get("loop") == "torch":
        return 1
    tp = (case.get("ds_config") or {}).get("tensor_parallel") or {}
    return int(tp.get("autotp_size", tp.get("tp_size", 1)) or 1) if isinstance(tp, dict) else 1


# DeepSpeed's config models (pydantic) by title -> the config section each reads
SECTIONS = {"DeepSpeedFP16Config": "fp16", "DeepSpeedBF16Config": "bf16", "DeepSpeedZeroConfig": "zero_optimization",
            "DeepSpeedZeroOffloadOptimizerConfig": "zero_optimization.offload_optimizer",
            "DeepSpeedZeroOffloadParamConfig": "zero_optimization.offload_param"}
LOSS_SCALING = ("loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis", "consecutive_hysteresis",
                "initial_scale_power")  # dynamic loss scaling's knobs: one this release refuses is dropped and said


def _refused_keys(e: Exception) -> list[tuple[str, str, str]]:
    """``(section, key, why)`` for every key DeepSpeed's config parser refused in ``e`` that the kit may drop and
    still judge the same accumulation: a key this release does not know (``extra_forbidden``: an older release's
    or another tool's, e.g. apex's ``opt_level``) and a loss-scaling knob of a value it refuses; [] where any
    other error is in ``e`` (a refusal the kit must not paper over)."""
    section = SECTIONS.get(getattr(e, "title", None))
    if section is None or type(e).__name__ != "ValidationError" or not hasattr(e, "errors"):
        return []
    out = []
    for err in e.errors():
        key = err["loc"][0] if err.get("loc") else None
        if not isinstance(key, str) or not (err["type"] == "extra_forbidden" or key in LOSS_SCALING):
            return []
        out.append((section, key, err["msg"]))
    return out


def initialize_leniently(deepspeed, model, ds: dict):
    """``deepspeed.initialize`` with the kit's SGD; where this release's config parser refuses keys the kit may drop
    (``_refused_keys``), they are dropped and said: ``(engine, ["fp16.opt_level: Extra inputs are not permitted"])``."""
    stripped = []
    for _ in range(8):
        try:
            engine, *_ = deepspeed.initialize(model=model, optimizer=c.sgd(model), config=ds)
            return engine, stripped
        except Exception as e:  # noqa: BLE001 - only a parser's refusal of droppable keys is retried
            refused = _refused_keys(e)
            if not refused:
                raise
            for section, key, why in refused:
                node = ds
                for part in section.split("."):
                    node = node.get(part) or {}
                node.pop(key, None)
                stripped.append(f"{section}.{key}: {why}")
    raise RuntimeError(f"DeepSpeed kept refusing the config after dropping {stripped}")


class RefusedAsWritten(RuntimeError):
    """DeepSpeed refused the user's config as written too (its own sentence follows)."""


class RefusedAsRun(RuntimeError):
    """DeepSpeed refused the config the kit runs, and accepted the user's as written."""


REFUSED_AS_WRITTEN, REFUSED_AS_RUN = RefusedAsWritten.__name__, RefusedAsRun.__name__  # a result's error starts so
REFUSE_FAULT_KEY = "gradkit_fault_refuse"  # tests: the config the kit runs is one DeepSpeed refuses
FAULT_KEYS = (FAULT_KEY, STALE_FAULT_KEY, LOOP_FAULT_KEY, REFUSE_FAULT_KEY)  # the kit's own: never DeepSpeed's


def ask_as_written(deepspeed, case: dict, model, error: Exception) -> Exception:
    """After ``deepspeed.initialize`` refused the config the kit runs: the same call on the user's config as written
    (``ds_written``: only "auto", the batch sizes for this world and the optimizer resolved). Its refusal is
    DeepSpeed's (``REFUSED_AS_WRITTEN`` and DeepSpeed's own sentence); where it passes, the kit's change is to blame
    (``REFUSED_AS_RUN``). Without a config as written (a fix's re-run): ``error`` as it was."""
    written = case.get("ds_written")
    if not written:
        return error
    try:
        engine, *_ = deepspeed.initialize(model=model, optimizer=c.sgd(model), config={
            k: v for k, v in written.items() if k not in FAULT_KEYS})
    except Exception as e:  # noqa: BLE001 - DeepSpeed's own refusal of the user's config
        return RefusedAsWritten(f"{type(e).__name__}: {str(e)[:400]}")
    judging.release(engine)
    return RefusedAsRun(f"{type(error).__name__}: {str(error)[:400]}")


def run_case(case: dict) -> dict:
    import deepspeed

    r, w, n = c.rank(), c.world_size(), case["ga"]
    steps, clip = int(case.get("steps", 1)), float(case.get("clip") or 0.0)
    shape = shapes.of_case(case)
    tp = tp_size(case)  # AutoTP: the ranks of a tensor-parallel group feed the same micro-batches
    scale = case_loss_scale(case, w // tp, n, clip, shape)

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
        if case["dtype"] == "fp16" and c.device().type == "cpu":
            allow_fp16_on_cpu()
        ds = {k: v for k, v in cfg.items() if k not in FAULT_KEYS}
        if cfg.get(REFUSE_FAULT_KEY):  # tests: the kit's own change makes DeepSpeed refuse what the user wrote
            ds["zero_optimization"] = {**ds.get("zero_optimization", {}), "stage": 7}
        with judging.phase("initialize"):
            try:
                engine, stripped = initialize_leniently(deepspeed, model, ds)
            except Exception as e:  # noqa: BLE001 - whose refusal it is decides the sentence (ask_as_written)
                raise ask_as_written(deepspeed, case, shape.build(SEED, HIDDEN, DEPTH).to(dtype), e) from e
        if case["loop"] == "unmanaged" and not hasattr(engine, "managed_gradient_accumulation"):
            judging.release(engine)
            raise RuntimeError(f"this DeepSpeed has no managed_gradient_accumulation (added in {UNMANAGED_SINCE})")
    dev = c.device()
    held, scales = {}, {}  # held: BF16_Optimizer's own fp32 accumulator on this rank, going into the step

    def take(s, batches):
        overflow = s == case.get("overflow_step")
        if engine is None:
            if overflow:  # the control skips the step a loss scaler skips: nothing is applied
                scales[s] = (1.0, 1.0, True)
                return None, None
            return loop.step(batches, loss_fn), None
        held.clear()
        scale, skipped = own_loss_scale(engine.optimizer), int(getattr(engine, "skipped_steps", 0) or 0)
        _step(engine, case["fix"] if case.get("fix") == "fix:B3" else case["loop"],
              [(c.to_device(x, dev, dtype), y.to(dev)) for x, y in batches], overflowing(loss_fn) if overflow and
              r == 0 else loss_fn, before_step=lambda: held.update(buffer=bf16_accumulator(engine, engine.module)))
        scales[s] = (scale, own_loss_scale(engine.optimizer), int(getattr(engine, "skipped_steps", 0) or 0) > skipped)
        # a leak is per rank: every rank's accumulator (a collective), attributed on rank 0
        return c.engine_norm(engine), (c.all_gather_flat(held["buffer"]) if held.get("buffer") is not None else None)

    def accumulators(judged, s, buffers, basis, weights, reference):
        if buffers is not None:  # each rank's accumulator, attributed and explained from that rank's view
            judged["rank_buffers"] = [{"metrics": oracle.compare(b, reference),
                                       "attribution": oracle.attribute(b, basis, weights),
                                       "hypotheses": naming.explain(b, basis, hypothesis_weights(w, n, own=q),
                                                                    case["dtype"], reference)}
                                      for q, b in enumerate(buffers)]
            judged["rank_spread"]["fp32 accumulators"] = oracle.spread(buffers)

    def hypotheses(ws, ns, prev, update):  # the step just taken: the scale its losses got, the one it unscaled by
        before, after, _ = scales[max(scales)] if scales else (1.0, 1.0, False)
        out = hypothesis_weights(ws, ns, previous=prev, loss_scale=after, scale_change=before / after)
        if engine is not None:
            out.update(stepwise_hypotheses(ws, ns, update, case.get("zero_stage"), out))
        return out

    def facts(s):  # an fp16 step's loss scale and how it moved; skipped: the scaler found an overflow (applies nothing)
        before, after, skip = scales.get(s, (1.0, 1.0, False))
        return {**({"loss_scale": before, "loss_scale_after": after} if before != 1.0 or after != 1.0 else {}),
                **({"skipped": True} if skip else {})}

    reader = c.read_tp_weights if tp > 1 else (lambda m, d: c.read_weights(m, engine.optimizer, d))
    read = loop.read if engine is None else lambda: reader(engine.module, case.get("judge_dtype", case["dtype"]))
    out = judging.judge_steps(steps, read, take, seed=SEED, ga=n, micro_batch=MICRO_BATCH, hidden=HIDDEN, depth=DEPTH,
                        dtype=case.get("judge_dtype", case["dtype"]), clip=clip, loss_scale=scale, extra=accumulators,
                        hypotheses=hypotheses, facts=facts, shape=shape,
                        masters_dtype=case.get("masters_dtype", "fp32"), data_rank=r // tp, replicas=w // tp)
    engine_ga = n if engine is None else engine.gradient_accumulation_steps()
    optimizer = "torch.optim.SGD" if engine is None else type(engine.optimizer).__name__
    if engine is not None:
        with judging.phase("release"):
            judging.release(engine)
    return {**out, "optimizer": optimizer, "engine_ga": engine_ga, **({"replicas": w // tp} if tp > 1 else {}),
            "config_stripped": stripped if engine is not None else []} if r == 0 else {}


def run_rank(payload: dict) -> list[dict]:
    return judging.run_cases(payload, run_case)
