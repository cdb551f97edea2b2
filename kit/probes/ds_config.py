"""A user's DeepSpeed config, judged on the kit's tiny model: does every step apply the mean gradient?

    cfg = ds_config.resolve(json.load(open("ds_config.json")), world_size=2)   # "auto" resolved, notes kept
    recs = ds_config.run(cfg, loops=LOOPS, world_size=2)                    # one world, every loop style

The config runs as ``resolve`` made it (``gradkit.probes.ds_resolve``: what is kept, what is replaced and why, in its
notes; ``resolve`` and ``load`` are reached through this module). Each case takes ``steps`` optimizer steps, each
judged against the reference from that step's own starting weights (the module's weights, cross-checked against the
fp32 masters), with the previous step's micro-batches in the basis of its fitted weights; what the ranks run is
``gradkit.probes.ranks.ds_config``.

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

from gradkit import config as kconfig
from gradkit import launch
from gradkit import shapes
from gradkit.judge import naming, oracle, records, tolerances
from gradkit.probes import ds_features, runner
from gradkit.probes.ds_resolve import Resolved, dynamic_scale, load, resolve  # noqa: F401 - read and resolved here too
from gradkit.probes.probe import Probe
from gradkit.probes.ranks.ds_config import MASTERS_STEP, OVERFLOW, REFUSED_AS_RUN, REFUSED_AS_WRITTEN, UNMANAGED_SINCE
from gradkit.stacks import versions
from gradkit.stacks.versions import version_key

LOOPS = ("engine", "boundary", "manual", "unmanaged")
STEPS = 3  # optimizer steps per check or sweep point, each judged
DYNAMIC_STEPS = 6  # ... with a dynamic fp16 loss scale: an overflow, then two of its windows
OVERFLOW_STEP = 1  # the step (from 0) a dynamic fp16 scale is made to overflow
FIX_SCALE = 256.0  # B10's fix re-run: a static loss scale


def dtype_of(cfg: dict) -> str:
    return "bf16" if cfg.get("bf16", {}).get("enabled") else "fp16" if cfg.get("fp16", {}).get("enabled") else "fp32"


_COARSENESS = ("fp32", "fp16", "bf16")  # finest to coarsest significand


def _passes_through(cfg: dict) -> dict:
    """``{key that chose it: dtype}``: every precision a gradient of ``cfg`` passes through."""
    out = {"the model": dtype_of(cfg), "communication_data_type": str(cfg.get("communication_data_type") or ""),
           "data_types.grad_accum_dtype": str((cfg.get("data_types") or {}).get("grad_accum_dtype") or "")}
    for name in ("bf16", "fp16"):  # read by ZeRO whether or not the section is enabled (deepspeed/runtime/config.py)
        if (cfg.get(name) or {}).get(f"{name}_master_weights_and_grads"):
            out[f"{name}.{name}_master_weights_and_grads"] = name
    return {k: v for k, v in out.items() if v in _COARSENESS}


def masters_dtype(cfg: dict) -> str:
    """The precision of the masters the optimizer steps (fp32 unless ``bf16_master_weights_and_grads`` /
    ``fp16_master_weights_and_grads``)."""
    return next((n for n in ("bf16", "fp16") if (cfg.get(n) or {}).get(f"{n}_master_weights_and_grads")), "fp32")


def judge_dtype(cfg: dict) -> str:
    """The precision a step of ``cfg`` is judged at: the coarsest its gradient passes through -- the model's, the
    reduction's (``communication_data_type``), the accumulator's (``data_types.grad_accum_dtype``) and the masters'
    (``bf16_master_weights_and_grads``: gradients and masters in bf16, even where bf16 itself is off). An fp32
    model reduced in bf16 carries bf16's rounding by design: judged at fp32's limits it would be called affected."""
    return max(_passes_through(cfg).values(), key=_COARSENESS.index)


def judge_note(cfg: dict) -> str | None:
    """The line that says why a config is judged at a coarser precision than its model's, with the limits."""
    seen, model = _passes_through(cfg), dtype_of(cfg)
    coarse = judge_dtype(cfg)
    if coarse == model:
        return None
    why = [k for k, v in seen.items() if v == coarse]
    t = tolerances.tolerance(coarse)
    return (f"judged at {coarse}'s limits (rel. error {t.rel_l2:g}, misplaced weight {t.misplaced_weight:g}): "
            f"{' and '.join(why)} {'puts' if len(why) == 1 else 'put'} the gradient through {coarse}, whose rounding "
            f"a correct step carries by design")


def known_fixes(cfg: dict, loop: str) -> list[str]:
    """The known bugs' fixes worth a re-run for this config and loop (cheap: one more case each)."""
    out = []
    if loop == "manual" and cfg["zero_optimization"]["stage"] in (1, 2):
        out.append("fix:B3")
    if (dtype_of(cfg) == "bf16" and cfg.get("data_types", {}).get("grad_accum_dtype") == "fp32"
            and not cfg["bf16"].get("immediate_grad_update", False)):
        out.append("fix:B4")
    if dynamic_scale(cfg):
        out.append("fix:B10")
    return out


