"""The docs' result tables, written from a run's records (never typed by hand).

    python -m gradkit.notebooks.readme_tables runs/full                        # print every bug's table (markdown)
    python -m gradkit.notebooks.readme_tables runs/full --readme docs/bugs.md  # replace that page's generated blocks in place

A generated block sits between ``<!-- gradkit:table B4 -->`` and ``<!-- /gradkit:table -->`` on a page (the bugs'
tables on ``PAGE``, docs/bugs.md, the default of ``--readme`` without a file; the sweep's, the performance and the
mutation tables on their own pages, written by their own commands with ``fill``); its first line names the run
it came from (run id, parameters file) so a reader can reproduce it. Releases are the ones a run's records
really imported; a release the run did not measure is simply not in the table.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from gradkit import config as kconfig
from gradkit.judge import oracle, records
from gradkit.judge.tables import markdown_table
from gradkit.stacks.versions import version_key


def _ds(r: dict) -> str:
    return (r.get("versions") or {}).get("deepspeed") or r["version"]


def _ratio(r: dict) -> str:
    m = r.get("metrics")
    return f"{m['norm_ratio']:.3f}" if m else r["verdict"]


def b4(recs: list[dict]) -> str:
    """Per release and case, at the largest GA and the notebook's own world size: ratio, cosine, rel. error,
    the misplaced weight of each rank's accumulator against (W-1)/W * 1/GA, verdict."""
    main = [r for r in recs if r["case"] in ("leak", "workaround") and r["role"] != "symptom"]
    if not main:
        return ""
    w = min(r["world_size"] for r in main)
    ga = max(r["ga"] for r in main if r["world_size"] == w)
    rows = []
    for r in sorted((r for r in main if r["world_size"] == w and r["ga"] == ga), key=lambda r: (version_key(_ds(r)), r["case"])):
        m = r.get("metrics") or {}
        bufs = [b["attribution"]["misplaced_weight"] for b in r.get("rank_buffers") or []]
        rows.append({"DeepSpeed": _ds(r), "case": "bug config" if r["case"] == "leak" else "`immediate_grad_update: true`",
                     "ratio eff/ref": m.get("norm_ratio"), "cosine": m.get("cosine"), "rel. error": m.get("rel_l2"),
                     "misplaced (per rank)": " / ".join(f"{b:.4f}" for b in bufs) or "-",
                     "predicted": f"{r.get('predicted_misplaced_weight', float('nan')):.4f}" if r["case"] == "leak" else "-",
                     "verdict": r["verdict"]})
    return (f"W = {w}, GA = {ga}, bf16 + `grad_accum_dtype: fp32` + ZeRO-1:\n\n"
            + markdown_table(rows, list(rows[0])))


def b3(recs: list[dict]) -> str:
    """Per ZeRO stage (fp32, the largest W): the manual loop's ratio at every N > 1 on each release, what the
    applied gradient matches, and the configuration's verdict (N = 1 as its second control)."""
    manual = [r for r in recs if r["case"] == "manual" and r["dtype"] == "fp32"]
    if not manual:
        return ""
    w = max(r["world_size"] for r in manual)
    ns = sorted({r["ga"] for r in manual if r["ga"] > 1})
    rows = []
    for stage in sorted({r["zero_stage"] for r in manual}):
        by_release: dict = {}
        for r in manual:
            if r["zero_stage"] == stage and r["world_size"] == w:
                by_release.setdefault(_ds(r), []).append(r)
        # releases that give the same numbers share a row
        groups: dict = {}
        for ds, sel in sorted(by_release.items(), key=lambda kv: version_key(kv[0])):
            at = {r["ga"]: r for r in sel}
            ratios = " / ".join(_ratio(at[n]) if n in at else "-" for n in ns)
            matches = sorted({r.get("matches") or "-" for r in sel if r["ga"] > 1})
            verdict = (sel[0].get("config_verdict") or sel[0]["verdict"])
            groups.setdefault((ratios, tuple(matches), verdict), []).append(ds)
        for (ratios, matches, verdict), releases in groups.items():
            rows.append({"ZeRO": stage, "DeepSpeed": ", ".join(releases), f"ratio at N = {' / '.join(map(str, ns))}": ratios,
                         "matches": ", ".join(matches), "verdict": verdict})
    return f"fp32, W = {w}, config GA = 1, N manual `backward()` calls, one `step()`:\n\n" + markdown_table(rows, list(rows[0]))


def b2(recs: list[dict]) -> str:
    """Per release (fp32, the smallest W, the largest GA, ZeRO-0 where it ran, else ZeRO-1): each stage's ratio,
    the logged grad norm over the reference's, and the record's verdict (its worst stage)."""
    pipe = [r for r in recs if r["case"] == "pipeline" and r["dtype"] == "fp32"]
    if not pipe:
        return ""
    w = min(r["world_size"] for r in pipe)
    ga = max(r["ga"] for r in pipe)
    rows = []
    for ds in sorted({_ds(r) for r in pipe}, key=version_key):
        sel = sorted((r for r in pipe if _ds(r) == ds and r["world_size"] == w and r["ga"] == ga),
                     key=lambda r: (r["verdict"] == oracle.CANNOT_RUN, r["zero_stage"]))
        if not sel:
            continue
        r = sel[0]
        stages = {s["stage"]: s["metrics"]["norm_ratio"] for s in r.get("stages") or []}
        logged = r.get("logged_grad_norm")
        rows.append({"DeepSpeed": ds, "ZeRO": r["zero_stage"], "stage 0": stages.get(0), "stage 1 (last)": stages.get(1),
                     "logged grad norm / reference": logged / r["reference_grad_norm"] if logged else None,
                     "verdict": r["verdict"]})
    mb = next(r["config"]["micro_batch"] for r in pipe if r["ga"] == ga)
    return (f"{w // 2} data-parallel replica(s) x 2 stages, fp32, one global batch split {mb} x {ga} (micro-batch x GA); "
            "effective/reference ratio per stage:\n\n" + markdown_table(rows, list(rows[0])))


