"""Building the test map (``scripts/testmap.py`` reads it): the suite under coverage, each line of ``kit/`` keyed by
the tests that ran it.

    .venv/bin/python scripts/testmap_build.py build [pytest args]   # the suite under coverage -> runs/testmap/map.json
    .venv/bin/python scripts/testmap_build.py build tests/test_x.py # those files again, merged into the map
    .venv/bin/python scripts/testmap_build.py remap                 # the map again from the last build's coverage data

How a test is told apart (coverage.py's contexts, ``tests/conftest.py`` switches them): what runs in the pytest process
during a test's call, and in every subprocess it starts (ranks, kernels, the kit's commands), is that test's (``T|<node
id>``); what runs during a fixture's set-up or tear-down, and in the subprocesses it starts, is its test file's
(``F|<file>``), since a module's fixtures serve every test of the file. A warm world a test's call started goes when
the call ends (the next test's ranks are its own). Fork servers, which outlive a test, are off while the map is built
(``GRADKIT_NO_FORK_SERVER``), but in the files that test them (``SERVER_TESTS``), whose subprocesses count for the
file. A line is keyed by the function around it (its qualified name), so the map outlives edits that move lines; a
module's top-level code (imports, constants) is reached by every test of the module's functions. The map also keeps
each line's tests for the source as it was measured (with its hash): a mutant, whose module is the measured one but
for the mutant, runs the tests of its own statement (``tests_of_line``), not of its whole function.
"""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import testmap
from testmap import MAP, OUT, REPO, digest, functions, git

# set while the map is built (tests/conftest.py then switches coverage's context per test); not GRADKIT_*: the kit
# refuses a variable of that name it does not read
ENV = "TESTMAP_BUILD"
TEST = "T|"  # a test's own context: its node id follows
FILE = "F|"  # a test file's context: its path (tests/...) follows
NO_FORK = "GRADKIT_NO_FORK_SERVER"  # gradkit.launch.NO_FORK_ENV (the map's code imports nothing of the kit)
SERVER_TESTS = ("tests/test_forkserver.py", "tests/test_warm_worlds.py", "tests/test_launch.py",
                "tests/test_jobs.py")  # servers are theirs
WARNINGS = ("module-not-measured", "module-not-python", "no-data-collected", "module-not-imported", "include-ignored",
            "couldnt-parse", "no-ctracer", "already-imported", "dynamic-conflict", "no-sysmon")


def switch(test_id: str | None, test_file: str) -> None:
    """Coverage's context from now on: ``test_id``'s (None: the file's), in this process and in every subprocess
    started from now on (the ranks, kernels and commands a test's call starts are that test's), but in the files
    of ``SERVER_TESTS``, whose fork servers outlive a test: there a subprocess counts for the file. Called by
    tests/conftest.py's hooks only while the map is built."""
    import coverage

    cov = coverage.Coverage.current()
    if cov is None:
        return
    here = TEST + test_id if test_id else FILE + test_file
    cov.switch_context(here)
    serialized = os.environ.get("COVERAGE_PROCESS_CONFIG")
    if serialized:
        cfg = json.loads(base64.b64decode(serialized))
        sub = FILE + test_file if test_file in SERVER_TESTS else here
        if cfg.get("context") != sub:
            cfg["context"] = sub
            os.environ["COVERAGE_PROCESS_CONFIG"] = base64.b64encode(json.dumps(cfg).encode()).decode()


def test_done(test_file: str) -> None:
    """After a test's call: the warm worlds it started go (their ranks count for it; the next test's must count for
    that one), but in ``SERVER_TESTS``, which test keeping them. Fixtures' warm worlds are the file's and stay."""
    warm = sys.modules.get("gradkit.launch.warm")
    if warm is not None and test_file not in SERVER_TESTS:
        warm.stop_warm_worlds(servers=False)


_TOOK: dict[str, float] = {}
DURATIONS = OUT / "durations.json"


def took(node_id: str, seconds: float) -> None:
    """A test's set-up, call or tear-down took ``seconds`` (under coverage): summed per test, for the map."""
    _TOOK[node_id] = _TOOK.get(node_id, 0.0) + seconds


def write_durations() -> None:
    DURATIONS.write_text(json.dumps({k: round(v, 2) for k, v in sorted(_TOOK.items())}, indent=0))


def fork_servers(test_file: str) -> None:
    """Fork servers off for ``test_file``'s worlds unless it is a test of fork servers themselves: a server outlives
    the file that started it, and its ranks would count for that file (tests/conftest.py, while the map is built)."""
    if test_file in SERVER_TESTS:
        os.environ.pop(NO_FORK, None)
    else:
        os.environ[NO_FORK] = "1"


def rcfile() -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    rc = OUT / "coveragerc"
    rc.write_text(f"[run]\nsource = {REPO / 'kit'}\nparallel = true\ndata_file = {OUT / '.coverage'}\n"
                  f"patch = subprocess, _exit, fork\ndisable_warnings = {', '.join(WARNINGS)}\n")
    return rc