def with_ga(cfg: Resolved, n: int, why: str) -> Resolved:
    """The same resolved config at ``n`` micro-batches per step (train batch size to match), ``why`` in its notes."""
    out = Resolved(copy.deepcopy(dict(cfg)))
    mb, w = out["train_micro_batch_size_per_gpu"], out["train_batch_size"] // (
        out["train_micro_batch_size_per_gpu"] * out["gradient_accumulation_steps"])
    out.update(gradient_accumulation_steps=n, train_batch_size=mb * n * w)
    out.notes, out.refused = list(cfg.notes) + [f"gradient_accumulation_steps {cfg['gradient_accumulation_steps']} "
                                                f"-> {n} ({why})"], cfg.refused
    if cfg.as_written is not None:
        out.as_written = {**cfg.as_written, "gradient_accumulation_steps": n, "train_batch_size": mb * n * w}
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
    if fix == "fix:B10":  # a static scale, which never moves (2**8: the kit's model's gradients never overflow at it)
        out["fp16"] = {**out["fp16"], "loss_scale": FIX_SCALE}
    return out


def plan(cfg: Resolved, loops=LOOPS, deepspeed_version: str | None = None, steps: int = STEPS, model=None
         ) -> tuple[list[dict], list[str]]:
    """The cases of one check (the control first) and a note per loop style left out; each case takes ``steps``
    optimizer steps, each judged, on ``model``: a shape's name (``gradkit.shapes``; the MLP by default) or the
    user's architecture (``{"model_config": ..., "adapter_config": ...}`` from ``gradkit.shapes.user_model``)."""
    unknown = sorted(set(loops) - set(LOOPS))
    if unknown or not loops:
        raise kconfig.ConfigError(f"unknown loop style(s) {unknown or loops}; known: {', '.join(LOOPS)} (or all)")
    kconfig.check_positive_int("steps", steps)
    n, dtype, notes = cfg["gradient_accumulation_steps"], dtype_of(cfg), []
    overflow = {}
    if dynamic_scale(cfg):
        # a scale above 2**16 overflows the kit's model and halves once a step until it does not: one more step each
        want = DYNAMIC_STEPS + max(0, int(cfg["fp16"].get("initial_scale_power", 16)) - 16)
        if steps < want:
            notes.append(f"{want} steps judged, not {steps}: the dynamic fp16 loss scale moves every "
                         f"{cfg['fp16'].get('loss_scale_window')} steps or on an overflow (and halves once a step from "
                         f"2^{cfg['fp16'].get('initial_scale_power', 16)} while it overflows), and each of its moves is "
                         "judged")
            steps = want
        overflow = {"overflow_step": OVERFLOW_STEP}
        notes.append(f"step {OVERFLOW_STEP + 1} overflows on purpose: rank 0's first micro-batch has its loss x "
                     f"{OVERFLOW:.3g}, so DeepSpeed's loss scaler must skip that step on every rank and apply nothing "
                     "(said as skipped; the control skips it too); the steps after it show whether the skip left "
                     "anything behind")
    stage, clip = cfg["zero_optimization"]["stage"], cfg.get("gradient_clipping", 0.0)
    on = model_keys(model)
    written = getattr(cfg, "as_written", None)  # a plain dict (the tests') has none
    coarser = judge_note(cfg)
    if coarser:
        notes.append(coarser)
    if masters_dtype(cfg) != "fp32" and not clip:
        notes.append(f"{masters_dtype(cfg)} masters ({masters_dtype(cfg)}_master_weights_and_grads): every loss is "
                     f"scaled so the first step is {MASTERS_STEP:g} of the weights' norm, since a step read from "
                     f"{masters_dtype(cfg)} masters is known only to within their rounding (said as the read floor)")
    out = [{"name": "control", "role": "control", "loop": "torch", "ga": n, "dtype": "fp32", "zero_stage": None,
            "steps": steps, "clip": clip, **overflow, **on}]
    for loop in loops:
        if loop == "unmanaged" and deepspeed_version and version_key(deepspeed_version) < version_key(UNMANAGED_SINCE):
            notes.append(f"unmanaged: left out, DeepSpeed {deepspeed_version} has no managed_gradient_accumulation "
                         f"(added in {UNMANAGED_SINCE}; older releases ignore the key silently)")
            continue
        for fix in (None, *known_fixes(cfg, loop)):
            out.append({"name": loop if fix is None else f"{loop} {fix}", "role": "measured" if fix is None else "fix",
                        "loop": loop, "fix": fix, "ga": n, "dtype": dtype, "judge_dtype": judge_dtype(cfg),
                        "masters_dtype": masters_dtype(cfg),
                        "zero_stage": stage, "steps": steps, "clip": clip, "ds_config": case_config(cfg, loop, fix),
                        **({"ds_written": written} if fix is None and written else {}),
                        **(overflow if fix != "fix:B10" else {}), **on})
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
        naming.annotate_steps(r)
        for s in r.get("steps") or [r]:
            per_rank = [b["hypotheses"] for b in s.get("rank_buffers") or []]
            if per_rank and s["matches"] in (None, "none"):
                names = {naming.step_name(x) for x in per_rank}
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
        judge_floor(r)
    return recs


