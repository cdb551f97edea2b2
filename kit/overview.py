"""The four bugs side by side: one verdict matrix (bug x DeepSpeed version) and what to do about each.

    recs = overview.run_probes(["installed"])          # a small run of every probe, or
    recs = overview.load_results("runs/latest")        # the records a run-all left behind
    cells = overview.verdict_matrix(recs)              # one cell per (bug, version)
    overview.save_matrix(cells, "runs/latest")         # verdict_matrix.json + verdict_matrix.png

A cell is the worst verdict of the bug's *measured* configurations on that version (affected >
inconclusive > cannot-run > not-affected: a version is only `not-affected` when every configuration
ran and matched the reference) with the most extreme effective/reference ratio among the records
that carry that verdict, and the configuration it came from.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from kit import config as kconfig
from kit import oracle


@dataclass(frozen=True)
class Bug:
    """What the overview needs to know about one bug and its probe."""

    id: str
    title: str
    notebook: str
    probe: str  # module under kit.probes
    measured: str  # the case that is the reported configuration
    verdict_key: str  # record key holding that case's verdict
    ratio_meaning: str  # what the number in a cell is
    do_if_affected: str


BUGS = {b.id: b for b in (
    Bug("B1", "HF Trainer + DeepSpeed + model_accepts_loss_kwargs=True", "01_trainer_loss_kwargs.ipynb",
        "trainer_ga", "trainer", "verdict", "effective / reference gradient of the Trainer's step (GAS > 1)",
        "the Trainer's step is off the reference: read notebook 01 for which path GAS changes and what the token "
        "count costs; upgrade transformers (see the upstream table in kit/expectations.py), and never add the "
        "report's extra division by GAS"),
    Bug("B2", "PipelineEngine with GA > 1", "02_pipeline_ga.ipynb", "pipeline_ga", "pipeline", "verdict",
        "effective / reference gradient of the pipeline stage furthest from 1",
        "on DeepSpeed <= 0.18.2 divide the pipeline loss by GA; on 0.18.3 - 0.19.2 do not (earlier stages are "
        "already divided twice): upgrade to >= 0.19.3 or train with GA = 1"),
    Bug("B3", "ZeRO-1/2, config GA = 1, several backward() per step()", "03_zero_boundary.ipynb",
        "zero_boundary", "manual", "config_verdict", "effective / reference gradient (the last micro-batch / N survives)",
        "call engine.set_gradient_accumulation_boundary(i == N - 1) before each backward, or put the real N in "
        "gradient_accumulation_steps and step after every backward; from 0.19.4 "
        "\"managed_gradient_accumulation\": false also works"),
    Bug("B4", "BF16_Optimizer (bf16 + grad_accum_dtype fp32 + ZeRO-1)", "04_bf16_leak.ipynb", "bf16_leak", "leak",
        "verdict", "effective / reference gradient of the reported configuration",
        "set \"bf16\": {\"enabled\": true, \"immediate_grad_update\": true}, or upgrade to DeepSpeed >= 0.19.0"),
)}

_RANK = {v: i for i, v in enumerate(reversed(oracle.WORST_FIRST))}  # higher = worse


# ---------------------------------------------------------------------------------------------- getting records

def quick_plan(world_size: int = 2) -> dict:
    """The smallest configuration of each probe that still shows its bug (what the overview runs)."""
    return {
        "B1": dict(paths=("no_ds", "ds_zero0"), gas_values=(1, 4), cases=("trainer",), world_size=1),
        "B2": dict(world_sizes=(2,), splits=((8, 1), (1, 8)), dtypes=("fp32",), zero_stages=(0,), workaround=False),
        "B3": dict(world_sizes=(world_size,), n_values=(1, 4), stages=(0, 1, 2, 3), dtypes=("fp32",),
                   fixes=("fix_boundary",), fix_n_values=(4,)),
        "B4": dict(world_size=world_size, ga_values=(4,), cases=("leak", "workaround", "control")),
    }


def check_notebook(p: dict) -> None:
    """Every parameter of notebook 00, by its name there (what the notebook and ``kit.runall`` call first)."""
    if not isinstance(p["LOAD_RESULTS"], str):
        raise kconfig.ConfigError(f"LOAD_RESULTS must be a folder name or \"\", got {p['LOAD_RESULTS']!r}")
    for name in ("VERSIONS", "BUGS"):
        kconfig.check_list(name, p[name])
    unknown = sorted(set(p["BUGS"]) - set(BUGS))
    if unknown:
        raise kconfig.ConfigError(f"BUGS: unknown bug(s) {unknown}; the kit knows {sorted(BUGS)}")
    for v in p["VERSIONS"]:
        kconfig.check_version(v)
    kconfig.check_device(p["DEVICE"])
    kconfig.check_world_size(p["WORLD_SIZE"], p["DEVICE"])
    kconfig.check_timeout(p["TIMEOUT_S"])


def run_probes(versions=(kconfig.INSTALLED,), bugs=tuple(BUGS), world_size: int = 2, device: str = "cpu",
               timeout_s: float = 600, progress=None) -> list[dict]:
    """Run ``quick_plan`` of every bug under every DeepSpeed version; one record list for all of them.

    B1 runs the installed transformers with each DeepSpeed version; B2 needs an even world (2 stages).
    ``progress(bug, i, n)`` is called before each bug, if given.
    """
    from kit.probes import bf16_leak, pipeline_ga, trainer_ga, zero_boundary

    kconfig.check_list("versions", versions)
    kconfig.check_list("bugs", bugs)
    unknown = sorted(set(bugs) - set(BUGS))
    if unknown:
        raise kconfig.ConfigError(f"unknown bug(s) {unknown}; the kit knows {sorted(BUGS)}")
    for v in versions:
        kconfig.check_version(v)
    kconfig.check_world_size(world_size, device)
    plan = quick_plan(world_size)
    common = dict(device=device, timeout_s=timeout_s)
    runs = {
        "B1": lambda: trainer_ga.run(stacks=[{} if v == kconfig.INSTALLED else {"deepspeed": v} for v in versions],
                                     **plan["B1"], **common),
        "B2": lambda: pipeline_ga.run(versions=versions, **plan["B2"], **common),
        "B3": lambda: zero_boundary.run(versions=versions, **plan["B3"], **common),
        "B4": lambda: bf16_leak.run(versions=versions, **plan["B4"], **common),
    }
    out = []
    for i, bug in enumerate(bugs):
        if progress:
            progress(bug, i, len(bugs))
        out += runs[bug]()
    return out


def load_results(folder) -> tuple[list[dict], list[str]]:
    """The bug notebooks' records of the last run-all into ``folder`` (relative: the repository's), only from
    notebooks that ran to the end, only of that run; and one line per notebook saying what was used."""
    from kit import records

    stems = {Path(b.notebook).stem for b in BUGS.values()}
    recs, said = records.run_records(folder, stems)
    if not recs:
        raise FileNotFoundError(f"no records of a finished bug notebook in {kconfig.repo_path(folder)} "
                                f"({'; '.join(said) or 'none listed'}): run `python -m kit.runall` first, or run "
                                "the probes here")
    return recs, said


# ---------------------------------------------------------------------------------------------- the matrix

NO_DEEPSPEED = "none"  # the matrix column of steps that never went through DeepSpeed (B1's Trainer alone)


def deepspeed_version(rec: dict) -> str:
    """The DeepSpeed release a record really imported (its request where it never got that far);
    ``NO_DEEPSPEED`` for a step whose path does not use DeepSpeed, whatever the ranks imported."""
    from kit import versions

    if rec.get("bug") == "B1" and rec.get("path", (rec.get("config") or {}).get("path")) == "no_ds":
        return NO_DEEPSPEED
    got = (rec.get("versions") or {}).get("deepspeed") or (rec.get("stack") or {}).get("deepspeed")
    if got:
        return got
    label = rec.get("version", "")
    return versions.installed_version("deepspeed") if label in (kconfig.INSTALLED, "") else label.split("=")[-1]


def _ratio(rec: dict) -> float | None:
    """The number that shows the bug, always against the reference: the extreme per-stage ratio (B2), else the ratio."""
    if rec.get("stages"):
        vals = [(s.get("metrics") or {}).get("norm_ratio") for s in rec["stages"]]
    else:
        vals = [(rec.get("metrics") or {}).get("norm_ratio")]
    vals = [v for v in vals if v]
    return max(vals, key=lambda v: abs(math.log(v))) if vals else None


def _where(rec: dict) -> str:
    bits = [f"GA {rec['ga']}" if rec["bug"] != "B1" else f"GAS {rec['ga']}"]
    if rec.get("path"):
        bits.append(rec["path"])
    elif rec.get("zero_stage") is not None:
        bits.append(f"ZeRO-{rec['zero_stage']}")
    bits += [rec["dtype"], f"W {rec['world_size']}"]
    tf = (rec.get("versions") or {}).get("transformers")
    if rec["bug"] == "B1" and tf:
        bits.append(f"transformers {tf}")
    return ", ".join(bits)


def verdict_matrix(recs: list[dict]) -> list[dict]:
    """One cell per (bug, DeepSpeed version) over the bug's measured records, worst verdict first."""
    groups: dict = {}
    for r in recs:
        bug = BUGS.get(r.get("bug"))
        if bug is None or r.get("role") != "measured" or r.get("case") != bug.measured:
            continue
        groups.setdefault((bug.id, deepspeed_version(r)), []).append(r)
    cells = []
    for (bug_id, version), group in groups.items():
        verdict_of = lambda r: r.get(BUGS[bug_id].verdict_key) or r["verdict"]  # noqa: E731
        worst = max((verdict_of(r) for r in group), key=lambda v: _RANK.get(v, -1))
        bad = [r for r in group if verdict_of(r) == worst]
        with_ratio = [r for r in bad if _ratio(r)]
        # the representative record: fp32 before bf16 (no rounding noise), the largest GA, the most extreme ratio
        pick = max(with_ratio, key=lambda r: (r["dtype"] == "fp32", r["ga"], abs(math.log(_ratio(r))))) \
            if with_ratio else bad[0]
        cells.append({"bug": bug_id, "deepspeed": version, "verdict": worst, "ratio": _ratio(pick),
                      "cosine": (pick.get("metrics") or {}).get("cosine"),
                      "ratio_means": BUGS[bug_id].ratio_meaning, "where": _where(pick),
                      "transformers": (pick.get("versions") or {}).get("transformers") if bug_id == "B1" else None,
                      "gas_verdict": pick.get("gas_verdict") if bug_id == "B1" else None,
                      "ratio_vs_gas1": pick.get("ratio_vs_control") if bug_id == "B1" else None,
                      "configs": len(group), "configs_with_verdict": len(bad),
                      "reason": pick.get(BUGS[bug_id].verdict_key.replace("verdict", "reason")) or pick.get("reason", ""),
                      "notebook": BUGS[bug_id].notebook})
    return sorted(cells, key=lambda c: (c["bug"], _version_key(c["deepspeed"])))


