"""``gradkit bisect ds_config.json``: since which DeepSpeed release does this config's accumulation change, and how?

    gradkit bisect ds_config.json --loop manual [--from 0.14.0] [--to installed] [--steps 3] [--json out.json]
    gradkit bisect ds_config.json --releases 0.18.9,0.19.0        # exactly these releases, in this order
    gradkit bisect --probe B1 --axis transformers --releases 4.46.0,5.3.0,installed   # a probe, another package

Every release measured is ``gradkit check``'s probe on that release (the same oracle, control and fitted weights,
one world each, the release as an overlay). A release's **result** is the loop's verdict and the step it applied
in words (the named hypothesis its fitted weights match, else the step as fitted), so a change is found where the
verdict flips *and* where the step changes shape ("first and last micro-batch" becoming "all but the first").

The search: every ``--stride``-th release of the ordered list first (a change and its undoing between two of them
is not seen, and the output says so), then a binary search between two neighbours whose results differ, then a
confirming run in a fresh world on both sides of each change. A release that cannot be installed or run here
(or whose control is off: ``inconclusive``) is **skipped**, named with its reason, never counted as good; a change
next to skipped releases is a range. For each change, the code that changed between its two releases in the files
the measured run went through (``kit.commands.bisect.diff``). Exit status, as ``gradkit check``'s: 0 the newest release that
ran is not affected, 1 it is (a measured ``affected``), 2 bad input (nothing launched), 3 fewer than two releases
could run.
"""
from __future__ import annotations

import argparse
import ast
import difflib
import json
import subprocess
import sys
import time
from pathlib import Path

from kit import config as kconfig
from kit import probes
from kit.commands import check
from kit.judge import oracle
from kit.judge.expectations import version_key
from kit.probes import ds_config
from kit.stacks import prefetch as kprefetch
from kit.stacks import versions

PACKAGE = "deepspeed"
STRIDE = 4  # the first pass measures every STRIDE-th release: a change and its undoing inside one stride are not seen
INDEX_MAX_AGE_S = 24 * 3600
SKIPPED = (oracle.CANNOT_RUN, oracle.INCONCLUSIVE)


# ---------------------------------------------------------------------------------------------- releases

def stack_of(release: str, package: str = PACKAGE) -> dict:
    """The world stack that runs ``release`` of ``package``: ``{}`` for the installed release, else its overlay."""
    return {} if release == versions.installed_version(package).split("+")[0] else {package: release}


def _final(v: str) -> bool:
    return all(part.isdigit() for part in v.split("."))


def index_releases(package: str = PACKAGE) -> tuple[list[str], str]:
    """Every final release of ``package`` the package index has, oldest first, and where the list came from. The
    list is cached in the kit's cache for a day; offline, the cached list, else the releases already in the kit's
    cache (overlays) and the installed one, said so."""
    cache = kconfig.cache_dir() / "releases" / f"{package}.json"
    try:
        held = json.loads(cache.read_text())
    except (OSError, ValueError):
        held = None
    if held and time.time() - held.get("fetched", 0) < INDEX_MAX_AGE_S:
        return held["releases"], f"the package index (cached {time.strftime('%Y-%m-%d', time.gmtime(held['fetched']))})"
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", package, "--disable-pip-version-check"],
                             capture_output=True, text=True, timeout=60)
        line = next(x for x in out.stdout.splitlines() if x.startswith("Available versions:"))
        found = sorted({v.strip() for v in line.split(":", 1)[1].split(",") if _final(v.strip())}, key=version_key)
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"fetched": time.time(), "releases": found}))
        return found, "the package index"
    except (StopIteration, OSError, subprocess.SubprocessError):
        pass
    if held:
        return held["releases"], "the package index as cached on " + time.strftime("%Y-%m-%d", time.gmtime(held["fetched"])) \
            + " (the index cannot be reached now)"
    here = {p.name.split("-", 1)[1] for p in versions.overlay_root().glob(f"{package}-*") if (p / ".complete").exists()}
    here.add(versions.installed_version(package))
    found = sorted((v for v in here if _final(v.split("+")[0])), key=version_key)
    return found, "the releases already in the kit's cache and the installed one (the package index cannot be reached)"


