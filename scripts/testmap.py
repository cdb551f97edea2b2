"""Which tests reach which code: the suite's coverage, per test, as a map from each function of ``kit/`` to the
tests that run it; and the tests a change needs (``bash scripts/test.sh --changed [BASE]``, ``scripts/mutation.sh``).

    .venv/bin/python scripts/testmap.py build [pytest args]   # the suite under coverage -> runs/testmap/map.json
    .venv/bin/python scripts/testmap.py changed [BASE]        # the tests a change since BASE (default HEAD) needs
    .venv/bin/python scripts/testmap.py tests FILE LINE       # the tests that reach that line's function
    .venv/bin/python scripts/testmap.py remap                 # the map again from the last build's coverage data

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

A selection is conservative: a function the map does not know (new, or never run) takes every test of its module;
a changed test file and a test file newer than the map are taken whole; a package's ``__init__`` also takes the test
files that name the package (a fresh venv's import of it); a changed file outside ``kit/`` and ``tests/`` takes the
test files that name it (docs pages: the docs test), and so does every changed file while there is no map.
"""
from __future__ import annotations

import ast
import base64
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "runs" / "testmap"
MAP = OUT / "map.json"
# set while the map is built (tests/conftest.py then switches coverage's context per test); not GRADKIT_*: the kit
# refuses a variable of that name it does not read
ENV = "TESTMAP_BUILD"
TEST = "T|"  # a test's own context: its node id follows
FILE = "F|"  # a test file's context: its path (tests/...) follows
NO_FORK = "GRADKIT_NO_FORK_SERVER"  # gradkit.launch.NO_FORK_ENV (the map's code imports nothing of the kit)
SERVER_TESTS = ("tests/test_forkserver.py", "tests/test_warm_worlds.py", "tests/test_launch.py",
                "tests/test_jobs.py")  # servers are theirs
CONTENT = ("notebooks", "examples")  # folders whose files tests find by listing the folder
WARNINGS = ("module-not-measured", "module-not-python", "no-data-collected", "module-not-imported", "include-ignored",
            "couldnt-parse", "no-ctracer", "already-imported", "dynamic-conflict", "no-sysmon")


# ------------------------------------------------------------------------------------------------ while building

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
    where = [] if any(not a.startswith("-") for a in pytest_args) else ["tests"]  # some test files: a partial map
    code = subprocess.run([sys.executable, "-m", "coverage", "run", f"--rcfile={rc}", "-m", "pytest", "-q", "-n", "2",
                           "--dist", "loadfile", "--no-loadscope-reorder", "-p", "no:cacheprovider", *where,
                           *pytest_args], cwd=REPO, env=env).returncode
    suite_s = time.monotonic() - t0
    subprocess.run([sys.executable, "-m", "coverage", "combine", f"--rcfile={rc}", "-q"], cwd=REPO, env=env, check=True)
    m = from_coverage(OUT / ".coverage")
    m.update(commit=git("rev-parse", "HEAD"), dirty=bool(git("status", "--porcelain", "--", "kit", "tests")),
             built_s=round(time.monotonic() - t0, 1), suite_s=round(suite_s, 1), pytest_status=code,
             world_tests=world_tests(),
             durations=json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {})
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


def digest(source: str) -> str:
    return hashlib.sha1(source.encode()).hexdigest()


def statement(source: str, line: int) -> tuple[int, int] | None:
    """The first and last line of the innermost statement that holds ``line`` (a compound statement's header: the
    whole statement), where coverage records a line of it."""
    best = None
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.stmt) and node.lineno <= line <= (node.end_lineno or node.lineno):
            first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
            if best is None or (node.end_lineno or node.lineno) - first < best[1] - best[0]:
                best = (first, node.end_lineno or node.lineno)
    return best


