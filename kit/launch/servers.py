"""Fork servers.

Inside a warm_worlds block, the ranks of a stack's warm worlds are forked from one process that imported the
stack once (``gradkit.launch.forkserver``): a probe that runs a stack at several world sizes, or groups of cases in
several worlds, pays DeepSpeed's import once (0.18.x: ~7 s of a core per rank). CPU worlds only (a fork after
CUDA is initialised is not safe); a server that cannot start (its stack does not import) means ranks started
the usual way, which then say why themselves. A server outlives the run that started it, for the next run of
its stack (a test module, a script's next probe: ~5 s of a core each); it leaves after ``SERVER_IDLE_S``
without a rank, when ``SERVER_MAX`` others were used since, on ``stop_warm_worlds()``, and with this process
(parent-death signal). Its ranks never outlive their run: they are the warm worlds' (``gradkit.launch.warm``).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from gradkit import config as kconfig
from gradkit.launch.processes import kill_groups, session_dying_with_parent
from gradkit.launch.spec import World, rank_env

SERVER_MAX = 3  # servers kept at once (each holds a whole stack in memory): the least recently used goes
SERVER_IDLE_S = 60.0  # a server with no rank for this long leaves (a kernel's warm worlds idled out after WARM_IDLE_S)
NO_FORK_ENV = "GRADKIT_NO_FORK_SERVER"  # set (to anything): every rank is a process of its own, as before


class Forked:
    """A rank forked by a fork server, read like a ``subprocess.Popen``: its exit status comes from the server."""

    def __init__(self, pid: int, exit_file: Path, server: "Server"):
        self.pid, self.exit_file, self.server, self.returncode = pid, exit_file, server, None

    def poll(self):
        if self.returncode is None:
            try:
                self.returncode = int(self.exit_file.read_text())
            except (OSError, ValueError):
                if self.server.proc.poll() is not None and not _alive(self.pid):
                    self.returncode = -signal.SIGKILL  # its server is gone, and the rank died with it
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def kill(self):
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class Server:
    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.lock = threading.Lock()
        self.used = time.monotonic()

    def fork(self, job: Path, env: dict, log: Path, exit_file: Path) -> Forked:
        with self.lock:
            self.proc.stdin.write(json.dumps({"job": str(job), "env": env, "log": str(log), "exit_file": str(exit_file)}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        return Forked(int(json.loads(line)["pid"]), exit_file, self)


_SERVERS: dict[str, "Server | None"] = {}  # None: this stack's server could not start; its ranks start as before


def stack_fields(world: World) -> list:
    """What a world's ranks import and how they start: the same for every world size (a fork server's key)."""
    return [world.device, world.pythonpath, world.env, world.init, world.extensions_key, world.expect,
            str(kconfig.cache_dir())]


def server_key(world: World) -> str:
    return json.dumps(stack_fields(world), sort_keys=True, default=str)


def server_for(world: World, busy: set[str]) -> "Server | None":
    """The fork server of ``world``'s stack, started now if there is none (from the spawner thread). ``busy``: the
    keys of the servers whose ranks are up now (the warm worlds'), never stopped to make room."""
    if world.device != "cpu" or world.launcher != "local" or world.nnodes != 1 or os.environ.get(NO_FORK_ENV):
        return None
    key = server_key(world)
    server = _SERVERS.get(key, False)
    if server is False or (server is not None and server.proc.poll() is not None):
        idle = sorted((k for k, s in _SERVERS.items() if s is not None and k != key and k not in busy),
                      key=lambda k: _SERVERS[k].used)
        for old in idle[:max(0, sum(s is not None for s in _SERVERS.values()) + 1 - SERVER_MAX)]:
            stop_server(old)
        _SERVERS[key] = server = _start_server(world)
    if server is not None:
        server.used = time.monotonic()
    return server


def _start_server(world: World) -> "Server | None":
    import select

    env = rank_env(world, 0, 0)
    proc = subprocess.Popen([sys.executable, "-m", "gradkit.launch.forkserver"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env=env, cwd=tempfile.gettempdir(), text=True,
                            preexec_fn=session_dying_with_parent)
    proc.stdin.write(json.dumps({"pythonpath": list(world.pythonpath), "expect": world.expect,
                                 "init": world.init, "idle_s": SERVER_IDLE_S}) + "\n")
    proc.stdin.flush()
    ready, _, _ = select.select([proc.stdout], [], [], world.timeout_s)
    said = {}
    if ready:
        try:
            said = json.loads(proc.stdout.readline() or "{}")
        except ValueError:
            said = {}
    if said.get("ready"):
        return Server(proc)
    kill_groups([proc])
    return None


def stop_server(key: str) -> None:
    server = _SERVERS.pop(key, None)
    if server is not None:
        kill_groups([server.proc])  # its ranks die with it (parent-death signal)
        for f in (server.proc.stdin, server.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


def server_keys() -> set[str]:
    """The stacks that have a fork server now, or whose server could not start."""
    return set(_SERVERS)


def forget_unstarted(keys) -> None:
    """Forget the stacks among ``keys`` whose server could not start: the next run tries again."""
    for key in keys:
        if _SERVERS.get(key) is None:
            _SERVERS.pop(key, None)


def stop_servers() -> None:
    """Stop every fork server of this process."""
    for key in list(_SERVERS):
        stop_server(key)
