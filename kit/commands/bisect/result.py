"""One release's result: ``gradkit check``'s probe (``measure_with``) or any registered probe (``probe_measure``)
run on that release, one world, and what it gave: the verdict, the step in words, the ratio of every step
(``result_of``); what a change is a change of (``signature``); results that do not count (``SKIPPED``)."""
from __future__ import annotations

from kit import config as kconfig
from kit.commands import check
from kit.commands.bisect.listing import PACKAGE, stack_of
from kit.judge import oracle
from kit.probes import ds_config
from kit.stacks import versions

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
    optimizer = next((r.get("optimizer") for r in recs if r.get("role") == "measured" and r.get("optimizer")), None)
    return {"release": release, "verdict": row["verdict"], "step": step if row["verdict"] == oracle.AFFECTED else None,
            "ratios": [s["ratio"] for s in row["steps"]], "cosine": row.get("cosine"),
            "misplaced_weight": row.get("misplaced_weight"), "explained_by": row.get("explained_by"),
            "optimizer": optimizer, "reason": row.get("reason") if row["verdict"] in SKIPPED else None,
            "control": (summary.get("control") or {}).get("verdict")}


def measure_with(cfg, loop: str, world_size: int, device: str, timeout_s: float, steps: int, model=None):
    """``measure(release) -> result``: the check's probe on that release, one world."""
    def measure(release: str) -> dict:
        stack = stack_of(release)
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


def probe_measure(probe, run_kwargs: dict, case: str, axis: str = PACKAGE, words=step_words):
    """``measure(release)`` for any registered probe (``kit.probes``): ``probe.run(**run_kwargs)`` on a stack
    holding that release of ``axis`` (``deepspeed``, ``transformers`` or ``accelerate``: a package the probe's stack
    names), judged on its record of ``case`` by the probe's own verdict. This is how the known bugs' boundaries
    are found with their own probes (B2's pipeline, B1's Trainer), as the check's probe finds a config's."""
    if axis not in probe.packages:
        raise kconfig.ConfigError(f"the {probe.id} probe's stack names {list(probe.packages)}, not {axis!r}")

    def measure(release: str) -> dict:
        stack = stack_of(release, axis)
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
        return {"release": release, "verdict": verdict, "step": "; ".join(steps) or None,
                "ratios": [(st.get("metrics") or {}).get("norm_ratio") for st in rec.get("steps") or [rec]],
                "reason": rec.get(probe.reason_key()) if verdict in SKIPPED else None, "optimizer": rec.get("optimizer")}

    return measure


def signature(res: dict) -> tuple:
    """What a change is a change of: the verdict, and the step's shape where it is off."""
    return res["verdict"], res.get("step")
