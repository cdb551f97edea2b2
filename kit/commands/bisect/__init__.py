"""``gradkit bisect ds_config.json``: since which DeepSpeed release does this config's accumulation change, and how?

    gradkit bisect ds_config.json --loop manual [--from 0.14.0] [--to installed] [--steps 3] [--json out.json]
    gradkit bisect ds_config.json --releases 0.18.9,0.19.0        # exactly these releases, in this order
    gradkit bisect --probe B1 --axis transformers --releases 4.46.0,5.3.0,installed   # a probe, another package
    gradkit bisect --probe B1 --axis deepspeed --with transformers=5.3.0    # the other package held at one release
    gradkit bisect --known B5 [--from 0.14.4]      # a known bug, measured as its recipe says (bisect/known.py)

Every release measured is ``gradkit check``'s probe on that release (the same oracle, control and fitted weights,
one world each, the release as an overlay). A release's **result** is the loop's verdict and the step it applied
in words (the named hypothesis its fitted weights match, else the step as fitted), so a change is found where the
verdict flips *and* where the step changes shape ("first and last micro-batch" becoming "all but the first").

The search: every ``--stride``-th release of the ordered list first (a change and its undoing between two of them
is not seen, and the output says so), then a binary search between two neighbours whose results differ, then a
confirming run in a fresh world on both sides of each change. A release that cannot be installed or run here
(or whose control is off: ``inconclusive``) is **skipped**, named with its reason, never counted as good; a change
next to skipped releases is a range. For each change, the code that changed between its two releases in the files
the measured run went through (``gradkit.commands.bisect.diff``). Exit status, as ``gradkit check``'s: 0 the newest release that
ran is not affected, 1 it is (a measured ``affected``), 2 bad input (nothing launched), 3 fewer than two releases
could run.

The pieces: the releases to go through (``listing``), one release measured and its result (``result``), the search
and its words (``search``), the code that changed (``diff``); this module is the command.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from gradkit import config as kconfig
from gradkit import probes
from gradkit.commands import check
from gradkit.commands.bisect import diff, known, listing, result, search
from gradkit.judge import history, oracle
from gradkit.probes import ds_config
from gradkit.stacks import versions


def parser() -> argparse.ArgumentParser:
    p = kconfig.Parser(prog="gradkit bisect", description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", help="a DeepSpeed JSON config (HF Trainer's \"auto\" values allowed)")
    p.add_argument("--probe", help="instead of a config: a registered probe (B1, B2, B3, B4, DDP), its quick plan, "
                                   "judged on its measured case")
    p.add_argument("--known", metavar="NAME", help=f"instead of a config: a known bug's recipe, one of "
                                                   f"{', '.join(known.RECIPES)} (its configuration or probe, "
                                                   "axis and held releases; --from defaults to its oldest)")
    p.add_argument("--keep", action="store_true", help="with --known: add every release measured to the release "
                                                       "history (kit/judge/history.json), saying what moved")
    p.add_argument("--case", default=None, help="with --probe: the case judged (default: the probe's measured one)")
    p.add_argument("--with", dest="fixed", action="append", default=[], metavar="PKG=RELEASE",
                   help="hold another package at one release in every stack (repeatable)")
    p.add_argument("--axis", default=listing.PACKAGE, help="the package whose releases are bisected (deepspeed; with "
                                                          "--probe also transformers or accelerate, where the probe's "
                                                          "stack names it)")
    p.add_argument("--loop", default="engine", help=f"one of {', '.join(ds_config.LOOPS)}")
    p.add_argument("--from", dest="frm", default=None, help="the oldest release (default: the index's first)")
    p.add_argument("--to", default=kconfig.INSTALLED, help="the newest release (default: the installed one)")
    p.add_argument("--releases", default=None, help="a comma list of releases, bisected in this order (no index)")
    p.add_argument("--stride", type=int, default=search.STRIDE, help="the first pass measures every N-th release")
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
    if sum(map(bool, (a.probe, a.config, a.known))) != 1:
        raise kconfig.ConfigError("give a DeepSpeed config, --probe or --known, one of the three")
    fixed = fixed_releases(a.fixed, a.axis)
    if a.keep and not a.known:
        raise kconfig.ConfigError("--keep needs --known: the release history holds the known bugs' recipes")
    probe = None
    if a.known:
        if a.known not in known.RECIPES:
            raise kconfig.ConfigError(f"--known {a.known!r}: the recipes are {', '.join(known.RECIPES)}")
        if a.fixed or a.case or a.axis != listing.PACKAGE or a.model:
            raise kconfig.ConfigError("--known takes its axis, case, model and held releases from its recipe")
        recipe = known.RECIPES[a.known]
        a.axis, fixed, a.frm, a.loop = recipe.axis, dict(recipe.fixed), a.frm or recipe.oldest, recipe.loop
        probe = known.probe_of(recipe)
        measure = known.measure(recipe, a.world_size, a.device, a.timeout, a.steps)
        what, notes = f"the known bug {recipe.name} ({recipe.probe or 'loop ' + recipe.loop})", \
            [f"releases older than {recipe.oldest}: {recipe.older}"]
    elif a.probe:
        probe = probes.get(a.probe)
        if a.axis not in probe.packages or a.axis == "torch":
            raise kconfig.ConfigError(f"--axis {a.axis}: the {probe.id} probe's stack names "
                                      f"{[x for x in probe.packages if x != 'torch']} (torch is the installed one)")
        case = a.case or probe.measured_case
        measure = result.probe_measure(probe, {**probe.quick_plan(a.world_size), "device": a.device,
                                               "timeout_s": a.timeout}, case, a.axis, fixed=fixed)
        what, notes = f"the {probe.id} probe ({probe.title}), case {case}", []
    else:
        if a.axis != listing.PACKAGE:
            raise kconfig.ConfigError(f"--axis {a.axis} needs --probe: a DeepSpeed config is bisected over DeepSpeed")
        if a.case:
            raise kconfig.ConfigError("--case needs --probe: a config is judged on its --loop")
        user = ds_config.load(a.config)
        model, notes = check.model_of(a.model, None)
        dtypes = check.precisions(user, a.trainer_dtype)
        if len(dtypes) > 1:
            raise kconfig.ConfigError(f"{a.config}: \"auto\" precision could be {' or '.join(dtypes)}; say which "
                                      "with --trainer-dtype (a bisect follows one configuration)")
        cfg = ds_config.resolve(user, a.world_size, a.ga, dtypes[0])
        ds_config.plan(cfg, (a.loop,), steps=a.steps, model=model)  # bad input is refused here, before any launch
        measure = result.measure_with(cfg, a.loop, a.world_size, a.device, a.timeout, a.steps, model, fixed=fixed)
        what, notes = f"{a.config}: loop {a.loop}, {a.steps} judged steps each", list(cfg.notes) + notes
    order, where = listing.release_list(a.frm, a.to, a.releases, a.axis)
    print(f"gradkit bisect {what}; {len(order)} {a.axis} releases from {where} ({order[0]} .. {order[-1]}), "
          f"every {a.stride} releases first")
    for n in notes + [f"{p} {v} in every stack" for p, v in fixed.items()]:
        print(f"  as run: {n}")

    for problem in search.prefetch(order, a.stride, progress=not a.no_progress, probe=probe, axis=a.axis, fixed=fixed):
        print(f"  not prepared: {problem}")

    def said(rel, res):
        extra = res.get("step") or (res.get("reason") or "")[:120]
        print(f"  {rel:>8}: {res['verdict']}" + (f" ({extra})" if extra else ""), flush=True)

    found = search.search(order, measure, a.stride, not a.no_confirm, said)
    if a.axis != listing.PACKAGE:
        found["axis"] = a.axis
    print(search.table(found))
    runnable = [r for r in found["measured"].values() if r["verdict"] not in result.SKIPPED]
    if a.stride > 1:
        print(f"(a change and its undoing between two of the first pass's releases, {a.stride} apart, is not seen: "
              f"--stride 1 measures every release)")
    for ch in found["changes"]:
        print("change: " + search.describe(ch))
        opt = ch["to"].get("optimizer") or ch["from"].get("optimizer")
        ch["diff"] = diff.diff(ch["before"], ch["after"], opt, package=a.axis)
        print("\n".join("    " + x for x in diff.diff_text(ch["diff"]).splitlines()))
    if not found["changes"]:
        print("no change: every release that ran gave the same result" if len(runnable) > 1 else
              "nothing to compare: fewer than two releases ran here")
    if a.json:
        Path(a.json).write_text(json.dumps({"config": a.config, "probe": a.probe, "known": a.known, "axis": a.axis,
                                            "loop": a.loop, "with": fixed,
                                            "releases_from": where, **found},
                                           indent=1, default=str))
    if a.keep:
        recipe = known.RECIPES[a.known]
        hist = history.load()
        how = "gradkit bisect " + " ".join(shlex.quote(x) for x in (argv if argv is not None else sys.argv[1:]))
        for line in history.merge(hist, recipe.name, recipe.bug, recipe.axis, fixed, found["measured"], how,
                                  time.strftime("%Y-%m-%d"), result.same):
            print("moved: " + line)
        history.save(hist)
        print(f"kept: {len(found['measured'])} releases in {history.PATH}")
    if len(runnable) < 2:
        return 3
    newest = runnable[-1]  # exit 1 means a measured affected, as for gradkit check: here, on the newest that ran
    print(f"newest release that ran: {newest['release']}, {newest['verdict']}")
    return 1 if newest["verdict"] == oracle.AFFECTED else 0


def fixed_releases(given: list[str], axis: str) -> dict:
    """``--with PKG=RELEASE`` (repeatable) as ``{package: release}``: a package the kit overlays, not the axis."""
    out = {}
    for item in given:
        pkg, _, rel = item.partition("=")
        if pkg not in versions.PACKAGES or not rel:
            raise kconfig.ConfigError(f"--with {item!r}: give PACKAGE=RELEASE, PACKAGE one of {', '.join(versions.PACKAGES)}")
        if pkg == axis:
            raise kconfig.ConfigError(f"--with {item!r}: {pkg} is the axis being bisected")
        kconfig.check_version(rel)
        out[pkg] = rel
    return out
