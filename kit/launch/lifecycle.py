"""The life of a world's processes: starting its ranks (``run_world``), waiting for them, killing them (and
every process the kit started, with its caller: parent-death signal), and removing the folders of worlds whose
caller was killed before it could."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kit import config as kconfig
from kit.launch.results import _complete, _failure, _PartialReader, _partials, _tail, how_it_ended
from kit.launch.spec import (REPO_ROOT, LaunchError, RankFailed, RankTimeout, World, WorldStopped, launch_commands,
                             launcher_env, rank_env, repair_extensions)

if TYPE_CHECKING:
    from kit.launch.servers import _Server

GRACE_AFTER_FAILURE_S = 5.0  # other ranks usually block in a collective once one dies
POLL_S = 0.1


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux; a no-op elsewhere).

    Used as ``preexec_fn`` of every process the kit starts (ranks, launchers, papermill): a kernel restart or a
    ``kill -9`` of the caller then takes its ranks with it instead of leaving them re-parented to PID 1. The
    setting survives ``exec``; ``kit.launch.worker`` also watches its parent's pid, for the platforms without it.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except OSError:
        pass


def _session_dying_with_parent() -> None:
    os.setsid()  # its own process group: killed as one (``_kill``), and out of reach of the caller's Ctrl-C
    die_with_parent()


_LIVE: dict[int, list] = {}  # the processes of every world this process is running now (id -> Popen list)
_STOPS = [0]  # how many times stop_worlds ran: a world started before a stop is never launched again after it


def stop_worlds() -> int:
    """Kill the ranks of every world this process is running (an interrupted cell or explorer Run); how many.
    None of them is launched again: their failure is the stop, never a rendezvous to retry. A world still
    starting counts too: its ranks are killed as soon as they are up (``check_stop``), and its call raises
    ``WorldStopped``."""
    _STOPS[0] += 1
    live = list(_LIVE.values())
    for procs in live:
        _kill(procs)
    return len(live)


def check_stop(stops: int) -> None:
    """Called once a world's ranks are started and in ``_LIVE``: if ``stop_worlds`` ran since its call began
    (``stops``), while they started (a fork server importing the stack takes seconds), raise ``WorldStopped``; the
    caller's clean-up kills the ranks, as for any failed world. Without it a Stop during the start stopped nothing,
    and the world ran to its end."""
    if _STOPS[0] != stops:
        raise WorldStopped("stopped while its ranks started: they were killed as they came up; nothing ran")


def kill_tree(pid: int, timeout_s: float = 3.0) -> list[int]:
    """SIGKILL ``pid`` and every process below it (papermill, its kernel in another session, the kernel's ranks
    in theirs), children collected first so none is re-parented out of reach; the pids that were alive."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    ours = []
    for p in procs:
        try:
            ours += [p] if p.ppid() == os.getpid() else []
            p.kill()
        except psutil.NoSuchProcess:
            pass
    # wait for the others to go, but never reap our own children: their Popen must still read the exit status
    psutil.wait_procs([p for p in procs if p not in ours], timeout=timeout_s)
    return [p.pid for p in procs]


def ranks_below(pid: int) -> list[tuple[int, "psutil.Process"]]:
    """``(rank, process)`` of the kit's ranks among the processes below ``pid`` (a caller, a kernel, a run-all).
    A rank names itself ``gradkit-rank<R>`` (``kit.launch.worker``); one still starting is found by its command line
    (``kit.launch.worker``), or as a fork of a fork server, with rank -1 until it has named itself."""
    import psutil

    from kit.launch.worker import RANK_NAME

    out = []
    try:
        below = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return out
    for p in below:
        try:
            name, cmd = p.name(), " ".join(p.cmdline())
            if name.startswith(RANK_NAME):
                out.append((int(name[len(RANK_NAME):]), p))
            elif "kit.launch.worker" in cmd:
                out.append((int(p.environ().get("RANK", -1)), p))
            elif "kit.launch.forkserver" in cmd and "kit.launch.forkserver" in " ".join(p.parent().cmdline()):
                out.append((-1, p))
        except (psutil.Error, ValueError):
            pass  # gone while being looked at
    return out


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                p.kill()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def run_world(target: str, payload: dict, world: World | None = None, keep_dir: str | None = None, on_partial=None,
              **kw) -> list:
    """Run ``target`` ("package.module:function") on every rank of ``world``.

    Returns the list of per-rank return values (index = rank). Raises
    ``RankFailed`` when a rank raises or exits non-zero (the first failing
    rank's traceback is attached), ``RankTimeout`` when the world outlives
    ``world.timeout_s`` (all ranks are killed first), ``ConfigError`` on bad
    input before anything starts. ``on_partial(piece)`` is called in the caller, while the world runs, with
    each piece rank 0 reports (``kit.launch.worker.report_partial``): progress, and results kept as they come.
    """
    from kit.launch.warm import _run_warm, _warm_wanted  # warm worlds are built on this module: imported here

    world = world or World(**kw)
    world.validate()
    if ":" not in target:
        raise kconfig.ConfigError(f"target must look like 'package.module:function', got {target!r}")
    warm = keep_dir is None and _warm_wanted(world)
    stops = _STOPS[0]
    for attempt in range(1 + RENDEZVOUS_RETRIES):
        try:
            if warm:
                return _run_warm(target, payload, world, on_partial, stops)
            return _run_world_once(target, payload, world, keep_dir, on_partial, stops)
        except RankFailed as e:
            if _STOPS[0] != stops:  # its ranks died of the stop, whatever the first of them to notice says
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


