"""B3: with ``gradient_accumulation_steps: 1`` in the config and several manual ``backward()`` calls
before one ``step()``, which micro-batches' gradients reach the optimizer?

The seed (``002``) claims: every backward is an accumulation boundary, ZeRO-2 resets its
accumulator at each boundary, so only the last micro-batch survives; ZeRO-3 is unaffected.
The probe tests that for every ZeRO stage, fp32 and bf16, W ranks, N micro-batches.

Cases (one world runs them all, for every N):

==============  ======================================================================  ==========
case            loop                                                                    role
==============  ======================================================================  ==========
manual          config GA=1; ``backward(loss / N)`` N times, one ``step()``             measured
fix_boundary    the same + ``set_gradient_accumulation_boundary(i == N-1)`` first       fix
fix_config_ga   config GA=N; ``backward(loss)`` + ``step()`` per micro-batch (engine     fix
                divides by GA and steps at its own boundary)
fix_unmanaged   manual loop + config ``managed_gradient_accumulation: false``           fix
                (DeepSpeed >= 0.19.4; older releases ignore the key)
control         ZeRO-0 fp32, the ``fix_config_ga`` loop: the documented path             control
==============  ======================================================================  ==========

Per case, ``steps`` optimizer steps (``common.STEPS`` by default); for each, rank 0 compares the effective
gradient (SGD, lr=1, from the fp32 masters, cross-checked against the module's weights) with the oracle's reference
on the whole global batch from that step's starting weights, attributes it to the individual micro-batches (this
step's and the previous one's), and tests the named hypotheses ``HYPOTHESES`` ("global mean", "last micro-batch /
N", "sum of micro-batches"). The record is the worst step's, with every step in ``steps``. What its ranks run is
``gradkit.probes.ranks.zero_boundary`` (where ``HYPOTHESES`` are).
"""
from __future__ import annotations

from gradkit import config as kconfig
from gradkit.judge import naming, oracle, records, tolerances
from gradkit.probes import runner
from gradkit.probes.probe import Probe

BUG = "B3"
CASES = {
    "manual": {"role": "measured", "loop": "manual", "config_ga": "1", "managed": True},
    "fix_boundary": {"role": "fix", "loop": "boundary", "config_ga": "1", "managed": True},
    "fix_config_ga": {"role": "fix", "loop": "engine_ga", "config_ga": "N", "managed": True},
    "fix_unmanaged": {"role": "fix", "loop": "manual", "config_ga": "1", "managed": False},
    "control": {"role": "control", "loop": "engine_ga", "config_ga": "N", "managed": True,
                "zero_stage": 0, "dtype": "fp32"},
}
FIXES = ("fix_boundary", "fix_config_ga", "fix_unmanaged")
UNMANAGED_SINCE = "0.19.4"  # first DeepSpeed release with ``managed_gradient_accumulation``


def plan(n_values, stages=(0, 1, 2, 3), dtypes=("fp32", "bf16"), fixes=FIXES, fix_n_values=None,
         micro_batch: int = 4, hidden: int = 32, seed: int = 0) -> list[dict]:
    """Every case of one world: ``manual`` on the whole grid, the fixes at ``fix_n_values``, a control per N.

    ``ga`` in a case is N (the micro-batches per step), so every record of one N shares a control.
    """
    fix_n_values = n_values if fix_n_values is None else fix_n_values
    unknown = set(fixes) - set(FIXES)
    if unknown:
        raise kconfig.ConfigError(f"unknown B3 fix(es) {sorted(unknown)}; known: {list(FIXES)}")
    missing = set(fix_n_values) - set(n_values)
    if missing:
        raise kconfig.ConfigError(f"FIX_N_VALUES {sorted(missing)} are not in N_VALUES {list(n_values)}: "
                                  "a fix needs the control of the same N")
    common = {"micro_batch": micro_batch, "hidden": hidden, "seed": seed}
    out = []
    for n in n_values:
        out.append({"name": "control", **CASES["control"], "n": n, "ga": n, **common})
        for stage in stages:
            for dtype in dtypes:
                names = ("manual", *fixes) if n in fix_n_values else ("manual",)
                for name in names:
                    out.append({"name": name, **CASES[name], "zero_stage": stage, "dtype": dtype,
                                "n": n, "ga": n, **common})
    return out


def validate(world_sizes, n_values, stages, dtypes, versions, device: str, timeout_s: float, fix_n_values=(),
             micro_batch: int = 4, hidden: int = 32) -> None:
    """Every knob of the B3 notebook, checked before the first launch (``ConfigError`` says which)."""
    kconfig.check_device(device)
    for name, values in (("WORLD_SIZES", world_sizes), ("N_VALUES", n_values), ("ZERO_STAGES", stages),
                         ("DTYPES", dtypes), ("VERSIONS", versions)):
        kconfig.check_list(name, values)
    for w in world_sizes:
        kconfig.check_world_size(w, device)
    for n in (*n_values, *fix_n_values):
        kconfig.check_ga(n)
    for s in stages:
        kconfig.check_zero_stage(s)
    for d in dtypes:
        kconfig.check_dtype(d)
    for v in versions:
        kconfig.check_version(v)
    kconfig.check_timeout(timeout_s)
    kconfig.check_positive_int("micro_batch", micro_batch)
    kconfig.check_positive_int("hidden", hidden)