def world_tests() -> list[str]:
    """The node ids that carry the ``world`` marker (a real multi-rank world): the mutation's second stage."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "world", "-p", "no:cacheprovider",
                          "tests"], cwd=REPO, capture_output=True, text=True)
    return sorted(line for line in out.stdout.splitlines() if "::" in line)


# ------------------------------------------------------------------------------------------------ reading it

def functions(source: str, signature: bool = True):
    """A function ``line -> qualname`` of the innermost def or class around that line ("<module>" outside any).
    ``signature=False`` (what ran): a def's decorators and signature are the enclosing scope's, since they run when
    that scope does (a module's at its import), and only its body is the function's; ``True`` (what changed): an edit
    of a def's signature is an edit of that function."""
    spans: list[tuple[int, int, str]] = []

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)]) if signature else \
                    child.body[0].lineno
                spans.append((first, child.end_lineno or child.lineno, name))
                walk(child, name + ".")
            else:
                walk(child, prefix)

    try:
        walk(ast.parse(source), "")
    except SyntaxError:
        return lambda line: "<module>"
    spans.sort(key=lambda s: (s[0], -s[1]))

    def where(line: int) -> str:
        inside = [s for s in spans if s[0] <= line <= s[1]]
        return max(inside, key=lambda s: s[0])[2] if inside else "<module>"

    return where


def load() -> dict | None:
    return json.loads(MAP.read_text()) if MAP.exists() else None


def tests_of_line(m: dict, module: str, source: str, line: int) -> set[str] | None:
    """The tests that ran the statement at ``line`` of ``module`` (its whole statement: coverage records a
    multi-line one on some of its lines), if ``source`` is the text the map measured; None where the map cannot say
    (the module changed since, no line of the statement was recorded): then ``tests_of`` its function answers."""
    entry = m.get("lines", {}).get(module)
    if not entry or entry["sha"] != digest(source):
        return None
    try:
        span = statement(source, line)
    except SyntaxError:
        return None
    hits = [entry["by_line"][str(i)] for i in range(span[0], span[1] + 1) if str(i) in entry["by_line"]] if span else []
    return {m["ids"][k] for h in hits for k in h} if hits else None


def tests_of(m: dict, module: str, qualnames: set[str]) -> set[str]:
    """The tests that reach ``qualnames`` of ``module`` (a path under kit/); a name the map does not know, or the
    module's top level, takes every test of the module."""
    known = m["functions"].get(module, {})
    whole = {t for ts in known.values() for t in ts}
    out: set[str] = set()
    for q in qualnames:
        parts = q.split(".")
        hits = [known[".".join(parts[:i])] for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in known]
        out |= set(hits[0]) if hits and q != "<module>" else whole
    return out


def naming(module: str) -> set[str]:
    """Test files whose source names ``module`` (kit/a/b.py: gradkit.a.b, or `from gradkit.a import b`), or, for a
    file that is not a module of kit/, its file name."""
    if module.startswith("kit/") and module.endswith(".py"):
        dotted = "gradkit." + module[4:-3].replace("/", ".").removesuffix(".__init__")
        parent, _, leaf = dotted.rpartition(".")
        pattern = re.compile(rf"{re.escape(dotted)}\b|from {re.escape(parent)} import [^\n]*\b{re.escape(leaf)}\b")
    else:  # its file name, a script's module name, or the content folder it is in (tests read those by folder)
        p = Path(module)
        words = [re.escape(p.name)] + ([rf"\b{re.escape(p.stem)}\b"] if p.suffix == ".py" else []) + \
            ([re.escape(p.parts[0] + "/"), rf"[\"']{re.escape(p.parts[0])}[\"']"] if p.parts[0] in CONTENT else [])
        pattern = re.compile("|".join(words))
    return {p.relative_to(REPO).as_posix() + "::" for p in (REPO / "tests").glob("test_*.py")
            if pattern.search(p.read_text())}


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


def newer_tests(m: dict) -> list[str]:
    """The test files changed since the map was built (the working tree included): tests the map cannot know."""
    return [p for p in git("diff", "--name-only", m["commit"], "--", "tests").splitlines()
            if p.startswith("tests/test_") and (REPO / p).exists()]


