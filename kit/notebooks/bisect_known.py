"""The known bugs' releases, found again by ``gradkit bisect``: the proof that bisect is right (notebook 08).

Each known bug is bisected with the configuration (or the probe) that shows it, and what bisect finds is checked
against ``gradkit.judge.expectations.KNOWN``: every release it measured that the table pins must have the table's
verdict, and a change it finds between two releases must hold the table's boundary in between (``(before, after]``;
exact where the two are neighbours on the index). A boundary bisect finds that the table does not have is a finding.

- B4: bf16 + ``grad_accum_dtype: fp32`` + ZeRO-1, DeepSpeed's own loop (fixed in 0.19.0);
- B5: ZeRO-2 + ``offload_optimizer`` cpu, GA 8, DeepSpeed's own loop (#6550 brought it, fixed in 0.19.0);
- B3: ZeRO-1 fp32, config GA = 1 with 4 manual ``backward()`` per step (never fixed); its opt-out loop
  (``managed_gradient_accumulation: false``) runs from 0.19.4 and is exact there;
- B2: the pipeline probe itself (2 stages, GA 4): every stage sums until 0.18.2, the earlier stage is divided by
  GA twice from 0.18.3, fixed in 0.19.3 -- a change of shape, then a fix;
- B8: ZeRO-1 fp32 with ``contiguous_gradients: false`` on the CPU accelerator (fixed in 0.19.8): the group the sweep
  marked unknown, whose end notebook 08 finds;
- B12: ZeRO-2 fp32, GA 4, DeepSpeed's own loop: only the boundary micro-batch from 0.17.6 (#7509), fixed in 0.18.3;
- B11: ZeRO-2 + ``offload_optimizer`` cpu, 4 manual ``backward()`` per step: from 0.19.0 the first micro-batch is lost
  and the previous update applied again (0.18.7 - 0.18.9 cannot run here: skipped);
- B10: fp16 with a dynamic loss scale, ZeRO-2: half a step where the scale grows, in every release; from 0.17.1 the
  scale grows one clean step later (a change of the step that keeps the verdict).
"""
from __future__ import annotations

from gradkit import config as kconfig
from gradkit.commands.bisect import known, listing, result, search
from gradkit.commands.sweep import spec as sweep_spec
from gradkit.judge import expectations as ex
from gradkit.judge import oracle
from gradkit.judge.expectations import UNMANAGED_SINCE
from gradkit.probes import ds_config
from gradkit.stacks.fixes import FIXES
from gradkit.stacks.versions import version_key

BUGS = ("B4", "B5", "B3", "B3 opt-out", "B2", "B8", "B12", "B11", "B10", "B13")  # the recipes (gradkit.commands.bisect.known) notebook 08 bisects


def run(bug: str, releases: list[str], stride: int = 1, **kw) -> dict:
    """Bisect one known bug over ``releases`` (in order; ``installed`` allowed), each change confirmed, measured as
    its recipe says (``gradkit.commands.bisect.known``)."""
    recipe = known.RECIPES[bug]
    order, _ = listing.release_list(None, kconfig.INSTALLED, ",".join(releases), recipe.axis)
    return {"bug": bug, **search.search(order, known.measure(recipe, **kw), stride)}


def needs(releases_by_bug: dict) -> list:
    """The ``(probe, stack)`` pairs the bisects will run (for ``gradkit.stacks.prefetch``); "story" is a config through
    the check's probe."""
    out = []
    for bug, releases in releases_by_bug.items():
        if bug == "story":
            out += [(ds_config.CHECK, {} if r == kconfig.INSTALLED else listing.stack_of(r)) for r in releases]
        else:
            out += known.needs(known.RECIPES[bug], releases)
    return out


def _expected(bug: str, release: str) -> str | None:
    if bug == "B3 opt-out":
        return oracle.NOT_AFFECTED if version_key(release) >= version_key(ex.UNMANAGED_SINCE) else None
    return ex.KNOWN[bug].expected_for_release(release)


def _boundaries(bug: str) -> list[tuple[str, str]]:
    """The releases where the table says the result changes: ``(release, what)``, what starts there: the pins of
    the bug's series (``gradkit.judge.pins``), else its ``introduced_in`` and ``fixed_in``."""
    k = ex.KNOWN[known.RECIPES[bug].bug]
    mine = [(p.after, p.what) for p in k.pins if p.series == bug]
    if mine:
        return mine
    if bug == "B3 opt-out":
        return [(ex.UNMANAGED_SINCE, "the opt-out key exists")]
    return [*([(k.introduced_in, "introduced")] if k.introduced_in else []),
            *([(k.fixed_in, "fixed")] if k.fixed_in else [])]


def violations(found: dict) -> list[str]:
    """Where a bisect disagrees with the table: a pinned release measured otherwise, a change with no boundary of
    the table inside it, a boundary of the table between two measured releases with no change found there."""
    bug, out = found["bug"], []
    runs = [(rel, r) for rel, r in found["measured"].items() if r["verdict"] not in result.SKIPPED]
    if bug == "B3 opt-out":  # the loop runs exactly from the release that has the key
        for rel, r in found["measured"].items():
            if (r["verdict"] in result.SKIPPED) != (version_key(rel) < version_key(UNMANAGED_SINCE)):
                out.append(f"B3 opt-out on {rel}: {r['verdict']}, but the key arrives in {UNMANAGED_SINCE}")
    for rel, r in runs:
        want = _expected(bug, rel)
        if want is not None and r["verdict"] != want:
            out.append(f"{bug} on {rel}: measured {r['verdict']}, the table says {want}")
    bounds = _boundaries(bug)
    for ch in found["changes"]:
        lo, hi = version_key(ch["before"]), version_key(ch["after"])
        if not any(lo < version_key(b) <= hi for b, _ in bounds):
            out.append(f"{bug}: a change the table does not have: {search.describe(ch)}")
    ran = sorted(version_key(rel) for rel, _ in runs)
    for b, what in bounds:
        below = [v for v in ran if v < version_key(b)]
        above = [v for v in ran if v >= version_key(b)]
        if below and above and not any(version_key(c["before"]) < version_key(b) <= version_key(c["after"])
                                       for c in found["changes"]):
            if bug == "B3 opt-out":
                continue  # below the key the loop cannot run at all: skipped, so no change can be seen there
            out.append(f"{bug}: the table's boundary at {b} ({what}) lies between releases that ran, but no change "
                       "was found there")
    return out


