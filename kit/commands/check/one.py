"""One config checked: every precision it could run in (``prepare``, before anything launches), each run on the
kit's model in one world with its control (``check``), a tie separated, and the verdict over the precisions by
``gradkit.judge.verdict.over_precisions``.

    todo = prepare(run, args, model, model_notes)     # {precision: resolved config}; ConfigError: exit 2
    result = check(run, todo, args, model)            # {"verdict", "exit", "precisions": {...}, "asked", ...}
"""
from __future__ import annotations

import re
import traceback

from gradkit import config as kconfig
import gradkit.commands.check.plan as plan
from gradkit.commands.check.summary import report, separate, summarise
from gradkit.judge import oracle
from gradkit.judge import verdict as kverdict
from gradkit.probes import ds_config, ds_features
from gradkit.shapes import hf
from gradkit.stacks import versions


# resolve's lines for the "auto" values a training config's framework has already filled (and said how)
FILLED_BY_FRAMEWORK = re.compile(r'^(gradient_accumulation_steps|gradient_clipping|bf16\.enabled|fp16\.enabled) "?auto"? ->')


def model_name(a) -> str:
    return a.model or "the MLP"


def _ga_of(run, a) -> tuple[int, bool]:
    """The GA to resolve ``"auto"`` with, and whether it is the run's own (a training config's) or ``--ga``."""
    if run.framework != "deepspeed" and run.ga is not None and a.ga_given is None:
        return run.ga, True
    return a.ga, False


def world_of(run, a) -> tuple[int, str]:
    """The ranks to check ``run`` with, and the line that says why: ``--world-size``; else the run's own (its training
    config or launch line), up to what this machine runs, where a bug's size depends on it (B4 leaks 1 / W of the
    boundary micro-batch, B3's and B12's steps keep 1 / (W N) of each); else 2, the smallest world a bug between
    ranks shows in."""
    limit = kconfig.max_world_size(a.device)
    if a.world_size:
        return a.world_size, (f"world size {run.world_size} (your run) -> {a.world_size} (--world-size)"
                              if run.world_size and run.world_size != a.world_size else
                              f"world size {a.world_size} (--world-size)")
    if not run.world_size:
        return 2, ("world size 2: your config does not say how many ranks your run has (the launcher does): 2 is the "
                   "smallest world a bug between ranks shows in; --world-size sets yours")
    if run.world_size <= limit:
        return run.world_size, f"world size {run.world_size}: your run's"
    return limit, (f"world size {run.world_size} (your run) -> {limit}: this machine runs at most {limit} ranks on "
                   f"{a.device}; every bug the kit knows shows at {limit}, and one whose size depends on the world (B4's "
                   f"leaked share, 1 / W) is measured at W = {limit}, not {run.world_size} (--device cuda on "
                   f"{run.world_size} GPUs runs yours)")


def prepare(run, a, model, model_notes: list) -> dict:
    """``{precision: resolved config}`` for one training run (``gradkit.frameworks.TrainingRun``): every precision it
    could run in (``--precision`` where given), resolved with the run's GA, micro-batch and clipping; an unknown
    loop style or a bad key is refused here, before any launch."""
    if a.deepspeed == kconfig.INSTALLED and versions.installed_version("deepspeed") == "absent":
        raise kconfig.ConfigError(
            f"{run.source} runs on DeepSpeed, which is not installed in this environment: install the release you "
            "train with, or name releases with --deepspeed (e.g. --deepspeed 0.19.8: installed into the kit's cache as "
            "an overlay, not into this environment)")
    user = run.ds_config or {}
    if ds_features.autotp_size(user) > 1 and not isinstance(model, dict):  # AutoTP needs a tensor-parallel policy
        model, built = hf.tiny_llama()
        model_notes = model_notes + built + [
            f"model: a tiny Llama (transformers' LlamaForCausalLM at toy size), not {model_name(a)}: AutoTP shards a "
            "model by its tensor-parallel policy, which the kit's shapes have none of; --model judges your "
            "architecture"]
    ga, ga_from_run = _ga_of(run, a)
    flag = a.precision
    dtypes = [flag] if flag else list(run.precisions) if run.framework != "deepspeed" else plan.precisions(user, None)
    todo = {}
    for dtype in dtypes:
        if plan.not_here(dtype, a.device):  # said by ``check``, never resolved
            todo[dtype] = None
            continue
        w, w_note = world_of(run, a)
        cfg = ds_config.resolve(user, w, ga, dtype, micro_batch=run.micro_batch,
                                max_grad_norm=run.max_grad_norm, ga_from_run=ga_from_run)
        said = [f"{run.framework}: {n}" for n in run.notes] if run.framework != "deepspeed" else []
        own = [n for n in cfg.notes if not (said and FILLED_BY_FRAMEWORK.match(n))]  # said once, by the framework
        cfg.notes = said + own + model_notes + [w_note]  # a bare config's own resolutions are resolve's lines
        cfg.world_size = w
        ds_config.plan(cfg, plan.loops_of(a.loop, run.loops), steps=a.steps, model=model)
        cfg.model = model  # the model it runs on (a tiny Llama for AutoTP)
        todo[ds_config.dtype_of(cfg)] = cfg  # named by what runs (a config that enables bf16 itself is bf16)
    return todo