def changed_functions(base: str) -> dict[str, set[str]]:
    """``{path: {qualname}}`` of every function that a change since ``base`` touches (the working tree, uncommitted
    changes included): each hunk's lines in the new file and its removed lines in the old one."""
    out: dict[str, set[str]] = {}
    diff = git("diff", "-U0", "--no-color", "--no-ext-diff", base, "--")
    path = old_where = new_where = None
    for line in diff.splitlines():
        if line.startswith("diff --git"):
            path = line.split(" b/", 1)[1]
            out.setdefault(path, set())
            old_where = new_where = None
            if path.endswith(".py"):
                new = REPO / path
                old = subprocess.run(["git", "show", f"{base}:{path}"], cwd=REPO, capture_output=True, text=True)
                new_where = functions(new.read_text()) if new.exists() else None
                old_where = functions(old.stdout) if old.returncode == 0 else None
        elif line.startswith("@@") and path:
            m = re.match(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@", line)
            a, na, b, nb = int(m[1]), int(m[2] or 1), int(m[3]), int(m[4] or 1)
            if old_where:
                out[path] |= {old_where(i) for i in range(a, a + na)}
            if new_where:
                out[path] |= {new_where(i) for i in range(b, b + max(nb, 1))}
    # new files git does not track yet
    for untracked in git("ls-files", "--others", "--exclude-standard", "--", "kit", "tests").splitlines():
        out.setdefault(untracked, {"<module>"})
    return out


def select(base: str, m: dict | None) -> tuple[list[str], list[str]]:
    """The test ids and files (``tests/x.py::``) a change since ``base`` needs, and the reasons, one line each."""
    picked: set[str] = set()
    why = [] if m is not None else ["no test map (bash scripts/test.sh --map builds it): each changed file takes the "
                                    "test files that name it"]
    changed = changed_functions(base)
    if m is not None:
        for p in newer_tests(m):  # tests the map cannot know
            changed.setdefault(p, {"<newer than the map>"})
    for path, names in sorted(changed.items()):
        if path in ("tests/conftest.py", "scripts/test.sh", "scripts/setup.sh", "pyproject.toml", "constraints.txt",
                    "setup.py"):
            why.append(f"{path}: every test (it sets up the whole suite)")
            return ["tests"], why
        if path.startswith("tests/test_") and path.endswith(".py"):
            if (REPO / path).exists():
                picked.add(path + "::")
                why.append(f"{path}: its every test")
            continue
        if not path.startswith("kit/") or m is None:
            got = naming(path)
        elif path.endswith(".py"):  # a package's __init__ is also what `import gradkit.x` in a fresh venv runs
            got = tests_of(m, path, names) | (naming(path) if path.endswith("__init__.py") else set())
        else:  # a data file of the kit: the tests of its folder's code
            folder = str(Path(path).parent) + "/"
            got = {t for mod, fs in m["functions"].items() if mod.startswith(folder) for ts in fs.values() for t in ts}
        picked |= got
        shown = ", ".join(sorted(n for n in names if n != "<module>")[:6]) or "its top level"
        why.append(f"{path} ({shown}): {len(got)} tests or test files")
    files = {t for t in picked if t.endswith("::")}
    tests = {t for t in picked if not t.endswith("::") and t.split("::")[0] + "::" not in files}
    return sorted(f[:-2] for f in files) + sorted(tests), why


def main(argv: list[str]) -> int:
    if argv[:1] == ["build"]:
        return build(argv[1:])
    if argv[:1] == ["remap"]:  # the map again from the last build's coverage data (after a change of this file)
        old, m = load(), from_coverage(OUT / ".coverage")
        MAP.write_text(json.dumps({**old, **m}, indent=0, sort_keys=True))
        print(f"{MAP.relative_to(REPO)}: rebuilt from {OUT.relative_to(REPO) / '.coverage'}")
        return 0
    m = load()
    if argv[:1] == ["tests"] and len(argv) == 3:
        if m is None:
            print("no test map: build it with `.venv/bin/python scripts/testmap.py build`", file=sys.stderr)
            return 2
        path = Path(argv[1]).resolve().relative_to(REPO).as_posix()
        print("\n".join(sorted(tests_of(m, path, {functions((REPO / path).read_text())(int(argv[2]))}))))
        return 0
    if argv[:1] == ["changed"] and len(argv) <= 2:
        base = argv[1] if len(argv) == 2 else "HEAD"
        ids, why = select(base, m)
        print("\n".join(ids))
        print("\n".join(why), file=sys.stderr)
        return 0
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
