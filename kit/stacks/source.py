"""Read the code of an installed (or overlaid) library version: the mechanism sections of the notebooks.

``function_source("deepspeed", "deepspeed/runtime/engine.py", "DeepSpeedEngine._backward_epilogue",
version="0.18.9")`` returns the text of that method as the given version ships it, read from
the base environment (``installed``) or from the version's overlay, without importing it.
"""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from gradkit import config as kconfig
from gradkit.stacks import versions as kversions


def package_root(package: str, version: str = kconfig.INSTALLED) -> Path:
    if version in (kconfig.INSTALLED, kversions.installed_version(package)):
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ModuleNotFoundError(f"{package} is not installed")
        return Path(list(spec.submodule_search_locations)[0]).parent
    return kversions.ensure_overlay(package, version)


def function_source(package: str, relpath: str, qualname: str, version: str = kconfig.INSTALLED) -> tuple[str, int, str]:
    """``(source, first line number, file path)`` of ``qualname`` ("Class.method" or "function") in that file."""
    path = package_root(package, version) / relpath
    text = path.read_text()
    node: ast.AST = ast.parse(text)
    for part in qualname.split("."):
        node = next((n for n in ast.iter_child_nodes(node)
                     if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == part), None)
        if node is None:
            raise LookupError(f"{qualname} not found in {path}")
    lines = text.splitlines()[node.lineno - 1:node.end_lineno]
    return "\n".join(lines), node.lineno, str(path)


def numbered(source: str, first_line: int, highlight=()) -> str:
    """The source with line numbers; lines containing any ``highlight`` string are marked ``>>``."""
    out = []
    for i, line in enumerate(source.splitlines()):
        mark = ">>" if any(h in line for h in highlight) else "  "
        out.append(f"{mark}{first_line + i:5d}  {line}")
    return "\n".join(out)


def first_call_line(source: str, call: str) -> int | None:
    """Offset of the first line that calls ``call`` (e.g. "self.allreduce_gradients(") and is not a comment."""
    for i, line in enumerate(source.splitlines()):
        stripped = line.strip()
        if call in stripped and not stripped.startswith("#"):
            return i
    return None


def calls_in_order(source: str, first: str, second: str) -> bool | None:
    """True if ``first`` is called before ``second`` in the source, None if either is missing."""
    a, b = first_call_line(source, first), first_call_line(source, second)
    if a is None or b is None:
        return None
    return a < b


def excerpt(package: str, relpath: str, qualname: str, marks=(), version: str = kconfig.INSTALLED,
            before: int = 3, after: int = 8) -> str | None:
    """The lines of ``qualname`` from the first to the last line containing a mark (plus context), numbered,
    with a header naming the version and file; ``None`` when that version has no such function.
    Without marks, or when none is found, the whole function."""
    try:
        src, line, path = function_source(package, relpath, qualname, version=version)
    except LookupError:
        return None
    lines = src.splitlines()
    hits = [i for i, text in enumerate(lines) if any(m in text for m in marks)]
    lo, hi = (max(0, hits[0] - before), min(len(lines), hits[-1] + after + 1)) if hits else (0, len(lines))
    found = sorted({m for m in marks if m in src})
    head = f"--- {qualname}  ({path}, lines {line + lo}-{line + hi - 1}); marked: {found or 'none'}"
    return head + "\n" + numbered("\n".join(lines[lo:hi]), line + lo, highlight=marks)