def build(pytest_args: list[str]) -> int:
    """The suite under coverage (two workers, as scripts/test.sh runs it), then the map. Returns pytest's status;
    the map is written whatever it is (a failing test still shows what it reaches)."""
    for old in [*OUT.glob(".coverage*"), DURATIONS]:
        old.unlink(missing_ok=True)
    rc = rcfile()
    env = {**os.environ, ENV: "1", "COVERAGE_RCFILE": str(rc)}
    t0 = time.monotonic()
    files = [a for a in pytest_args if not a.startswith("-")]  # some test files: measured again, merged into the map
    where = [] if files else ["tests"]
    code = subprocess.run([sys.executable, "-m", "coverage", "run", f"--rcfile={rc}", "-m", "pytest", "-q", "-n", "2",
                           "--dist", "loadfile", "--no-loadscope-reorder", "-p", "no:cacheprovider", *where,
                           *pytest_args], cwd=REPO, env=env).returncode
    suite_s = time.monotonic() - t0
    subprocess.run([sys.executable, "-m", "coverage", "combine", f"--rcfile={rc}", "-q"], cwd=REPO, env=env, check=True)
    m = from_coverage(OUT / ".coverage")
    old = testmap.load() if files else None
    if old is not None:
        m = merge(old, m, files)
    m.update(commit=old["commit"] if old else git("rev-parse", "HEAD"),
             dirty=bool(git("status", "--porcelain", "--", "kit", "tests")),
             built_s=round(time.monotonic() - t0, 1), suite_s=round(suite_s, 1), pytest_status=code,
             world_tests=world_tests(),
             durations={**((old or {}).get("durations") or {}),
                        **(json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {})})
    MAP.write_text(json.dumps(m, indent=0, sort_keys=True))
    n = sum(len(v) for v in m["functions"].values())
    print(f"{MAP.relative_to(REPO)}: {n} functions of {len(m['functions'])} modules, "
          f"{len({t for f in m['functions'].values() for ts in f.values() for t in ts})} tests and files; "
          f"the suite under coverage took {suite_s:.0f} s (pytest exit {code})")
    return code


def from_coverage(data_file: Path) -> dict:
    """``{"functions": {module path: {qualname: [test ids and test files]}}, "lines": {module path: {"sha": the
    source's hash, "by_line": {line: [indices into "ids"]}}}, "ids": [test ids and test files]}`` from a combined
    coverage file: by function (what survives edits), and by line for the source as it was measured (a mutant's)."""
    import coverage

    data = coverage.CoverageData(str(data_file))
    data.read()
    out: dict[str, dict[str, list[str]]] = {}
    lines: dict[str, dict] = {}
    ids: dict[str, int] = {}
    for measured in data.measured_files():
        path = Path(measured)
        if not path.is_relative_to(REPO / "kit") or not path.exists():
            continue
        rel = path.relative_to(REPO).as_posix()
        source = path.read_text()
        where = functions(source, signature=False)
        per: dict[str, set[str]] = {}
        by_line: dict[str, list[int]] = {}
        for line, contexts in data.contexts_by_lineno(measured).items():
            tests = {c[2:] if c.startswith(TEST) else c[2:] + "::" for c in contexts if c.startswith((TEST, FILE))}
            if tests:
                per.setdefault(where(line), set()).update(tests)
                by_line[str(line)] = sorted(ids.setdefault(t, len(ids)) for t in tests)
        out[rel] = {q: sorted(t) for q, t in sorted(per.items())}
        lines[rel] = {"sha": digest(source), "by_line": by_line}
    return {"functions": out, "lines": lines, "ids": sorted(ids, key=ids.get)}


def merge(old: dict, new: dict, files: list[str]) -> dict:
    """``old`` with what ``new`` measured of the test ``files`` (test files, or node ids of them) in place of what it
    said of them: a module's lines are merged where both measured the same text, else its lines go (its functions
    answer until the next whole build). The files are noted with the hash of the text measured (``merged``)."""
    mine = {f.split("::")[0] for f in files}
    ours = lambda t: t.split("::")[0] in mine  # noqa: E731
    functions_: dict[str, dict[str, list[str]]] = {}
    for module in set(old["functions"]) | set(new["functions"]):
        a, b = old["functions"].get(module, {}), new["functions"].get(module, {})
        functions_[module] = {q: sorted({t for t in a.get(q, []) if not ours(t)} | set(b.get(q, [])))
                              for q in set(a) | set(b)}
    ids = [t for t in old["ids"] if not ours(t)]
    index = {t: i for i, t in enumerate(ids)}
    for t in new["ids"]:
        if t not in index:
            index[t] = len(ids)
            ids.append(t)
    lines = {}
    for module in set(old["lines"]) | set(new["lines"]):
        a, b = old["lines"].get(module), new["lines"].get(module)
        if a and b and a["sha"] != b["sha"]:
            continue
        by_line: dict[str, set[int]] = {}
        for entry, names in ((a, old["ids"]), (b, new["ids"])):
            for line, got in (entry or {}).get("by_line", {}).items():
                keep = {index[names[k]] for k in got if entry is b or not ours(names[k])}
                by_line.setdefault(line, set()).update(keep)
        lines[module] = {"sha": (a or b)["sha"], "by_line": {k: sorted(v) for k, v in by_line.items() if v}}
    texts = {f: digest((REPO / f).read_text()) for f in sorted(mine) if (REPO / f).exists()}
    merged = {**(old.get("merged") or {}), **texts}
    return {**old, "functions": functions_, "ids": ids, "lines": lines, "merged": merged}


def world_tests() -> list[str]:
    """The node ids that carry the ``world`` marker (a real multi-rank world): the mutation's second stage."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "world", "-p", "no:cacheprovider",
                          "tests"], cwd=REPO, capture_output=True, text=True)
    return sorted(line for line in out.stdout.splitlines() if "::" in line)




def main(argv: list[str]) -> int:
    if argv[:1] == ["build"]:
        return build(argv[1:])
    if argv[:1] == ["remap"]:  # the map again from the last build's coverage data (after a change of this file)
        old, m = testmap.load(), from_coverage(OUT / ".coverage")
        MAP.write_text(json.dumps({**old, **m}, indent=0, sort_keys=True))
        print(f"{MAP.relative_to(REPO)}: rebuilt from {OUT.relative_to(REPO) / '.coverage'}")
        return 0
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
