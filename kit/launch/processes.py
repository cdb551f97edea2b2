"""The kit's processes: each dies with its caller (parent-death signal) in a session of its own, the worlds this
process is running now (``track_world``), killing them (``kill_groups``, ``kill_tree``), the user's stop
(``stop_worlds``, ``check_stop``), and finding the kit's ranks below a process (``ranks_below``)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

from gradkit.launch.spec import RANK_NAME, WorldStopped

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux; a no-op elsewhere).

    Used as ``preexec_fn`` of every process the kit starts (ranks, launchers, papermill): a kernel restart or a
    ``kill -9`` of the caller then takes its ranks with it instead of leaving them re-parented to PID 1. The
    setting survives ``exec``; ``gradkit.launch.worker`` also watches its parent's pid, for the platforms without it.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except OSError:
        pass


def session_dying_with_parent() -> None:
    """``preexec_fn`` of a process the kit starts: in a session of its own (its own process group: killed as one by
    ``kill_groups``, and out of reach of the caller's Ctrl-C), dying with its parent (``die_with_parent``)."""
    os.setsid()
    die_with_parent()


_LIVE: dict[int, list] = {}  # the processes of every world this process is running now (id -> Popen list)
_STOPS = [0]  # how many times stop_worlds ran: a world started before a stop is never launched again after it


def track_world(procs: list) -> None:
    """``procs`` (a list the caller fills as its ranks start) are a world this process runs now: ``stop_worlds``
    kills them."""
    _LIVE[id(procs)] = procs


def untrack_world(procs: list) -> None:
    _LIVE.pop(id(procs), None)


def stop_count() -> int:
    """How many times ``stop_worlds`` ran so far: a call notes it when it begins, for ``check_stop``."""
    return _STOPS[0]


def stop_worlds() -> int:
    """Kill the ranks of every world this process is running (an interrupted cell or explorer Run); how many.
    None of them is launched again: their failure is the stop, never a rendezvous to retry. A world still
    starting counts too: its ranks are killed as soon as they are up (``check_stop``), and its call raises
    ``WorldStopped``."""
    _STOPS[0] += 1
    live = list(_LIVE.values())
    for procs in live:
        kill_groups(procs)
    return len(live)


def check_stop(stops: int) -> None:
    """Called once a world's ranks are started and tracked (``track_world``): if ``stop_worlds`` ran since its call
    began (``stops``), while they started (a fork server importing the stack takes seconds), raise ``WorldStopped``;
    the caller's clean-up kills the ranks, as for any failed world. Without it a Stop during the start stopped
    nothing, and the world ran to its end."""
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
    A rank names itself ``gradkit-rank<R>`` (``gradkit.launch.worker``); one still starting is found by its command line
    (``gradkit.launch.worker``), or as a fork of a fork server, with rank -1 until it has named itself."""
    import psutil

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
            elif "gradkit.launch.worker" in cmd:
                out.append((int(p.environ().get("RANK", -1)), p))
            elif "gradkit.launch.forkserver" in cmd and "gradkit.launch.forkserver" in " ".join(p.parent().cmdline()):
                out.append((-1, p))
        except (psutil.Error, ValueError):
            pass  # gone while being looked at
    return out


def kill_groups(procs: list[subprocess.Popen]) -> None:
    """SIGKILL each process's process group (each was started in a session of its own) and wait for it."""
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