def release_list(frm: str | None, to: str, given: str | None = None, package: str = PACKAGE) -> tuple[list[str], str]:
    """The ordered releases of ``package`` to bisect: ``given`` (a comma list, in its order) or the index's between
    ``frm`` and ``to`` (both included; ``installed`` is the installed release)."""
    installed = versions.installed_version(package).split("+")[0]
    if given:
        out = [installed if v.strip() == kconfig.INSTALLED else v.strip() for v in given.split(",") if v.strip()]
        for v in out:
            kconfig.check_version(v)
        if len(out) < 2:
            raise kconfig.ConfigError(f"--releases needs at least two releases to compare, got {given!r}")
        return out, "--releases"
    for v in (frm, to):
        if v is not None:
            kconfig.check_version(v)
    hi = installed if to == kconfig.INSTALLED else to
    found, where = index_releases(package)
    if installed not in found and _final(installed):
        found = sorted([*found, installed], key=version_key)
    out = [v for v in found if (frm is None or version_key(v) >= version_key(frm)) and version_key(v) <= version_key(hi)]
    if len(out) < 2:
        raise kconfig.ConfigError(f"between {frm or 'the first release'} and {hi} {where} has {len(out)} "
                                  f"release(s) of {package}: nothing to bisect")
    return out, where


# ---------------------------------------------------------------------------------------------- one release

def result_of(summary: dict, loop: str, release: str, recs: list[dict]) -> dict:
    """One release's result for the bisect: verdict, the step in words, the ratio of every step."""
    row = next((r for r in summary["loops"] if r["loop"] == loop), None)
    if row is None:
        return {"release": release, "verdict": oracle.CANNOT_RUN, "step": None, "ratios": [],
                "reason": f"the loop {loop!r} did not run"}
    step = "global mean"
    if row["verdict"] == oracle.AFFECTED:
        if row.get("ties"):
            step = "ambiguous between " + " and ".join(f"'{t}'" for t in row["ties"])
        elif row.get("matches") not in (None, "none"):
            step = row["matches"]
        else:
            step = row.get("shape") or "off, not named"
    optimizer = next((r.get("optimizer") for r in recs if r.get("role") == "measured" and r.get("optimizer")), None)
    return {"release": release, "verdict": row["verdict"], "step": step if row["verdict"] == oracle.AFFECTED else None,
            "ratios": [s["ratio"] for s in row["steps"]], "cosine": row.get("cosine"),
            "misplaced_weight": row.get("misplaced_weight"), "explained_by": row.get("explained_by"),
            "optimizer": optimizer, "reason": row.get("reason") if row["verdict"] in SKIPPED else None,
            "control": (summary.get("control") or {}).get("verdict")}


def measure_with(cfg, loop: str, world_size: int, device: str, timeout_s: float, steps: int, model=None):
    """``measure(release) -> result``: the check's probe on that release, one world."""
    def measure(release: str) -> dict:
        stack = stack_of(release)
        try:
            recs = ds_config.run(cfg, (loop,), world_size, stack, device, timeout_s, steps=steps, model=model)
        except versions.CannotRun as e:
            return {"release": release, "verdict": oracle.CANNOT_RUN, "step": None, "ratios": [], "reason": e.reason}
        return result_of(check.summarise(recs), loop, release, recs)

    return measure


def step_words(rec: dict) -> str | None:
    """A probe record's step in words: per stage for a pipeline (``stage 0: sum (x GA); stage 1: ...``), else the
    named hypothesis it matches."""
    if rec.get("stages"):
        return "; ".join(f"stage {s['stage']}: {s.get('matches')}" for s in rec["stages"])
    return rec.get("matches") or rec.get("shape") or "off (this probe names no step)"


def probe_measure(probe, run_kwargs: dict, case: str, axis: str = PACKAGE, words=step_words):
    """``measure(release)`` for any registered probe (``kit.probes``): ``probe.run(**run_kwargs)`` on a stack
    holding that release of ``axis`` (``deepspeed``, ``transformers`` or ``accelerate``: a package the probe's stack
    names), judged on its record of ``case`` by the probe's own verdict. This is how the known bugs' boundaries
    are found with their own probes (B2's pipeline, B1's Trainer), as the check's probe finds a config's."""
    if axis not in probe.packages:
        raise kconfig.ConfigError(f"the {probe.id} probe's stack names {list(probe.packages)}, not {axis!r}")

    def measure(release: str) -> dict:
        stack = stack_of(release, axis)
        try:
            recs = probe.run(**run_kwargs, stacks=[stack])
        except versions.CannotRun as e:
            return {"release": release, "verdict": oracle.CANNOT_RUN, "step": None, "ratios": [], "reason": e.reason}
        mine = [r for r in recs if r.get("case") == case]
        if not mine:
            return {"release": release, "verdict": oracle.CANNOT_RUN, "step": None, "ratios": [],
                    "reason": f"the probe gave no record of the case {case!r}"}
        verdicts = [r.get(probe.verdict_key, r["verdict"]) for r in mine]  # the case's worst configuration
        verdict = min(verdicts, key=lambda v: oracle.WORST_FIRST.index(v) if v in oracle.WORST_FIRST else 99)
        worst = [r for r, v in zip(mine, verdicts) if v == verdict]
        rec = worst[0]
        steps = sorted({str(words(r)) for r in worst}) if verdict == oracle.AFFECTED else []
        return {"release": release, "verdict": verdict, "step": "; ".join(steps) or None,
                "ratios": [(st.get("metrics") or {}).get("norm_ratio") for st in rec.get("steps") or [rec]],
                "reason": rec.get(probe.reason_key()) if verdict in SKIPPED else None, "optimizer": rec.get("optimizer")}

    return measure


