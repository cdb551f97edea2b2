"""Starting a world's ranks (processes of their own, or forks of a fork server) and waiting for them: every rank's
result, or the error that names the rank to blame (``gradkit.launch.results``), or a timeout, with every rank killed."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from gradkit.launch.processes import kill_groups, session_dying_with_parent
from gradkit.launch.results import PartialReader, blame, how_it_ended, is_complete, tail
from gradkit.launch.spec import RankTimeout, World, launch_commands, launcher_env, rank_env, repair_extensions

if TYPE_CHECKING:
    from gradkit.launch.servers import Server

GRACE_AFTER_FAILURE_S = 5.0  # other ranks usually block in a collective once one dies
POLL_S = 0.1


def start_ranks(world: World, job: Path, task: dict, server: "Server | None" = None):
    """Write the world's spec into ``job`` and start its processes: ``(procs, logs, holder)``; ``task`` is the
    spec's target and payload (a one-shot world) or ``{"serve": True, ...}`` (a warm world). With ``server`` (a
    fork server of the world's stack, ``gradkit.launch.forkserver``) the ranks are forked from it, imports paid; ``job``
    comes from ``new_world_folder``."""
    # Local ranks meet through a file store in the job folder (as DeepSpeed's DistributedTest does), so nothing
    # races for a port; the port is held (bound, never listened on) for the world's life so that no other world
    # of this machine gets the same number, since MASTER_PORT still names the world (DeepSpeed's shm comm op).
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    env0 = rank_env(world, 0, port)
    repair_extensions(Path(env0["TORCH_EXTENSIONS_DIR"]))
    # What every rank needs, whoever starts it (a launcher may not pass the kit's variables on to other nodes):
    (job / "spec.json").write_text(json.dumps({
        **task, "device": world.device, "init": world.init, "timeout_s": world.timeout_s, "expect": world.expect,
        "init_method": f"file://{job / 'rendezvous'}" if world.launcher == "local" else "env://",
        "pythonpath": list(world.pythonpath),
        "env": {k: env0[k] for k in ("TORCH_EXTENSIONS_DIR", "DS_ACCELERATOR", "OMP_NUM_THREADS") if k in env0}}))
    if world.launcher != "local":
        holder.close()  # torchrun / the DeepSpeed launcher listen on it themselves (a race a retry absorbs)
    procs: list[subprocess.Popen] = []
    commands = launch_commands(world, job, port)
    logs = [job / (f"rank{r}.log" if world.launcher == "local" else f"launcher{r}.log") for r in range(len(commands))]
    if server is not None:
        try:
            for r in range(world.world_size):
                procs.append(server.fork(job, rank_env(world, r, port), logs[r], job / f"rank{r}.exit"))
            return procs, logs, holder
        except (OSError, ValueError, KeyError) as e:  # the server went away: start the ranks the usual way
            kill_groups(procs)
            procs = []
            print(f"gradkit: the fork server of this stack failed ({e}); starting the ranks afresh", file=sys.stderr)
    try:
        for r, cmd in enumerate(commands):
            env = rank_env(world, r, port) if world.launcher == "local" else launcher_env(world, port)
            with open(logs[r], "wb") as log:
                procs.append(subprocess.Popen(cmd, env=env, cwd=str(job), stdout=log, stderr=subprocess.STDOUT,
                                              preexec_fn=session_dying_with_parent))
    except BaseException:
        kill_groups(procs)
        holder.close()
        raise
    return procs, logs, holder


def wait_for_ranks(procs: list[subprocess.Popen], world: World, job: Path, logs: list[Path], on_partial=None,
                   serving: bool = False, started_in: Path | None = None) -> None:
    """Until every rank's result is in ``job``: a one-shot world's ranks exit 0; a warm world's (``serving``) write
    their job's results and stay, and any of them exiting is a failure (an error raised while the warm world
    started is in its own folder, ``started_in``)."""
    deadline = time.monotonic() + world.timeout_s
    failed_at = None
    exited: dict[int, float] = {}  # rank -> when it was first seen gone: the first to go is the one to blame
    partial = PartialReader(job / "rank0.partial.jsonl", on_partial)
    while True:
        partial()
        codes = [p.poll() for p in procs]
        now = time.monotonic()
        for r, c in enumerate(codes):
            if c is not None and r not in exited:
                exited[r] = now
        if serving and all(is_complete(job / f"rank{r}.json") for r in range(len(procs))):
            partial()
            return
        if not serving and all(c == 0 for c in codes):
            partial()
            return
        # A local rank that wrote its result and then died in tear-down (seen once in CI: a SIGABRT, "terminate
        # called without an active exception", in a C++ destructor after a freshly built comm op) finished its work.
        if not serving and world.launcher == "local" and all(c == 0 or (c is not None and is_complete(job / f"rank{r}.json"))
                                             for r, c in enumerate(codes)):
            for r, c in enumerate(codes):
                if c != 0:
                    print(f"gradkit: rank {r} wrote its result, then {how_it_ended(c)} in tear-down; "
                          "its result is kept", file=sys.stderr)
            partial()
            return
        bad = [r for r, c in enumerate(codes) if c is not None and (serving or c != 0)]
        if bad and failed_at is None:
            failed_at = time.monotonic()
        if failed_at is not None and (all(c is not None for c in codes) or time.monotonic() - failed_at > GRACE_AFTER_FAILURE_S):
            kill_groups(procs)
            partial()
            raise blame(sorted(bad, key=lambda r: (exited[r], codes[r] >= 0)), codes, job, logs,
                        by_exit=world.launcher == "local", started_in=started_in)
        if time.monotonic() > deadline:
            running = [r for r, c in enumerate(codes) if c is None]
            kill_groups(procs)
            partial()
            tails = {r: tail(logs[r]) for r in range(len(procs))}
            raise RankTimeout(f"world of {world.world_size} ranks ran past its timeout of {world.timeout_s:g} s; "
                              f"ranks still running (killed): {running}. Last output of rank {running[0]}:\n"
                              f"{tails[running[0]][-1500:]}", rank=running[0], logs=tails)
        time.sleep(POLL_S)
