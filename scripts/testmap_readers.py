"""The tests a module-level value reaches: those that ran a line *reading* it, not those that happened to import its
module. Coverage credits a module's top-level lines (a constant, a class attribute) to whichever test first imported
the module in each process (every rank of every world imports it again), so the test map's answer for them is both
too wide (hundreds of world tests for ``DEFAULT_GA = 4``) and arbitrary. A mutant of such a line changes the program
only where the name is read: here, every load of the names it binds, in ``kit/`` (the module itself; another module
that imports the name, or reads it as an attribute; a value computed from it at top level, followed on) and in
``tests/`` (a test that reads the constant itself), each turned into the tests that ran that statement.

Conservative where it cannot see: a line that binds no name (an import, a top-level call), a name nothing reads by
name (``getattr``, ``__all__``) or a reading statement the map does not hold, falls back to what the map says.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import testmap

REPO = testmap.REPO


def _targets(node: ast.stmt, col: int | None) -> set[str]:
    """The names ``node`` binds; of a tuple bound to a tuple (``A, B = 1, 2``), the one whose value holds ``col``."""
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    if col is not None and isinstance(node, ast.Assign) and len(targets) == 1 and \
            isinstance(targets[0], ast.Tuple) and isinstance(node.value, ast.Tuple) and \
            len(targets[0].elts) == len(node.value.elts):
        for t, v in zip(targets[0].elts, node.value.elts):
            if isinstance(t, ast.Name) and v.lineno == node.lineno and v.col_offset <= col < (v.end_col_offset or 0):
                return {t.id}
    return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}


def bound_names(source: str, line: int, col: int | None = None) -> tuple[set[str], bool] | None:
    """The names that the module- or class-level assignment holding ``line`` (``col``: the mutated column) binds,
    and whether a class binds them (an attribute read on any object then counts); a top-level class's header (its
    decorators, its bases) binds the class's name; None where ``line`` is in no such statement (a function's body,
    an import, a bare call)."""
    def scan(body: list[ast.stmt], in_class: bool):
        for node in body:
            first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
            if not first <= line <= (node.end_lineno or node.lineno):
                continue
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                names = _targets(node, col)
                return (names, in_class) if names else None
            if isinstance(node, ast.ClassDef) and node.body and line >= node.body[0].lineno:
                return scan(node.body, True)
            if isinstance(node, ast.ClassDef) and not in_class:  # its decorators or bases: where the class is used
                return {node.name}, False
            if isinstance(node, (ast.If, ast.Try, ast.With)):  # `if TYPE_CHECKING:`, `try: X = ...`
                return scan([*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                             *(s for h in getattr(node, "handlers", []) for s in h.body)], in_class)
            return None
        return None

    return scan(ast.parse(source).body, False)


@functools.lru_cache(maxsize=None)
def _parsed(path: Path) -> tuple[str, ast.Module] | None:
    try:
        source = path.read_text()
        return source, ast.parse(source)
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None


def _aliases(tree: ast.Module, dotted: str) -> set[str]:
    """The names a file binds to the module ``dotted`` (``import gradkit.a.b as x``, ``from gradkit.a import b``)."""
    parent, _, leaf = dotted.rpartition(".")
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out |= {a.asname for a in n.names if a.name == dotted and a.asname}
        elif isinstance(n, ast.ImportFrom) and n.module == parent:
            out |= {a.asname or a.name for a in n.names if a.name == leaf}
    return out


def _loads(tree: ast.Module, names: set[str], own: set[str], dotted: str, anywhere: bool) -> list[int]:
    """Lines that read one of ``names``: a bare name where it is bound (``own``, this module's) or imported by that
    name from ``dotted``; an attribute of that name on the module (``mod.X``), or on anything where ``anywhere`` (a
    class attribute: ``self.X``)."""
    parent, _, leaf = dotted.rpartition(".")
    bare = own | {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == dotted
                  for a in n.names if a.name in names}
    bases = _aliases(tree, dotted)
    out = []
    for n in ast.walk(tree):
        if not isinstance(getattr(n, "ctx", None), ast.Load):
            continue
        if isinstance(n, ast.Name) and n.id in bare:
            out.append(n.lineno)
        elif isinstance(n, ast.Attribute) and n.attr in names and (
                anywhere or isinstance(n.value, ast.Name) and n.value.id in bases or ast.unparse(n.value) == dotted):
            out.append(n.lineno)
    return out


def _test_of(tree: ast.Module, rel: str, line: int) -> str:
    """The test (``tests/x.py::test_f``, ``tests/x.py::C::test_f``) whose body holds ``line``; its whole file where
    the line is in a fixture, a helper or the file's top level (they serve any of its tests)."""
    for node in tree.body:
        if not node.lineno <= line <= (node.end_lineno or node.lineno):
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            return f"{rel}::{node.name}"
        if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            for f in node.body:
                if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name.startswith("test") and \
                        f.lineno <= line <= (f.end_lineno or f.lineno):
                    return f"{rel}::{node.name}::{f.name}"
    return f"{rel}::"


def _expand(test: str, known: list[str]) -> set[str]:
    """A test function as the node ids the map knows (its parameters: ``test_f[a]``, ``test_f[b]``)."""
    if test.endswith("::"):
        return {test}
    got = {k for k in known if k == test or k.startswith(test + "[")}
    return got or {test}


def _dotted(rel: str) -> str:
    return "gradkit." + rel[len("kit/"):-len(".py")].replace("/", ".").removesuffix(".__init__")


def tests_of_readers(m: dict, module: str, source: str, line: int, col: int | None = None,
                     repo: Path = REPO) -> set[str] | None:
    """The tests that ran a statement reading a name that ``line`` (at ``col``) of ``module`` binds at its top level
    (``source``: the module's text as measured), followed through top-level values computed from it; None where
    ``line`` binds no name or nothing reads one by name (the map's own answer then). ``repo``: the repository whose
    ``kit/`` and ``tests/`` are read."""
    bound = bound_names(source, line, col)
    if bound is None:
        return None
    kit = sorted((repo / "kit").rglob("*.py"))
    tests = sorted((repo / "tests").glob("test_*.py"))
    known = [*m.get("ids", []), *m.get("world_tests", [])]
    work, done, out, found = [(module, *bound)], set(), set(), False
    while work:
        origin, names, anywhere = work.pop()
        if (origin, frozenset(names)) in done:
            continue
        done.add((origin, frozenset(names)))
        for path in kit:
            rel = path.relative_to(repo).as_posix()
            parsed = (source, ast.parse(source)) if rel == module else _parsed(path)
            if parsed is None or not any(n in parsed[0] for n in names):
                continue
            text, tree = parsed
            for at in _loads(tree, names, names if rel == origin else set(), _dotted(origin), anywhere):
                found = True
                further = bound_names(text, at)
                if further:  # a top-level value computed from it: its readers are this one's
                    work.append((rel, *further))
                    continue
                got = testmap.tests_of_line(m, rel, text, at)
                out |= got if got is not None else testmap.tests_of(m, rel, {testmap.functions(text, False)(at)})
        for path in tests:
            parsed = _parsed(path)
            if parsed is None or not any(n in parsed[0] for n in names):
                continue
            rel = path.relative_to(repo).as_posix()
            for at in _loads(parsed[1], names, set(), _dotted(origin), anywhere):
                found = True
                out |= _expand(_test_of(parsed[1], rel, at), known)
    return out if found else None