OWNER_FILE = "owner"  # "<pid> <process start time>" of the process that started a world and owns its folder
# A world folder with no owner file is left alone this long after it last changed: it may be a world starting now.
OWNERLESS_GRACE_S = 60.0


def _new_world_folder(keep_dir: str | None = None) -> Path:
    """The folder of a world starting now (``keep_dir``, or a fresh ``$TMPDIR/gradkit-world-*``), claimed for this
    process at once: its ``OWNER_FILE`` is written right after the folder is made, before anything slow (a fork
    server's start, the ranks'), and whole (renamed into place), so that ``remove_stale_worlds`` can tell a world
    whose caller is gone from one still starting."""
    import psutil

    job = Path(keep_dir) if keep_dir else Path(tempfile.mkdtemp(prefix="gradkit-world-"))
    try:
        job.mkdir(parents=True, exist_ok=True)
        tmp = job / (OWNER_FILE + ".tmp")
        tmp.write_text(f"{os.getpid()} {psutil.Process().create_time()}")
        os.replace(tmp, job / OWNER_FILE)
    except BaseException:
        if keep_dir is None:
            shutil.rmtree(job, ignore_errors=True)
        raise
    return job


SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "deepspeed_allreduce_buffer"  # DeepSpeed's CPU comm op: one 66 MB segment per rank, never unlinked
ORPHAN_SHM_GRACE_S = 60.0


def _unlink(paths) -> list[Path]:
    """Remove ``paths``; the ones that were removed (another process may have taken one first)."""
    removed = []
    for path in paths:
        try:
            path.unlink()
            removed.append(path)
        except OSError:
            pass
    return removed


def release_port(holder) -> list[Path]:
    """The world that held ``holder``'s port is over: free the port and remove the shared-memory segments DeepSpeed's
    CPU comm op made for it. ``shm.cpp`` names them ``deepspeed_allreduce_buffer_<uid>_<addr>_<MASTER_PORT>_<rank>``
    (66 MB each, in RAM) and never unlinks them, so every DeepSpeed world on CPU left W of them behind: a few
    hundred worlds (a sweep, the test suite) filled /dev/shm and the machine's memory."""
    try:
        port = holder.getsockname()[1]
    except OSError:  # closed already (a launcher's world listened on it itself): remove_orphan_segments takes them
        return []
    try:  # the segments go while the port is still held: a world that gets the number next makes its own after
        segments = SHM_DIR.glob(f"{SHM_PREFIX}_{os.getuid()}_*_{port}_*")
        return _unlink(p for p in segments if p.name.rsplit("_", 1)[-1].isdigit())  # ..._<port>_<rank>
    finally:
        holder.close()


def remove_orphan_segments(grace_s: float = ORPHAN_SHM_GRACE_S) -> list[Path]:
    """Remove this user's DeepSpeed CPU comm segments that no live process maps and that are older than
    ``grace_s`` (a world killed before the kit could remove them): a segment only its own world's ranks ever open,
    and they are gone. A segment a running DeepSpeed job maps (the kit's or the user's own) is never touched."""
    now = time.time()
    mine = []
    for p in SHM_DIR.glob(f"{SHM_PREFIX}_{os.getuid()}_*"):
        try:
            if now - p.stat().st_mtime > grace_s:
                mine.append(p)
        except OSError:
            pass
    if not mine:  # the common case (every world removes its own): no need to read every process's maps
        return []
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:
            continue
        if SHM_PREFIX in text:
            mapped.update(line.rsplit("/", 1)[-1].split(" ")[0] for line in text.splitlines() if SHM_PREFIX in line)
    return _unlink(p for p in mine if p.name not in mapped)


