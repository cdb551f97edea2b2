"""The command line of ``python -m gradkit.watch.attach``: its own options (what the watch's ``Callback`` takes), then
the target (a module or a ``.py`` file) and the target's own arguments. Here beside the launchers because both sides
read it: the watch runs it (``gradkit.watch.attach``), and the check reads a launch line that wraps a framework's
entry point in it (``command_line``: the run is the target's)."""
from __future__ import annotations

import argparse

S = argparse.SUPPRESS  # an option not given is left out, so the watch's own default holds
MODULE = "gradkit.watch.attach"
PROG = f"python -m {MODULE}"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one sentence, said by the caller (exit 2 here, a refused config in the check)
        raise ValueError(message)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Run a training entry point (a module or a .py file, as __main__, with its own "
                "arguments) with gradkit's watch in every HF Trainer it builds.")
    p.add_argument("--first", type=int, default=S, help="judge the first N optimizer steps (the watch's default: 2)")
    p.add_argument("--every", type=int, default=S, help="and every Nth step after them (default: 100)")
    p.add_argument("--steps", type=int, action="append", default=S, help="and this step (again for more)")
    p.add_argument("--layers", action="append", default=S,
                   help="judge only the parameters whose names start with this prefix (again for more)")
    p.add_argument("--out", default=S, help="where the records go (default: <output_dir>/gradkit-watch)")
    p.add_argument("--stop", action="store_true", default=S, help="end training after an affected step")
    p.add_argument("target", help="a module (trl.scripts.sft) or a .py file, run as __main__")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the target's own arguments")
    return p


def split(argv) -> argparse.Namespace:
    """The options, the target and the target's arguments; ValueError (argparse's sentence) where they are wrong."""
    return parser().parse_args(list(argv))


def options(ns: argparse.Namespace) -> dict:
    """What ``Callback`` takes from the command line: only what was given, the rest its own defaults."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in vars(ns).items() if k not in ("target", "args")}