def check_notebook(p: dict) -> list:
    """Every parameter of notebook 03, by its name there (what the notebook and ``gradkit.notebooks.runall`` call
    first); returns the ``(probe, stack)`` pairs its worlds will run (``gradkit.stacks.prefetch``)."""
    kconfig.check_list("FIX_N_VALUES", p["FIX_N_VALUES"])
    validate(p["WORLD_SIZES"], p["N_VALUES"], p["ZERO_STAGES"], p["DTYPES"], p["VERSIONS"], p["DEVICE"], p["TIMEOUT_S"],
             p["FIX_N_VALUES"], p["MICRO_BATCH"], p["HIDDEN"])
    plan(p["N_VALUES"], fix_n_values=p["FIX_N_VALUES"])
    return [(PROBE, stack) for stack in runner.stacks_of(p["VERSIONS"])]


def _annotate(rec: dict) -> dict:
    """Name the hypothesis each step matches (the record's: its worst step's), and say when a fix was not really
    available."""
    naming.annotate_steps(rec)
    if rec["case"] == "fix_unmanaged" and rec.get("knows_unmanaged") is False:
        rec["reason"] += (f"; this DeepSpeed has no managed_gradient_accumulation (added in {UNMANAGED_SINCE}) "
                          "and silently ignores the key")
    return rec


def config_verdicts(recs: list[dict]) -> dict:
    """B3's verdict per (version, ZeRO stage, dtype, W): the worst ``manual`` verdict over N > 1.

    The same configuration with N = 1 (nothing to accumulate) is a second, config-specific control:
    if even that is off the reference, something other than the boundary reset is wrong with the
    configuration (seen on DeepSpeed 0.18.4, bf16 ZeRO-0: the update is 1/65536 of the gradient), so
    B3 cannot be judged there -> ``inconclusive`` (or ``cannot-run`` if it did not run).
    Returns ``{(version, stage, dtype, W): {"verdict", "reason", "matches", "ratio_at_max_n"}}``.
    """
    out = {}
    for key, sel in records.group_by(recs, ("version", "zero_stage", "dtype", "world_size"), case="manual").items():
        sel = sorted(sel, key=lambda r: r["ga"])
        base = next((r for r in sel if r["ga"] == 1), None)
        rest = [r for r in sel if r["ga"] > 1] or sel
        top = (rest[-1].get("metrics") or {}).get("norm_ratio")
        if base is not None and base["verdict"] != oracle.NOT_AFFECTED:
            word = oracle.CANNOT_RUN if base["verdict"] == oracle.CANNOT_RUN else oracle.INCONCLUSIVE
            out[key] = {"verdict": word, "matches": None, "ratio_at_max_n": top,
                        "reason": f"even N=1 (nothing to accumulate) is {base['verdict']}: {base['reason']}"}
            continue
        worst = min(rest, key=lambda r: oracle.WORST_FIRST.index(r["verdict"]))
        matches = sorted({r.get("matches") or "none" for r in rest if r["verdict"] == oracle.AFFECTED})
        out[key] = {"verdict": worst["verdict"], "matches": matches or None, "ratio_at_max_n": top,
                    "reason": f"N={worst['ga']}: {worst['reason']}"}
    return out


def annotate_configs(recs: list[dict]) -> list[dict]:
    """Give every ``manual`` record its configuration's verdict (``config_verdict``, ``config_reason``).

    What the overview's matrix and a notebook's table read: the verdict over N > 1 with N = 1 of the same
    configuration as a second control (``config_verdicts``), not the single record's own verdict.
    """
    cv = config_verdicts(recs)
    for r in recs:
        x = cv.get((r["version"], r["zero_stage"], r["dtype"], r["world_size"])) if r["case"] == "manual" else None
        if x is not None:
            r["config_verdict"], r["config_reason"] = x["verdict"], x["reason"]
    return recs


