"""One cell of ``gradkit check``'s matrix: one config at one DeepSpeed release, checked from plain data
(``check_task``), so that the same function runs here, one cell after another, or in a worker of a distributed
engine (``gradkit.commands.check.matrix``), with the same result.

    result = check_task({"source": "ds_z3.json", "command": None, "release": "0.18.6", "args": vars(args)})
"""
from __future__ import annotations

import argparse
import shlex
import time

from gradkit import config as kconfig
from gradkit import frameworks, launch
import gradkit.commands.check.one as one
import gradkit.commands.check.paths as paths
from gradkit.commands.check.plan import model_of

BAD_INPUT = "bad input"


def read(path: str):
    """A config file as ``gradkit.frameworks.read`` reads it, named by its path (a launch line's too)."""
    run = frameworks.read(path)
    run.source = path
    return run


def read_task(task: dict):
    """The training run a task names: a config file, or a launch line (``command``)."""
    if task.get("command"):
        return frameworks.read_command_line(shlex.split(task["command"]))
    return read(task["source"])


def args_of(task: dict) -> argparse.Namespace:
    """The check's flags for one cell: the set's, at the cell's release."""
    a = argparse.Namespace(**task["args"])
    a.deepspeed = task["release"]
    return a


def prepare(task: dict):
    """``(run, todo or None, a, model)`` of one cell, everything refused before any launch (``ConfigError``)."""
    a = args_of(task)
    run = read_task(task)
    model, model_notes = model_of(a.model, a.adapter)
    if run.path == "deepspeed":
        return run, one.prepare(run, a, model, model_notes), a, model
    paths.path_args(run, a)
    return run, None, a, model


def bad_input(task: dict, why: str) -> dict:
    return {"source": task.get("source") or "command line", "release": task["release"], "framework": None,
            "verdict": BAD_INPUT, "exit": 2, "precisions": {}, "error": why}


def check_task(task: dict) -> dict:
    """Checks one cell; its report lines are in the result's ``log``. The ranks stay up for the next cell of the
    same stack in this process (a warm world), and go with it."""
    log: list[str] = []
    t0 = time.perf_counter()
    try:
        run, todo, a, model = prepare(task)
    except kconfig.ConfigError as e:
        return bad_input(task, str(e))
    with launch.warm_worlds(keep=True):
        result = paths.trainer_side(run, a, one.check(run, todo, a, model, say=log.append), say=log.append) \
            if todo is not None else paths.check(run, a, say=log.append)
    return {**result, "source": task.get("source") or result["source"], "release": task["release"], "log": log,
            "wall_s": round(time.perf_counter() - t0, 2)}
