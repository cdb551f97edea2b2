"""The verdict of a command and its exit status, one rule for every command (``gradkit check``, ``check --path``,
``bisect``): 0 not affected, 1 a measured ``affected`` and nothing else, 3 inconclusive or cannot run (2, bad input,
is ``gradkit.config.run_cli``'s, before anything launches). Several verdicts of one configuration combine to the
worst."""
from __future__ import annotations

from gradkit.judge import oracle

EXIT = {oracle.NOT_AFFECTED: 0, oracle.AFFECTED: 1, oracle.INCONCLUSIVE: 3, oracle.CANNOT_RUN: 3}


def worst(words) -> str:
    """The worst of some verdicts (``oracle.WORST_FIRST``); nothing judged is ``cannot-run``."""
    words = [w for w in words if w in oracle.WORST_FIRST]
    return min(words, key=oracle.WORST_FIRST.index, default=oracle.CANNOT_RUN)


def num(x, fmt: str) -> str:
    """A measured number in a report's column, ``-`` where nothing was measured."""
    return format(x, fmt) if isinstance(x, (int, float)) else "-"


def over_precisions(verdicts: dict, not_here: dict, asked) -> str:
    """The verdict of one config checked in several precisions (``{precision: verdict}``), the rule a CI reader can
    rely on: the worst of the precisions that were judged; a precision this machine cannot run (``not_here``:
    ``{precision: why}``) counts, as ``cannot-run``, only where it was asked for (``asked``: the config enables it,
    or the training config or ``--precision`` names it), not where only an ``"auto"`` could resolve to it. Nothing
    judged at all is ``cannot-run``."""
    counted = [v for p, v in verdicts.items() if p not in not_here or p in set(asked)]
    return worst(counted)
