"""``gradkit report --known BUG``: a known bug with no fix upstream, written up for its maintainers with a fix the kit
has verified (``docs/reports/<BUG>/``).

    gradkit report --known B10                        # the installed release, its default sweep: minutes
    gradkit report --known B10 --sweep none           # without the sweep (said so in the report)

The fix (``gradkit.stacks.fixes``: a patch ``kit/stacks/patches/<package>/<name>.diff`` with its reproduction and
regression test beside it) is applied to the release in an overlay of its own (``gradkit.stacks.patched``:
``0.19.8+b10``), and the same judgements run on both sides:

1. the standalone reproduction (``<name>_repro.py``, plain DeepSpeed and torch, CPU or GPU), as a user runs it
   (torchrun, 2 ranks), once per ZeRO stage it names: exit 1 on the release, 0 with the patch;
2. the regression test (``<name>_test.py``, written for DeepSpeed's ``tests/unit``), under pytest on every rank of
   a torchrun world (``kit/stacks/patches/harness``): a failed test on the release, all passed with the patch;
3. the bug's recipe (``gradkit.commands.bisect.known``), judged by the kit's oracle: affected on the release,
   not-affected with the patch;
4. the sweep (the default spec, fp16 among its precisions; its records in ``runs/reports/sweep``, one store for every report, or beside a
   report written elsewhere): no point not-affected on the release is affected with the patch.

The report holds what happens in the code's own lines (read from the release), the reproduction and what it
printed on both sides, the patch, the test, the verification table and the command that wrote it; ``verified`` is
true only where every judgement went the way a fix must.
"""
from __future__ import annotations

import collections
import dataclasses
import datetime
import json
import re
import shutil
from pathlib import Path

from gradkit import config as kconfig
from gradkit.commands import repro
from gradkit.commands.bisect import known as recipes
from gradkit.commands.sweep import run as sweep_run
from gradkit.commands.sweep import spec as sweep_spec
from gradkit.judge import expectations, oracle
from gradkit.launch import scripts
from gradkit.stacks import patched, versions
from gradkit.stacks.fixes import FIXES, Fix

SWEEP = "scripts/sweeps/default.yaml"


HARNESS = patched.PATCHES / "harness" / "run_unit_test.py"  # runs a test written for DeepSpeed's tests/unit


def code_lines(root: Path, fix: Fix) -> list[str]:
    """Each line of ``fix.lines`` as the release writes it, with its file and line number, in file order."""
    out = []
    for rel, wanted in fix.lines:
        text = (root / rel).read_text().splitlines()
        hits = sorted((i + 1, line.strip()) for i, line in enumerate(text) for w in wanted if w in line)
        out += [f"{rel}:{n}: {line}" for n, line in dict(hits).items()]
    return out


