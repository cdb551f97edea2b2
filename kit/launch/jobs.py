"""Job servers, the caller's side: which server a user script's ranks are forked from (``gradkit.launch.jobserver``),
started on first use and kept for the next script of the same stack and environment.

A server is keyed by everything its imports can read: the interpreter, the whole environment the ranks get (the
stack's ``PYTHONPATH``, ``DS_ACCELERATOR``, ``HF_HOME`` ...; not the variables pytest sets per test) and what it
imports. It leaves after ``JOB_SERVER_IDLE_S`` without a rank, when ``JOB_SERVER_MAX`` others were used since, on
``stop_job_servers()`` and with this process (its stdin is this process's pipe). ``NO_FORK_ENV`` set, or
``GRADKIT_WARM_JOBS=0``: every rank starts its own interpreter, as ``torchrun script.py`` does.
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from gradkit.launch.cleanup import new_world_folder
from gradkit.launch.processes import kill_groups
from gradkit.launch.servers import NO_FORK_ENV

CLIENT = Path(__file__).with_name("jobclient.py")
JOB_SERVER_IDLE_S = 120.0
JOB_SERVER_MAX = 3  # each holds a whole stack in memory (~0.7 GB with transformers): the least recently used goes
WARM_JOBS_ENV = "GRADKIT_WARM_JOBS"  # "0": no job servers
PER_TEST = ("PYTEST_CURRENT_TEST", "COVERAGE_PROCESS_CONFIG")  # set per test: no import reads them
# what a rank of a script needing each package imports before its first line (a lazy module's heavy part after ':')
PRELOAD = {"deepspeed": ["deepspeed"], "transformers": ["transformers", "transformers:Trainer"],
           "accelerate": ["accelerate"]}


class _Server:
    def __init__(self, proc: subprocess.Popen, folder: str):
        self.proc, self.folder, self.used = proc, folder, time.monotonic()

    @property
    def socket(self) -> str:
        return os.path.join(self.folder, "s")


_SERVERS: dict[str, _Server] = {}
_LOCK = threading.Lock()


def enabled(device: str) -> bool:
    return device == "cpu" and not os.environ.get(NO_FORK_ENV) and os.environ.get(WARM_JOBS_ENV, "1") != "0"


def preload(packages) -> list[str]:
    return ["torch", "torch.distributed", *(m for p in packages for m in PRELOAD.get(p, [p]))]


def client_command(env: dict, packages, device: str) -> list[str]:
    """What torchrun runs (``--no-python``) in place of ``python -u`` for each rank: the client of this stack's job
    server; ``[]`` where ranks start their own interpreters."""
    if not enabled(device):
        return []
    modules = preload(packages)
    key = json.dumps([sys.executable, modules, sorted((k, v) for k, v in env.items() if k not in PER_TEST)])
    with _LOCK:
        server = _SERVERS.get(key)
        if server is None or server.proc.poll() is not None:
            if server is not None:
                _forget(key)
            for old in sorted((k for k in _SERVERS if k != key), key=lambda k: _SERVERS[k].used)[
                    :max(0, len(_SERVERS) + 1 - JOB_SERVER_MAX)]:
                _forget(old)
            server = _SERVERS[key] = _start(env, modules)
        server.used = time.monotonic()
    return [sys.executable, "-S", str(CLIENT), server.socket, str(server.proc.pid)]


def _start(env: dict, modules: list[str]) -> _Server:
    folder = str(new_world_folder(prefix="gradkit-jobs-"))  # owned by this process: swept once it is gone
    proc = subprocess.Popen([sys.executable, "-m", "gradkit.launch.jobserver", os.path.join(folder, "s"),
                             json.dumps(modules), str(JOB_SERVER_IDLE_S)], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=folder,
                            start_new_session=True)
    return _Server(proc, folder)


def _forget(key: str) -> None:
    server = _SERVERS.pop(key, None)
    if server is not None:
        kill_groups([server.proc])  # its ranks die with it (parent-death signal)
        try:
            server.proc.stdin.close()
        except OSError:
            pass
        server.proc.wait()
        shutil.rmtree(server.folder, ignore_errors=True)


def stop_job_servers() -> None:
    """Stop every job server of this process."""
    with _LOCK:
        for key in list(_SERVERS):
            _forget(key)


atexit.register(stop_job_servers)
