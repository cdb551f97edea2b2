"""What is known upstream, per bug: which releases have it, where each fix landed, with its pull request.

One table (``KNOWN``), read by every notebook's last cells and by the overview:

- for a **pinned** release (one the table vouches for: not newer than ``newest_pinned``), the measured
  verdict must equal ``expected(...)``; a mismatch there is a bug in the harness, and the notebook fails;
- for a release **newer than the table**, the measurement is a *finding* ("0.20.1 is no longer affected",
  "still affected"), printed and never failed on (``judge_release``).

The table itself, with every bug's sources, is ``gradkit.judge.bugs``.
"""
from __future__ import annotations

from gradkit.judge import oracle, pins
from gradkit.judge.bugs import KNOWN, UNMANAGED_SINCE, Known  # noqa: F401 - the table is read through this module too
from gradkit.stacks import fixes
from gradkit.stacks.versions import version_key

AFFECTED, NOT_AFFECTED = oracle.AFFECTED, oracle.NOT_AFFECTED


def expected(bug: str, versions: dict, case: str | None = None, zero_stage: int | None = None,
             ga: int | None = None) -> str | None:
    """The verdict upstream implies for one record's stack and configuration (None: not pinned).

    ``versions`` is what the record's ranks imported ({package: version}). B3 depends on the configuration:
    the manual loop is affected on ZeRO-1/2 only, and ``managed_gradient_accumulation: false`` repairs it
    from 0.19.4; the other fixes and every control are expected correct on every pinned release.
    """
    known = KNOWN[bug]
    version = (versions or {}).get(known.package)
    if not version:
        return None
    if known.rules:
        return known.rule_for(case, version, ga)
    base = known.expected_for_release(version)
    if base is None:
        return None
    if bug == "B3":
        if case == "fix_unmanaged":
            return NOT_AFFECTED if version_key(version) >= version_key(UNMANAGED_SINCE) or zero_stage in (0, 3) \
                else AFFECTED
        if case not in (None, "manual"):
            return NOT_AFFECTED
        return AFFECTED if zero_stage in (1, 2) else NOT_AFFECTED
    return base


def judge_release(bug: str, versions: dict, measured: str, **config) -> tuple[str, str]:
    """``("ok" | "mismatch" | "finding" | "not-judged", sentence)`` for one measured verdict.

    ``mismatch`` only for a pinned release (the notebook asserts there is none); a release newer than the
    table gives a ``finding`` that says what changed; ``cannot-run`` / ``inconclusive`` are ``not-judged``.
    """
    known = KNOWN[bug]
    version = (versions or {}).get(known.package, "?")
    want = expected(bug, versions, **config)
    what = f"{bug} on {known.package} {version}" + "".join(f", {k} {v}" for k, v in config.items() if v is not None)
    if measured not in (AFFECTED, NOT_AFFECTED):
        return "not-judged", f"{what}: {measured}, so it neither confirms nor contradicts the upstream table"
    if want is not None:
        if want == measured:
            return "ok", f"{what}: {measured}, as upstream says ({known.fix_text()})"
        return "mismatch", (f"{what}: measured {measured}, but upstream says {want} ({known.fix_text()}): "
                            f"a pinned release disagrees with the table, so the harness is suspect")
    newer = version_key(version) > version_key(known.newest_pinned)
    if not newer:
        return "finding", f"{what}: {measured} (this release is not pinned in the table)"
    if measured == NOT_AFFECTED:
        state = "is not affected" + (" (as the fix implies)" if known.fixed_in else ": a finding, no fix is known")
    else:
        state = "is still affected" + (f", although the fix landed in {known.fixed_in}" if known.fixed_in else "")
    return "finding", f"{what} (newer than the table's {known.newest_pinned}) {state}"


def mismatches(bug: str, recs: list[dict], verdict_key: str = "verdict", **where) -> tuple[list[str], list[str]]:
    """``(mismatches, findings)`` over the records of ``bug``: what a notebook asserts empty, and what it prints."""
    bad, found = [], []
    for r in recs:
        if any(r.get(k) != v for k, v in where.items()):
            continue
        config = {"case": r.get("case"), "zero_stage": r.get("zero_stage")} if bug == "B3" else \
            {"case": r.get("case"), "ga": r.get("ga")} if KNOWN[bug].rules else {}
        word, text = judge_release(bug, r.get("versions") or {}, r.get(verdict_key) or r["verdict"], **config)
        if word == "mismatch":
            bad.append(text)
        elif word == "finding":
            found.append(text)
    return sorted(set(bad)), sorted(set(found))


def ranges_short() -> str:
    """Every known bug's range in one short row (the README's ``RANGES`` block): where it starts, where it ends, how
    many other changes of its step lie between (each in ``ranges_table``), and the kit's verified fix where no release
    has one (``gradkit report --known``: ``docs/reports/<bug>/``)."""
    rows = ["| bug | package | starts | ends | other changes of the step | a fix, verified by the kit |",
            "|---|---|---|---|---|---|"]
    for k in KNOWN.values():
        mine = [p for p in k.pins if p.series == k.bug]
        first = next((p for p in mine if p.what.startswith("introduced")), None)
        last = next((p for p in mine if p.what.startswith("fixed")), None)
        start = f"{first.after} ({first.before} without it)" if first else pins.START_SHORT.get(k.bug, "not pinned")
        end = f"{last.after} ({last.before} with it)" if last else "no release fixes it"
        others = len([p for p in mine if p not in (first, last)])
        report = fixes.verified_report(k.bug)
        rows.append(f"| {k.bug} | {k.package} | {start} | {end} | {others or '-'} | "
                    + (f"[{report.split('/')[-2]}]({report})" if report else "-") + " |")
    return "\n".join(rows)


def ranges_table() -> str:
    """Every known bug's pinned range as a markdown table (the bugs page's ``RANGES`` block): the bug, its package,
    each boundary with the command that found it."""
    rows = ["| bug | package | range (each boundary: the last release before, the first after, both measured) | found by |",
            "|---|---|---|---|"]
    for k in KNOWN.values():
        found = "; ".join(sorted({f"`{p.found_by}`" for p in k.pins})) or "-"
        rows.append(f"| {k.bug} | {k.package} | {k.range_text().split(': ', 1)[1]} | {found} |")
    return "\n".join(rows)
