"""Many configs checked as one set (``gradkit check DIR`` or several files), at one DeepSpeed release or several
(``--deepspeed 0.18.6,0.19.8``: a matrix, every config at every release): one table, config x release x precision
x loop, with the verdict, the ratio, the cosine and the known bug or the reason, as Markdown and JSON, and one exit
status.

Every cell is read and resolved before anything launches (one that cannot be is a ``bad input`` row with its
sentence; the others still run). The cells run here one after another in warm worlds (``gradkit.launch.warm_worlds``:
the ranks of a stack start once and serve every config of the set), or on a Dask cluster (``--scheduler``,
``gradkit.commands.check.matrix``), each cell the same function (``gradkit.commands.check.task.check_task``). The set's
exit status: 1 if any cell is affected (measured), else 2 if any was bad input, else 3 if any could not be judged,
else 0.
"""
from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

from tqdm import tqdm

from gradkit import config as kconfig
from gradkit import frameworks, launch
import gradkit.commands.check.task as task
from gradkit.judge import oracle
from gradkit.judge import verdict as kverdict

SUFFIXES = (".json", ".yaml", ".yml", ".conf", ".sh")
BAD_INPUT = task.BAD_INPUT
SCHEDULERS = {"dask": "gradkit.commands.check.matrix"}  # imported only when asked for (Dask's import takes a second)


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


def _rows(result: dict, several: bool = False) -> list[dict]:
    """One table row per precision x loop of a checked config (and its release, where the set has several)."""
    out = []
    at = {"deepspeed": result.get("release")} if several else {}
    for dtype, o in result["precisions"].items():
        s = o["summary"]
        if o.get("not_here") or not s["loops"]:
            out.append({"config": result["source"], **at, "precision": dtype, "loop": "-",
                        "verdict": "not run here" if o.get("not_here") else s["verdict"], "ratio": None,
                        "cosine": None, "bug_or_reason": o.get("not_here") or s.get("error") or "nothing judged"})
            continue
        for row in s["loops"]:
            why = (row.get("explained_by") or row.get("explanation") or "") if row["verdict"] == oracle.AFFECTED else \
                ("" if row["verdict"] == oracle.NOT_AFFECTED else row["reason"])
            out.append({"config": result["source"], **at, "precision": dtype, "loop": row["loop"], "verdict": row["verdict"],
                        "ratio": row["ratio"], "cosine": row["cosine"], "bug_or_reason": (why or "")[:200]})
    if result.get("trainer"):  # the Trainer's side of a run on DeepSpeed (check.paths.trainer_side)
        out += _rows({**result["trainer"], "source": result["source"], "release": result.get("release")}, several)
    return out


def markdown(rows: list[dict], verdict: str, code: int) -> str:
    several = any("deepspeed" in r for r in rows)
    lines = ["| config |" + (" deepspeed |" if several else "") + " precision | loop | verdict | ratio | cosine | "
             "known bug or reason |", "|---|" + ("---|" if several else "") + "---|---|---|---|---|---|"]
    for r in rows:
        reason = r["bug_or_reason"].replace("|", "/").replace("\n", " ")
        lines.append(f"| {r['config']} |" + (f" {r.get('deepspeed', '-')} |" if several else "") +
                     f" {r['precision']} | {r['loop']} | {r['verdict']} | "
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


def tasks_of(sources, a) -> tuple[list[dict], list[dict]]:
    """Every (config, release) cell of the set, each read and resolved here before anything launches, and a
    ``bad input`` result for each cell that cannot be. ``sources``: config files, or ``("command", line)``."""
    args = {k: v for k, v in vars(a).items() if k not in ("config", "command", "out", "json", "scheduler")}
    cells, bad = [], []
    for source in sources:
        for release in a.releases:
            cell = {"source": None if isinstance(source, tuple) else source,
                    "command": source[1] if isinstance(source, tuple) else None, "release": release, "args": args}
            try:
                task.prepare(cell)
                cells.append(cell)
            except kconfig.ConfigError as e:
                bad.append(task.bad_input(cell, str(e)))
    return cells, bad


def run_here(cells: list[dict], say) -> list[dict]:
    """The cells one after another in this process; the ranks of each stack start once (warm worlds)."""
    out = []
    with launch.warm_worlds(keep=False):
        bar = tqdm(cells, desc="configs", unit="config", file=sys.stdout, mininterval=2.0, ascii=True)
        for cell in bar:
            bar.set_postfix_str(Path(cell["source"] or "command line").name, refresh=False)
            out.append(task.check_task(cell))
            say(bar.write, out[-1])
    return out


def _said(write, result: dict) -> None:
    write(f"{result['source']} @ DeepSpeed {result['release']}: {result['verdict']} ({result['wall_s']:.1f} s)")


def main(sources, skipped, a) -> int:
    """``sources``: config files, or ``("command", line)``; each is checked at every release of ``a.releases``,
    here or on a distributed engine (``a.scheduler``: ``gradkit.commands.check.matrix``)."""
    for f, why in skipped:
        print(f"skipped {f}: {why}")
    cells, bad = tasks_of(sources, a)
    if a.scheduler == "here":
        results = run_here(cells, _said)
    else:
        results = importlib.import_module(SCHEDULERS["dask"]).run(cells, a.scheduler, lambda r: _said(print, r))
    results = bad + results
    several = len(a.releases) > 1
    rows = [r for res in results for r in _rows(res, several)] + [
        {"config": res["source"], **({"deepspeed": res["release"]} if several else {}), "precision": "-", "loop": "-",
         "verdict": BAD_INPUT, "ratio": None, "cosine": None, "bug_or_reason": res["error"]}
        for res in results if res["verdict"] == BAD_INPUT]
    order = {"command line" if isinstance(s, tuple) else str(s): i for i, s in enumerate(sources)}  # as named or found
    rows.sort(key=lambda r: (order.get(r["config"], 0), r.get("deepspeed", "")))
    verdict, code = set_exit(results)
    table = markdown(rows, verdict, code)
    print(table)
    timed = [r["wall_s"] for r in results if "wall_s" in r]
    if timed:
        print(f"{len(timed)} configs checked in {sum(timed):.1f} s ({sum(timed) / len(timed):.1f} s per config)")
    doc = {"verdict": verdict, "exit": code, "rows": rows, "skipped": [{"file": f, "why": w} for f, w in skipped],
           "configs": [{k: v for k, v in r.items() if k not in ("precisions", "log")} for r in results]}
    if a.out:
        Path(f"{a.out}.md").write_text(table + "\n")
        Path(f"{a.out}.json").write_text(json.dumps(doc, indent=1, default=str))
    if a.json:
        Path(a.json).write_text(json.dumps({**doc, "results": results}, indent=1, default=str))
    return code
