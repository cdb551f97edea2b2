"""Warm worlds.

A warm world keeps its ranks between calls: they joined the process group and paid their imports once
(``gradkit.launch.worker.serve``: torch._dynamo, DeepSpeed's engine), and each call writes one job for them. Used where
the same probe is asked again and again by a person waiting (the explorer's Run); one-shot worlds stay the
default. A warm world serves one target only (one probe): jobs of the same target are what the cases of one
world already are, while another probe's job could inherit global state (B2's pipeline topology broke a B4 job
that followed it in the same ranks). At most ``WARM_MAX`` are kept (the least recently used is stopped). A job
that fails in any way takes its warm world down with it (the next call starts a fresh one); the ranks die with
their caller (parent-death signal), on ``stop_warm_worlds()`` (asked to leave between jobs, killed after
``STOP_GRACE_S``) and after ``WARM_IDLE_S``.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from gradkit.launch.cleanup import new_world_folder, release_port, remove_stale_worlds
from gradkit.launch.processes import check_stop, kill_groups, track_world, untrack_world
from gradkit.launch.ranks import start_ranks, wait_for_ranks
from gradkit.launch.results import read_partials
from gradkit.launch.servers import (Forked, forget_unstarted, server_for, server_key, server_keys, stack_fields,
                                stop_servers)
from gradkit.launch.spec import LaunchError, World
from gradkit.launch.worker import SERVE_POLL_S, STOP_FILE

WARM_IDLE_S = 600.0
WARM_MAX = 2
STOP_GRACE_S = 1.0  # how long a warm world's ranks have to leave by themselves before they are killed
_WARM_FLAG = threading.local()


@dataclass
class _Warm:
    procs: list
    logs: list
    holder: object
    job: Path
    jobs: int = 0
    used: float = 0.0
    server_key: str = ""  # the fork server its ranks came from ("" none)


_WARM: dict[str, _Warm] = {}
_WARM_LOCK = threading.Lock()


@contextlib.contextmanager
def warm_worlds(keep: bool = True):
    """While the block runs (in this thread), ``run_world`` runs each local world as a job of a warm world of the
    same stack, started on first use: ``with launch.warm_worlds(): probe.run(...)``.

    ``keep=False``: the warm worlds the block started are stopped when it ends, unless an enclosing block keeps
    them (``gradkit.probes.runner.run`` reuses the ranks of one stack between its own worlds, and leaves no rank
    behind). Their fork servers stay for the next run of their stack, until ``SERVER_IDLE_S`` without a rank."""
    before = getattr(_WARM_FLAG, "on", False)
    with _WARM_LOCK:
        had, had_servers = set(_WARM), server_keys()
    _WARM_FLAG.on = True
    try:
        yield
    finally:
        _WARM_FLAG.on = before
        if not keep and not before:
            with _WARM_LOCK:
                for key in set(_WARM) - had:
                    _discard(key)
                forget_unstarted(server_keys() - had_servers)  # could not start: the next run tries again


def warm_wanted(world: World) -> bool:
    return getattr(_WARM_FLAG, "on", False) and world.launcher == "local" and world.nnodes == 1


def _warm_key(world: World, target: str) -> str:
    return json.dumps([target, world.world_size, *stack_fields(world)], sort_keys=True, default=str)


_SPAWNER = None  # the one thread that starts warm worlds (see _start_warm)


def _start_warm(world: World) -> _Warm:
    """Started from a thread that lives as long as this process: the parent-death signal fires when the *thread*
    that started a process ends, and a warm world outlives the explorer thread that first asked for it."""
    global _SPAWNER
    from concurrent.futures import ThreadPoolExecutor

    if _SPAWNER is None:
        _SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradkit-warm-spawner")
    return _SPAWNER.submit(_start_warm_here, world).result()


def _start_warm_here(world: World) -> _Warm:
    remove_stale_worlds()
    job = new_world_folder()  # claimed before the fork server starts (which may take a while)
    try:
        server = server_for(world, busy={w.server_key for w in _WARM.values()})
        procs, logs, holder = start_ranks(world, job, {"serve": True, "idle_s": WARM_IDLE_S}, server)
    except BaseException:
        shutil.rmtree(job, ignore_errors=True)
        raise
    forked = server is not None and any(isinstance(p, Forked) for p in procs)
    return _Warm(procs, logs, holder, job, server_key=server_key(world) if forked else "")


def prewarm(world: World, target: str) -> _Warm:
    """Start the warm world that serves ``target`` on ``world``'s stack now, if there is none (a person is about
    to ask for it); the least recently used one goes if ``WARM_MAX`` would be passed."""
    world.validate()
    with _WARM_LOCK:
        key = _warm_key(world, target)
        if key in _WARM and any(p.poll() is not None for p in _WARM[key].procs):
            _discard(key)
        if key not in _WARM:
            for old in sorted(_WARM, key=lambda k: _WARM[k].used)[:max(0, len(_WARM) - WARM_MAX + 1)]:
                _discard(old)
            _WARM[key] = _start_warm(world)
        _WARM[key].used = time.monotonic()
        return _WARM[key]


def _discard(key: str) -> None:
    w = _WARM.pop(key, None)
    if w is not None:
        # asked to leave first: an idle rank ends as a one-shot one does (its exit handlers run: a coverage run
        # measures it); one busy in a job or hung is killed after STOP_GRACE_S
        with contextlib.suppress(OSError):
            (w.job / STOP_FILE).write_text("")
        deadline = time.monotonic() + STOP_GRACE_S
        while any(p.poll() is None for p in w.procs) and time.monotonic() < deadline:
            time.sleep(SERVE_POLL_S)
        kill_groups(w.procs)
        release_port(w.holder)
        shutil.rmtree(w.job, ignore_errors=True)
        # its server stays for the next world of its stack (leaving after SERVER_IDLE_S without a rank)


def stop_warm_worlds(servers: bool = True) -> int:
    """Kill every warm world of this process, and (``servers``) its fork servers; how many worlds there were."""
    with _WARM_LOCK:
        keys = list(_WARM)
        for key in keys:
            _discard(key)
        if servers:
            stop_servers()
    return len(keys)


atexit.register(stop_warm_worlds)


def run_warm(target: str, payload: dict, world: World, on_partial, stops: int) -> list:
    starting: list = []  # counted by a stop_worlds while the warm world starts (it has no ranks yet)
    track_world(starting)
    try:
        w = prewarm(world, target)
    finally:
        untrack_world(starting)
    key = _warm_key(world, target)
    track_world(w.procs)
    ok = False
    try:
        check_stop(stops)  # a stop while it started: the finally below discards the world, its ranks killed
        w.jobs += 1
        folder = w.job / f"job-{w.jobs}"
        folder.mkdir()
        tmp = folder / "spec.json.tmp"
        tmp.write_text(json.dumps({"target": target, "payload": payload}))
        os.replace(tmp, folder / "spec.json")  # the ranks see the job whole or not at all
        try:
            wait_for_ranks(w.procs, world, folder, w.logs, on_partial, serving=True, started_in=w.job)
        except LaunchError as e:
            e.partial = read_partials(folder, world.world_size)
            raise
        results = [json.loads((folder / f"rank{r}.json").read_text())["result"] for r in range(world.world_size)]
        ok = True
        return results
    finally:
        untrack_world(w.procs)
        if ok:
            shutil.rmtree(folder, ignore_errors=True)
        else:
            with _WARM_LOCK:
                if _WARM.get(key) is w:
                    _discard(key)
