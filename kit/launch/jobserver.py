"""A job server: one process per stack and environment that has imported the stack once, and forks the ranks of the
user scripts run on it (``gradkit.launch.scripts``: torchrun's ranks), each then running the script as
``python -u script.py`` would.

Every rank of ``torchrun script.py`` imports torch, DeepSpeed and transformers before it reaches the script's first
line: ~6 s of a core each (transformers 5 alone ~3 s), several times the work of a toy job itself. Here torchrun
still runs its agent, its rendezvous and its environment, and starts each rank as a small client
(``kit/launch/jobclient.py``, ``torchrun --no-python``); the client hands its environment, folder, arguments and
standard streams to this server, which forks a child that becomes the rank: the client's streams, environment and
folder, ``sys.argv`` and ``sys.path[0]`` as the interpreter sets them, the random state of a fresh interpreter, the
script run as ``__main__`` (``runpy``), its exit as the interpreter's (``SystemExit``, a traceback and 1, atexit).
The client forwards the signals torchrun sends and exits as the rank did.

The server is started with the job's own environment (``PYTHONPATH`` of the stack, ``DS_ACCELERATOR`` ...): modules
that read the environment at import read the job's. Its clients wait for its socket while it imports (torchrun's
agent starts meanwhile). Where an import leaves a thread running (a fork would not carry it: pyarrow's, under the
Trainer's import in TRL's package set), it starts again with the imports before that one; where an import fails it
answers ``{"fallback": why}`` and the client runs the script in a fresh interpreter instead. A rank whose client dies (a
timeout's ``kill_tree`` of the torchrun tree) is killed with its process group at once. The server leaves when its
caller closes its stdin or dies, or after ``idle_s`` without a rank.

    python -m gradkit.launch.jobserver SOCKET PRELOAD_JSON IDLE_S
"""
from __future__ import annotations

import array
import gc
import importlib
import json
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
import traceback

from gradkit.launch.cleanup import OWNER_FILE
from gradkit.launch.processes import die_with_parent

HEADER = struct.Struct("!I")


def _preload(modules: list[str]) -> tuple[str, int]:
    """Import ``modules`` in order (``pkg:attr`` also reads that attribute: a lazy module's heavy part); returns why the
    server cannot fork ranks ("" where it can) and how many of them were imported before that."""
    for k, name in enumerate(modules):
        mod, _, attr = name.partition(":")
        try:
            m = importlib.import_module(mod)
            if attr:
                getattr(m, attr)
        except Exception as e:  # noqa: BLE001 - the ranks will meet it themselves, in a fresh interpreter
            return f"importing {name} failed here: {type(e).__name__}: {e}", k
        if threading.active_count() > 1 or len(os.listdir("/proc/self/task")) > 1:
            return f"importing {name} started a thread (a fork would not carry it)", k
    return "", len(modules)


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    """The client's request and the three file descriptors of its standard streams."""
    fds = array.array("i")
    data, anc, _, _ = conn.recvmsg(65536, socket.CMSG_SPACE(3 * fds.itemsize))
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    try:
        while len(data) < HEADER.size or len(data) < HEADER.size + HEADER.unpack_from(data)[0]:
            more = conn.recv(65536)
            if not more:
                raise EOFError("the client left before its request was whole")
            data += more
        (n,) = HEADER.unpack_from(data)
        return json.loads(data[HEADER.size:HEADER.size + n]), list(fds)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _say(conn: socket.socket, obj: dict) -> None:
    try:
        conn.sendall((json.dumps(obj) + "\n").encode())
    except OSError:
        pass  # the client is gone; its rank is killed where the loop sees that


def _fresh_random_state() -> None:
    """What a fresh interpreter starts with: ``random``, numpy's (where imported) and torch's default generator seeded
    from the OS (a forked child would share the server's: the same "random" numbers on every rank)."""
    import random

    random.seed()
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()


