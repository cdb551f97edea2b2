"""``python -m gradkit.watch.attach [options] TARGET [its arguments]``: run a training entry point that builds its own
Trainer (a framework's command line that takes no callback: TRL's scripts, LLaMA-Factory's launcher, axolotl's
``cli.train``) with the watch's ``Callback`` in every HF ``Trainer`` it builds.

TARGET is a module (``trl.scripts.sft``) or a ``.py`` file, run as ``__main__`` with its own arguments, as
``python -m TARGET ...`` would run it; launch it the way the framework launches itself, one process per GPU:

    accelerate launch -m gradkit.watch.attach trl.scripts.sft --config sft.yaml   # what `trl sft` launches
    torchrun --nproc-per-node 8 -m gradkit.watch.attach llamafactory.launcher sft.yaml

Every ``Trainer`` (and subclass: TRL's, LLaMA-Factory's) gets ``Callback(**options)`` at the end of its
``__init__`` unless one is already in its callbacks. The watch never stops the job: where transformers is not
there or the callback cannot be added, it says so and the job runs without it. A TARGET that does not exist is
refused (exit 2) before anything runs."""
from __future__ import annotations

import functools
import importlib.util
import os
import runpy
import sys

from gradkit.frameworks.attach_args import PROG, options, split


def found(target: str) -> bool:
    """Whether ``target`` names a ``.py`` file or a module that can be imported (its parents are imported to know)."""
    if target.endswith(".py"):
        return os.path.isfile(target)
    try:
        return importlib.util.find_spec(target) is not None
    except (ImportError, ValueError):
        return False


def attach(callback_options: dict, log=print) -> bool:
    """Every ``transformers.Trainer`` built from now on gets ``Callback(**callback_options)``; False (said) where
    transformers cannot be imported. Calling it again changes nothing."""
    try:
        from transformers import Trainer

        from gradkit.watch.hf import Callback
    except Exception as e:  # noqa: BLE001 - the job runs without the watch, never stopped by it
        log(f"gradkit watch: cannot attach to the Trainer ({type(e).__name__}: {e}); the job runs without the watch")
        return False
    init = Trainer.__init__
    if getattr(init, "_gradkit_attached", False):
        return True

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        try:
            if not any(isinstance(c, Callback) for c in self.callback_handler.callbacks):
                self.add_callback(Callback(**callback_options))
        except Exception as e:  # noqa: BLE001 - as above
            log(f"gradkit watch: cannot add its callback ({type(e).__name__}: {e}); training goes on without it")

    __init__._gradkit_attached = True
    Trainer.__init__ = __init__
    return True


def main(argv=None) -> int:
    try:
        ns = split(sys.argv[1:] if argv is None else argv)
    except ValueError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    if not found(ns.target):
        print(f"{PROG}: {ns.target!r} is neither a .py file nor a module that can be imported here", file=sys.stderr)
        return 2
    attach(options(ns))
    sys.argv = [ns.target, *ns.args]
    if ns.target.endswith(".py"):
        sys.path.insert(0, os.path.dirname(os.path.abspath(ns.target)))
        runpy.run_path(ns.target, run_name="__main__")
    else:
        runpy.run_module(ns.target, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
