"""What a run-all leaves in its folder besides the executed notebooks: ``run.json`` (the run's id and every notebook's
status), ``summary.json`` / ``summary.md`` (every notebook with its verdicts, the verdict matrix, what changed since the
previous run into the same folder) and ``verdict_matrix.png`` / ``.json``.
"""
from __future__ import annotations

import json
from pathlib import Path

from gradkit import probes
from gradkit.judge import records
from gradkit.judge import tables
from gradkit.notebooks import overview


def read_run_file(out: Path) -> dict:
    """``run.json`` of a folder as ``{"run_id", "notebooks": {name: {"status", "run_id"}}}`` (empty if none)."""
    try:
        run = json.loads((out / records.RUN_FILE).read_text())
        return {"run_id": run["run_id"], "notebooks": {
            k: (v if isinstance(v, dict) else {"status": v, "run_id": run["run_id"]}) for k, v in run["notebooks"].items()}}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {"run_id": None, "notebooks": {}}


def write_run_file(out: Path, run_id: str, entries: list[dict]) -> Path:
    """``run.json``: this run's id, and every notebook of the folder with its status and the run that last executed
    it -- the notebooks of this run updated, the others kept (what ``records.run_records`` trusts)."""
    run = read_run_file(out)
    notebooks = {**run["notebooks"], **{e["notebook"]: {"status": e["status"], "run_id": run_id} for e in entries}}
    path = out / records.RUN_FILE
    path.write_text(json.dumps({"run_id": run_id, "notebooks": notebooks}, indent=1, sort_keys=True))
    return path


def previous_summary(js: Path) -> dict:
    """The summary of the last run into this folder; ``{}`` when there is none to build on (no summary, an
    unreadable one, or one written by an older kit in another shape)."""
    try:
        old = json.loads(js.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(old, dict) or not isinstance(old.get("notebooks", []), list):
        return {}
    old["notebooks"] = [e for e in old.get("notebooks", []) if isinstance(e, dict) and "notebook" in e
                        and "executed" in e and "status" in e]
    return old


def summarise(entries: list[dict], out: Path, run_id: str, params_file: str | None = None,
              stopped: str | None = None, prefetch: dict | None = None) -> tuple[Path, Path]:
    """``summary.json`` / ``summary.md`` and the verdict matrix over every notebook that ran in run ``run_id``."""
    js = out / "summary.json"
    before = previous_summary(js)
    write_run_file(out, run_id, entries)  # the run's id and every notebook's final status
    # One folder, one truth: the notebooks of this run, and those an earlier run left here (with the run id
    # that produced them); records only of the run that last executed each notebook, only if it finished.
    mine = {e["notebook"] for e in entries}
    entries = entries + [{**e, "from_run": e.get("run_id") or before.get("run_id")}
                         for e in before.get("notebooks", []) if e["notebook"] not in mine]
    by_nb = {e["notebook"]: records.run_records(out, {Path(e["notebook"]).stem})[0] for e in entries}
    for e in entries:
        e.setdefault("run_id", run_id)
    cells = overview.verdict_matrix([r for recs in by_nb.values() for r in recs])
    previous = before.get("matrix") if isinstance(before.get("matrix"), list) else None
    changed = None
    if previous is not None:  # compared only where a notebook ran again with the same parameters
        old = {e["notebook"]: e.get("parameters") for e in before.get("notebooks", [])}
        same = {b.id for b in probes.registry().values() if b.notebook in mine and b.notebook in old
                and old[b.notebook] == next(e.get("parameters") for e in entries if e["notebook"] == b.notebook)}
        rerun = {b.id for b in probes.registry().values() if b.notebook in mine}
        keep = lambda cs: [c for c in cs if c["bug"] in same or c["bug"] not in rerun]  # noqa: E731
        changed = overview.differences(keep(previous), keep(cells))
    if cells:
        overview.save_matrix(cells, out)
    summary = {"notebooks": [{**e, "verdicts": tables.verdict_rows(by_nb[e["notebook"]])} for e in entries],
               "matrix": cells, "changed_since_previous": changed, "run_id": run_id, "params_file": params_file,
               "stopped": stopped, "prefetch": prefetch}
    js.write_text(json.dumps(summary, indent=1, default=str))
    ok = sum(e["status"] == "ok" for e in entries)
    lines = ["# gradkit run-all summary", "",
             f"{ok} of {len(entries)} notebooks ran to the end (their last cells assert what they found).", ""]
    if prefetch and (prefetch["wall_s"] or prefetch["problems"]):
        lines += [f"Prefetch ({prefetch['wall_s']} s before the notebooks): " + "; ".join(prefetch["done"] + [
            f"**not ready:** {p}" for p in prefetch["problems"]]) + ".", ""]
    if stopped:
        lines += [f"**The run was stopped ({stopped})**: the notebooks marked `stopped` were killed with their "
                  "kernels and ranks, or never started; what finished before is below.", ""]
    if cells:
        link = lambda nb: nb  # noqa: E731 - the executed copies sit next to this file
        lines += ["## Verdict matrix", "", "![verdict matrix](verdict_matrix.png)", "",
                  overview.matrix_table(cells, link=link), "",
                  "Each cell: the worst verdict of the probe's measured configuration on that DeepSpeed release, "
                  "with the effective/reference ratio (1.000 = correct; B2: the pipeline stage furthest from 1; B1: the "
                  "Trainer's step, with whether GAS changes it, and the steps without DeepSpeed in their own column) and "
                  "the cosine of the configuration shown.", ""]
    if changed is not None:
        lines += ["Verdicts identical to the previous run into this folder." if not changed else
                  "**Verdicts changed since the previous run into this folder:** " + "; ".join(changed), ""]
    for e in entries:
        earlier = f" (from the earlier run {e['from_run']})" if e.get("from_run") else ""
        lines.append(f"## [{e['notebook']}]({Path(e['executed']).name}) — {e['status']} in {e['wall_s']} s{earlier}")
        if e.get("retried"):
            lines += ["", f"Started twice: {e['retried']}."]
        if e["status"] != "ok":
            cell = e.get("failing_cell") or {}
            lines += ["", f"**{e['status'].capitalize()}:** `{e['error']}`", ""]
            if cell.get("source"):
                lines += [f"Cell {cell['index']}:", "", "```python", cell["source"], "```", ""]
            continue
        if by_nb[e["notebook"]]:
            lines += ["", tables.verdict_table(by_nb[e["notebook"]]), ""]
    md = out / "summary.md"
    md.write_text("\n".join(lines) + "\n")
    return md, js
