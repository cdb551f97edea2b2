"""The mutation run behind ``scripts/mutation.sh``: cosmic-ray over each module of ``scripts/mutation/targets.yaml``,
with that module's tests; the score, the survivors and the wall time into ``runs/mutation/summary.json``.

A mutant counts as *killed* when its tests fail, time out (a mutant that hangs a world is caught by its timeout)
or it does not import; *survived* when every test passes. A module's tests come in two stages where
``targets.yaml`` gives it ``fast`` and ``world`` commands: every mutant runs the fast tests (seconds), and only a
mutant that survives them runs the world tests (real 2-rank worlds, about a minute each), with
``cosmic-ray mutate-and-test``; their outcomes are kept in ``runs/mutation/<module>.world.json`` (resumable too;
``--fast`` leaves the world stage out, and the score then counts the fast stage's survivors; a mutant the world
stage could not run stays a survivor, tried again next time). ``--again`` runs the survivors of an earlier run
once more, against the tests as they are now (after tests were added for them). Survivors listed in
``scripts/mutation/equivalent.yaml`` (with why they cannot change any output) leave the score's denominator.
Score = killed / (killed + survived - equivalent). ``--readme [FILE]`` (alone) writes ``summary.json``'s table
into that file's ``<!-- gradkit:table MUTATION -->`` block (``PAGE``, docs/tests.md, without a file).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
HERE = REPO / "scripts" / "mutation"
OUT = REPO / "runs" / "mutation"
BIN = Path(sys.executable).parent
PAGE = "docs/tests.md"  # the page whose <!-- gradkit:table MUTATION --> block ``--readme`` writes without a file
FAST_TIMEOUT_S = 120.0  # per mutant of the fast stage (its tests take seconds: a mutant that loops forever is killed)
TIMEOUT_S = 600.0  # per mutant of the world stage; a world test that hangs is stopped by the kit's own timeouts before


def config(module: str, tests: str, excluded: list[str]) -> Path:
    name = module.replace("/", "_").removesuffix(".py")
    path = OUT / f"{name}.toml"
    command = pytest_command(tests)
    ops = ",\n  ".join(json.dumps(e) for e in excluded)
    path.write_text(f'[cosmic-ray]\nmodule-path = "{module}"\ntimeout = {FAST_TIMEOUT_S}\nexcluded-modules = []\n'
                    f"test-command = {json.dumps(command)}\n\n[cosmic-ray.distributor]\nname = \"local\"\n\n"
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


def commands(entry) -> tuple[str, str | None]:
    """A target's (fast, world) test selections: a plain string is one stage."""
    return (entry, None) if isinstance(entry, str) else (entry["fast"], entry.get("world"))


def pytest_command(tests: str) -> str:
    return f"{sys.executable} -B -m pytest -x -q -p no:cacheprovider {tests}"


def world_stage(module: str, session: Path, tests: str, rows: list[dict]) -> list[dict]:
    """The second stage: each survivor of the fast tests, mutated again and run against the world tests. Returns
    ``rows`` with those outcomes folded in (a survivor the worlds kill is killed)."""
    path = session.with_suffix(".world.json")
    done = json.loads(path.read_text()) if path.exists() else {}
    for r in rows:
        if not (r["worker"] == "normal" and r["test"] == "survived"):
            continue
        name = f"{r['line']}: {r['operator']}[{r['occurrence']}]"
        if name not in done:
            t0 = time.monotonic()
            try:
                out = subprocess.run([str(BIN / "cosmic-ray"), "mutate-and-test", module, r["operator"],
                                      str(r["occurrence"]), pytest_command(tests)], cwd=REPO, capture_output=True,
                                     text=True, timeout=TIMEOUT_S)
                result = json.loads(out.stdout.strip().splitlines()[-1]) if out.stdout.strip() else {}
                outcome = result.get("test_outcome")
            except subprocess.TimeoutExpired:
                outcome = "killed"  # a mutant that hangs a world is caught by the timeout
            except ValueError:
                outcome = None
            finally:
                restore(module)
            if outcome is None:  # cosmic-ray said nothing readable: not run, so still a survivor (tried again)
                print(f"  world stage {name}: not run ({(out.stderr or '').strip()[-300:]})", flush=True)
                continue
            done[name] = {"test": outcome, "wall_s": round(time.monotonic() - t0, 1)}
            path.write_text(json.dumps(done, indent=1))
            print(f"  world stage {name}: {outcome} ({done[name]['wall_s']:.0f} s)", flush=True)
        r["test"] = done[name]["test"]
    return rows


