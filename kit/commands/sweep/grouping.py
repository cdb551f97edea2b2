"""The affected points of a sweep grouped by the smallest set of axis conditions (``axis in {values}``) that holds
for all of them and for no point that is not affected (``groups``, a beam search over conjunctions); each group named
by the known bug that explains its points (``gradkit.commands.check.explain``), said as a **tie** where two known bugs (or two
named steps) leave the very same step, or marked **unknown**."""
from __future__ import annotations

import itertools
import json

from gradkit.commands import check
from gradkit.commands.sweep.spec import DEFAULT
from gradkit.judge import oracle


def groups(recs: list[dict], axes: dict, max_keys: int = 5) -> list[dict]:
    """The affected points of one stack, covered by the fewest, smallest conjunctions of ``axis in {values}``.

    Affected points are first split by what explains them (the known bug, else the hypothesis the step
    matches): one group never mixes two explanations. A conjunction is admissible for a label when every point
    it selects that ran (affected or not-affected) is affected with that label. Greedy set cover: at each step
    the admissible conjunction with the fewest conditions that covers the most still uncovered points (a
    search by size, pruned where a conjunction covers nothing new).
    Returns ``[{"when": {axis: [values]}, "count", "ids", "known_bug", ...}]``.
    """
    # Every point is in the universe; only the ones that ran (affected / not-affected) can make a condition
    # admissible, so a cannot-run or inconclusive point never widens one: a condition that selects it is refused.
    ran = [r for r in recs if r.get("point")]
    if not any(r["verdict"] == oracle.AFFECTED for r in ran):
        return []
    names = [a for a in axes if len({r["point"].get(a) for r in ran}) > 1]  # an axis with one value selects nothing
    literals = []  # per axis: [(values, bitset of the ran points it selects)]
    for axis in names:
        values = [v for v in axes[axis] if any(r["point"].get(axis) == v for r in ran)]
        lits = []
        for k in range(1, len(values)):
            for subset in itertools.combinations(values, k):
                lits.append((subset, sum(1 << i for i, r in enumerate(ran) if r["point"].get(axis) in subset)))
        literals.append(lits)
    out = []
    for label in sorted({_label(r) for r in ran if r["verdict"] == oracle.AFFECTED}):
        target = sum(1 << i for i, r in enumerate(ran) if r["verdict"] == oracle.AFFECTED and _label(r) == label)
        out += _cover(ran, names, literals, target, max_keys)
    return sorted(out, key=lambda g: -g["count"])


def _label(rec: dict) -> str:
    """What one group may hold: one known bug; or a tie the measurement cannot settle (``tie``); or -- unexplained --
    one shape of step (its fitted weights in words), never a catch-all."""
    if rec.get("explained_by"):
        return rec["explained_by"]
    names = tie(rec)
    return "tie: " + " or ".join(names) if names else f"unknown: {rec.get('shape') or rec.get('matches')}"


def tie(rec: dict) -> list[str]:
    """What an unexplained affected point ties between: the known bugs expected here that each leave its very step
    (``tied``, from ``gradkit.commands.check.tied``: "B6", "B7"), else the named steps it matches equally (``ties``:
    at GA 2 B10's half is "mean / N") that no sibling point separated; [] for a point that is no tie."""
    return list(rec.get("tied") or []) or [f"'{n}'" for n in rec.get("ties") or []]


def _cover(ran: list[dict], names: list[str], literals: list, affected: int, max_keys: int) -> list[dict]:
    uncovered, out = affected, []
    while uncovered:
        best, level = None, [((), (1 << len(ran)) - 1, -1)]
        for size in range(max_keys + 1):
            following = []
            for combo, mask, last in level:
                new = mask & uncovered
                if not new:
                    continue
                if not mask & ~affected:  # admissible: every point it selects is affected
                    score = bin(new).count("1")
                    if best is None or score > best[0]:
                        best = (score, combo, mask)
                    continue
                if size < max_keys:
                    following += [(combo + ((names[a], values),), mask & m, a)
                                  for a in range(last + 1, len(names)) for values, m in literals[a] if mask & m & uncovered]
            if best is not None or not following:
                break
            level = _beam(following, uncovered, affected)
        if best is None:  # what no conjunction of max_keys conditions isolates: one group per point
            for i, r in enumerate(ran):
                if uncovered >> i & 1:
                    out.append(_group(ran, 1 << i, {a: [r["point"][a]] for a in names}))
            break
        _, combo, mask = best
        out.append(_group(ran, mask & uncovered, {axis: list(values) for axis, values in combo}))  # a partition
        uncovered &= ~mask
    return out