def signature(res: dict) -> tuple:
    """What a change is a change of: the verdict, and the step's shape where it is off."""
    return res["verdict"], res.get("step")


# ---------------------------------------------------------------------------------------------- the search

def grid(n: int, stride: int) -> list[int]:
    """The first pass: every ``stride``-th of ``n`` releases, and the last."""
    return sorted({*range(0, n, max(1, stride)), n - 1})


def prefetch(order: list[str], stride: int, progress: bool = True, probe=None, axis: str = PACKAGE) -> list[str]:
    """The first pass's releases installed (and their comm ops built) up front, in parallel (``kit.stacks.prefetch``),
    for ``probe`` (the check's by default); the binary search's few releases install as it reaches them. Returns
    what could not be prepared (those releases are then measured ``cannot-run``, i.e. skipped)."""
    stacks = [stack_of(order[i], axis) for i in grid(len(order), stride)]
    stacks = [st for st in stacks if st]  # the installed release needs nothing
    _, problems = kprefetch.prefetch(kprefetch.needs_of([(probe or ds_config.CHECK, st) for st in stacks]),
                                     progress=progress)
    return problems


def search(order: list[str], measure, stride: int = STRIDE, confirm: bool = True, progress=None) -> dict:
    """Find every release in ``order`` where the result changes. ``measure(release)`` -> result (``result_of``).

    Returns ``{"measured": {release: result}, "changes": [...], "skipped": [...], "confirmations": {...}}``; a change
    is ``{"before": release, "after": release, "between": [skipped releases in between], "from": result,
    "to": result, "confirmed": bool}``. A release is measured at most once in the search (and once more to confirm)."""
    seen: dict[int, dict] = {}

    def get(i: int) -> dict:
        if i not in seen:
            seen[i] = measure(order[i])
            if progress:
                progress(order[i], seen[i])
        return seen[i]

    def runs(i: int) -> bool:
        return get(i)["verdict"] not in SKIPPED

    def nearest(candidates):  # the first release that runs, nearest first
        return next((i for i in candidates if runs(i)), None)

    n = len(order)
    anchors = [i for i in grid(n, stride) if runs(i)]
    if not anchors:  # no grid release runs: look at every other one before giving up
        anchors = [i for i in range(n) if runs(i)]
    changes = []

    def split(lo: int, hi: int) -> None:
        if signature(get(lo)) == signature(get(hi)):
            return
        inner = list(range(lo + 1, hi))
        mid = nearest(sorted(inner, key=lambda i: (abs(2 * i - lo - hi), i)))
        if mid is None:
            changes.append({"before": order[lo], "after": order[hi], "between": [order[i] for i in inner],
                            "from": get(lo), "to": get(hi)})
            return
        split(lo, mid)
        split(mid, hi)

    # a release below the first anchor or above the last that runs is an anchor too (the grid may have skipped it)
    first = nearest(range(0, anchors[0])) if anchors and anchors[0] > 0 else None
    last = nearest(range(n - 1, anchors[-1], -1)) if anchors and anchors[-1] < n - 1 else None
    anchors = sorted({*anchors, *(x for x in (first, last) if x is not None)})
    for lo, hi in zip(anchors, anchors[1:]):
        split(lo, hi)
    confirmations = {}
    if confirm:
        for ch in changes:
            for side, key in (("before", "from"), ("after", "to")):
                rel = ch[side]
                if rel not in confirmations:
                    again = measure(rel)
                    if progress:
                        progress(rel, again)
                    confirmations[rel] = signature(again) == signature(ch[key])
            ch["confirmed"] = confirmations[ch["before"]] and confirmations[ch["after"]]
    skipped = [{"release": order[i], "verdict": r["verdict"], "reason": r.get("reason")}
               for i, r in sorted(seen.items()) if r["verdict"] in SKIPPED]
    return {"order": list(order), "stride": stride, "measured": {order[i]: r for i, r in sorted(seen.items())},
            "changes": changes, "skipped": skipped, "confirmations": confirmations}