def judge_floor(r: dict) -> None:
    """A ``not-affected`` says the smallest misplaced weight it could have seen; where that is above what one lost
    micro-batch weighs (1 / (2 W N) of the step), it could not have seen one lost: ``inconclusive``."""
    if r.get("verdict") != oracle.NOT_AFFECTED or not r.get("metrics"):
        return
    seen = oracle.detectable_weight(records.judged(r))
    one = 1.0 / (2 * (r.get("replicas") or r["world_size"]) * r["ga"])
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
    meta = {"config_notes": list(cfg.notes) + notes, "resolved_config": dict(cfg), "step_count": cases[0]["steps"]}
    # the ranks do it (gradkit.probes.ranks.ds_config.allow_fp16_on_cpu)
    if dtype_of(cfg) == "fp16" and device == "cpu":
        meta["config_notes"].append("fp16 judged on CPU: DeepSpeed's CPU accelerator is told fp16 is supported (torch "
                                    "computes half on any CPU); DeepSpeed's own fp16 code runs: loss scaling, the "
                                    "overflow check, the fp16 optimizers")
    why = getattr(cfg, "refused", None)
    if why:
        return records.failed_records(cases, {**meta, "bug": CHECK.id, "probe": CHECK.module, "world_size": world_size,
                                              "device": device, "stack": stack}, runner.stack_label(stack), why,
                                      versions={"deepspeed": ds, "torch": versions.installed_version("torch")})
    recs = runner.run(CHECK, cases, [stack], (world_size,), device, timeout_s, meta=meta)
    if ds_features.autotp_size(cfg) > 1:  # its ranks now hold DeepSpeed's tensor-parallel groups (global state)
        launch.stop_warm_worlds(servers=False)  # that the next config's engines must not inherit: fresh ranks
    stripped = sorted({k for r in recs for k in r.get("config_stripped") or []})
    if stripped:
        v = next((r["versions"]["deepspeed"] for r in recs if (r.get("versions") or {}).get("deepspeed")), ds)
        for r in recs:
            r["config_notes"] = list(r.get("config_notes") or []) + [
                f"DeepSpeed {v} refuses {'; '.join(stripped)}: dropped to judge the rest (the kit's SGD does not read "
                f"an optimizer's keys; a refused loss-scaling knob takes DeepSpeed's default); a run of this config on "
                f"{v} stops in deepspeed.initialize until they are removed"]
    for r in recs:
        if r["verdict"] == oracle.CANNOT_RUN and "managed_gradient_accumulation" in (r.get("error") or ""):
            r["reason"] = f"not available: {r['error']}"
        elif r["verdict"] == oracle.CANNOT_RUN and "not been implemented on CPU" in str(r.get("error")):
            zpp = [k for k in ("zero_quantized_weights", "zero_quantized_gradients", "zero_hpz_partition_size")
                   if (cfg.get("zero_optimization") or {}).get(k)]
            r["reason"] = (f"DeepSpeed runs an op with no CPU implementation here ({r['error']})"
                           + (f": {', '.join(zpp)} (ZeRO++) quantize with CUDA kernels" if zpp else "")
                           + "; check it on a GPU (--device cuda)" + (f", or without {', '.join(zpp)} to judge the "
                                                                       "rest here" if zpp else ""))
        elif r["verdict"] == oracle.CANNOT_RUN and r.get("failed_in") == "initialize":
            v = (r.get("versions") or {}).get("deepspeed", ds)
            error = str(r.get("error"))
            if error.startswith(f"{REFUSED_AS_WRITTEN}: "):  # the ranks handed DeepSpeed the config as written too
                r["reason"] = (f"DeepSpeed {v} refuses this config itself, as written (a run of it on this release "
                               f"stops there too): {error.split(': ', 1)[1]}")
            else:
                passed = error.startswith(f"{REFUSED_AS_RUN}: ")
                r["reason"] = (f"DeepSpeed {v} refuses this config as the kit runs it, in deepspeed.initialize"
                               + (" (the config as written passes it: the kit's change is to blame)" if passed else "")
                               + f": {error.split(': ', 1)[1] if passed else error}")
    return recs


CHECK = Probe(  # not registered (no ``PROBE`` name): the check and the sweep run it, the matrix does not
    id="CFG", title="a user's DeepSpeed config", module="ds_config", notebook="06_sweep.ipynb",
    measured_case="engine", ratio_meaning="effective / reference gradient of one step",
    advice="see `gradkit check` for the loop style and the fix", run=run,
    quick_plan=lambda w: {}, knobs={}, explorer_kwargs=lambda sel, d, t: {}, annotate=_annotate,
    control_key=lambda r: (r["ga"], r["config"].get("model"), bool(r["config"].get("model_config"))))