def b1(recs: list[dict]) -> str:
    """Per stack and path: the effective/reference ratio at GAS = 1 and at the largest GAS, and the two verdicts."""
    steps = [r for r in recs if r["case"] in ("trainer", "gas1")]
    if not steps:
        return ""
    gas = max(r["ga"] for r in steps)
    rows = []
    for label in dict.fromkeys(r["version"] for r in steps):
        for path in dict.fromkeys(r["path"] for r in steps if r["version"] == label):
            one = next((r for r in steps if r["version"] == label and r["path"] == path and r["ga"] == 1), None)
            top = next((r for r in steps if r["version"] == label and r["path"] == path and r["ga"] == gas), None)
            if top is None:
                continue
            v = top.get("versions") or (top.get("stack") or {})
            rows.append({"transformers / DeepSpeed": f"{v.get('transformers', 'installed')} / {v.get('deepspeed', 'installed')}",
                         "path": path, f"ratio at GAS 1 -> {gas}": f"{_ratio(one) if one else '-'} -> {_ratio(top)}",
                         "token factor": top.get("token_factor"),
                         "GAS-invariant": {"not-affected": "yes", "affected": "**no**"}.get(top.get("gas_verdict"),
                                                                                            top.get("gas_verdict")),
                         "matches the reference": {"not-affected": "yes", "affected": "**no**"}.get(top["verdict"],
                                                                                                   top["verdict"])})
    w = steps[0]["world_size"]
    return f"one real `Trainer` step, tiny Qwen3, W = {w}:\n\n" + markdown_table(rows, list(rows[0]))


PAGE = "docs/bugs.md"  # the page of the bugs' tables: "What the notebooks measured"
TABLES = {"B1": ("01_trainer_loss_kwargs", b1), "B2": ("02_pipeline_ga", b2), "B3": ("03_zero_boundary", b3),
          "B4": ("04_bf16_leak", b4)}
BLOCK = re.compile(r"(<!-- gradkit:table (B\d+|SWEEP|PERF|MUTATION|RANGES|SUPPORT|SCALE|VERDICT_[A-Z_]+) -->\n)(.*?)(<!-- /gradkit:table -->)", re.S)


def render(folder) -> dict[str, str]:
    """``{bug: markdown}`` from the records of the last run into ``folder`` (notebooks that finished only)."""
    folder = kconfig.repo_path(folder)
    run = json.loads((folder / records.RUN_FILE).read_text())
    params = _params_file(folder)
    out = {}
    for bug, (stem, make) in TABLES.items():
        recs, _ = records.run_records(folder, {stem})
        body = make([r for r in recs if r.get("bug") == bug]) if recs else ""
        if body:
            name = folder.relative_to(kconfig.REPO_ROOT) if folder.is_relative_to(kconfig.REPO_ROOT) else folder
            out[bug] = (f"<sub>generated by `python -m gradkit.notebooks.readme_tables {name}` from run {run['run_id']}"
                        f"{f' ({params})' if params else ''}</sub>\n\n{body}\n")
    return out


def _params_file(folder: Path) -> str | None:
    try:
        return json.loads((folder / "summary.json").read_text()).get("params_file")
    except (OSError, ValueError, AttributeError):
        return None


def fill(text: str, tables: dict[str, str]) -> tuple[str, list[str]]:
    """``text`` with every generated block replaced by its table (a block whose bug has none is left alone)."""
    done = []

    def sub(m):
        if m.group(2) not in tables:
            return m.group(0)
        done.append(m.group(2))
        return m.group(1) + tables[m.group(2)] + m.group(4)

    return BLOCK.sub(sub, text), done


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Write the bugs' result tables (docs/bugs.md) from a run-all folder's records.")
    ap.add_argument("folder", help="a run-all output folder (e.g. runs/full)")
    ap.add_argument("--readme", nargs="?", const=PAGE, metavar="FILE",
                    help=f"replace the generated blocks of FILE (default {PAGE}) in place")
    a = ap.parse_args(argv)
    folder = kconfig.repo_path(a.folder)
    if not (folder / records.RUN_FILE).exists():
        raise kconfig.ConfigError(f"{folder} has no {records.RUN_FILE}: give a folder written by `python -m gradkit.notebooks.runall`")
    tables = render(folder)
    if not a.readme:
        for bug, t in tables.items():
            print(f"## {bug}\n\n{t}")
        return 0
    path = kconfig.repo_path(a.readme)
    text, done = fill(path.read_text(), tables)
    path.write_text(text)
    print(f"{path}: replaced the tables of {', '.join(done) or 'no bug'} from {folder}")
    return 0


if __name__ == "__main__":
    kconfig.run_cli(main)