def remove_stale_worlds() -> list[Path]:
    """Remove the world folders whose owner is gone (a caller killed with SIGKILL never ran its clean-up), and
    those that never got an owner (a caller killed between making the folder and claiming it); and the shared-memory
    segments of DeepSpeed worlds that are gone (``remove_orphan_segments``)."""
    import psutil

    remove_orphan_segments()
    removed = []
    for folder in Path(tempfile.gettempdir()).glob("gradkit-world-*"):
        try:
            pid, started = (folder / OWNER_FILE).read_text().split()
            alive = psutil.pid_exists(int(pid)) and abs(psutil.Process(int(pid)).create_time() - float(started)) < 1
        except FileNotFoundError:
            # No owner. ``_new_world_folder`` writes it microseconds after making the folder (and making a file in
            # the folder, the owner's temporary one included, makes the folder's mtime new): an ownerless folder
            # that has not changed for OWNERLESS_GRACE_S is one whose caller died in between, never a world that
            # is starting now. (Writing the owner atomically *with* the folder would need the folder made under
            # another name and renamed into place, which leaves the same window at that other name.)
            try:
                alive = time.time() - folder.stat().st_mtime < OWNERLESS_GRACE_S
            except OSError:
                continue  # removed meanwhile
        except (OSError, ValueError, psutil.Error):
            continue  # not the kit's, or not this user's
        if not alive:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _start_ranks(world: World, job: Path, task: dict, server: "_Server | None" = None):
    """Write the world's spec into ``job`` and start its processes: ``(procs, logs, holder)``; ``task`` is the
    spec's target and payload (a one-shot world) or ``{"serve": True, ...}`` (a warm world). With ``server`` (a
    fork server of the world's stack, ``kit.launch.forkserver``) the ranks are forked from it, imports paid; ``job``
    comes from ``_new_world_folder``."""
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
        "pythonpath": [*world.pythonpath, str(REPO_ROOT)],
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
            _kill(procs)
            procs = []
            print(f"gradkit: the fork server of this stack failed ({e}); starting the ranks afresh", file=sys.stderr)
    try:
        for r, cmd in enumerate(commands):
            env = rank_env(world, r, port) if world.launcher == "local" else launcher_env(world, port)
            with open(logs[r], "wb") as log:
                procs.append(subprocess.Popen(cmd, env=env, cwd=str(REPO_ROOT), stdout=log, stderr=subprocess.STDOUT,
                                              preexec_fn=_session_dying_with_parent))
    except BaseException:
        _kill(procs)
        holder.close()
        raise
    return procs, logs, holder


def _run_world_once(target: str, payload: dict, world: World, keep_dir: str | None, on_partial, stops: int) -> list:
    remove_stale_worlds()
    job = _new_world_folder(keep_dir)
    procs: list[subprocess.Popen] = []
    _LIVE[id(procs)] = procs
    holder = None
    try:
        started, logs, holder = _start_ranks(world, job, {"target": target, "payload": payload})
        procs += started
        check_stop(stops)  # a stop while they started: the finally below kills them
        try:
            _wait(procs, world, job, logs, on_partial)
            if not (job / "rank0.json").exists():
                raise RankFailed("the launcher exited 0 but rank 0 wrote no result; its output:\n"
                                 + _tail(logs[0])[-1500:], rank=0, logs={0: _tail(logs[0])})
        except LaunchError as e:
            e.partial = _partials(job, world.world_size)
            raise
        results = []
        for r in range(world.world_size):  # other nodes' ranks are visible only on a shared filesystem
            path = job / f"rank{r}.json"
            results.append(json.loads(path.read_text())["result"] if path.exists() else None)
        return results
    finally:
        _LIVE.pop(id(procs), None)
        _kill(procs)
        if holder is not None:
            release_port(holder)
        if keep_dir is None:
            shutil.rmtree(job, ignore_errors=True)


def _wait(procs: list[subprocess.Popen], world: World, job: Path, logs: list[Path], on_partial=None,
          serving: bool = False, started_in: Path | None = None) -> None:
    """Until every rank's result is in ``job``: a one-shot world's ranks exit 0; a warm world's (``serving``) write
    their job's results and stay, and any of them exiting is a failure (an error raised while the warm world
    started is in its own folder, ``started_in``)."""
    deadline = time.monotonic() + world.timeout_s
    failed_at = None
    exited: dict[int, float] = {}  # rank -> when it was first seen gone: the first to go is the one to blame
    partial = _PartialReader(job / "rank0.partial.jsonl", on_partial)
    while True:
        partial()
        codes = [p.poll() for p in procs]
        now = time.monotonic()
        for r, c in enumerate(codes):
            if c is not None and r not in exited:
                exited[r] = now
        if serving and all(_complete(job / f"rank{r}.json") for r in range(len(procs))):
            partial()
            return
        if not serving and all(c == 0 for c in codes):
            partial()
            return
        # A local rank that wrote its result and then died in tear-down (seen once in CI: a SIGABRT, "terminate
        # called without an active exception", in a C++ destructor after a freshly built comm op) finished its work.
        if not serving and world.launcher == "local" and all(c == 0 or (c is not None and _complete(job / f"rank{r}.json"))
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
            _kill(procs)
            partial()
            raise _failure(sorted(bad, key=lambda r: (exited[r], codes[r] >= 0)), codes, job, logs,
                           by_exit=world.launcher == "local", started_in=started_in)
        if time.monotonic() > deadline:
            running = [r for r, c in enumerate(codes) if c is None]
            _kill(procs)
            partial()
            tails = {r: _tail(logs[r]) for r in range(len(procs))}
            raise RankTimeout(f"world of {world.world_size} ranks ran past its timeout of {world.timeout_s:g} s; "
                              f"ranks still running (killed): {running}. Last output of rank {running[0]}:\n"
                              f"{tails[running[0]][-1500:]}", rank=running[0], logs=tails)
        time.sleep(POLL_S)
