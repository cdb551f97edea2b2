"""The four bugs side by side: one verdict matrix (bug x DeepSpeed version) and what to do about each.

    recs = overview.run_probes(["installed"])          # a small run of every probe, or
    recs = overview.load_results("runs/latest")        # the records a run-all left behind
    cells = overview.verdict_matrix(recs)              # one cell per (bug, version)
    overview.save_matrix(cells, "runs/latest")         # verdict_matrix.json + verdict_matrix.png

A cell is the worst verdict of the bug's *measured* configurations on that version that were judged (affected >
inconclusive > not-affected) and, beside it, how many could not run (`cannot-run` only where none could): a
version reads plain `not-affected` only when every configuration ran and matched the reference. It carries the most
extreme effective/reference ratio among the records that carry that verdict, and the configuration it came from.
"""
from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

from gradkit import config as kconfig
from gradkit import probes
from gradkit.judge import oracle, records, tolerances
from gradkit.judge.records import NO_DEEPSPEED, column_key, column_label, deepspeed_version  # noqa: F401 - notebooks read them here
from gradkit.probes import runner
from gradkit.stacks import versions

_RANK = {v: i for i, v in enumerate(reversed(oracle.WORST_FIRST))}  # higher = worse


# ---------------------------------------------------------------------------------------------- getting records

def quick_plan(world_size: int = 2) -> dict:
    """The smallest configuration of each probe that still shows its bug (what the overview runs)."""
    return {p.id: p.quick_plan(world_size) for p in probes.registry().values()}


def check_notebook(p: dict) -> list:
    """Every parameter of notebook 00, by its name there (what the notebook and ``gradkit.notebooks.runall`` call
    first); returns the ``(probe, stack)`` pairs its worlds will run (none when it reads ``LOAD_RESULTS``)."""
    if not isinstance(p["LOAD_RESULTS"], str):
        raise kconfig.ConfigError(f"LOAD_RESULTS must be a folder name or \"\", got {p['LOAD_RESULTS']!r}")
    kconfig.check_list("VERSIONS", p["VERSIONS"])
    if not isinstance(p["BUGS"], list):
        raise kconfig.ConfigError(f"BUGS must be a list of probe ids (empty: every probe), got {p['BUGS']!r}")
    unknown = sorted(set(p["BUGS"]) - set(probes.registry()))
    if unknown:
        raise kconfig.ConfigError(f"BUGS: unknown bug(s) {unknown}; the kit knows {sorted(probes.registry())}")
    for v in p["VERSIONS"]:
        kconfig.check_version(v)
    kconfig.check_device(p["DEVICE"])
    kconfig.check_world_size(p["WORLD_SIZE"], p["DEVICE"])
    kconfig.check_timeout(p["TIMEOUT_S"])
    if p["LOAD_RESULTS"]:
        return []
    every = probes.registry()
    return [(every[b], s) for b in (p["BUGS"] or every) for s in runner.probe_stacks(every[b], p["VERSIONS"])]


def run_probes(versions=(kconfig.INSTALLED,), bugs=(), world_size: int = 2, device: str = "cpu",
               timeout_s: float = 600, progress: str = "") -> list[dict]:
    """Run ``quick_plan`` of every probe (``bugs``: those ids; empty: all) under every DeepSpeed version.

    A probe whose stack does not name DeepSpeed runs once, on its installed stack. ``progress``: "" none,
    "text" a text bar on stdout, "widget" a JupyterLab bar; either counts the cases the ranks finish
    (``gradkit.probes.runner.case_bar``) and names the probe, the stack, and what makes a first launch slow.
    """
    kconfig.check_list("versions", versions)
    if progress not in ("", "text", "widget"):
        raise kconfig.ConfigError(f"progress must be '', 'text' or 'widget', got {progress!r}")
    every = probes.registry()
    bugs = list(bugs) or list(every)
    unknown = sorted(set(bugs) - set(every))
    if unknown:
        raise kconfig.ConfigError(f"unknown bug(s) {unknown}; the kit knows {sorted(every)}")
    for v in versions:
        kconfig.check_version(v)
    kconfig.check_world_size(world_size, device)
    out = []
    bar = runner.case_bar(f"{len(bugs)} probes", widget=progress == "widget") if progress else contextlib.nullcontext()
    with bar:
        for bug in bugs:
            probe = every[bug]
            out += probe.run(stacks=runner.probe_stacks(probe, versions), **probe.quick_plan(world_size), device=device, timeout_s=timeout_s)
    return out


def load_results(folder) -> tuple[list[dict], list[str]]:
    """The bug notebooks' records of the last run-all into ``folder`` (relative: the repository's), only from
    notebooks that ran to the end, only of that run; and one line per notebook saying what was used."""
    stems = {Path(p.notebook).stem for p in probes.registry().values()}
    recs, said = records.run_records(folder, stems)
    if not recs:
        raise FileNotFoundError(f"no records of a finished bug notebook in {kconfig.repo_path(folder)} "
                                f"({'; '.join(said) or 'none listed'}): run `python -m gradkit.notebooks.runall` first, or run "
                                "the probes here")
    return recs, said


