"""A user's own script on W ranks, as the user runs it (``torchrun --standalone``, ``accelerate launch``), under a
stack of releases: the standalone reproductions (``gradkit.commands.repro``), the watch's example jobs
(``examples/watch``) and the recipes (``examples/recipes``) run this way.
The script's ranks start in sessions of their own: a timeout kills the whole tree, and the shared-memory segments
DeepSpeed's CPU comm op leaves behind are removed. The launcher and the ranks are forked from a job server of the stack
(``gradkit.launch.jobs``: one import of torch, DeepSpeed and transformers instead of one per process); the process
started here is then the launcher's client, and killing it makes the server kill the launcher's tree and ranks."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from gradkit import config as kconfig
from gradkit.launch import jobs
from gradkit.launch.cleanup import remove_orphan_segments
from gradkit.launch.processes import die_with_parent, kill_tree
from gradkit.stacks import versions


def torchrun(path, args=(), world_size: int = 2, stack: dict | None = None, packages=("deepspeed",),
             device: str = "cpu", timeout_s: float = 300, cwd=None, env: dict | None = None,
             paths=(), module: bool = False) -> tuple[int, str, str]:
    """``(exit status, stdout, stderr)`` of ``torchrun --standalone --nproc_per_node=W path args``; 124 and what it
    printed so far (its whole tree killed) where it ran past ``timeout_s``. ``stack`` pins releases (``{"deepspeed": "0.18.9"}``), the
    others of ``packages`` are the installed ones. ``paths``: more folders on the ranks' path (an extra
    package set, ``gradkit.stacks.extras``). ``module``: ``path`` is a module, run as ``torchrun -m``."""
    if module:
        program, folder = ["-m", str(path)], Path.cwd()
    else:
        path = Path(path).resolve()  # it runs from its own folder: a path relative to the caller's is made whole first
        program, folder = [str(path)], path.parent
    env = _environment(stack, packages, device, env, paths)
    client = jobs.client_command(env, packages, device)  # torchrun and each rank forked from a job server, or []
    cmd = [*client[1:], "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world_size}",
           *(["--no-python", *client] if client else []), *program, *map(str, args)]
    return _launch(cmd, env, timeout_s, cwd or folder)


def accelerate(args, stack: dict | None = None, packages=("deepspeed", "transformers", "accelerate"),
               device: str = "cpu", timeout_s: float = 300, cwd=None, env: dict | None = None,
               paths=()) -> tuple[int, str, str]:
    """``accelerate launch args`` (its config file and flags, then the program and its arguments), as
    ``torchrun`` above runs its script: the same stack, environment, timeout and clean-up."""
    env = _environment(stack, packages, device, env, paths)
    client = jobs.client_command(env, packages, device)  # the launcher forked from a job server (its ranks are not)
    return _launch([*client[1:], "-m", "accelerate.commands.launch", *map(str, args)], env, timeout_s, cwd or Path.cwd())


def _environment(stack, packages, device, env, paths) -> dict:
    """The ranks' environment: the stack's path (and ``paths``), its comm-op folder, ``env`` on top."""
    resolved = versions.resolve_stack(stack or {}, tuple(packages))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*resolved.pythonpath, *map(str, paths)]),
               OMP_NUM_THREADS="1", **(env or {}),
               TORCH_EXTENSIONS_DIR=str(kconfig.cache_dir() / "torch_extensions" / resolved.extensions_key))
    if device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    return env


def _launch(cmd: list, env: dict, timeout_s, cwd) -> tuple[int, str, str]:
    proc = subprocess.Popen([sys.executable, *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=str(cwd), preexec_fn=die_with_parent)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        # the launcher starts each rank in a session of its own: killing it alone would leave them running (a job
        # server's client: the server kills the launcher's tree and its ranks when the client dies)
        kill_tree(proc.pid)
        stdout, stderr = proc.communicate()
        return 124, stdout, stderr
    finally:
        remove_orphan_segments(grace_s=5.0)
    return proc.returncode, stdout, stderr