def forget_survivors(session: Path) -> None:
    """Mark every survivor of ``session`` (both stages) as not run, so that the next exec runs it again."""
    import sqlite3

    with sqlite3.connect(session) as db:
        db.execute("DELETE FROM work_results WHERE upper(test_outcome) = 'SURVIVED'")
    world = session.with_suffix(".world.json")
    if world.exists():
        done = json.loads(world.read_text())
        world.write_text(json.dumps({k: v for k, v in done.items() if v["test"] != "survived"}, indent=1))


def restore(module: str) -> None:
    """A run stopped mid-mutant leaves the mutant on disk: the module is put back from git (the script refuses to
    start with uncommitted changes in kit/, so git holds the truth)."""
    if subprocess.run(["git", "diff", "--quiet", "--", module], cwd=REPO).returncode:
        subprocess.run(["git", "checkout", "--", module], cwd=REPO, check=True)


def table(summary: dict, page: str = PAGE) -> str:
    """The mutation table of ``page``: per module its mutants, killed, surviving, equivalent, score and wall time."""
    sys.path.insert(0, str(REPO))
    from gradkit.judge.tables import markdown_table

    rows = [{"module": f"`{m}`", "mutants": s["killed"] + s["survived"], "killed": s["killed"],
             "survived": s["survived"] - s["equivalent"], "equivalent (listed with why)": s["equivalent"],
             "score": f"{s['score']:.3f}" if s["score"] is not None else "-",
             "tests per mutant": s.get("stages", "fast"), "wall time": f"{s['wall_s']:.0f} s"}
            for m, s in summary.items()]
    return (f"<sub>generated by `bash scripts/mutation.sh` then `bash scripts/mutation.sh --readme {page}` "
            "(2 cores; a module's wall time adds up its first run and each --again, run beside other modules' runs; "
            "its survivors are in runs/mutation/summary.json)</sub>\n\n" + markdown_table(rows, list(rows[0]))
            + "\n")


def fill_readme(path: str = PAGE) -> int:
    """Write the mutation table into the MUTATION block of ``path`` (relative to the repository: mutation.sh runs
    from its root)."""
    sys.path.insert(0, str(REPO))
    from gradkit.notebooks import readme_tables

    summary = json.loads((OUT / "summary.json").read_text())
    readme = (REPO / path).resolve()
    page = readme.relative_to(REPO).as_posix() if readme.is_relative_to(REPO) else str(readme)
    text, done = readme_tables.fill(readme.read_text(), {"MUTATION": table(summary, page)})
    readme.write_text(text)
    print(f"{readme}: {'replaced the mutation table' if done else 'has no <!-- gradkit:table MUTATION --> block'}")
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["--readme"]:
        return fill_readme(argv[1] if len(argv) > 1 else PAGE)
    spec = yaml.safe_load((HERE / "targets.yaml").read_text())
    equivalent = yaml.safe_load((HERE / "equivalent.yaml").read_text()) or {}
    fast_only, again = "--fast" in argv, "--again" in argv
    argv = [a for a in argv if a not in ("--fast", "--again")]
    modules = argv or list(spec["targets"])
    unknown = [m for m in modules if m not in spec["targets"]]
    if unknown:
        print(f"error: not a mutation target: {unknown}; scripts/mutation/targets.yaml has {list(spec['targets'])}",
              file=sys.stderr)
        return 2
    OUT.mkdir(parents=True, exist_ok=True)
    summary_path = OUT / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    for module in modules:
        fast, world = commands(spec["targets"][module])
        cfg = config(module, fast, spec["operators_excluded"])
        session = cfg.with_suffix(".sqlite")
        if not session.exists():
            subprocess.run([str(BIN / "cosmic-ray"), "init", str(cfg), str(session)], cwd=REPO, check=True)
            subprocess.run([str(BIN / "cr-filter-operators"), str(session), str(cfg)], cwd=REPO, check=True)
        if again:
            forget_survivors(session)
        t0 = time.monotonic()
        try:
            subprocess.run([str(BIN / "cosmic-ray"), "exec", str(cfg), str(session)], cwd=REPO, check=True)
        finally:
            restore(module)
        rows = outcomes(session)
        if world and not fast_only:
            rows = world_stage(module, session, world, rows)
        wall = time.monotonic() - t0 + (summary.get(module) or {}).get("wall_s", 0.0)
        summary[module] = {**judge(module, rows, equivalent, wall),
                           "stages": "fast" if not world or fast_only else "fast, then world on its survivors"}
        summary_path.write_text(json.dumps(summary, indent=1))
        s = summary[module]
        print(f"{module}: {s['killed']} killed, {s['survived']} survived ({s['equivalent']} equivalent), "
              f"score {s['score']}, {s['pending']} pending, {s['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
