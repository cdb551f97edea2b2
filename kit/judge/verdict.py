"""The verdict of a command and its exit status, one rule for every command (``gradkit check``, ``check --path``,
``bisect``): 0 not affected, 1 a measured ``affected`` and nothing else, 3 inconclusive or cannot run (2, bad input,
is ``kit.config.run_cli``'s, before anything launches). Several verdicts of one configuration combine to the worst."""
from __future__ import annotations

from kit.judge import oracle

EXIT = {oracle.NOT_AFFECTED: 0, oracle.AFFECTED: 1, oracle.INCONCLUSIVE: 3, oracle.CANNOT_RUN: 3}


def worst(words) -> str:
    """The worst of some verdicts (``oracle.WORST_FIRST``); nothing judged is ``cannot-run``."""
    words = [w for w in words if w in oracle.WORST_FIRST]
    return min(words, key=oracle.WORST_FIRST.index, default=oracle.CANNOT_RUN)


def num(x, fmt: str) -> str:
    """A measured number in a report's column, ``-`` where nothing was measured."""
    return format(x, fmt) if isinstance(x, (int, float)) else "-"