def _failed(why: str) -> dict:
    return {"verdict": oracle.CANNOT_RUN, "exit": kverdict.EXIT[oracle.CANNOT_RUN], "loops": [], "control": None,
            "not_run": [], "error": why}


def check(run, todo: dict, a, model, say=print) -> dict:
    """Runs every precision of ``todo`` that this machine can run; says each report through ``say``."""
    loops = plan.loops_of(a.loop, run.loops)
    stack = {} if a.deepspeed == kconfig.INSTALLED else {"deepspeed": a.deepspeed}
    asked = plan.asked(run.ds_config or {}, run.precision if run.framework != "deepspeed" else None, a.precision)
    out, not_here, text = {}, {}, []
    if len(todo) > 1:
        text.append(f"{run.source}: the precision is not fixed ({'; '.join(_why_open(run))}): checking each it could "
                    f"resolve to ({', '.join(todo)})")
    for dtype, cfg in todo.items():
        why = plan.not_here(dtype, a.device)
        if why or cfg is None:
            not_here[dtype] = why
            out[dtype] = {"summary": _failed(why), "records": [], "not_here": why}
            text.append(f"{run.source} [{dtype}]: not run: {why}"
                        + ("" if dtype in asked else " (an \"auto\" could resolve to it: the exit status does not "
                                                     "count it)"))
            continue
        try:
            on = getattr(cfg, "model", model)

            w = cfg.world_size

            def go(c, ls):
                return ds_config.run(c, ls, w, stack, a.device, a.timeout, steps=a.steps, model=on)

            recs = go(cfg, loops)
            summary = summarise(recs)
            recs += separate(cfg, summary, go)
            text.append(report(recs, summary, run.source if len(todo) == 1 else f"{run.source} [{dtype}]",
                               w, a.device))
        except Exception as e:  # noqa: BLE001 - the kit's own failure is never a verdict on the user's config
            traceback.print_exc()
            text.append(f"internal error while checking {dtype}: {type(e).__name__}: {e} (nothing was measured: exit 3)")
            recs, summary = [], _failed(f"{type(e).__name__}: {e}")
        out[dtype] = {"summary": summary, "records": recs}
    verdicts = {d: o["summary"]["verdict"] for d, o in out.items()}
    worst = kverdict.over_precisions(verdicts, not_here, asked)
    if len(out) > 1:
        text.append("verdict over every precision: " + ", ".join(
            f"{d} {'not run here' if d in not_here else v}" for d, v in verdicts.items())
            + f" -> {worst} (exit {kverdict.EXIT[worst]})")
    for line in text:
        say(line)
    return {"source": run.source, "framework": run.framework, "loops": list(loops), "asked": sorted(asked),
            "precisions": out, "verdict": worst, "exit": kverdict.EXIT[worst]}


def _why_open(run) -> list[str]:
    """Why a run's precision is open, in words: the framework's own rule, or the config's ``"auto"``."""
    if run.framework != "deepspeed":
        return [n for n in run.notes if "auto" in n and ("bf16" in n or "fp16" in n)] or [
            f"{run.framework} decides it on the machine it runs on"]
    return ["\"auto\" in bf16/fp16.enabled: the Trainer's --bf16 / --fp16 decide; --precision fixes it"]