def violations(recs: list[dict]) -> list[str]:
    """The claims the B3 notebook asserts, each broken one as a sentence (empty list: all hold).

    1. every control matches the reference;
    2. where the boundary reset is measured (affected, while N=1 of the same config is fine), the
       effective gradient is one of the named hypotheses, not an unexplained mix;
    3. marking the boundary, and ``managed_gradient_accumulation: false`` where the release knows it,
       turn the manual loop into exactly what DeepSpeed's own GA loop gives (same verdict, ratio
       within the dtype's tolerance) -- whether or not that loop is itself right.
    """
    bad = []
    for r in recs:
        if r["role"] == "control" and r["verdict"] != oracle.NOT_AFFECTED:
            bad.append(f"control (W={r['world_size']}, N={r['ga']}, ds {r['version']}) is {r['verdict']}: {r['reason']}")
    cv = config_verdicts(recs)
    for r in recs:
        key = (r["version"], r["zero_stage"], r["dtype"], r["world_size"])
        where = f"ds {r['version']} ZeRO-{r['zero_stage']} {r['dtype']} W={r['world_size']} N={r['ga']} {r['case']}"
        if (r["case"] == "manual" and r["verdict"] == oracle.AFFECTED and key in cv
                and cv[key]["verdict"] == oracle.AFFECTED and r.get("matches") in (None, "none", "global mean")):
            bad.append(f"{where}: affected, but no named hypothesis explains the effective gradient")
        fixed = r["case"] == "fix_boundary" or (r["case"] == "fix_unmanaged" and r.get("knows_unmanaged"))
        if not fixed or r["verdict"] == oracle.CANNOT_RUN:
            continue
        own = [o for o in recs if o["case"] == "fix_config_ga" and o["ga"] == r["ga"]
               and (o["version"], o["zero_stage"], o["dtype"], o["world_size"]) == key]
        if not own or own[0]["verdict"] == oracle.CANNOT_RUN:
            continue
        a, b = r["metrics"], own[0]["metrics"]
        if r["verdict"] != own[0]["verdict"] or abs(a["norm_ratio"] - b["norm_ratio"]) > tolerances.tolerance(r["dtype"]).norm_ratio:
            bad.append(f"{where}: {r['verdict']} (ratio {a['norm_ratio']:.4f}) but DeepSpeed's own GA loop gives "
                       f"{own[0]['verdict']} (ratio {b['norm_ratio']:.4f})")
    return bad


def run(world_sizes=(2,), n_values=(1, 2, 4, 8), stages=(0, 1, 2, 3), dtypes=("fp32", "bf16"),
        versions=("installed",), fixes=FIXES, fix_n_values=None, micro_batch: int = 4, hidden: int = 32,
        seed: int = 0, device: str = "cpu", timeout_s: float = kconfig.DEFAULT_TIMEOUT_S, stacks=None) -> list[dict]:
    """Run the grid under every DeepSpeed version (or ``stacks``) and world size; one world each.

    Returns one record per case with its verdict (judged against the control of the same N and world),
    ``matches`` (the hypothesis the effective gradient is, or "none") and the attribution weights.
    """
    stacks = runner.stacks_of(versions) if stacks is None else list(stacks)
    fix_n_values = tuple(n_values) if fix_n_values is None else tuple(fix_n_values)
    validate(world_sizes, n_values, stages, dtypes, runner.versions_of(stacks), device, timeout_s, fix_n_values,
             micro_batch, hidden)
    todo = plan(n_values, stages, dtypes, fixes, fix_n_values, micro_batch, hidden, seed)
    return runner.run(PROBE, todo, stacks, world_sizes, device, timeout_s,
                      meta={"seed": seed, "micro_batch": micro_batch, "hidden": hidden})


def explorer_kwargs(sel: dict, device: str, timeout_s: float) -> dict:
    ga = sel["ga"]
    return {"world_sizes": [sel["world_size"]], "n_values": sorted({1, ga}), "stages": [sel["zero_stage"]],
            "dtypes": [sel["dtype"]], "versions": [sel["version"]], "fixes": ["fix_boundary"], "fix_n_values": [ga],
            "device": device, "timeout_s": timeout_s}


PROBE = Probe(
    id=BUG, title="ZeRO-1/2, config GA = 1, several backward() per step()", module="zero_boundary",
    notebook="03_zero_boundary.ipynb", measured_case="manual", verdict_key="config_verdict",
    ratio_meaning="effective / reference gradient (the last micro-batch / N survives)",
    advice="call engine.set_gradient_accumulation_boundary(i == N - 1) before each backward, or put the real N in "
           "gradient_accumulation_steps and step after every backward; from 0.19.4 "
           "\"managed_gradient_accumulation\": false also works",
    run=run, check_notebook=check_notebook,
    quick_plan=lambda w: dict(world_sizes=(w,), n_values=(1, 4), stages=(0, 1, 2, 3), dtypes=("fp32",),
                              fixes=("fix_boundary",), fix_n_values=(4,)),
    knobs={"world_size": [2, 1, 3, 4], "ga": [4, 2, 8], "zero_stage": [2, 0, 1, 3], "dtype": ["fp32", "bf16"],
           "version": ["installed", "0.18.6"]},
    explorer_kwargs=explorer_kwargs, typical_s=15.0,
    annotate=lambda recs: annotate_configs([_annotate(r) for r in recs]), violations=violations, order=3)