def _version_key(v: str):
    from kit.expectations import version_key

    return (-1,) if v == NO_DEEPSPEED else version_key(v)


def column_label(v: str, installed: str) -> str:
    return "no DeepSpeed" if v == NO_DEEPSPEED else f"{v} (installed)" if v == installed else v


def gas_text(cell: dict) -> str:
    """B1's second verdict, named: does GAS change the step (against the same path at GAS = 1)?"""
    g = cell.get("gas_verdict")
    if g not in (oracle.AFFECTED, oracle.NOT_AFFECTED):
        return ""
    x = f" (x{cell['ratio_vs_gas1']:.3f} of GAS = 1)" if cell.get("ratio_vs_gas1") else ""
    return "GAS-invariant" if g == oracle.NOT_AFFECTED else f"GAS changes the step{x}"


def cell_text(cell: dict) -> str:
    if not cell.get("ratio"):
        return cell["verdict"]
    cos = f", cos {cell['cosine']:.3f}" if cell.get("cosine") is not None else ""
    tf = f"; transformers {cell['transformers']}" if cell.get("transformers") else ""
    gas = f"; {gas_text(cell)}" if gas_text(cell) else ""
    return f"{cell['verdict']} ({cell['ratio']:.3f}{cos}{gas}{tf})"


def matrix_table(cells: list[dict], link=lambda notebook: f"../notebooks/{notebook}") -> str:
    """Markdown: bugs as rows (linked to ``link(notebook)``), DeepSpeed versions as columns, verdict (ratio, cosine)."""
    from kit import versions

    installed = versions.installed_version("deepspeed")
    cols = sorted({c["deepspeed"] for c in cells}, key=_version_key)
    head = ["bug"] + [column_label(v, installed) for v in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for bug in BUGS:
        row = {c["deepspeed"]: c for c in cells if c["bug"] == bug}
        if row:
            lines.append(f"| [{bug}]({link(BUGS[bug].notebook)}) | "
                         + " | ".join(cell_text(row[v]) if v in row else "" for v in cols) + " |")
    return "\n".join(lines)


def save_matrix(cells: list[dict], folder) -> tuple[Path, Path]:
    """``verdict_matrix.json`` and ``verdict_matrix.png`` in ``folder``."""
    import matplotlib.pyplot as plt

    from kit import plots

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    js = folder / "verdict_matrix.json"
    js.write_text(json.dumps(cells, indent=1, sort_keys=True))
    png = folder / "verdict_matrix.png"
    fig = plots.verdict_matrix(cells)
    plots.save(fig, png)
    plt.close(fig)
    return js, png


def what_to_do(cells: list[dict], deepspeed: str | None = None) -> list[str]:
    """One sentence per bug for one DeepSpeed version (default: the installed one)."""
    from kit import versions

    deepspeed = deepspeed or versions.installed_version("deepspeed")
    out = []
    for bug in BUGS.values():
        cell = next((c for c in cells if c["bug"] == bug.id and c["deepspeed"] == deepspeed), None)
        if cell is None:
            out.append(f"{bug.id} ({bug.title}): not measured on DeepSpeed {deepspeed}; run {bug.notebook}.")
        elif cell["verdict"] == oracle.AFFECTED:
            gas = f"; {gas_text(cell)}" if gas_text(cell) else ""
            out.append(f"{bug.id} ({bug.title}): **affected** on {deepspeed} (the applied gradient is "
                       f"{cell['ratio']:.3f} x the reference at {cell['where']}{gas}). To avoid it: "
                       f"{bug.do_if_affected}.")
        elif cell["verdict"] == oracle.NOT_AFFECTED:
            out.append(f"{bug.id} ({bug.title}): not affected on {deepspeed} ({_count(cell['configs'])} "
                       f"measured, every one matches the reference on every signal); nothing to change.")
        elif cell["verdict"] == oracle.CANNOT_RUN:
            out.append(f"{bug.id} ({bug.title}): could not run {cell['configs_with_verdict']} of {cell['configs']} "
                       f"configurations on {deepspeed} here ({cell['reason'][:160]}); this is not a clean bill of "
                       f"health: run {bug.notebook} where it runs (e.g. on a GPU).")
        else:
            out.append(f"{bug.id} ({bug.title}): inconclusive on {deepspeed}: the control of the same launch is off "
                       f"the reference ({cell['reason'][:160]}); see {bug.notebook}.")
    return out


def _count(n: int) -> str:
    return f"{n} configuration" + ("" if n == 1 else "s")


def differences(old: list[dict], new: list[dict]) -> list[str]:
    """Cells whose verdict changed between two matrices (what a re-run must not show)."""
    before = {(c["bug"], c["deepspeed"]): c["verdict"] for c in old}
    after = {(c["bug"], c["deepspeed"]): c["verdict"] for c in new}
    return [f"{b} on {v}: {before.get((b, v), 'absent')} -> {after.get((b, v), 'absent')}"
            for b, v in sorted(set(before) | set(after)) if before.get((b, v)) != after.get((b, v))]


def sentences(cells: list[dict]) -> list[str]:
    """Each cell of the matrix in one sentence, with its numbers."""
    from kit import versions

    installed = versions.installed_version("deepspeed")
    out = []
    for c in cells:
        where = "no DeepSpeed" if c["deepspeed"] == NO_DEEPSPEED else \
            f"DeepSpeed {c['deepspeed']}" + (" (installed)" if c["deepspeed"] == installed else "")
        share = f"{c['configs_with_verdict']} of {_count(c['configs'])}"
        if c.get("ratio"):
            cos = f" (cosine with the reference {c['cosine']:.3f})" if c.get("cosine") is not None else ""
            gas = f" {gas_text(c)}." if gas_text(c) else ""
            out.append(f"**{c['bug']}** on {where}: **{c['verdict']}** ({share}); at {c['where']} the applied "
                       f"gradient is {c['ratio']:.3f} x the reference{cos}.{gas}")
        else:
            out.append(f"**{c['bug']}** on {where}: **{c['verdict']}** ({share}): {c['reason'][:200]}")
    return out


def violations(cells: list[dict], bugs=tuple(BUGS), versions_run=None) -> list[str]:
    """What must hold for the matrix to be trusted; the overview notebook asserts the list is empty.

    Every requested bug has a cell on every version run; an ``affected`` cell's number is off 1 (or its
    cosine is); a ``not-affected`` cell's number is 1 within the loosest (bf16) tolerance.
    """
    from kit import versions

    out = []
    loose = oracle.tolerance("bf16").norm_ratio
    if versions_run is not None:
        want = {versions.installed_version("deepspeed") if v == kconfig.INSTALLED else v for v in versions_run}
        have = {(c["bug"], c["deepspeed"]) for c in cells}
        out += [f"{b} has no verdict on DeepSpeed {v}" for b in bugs for v in sorted(want) if (b, v) not in have]
    for c in cells:
        ratio, cos = c.get("ratio"), c.get("cosine")
        if c["verdict"] == oracle.NOT_AFFECTED and (ratio is None or abs(ratio - 1) > loose):
            out.append(f"{c['bug']} on {c['deepspeed']}: not-affected but the ratio is {ratio}")
        if c["verdict"] == oracle.AFFECTED and ratio is not None and abs(ratio - 1) <= 1e-4 and (cos or 1) > 1 - 1e-4:
            out.append(f"{c['bug']} on {c['deepspeed']}: affected but ratio {ratio} and cosine {cos} look correct")
        if c["verdict"] not in oracle.VERDICTS:
            out.append(f"{c['bug']} on {c['deepspeed']}: unknown verdict {c['verdict']!r}")
    return out
