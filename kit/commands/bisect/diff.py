"""The code that changed between two releases on the gradient path the measured run went through: the engine's and
the optimizer class's functions (or, on another package's axis, its Trainer's / Accelerator's) whose names are on
that path, read from the two releases' installed sources (``diff``, ``diff_text``); nothing is downloaded."""
from __future__ import annotations

import ast
import difflib
from pathlib import Path

from gradkit.commands.bisect.listing import PACKAGE, stack_of
from gradkit.stacks import versions

# The optimizer class that ran -> the file that holds it (under deepspeed/); the engine's file is always read too.
OPTIMIZER_FILES = {
    "DeepSpeedZeroOptimizer": "runtime/zero/stage_1_and_2.py",
    "DeepSpeedZeroOptimizer_Stage3": "runtime/zero/stage3.py",
    "BF16_Optimizer": "runtime/bf16_optimizer.py",
    "FP16_Optimizer": "runtime/fp16/fused_optimizer.py",
    "FP16_UnfusedOptimizer": "runtime/fp16/unfused_optimizer.py",
}
ENGINE = ("runtime/engine.py", "DeepSpeedEngine")
# the files a run through another package's accumulation goes through (``--axis``), under that package
AXIS_FILES = {"transformers": [("trainer.py", "Trainer")], "accelerate": [("accelerator.py", "Accelerator")]}
# A function is on the gradient path when its name says it touches gradients, their reduction, the boundary,
# the accumulation or the offload, or it is the step itself.
# "accelerator": the Trainer's create_accelerator_and_postprocess sets Accelerate's accumulation steps (B1's 5.5.4
# change: num_steps 1, so Accelerate no longer divides by GA a second time); "training_loop": the Trainer's
# _inner_training_loop decides which micro-batch syncs (HFT's 4.46.2 -> 4.46.3 change: i == last -> i != last).
GRADIENT_PATH = ("grad", "reduce", "boundary", "accumul", "offload", "partition", "average", "allreduce", "backward",
                 "step", "epilogue", "ipg", "bucket", "copy", "zero_", "loss", "num_items", "sync", "accelerator",
                 "training_loop")


def _functions(source: str, cls: str | None) -> dict[str, str]:
    """``{name: source}`` of the methods of class ``cls`` in ``source`` (``Class.method``; module-level functions when
    ``cls`` is None) whose name is on the gradient path, and of the file's module-level functions they call (a helper such as
    ``split_half_float_double`` decides what a reduction reduces, whatever its name says)."""
    tree = ast.parse(source)
    lines = source.splitlines()

    def text(n):
        start = min([n.lineno, *(d.lineno for d in n.decorator_list)]) - 1
        return "\n".join(lines[start:n.end_lineno])

    funcs = (ast.FunctionDef, ast.AsyncFunctionDef)
    body = tree.body
    if cls:
        body = next((n.body for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls), [])
    chosen = [n for n in body if isinstance(n, funcs) and any(k in n.name.lower() for k in GRADIENT_PATH)]
    out = {f"{cls}.{n.name}" if cls else n.name: text(n) for n in chosen}
    called = {x.id for n in chosen for x in ast.walk(n) if isinstance(x, ast.Name)}
    for n in tree.body:  # a module-level helper keeps its own name
        if cls and isinstance(n, funcs) and n.name in called:
            out[n.name] = text(n)
    return out


def _source_root(release: str, package: str = PACKAGE) -> Path | None:
    try:
        own = {k: v for k, v in stack_of(release, package).items() if k == package}  # its source alone, no companion
        root = versions.resolve_stack(own, (package,)).roots.get(package)
    except versions.CannotRun:
        return None
    return Path(root) / versions.module_name(package) if root else None


def git_hash(release: str, package: str = PACKAGE) -> str | None:
    """The commit a release was built from, as its package says (``deepspeed/git_version_info_installed.py``)."""
    root = _source_root(release, package)
    for name in ("git_version_info_installed.py", "git_version_info.py"):
        try:
            text = (root / name).read_text() if root else ""
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("git_hash"):
                value = line.split("=", 1)[1].strip().strip("'\"")
                if value and value != "unknown":
                    return value
    return None


def diff(before: str, after: str, optimizer: str | None, max_lines: int = 60, package: str = PACKAGE) -> dict:
    """The code that changed between two releases on the gradient path the measured run went through: the engine's
    and the optimizer class's functions whose names are on it, read from the two releases' installed sources (the
    kit's overlays; nothing is downloaded). ``{"files": [{"file", "class", "functions": [{"name", "diff",
    "lines"}]}], "commits": (hash, hash)}``; each function's unified diff is cut at ``max_lines`` lines."""
    roots = {r: _source_root(r, package) for r in (before, after)}
    targets = AXIS_FILES.get(package) or [ENGINE]
    if package == PACKAGE and optimizer in OPTIMIZER_FILES:
        targets = [(OPTIMIZER_FILES[optimizer], optimizer), *targets]
    files = []
    for rel_path, cls in targets:
        texts = {}
        for r, root in roots.items():
            try:
                texts[r] = (root / rel_path).read_text() if root else ""
            except OSError:
                texts[r] = ""
        if not texts[before] or not texts[after]:
            files.append({"file": f"{package}/{rel_path}", "class": cls, "functions": [],
                          "note": "not in both releases"})
            continue
        fa, fb = _functions(texts[before], cls), _functions(texts[after], cls)
        funcs = []
        for name in sorted(set(fa) | set(fb), key=lambda n: (n not in fb, n)):
            if fa.get(name) == fb.get(name):
                continue
            lines = list(difflib.unified_diff((fa.get(name) or "").splitlines(), (fb.get(name) or "").splitlines(),
                                              f"{before}/{package}/{rel_path}", f"{after}/{package}/{rel_path}",
                                              lineterm="", n=2))
            changed = sum(1 for x in lines if x[:1] in "+-" and not x.startswith(("+++", "---")))
            text = "\n".join(lines[:max_lines]) + (f"\n... ({len(lines) - max_lines} more lines)"
                                                   if len(lines) > max_lines else "")
            funcs.append({"name": name, "diff": text, "lines": changed,
                          "status": "added" if name not in fa else "removed" if name not in fb else "changed"})
        files.append({"file": f"{package}/{rel_path}", "class": cls, "functions": funcs})
    return {"before": before, "after": after, "files": files, "package": package,
            "commits": (git_hash(before, package), git_hash(after, package))}


def diff_text(d: dict, max_functions: int = 6) -> str:
    """The diff excerpt as text: per file, the changed functions on the gradient path, largest first."""
    out = []
    ca, cb = d["commits"]
    known = bool(ca and cb)  # a release built from its sdist says 'unknown': its release tag names it
    ca, cb = (ca, cb) if known else (f"v{d['before']}", f"v{d['after']}")
    out.append(f"the commits between them{'' if known else ' (the packages name no commit: their release tags)'}: "
               f"git log --oneline {ca}..{cb} -- " + " ".join(f["file"] for f in d["files"]))
    for f in d["files"]:
        if f.get("note"):
            out.append(f"{f['file']} ({f['class']}): {f['note']}")
            continue
        if not f["functions"]:
            out.append(f"{f['file']} ({f['class']}): no function on the gradient path changed")
            continue
        out.append(f"{f['file']} ({f['class']}): {len(f['functions'])} function(s) on the gradient path changed: "
                   + ", ".join(f"{x['name']} ({x['status']}, {x['lines']} lines)" for x in f["functions"]))
        for x in sorted(f["functions"], key=lambda x: -x["lines"])[:max_functions]:
            out.append(x["diff"])
    return "\n".join(out)
