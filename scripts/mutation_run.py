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
killed / (killed + survived - equivalent). ``--readme [FILE]`` (alone) writes ``summary.json``'s table into that file's
``<!-- gradkit:table MUTATION -->`` block (``PAGE``, docs/tests.md, without a file).
"""
from __future__ import annotations

import contextlib
import difflib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch  # noqa: F401  (imported once here, before any mutant: each mutant's pytest is forked from this process)
import yaml
from cosmic_ray.mutating import use_mutation
from cosmic_ray.plugins import get_operator
from cosmic_ray.work_db import WorkDB, use_db
from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

import testmap
import testmap_readers

REPO = Path(__file__).resolve().parents[1]
HERE = REPO / "scripts" / "mutation"
OUT = REPO / "runs" / "mutation"
BIN = Path(sys.executable).parent
PAGE = "docs/tests.md"  # the page whose <!-- gradkit:table MUTATION --> block ``--readme`` writes without a file
FAST_TIMEOUT_S = 120.0  # per mutant of the fast stage (its tests take seconds: a mutant that loops forever is killed)
TIMEOUT_S = 600.0  # per mutant of the world stage; a world test that hangs is stopped by the kit's own timeouts before,
# so a world stage past it is not counted (its selection is too long to judge one mutant: pending, said)
NOT_RUN = "not run"  # pytest could not run the selection (a test the map names is gone): the mutant stays pending


def config(module: str, excluded: list[str]) -> Path:
    """The cosmic-ray session's config: which module, which operators (its test command is not used: each mutant's
    tests come from the test map)."""
    name = module.removesuffix(".py").replace("/", ".")  # kit.commands.check.paths, not ..._check_paths: another's
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
    (``tests/x.py::``), are taken whole in the stage their tests belong to. The world stage goes cheapest first (the
    map's durations: a mutant a test kills stops there, ``-x``); one of more than one file runs on two workers, a
    file each (``scripts/test.sh``'s way)."""
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
    fast = [t for t in tests if t not in world] + files
    slow = sorted([t for t in tests if t in world] + [f for f in files if f in world_files], key=cost)  # cheap first
    workers = ["-n", "2", "--dist", "loadfile"] if len({t.split("::")[0] for t in slow}) > 1 else []
    return ([*fast, "-m", "not world"] if fast else []), ([*slow, "-m", "world", *workers] if slow else [])


def run_tests(args: list[str], timeout_s: float) -> tuple[str, str]:
    """pytest on ``args`` (stop at the first failure) in a child forked from this process, which has imported torch
    and pytest but never the kit (so the child imports the mutant, and the ranks it starts do too): ``(outcome,
    output's tail)``; a hang is a kill, the child's whole process group with it."""
    with tempfile.TemporaryFile("w+") as log:
        pid = os.fork()
        if pid == 0:  # the child: a fresh session, output to the log, pytest as `python -m pytest` runs it
            code = 3
            try:
                os.setsid()
                os.dup2(log.fileno(), 1)
                os.dup2(log.fileno(), 2)
                os.chdir(REPO)
                sys.path.insert(0, str(REPO))
                code = int(pytest.main(["-x", "-q", "-p", "no:cacheprovider", *args]))
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                if time.monotonic() > deadline:
                    os.killpg(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    return TestOutcome.KILLED, f"timed out after {timeout_s:.0f} s"
                time.sleep(0.05)
        except BaseException:  # a stop (SIGTERM, Ctrl-C) while the child runs: it goes too, with its worlds
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            raise
        with contextlib.suppress(ProcessLookupError):  # ranks or servers the tests left behind
            os.killpg(pid, signal.SIGKILL)
        log.seek(0)
        out = log.read()
    if os.WIFSIGNALED(status):  # the mutant crashed the test process
        return TestOutcome.KILLED, f"pytest died of signal {os.WTERMSIG(status)}: " + out[-1500:]
    code = os.WEXITSTATUS(status)
    # 2-4: interrupted, internal or usage error; one of them is the mutant's (a module that no longer imports, a
    # collection it breaks) unless pytest did not find a test the map names (renamed since the map was built)
    stale = "ERROR: not found:" in out or "no match in any of" in out
    outcome = {0: TestOutcome.SURVIVED, 1: TestOutcome.KILLED, 5: TestOutcome.SURVIVED}.get(
        code, NOT_RUN if stale else TestOutcome.KILLED)
    return outcome, f"pytest exit {code}: " + out[-1500:]


def mutate_and_test(module: str, mutation, args: tuple[list[str], list[str]], fast_only: bool) -> WorkResult | None:
    """One mutant against its stages (None: pytest could not run a stage; the mutant stays pending). ``fast_only``:
    no world stage (``--fast``, or a survivor ``equivalent.yaml`` lists, whose reason says no output changes)."""
    operator = get_operator(mutation.operator_name)()
    with use_mutation(Path(module), operator, mutation.occurrence) as (original, mutated):
        if mutated is None:
            return WorkResult(worker_outcome=WorkerOutcome.NO_TEST)
        diff = "".join(difflib.unified_diff(original.splitlines(True), mutated.splitlines(True), module, module))
        said = []
        outcome = TestOutcome.SURVIVED
        for stage, a, limit in (("fast", args[0], FAST_TIMEOUT_S), ("world", args[1], TIMEOUT_S)):
            if not a or (stage == "world" and fast_only):
                continue
            outcome, output = run_tests(a, limit)
            if stage == "world" and output.startswith("timed out"):  # a world hangs at its own timeout before this:
                outcome = NOT_RUN  # a selection this long is the map's coarseness (whole files), not the mutant's hang
            if outcome == NOT_RUN:
                print(f"  {module} {mutation.operator_name}[{mutation.occurrence}]: pytest could not run its {stage} "
                      f"selection ({output[:300]}); build the map again (bash scripts/test.sh --map)", flush=True)
                return None
            said.append(f"{stage}: {output}")
            if outcome == TestOutcome.KILLED:
                break
        if not any(args):
            said.append("no test reaches it")
    return WorkResult(worker_outcome=WorkerOutcome.NORMAL, test_outcome=outcome, output="\n".join(said), diff=diff)


def forget_survivors(session: Path) -> None:
    """Mark every survivor of ``session`` as not run, so that the next run runs it again."""
    import sqlite3

    with sqlite3.connect(session) as db:
        db.execute("DELETE FROM work_results WHERE upper(test_outcome) = 'SURVIVED'")


def restore(module: str) -> None:
    """A run stopped mid-mutant leaves the mutant on disk: the module is put back from git (the script refuses to
    start with uncommitted changes in kit/, so git holds the truth)."""
    if subprocess.run(["git", "diff", "--quiet", "--", module], cwd=REPO).returncode:
        subprocess.run(["git", "checkout", "--", module], cwd=REPO, check=True)


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
                pending = list(db.pending_work_items)
                for i, item in enumerate(pending):
                    (mutation,) = item.mutations
                    args = stages(m, module, mutation.start_pos[0], where, newer, source,
                                  mutation.start_pos[1])
                    listed = f"{mutation.start_pos[0]}: {mutation.operator_name}[{mutation.occurrence}]" in listed_here
                    t1 = time.monotonic()
                    result = mutate_and_test(module, mutation, args, fast_only or listed)
                    if result is not None:
                        db.set_result(item.job_id, result)
                        print(f"  {i + 1}/{len(pending)} line {mutation.start_pos[0]} {mutation.operator_name}"
                              f"[{mutation.occurrence}]: {(result.test_outcome or result.worker_outcome).value} "
                              f"({time.monotonic() - t1:.1f} s)", flush=True)
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
