"""A fork server per stack: one process that has imported the stack once, and forks the ranks of its worlds.

Importing an older DeepSpeed costs ~7 s of one core (0.18.x imports transformers and torch._inductor at import;
the installed 0.19 ~2 s), and every rank of every world paid it: a probe that runs one stack at world sizes 2
and 4 imported it six times. ``gradkit.launch`` starts one server per stack inside a ``launch.warm_worlds`` block
(``gradkit.probes.runner.run`` opens one per probe run) and forks each rank of that stack's worlds from it; the rank
then runs ``gradkit.launch.worker.main`` as a started one would (its own session, log, environment, process group). The
server imports nothing it was not asked for, starts no thread, and leaves when its caller closes its stdin or dies, or
when it has had no rank for ``idle_s`` (the caller then starts a new one when it needs one).

Protocol (JSON lines): the caller writes the server's spec, ``{"pythonpath", "expect", "init", "idle_s"}``; the server
answers ``{"ready": true}`` or ``{"error": ...}`` (the caller then starts its ranks the usual way, and they
report the error themselves). Then, per rank, ``{"job", "env", "log", "exit_file"}`` -> ``{"pid"}``; when a
rank exits, the server writes its exit status (as ``subprocess`` reports it: -9 = SIGKILL) to ``exit_file``.
"""
from __future__ import annotations

import json
import os
import select
import signal
import sys
import time
import traceback
from pathlib import Path

from gradkit.launch import worker
from gradkit.launch.processes import die_with_parent


def _say(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _child(req: dict) -> None:
    """In the forked rank: become a rank started by ``gradkit.launch`` and run ``gradkit.launch.worker.main``; never
    returns."""
    code = 70
    try:
        os.setsid()  # its own process group, as a started rank: killed as one with what it starts
        die_with_parent()  # the server; the server dies with the caller
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.environ.clear()
        os.environ.update(req["env"])
        code = worker.main(Path(req["job"]))
    except BaseException:  # noqa: BLE001 - anything here is the rank's failure, said in its log
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # no interpreter tear-down (see gradkit.launch.worker)


def _reap(children: dict[int, str]) -> None:
    """Write the exit status of every rank that ended (written whole, then renamed into place)."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        path = children.pop(pid, None)
        if path:
            try:
                with open(f"{path}.tmp", "w") as f:
                    f.write(str(os.waitstatus_to_exitcode(status)))
                os.replace(f"{path}.tmp", path)
            except OSError:
                pass  # the world's folder is gone: nobody is waiting for this rank any more


def main() -> int:
    spec = json.loads(sys.stdin.readline())
    for path in reversed(spec.get("pythonpath", [])):
        if path not in sys.path:
            sys.path.insert(0, path)
    try:
        worker.check_stack(spec.get("expect") or {})
        import torch  # noqa: F401

        if spec.get("init") == "deepspeed":
            import deepspeed  # noqa: F401
        worker.warm_up(spec.get("init", "deepspeed"))
        import threading

        if threading.active_count() != 1:  # a thread would not survive the fork, and might hold a lock
            raise RuntimeError(f"the stack started threads at import: {[t.name for t in threading.enumerate()]}")
    except BaseException as e:  # noqa: BLE001 - the caller falls back to started ranks, which say it themselves
        _say({"error": f"{type(e).__name__}: {str(e)[:500]}"})
        return 1
    import gc

    gc.collect()
    gc.freeze()  # the imported modules stay shared with the ranks, and their collections skip them
    _say({"ready": True})
    children: dict[int, str] = {}
    idle_since = time.monotonic()
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 0.05)
        _reap(children)
        if children:
            idle_since = time.monotonic()
        if not ready:
            if time.monotonic() - idle_since > spec.get("idle_s", 60):
                return 0  # no rank for that long (a kernel's warm worlds idled out): the stack's memory goes
            continue
        line = sys.stdin.readline()
        if not line:  # the caller closed the pipe (or died): the ranks go with this process
            return 0
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(req)
        children[pid] = req["exit_file"]
        _say({"pid": pid})


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
