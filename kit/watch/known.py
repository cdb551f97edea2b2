"""Which known bug an affected step of a Trainer or Accelerate job is: the bug table (``gradkit.judge.expectations``)
asked whether each candidate bug is expected on the job's releases. These bugs have no named step of their own to
match (their steps vary by release, see each bug's notes), so every bug expected there is said, all of them where
several are: a tie is never resolved by the order of a list."""
from __future__ import annotations

from gradkit.commands.check import known as kknown
from gradkit.judge import expectations, naming, oracle
from gradkit.stacks import fixes

CANDIDATES = {"trainer": ("B1", "HFT"), "accelerate": ("ACC",)}
TIE = "several known bugs are expected here and the measurement does not tell them apart"


def case_of(bug: str, rec: dict) -> str | None:
    """The bug table's case a job is: the Trainer's own loop for HFT; for ACC, Accelerate's plugin setting."""
    if bug == "HFT":
        return "trainer"
    if bug == "ACC":
        return "sync_each_batch" if rec.get("sync_each_batch") else "accumulate"
    return None


def named_step(rec: dict) -> str | None:
    """The known bug whose own named step the record's step is (B9's and B10's fp16 loss-scale steps, under the
    Trainer on DeepSpeed), where the table expects it on the job's releases; None where none is."""
    versions = rec.get("versions") or {}
    for k in expectations.KNOWN.values():
        if k.explains and k.explains[1] in (naming.UNSCALED, naming.SCALE_GREW) and rec.get("matches") == \
                k.explains[1] and kknown.expected_here(k.bug, versions):
            patch = fixes.verified_report(k.bug)
            return (f"{k.bug} ({k.report}): {k.explains[0]}; fix: {k.explains[2]}"
                    + (f"; a patch the kit verified: {patch}" if patch else ""))
    return None


def from_table(rec: dict, path: str) -> str:
    named = named_step(rec)
    if named:
        return named
    versions = rec.get("versions") or {}
    ga = rec.get("declared_ga") or rec.get("trainer_ga")
    expected = [b for b in CANDIDATES[path]
                if expectations.expected(b, versions, case=case_of(b, rec), ga=ga) == oracle.AFFECTED]
    if not expected:
        on = ", ".join(f"{expectations.KNOWN[b].package} {versions.get(expectations.KNOWN[b].package, '?')}"
                       for b in CANDIDATES[path])
        return (f"not explained by a known bug: {', '.join(CANDIDATES[path])} not expected on {on} "
                f"(the step is {rec.get('matches')!r}); look at your own loss, collator and loop")
    said = [f"{b} ({expectations.KNOWN[b].report}) is expected on {expectations.KNOWN[b].package} "
            f"{versions.get(expectations.KNOWN[b].package)}: {expectations.KNOWN[b].fix_text()}" for b in expected]
    return ("; ".join(said) if len(said) == 1 else
            TIE + ": " + "; ".join(said))
