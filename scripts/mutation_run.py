"""The mutation run behind ``scripts/mutation.sh``: cosmic-ray's mutants of each module of
``scripts/mutation/targets.yaml``, each run against the tests that reach its line; the score, the survivors and the
wall time into ``runs/mutation/summary.json``.

Which tests a mutant runs comes from the test map (``scripts/testmap.py``: the suite's coverage, per test): the tests
that ran the mutant's statement (the map's lines, while the module is the one it measured), else those that run the
function the mutant is in. They come in two stages: the tests of the pytest process
itself that launch no world (seconds) first, and only if the mutant survives them, the world tests (``world`` marker:
real 2-rank worlds) that reach it, in their own process or in what they start, and the files whose fixtures reach it. A
mutant no test reaches survives ("no test reaches it"). A mutant counts as *killed* when its tests fail or time out (a
mutant that hangs a world is caught by its timeout) or it does not import (pytest's collection fails); *survived* when
every selected test passes. A selection that pytest cannot find (a test renamed since the map was built) is not
counted: it is said, and the mutant stays pending for the next run after ``bash scripts/test.sh --map``. ``--fast``
leaves the world stage out (the score then counts the first stage's survivors). ``--again`` runs the survivors of an
earlier run once more, against the tests as they are now (after tests were added for them). Survivors listed in
``scripts/mutation/equivalent.yaml`` (with why they cannot change any output) leave the score's denominator, and
skip the world stage (their fast stage still runs: a listed mutant that a test kills counts as killed). Score =
killed / (killed + survived - equivalent). ``--workers N`` runs a module's mutants on N checkouts at once
(``scripts/mutation_workers.py``: one per core). ``--readme [FILE]`` (alone) writes ``summary.json``'s table into
that file's ``<!-- gradkit:table MUTATION -->`` block (``PAGE``, docs/tests.md, without a file).
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch  # noqa: F401  (imported once here, before any mutant: each mutant's pytest is forked from this process)
import yaml
from cosmic_ray.work_db import WorkDB, use_db

import testmap
import testmap_readers
import mutation_workers
from mutation_mutant import FAST_TIMEOUT_S, mutate_and_test, restore

REPO = Path(__file__).resolve().parents[1]
HERE = REPO / "scripts" / "mutation"
OUT = REPO / "runs" / "mutation"
BIN = Path(sys.executable).parent
PAGE = "docs/tests.md"  # the page whose <!-- gradkit:table MUTATION --> block ``--readme`` writes without a file


def config(module: str, excluded: list[str]) -> Path:
    """The cosmic-ray session's config: which module, which operators (its test command is not used: each mutant's
    tests come from the test map)."""
    name = module.removesuffix(".py").replace("/", ".")  # one name per module (check/paths.py vs check_paths.py)
    path = OUT / f"{name}.toml"
    before = OUT / (module.replace("/", "_").removesuffix(".py") + ".toml")  # sessions named so before: moved, if
    if not path.exists() and before.exists() and f'module-path = "{module}"' in before.read_text():  # this one's
        for suffix in (".toml", ".sqlite"):
            before.with_suffix(suffix).rename(path.with_suffix(suffix))
    ops = ",\n  ".join(json.dumps(e) for e in excluded)
    path.write_text(f'[cosmic-ray]\nmodule-path = "{module}"\ntimeout = {FAST_TIMEOUT_S}\nexcluded-modules = []\n'
                    f'test-command = "false"\n\n[cosmic-ray.distributor]\nname = "local"\n\n'
                    f"[cosmic-ray.filters.operators-filter]\nexclude-operators = [\n  {ops}\n]\n")
    return path


def outcomes(session: Path) -> list[dict]:
    out = subprocess.run([str(BIN / "cosmic-ray"), "dump", str(session)], capture_output=True, text=True, check=True)
    rows = []
    for line in out.stdout.splitlines():
        work, result = json.loads(line)
        for m in work["mutations"]:
            rows.append({"line": m["start_pos"][0], "operator": m["operator_name"], "occurrence": m["occurrence"],
                         "worker": (result or {}).get("worker_outcome"), "test": (result or {}).get("test_outcome"),
                         "diff": ((result or {}).get("diff") or "")[-600:]})
    return rows


def judge(module: str, rows: list[dict], equivalent: dict, wall_s: float) -> dict:
    done = [r for r in rows if r["worker"] not in (None, "skipped")]
    killed = [r for r in done if r["worker"] in ("normal", "timeout", "exception") and r["test"] != "survived"
              or r["worker"] == "timeout"]
    survived = [r for r in done if r["worker"] == "normal" and r["test"] == "survived"]
    eq = equivalent.get(module) or {}
    named = {f"{r['line']}: {r['operator']}[{r['occurrence']}]" for r in survived}
    equiv = sorted(named & set(eq))
    denominator = len(killed) + len(survived) - len(equiv)
    return {"module": module, "mutants": len(rows), "skipped": sum(r["worker"] == "skipped" for r in rows),
            "pending": sum(r["worker"] is None for r in rows), "killed": len(killed), "survived": len(survived),
            "equivalent": len(equiv), "score": round(len(killed) / denominator, 4) if denominator else None,
            "wall_s": round(wall_s, 1),
            "survivors": [{"where": f"{r['line']}: {r['operator']}[{r['occurrence']}]", "diff": r["diff"]}
                          for r in survived if f"{r['line']}: {r['operator']}[{r['occurrence']}]" not in eq]}


def stages(m: dict, module: str, line: int, where, newer: set[str], source: str,
           col: int | None = None) -> tuple[list[str], list[str]]:
    """The pytest arguments of a mutant's two stages, from the test map: for a top-level value (a constant, a class
    attribute), the tests that ran a statement reading it (``testmap_readers``), else the tests that ran ``line``'s
    statement (the map's lines, where ``source`` is what it measured; else those that reach its function) that launch no
    world, then the world tests that reach it (in their process or what they start) and the files whose fixtures
    do (a file's tests of that kind only). ``newer``, the test files changed since the map was built
    (``tests/x.py::``), are taken whole in the stage their tests belong to. Each stage goes cheapest first (the
    map's durations: a mutant a test kills stops there, ``-x``); a world stage of more than one file runs on two
    workers, a file each (``scripts/test.sh``'s way)."""
    reach = testmap_readers.tests_of_readers(m, module, source, line, col)
    if reach is None:
        reach = testmap.tests_of_line(m, module, source, line)
    if reach is None:
        reach = testmap.tests_of(m, module, {where(line)})
    world = set(m["world_tests"])
    world_files = {t.split("::")[0] for t in world}
    files = sorted({t[:-2] for t in reach | (newer if reach else set()) if t.endswith("::")})
    tests = sorted(t for t in reach if not t.endswith("::") and t.split("::")[0] not in files)
    took = m.get("durations") or {}
    cost = lambda t: took.get(t, sum(v for k, v in took.items() if k.startswith(t + "::")))  # noqa: E731
    fast = sorted([t for t in tests if t not in world] + files, key=cost)  # cheap first too: -x stops at a kill
    slow = sorted([t for t in tests if t in world] + [f for f in files if f in world_files], key=cost)  # cheap first
    workers = ["-n", "2", "--dist", "loadfile"] if len({t.split("::")[0] for t in slow}) > 1 else []
    return ([*fast, "-m", "not world"] if fast else []), ([*slow, "-m", "world", *workers] if slow else [])


def forget_survivors(session: Path) -> None:
    """Mark every survivor of ``session`` as not run, so that the next run runs it again."""
    import sqlite3

    with sqlite3.connect(session) as db:
        db.execute("DELETE FROM work_results WHERE upper(test_outcome) = 'SURVIVED'")


def table(summary: dict, page: str = PAGE, earlier: list[str] = ()) -> str:
    """The mutation table of ``page``: per module its mutants, killed, surviving, equivalent, score and wall time;
    ``earlier``: the page's rows of modules ``summary`` does not hold (measured by an earlier run), kept after them."""
    sys.path.insert(0, str(REPO))
    from gradkit.judge.tables import markdown_table

    rows = [{"module": f"`{m}`", "mutants": s["killed"] + s["survived"], "killed": s["killed"],
             "survived": s["survived"] - s["equivalent"], "equivalent (listed with why)": s["equivalent"],
             "score": f"{s['score']:.3f}" if s["score"] is not None else "-",
             "tests per mutant": s.get("stages", "fast"), "wall time": f"{s['wall_s']:.0f} s"}
            for m, s in summary.items()]
    kept = [line for line in earlier if line.split("`")[1] not in summary]
    return (f"<sub>generated by `bash scripts/mutation.sh` then `bash scripts/mutation.sh --readme {page}` "
            "(2 cores; a module's wall time adds up its first run and each --again, run beside other modules' runs; "
            "its survivors are in runs/mutation/summary.json; a module this run did not mutate keeps its row)</sub>\n\n"
            + "\n".join([markdown_table(rows, list(rows[0])).rstrip("\n"), *kept]) + "\n")


def fill_readme(path: str = PAGE) -> int:
    """Write the mutation table into the MUTATION block of ``path`` (relative to the repository: mutation.sh runs
    from its root)."""
    sys.path.insert(0, str(REPO))
    from gradkit.notebooks import readme_tables

    summary = json.loads((OUT / "summary.json").read_text())
    readme = (REPO / path).resolve()
    page = readme.relative_to(REPO).as_posix() if readme.is_relative_to(REPO) else str(readme)
    now = readme.read_text()
    block = now.split("<!-- gradkit:table MUTATION -->", 1)[-1].split("<!-- /gradkit:table -->", 1)[0]
    earlier = [line for line in block.splitlines() if line.startswith("| `")]
    text, done = readme_tables.fill(now, {"MUTATION": table(summary, page, earlier)})
    readme.write_text(text)
    print(f"{readme}: {'replaced the mutation table' if done else 'has no <!-- gradkit:table MUTATION --> block'}")
    return 0


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stop puts the module back (the finally below)
    if argv[:1] == ["--readme"]:
        return fill_readme(argv[1] if len(argv) > 1 else PAGE)
    spec = yaml.safe_load((HERE / "targets.yaml").read_text())
    equivalent = yaml.safe_load((HERE / "equivalent.yaml").read_text()) or {}
    fast_only, again = "--fast" in argv, "--again" in argv
    argv = [a for a in argv if a not in ("--fast", "--again")]
    workers = 1
    if "--workers" in argv:
        at = argv.index("--workers")
        if at + 1 >= len(argv) or not argv[at + 1].isdigit() or int(argv[at + 1]) < 1:
            print("error: --workers takes a number of checkouts, 1 or more (one per core)", file=sys.stderr)
            return 2
        workers = int(argv[at + 1])
        argv = argv[:at] + argv[at + 2:]
    modules = argv or list(spec["targets"])
    unknown = [m for m in modules if m not in spec["targets"]]
    if unknown:
        print(f"error: not a mutation target: {unknown}; scripts/mutation/targets.yaml has {list(spec['targets'])}",
              file=sys.stderr)
        return 2
    OUT.mkdir(parents=True, exist_ok=True)
    summary_path = OUT / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    m = testmap.load()
    if m is None:
        print("error: no test map to choose each mutant's tests: build it with `bash scripts/test.sh --map`",
              file=sys.stderr)
        return 2
    for module in modules:
        cfg = config(module, spec["operators_excluded"])
        session = cfg.with_suffix(".sqlite")
        if not session.exists():
            subprocess.run([str(BIN / "cosmic-ray"), "init", str(cfg), str(session)], cwd=REPO, check=True)
            subprocess.run([str(BIN / "cr-filter-operators"), str(session), str(cfg)], cwd=REPO, check=True)
        if again:
            forget_survivors(session)
        t0 = time.monotonic()
        source = (REPO / module).read_text()
        where = testmap.functions(source)
        listed_here = set(equivalent.get(module) or {})
        newer = {p + "::" for p in testmap.newer_tests(m)}
        try:
            with use_db(str(session), WorkDB.Mode.open) as db:
                todo = []
                for item in db.pending_work_items:
                    (mutation,) = item.mutations
                    args = stages(m, module, mutation.start_pos[0], where, newer, source, mutation.start_pos[1])
                    listed = f"{mutation.start_pos[0]}: {mutation.operator_name}[{mutation.occurrence}]" in listed_here
                    todo.append((item.job_id, mutation, args, fast_only or listed))

                def record(i, job_id, result, seconds, todo=todo, db=db):
                    if result is None:
                        return
                    db.set_result(job_id, result)
                    mutation = todo[i][1]
                    print(f"  {i + 1}/{len(todo)} line {mutation.start_pos[0]} {mutation.operator_name}"
                          f"[{mutation.occurrence}]: {(result.test_outcome or result.worker_outcome).value} "
                          f"({seconds:.1f} s)", flush=True)

                if workers > 1 and len(todo) > 1:
                    mutation_workers.run(module, todo, workers, record)
                else:
                    for i, (job_id, mutation, args, fast) in enumerate(todo):
                        t1 = time.monotonic()
                        record(i, job_id, mutate_and_test(module, mutation, args, fast), time.monotonic() - t1)
        finally:
            restore(module)
        rows = outcomes(session)
        wall = time.monotonic() - t0 + (summary.get(module) or {}).get("wall_s", 0.0)
        summary[module] = {**judge(module, rows, equivalent, wall),
                           "stages": "its tests (map), without worlds (--fast)" if fast_only else
                           "its tests (map): fast, then worlds on survivors"}
        summary_path.write_text(json.dumps(summary, indent=1))
        s = summary[module]
        print(f"{module}: {s['killed']} killed, {s['survived']} survived ({s['equivalent']} equivalent), "
              f"score {s['score']}, {s['pending']} pending, {s['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
