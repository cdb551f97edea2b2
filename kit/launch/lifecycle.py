"""A world's run from its call to its end: ``run_world`` runs it as a job of a warm world (inside a
``warm_worlds`` block) or as a one-shot world of its own, launches it again when its rendezvous failed before any
case ran, and never after the user's stop."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

from gradkit import config as kconfig
from gradkit.launch.cleanup import new_world_folder, release_port, remove_stale_worlds
from gradkit.launch.processes import check_stop, kill_groups, stop_count, track_world, untrack_world
from gradkit.launch.ranks import start_ranks, wait_for_ranks
from gradkit.launch.results import read_partials, tail
from gradkit.launch.spec import LaunchError, RankFailed, World, WorldStopped
from gradkit.launch.warm import run_warm, warm_wanted


def run_world(target: str, payload: dict, world: World | None = None, keep_dir: str | None = None, on_partial=None,
              **kw) -> list:
    """Run ``target`` ("package.module:function") on every rank of ``world``.

    Returns the list of per-rank return values (index = rank). Raises
    ``RankFailed`` when a rank raises or exits non-zero (the first failing
    rank's traceback is attached), ``RankTimeout`` when the world outlives
    ``world.timeout_s`` (all ranks are killed first), ``ConfigError`` on bad
    input before anything starts. ``on_partial(piece)`` is called in the caller, while the world runs, with
    each piece rank 0 reports (``gradkit.launch.worker.report_partial``): progress, and results kept as they come.
    """
    world = world or World(**kw)
    world.validate()
    if ":" not in target:
        raise kconfig.ConfigError(f"target must look like 'package.module:function', got {target!r}")
    warm = keep_dir is None and warm_wanted(world)
    stops = stop_count()
    for attempt in range(1 + RENDEZVOUS_RETRIES):
        try:
            if warm:
                return run_warm(target, payload, world, on_partial, stops)
            return _run_world_once(target, payload, world, keep_dir, on_partial, stops)
        except RankFailed as e:
            if stop_count() != stops:  # its ranks died of the stop, whatever the first of them to notice says
                raise WorldStopped(f"stopped while it ran: {str(e).splitlines()[0][:200]}", rank=e.rank,
                                   traceback=e.traceback, logs=e.logs, partial=e.partial) from e
            # judged on the blamed rank's own error only: its peers' errors ("Then: ...") often read "Connection
            # reset by peer" whatever the blamed rank did
            own = str(e).split("\nThen: ")[0] + "\n" + (e.traceback or "")
            if attempt == RENDEZVOUS_RETRIES or e.partial or not _is_rendezvous_error(own):
                raise
            print(f"gradkit: the world's rendezvous failed before any case ran ({str(e).splitlines()[0][:200]}); "
                  f"launching it again ({attempt + 2} of {1 + RENDEZVOUS_RETRIES})", file=sys.stderr)
    raise AssertionError("unreachable")


RENDEZVOUS_RETRIES = 2
_RENDEZVOUS_ERRORS = ("EADDRINUSE", "Address already in use", "DistNetworkError", "address already in use",
                      "Connection reset by peer", "rendezvous")


def _is_rendezvous_error(text: str) -> bool:
    return any(m in text for m in _RENDEZVOUS_ERRORS)


def _run_world_once(target: str, payload: dict, world: World, keep_dir: str | None, on_partial, stops: int) -> list:
    remove_stale_worlds()
    job = new_world_folder(keep_dir)
    procs: list[subprocess.Popen] = []
    track_world(procs)
    holder = None
    try:
        started, logs, holder = start_ranks(world, job, {"target": target, "payload": payload})
        procs += started
        check_stop(stops)  # a stop while they started: the finally below kills them
        try:
            wait_for_ranks(procs, world, job, logs, on_partial)
            if not (job / "rank0.json").exists():
                raise RankFailed("the launcher exited 0 but rank 0 wrote no result; its output:\n"
                                 + tail(logs[0])[-1500:], rank=0, logs={0: tail(logs[0])})
        except LaunchError as e:
            e.partial = read_partials(job, world.world_size)
            raise
        results = []
        for r in range(world.world_size):  # other nodes' ranks are visible only on a shared filesystem
            path = job / f"rank{r}.json"
            results.append(json.loads(path.read_text())["result"] if path.exists() else None)
        return results
    finally:
        untrack_world(procs)
        kill_groups(procs)
        if holder is not None:
            release_port(holder)
        if keep_dir is None:
            shutil.rmtree(job, ignore_errors=True)
