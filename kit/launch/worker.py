"""The process every rank runs: ``python -m gradkit.launch.worker <job dir>`` (started by ``gradkit.launch``).

Reads ``spec.json``, joins the process group, calls the target function with
the payload, and writes ``rank<R>.json`` (the result) or ``rank<R>.error.json``
(the exception and its traceback). Exit code 0 only when the result was written.
A target that works through a list may call ``report_partial(obj)`` after each
item: the lines of ``rank<R>.partial.jsonl`` reach the caller even if the world
fails later (``LaunchError.partial``).
"""
from __future__ import annotations

import datetime
import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

from gradkit.launch.spec import RANK_NAME
from gradkit.stacks.versions import module_name


def init_process_group(device: str, how: str, timeout_s: float, init_method: str = "env://") -> None:
    """Join the world: through a file store in the job folder for the kit's own local ranks (no port to race
    for), through the launcher's environment (``env://``) under torchrun or the DeepSpeed launcher."""
    timeout = datetime.timedelta(seconds=max(1.0, timeout_s))
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        import torch
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if init_method.startswith("file://"):
        import torch.distributed as dist
        dist.init_process_group(backend=backend, init_method=init_method, timeout=timeout,
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    if how == "deepspeed":
        import deepspeed
        use_flock_baton()  # before DeepSpeed JIT-loads its comm op
        deepspeed.init_distributed(dist_backend=backend, timeout=timeout)  # joins the group above if there is one
    elif not init_method.startswith("file://"):
        import torch.distributed as dist
        dist.init_process_group(backend=backend, timeout=timeout)


class FlockBaton:
    """torch's ``FileBaton`` (the lock of a JIT extension build) on an OS lock that dies with its holder.

    torch creates ``<build dir>/lock`` with O_EXCL and removes it when the build is done; a rank killed while it
    holds it (a world stopped or timed out during ``init_distributed``, when every rank loads the comm op) leaves
    the file, and every later rank of that release waits for it forever (pytorch#189245; torch 2.13 still has it).
    Here the ranks take ``flock`` on ``lock.flock``, which the kernel drops when a holder dies, and whoever holds
    it removes a ``lock`` file left behind. The interface is ``FileBaton``'s, as ``cpp_extension`` calls it.

    A ``lock`` file a live process holds open is torch's own baton of a process that is not one of the kit's ranks
    (the sweep's reproduction script, which ``gradkit.commands.repro.verify`` runs as plain DeepSpeed in the kit's build folder):
    that build is waited for, never taken over. Removing its lock made the holder's own ``release()`` fail
    (``FileNotFoundError``) and its rank exit 1 in ``init_distributed``."""

    def __init__(self, lock_file_path, wait_seconds=0.1, warn_after_seconds=None):
        self.lock_file_path, self.fd = lock_file_path, None

    def _open(self) -> int:
        return os.open(f"{self.lock_file_path}.flock", os.O_CREAT | os.O_RDWR, 0o644)

    def try_acquire(self) -> bool:
        import fcntl

        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        if lock_holder(self.lock_file_path) is not None:  # torch's own baton, held by a live process: its build
            os.close(fd)
            return False
        self.fd = fd
        try:
            os.remove(self.lock_file_path)  # torch's baton of a builder that died holding it
        except FileNotFoundError:
            pass
        return True

    def wait(self) -> None:
        import fcntl

        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # returns when the builder is done, or dead
        finally:
            os.close(fd)
        said = False
        while (holder := lock_holder(self.lock_file_path)) is not None:  # a build under torch's own baton
            if not said:
                print(f"gradkit: waiting for process {holder}'s build in {Path(self.lock_file_path).parent} "
                      "(torch's own build lock)", file=sys.stderr, flush=True)
                said = True
            time.sleep(0.1)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the lock
            self.fd = None


def lock_holder(path) -> int | None:
    """The pid of another live process that holds ``path`` open (torch's ``FileBaton`` keeps its lock file open
    while it builds); None when the file is gone or nobody holds it (a holder that died)."""
    if not os.path.exists(path):
        return None
    target = os.path.realpath(path)
    for fds in Path("/proc").glob("[0-9]*/fd"):
        if fds.parent.name == str(os.getpid()):
            continue
        try:
            for fd in os.scandir(fds):
                try:
                    if os.readlink(fd.path) == target:
                        return int(fds.parent.name)
                except OSError:
                    pass
        except OSError:  # gone meanwhile, or not ours to read
            pass
    return None


def use_flock_baton() -> None:
    """JIT extension builds in this rank lock with ``FlockBaton``."""
    from torch.utils import cpp_extension

    cpp_extension.FileBaton = FlockBaton


def watch_parent(interval_s: float = 0.5) -> None:
    """Exit when the process that started this rank is gone (the parent-death signal's fallback)."""
    import threading

    parent = os.getppid()

    def watch():
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent:
                os._exit(70)

    threading.Thread(target=watch, name="gradkit-parent-watch", daemon=True).start()


PARTIAL_ENV = "GRADKIT_PARTIAL"  # set by main(): works whether this module is __main__ or imported


def report_partial(obj) -> None:
    """Keep one finished piece of this rank's result, whatever happens to the rest (no-op outside a world)."""
    path = os.environ.get(PARTIAL_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(obj) + "\n")


class StackMismatch(RuntimeError):
    """A rank imported another release (or the same one from another folder) than the world asked for."""


def check_stack(expect: dict) -> dict:
    """Import every package the world names and check its version and folder; ``{package: file}`` if all match.

    A damaged overlay (a missing ``__init__.py``) lets Python fall through to the installed release: the record
    would then carry the requested label over another release's behaviour. This makes that a ``cannot-run``.
    """
    found, bad = {}, []
    for package, want in expect.items():
        try:
            module = importlib.import_module(module_name(package))
        except Exception as e:  # noqa: BLE001 - any import failure means the stack is not what was asked for
            bad.append(f"{package} {want['version']} does not import: {type(e).__name__}: {str(e)[:200]}")
            continue
        where = getattr(module, "__file__", None) or "?"
        got = getattr(module, "__version__", "?")
        root = want.get("root")
        if got != want["version"]:
            bad.append(f"{package}: {want['version']} was requested, {got} was imported (from {where})")
        elif root and where != "?" and not os.path.realpath(where).startswith(os.path.realpath(root) + os.sep):
            bad.append(f"{package} {got} was imported from {where}, not from {root}")
        found[package] = where
    if bad:
        raise StackMismatch("the world's packages are not the ones requested: " + "; ".join(bad))
    return found


def name_process(name: str) -> None:
    """Set this process's name (Linux; 15 characters): a forked rank's command line is its fork server's."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except OSError:
        pass


def resolve(target: str):
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _started_at() -> float:
    """When this process started (the interpreter's own start-up and ``import gradkit`` come before ``main``)."""
    try:
        import psutil
        return psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - a profile is for the eye: never fail a rank over it
        return time.time()


def main(job: Path) -> int:
    """One world's life: check the stack, join the process group, run the spec's target once and write the result.
    A warm world's spec (``"serve"``) has no target: its ranks run every job the caller adds as ``job-<k>/``."""
    t_main = time.time()
    rank = int(os.environ["RANK"])
    name_process(f"{RANK_NAME}{rank}")
    watch_parent()
    spec = json.loads((job / "spec.json").read_text())
    # torchrun / the DeepSpeed launcher on another node may not pass the kit's variables on: the spec carries them
    for key, value in spec.get("env", {}).items():
        os.environ.setdefault(key, value)
    for path in reversed(spec.get("pythonpath", [])):
        if path not in sys.path:
            sys.path.insert(0, path)
    os.environ[PARTIAL_ENV] = str(job / f"rank{rank}.partial.jsonl")
    try:
        check_stack(spec.get("expect") or {})
        fn = None if spec.get("serve") else resolve(spec["target"])
        t_imported = time.time()
        init_process_group(spec["device"], spec["init"], spec["timeout_s"], spec.get("init_method", "env://"))
        t_joined = time.time()
        timing = {"process_start_s": round(t_main - _started_at(), 3), "imports_s": round(t_imported - t_main, 3),
                  "init_distributed_s": round(t_joined - t_imported, 3)}
        if spec.get("serve"):
            return serve(job, rank, spec, timing)
        result = fn(spec["payload"])
        timing["work_s"] = round(time.time() - t_joined, 3)
    except BaseException as e:  # noqa: BLE001 - everything a rank does wrong must reach the caller
        _write_error(job, rank, e)
        return 1
    _write_result(job, rank, result, timing)
    try:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - tear-down problems do not change the result already written
        pass
    return 0


def _write_whole(path: Path, record: dict) -> None:
    """Written whole, then renamed: ``path`` exists only when complete (a launcher such as torchrun may kill a rank
    mid-write, and the caller reads these files while other ranks are still dying; CI stop 20 read an empty one)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def _write_error(folder: Path, rank: int, e: BaseException) -> None:
    _write_whole(folder / f"rank{rank}.error.json", {
        "rank": rank, "time": time.time(), "type": type(e).__name__, "message": str(e)[:2000],
        "traceback": traceback.format_exc()})
    traceback.print_exc()


def _write_result(folder: Path, rank: int, result, timing: dict) -> None:
    _write_whole(folder / f"rank{rank}.json", {"rank": rank, "result": result, "timing": timing})


def warm_up(init: str) -> None:
    """What every world pays once, paid while a warm world waits for its first job: the first torch optimizer
    imports torch._dynamo (~2.5 s on 2 cores), DeepSpeed's first ``initialize`` its engine and ZeRO modules."""
    import torch

    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)  # the first optimizer imports torch._dynamo
    if init == "deepspeed":
        import deepspeed.runtime.engine  # noqa: F401

        # The optimizers ZeRO knows: in 0.19 the Muon module, which torch.compiles at import (torch._inductor, ~1.4 s
        # of a core). DeepSpeed imports it inside is_zero_supported_optimizer, after asking the process group its
        # rank, so calling that here, in a fork server that has no group, raised before the import and every forked
        # rank paid it again in its first initialize (42 % of one check's CPU): imported here by name instead.
        try:
            importlib.import_module("deepspeed.runtime.zero.muon.muon_optimizer")
        except Exception:  # noqa: BLE001 - a release without it: nothing to warm
            pass


SERVE_POLL_S = 0.02
STOP_FILE = "stop"  # written into a warm world's folder by its caller: each rank leaves between jobs, by itself


def serve(job: Path, rank: int, spec: dict, timing: dict) -> int:
    """A warm world's rank: after ``warm_up``, run each ``job-<k>/spec.json`` the caller writes (k = 1, 2, ...)
    into ``job-<k>/`` (result, error, partials), until no job comes for ``idle_s`` (or the caller kills it).
    A job that raises ends the rank (exit 1), as in a one-shot world: its peers may be inside a collective."""
    warm_up(spec["init"])
    k, idle_since = 1, time.monotonic()
    while True:
        folder = job / f"job-{k}"
        if (folder / "spec.json").exists():
            task = json.loads((folder / "spec.json").read_text())
            os.environ[PARTIAL_ENV] = str(folder / f"rank{rank}.partial.jsonl")
            t0 = time.time()
            try:
                result = resolve(task["target"])(task["payload"])
            except BaseException as e:  # noqa: BLE001 - see the docstring
                _write_error(folder, rank, e)
                return 1
            _write_result(folder, rank, result, {**timing, "work_s": round(time.time() - t0, 3), "job": k})
            timing = {"process_start_s": 0.0, "imports_s": 0.0, "init_distributed_s": 0.0}  # paid by the first job
            k, idle_since = k + 1, time.monotonic()
        elif (job / STOP_FILE).exists() or time.monotonic() - idle_since > spec.get("idle_s", 600):
            return 0  # asked to leave (the caller wrote STOP_FILE), or idle: leaves as a one-shot rank does
        else:
            time.sleep(SERVE_POLL_S)


if __name__ == "__main__":
    code = main(Path(sys.argv[1]))
    # The result is on disk: leave without the interpreter's tear-down, whose C++ destructors (gloo, the comm op)
    # have aborted a rank after its work was done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
