"""``scripts/refresh_table`` (``python -m kit.commands.refresh``): the upstream table checked against the package index
as it is today, as a maintainer runs it weekly.

    scripts/refresh_table [--only B5,B1] [--full] [--page docs/refresh.md] [--json runs/refresh.json]

For every known bug's recipe (``kit.commands.bisect.known``) it measures, each in a fresh world:

- **each pin** of ``kit.judge.expectations`` (both releases of it): the two must still differ the way the pin says,
  and each must be the measurement the release history holds (``kit/judge/history.json``); otherwise the pin moved;
- **every release newer than the table vouches for** (``newest_pinned``) that the index has now, against the newest
  pinned one: the same result is "as the table says"; another is a **new change**, bisected between the two, with
  its diff. A new upstream release therefore never falls outside the table silently: it is measured, or the page
  says why it was not (it cannot install or run here);
- with ``--full``, every release from the recipe's oldest to the newest, bisected (the pins found again).

It writes the page (``--page``, a page of the site: what was measured, what moved, each bug's pins with the
command that found them), the results into the release history, and ``--json``. Exit status: 0 nothing moved,
1 something moved (a pin no longer holds, a new release changes a bug's result), 2 bad input, 3 a recipe could not
run at all.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kit import config as kconfig
from kit.commands.bisect import diff, known, listing, result, search
from kit.judge import expectations, history
from kit.stacks import prefetch as kprefetch
from kit.stacks.versions import version_key

PAGE = Path(__file__).resolve().parents[2] / "docs" / "refresh.md"


def parser() -> argparse.ArgumentParser:
    p = kconfig.Parser(prog="scripts/refresh_table", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=None, help=f"a comma list of recipes (default: all of {', '.join(known.RECIPES)})")
    p.add_argument("--full", action="store_true", help="bisect every release from each recipe's oldest, not only "
                                                       "the pins and the releases newer than the table")
    p.add_argument("--page", default=str(PAGE), help="the markdown page written (a page of the site)")
    p.add_argument("--json", default=None, help="also write every result here")
    p.add_argument("--history", default=str(history.PATH), help="the release history updated")
    p.add_argument("--device", default="cpu")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--no-progress", action="store_true")
    return p


def pins_of(recipe: known.Recipe) -> list:
    return [p for p in expectations.KNOWN[recipe.bug].pins if p.series == recipe.name]


def to_measure(recipe: known.Recipe, index: list[str], full: bool) -> list[str]:
    """The releases a refresh measures for ``recipe``, in release order: both sides of each pin, the newest release
    the table vouches for and every newer one on ``index`` (every release from the recipe's oldest with ``full``)."""
    newest = expectations.KNOWN[recipe.bug].newest_pinned if recipe.axis == expectations.KNOWN[recipe.bug].package \
        else None
    want = {rel for p in pins_of(recipe) for rel in (p.before, p.after)}
    if newest:
        anchor = max((r for r in index if version_key(r) <= version_key(newest)), key=version_key, default=None)
        want |= {r for r in index if version_key(r) > version_key(newest)} | ({anchor} if anchor else set())
    if full:
        want |= {r for r in index if version_key(r) >= version_key(recipe.oldest)}
    return sorted(want, key=version_key)


def check_pins(recipe: known.Recipe, measured: dict) -> list[dict]:
    """Each pin of ``recipe`` against what was measured now: ``{"pin", "holds", "why"}``."""
    out = []
    for p in pins_of(recipe):
        a, b = measured.get(p.before), measured.get(p.after)
        if a is None or b is None or a["verdict"] in result.SKIPPED or b["verdict"] in result.SKIPPED:
            why = "not measured now: " + "; ".join(f"{r} {(m or {}).get('verdict', 'not run')}"
                                                    for r, m in ((p.before, a), (p.after, b)))
            out.append({"pin": p, "holds": None, "why": why})
        elif result.same(a, b):
            out.append({"pin": p, "holds": False, "why": f"{p.before} and {p.after} now measure the same: "
                                                         f"{a['verdict']}"})
        else:
            out.append({"pin": p, "holds": True, "why": "; ".join(result.differences(a, b))})
    return out


def new_releases(recipe: known.Recipe, measured: dict, order: list[str]) -> tuple[list[dict], str | None]:
    """The releases newer than the table against its newest pinned one: ``([{"release", "result", "same"}], anchor)``."""
    k = expectations.KNOWN[recipe.bug]
    if recipe.axis != k.package:
        return [], None
    older = [r for r in order if version_key(r) <= version_key(k.newest_pinned) and
             measured.get(r, {}).get("verdict") not in (None, *result.SKIPPED)]
    anchor = older[-1] if older else None
    out = []
    for r in order:
        if version_key(r) > version_key(k.newest_pinned):
            res = measured[r]
            out.append({"release": r, "result": res, "same": None if anchor is None or res["verdict"] in result.SKIPPED
                        else result.same(measured[anchor], res)})
    return out, anchor


def refresh_one(recipe: known.Recipe, index: list[str], full: bool, device: str, timeout_s: float) -> dict:
    """One recipe refreshed: its releases measured (``--full``: bisected), its pins checked, its new releases
    compared with the table's newest, and a new change bisected with its diff."""
    order = to_measure(recipe, index, full)
    measure = known.measure(recipe, device=device, timeout_s=timeout_s)
    if full:
        found = search.search(order, measure, search.STRIDE, confirm=True)
        measured = dict(found["measured"])
    else:
        measured = {r: measure(r) for r in order}
        found = {"changes": []}
    news, anchor = new_releases(recipe, measured, order)
    changes = list(found["changes"])
    if not full and any(n["same"] is False for n in news):  # every newer release ran: the changes among them
        newer = [anchor] + [n["release"] for n in news]
        changes += search.search(newer, lambda r: measured[r], 1, confirm=False)["changes"]
    for ch in changes:
        opt = ch["to"].get("optimizer") or ch["from"].get("optimizer")
        ch["diff"] = diff.diff(ch["before"], ch["after"], opt, package=recipe.axis)
    return {"recipe": recipe, "measured": measured, "pins": check_pins(recipe, measured), "new": news,
            "anchor": anchor, "changes": changes}


def moved(done: dict) -> list[str]:
    """What a refreshed recipe found that the table does not say, in sentences."""
    out = [f"{done['recipe'].name}: the pin '{c['pin'].what}' ({c['pin'].before} -> {c['pin'].after}) no longer holds: "
           f"{c['why']}" for c in done["pins"] if c["holds"] is False]
    out += [f"{done['recipe'].name}: {n['release']} (newer than the table) measures otherwise than {done['anchor']}: "
            f"{'; '.join(result.differences(done['measured'][done['anchor']], n['result']))}"
            for n in done["new"] if n["same"] is False]
    out += [f"{done['recipe'].name}: {search.describe(ch)}" for ch in done["changes"]
            if not any(c["pin"].before == ch["before"] and c["pin"].after == ch["after"] for c in done["pins"])]
    return out


def history_table(s: dict) -> list[str]:
    """A series of the release history as markdown rows: release, verdict, the step, the ratio per step, by whom."""
    rows = ["| release | verdict | the step is | ratio per step | measured by |", "|---|---|---|---|---|"]
    for rel, res in history.releases(s):
        ratios = " / ".join(f"{x:.3f}" for x in res.get("ratios") or [] if isinstance(x, (int, float))) or "-"
        step = res.get("step") or (f"skipped: {(res.get('reason') or '')[:100]}" if res["verdict"] in result.SKIPPED
                                   else "-")
        rows.append(f"| {rel} | {res['verdict']} | {step} | {ratios} | {res.get('by', '-')}, {res.get('on', '-')} |")
    return rows


def page(dones: list[dict], moves: list[str], day: str, took_s: float, where: str, hist: dict | None = None) -> str:
    """The refresh as a markdown page of the site."""
    lines = ["# The upstream table, refreshed", "",
             "[← README](../README.md) · related: [findings and the upstream table](bugs.md), [bisect](bisect-report.md)",
             "", f"<sub>generated by `scripts/refresh_table` on {day} in {took_s:.0f} s (releases from {where}); every "
             "release measured in its own world, as `gradkit bisect` measures it</sub>", ""]
    lines += ["## What moved", ""] + ([f"- {m}" for m in moves] or ["Nothing: every pin holds, and every release newer "
                                                                     "than the table measures as the table says."])
    for d in dones:
        r = d["recipe"]
        k = expectations.KNOWN[r.bug]
        lines += ["", f"## {r.name}: {k.report}", "",
                  f"Measured as `{known.command(r)}`; releases older than {r.oldest}: {r.older}.", ""]
        if d["pins"]:
            lines += ["| pin | last before | first after | holds now | measured now | found by |", "|---|---|---|---|---|---|"]
            for c in d["pins"]:
                p = c["pin"]
                word = {True: "yes", False: "**no**", None: "not measured"}[c["holds"]]
                lines.append(f"| {p.what} | {p.before} | {p.after} | {word} | {c['why']} | `{p.found_by}` ({p.code}) |")
        if d["new"]:
            lines += ["", f"Newer than the table ({k.newest_pinned}), against {d['anchor']}:", ""]
            for n in d["new"]:
                res = n["result"]
                same = {True: "as the table says", False: "**another result**", None: "not compared"}[n["same"]]
                lines.append(f"- {n['release']}: {res['verdict']}" + (f" ({res.get('reason')[:120]})"
                                                                      if res.get("reason") else "") + f": {same}")
        elif r.axis == k.package:
            lines += ["", f"No release of {r.axis} newer than the table's {k.newest_pinned} on the index."]
        for ch in d["changes"]:
            lines += ["", f"- change: {search.describe(ch)}"] + [f"    {x}" for x in
                                                                 diff.diff_text(ch["diff"]).splitlines()[:12]]
        s = (hist or {}).get("series", {}).get(r.name)
        if s:
            lines += ["", f"<details><summary>Every release of {r.axis} measured for {r.name} "
                          f"(kit/judge/history.json)</summary>", ""] + history_table(s) + ["", "</details>"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    kconfig.check_device(a.device)
    kconfig.check_timeout(a.timeout)
    names = [n.strip() for n in a.only.split(",")] if a.only else list(known.RECIPES)
    bad = [n for n in names if n not in known.RECIPES]
    if bad:
        raise kconfig.ConfigError(f"--only {bad}: the recipes are {', '.join(known.RECIPES)}")
    for path in (a.page, a.json, a.history):
        if path and not Path(path).parent.exists():
            raise kconfig.ConfigError(f"{path}: the folder {Path(path).parent} does not exist")
    t0, day = time.monotonic(), time.strftime("%Y-%m-%d")
    recipes = [known.RECIPES[n] for n in names]
    indexes, wheres = {}, set()
    for r in recipes:
        if r.axis not in indexes:
            indexes[r.axis], where = listing.index_releases(r.axis)
            wheres.add(where)
    plans = {r.name: to_measure(r, indexes[r.axis], a.full) for r in recipes}
    _, problems = kprefetch.prefetch(kprefetch.needs_of([pair for r in recipes for pair in
                                                         known.needs(r, plans[r.name])]), progress=not a.no_progress)
    for p in problems:
        print(f"  not prepared: {p}")
    dones, moves = [], []
    hist = history.load(a.history)
    for r in recipes:
        print(f"{r.name}: {len(plans[r.name])} releases of {r.axis}: {', '.join(plans[r.name])}", flush=True)
        d = refresh_one(r, indexes[r.axis], a.full, a.device, a.timeout)
        moves += moved(d) + history.merge(hist, r.name, r.bug, r.axis, dict(r.fixed), d["measured"],
                                          "scripts/refresh_table" + (" --full" if a.full else ""), day, result.same)
        dones.append(d)
    history.save(hist, a.history)
    took = time.monotonic() - t0
    Path(a.page).write_text(page(dones, moves, day, took, "; ".join(sorted(wheres)), hist))
    if a.json:
        Path(a.json).write_text(json.dumps({"moved": moves, "recipes": [
            {**{k: v for k, v in d.items() if k not in ("recipe", "pins")}, "recipe": d["recipe"].name,
             "pins": [{**c, "pin": vars(c["pin"])} for c in d["pins"]]} for d in dones]}, indent=1, default=str))
    print("\n".join(moves) or "nothing moved")
    print(f"page: {a.page}; {took:.0f} s")
    if all(all(m["verdict"] in result.SKIPPED for m in d["measured"].values()) for d in dones):
        return 3
    return 1 if moves else 0


if __name__ == "__main__":
    kconfig.run_cli(main)
