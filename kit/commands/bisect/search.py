"""The search over an ordered list of releases: every ``stride``-th release first (installed up front,
``prefetch``), a binary search between two neighbours whose results differ, a confirming run on both sides of each
change (``search``); a change in one line (``describe``) and the releases as a table (``table``)."""
from __future__ import annotations

from gradkit.commands.bisect.listing import PACKAGE, stack_of
from gradkit.commands.bisect.result import SKIPPED, differences, same
from gradkit.judge import oracle
from gradkit.probes import ds_config
from gradkit.stacks import prefetch as kprefetch

STRIDE = 4  # the first pass measures every STRIDE-th release: a change and its undoing inside one stride are not seen


def grid(n: int, stride: int) -> list[int]:
    """The first pass: every ``stride``-th of ``n`` releases, and the last."""
    return sorted({*range(0, n, max(1, stride)), n - 1})


def prefetch(order: list[str], stride: int, progress: bool = True, probe=None, axis: str = PACKAGE,
             fixed: dict | None = None) -> list[str]:
    """The first pass's releases installed (and their comm ops built) up front, in parallel
    (``gradkit.stacks.prefetch``), for ``probe`` (the check's by default; ``fixed``: other packages' releases in every
    stack); the binary search's few releases install as it reaches them. Returns what could not be prepared (those
    releases are then measured ``cannot-run``, i.e. skipped)."""
    stacks = [{**(fixed or {}), **stack_of(order[i], axis)} for i in grid(len(order), stride)]
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
        if same(get(lo), get(hi)):
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
                    confirmations[rel] = same(again, ch[key])
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
    elif a["verdict"] == b["verdict"] == oracle.AFFECTED and a.get("step") != b.get("step"):
        what = f"the step is {a['step']} until {change['before']}, {b['step']} from {change['after']}"
    elif a["verdict"] == b["verdict"]:
        what = f"{a['verdict']} on both sides, but the measured step changes: {', '.join(differences(a, b))}"
    else:
        what = f"{a['verdict']} until {change['before']}, {b['verdict']} from {change['after']}"
    sure = "" if change.get("confirmed", True) else " (NOT confirmed: a second run of one side gave another result)"
    return f"{where}: {what}{sure}"


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
