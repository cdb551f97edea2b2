"""Which tests reach which code: the suite's coverage, per test, as a map from each function of ``kit/`` to the
tests that run it; and the tests a change needs (``bash scripts/test.sh --changed [BASE]``, ``scripts/mutation.sh``).

    .venv/bin/python scripts/testmap.py changed [BASE]        # the tests a change since BASE (default HEAD) needs
    .venv/bin/python scripts/testmap.py tests FILE LINE       # the tests that reach that line's function

How the map is built: scripts/testmap_build.py (`bash scripts/test.sh --map`).

A selection is conservative: a function the map does not know (new, or never run) takes every test of its module;
a changed test file and a test file newer than the map are taken whole; a package's ``__init__`` also takes the test
files that name the package (a fresh venv's import of it); a changed file outside ``kit/`` and ``tests/`` takes the
test files that name it (docs pages: the docs test), and so does every changed file while there is no map.
"""
from __future__ import annotations

import ast
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "runs" / "testmap"
MAP = OUT / "map.json"
CONTENT = ("notebooks", "examples")  # folders whose files tests find by listing the folder


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
    """The test files changed since the map was built (the working tree included): tests the map cannot know; a
    file measured again since (``testmap_build.py build FILE``: ``merged``, with its text's hash) counts only if its
    text changed after that."""
    merged = m.get("merged") or {}
    changed = git("diff", "--name-only", m["commit"], "--", "tests").splitlines()
    changed += git("ls-files", "--others", "--exclude-standard", "--", "tests").splitlines()  # new, not yet added
    return [p for p in dict.fromkeys(changed) if p.startswith("tests/test_") and (REPO / p).exists() and
            merged.get(p) != digest((REPO / p).read_text())]


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
    m = load()
    if argv[:1] == ["tests"] and len(argv) == 3:
        if m is None:
            print("no test map: build it with `bash scripts/test.sh --map`", file=sys.stderr)
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