def describe(change: dict) -> str:
    """A change in one line: last good / first bad, fixed in, or a shape becoming another."""
    a, b = change["from"], change["to"]
    where = (f"between {change['before']} and {change['after']} (not run here: {', '.join(change['between'])})"
             if change["between"] else f"{change['before']} -> {change['after']}")
    if a["verdict"] == oracle.NOT_AFFECTED and b["verdict"] == oracle.AFFECTED:
        what = f"last good {change['before']}, first bad {change['after']}: the step becomes {b['step']}"
    elif a["verdict"] == oracle.AFFECTED and b["verdict"] == oracle.NOT_AFFECTED:
        what = f"last bad {change['before']} ({a['step']}), first good {change['after']}"
    elif a["verdict"] == b["verdict"] == oracle.AFFECTED:
        what = f"the step is {a['step']} until {change['before']}, {b['step']} from {change['after']}"
    else:
        what = f"{a['verdict']} until {change['before']}, {b['verdict']} from {change['after']}"
    sure = "" if change.get("confirmed", True) else " (NOT confirmed: a second run of one side gave another result)"
    return f"{where}: {what}{sure}"


# ---------------------------------------------------------------------------------------------- the change

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
GRADIENT_PATH = ("grad", "reduce", "boundary", "accumul", "offload", "partition", "average", "allreduce", "backward",
                 "step", "epilogue", "ipg", "bucket", "copy", "zero_", "loss", "num_items", "sync")


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
        root = versions.resolve_stack(stack_of(release, package), (package,)).roots.get(package)
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


# ---------------------------------------------------------------------------------------------- the command