# ---------------------------------------------------------------------------------------------- the matrix

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
    if rec.get("init") == "torch":  # a plain-torch probe: its stack is the torch it ran
        bits.append(f"torch {(rec.get('versions') or {}).get('torch', '?')}")
    return ", ".join(bits)


def verdict_matrix(recs: list[dict]) -> list[dict]:
    """One cell per (bug, DeepSpeed version) over the bug's measured records, worst verdict first."""
    every = probes.registry()
    groups: dict = {}
    for r in recs:
        bug = every.get(r.get("bug"))
        if bug is None or r.get("role") != "measured" or r.get("case") != bug.measured_case:
            continue
        if "deepspeed" not in bug.packages and r.get("stack"):  # a path without DeepSpeed: its column is the
            continue  # installed stack; its other releases are its own notebook's matrix
        groups.setdefault((bug.id, deepspeed_version(r)), []).append(r)
    cells = []
    for (bug_id, version), group in groups.items():
        verdict_of = lambda r: r.get(every[bug_id].verdict_key) or r["verdict"]  # noqa: E731
        unrun = [r for r in group if verdict_of(r) == oracle.CANNOT_RUN]
        judged = [r for r in group if verdict_of(r) != oracle.CANNOT_RUN] or group  # what was judged, first
        worst = max((verdict_of(r) for r in judged), key=lambda v: _RANK.get(v, -1))
        bad = [r for r in judged if verdict_of(r) == worst]
        with_ratio = [r for r in bad if _ratio(r)]
        # the representative record: fp32 before bf16 (no rounding noise), the largest GA, the most extreme ratio
        pick = max(with_ratio, key=lambda r: (r["dtype"] == "fp32", r["ga"], abs(math.log(_ratio(r))))) \
            if with_ratio else bad[0]
        cells.append({"bug": bug_id, "deepspeed": version, "verdict": worst, "ratio": _ratio(pick),
                      "cosine": (pick.get("metrics") or {}).get("cosine"),
                      "ratio_means": every[bug_id].ratio_meaning, "where": _where(pick),
                      "transformers": (pick.get("versions") or {}).get("transformers") if bug_id == "B1" else None,
                      "gas_verdict": pick.get("gas_verdict") if bug_id == "B1" else None,
                      "ratio_vs_gas1": pick.get("ratio_vs_control") if bug_id == "B1" else None,
                      "configs": len(group), "configs_with_verdict": len(bad),
                      "cannot_run": len(unrun) if worst != oracle.CANNOT_RUN else 0,
                      "cannot_reason": (unrun[0].get("reason") or "")[:200] if unrun else "",
                      "reason": pick.get(every[bug_id].verdict_key.replace("verdict", "reason")) or pick.get("reason", ""),
                      "notebook": every[bug_id].notebook})
    return sorted(cells, key=lambda c: (c["bug"], column_key(c["deepspeed"])))


def gas_text(cell: dict) -> str:
    """B1's second verdict, named: does GAS change the step (against the same path at GAS = 1)?"""
    g = cell.get("gas_verdict")
    if g not in (oracle.AFFECTED, oracle.NOT_AFFECTED):
        return ""
    x = f" (x{cell['ratio_vs_gas1']:.3f} of GAS = 1)" if cell.get("ratio_vs_gas1") else ""
    return "GAS-invariant" if g == oracle.NOT_AFFECTED else f"GAS changes the step{x}"


def unrun_text(cell: dict) -> str:
    """Beside a judged verdict: the configurations that could not run (never counted as judged)."""
    k = cell.get("cannot_run") or 0
    return f"; {k} of {cell['configs']} could not run" if k else ""


def cell_text(cell: dict) -> str:
    if not cell.get("ratio"):
        return cell["verdict"] + unrun_text(cell)
    cos = f", cos {cell['cosine']:.3f}" if cell.get("cosine") is not None else ""
    tf = f"; transformers {cell['transformers']}" if cell.get("transformers") else ""
    gas = f"; {gas_text(cell)}" if gas_text(cell) else ""
    return f"{cell['verdict']} ({cell['ratio']:.3f}{cos}{gas}{tf}){unrun_text(cell)}"