def verify(bug: str, release: str, out: Path, sweep: str | None = SWEEP, world_size: int = 2,
           timeout_s: float = 600, progress: bool = True, stages: tuple | None = None) -> dict:
    """Every judgement of the fix, on ``release`` and on it patched; the report written into ``out``. ``stages``:
    the reproduction at these ZeRO stages only (all the fix names where None)."""
    if bug not in FIXES:
        raise kconfig.ConfigError(f"--known {bug}: the kit holds a verified fix for {', '.join(FIXES)} only")
    fix = FIXES[bug] if stages is None else dataclasses.replace(FIXES[bug], stages=tuple(stages))
    plain = release  # on top of another fix where another bug hides this one (B9 hides B10 at ZeRO-0)
    release, with_patch = (f"{plain}+{fix.on}", f"{plain}+{fix.on}.{fix.patch}") if fix.on else \
        (plain, f"{plain}+{fix.patch}")
    stacks = {release: {"deepspeed": release}, with_patch: {"deepspeed": with_patch}}
    script = patched.patch_file("deepspeed", fix.patch).with_name(f"{fix.patch}_repro.py")
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(script, out / "repro.py")
    shutil.copy(patched.patch_file("deepspeed", fix.patch), out / "fix.diff")
    test = script.with_name(f"{fix.patch}_test.py")
    shutil.copy(test, out / f"test_{fix.patch}.py")
    runs, tests = {}, {}
    for name, stack in stacks.items():
        for stage in fix.stages:
            runs[(name, stage)] = run_script(out / "repro.py", world_size, stack, stage, timeout_s)
        tests[name] = run_test(test, stack, timeout_s)
    recipe = recipes.RECIPES[bug]
    measured = {name: recipes.measure(recipe, world_size, timeout_s=timeout_s)(name) for name in stacks}
    # the report's records stay out of docs/, in one store that every report shares (runs/reports/sweep: the
    # release's own side runs once for all of them); elsewhere beside the report
    swept = sweep_both(sweep, stacks, kconfig.repo_path("runs/reports") if out.resolve() == default_out(
        bug).resolve() else out, progress) if sweep else None
    doc = {"bug": bug, "deepspeed": plain, "release": release, "patched": with_patch, "patch": fix.patch,
           "on": fix.on, "stages": list(fix.stages),
           "reproduction": {
        f"{n} ZeRO-{s}": {"exit": rc, "output": text} for (n, s), (rc, text) in runs.items()}, "recipe": measured,
        "test": {n: {"exit": rc, "output": text} for n, (rc, text) in tests.items()}, "sweep": swept}
    doc["verified"] = (all(runs[(release, s)][0] == 1 and runs[(with_patch, s)][0] == 0 for s in fix.stages)
                       and tests[release][0] == 1 and tests[with_patch][0] == 0
                       and measured[release]["verdict"] == oracle.AFFECTED
                       and measured[with_patch]["verdict"] == oracle.NOT_AFFECTED
                       and (swept is None or not swept["broken"]))
    root = Path(versions.resolve_stack({"deepspeed": plain}).roots["deepspeed"])
    (out / "report.md").write_text(report(fix, doc, code_lines(root, fix), sweep, script.read_text(), test.read_text()))
    (out / "verification.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return doc


def run_script(path: Path, world_size: int, stack: dict, stage: int, timeout_s: float) -> tuple[int, str]:
    """The reproduction as a user runs it (torchrun, ``STAGE``): its exit status and what it printed of its steps and
    its verdict (everything it printed where it printed no verdict: a crash)."""
    rc, stdout, stderr = scripts.torchrun(path, world_size=world_size, stack=stack, timeout_s=timeout_s,
                                          env={"STAGE": str(stage)})
    said = [line for line in stdout.splitlines() if line.startswith(("step ", "REPRODUCED", "not reproduced"))]
    return rc, "\n".join(said) if any(not line.startswith("step ") for line in said) else repro.unjudged(stdout + stderr)


def run_test(path: Path, stack: dict, timeout_s: float) -> tuple[int, str]:
    """The regression test under pytest in a world of its class's size (2), every rank running it: 1 where a test
    failed (and none errored), 0 where all passed, else the world's own status (a crash, a collection error: it did
    not judge); with pytest's lines of outcome (everything it printed where it printed none)."""
    rc, stdout, stderr = scripts.torchrun(HARNESS, [path.resolve()], world_size=2, stack=stack, timeout_s=timeout_s)
    stdout = re.sub(r"\x1b\[[0-9;]*m", "", stdout)  # pytest's colours, where the caller's terminal asks for them
    said = [line.strip("= ") for line in stdout.splitlines()
            if line.startswith(("PASSED ", "FAILED ", "ERROR ", "SKIPPED "))
            or re.match(r"^=*\s*\d+ (passed|failed)", line)]
    if rc and any(x.startswith("FAILED ") for x in said) and not any(x.startswith("ERROR ") for x in said):
        rc = 1
    elif rc == 1:
        rc = 3  # torchrun's 1 for a rank that never judged: kept apart from a failed test
    return rc, "\n".join(said) if said else repro.unjudged(stdout + stderr)


def sweep_both(spec_path: str, stacks: dict, out: Path, progress: bool) -> dict:
    """The sweep's points on both sides: ``broken`` lists every point not-affected on the release and affected with
    the patch (a fix must leave none), ``fixed`` every point the other way, ``renamed`` the points affected on both
    sides by another known bug (``{"B9 -> B10": n}``: the patch took its bug away and another one shows there)."""
    spec = with_fp16(sweep_spec.load_spec(spec_path))
    spec["stacks"] = list(stacks.values())
    recs = sweep_run.run(spec, out / "sweep", progress=progress)
    by = {}  # point -> side -> (verdict, the known bug that explains it)
    for r in recs:
        side = (r.get("versions") or {}).get("deepspeed") or r.get("version")
        by.setdefault(json.dumps(r["point"], sort_keys=True), {})[side] = (r["verdict"],
                                                                           r.get("explained_by") or "unknown")
    names = list(stacks)
    pairs = [(p, v.get(names[0], (None,))[0], v.get(names[1], (None,))[0]) for p, v in by.items()]
    moved = collections.Counter(f"{by[p][names[0]][1]} -> {by[p][names[1]][1]}" for p, a, b in pairs
                                if a == b == oracle.AFFECTED and by[p][names[0]][1] != by[p][names[1]][1])
    return {"spec": spec_path, "points": len(pairs), "renamed": dict(sorted(moved.items())),
            "broken": [p for p, a, b in pairs if a == oracle.NOT_AFFECTED and b == oracle.AFFECTED],
            "fixed": [p for p, a, b in pairs if a == oracle.AFFECTED and b == oracle.NOT_AFFECTED],
            "affected": {n: sum(1 for _, *vs in pairs if vs[i] == oracle.AFFECTED) for i, n in enumerate(names)},
            "not_run": {n: sum(1 for _, *vs in pairs if vs[i] not in (oracle.AFFECTED, oracle.NOT_AFFECTED))
                        for i, n in enumerate(names)}}


def with_fp16(spec: dict) -> dict:
    """``spec`` with fp16 among its precisions (a patch of fp16 code is judged where it runs), a bf16 accumulator
    under an fp16 model left out as under an fp32 one."""
    dtypes = spec["axes"].get("dtype")
    if dtypes and "fp16" not in dtypes:
        spec["axes"]["dtype"] = [*dtypes, "fp16"]
        spec["skip"] = [*(spec.get("skip") or []), {"dtype": "fp16", "data_types.grad_accum_dtype": "bf16"}]
    return sweep_spec.check_spec(spec)


def table(doc: dict) -> list[str]:
    """The verification's rows (markdown): each judgement on the release and on it patched."""
    release, with_patch, rec = doc["release"], doc["patched"], doc["recipe"]
    rows = ["| judgement | " + f"DeepSpeed {release} | {with_patch} (the patch) |", "|---|---|---|"]
    for stage in doc["stages"]:
        rows.append(f"| `repro.py`, ZeRO-{stage}: exit status | "
                    + " | ".join(str(doc["reproduction"][f"{n} ZeRO-{stage}"]["exit"]) for n in (release, with_patch))
                    + " |")
    rows.append(f"| `test_{doc['patch']}.py` (pytest, 2 ranks): exit status | "
                + " | ".join(str(doc["test"][n]["exit"]) for n in (release, with_patch)) + " |")
    rows.append("| the kit's oracle on the bug's recipe (`gradkit bisect --known " + doc["bug"] + "`'s config) | "
                + " | ".join(f"{rec[n]['verdict']}" + (f" ({rec[n]['step']})" if rec[n].get("step") else "")
                             for n in (release, with_patch)) + " |")
    s = doc["sweep"]
    if s:
        rows.append(f"| the sweep (`{s['spec']}`, fp16 among its precisions, {s['points']} points): affected | "
                    + " | ".join(str(s["affected"].get(n, 0)) for n in (release, with_patch)) + " |")
    return rows


def report(fix: Fix, doc: dict, lines: list[str], sweep: str | None, script: str, test: str) -> str:
    k = expectations.KNOWN[fix.bug]
    release, with_patch, s = doc["release"], doc["patched"], doc["sweep"]
    plain = doc.get("deepspeed", release)
    rows = table(doc)
    said = [f"# [DeepSpeed {plain}] {fix.title}", "",
            f"<sub>written by `gradkit report --known {fix.bug} --deepspeed {plain}"
            + ("" if sweep == SWEEP else f" --sweep {sweep or 'none'}")
            + f"` on {datetime.date.today()}; the fix is **{'verified' if doc['verified'] else 'NOT verified'}** "
            "(every judgement below)</sub>", "",
            "## What happens", "", k.explains[0] + ".", "", "In the release's own lines:", "", "```",
            *lines, "```", "", *[f"- {n}" for n in k.notes], "",
            "## Reproduction", "", "`repro.py` (plain DeepSpeed and torch; CPU or GPU):", "", "```python",
            script.rstrip(), "```", "",
            f"What it printed on DeepSpeed {release}:", "", "```",
            doc["reproduction"][f"{release} ZeRO-{fix.stages[0]}"]["output"].strip(), "```", "",
            "## The fix", "", f"`fix.diff` ({fix.fixes}):",
            "", "```diff", patched.patch_file("deepspeed", fix.patch).read_text().rstrip(), "```", "",
            "## Regression test", "", f"`test_{fix.patch}.py`, in the style of DeepSpeed's `tests/unit` (it needs "
            "`unit.common.DistributedTest`; the kit runs it with pytest in a torchrun world of 2 ranks):", "",
            "```python", test.rstrip(), "```", "", *[f"On {n}:" + "\n\n```\n" + doc["test"][n]["output"].strip()
                                                     + "\n```\n" for n in (release, with_patch)],
            "## Verification", "", f"The same judgements on {release} and on it with the patch applied (an overlay "
            f"of its own, `{with_patch}`):", "", *([f"Both sides carry the kit's `{fix.on}` patch: {fix.on_why}.", ""]
                                                   if fix.on else []), *rows, ""]
    if s:
        said += [f"Points not-affected on {release} and affected with the patch: "
                 + (", ".join(s["broken"]) if s["broken"] else "none") + f"; the other way: {len(s['fixed'])}."
                 + ("" if not s.get("renamed") else " Affected on both sides, by another bug with the patch (its "
                    "bug gone, another one showing there): " + ", ".join(f"{n} ({k})" for k, n in s["renamed"].items())
                    + "."), ""]
    else:
        said += ["The sweep was not run for this report (`--sweep none`).", ""]
    said += [f"Upstream: {k.report}."]
    return "\n".join(said) + "\n"


def default_out(bug: str) -> Path:
    return kconfig.repo_path(f"docs/reports/{bug}")


def known_release(value: str) -> str:
    return versions.installed_version("deepspeed") if value in (None, kconfig.INSTALLED) else value


def parse_bug(value: str) -> str:
    bug = value.upper()
    if not re.fullmatch(r"B\d+", bug):
        raise kconfig.ConfigError(f"--known {value}: a known bug's name (one of {', '.join(FIXES)})")
    return bug
