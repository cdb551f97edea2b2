"""One release's result: ``gradkit check``'s probe (``measure_with``) or any registered probe (``probe_measure``)
run on that release, one world, and what it gave: the verdict, the step in words, the ratio of every step
(``result_of``); what a change is a change of (``same``: the verdict, the named step, or the measured step beyond
the dtype's tolerance); results that do not count (``SKIPPED``)."""
from __future__ import annotations

import math

from gradkit import config as kconfig
from gradkit.commands import check
from gradkit.commands.bisect.listing import PACKAGE, stack_of
from gradkit.judge import oracle
from gradkit.judge.tolerances import TOLERANCES
from gradkit.probes import ds_config
from gradkit.stacks import versions

SKIPPED = (oracle.CANNOT_RUN, oracle.INCONCLUSIVE)


def result_of(summary: dict, loop: str, release: str, recs: list[dict]) -> dict:
    """One release's result for the bisect: verdict, the step in words, the ratio of every step."""
    row = next((r for r in summary["loops"] if r["loop"] == loop), None)
    if row is None:
        return {"release": release, "verdict": oracle.CANNOT_RUN, "step": None, "ratios": [],
                "reason": f"the loop {loop!r} did not run"}
    step = "global mean"
    if row["verdict"] == oracle.AFFECTED:
        if row.get("ties"):
            step = "ambiguous between " + " and ".join(f"'{t}'" for t in row["ties"])
        elif row.get("matches") not in (None, "none"):
            step = row["matches"]
        else:
            step = row.get("shape") or "off, not named"
    measured = [r for r in recs if r.get("role") == "measured"]
    optimizer = next((r.get("optimizer") for r in measured if r.get("optimizer")), None)
    dtype = next((r.get("judge_dtype") or r.get("dtype") for r in measured if r.get("judge_dtype") or r.get("dtype")),
                 "fp32")
    return {"release": release, "verdict": row["verdict"], "step": step if row["verdict"] == oracle.AFFECTED else None,
            "ratios": [s["ratio"] for s in row["steps"]], "cosine": row.get("cosine"), "dtype": dtype,
            "misplaced_weight": row.get("misplaced_weight"), "explained_by": row.get("explained_by"),
            "optimizer": optimizer, "reason": row.get("reason") if row["verdict"] in SKIPPED else None,
            "control": (summary.get("control") or {}).get("verdict")}


def measure_with(cfg, loop: str, world_size: int, device: str, timeout_s: float, steps: int, model=None,
                 fixed: dict | None = None):
    """``measure(release) -> result``: the check's probe on that release, one world (``fixed``: other packages'
    releases held in every stack)."""
    def measure(release: str) -> dict:
        stack = {**(fixed or {}), **stack_of(release)}
        try:
            recs = ds_config.run(cfg, (loop,), world_size, stack, device, timeout_s, steps=steps, model=model)
        except versions.CannotRun as e:
            return {"release": release, "verdict": oracle.CANNOT_RUN, "step": None, "ratios": [], "reason": e.reason}
        return result_of(check.summarise(recs), loop, release, recs)

    return measure


def step_words(rec: dict) -> str | None:
    """A probe record's step in words: per stage for a pipeline (``stage 0: sum (x GA); stage 1: ...``), else the
    named hypothesis it matches."""
    if rec.get("stages"):
        return "; ".join(f"stage {s['stage']}: {s.get('matches')}" for s in rec["stages"])
    return rec.get("matches") or rec.get("shape") or "off (this probe names no step)"