def table(found: dict) -> str:
    """release -> verdict, the step, the ratio per step (measured releases; skipped ones with their reason)."""
    lines = [f"| {found.get('axis', 'DeepSpeed')} | verdict | the step is | ratio per step |", "|---|---|---|---|"]
    for rel in found["order"]:
        r = found["measured"].get(rel)
        if r is None:
            lines.append(f"| {rel} | not run (no change around it) | | |")
            continue
        step = r.get("step") or ("-" if r["verdict"] != oracle.NOT_AFFECTED else "global mean")
        if r["verdict"] in SKIPPED:
            step = f"skipped: {(r.get('reason') or '')[:160]}"
        ratios = " / ".join(f"{x:.3f}" for x in r["ratios"] if isinstance(x, (int, float))) or "-"
        lines.append(f"| {rel} | {r['verdict']} | {step} | {ratios} |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = kconfig.Parser(prog="gradkit bisect", description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", help="a DeepSpeed JSON config (HF Trainer's \"auto\" values allowed)")
    p.add_argument("--probe", help="instead of a config: a registered probe (B1, B2, B3, B4, DDP), its quick plan, "
                                   "judged on its measured case")
    p.add_argument("--axis", default=PACKAGE, help="the package whose releases are bisected (deepspeed; with --probe "
                                                  "also transformers or accelerate, where the probe's stack names it)")
    p.add_argument("--loop", default="engine", help=f"one of {', '.join(ds_config.LOOPS)}")
    p.add_argument("--from", dest="frm", default=None, help="the oldest release (default: the index's first)")
    p.add_argument("--to", default=kconfig.INSTALLED, help="the newest release (default: the installed one)")
    p.add_argument("--releases", default=None, help="a comma list of releases, bisected in this order (no index)")
    p.add_argument("--stride", type=int, default=STRIDE, help="the first pass measures every N-th release")
    p.add_argument("--steps", type=int, default=ds_config.STEPS, help="optimizer steps per release, each judged")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--ga", type=int, default=4, help="gradient_accumulation_steps where the config says \"auto\"")
    p.add_argument("--trainer-dtype", default=None, help="what \"auto\" in bf16/fp16.enabled resolves to")
    p.add_argument("--model", default=None, help="a model shape or your architecture (as gradkit check --model)")
    p.add_argument("--no-confirm", action="store_true", help="no second run on both sides of a change")
    p.add_argument("--no-progress", action="store_true", help="no progress bar while the first pass is prepared")
    p.add_argument("--device", default="cpu")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--json", help="write the table, the changes and their diffs here")
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    if a.loop not in ds_config.LOOPS:
        raise kconfig.ConfigError(f"--loop must be one of {', '.join(ds_config.LOOPS)}, got {a.loop!r}")
    kconfig.check_positive_int("--stride", a.stride)
    kconfig.check_positive_int("--steps", a.steps)
    kconfig.check_device(a.device)
    kconfig.check_timeout(a.timeout)
    kconfig.check_world_size(a.world_size, a.device)
    if a.json and not Path(a.json).parent.exists():
        raise kconfig.ConfigError(f"--json {a.json}: the folder {Path(a.json).parent} does not exist")
    if bool(a.probe) == bool(a.config):
        raise kconfig.ConfigError("give a DeepSpeed config or --probe, one of the two")
    probe = None
    if a.probe:
        probe = probes.get(a.probe)
        if a.axis not in probe.packages or a.axis == "torch":
            raise kconfig.ConfigError(f"--axis {a.axis}: the {probe.id} probe's stack names "
                                      f"{[x for x in probe.packages if x != 'torch']} (torch is the installed one)")
        measure = probe_measure(probe, {**probe.quick_plan(a.world_size), "device": a.device, "timeout_s": a.timeout},
                                probe.measured_case, a.axis)
        what, notes = f"the {probe.id} probe ({probe.title}), case {probe.measured_case}", []
    else:
        if a.axis != PACKAGE:
            raise kconfig.ConfigError(f"--axis {a.axis} needs --probe: a DeepSpeed config is bisected over DeepSpeed")
        user = ds_config.load(a.config)
        model, notes = check.model_of(a.model, None)
        dtypes = check.precisions(user, a.trainer_dtype)
        if len(dtypes) > 1:
            raise kconfig.ConfigError(f"{a.config}: \"auto\" precision could be {' or '.join(dtypes)}; say which "
                                      "with --trainer-dtype (a bisect follows one configuration)")
        cfg = ds_config.resolve(user, a.world_size, a.ga, dtypes[0])
        ds_config.plan(cfg, (a.loop,), steps=a.steps, model=model)  # bad input is refused here, before any launch
        measure = measure_with(cfg, a.loop, a.world_size, a.device, a.timeout, a.steps, model)
        what, notes = f"{a.config}: loop {a.loop}, {a.steps} judged steps each", list(cfg.notes) + notes
    order, where = release_list(a.frm, a.to, a.releases, a.axis)
    print(f"gradkit bisect {what}; {len(order)} {a.axis} releases from {where} ({order[0]} .. {order[-1]}), "
          f"every {a.stride} releases first")
    for n in notes:
        print(f"  as run: {n}")

    for problem in prefetch(order, a.stride, progress=not a.no_progress, probe=probe, axis=a.axis):
        print(f"  not prepared: {problem}")

    def said(rel, res):
        extra = res.get("step") or (res.get("reason") or "")[:120]
        print(f"  {rel:>8}: {res['verdict']}" + (f" ({extra})" if extra else ""), flush=True)

    found = search(order, measure, a.stride, not a.no_confirm, said)
    if a.axis != PACKAGE:
        found["axis"] = a.axis
    print(table(found))
    runnable = [r for r in found["measured"].values() if r["verdict"] not in SKIPPED]
    if a.stride > 1:
        print(f"(a change and its undoing between two of the first pass's releases, {a.stride} apart, is not seen: "
              f"--stride 1 measures every release)")
    for ch in found["changes"]:
        print("change: " + describe(ch))
        opt = ch["to"].get("optimizer") or ch["from"].get("optimizer")
        ch["diff"] = diff(ch["before"], ch["after"], opt, package=a.axis)
        print("\n".join("    " + x for x in diff_text(ch["diff"]).splitlines()))
    if not found["changes"]:
        print("no change: every release that ran gave the same result" if len(runnable) > 1 else
              "nothing to compare: fewer than two releases ran here")
    if a.json:
        Path(a.json).write_text(json.dumps({"config": a.config, "probe": a.probe, "axis": a.axis, "loop": a.loop,
                                            "releases_from": where, **found},
                                           indent=1, default=str))
    if len(runnable) < 2:
        return 3
    newest = runnable[-1]  # exit 1 means a measured affected, as for gradkit check: here, on the newest that ran
    print(f"newest release that ran: {newest['release']}, {newest['verdict']}")
    return 1 if newest["verdict"] == oracle.AFFECTED else 0


if __name__ == "__main__":
    kconfig.run_cli(main)
