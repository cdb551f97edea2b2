"""B2: with ``PipelineEngine`` and GA > 1, is each pipeline stage's gradient the mean over micro-batches?

The seed (``001``) saw the logged grad norm grow with GA at a constant global batch and
suspected "summed, not averaged". The probe runs a real ``deepspeed.pipe.PipelineModule``
(Linear/GELU layers, MSE loss) on ``STAGES`` stages x D data-parallel replicas and, for each
split of one global batch into micro-batch x GA, takes one ``train_batch`` step (SGD, lr=1).

Per stage, the effective gradient (the update of that stage's own parameters) is compared with
the fp32 reference for those parameters: the same layers as one plain module on the whole
global batch. Three named hypotheses per stage (``HYPOTHESES``): the mean over micro-batches
(correct), their sum (GA times too large: the seed's claim), and the mean divided by GA again
(a stage that scales an already-scaled gradient).

Cases (one world runs them all):

=================  ===========================================================  ==========
case               what                                                          role
=================  ===========================================================  ==========
pipeline           the split's micro-batch x GA (GA > 1), the engine as configured measured
loss_div_ga        the same, the loss function divided by GA (a user workaround)  workaround
control            the same dtype and ZeRO stage with GA=1 (one micro-batch)     control
=================  ===========================================================  ==========

What its ranks run is ``gradkit.probes.ranks.pipeline_ga``.
"""
from __future__ import annotations

from gradkit import config as kconfig
from gradkit.judge import oracle, records, tolerances
from gradkit.probes import runner, shared
from gradkit.probes.probe import Probe
from gradkit.probes.ranks.pipeline_ga import STAGES, STALE

BUG = "B2"
CASES = {
    "pipeline": {"role": "measured", "loss_div_ga": False},
    "loss_div_ga": {"role": "workaround", "loss_div_ga": True},
    "control": {"role": "control", "loss_div_ga": False},
}
PIPE_ZERO_STAGES = (0, 1)  # the pipeline engine refuses ZeRO-2/3


def plan(splits, dtypes=("fp32",), zero_stages=(0,), workaround: bool = True, hidden: int = 16,
         seed: int = 0) -> list[dict]:
    """Per dtype x ZeRO stage: the GA=1 control, then ``pipeline`` (and ``loss_div_ga``) for every split with GA > 1.

    The control is the same configuration with the whole per-replica batch in one micro-batch: nothing
    to accumulate, so if it is off the reference the pipeline is broken for another reason and every
    verdict of that configuration is ``inconclusive``.
    """
    totals = {mb * ga for mb, ga in splits}
    if len(totals) != 1:
        raise kconfig.ConfigError(f"the splits {splits} do not share one global batch per replica (micro_batch x GA)")
    total = totals.pop()
    common = {"hidden": hidden, "seed": seed}
    out = []
    for dtype in dtypes:
        for stage in zero_stages:
            cfg = {"dtype": dtype, "zero_stage": stage, **common}
            out.append({"name": "control", **CASES["control"], "micro_batch": total, "ga": 1, **cfg})
            for mb, ga in sorted(splits, key=lambda s: s[1]):
                if ga == 1:
                    continue
                for name in ("pipeline", "loss_div_ga") if workaround else ("pipeline",):
                    out.append({"name": name, **CASES[name], "micro_batch": mb, "ga": ga, **cfg})
    return out


def validate(world_sizes, splits, dtypes, zero_stages, versions, device: str, timeout_s: float,
             hidden: int = 16) -> None:
    """Every knob of the B2 notebook, checked before the first launch (``ConfigError`` says which)."""
    kconfig.check_device(device)
    for name, values in (("WORLD_SIZES", world_sizes), ("SPLITS", splits), ("DTYPES", dtypes),
                         ("ZERO_STAGES", zero_stages), ("VERSIONS", versions)):
        kconfig.check_list(name, values)
    for w in world_sizes:
        kconfig.check_world_size(w, device)
        if w % STAGES:
            raise kconfig.ConfigError(f"world size {w} is not a multiple of the {STAGES} pipeline stages")
    for split in splits:
        shared.check_split(split)
    for d in dtypes:
        kconfig.check_dtype(d)
    for s in zero_stages:
        kconfig.check_zero_stage(s)
        if s not in PIPE_ZERO_STAGES:
            raise kconfig.ConfigError(f"ZeRO stage {s} does not combine with pipeline parallelism "
                                      f"(DeepSpeed allows {PIPE_ZERO_STAGES})")
    for v in versions:
        kconfig.check_version(v)
    kconfig.check_timeout(timeout_s)
    kconfig.check_positive_int("hidden", hidden)
    plan(splits)