def history_violations(hist: dict) -> list[str]:
    """Where the release history (``gradkit.judge.history``) and the table disagree: a pin whose two releases are not
    both in its series, measured and different; a release between a pin's two that ran after all; a release of a
    bug's own series (its package, nothing held) whose verdict is not the one the table pins for it."""
    out = []
    for k in ex.KNOWN.values():
        for p in k.pins:
            s = hist["series"].get(p.series)
            a, b = ((s or {}).get("releases", {}).get(r) for r in (p.before, p.after))
            if not s or s["bug"] != k.bug or a is None or b is None:
                out.append(f"{k.bug}: the pin {p.before} -> {p.after} has no measurement of both in series {p.series!r}")
            elif a["verdict"] in result.SKIPPED or b["verdict"] in result.SKIPPED or result.same(a, b):
                out.append(f"{k.bug}: the pin {p.before} -> {p.after} is not a measured change: {a['verdict']}, "
                           f"{b['verdict']}")
            for rel in p.between:
                if (s or {}).get("releases", {}).get(rel, {}).get("verdict", oracle.CANNOT_RUN) not in result.SKIPPED:
                    out.append(f"{k.bug}: {rel} lies between the pin's releases as one that cannot run, but it ran")
        s = hist["series"].get(k.bug)
        if s and s["axis"] == k.package and not s.get("with") and not k.rules:
            for rel, res in s["releases"].items():
                want = k.expected_for_release(rel)
                if want is not None and res["verdict"] not in result.SKIPPED and res["verdict"] != want:
                    out.append(f"{k.bug} on {rel}: the history holds {res['verdict']}, the table says {want}")
    return out


def summary_rows(founds: list[dict]) -> list[dict]:
    """One row per known bug: the changes in words, what was skipped, and whether the table agrees."""
    return [{"bug": f["bug"], "releases": f"{f['order'][0]} .. {f['order'][-1]} ({len(f['measured'])} measured)",
             "changes": "; ".join(search.describe(c) for c in f["changes"]) or "none",
             "skipped": ", ".join(s["release"] for s in f["skipped"]) or "-",
             "agrees with kit/judge/expectations.py": "yes" if not violations(f) else "; ".join(violations(f))}
            for f in founds]


def check_notebook(p: dict) -> list:
    """Every parameter of notebook 08, by its name there (the notebook and ``gradkit.notebooks.runall`` call it first); returns
    the ``(probe, stack)`` pairs its worlds will run (``gradkit.stacks.prefetch``)."""
    if not isinstance(p["STORY_CONFIG"], dict):
        raise kconfig.ConfigError(f"STORY_CONFIG must be a DeepSpeed config (a mapping), got {p['STORY_CONFIG']!r}")
    if p["STORY_LOOP"] not in ds_config.LOOPS:
        raise kconfig.ConfigError(f"STORY_LOOP must be one of {', '.join(ds_config.LOOPS)}, got {p['STORY_LOOP']!r}")
    known = p["KNOWN_RELEASES"]
    if not isinstance(known, dict) or not set(known) <= set(BUGS):
        raise kconfig.ConfigError(f"KNOWN_RELEASES maps some of {', '.join(BUGS)} to release lists, got {known!r}")
    for name, rels in [("STORY_RELEASES", p["STORY_RELEASES"]), *((f"KNOWN_RELEASES[{b!r}]", r) for b, r in known.items())]:
        if not isinstance(rels, list) or len(rels) < 2:
            raise kconfig.ConfigError(f"{name} must list at least two releases, got {rels!r}")
        for v in rels:
            kconfig.check_version(v)
    if p["FIX_BUG"] not in FIXES:
        raise kconfig.ConfigError(f"FIX_BUG must be a bug the kit holds a fix for ({', '.join(FIXES)}), got "
                                  f"{p['FIX_BUG']!r}")
    stages = FIXES[p["FIX_BUG"]].stages
    if not isinstance(p["FIX_STAGES"], list) or not p["FIX_STAGES"] or not set(p["FIX_STAGES"]) <= set(stages):
        raise kconfig.ConfigError(f"FIX_STAGES must list some of the ZeRO stages {p['FIX_BUG']}'s reproduction runs "
                                  f"at ({', '.join(map(str, stages))}), got {p['FIX_STAGES']!r}")
    if p["FIX_SWEEP"] is not None:
        sweep_spec.load_spec(p["FIX_SWEEP"])
    kconfig.check_positive_int("STRIDE", p["STRIDE"])
    kconfig.check_positive_int("STEPS", p["STEPS"])
    ds_config.resolve(p["STORY_CONFIG"], p["WORLD_SIZE"], p["STORY_CONFIG"].get("gradient_accumulation_steps", 4),
                      ds_config.dtype_of(p["STORY_CONFIG"]))
    listing.release_list(None, kconfig.INSTALLED, ",".join(p["STORY_RELEASES"]))
    return needs({"story": p["STORY_RELEASES"], **known})
