"""Sweep the DeepSpeed configuration space with the check's oracle, and group what is affected.

    python -m gradkit.commands.sweep scripts/sweeps/default.yaml --out runs/sweep      # resumes what is already there
    python -m gradkit.commands.sweep scripts/sweeps/default.yaml --deepspeed 0.18.6,installed --out runs/sweep

A spec (YAML) names a ``base`` config, ``axes`` (dotted config keys, or ``loop``, ``dtype``, ``ga``, ``model``: a
shape of ``gradkit.shapes``), ``skip``
rules (partial points that make no sense), the ``world_size`` and the ``stacks``. Every point of the
product is one case of ``gradkit.probes.ds_config``; every point of one stack runs inside one world, after
one plain-torch control per GA. A point that crashes or desynchronises the world costs only itself: the
world is relaunched and goes on after it. Each judged point is appended to ``records.jsonl`` as it comes
back (a re-run into the same folder skips those), with a tqdm bar and its ETA.

The affected points are then grouped by the smallest set of axis conditions (``axis in {values}``) that
holds for all of them and for no point that is not affected (``groups``); each group is named by the known
bug that explains its points (``gradkit.commands.check.explain``) or marked **unknown**. For an unknown group the sweep
writes a standalone reproduction (plain DeepSpeed + torch, no kit import) and runs it to verify it.

Where each part is: ``spec`` (the spec and its points), ``run`` (the worlds, the records, the reproductions, the
summary), ``grouping`` (the smallest key sets), ``tables``; notebook 06's own logic is ``gradkit.notebooks.sweep``."""
from __future__ import annotations

import json
import time

from gradkit import config as kconfig
from gradkit.commands.sweep import grouping
from gradkit.commands.sweep import run as sweep_run
from gradkit.commands.sweep import spec as sweep_spec
from gradkit.commands.sweep import tables as sweep_tables
from gradkit.notebooks import readme_tables
from gradkit.probes import runner


def main(argv=None) -> int:
    p = kconfig.Parser(prog="python -m gradkit.commands.sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("spec")
    p.add_argument("--out", default="runs/sweep")
    p.add_argument("--deepspeed", help="comma list of DeepSpeed releases to sweep instead of the spec's stacks "
                                       "(installed = the installed one), e.g. 0.18.6,installed")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--retry-cannot-run", action="store_true", help="run the points that were cannot-run again")
    p.add_argument("--jobs", type=int, default=sweep_run.JOBS, help=f"worlds at a time (default {sweep_run.JOBS})")
    p.add_argument("--readme", help="replace this file's <!-- gradkit:table SWEEP --> block with the groups")
    a = p.parse_args(argv)
    spec = sweep_spec.load_spec(a.spec)
    if a.deepspeed:
        spec = sweep_spec.check_spec({**spec, "stacks": runner.stacks_of([v.strip() for v in a.deepspeed.split(",") if v.strip()])},
                          a.spec)
    t0 = time.time()
    recs = sweep_run.run(spec, a.out, progress=not a.no_progress, retry=a.retry_cannot_run, jobs=a.jobs)
    out = kconfig.repo_path(a.out)
    summary = sweep_run.summarise(spec, recs, out)
    summary["wall_s"] = round(time.time() - t0, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    for s in summary["stacks"]:
        print(f"stack {runner.stack_label(s['stack'])} (DeepSpeed {s['deepspeed']}): {s['configs']} configs, "
              + ", ".join(f"{n} {v}" for v, n in s["counts"].items() if n))
        for g in s["groups"]:
            print("  " + grouping.describe(g))
            if g.get("repro"):
                print(f"    {g['repro']['script']}: {'reproduces' if g['repro']['reproduced'] else 'does NOT reproduce'} "
                      f"(exit {g['repro']['exit']}): {g['repro']['output'].splitlines()[0][:200]}")
    print(f"{len(recs)} records in {out / 'records.jsonl'}; {summary['wall_s']} s")
    if a.readme:
        given = argv if argv is not None else __import__("sys").argv[1:]
        command = "python -m gradkit.commands.sweep " + " ".join(given)
        path = kconfig.repo_path(a.readme)
        text, done = readme_tables.fill(path.read_text(), {"SWEEP": sweep_tables.table(summary, command)})
        path.write_text(text)
        print(f"{path}: {'replaced the sweep table' if done else 'has no <!-- gradkit:table SWEEP --> block'}")
    return 0