BEAM = 1000  # conjunctions kept from one size to the next (the search grows as values ** conditions)


def _beam(level: list, uncovered: int, affected: int) -> list:
    """One size's conjunctions, each selection once (the first, i.e. the one in axis order), and at most ``BEAM``:
    those that cover the most uncovered points per point they wrongly select (one that is not affected with this
    label). The search stays exact wherever a size has fewer distinct selections than that."""
    seen, out = set(), []
    for combo in level:
        if combo[1] not in seen:
            seen.add(combo[1])
            out.append(combo)
    if len(out) > BEAM:
        out.sort(key=lambda c: -bin(c[1] & uncovered).count("1") / (1 + bin(c[1] & ~affected).count("1")))
        out = out[:BEAM]
    return out


def _group(ran: list[dict], mask: int, when: dict) -> dict:
    members = [r for i, r in enumerate(ran) if mask >> i & 1]
    bugs = {r.get("explained_by") for r in members}
    ties = {tuple(tie(r)) for r in members}
    ratios = [r["metrics"]["norm_ratio"] for r in members if r.get("metrics")]
    known = bugs.pop() if len(bugs) == 1 and None not in bugs else None
    return {"when": when, "count": len(members), "ids": [r["id"] for r in members],
            "known_bug": known,
            # a tie of known bugs or named steps, the same at every point: said as such, no new finding
            "tie": list(ties.pop()) if not known and len(ties) == 1 and () not in ties else [],
            "explained_by": sorted(str(b) for b in {r.get("explained_by") for r in members}),
            "matches": sorted({str(r.get("matches")) for r in members}),
            "shapes": sorted({str(r.get("shape")) for r in members}),
            "worst_steps": sorted({r.get("worst_step", 0) + 1 for r in members}),
            "ratio_range": [min(ratios), max(ratios)] if ratios else None, "example": members[0]["id"]}


def when_text(when: dict, short=lambda axis: axis) -> str:
    """A group's conditions in words; the one-at-a-time keys a condition holds at ``DEFAULT`` are said once, as
    "no other key set" (they are many, and mean: a point of the axes' product)."""
    defaults = [a for a, v in when.items() if v == [DEFAULT]]
    parts = [f"{short(axis)} = {values[0]}" if len(values) == 1 else
             f"{short(axis)} in {{{', '.join(map(str, values))}}}" for axis, values in when.items() if axis not in defaults]
    if defaults:
        parts.append("no other key set" if len(defaults) > 2 else " x ".join(f"{short(a)} = {DEFAULT}" for a in defaults))
    return " x ".join(parts) or "every point"


def describe(group: dict) -> str:
    name = group["known_bug"] or ("TIE: " + " or ".join(group["tie"]) if group.get("tie") else "UNKNOWN")
    lo, hi = group["ratio_range"] or (None, None)
    ratio = f"; ratio {lo:.3f}-{hi:.3f}" if lo is not None else ""
    step = ", ".join(group["matches"]) if group["known_bug"] else "; ".join(group.get("shapes") or group["matches"])
    return f"[{name}] {when_text(group['when'])}: {group['count']} configs{ratio}; the step is {step}"


def separate(recs: list[dict]) -> list[dict]:
    """A point whose step ties between named hypotheses (at GA 2 "last / N" is "all but the first") names no bug
    by itself; the same config at a GA >= 3 (same stack, every other axis equal) separates them: where that
    point is affected, explained, and is one of the tied names, this point is explained by the same bug, said so.
    A tie with no such point stays a tie (its own group)."""
    def key(r):
        return json.dumps([r.get("stack"), {k: v for k, v in (r.get("point") or {}).items() if k != "ga"}],
                          sort_keys=True)

    by: dict = {}
    for r in recs:
        if r["verdict"] == oracle.AFFECTED and r.get("explained_by") and r["ga"] >= check.SEPARATING_GA - 1:
            by.setdefault(key(r), []).append(r)
    for r in recs:
        names = r.get("ties") or []
        if r["verdict"] != oracle.AFFECTED or not names or r.get("explained_by"):
            continue
        sib = next((s for s in sorted(by.get(key(r), []), key=lambda s: s["ga"]) if s["matches"] in names), None)
        if sib:
            r["explained_by"], r["separated_by"] = sib["explained_by"], sib["id"]
            r["explanation"] = (f"{sib['explanation']} (at GA {r['ga']} the step is {r['matches']}; the same config "
                                f"at GA {sib['ga']} separates them: '{sib['matches']}')")
    return recs