def check_notebook(p: dict) -> list:
    """Every parameter of notebook 02, by its name there (what the notebook and ``gradkit.notebooks.runall`` call
    first); returns the ``(probe, stack)`` pairs its worlds will run (``gradkit.stacks.prefetch``)."""
    validate(p["WORLD_SIZES"], p["SPLITS"], p["DTYPES"], p["ZERO_STAGES"], p["VERSIONS"], p["DEVICE"], p["TIMEOUT_S"],
             p["HIDDEN"])
    return [(PROBE, stack) for stack in runner.stacks_of(p["VERSIONS"])]


def annotate_record(rec: dict, control: dict | None) -> dict:
    """Each stage of each step judged on every signal against the control's same stage at the same step; the
    record takes its worst step's stages, and its verdict is the worst stage's there (``step``: which step).

    The whole-model numbers (``metrics``, ``attribution``) stay in the record as information: a stage
    that carries a small share of the norm can be off while the whole model looks right.
    """
    rec["affected_stages"] = []
    steps = rec.get("steps") or ([{"step": 0, "stages": rec["stages"]}] if rec.get("stages") else [])
    if rec.get("error") or not steps:
        return rec  # cannot-run (or no per-stage numbers): the whole-model verdict stands
    c_steps = (control or {}).get("steps") or ([control] if control else [])
    for i, st in enumerate(steps):
        c_step = c_steps[min(i, len(c_steps) - 1)] if c_steps else None
        st["verdict"], st["reason"] = _judge_stages(st["stages"], rec["dtype"], control, c_step)
    worst = min(range(len(steps)), key=lambda i: oracle.WORST_FIRST.index(steps[i]["verdict"]))
    rec["stages"], rec["worst_step"] = steps[worst]["stages"], worst
    rec["affected_stages"] = sorted({s["stage"] for st in steps for s in st["stages"] if s["verdict"] == oracle.AFFECTED})
    rec["whole_model_verdict"], rec["whole_model_reason"] = rec["verdict"], rec["reason"]
    where = f"step {worst + 1} of {len(steps)}, " if len(steps) > 1 else ""
    rec["verdict"], rec["reason"] = steps[worst]["verdict"], where + steps[worst]["reason"]
    # B2 is a question about one step's scaling: its table is judged on the first step (every later step also
    # carries whatever a step left behind, said apart in ``stale``)
    rec["first_step_verdict"] = steps[0]["verdict"]
    rec["stale"] = sorted({f"step {st['step'] + 1} stage {x['stage']}: {x['matches']}" for st in steps
                           for x in st["stages"] if str(x.get("matches", "")).endswith(STALE)})
    return rec


def _judge_stages(stages: list[dict], dtype: str, control: dict | None, c_step: dict | None) -> tuple[str, str]:
    """One step's stages judged against the control's same step (``matches``, ``verdict`` set on each); returns
    the worst stage's ``(verdict, "stage s: reason")``."""
    by_stage = {s["stage"]: s for s in (c_step or {}).get("stages") or []}
    for s in stages:
        h = s["hypotheses"]
        s["matches"] = h["best"] if h["best_matches"] else "none"
        c = by_stage.get(s["stage"])
        if control is None or c is None:
            c_judged = None if control is None else {"error": control.get("error") or f"no stage {s['stage']} ran"}
        else:
            c_judged = records.judged(c, control["dtype"])
        s["verdict"], s["reason"] = oracle.verdict(records.judged(s, dtype), c_judged)
    worst = min(stages, key=lambda s: oracle.WORST_FIRST.index(s["verdict"]))
    return worst["verdict"], f"stage {worst['stage']}: {worst['reason']}"


def run(world_sizes=(2,), splits=((8, 1), (4, 2), (2, 4), (1, 8)), dtypes=("fp32",), zero_stages=(0,),
        versions=("installed",), workaround: bool = True, hidden: int = 16, seed: int = 0, device: str = "cpu",
        timeout_s: float = kconfig.DEFAULT_TIMEOUT_S, stacks=None) -> list[dict]:
    """Every split x dtype x ZeRO stage under every DeepSpeed version (or ``stacks``) and world size; one world
    per ZeRO stage (a stage that breaks the engine cannot take the other down).

    Each record is judged against the GA=1 control of its own world, dtype and ZeRO stage (whole model),
    and carries ``stages``: per stage metrics, hypotheses, ``matches`` and ``verdict``.
    """
    stacks = runner.stacks_of(versions) if stacks is None else list(stacks)
    validate(world_sizes, splits, dtypes, zero_stages, runner.versions_of(stacks), device, timeout_s, hidden)
    todo = [c for z in zero_stages for c in plan(splits, dtypes, (z,), workaround, hidden, seed)]
    return runner.run(PROBE, todo, stacks, world_sizes, device, timeout_s,
                      meta={"pipeline_stages": STAGES, "seed": seed, "hidden": hidden})