def _rank(req: dict, fds: list[int]) -> None:
    """In the forked child: become ``python -u script args`` (or ``-m module``) in the client's streams, folder and
    environment; never returns."""
    import io
    import runpy

    code = 1
    try:
        os.setsid()  # its own process group: killed as one, with what it starts, when its client goes
        die_with_parent()  # the server
        for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)  # SIGPIPE stays ignored, as the interpreter sets it at start
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
        for fd in fds:
            os.close(fd)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)  # -u
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace")
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        _fresh_random_state()
        argv = req["argv"]
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = req["cwd"]
            runner = lambda: runpy.run_module(argv[1], run_name="__main__", alter_sys=True)  # noqa: E731
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runner = lambda: runpy.run_path(argv[0], run_name="__main__")  # noqa: E731
        try:
            runner()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if e.code is not None and not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - what the interpreter prints of an uncaught exception, and its 1
            kind, value, tb = sys.exc_info()
            while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__, "<frozen runpy>"):
                tb = tb.tb_next  # from the script's first frame, as the interpreter shows it
            sys.excepthook(kind, value.with_traceback(tb), tb)
            code = 1
        try:
            threading._shutdown()  # the interpreter waits for the script's non-daemon threads at its end
        except Exception:  # noqa: BLE001
            pass
        import atexit

        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - the server's part failed: said on the rank's stderr
        traceback.print_exc()
        code = 70
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code & 0xFF)


def serve(path: str, preload: list[str], idle_s: float) -> int:
    """Its caller holds its stdin: the server leaves when that closes (the caller ended, or was killed: a pipe, not
    the parent-death signal, which fires when the caller's *thread* ends)."""
    why, safe = _preload(preload)
    if why and 0 < safe < len(preload) and "thread" in why:
        # e.g. the Trainer's import reaching pyarrow (jemalloc's thread) in TRL's package set: the imports before it
        # are still worth a server; its ranks import the rest themselves (their clients wait for the socket)
        os.execv(sys.executable, [sys.executable, "-m", "gradkit.launch.jobserver", path, json.dumps(preload[:safe]),
                                  str(idle_s)])
    gc.collect()
    gc.freeze()  # the imported modules stay shared with the forked ranks: their collections do not touch them
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print(json.dumps({"ready": not why, "why": why}), flush=True)
    ranks: dict[int, socket.socket] = {}  # pid -> its client's connection
    waiting: list[socket.socket] = []  # connections whose request is not read yet
    last = time.monotonic()
    try:
        while True:
            ready, _, _ = select.select([listener, sys.stdin, *waiting, *ranks.values()], [], [], 0.2)
            for r in ready:
                if r is sys.stdin:
                    if not os.read(sys.stdin.fileno(), 4096):
                        return 0  # the caller is gone
                elif r is listener:
                    conn, _ = listener.accept()
                    waiting.append(conn)
                elif r in waiting:
                    waiting.remove(r)
                    try:
                        req, fds = _receive(r)
                    except (OSError, EOFError, ValueError):
                        r.close()
                        continue
                    if why:
                        for fd in fds:
                            os.close(fd)  # the client's streams: held here, its caller would wait for their end
                        _say(r, {"fallback": why})
                        r.close()
                    else:
                        pid = os.fork()
                        if pid == 0:
                            for other in (listener, r, *waiting, *ranks.values()):
                                other.close()
                            _rank(req, fds)
                        for fd in fds:
                            os.close(fd)
                        ranks[pid] = r
                        _say(r, {"pid": pid})
                else:  # a client's connection readable: it left (its rank goes with it)
                    pid = next((p for p, c in ranks.items() if c is r), None)
                    if pid is not None and not r.recv(1):
                        _kill(pid)
            while ranks:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                conn = ranks.pop(pid, None)
                if conn is not None:
                    _say(conn, {"status": os.waitstatus_to_exitcode(status)})
                    conn.close()
            if ranks or waiting:
                last = time.monotonic()
            elif time.monotonic() - last > idle_s:
                return 0
    finally:
        for pid in list(ranks):
            _kill(pid)
        listener.close()
        for remove, what in ((os.unlink, path), (os.unlink, os.path.join(os.path.dirname(path), OWNER_FILE)),
                             (os.rmdir, os.path.dirname(path))):
            try:
                remove(what)
            except OSError:
                pass


def _below(pid: int) -> list[int]:
    """The processes below ``pid`` (a forked torchrun agent's rank clients, in sessions of their own)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    out, frontier = [], [pid]
    while frontier:
        frontier = [p for p, parent in parents.items() if parent in frontier]
        out += frontier
    return out


def _kill(pid: int) -> None:
    """SIGKILL a rank (or agent), its process group and every process below it, collected first."""
    below = _below(pid)
    for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL),
                   *(lambda p=p: os.kill(p, signal.SIGKILL) for p in below)):
        try:
            target()
        except OSError:
            pass


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3])))