def probe_measure(probe, run_kwargs: dict, case: str, axis: str = PACKAGE, words=step_words, fixed: dict | None = None):
    """``measure(release)`` for any registered probe (``gradkit.probes``): ``probe.run(**run_kwargs)`` on a stack
    holding that release of ``axis`` (``deepspeed``, ``transformers`` or ``accelerate``: a package the probe's stack
    names), judged on its record of ``case`` by the probe's own verdict. This is how the known bugs' boundaries
    are found with their own probes (B2's pipeline, B1's Trainer), as the check's probe finds a config's. ``fixed``:
    other packages' releases held in every stack (B1's DeepSpeed side: transformers 5.3.0 throughout)."""
    if axis not in probe.packages:
        raise kconfig.ConfigError(f"the {probe.id} probe's stack names {list(probe.packages)}, not {axis!r}")

    def measure(release: str) -> dict:
        stack = {**(fixed or {}), **stack_of(release, axis)}
        try:
            recs = probe.run(**run_kwargs, stacks=[stack])
        except versions.CannotRun as e:
            return {"release": release, "verdict": oracle.CANNOT_RUN, "step": None, "ratios": [], "reason": e.reason}
        mine = [r for r in recs if r.get("case") == case]
        if not mine:
            return {"release": release, "verdict": oracle.CANNOT_RUN, "step": None, "ratios": [],
                    "reason": f"the probe gave no record of the case {case!r}"}
        verdicts = [r.get(probe.verdict_key, r["verdict"]) for r in mine]  # the case's worst configuration
        verdict = min(verdicts, key=lambda v: oracle.WORST_FIRST.index(v) if v in oracle.WORST_FIRST else 99)
        worst = [r for r, v in zip(mine, verdicts) if v == verdict]
        rec = worst[0]
        steps = sorted({str(words(r)) for r in worst}) if verdict == oracle.AFFECTED else []
        metrics = [st.get("metrics") or {} for st in rec.get("steps") or [rec]]
        return {"release": release, "verdict": verdict, "step": "; ".join(steps) or None,
                "ratios": [m.get("norm_ratio") for m in metrics],
                "cosine": min((m["cosine"] for m in metrics if isinstance(m.get("cosine"), (int, float))), default=None),
                "misplaced_weight": (rec.get("attribution") or {}).get("misplaced_weight"),
                "dtype": rec.get("judge_dtype") or rec.get("dtype") or "fp32",
                "reason": rec.get(probe.reason_key()) if verdict in SKIPPED else None, "optimizer": rec.get("optimizer")}

    return measure


def differences(a: dict, b: dict) -> list[str]:
    """How two results differ, in words ([] where they are the same): the verdict, the named step, or the measured
    step itself -- a step's norm ratio, the cosine or the misplaced weight -- by more than the coarser dtype's
    tolerance (``gradkit.judge.tolerances``). So a probe that names no step still changes where its step does (B1's
    ratio 0.227 becoming 0.908, both affected), while two runs of one release, which differ by rounding, are the same."""
    if a["verdict"] != b["verdict"]:
        return [f"verdict {a['verdict']} -> {b['verdict']}"]
    if a["verdict"] in SKIPPED:
        return []
    out = [] if a.get("step") == b.get("step") else [f"step '{a.get('step')}' -> '{b.get('step')}'"]
    tol = max((TOLERANCES.get(x.get("dtype") or "fp32", TOLERANCES["fp32"]) for x in (a, b)),
              key=lambda t: t.norm_ratio)
    ra, rb = a.get("ratios") or [], b.get("ratios") or []
    for i, (x, y) in enumerate(zip(ra, rb)):
        if _apart(x, y, tol.norm_ratio * max(1.0, abs(x or 0), abs(y or 0))):
            out.append(f"ratio of step {i + 1} {_num(x)} -> {_num(y)}")
    if len(ra) != len(rb):
        out.append(f"{len(ra)} judged steps -> {len(rb)}")
    if _apart(a.get("cosine"), b.get("cosine"), tol.rel_l2):
        out.append(f"cosine {_num(a.get('cosine'), 5)} -> {_num(b.get('cosine'), 5)}")
    if _apart(a.get("misplaced_weight"), b.get("misplaced_weight"), tol.misplaced_weight):
        out.append(f"misplaced weight {_num(a.get('misplaced_weight'))} -> {_num(b.get('misplaced_weight'))}")
    return out


def same(a: dict, b: dict) -> bool:
    """Two results are the same measurement (``differences`` finds nothing): what a change is a change of."""
    return not differences(a, b)


def _apart(x, y, limit: float) -> bool:
    """Two measured numbers differ by more than ``limit`` (one missing, or one not finite and the other finite,
    differ; two missing do not)."""
    nums = [v for v in (x, y) if isinstance(v, (int, float))]
    if len(nums) != 2:
        return len(nums) == 1
    if not all(math.isfinite(v) for v in nums):
        return not (math.isnan(x) and math.isnan(y) or x == y)
    return abs(x - y) > limit


def _num(v, digits: int = 3) -> str:
    return f"{v:.{digits}f}" if isinstance(v, (int, float)) else "-"