def annotate_world(recs: list[dict]) -> list[dict]:
    controls = {(r["dtype"], r["zero_stage"]): r for r in recs if r["role"] == "control"}
    for r in recs:
        r["data_parallel"] = r["world_size"] // STAGES
    return [annotate_record(r, controls.get((r["dtype"], r["zero_stage"]))) for r in recs]


def explorer_kwargs(sel: dict, device: str, timeout_s: float) -> dict:
    return {"world_sizes": [sel["world_size"]], "splits": [[8 // sel["ga"], sel["ga"]]], "dtypes": [sel["dtype"]],
            "zero_stages": [sel["zero_stage"]], "versions": [sel["version"]], "device": device, "timeout_s": timeout_s}


def stage_rows(recs: list[dict], case: str = "pipeline") -> list[dict]:
    """One row per (record, pipeline stage) of ``case``: the numbers of the version table."""
    rows = []
    for r in recs:
        if r["case"] != case:
            continue
        base = {"deepspeed": r.get("versions", {}).get("deepspeed", r["version"]), "W": r["world_size"],
                "dtype": r["dtype"], "ZeRO": r["zero_stage"], "split": f"{r['config']['micro_batch']}x{r['ga']}"}
        if not r.get("stages"):
            rows.append({**base, "stage": "-", "verdict": r["verdict"]})
            continue
        for s in r["stages"]:
            rows.append({**base, "stage": s["stage"], "ratio": s["metrics"]["norm_ratio"],
                         "cosine": s["metrics"]["cosine"], "matches": s["matches"], "verdict": s["verdict"],
                         "ratio per step (* off)": stage_steps(r, s["stage"])})
    return rows


def stage_steps(rec: dict, stage: int) -> str:
    """A stage's ratio at every judged step of ``rec``, ``*`` where that stage was off at that step (the record's
    own numbers are its worst step's)."""
    out = []
    for st in rec.get("steps") or []:
        s = next((x for x in st.get("stages") or [] if x.get("stage") == stage), None)
        if s is not None:
            out.append(f"{s['metrics']['norm_ratio']:.3f}{'*' if s.get('verdict') == 'affected' else ''}")
    return " / ".join(out) or "-"


def config_verdicts(recs: list[dict]) -> dict:
    """B2's verdict per (version, W, dtype, ZeRO stage): the worst ``pipeline`` verdict over GA > 1.

    Returns ``{key: {"verdict", "affected_stages", "matches": {stage: [hypotheses]}, "reason"}}``.
    """
    out = {}
    for key, sel in records.group_by(recs, ("version", "world_size", "dtype", "zero_stage"), case="pipeline").items():
        worst = min(sel, key=lambda r: (oracle.WORST_FIRST.index(r["verdict"]), -r["ga"]))
        matches: dict = {}
        for r in sel:
            for s in r.get("stages") or []:
                if s["verdict"] == "affected":
                    matches.setdefault(s["stage"], set()).add(s["matches"])
        out[key] = {"verdict": worst["verdict"], "affected_stages": sorted(matches),
                    "matches": {k: sorted(v) for k, v in matches.items()},
                    "reason": f"{worst['config']['micro_batch']}x{worst['ga']}: {worst['reason']}"}
    return out


def stale_findings(recs: list[dict]) -> list[str]:
    """Every record whose later steps apply the previous step's gradient again (state not cleared after a step):
    not B2, and not an accumulation bug of one step; a finding, in words."""
    return [f"DeepSpeed {r.get('versions', {}).get('deepspeed', r['version'])} W={r['world_size']} {r['dtype']} "
            f"ZeRO-{r['zero_stage']} {r['config']['micro_batch']}x{r['ga']} {r['case']} ({r.get('optimizer')}): "
            + "; ".join(r["stale"]) for r in recs if r.get("stale")]


def _first_step(rec: dict) -> list[dict]:
    steps = rec.get("steps")
    return (steps[0]["stages"] if steps else rec.get("stages")) or []


def violations(recs: list[dict]) -> list[str]:
    """The claims the B2 notebook asserts, each broken one as a sentence (empty list: all hold).

    1. a control (GA=1) that ran matches the reference on every stage;
    2. every stage the engine got wrong is one of the named hypotheses ("sum (x GA)" or "mean / GA");
    3. data-parallel replicas of a stage applied identical updates;
    4. dividing the loss by GA scales every stage's update by exactly 1/GA (so it repairs an engine that
       sums on every stage, and breaks a correct one);
    5. what the user logs from inside the optimizer is the gradient that was applied (lr = 1).
    """
    bad = []
    ran = [r for r in recs if r["verdict"] != oracle.CANNOT_RUN]
    by_key = {(r["version"], r["world_size"], r["dtype"], r["zero_stage"], r["ga"], r["case"]): r for r in ran}
    for r in ran:
        where = (f"ds {r['version']} W={r['world_size']} {r['dtype']} ZeRO-{r['zero_stage']} "
                 f"{r['config']['micro_batch']}x{r['ga']} {r['case']}")
        steps = r.get("steps") or [r]
        off = [s for st in steps for s in st.get("stages") or [] if s["verdict"] != oracle.NOT_AFFECTED]
        if r["role"] == "control" and (off or r["verdict"] != oracle.NOT_AFFECTED) and not (
                off and all(str(s.get("matches", "")).endswith(STALE) for s in off)):  # stale: a finding, said
            bad.append(f"{where}: the GA=1 control is off the reference: {r['reason']}")
        for st in steps:
            at = f"{where} step {st.get('step', 0) + 1}"
            for s in st.get("stages") or []:
                if (r["role"] == "measured" and s["verdict"] == oracle.AFFECTED
                        and s["matches"] not in ("sum (x GA)", "mean / GA") and not s["matches"].endswith(STALE)):
                    bad.append(f"{at}: stage {s['stage']} is off the reference but matches no named hypothesis")
                spread = s["rank_spread"]["data-parallel replicas"]
                if spread > tolerances.tolerance(r["dtype"]).rank_spread:
                    bad.append(f"{at}: stage {s['stage']}'s data-parallel replicas applied different updates "
                               f"(spread {spread:.2e})")
            logged, applied = st.get("logged_grad_norm"), (st.get("metrics") or {}).get("effective_norm")
            if logged is not None and applied and abs(logged / applied - 1) > tolerances.tolerance(r["dtype"]).norm_ratio:
                bad.append(f"{at}: logged grad norm {logged:.5g} is not the applied gradient's {applied:.5g}")
        if r["case"] == "loss_div_ga":  # step 1 of both starts from the same weights (later ones need not)
            plain = by_key.get((r["version"], r["world_size"], r["dtype"], r["zero_stage"], r["ga"], "pipeline"))
            for s, p in zip(_first_step(r), _first_step(plain or {})):
                scaled = s["metrics"]["norm_ratio"] * r["ga"] / p["metrics"]["norm_ratio"]
                if abs(scaled - 1) > tolerances.tolerance(r["dtype"]).norm_ratio:
                    bad.append(f"{where}: stage {s['stage']}: loss / GA changed the update by {1 / scaled:.4g} / GA, not 1 / GA")
    return bad


PROBE = Probe(
    id=BUG, title="PipelineEngine with GA > 1", module="pipeline_ga", notebook="02_pipeline_ga.ipynb",
    measured_case="pipeline", ratio_meaning="effective / reference gradient of the pipeline stage furthest from 1",
    advice="on DeepSpeed <= 0.18.2 divide the pipeline loss by GA; on 0.18.3 - 0.19.2 do not (earlier stages are "
           "already divided twice): upgrade to >= 0.19.3 or train with GA = 1",
    run=run, check_notebook=check_notebook,
    quick_plan=lambda w: dict(world_sizes=(2,), splits=((8, 1), (1, 8)), dtypes=("fp32",), zero_stages=(0,),
                              workaround=False),
    knobs={"world_size": [2, 4], "ga": [4, 2, 8], "zero_stage": [0, 1], "dtype": ["fp32", "bf16"],
           "version": ["installed", "0.18.2", "0.18.6"]},
    explorer_kwargs=explorer_kwargs, typical_s=30.0, control_key=lambda r: (r["dtype"], r["zero_stage"]),
    world_key=lambda case: case["zero_stage"], annotate=annotate_world, violations=violations, order=2)
