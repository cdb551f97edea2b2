"""Execute the notebooks with papermill and collect their verdicts into one summary.

    python -m kit.runall [--params scripts/params/quick.yaml] [--out runs/latest] [--timeout 900] [NOTEBOOK ...]

Parameters are checked against each notebook's ``parameters`` cell (``papermill.inspect_notebook``)
before anything runs: papermill itself only warns about unknown names. Each notebook writes its
records and findings into ``RESULTS_DIR`` (set to ``--out``); a failing notebook is reported with
its failing cell and does not stop the others. Writes ``summary.json`` and ``summary.md``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from kit import config as kconfig
from kit import records, report

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"
KERNEL = "gradkit"


def notebook_parameters(path) -> dict:
    import papermill

    return {k: v for k, v in papermill.inspect_notebook(str(path)).items()}


def validate_parameters(path, params: dict, known: dict | None = None) -> None:
    """Raise ``ConfigError`` naming every parameter the notebook does not have."""
    known = notebook_parameters(path) if known is None else known
    if not known:
        raise kconfig.ConfigError(f"{path} has no cell tagged 'parameters'")
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise kconfig.ConfigError(f"{Path(path).name}: unknown parameter(s) {unknown}; it has {sorted(known)}")


def load_params(path) -> dict:
    """``{"defaults": {...}, "notebooks": {stem: {...}}}`` from a YAML file (both keys optional)."""
    import yaml

    if path is None:
        return {"defaults": {}, "notebooks": {}}
    data = yaml.safe_load(Path(path).read_text()) or {}
    extra = set(data) - {"defaults", "notebooks"}
    if extra:
        raise kconfig.ConfigError(f"{path}: unknown top-level key(s) {sorted(extra)}; use 'defaults' and 'notebooks'")
    return {"defaults": data.get("defaults") or {}, "notebooks": data.get("notebooks") or {}}


def params_for(path: Path, spec: dict, out: Path) -> dict:
    known = notebook_parameters(path)
    params = {k: v for k, v in spec["defaults"].items() if k in known}  # defaults apply where they fit
    params.update(spec["notebooks"].get(path.stem, {}))  # named ones must fit
    if "RESULTS_DIR" in known:
        params["RESULTS_DIR"] = str(out)
    validate_parameters(path, params, known)
    return params


def execute(path: Path, out: Path, params: dict, timeout_s: float) -> dict:
    import papermill

    executed = out / path.name
    t0 = time.time()
    entry = {"notebook": path.name, "executed": str(executed), "parameters": params}
    try:
        papermill.execute_notebook(str(path), str(executed), parameters=params, kernel_name=KERNEL,
                                   cwd=str(REPO), execution_timeout=timeout_s, progress_bar=False)
        entry["status"] = "ok"
    except papermill.PapermillExecutionError as e:
        entry.update(status="failed", error=f"cell {e.exec_count}: {e.ename}: {e.evalue}"[:1000])
    except Exception as e:  # noqa: BLE001 - a kernel that dies or times out is a failed notebook, not a crash
        entry.update(status="failed", error=f"{type(e).__name__}: {e}"[:1000])
    entry["wall_s"] = round(time.time() - t0, 1)
    recs_path = out / f"{path.stem}.jsonl"
    entry["records"] = records.load(recs_path) if recs_path.exists() and entry["status"] == "ok" else []
    return entry


def summarise(entries: list[dict], out: Path) -> tuple[Path, Path]:
    summary = [{k: v for k, v in e.items() if k != "records"} | {"verdicts": report.verdict_rows(e["records"])}
               for e in entries]
    js = out / "summary.json"
    js.write_text(json.dumps(summary, indent=1, default=str))
    lines = ["# gradkit run-all summary", ""]
    for e in entries:
        lines.append(f"## [{e['notebook']}]({Path(e['executed']).name}) — {e['status']} in {e['wall_s']} s")
        if e["status"] != "ok":
            lines.append(f"\n**Failed:** `{e['error']}`\n")
            continue
        lines += ["", report.verdict_table(e["records"]), ""]
    md = out / "summary.md"
    md.write_text("\n".join(lines) + "\n")
    return md, js


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="*", help="notebooks to run (default: notebooks/*.ipynb)")
    ap.add_argument("--params", help="YAML file of parameters (scripts/params/*.yaml)")
    ap.add_argument("--out", default=str(REPO / "runs" / "latest"), help="folder for executed notebooks and summary")
    ap.add_argument("--timeout", type=float, default=1800, help="per-cell execution timeout in seconds")
    a = ap.parse_args(argv)
    kconfig.check_timeout(a.timeout)
    paths = [Path(p) for p in a.notebooks] or sorted(NOTEBOOKS.glob("*.ipynb"))
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise kconfig.ConfigError(f"no such notebook(s): {missing}")
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    spec = load_params(a.params)
    unknown_nb = set(spec["notebooks"]) - {p.stem for p in paths}
    if unknown_nb:
        raise kconfig.ConfigError(f"parameters given for notebook(s) not being run: {sorted(unknown_nb)}")
    plan = [(p, params_for(p, spec, out)) for p in paths]  # every parameter checked before the first run
    entries = []
    for p, params in plan:
        print(f"running {p.name} ...", flush=True)
        entries.append(execute(p, out, params, a.timeout))
        print(f"  {entries[-1]['status']} in {entries[-1]['wall_s']} s", flush=True)
    md, js = summarise(entries, out)
    failed = [e["notebook"] for e in entries if e["status"] != "ok"]
    print(f"executed notebooks: {out}\nsummary: {md}\n         {js}")
    if failed:
        print(f"FAILED: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except kconfig.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
