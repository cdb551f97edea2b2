"""Many configs checked as one set (``gradkit check DIR`` or several files): one table, config x precision x loop,
with the verdict, the ratio, the cosine and the known bug or the reason, as Markdown and JSON, and one exit status.

Every config is read and resolved before anything launches (one that cannot be is a ``bad input`` row with its
sentence; the others still run). The checks run one after another in warm worlds (``kit.launch.warm_worlds``): the
ranks of a stack start once and serve every config of the set. The set's exit status: 1 if any config is affected
(measured), else 2 if any was bad input, else 3 if any could not be judged, else 0.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

from kit import config as kconfig
from kit import frameworks, launch
from kit.commands.check import one, paths
from kit.judge import oracle
from kit.judge import verdict as kverdict

SUFFIXES = (".json", ".yaml", ".yml", ".conf", ".sh")
BAD_INPUT = "bad input"


def expand(paths) -> tuple[list[str], list[tuple[str, str]]]:
    """The config files named or found (recursively) in the folders named, and ``(file, why)`` for each file
    of a folder that is no config the kit reads. A file named on the command line is always read."""
    files, skipped = [], []
    for p in map(Path, paths):
        if not p.is_dir():
            if not p.exists():
                raise kconfig.ConfigError(f"{p}: no such file or folder")
            files.append(str(p))
            continue
        found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in SUFFIXES)
        if not found:
            raise kconfig.ConfigError(f"{p}: no config file in it (looked for {', '.join(SUFFIXES)})")
        for f in found:
            try:
                frameworks.detect(f)
                files.append(str(f))
            except kconfig.ConfigError as e:
                skipped.append((str(f), str(e)))
    return files, skipped


def read(path: str):
    """A config file as ``kit.frameworks.read`` reads it, named by its path (a launch line's too)."""
    run = frameworks.read(path)
    run.source = path
    return run


def _rows(result: dict) -> list[dict]:
    """One table row per precision x loop of a checked config."""
    out = []
    for dtype, o in result["precisions"].items():
        s = o["summary"]
        if o.get("not_here") or not s["loops"]:
            out.append({"config": result["source"], "precision": dtype, "loop": "-",
                        "verdict": "not run here" if o.get("not_here") else s["verdict"], "ratio": None,
                        "cosine": None, "bug_or_reason": o.get("not_here") or s.get("error") or "nothing judged"})
            continue
        for row in s["loops"]:
            why = (row.get("explained_by") or row.get("explanation") or "") if row["verdict"] == oracle.AFFECTED else \
                ("" if row["verdict"] == oracle.NOT_AFFECTED else row["reason"])
            out.append({"config": result["source"], "precision": dtype, "loop": row["loop"], "verdict": row["verdict"],
                        "ratio": row["ratio"], "cosine": row["cosine"], "bug_or_reason": (why or "")[:200]})
    return out


def markdown(rows: list[dict], verdict: str, code: int) -> str:
    lines = ["| config | precision | loop | verdict | ratio | cosine | known bug or reason |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        reason = r["bug_or_reason"].replace("|", "/")
        lines.append(f"| {r['config']} | {r['precision']} | {r['loop']} | {r['verdict']} | "
                     f"{kverdict.num(r['ratio'], '.4f')} | {kverdict.num(r['cosine'], '.5f')} | {reason} |")
    lines.append("")
    lines.append(f"set verdict: {verdict} (exit {code})")
    return "\n".join(lines)


def set_exit(results: list[dict]) -> tuple[str, int]:
    """The set's verdict word and exit status (the module's rule)."""
    words = [r["verdict"] for r in results]
    if oracle.AFFECTED in words:
        return oracle.AFFECTED, kverdict.EXIT[oracle.AFFECTED]
    if BAD_INPUT in words:
        return BAD_INPUT, 2
    judged = kverdict.worst([w for w in words if w != BAD_INPUT])
    return judged, kverdict.EXIT[judged]


def main(runs, skipped, a, model, model_notes) -> int:
    """``runs``: training runs already read, or config files to read here (one that cannot be is a row)."""
    for f, why in skipped:
        print(f"skipped {f}: {why}")
    planned, results = [], []
    for run in runs:
        try:
            run = read(run) if isinstance(run, str) else run
            planned.append((run, one.prepare(run, a, model, model_notes) if run.path == "deepspeed" else None))
        except kconfig.ConfigError as e:
            source = run if isinstance(run, str) else run.source
            results.append({"source": source, "framework": getattr(run, "framework", None), "verdict": BAD_INPUT,
                            "exit": 2, "precisions": {}, "error": str(e)})
    log: list[str] = []
    with launch.warm_worlds(keep=False):
        bar = tqdm(planned, desc="configs", unit="config", file=sys.stdout, mininterval=2.0, ascii=True)
        for run, todo in bar:
            bar.set_postfix_str(Path(run.source).name, refresh=False)
            t0 = time.perf_counter()
            result = (one.check(run, todo, a, model, say=log.append) if todo is not None else
                      paths.check(run, a, say=log.append))
            result["wall_s"] = round(time.perf_counter() - t0, 2)
            results.append(result)
            bar.write(f"{run.source}: {result['verdict']} ({result['wall_s']:.1f} s)")
    rows = [r for res in results for r in _rows(res)] + [
        {"config": res["source"], "precision": "-", "loop": "-", "verdict": BAD_INPUT, "ratio": None, "cosine": None,
         "bug_or_reason": res["error"]} for res in results if res["verdict"] == BAD_INPUT]
    order = {str(r if isinstance(r, str) else r.source): i for i, r in enumerate(runs)}  # as named or found
    rows.sort(key=lambda r: order.get(r["config"], 0))
    verdict, code = set_exit(results)
    table = markdown(rows, verdict, code)
    print(table)
    timed = [r["wall_s"] for r in results if "wall_s" in r]
    if timed:
        print(f"{len(timed)} configs checked in {sum(timed):.1f} s ({sum(timed) / len(timed):.1f} s per config)")
    doc = {"verdict": verdict, "exit": code, "rows": rows, "skipped": [{"file": f, "why": w} for f, w in skipped],
           "configs": [{k: v for k, v in r.items() if k != "precisions"} for r in results]}
    if a.out:
        Path(f"{a.out}.md").write_text(table + "\n")
        Path(f"{a.out}.json").write_text(json.dumps(doc, indent=1, default=str))
    if a.json:
        Path(a.json).write_text(json.dumps({**doc, "results": results, "log": log}, indent=1, default=str))
    return code