def matrix_table(cells: list[dict], link=lambda notebook: f"../notebooks/{notebook}") -> str:
    """Markdown: bugs as rows (linked to ``link(notebook)``), DeepSpeed versions as columns, verdict (ratio, cosine)."""
    installed = versions.installed_version("deepspeed")
    cols = sorted({c["deepspeed"] for c in cells}, key=column_key)
    head = ["bug"] + [column_label(v, installed) for v in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for bug, probe in probes.registry().items():
        row = {c["deepspeed"]: c for c in cells if c["bug"] == bug}
        if row:
            lines.append(f"| [{bug}]({link(probe.notebook)}) | "
                         + " | ".join(cell_text(row[v]) if v in row else "" for v in cols) + " |")
    return "\n".join(lines)


def save_matrix(cells: list[dict], folder) -> tuple[Path, Path]:
    """``verdict_matrix.json`` and ``verdict_matrix.png`` in ``folder``."""
    import matplotlib.pyplot as plt

    # here, not at import: run-all reads this module to check parameters (0.5 s of matplotlib)
    from gradkit.notebooks import plot_style, verdict_plots

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    js = folder / "verdict_matrix.json"
    js.write_text(json.dumps(cells, indent=1, sort_keys=True))
    png = folder / "verdict_matrix.png"
    fig = verdict_plots.verdict_matrix(cells)
    plot_style.save(fig, png)
    plt.close(fig)
    return js, png


def what_to_do(cells: list[dict], deepspeed: str | None = None) -> list[str]:
    """One sentence per bug for one DeepSpeed version (default: the installed one)."""
    deepspeed = deepspeed or versions.installed_version("deepspeed")
    out = []
    for bug in probes.registry().values():
        cell = next((c for c in cells if c["bug"] == bug.id and c["deepspeed"] == deepspeed), None)
        if cell is None:
            out.append(f"{bug.id} ({bug.title}): not measured on DeepSpeed {deepspeed}; run {bug.notebook}.")
        elif cell["verdict"] == oracle.AFFECTED:
            gas = f"; {gas_text(cell)}" if gas_text(cell) else ""
            out.append(f"{bug.id} ({bug.title}): **affected** on {deepspeed} (the applied gradient is "
                       f"{cell['ratio']:.3f} x the reference at {cell['where']}{gas}). To avoid it: "
                       f"{bug.advice}.")
        elif cell["verdict"] == oracle.NOT_AFFECTED and cell.get("cannot_run"):
            out.append(f"{bug.id} ({bug.title}): not affected on {deepspeed} in the "
                       f"{_count(cell['configs_with_verdict'])} judged (each matches the reference on every "
                       f"signal); {cell['cannot_run']} more could not run here ({cell['cannot_reason'][:160]}), "
                       f"which says nothing of them: see {bug.notebook}.")
        elif cell["verdict"] == oracle.NOT_AFFECTED:
            out.append(f"{bug.id} ({bug.title}): not affected on {deepspeed} ({_count(cell['configs'])} "
                       f"measured, every one matches the reference on every signal); nothing to change.")
        elif cell["verdict"] == oracle.CANNOT_RUN:
            out.append(f"{bug.id} ({bug.title}): could not run {cell['configs_with_verdict']} of {cell['configs']} "
                       f"configurations on {deepspeed} here ({cell['reason'][:160]}); this is not a clean bill of "
                       f"health: see {bug.notebook} (a library's own error is said there with its upstream issue; "
                       f"a device the CPU lacks needs a GPU run).")
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


def violations(cells: list[dict], bugs=(), versions_run=None) -> list[str]:
    """What must hold for the matrix to be trusted; the overview notebook asserts the list is empty.

    Every requested bug has a cell on every version run; an ``affected`` cell's number is off 1 (or its
    cosine is); a ``not-affected`` cell's number is 1 within the loosest (bf16) tolerance.
    """
    out = []
    loose = tolerances.tolerance("bf16").norm_ratio
    if versions_run is not None:
        want = {versions.installed_version("deepspeed") if v == kconfig.INSTALLED else v for v in versions_run}
        have = {(c["bug"], c["deepspeed"]) for c in cells}
        every = probes.registry()
        for b in bugs or every:
            # a probe whose stack does not name DeepSpeed has one column: its own stack, without DeepSpeed
            cols = want if "deepspeed" in every[b].packages else {NO_DEEPSPEED}
            out += [f"{b} has no verdict on DeepSpeed {v}" for v in sorted(cols) if (b, v) not in have]
    for c in cells:
        ratio, cos = c.get("ratio"), c.get("cosine")
        if c["verdict"] == oracle.NOT_AFFECTED and (ratio is None or abs(ratio - 1) > loose):
            out.append(f"{c['bug']} on {c['deepspeed']}: not-affected but the ratio is {ratio}")
        if c["verdict"] == oracle.AFFECTED and ratio is not None and abs(ratio - 1) <= 1e-4 and (cos or 1) > 1 - 1e-4:
            out.append(f"{c['bug']} on {c['deepspeed']}: affected but ratio {ratio} and cosine {cos} look correct")
        if c["verdict"] not in oracle.VERDICTS:
            out.append(f"{c['bug']} on {c['deepspeed']}: unknown verdict {c['verdict']!r}")
    return out
