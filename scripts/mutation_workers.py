"""``scripts/mutation.sh --workers N``: a module's mutants over N checkouts at once (one per core), so that the run's
wall time falls with the cores as the suite's does. A mutant is written into its module in place, so two at once need
two copies of ``kit/``: worker 0 is the repository itself, each other one a git worktree under
``runs/mutation/checkouts/`` at the same commit, with every other file of the working tree copied in (uncommitted
tests included) and ``gradkit`` imported from its own ``kit/`` (``PYTHONPATH``: a link to it, which the editable
install's finder yields to, in the pytest process and in every rank and kernel it starts). Each worker is a process
forked before any thread, taking mutants from a queue and forking one pytest per mutant as the single run does; the
parent writes each result into the session as it comes.
"""
from __future__ import annotations

import contextlib
import filecmp
import multiprocessing
import os
import queue
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import mutation_mutant as mm

CHECKOUTS = mm.REPO / "runs" / "mutation" / "checkouts"
SHIM = ".mutation-import"  # in a checkout: gradkit -> ../kit


def git(*args: str, cwd: Path = mm.REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def checkout(i: int) -> Path:
    """Worker ``i``'s checkout (0: the repository): a worktree at HEAD, the working tree's other files copied in."""
    if i == 0:
        return mm.REPO
    d = CHECKOUTS / f"w{i}"
    head = git("rev-parse", "HEAD")
    if not (d / ".git").exists():
        CHECKOUTS.mkdir(parents=True, exist_ok=True)
        git("worktree", "add", "--detach", "--force", str(d), head)
    else:  # a lock a stopped run left in this worker's own checkout is stale: nothing else works there (an
        # absolute path joined to d is itself)
        (d / git("rev-parse", "--git-path", "index.lock", cwd=d)).unlink(missing_ok=True)
        git("checkout", "--detach", "--force", head, cwd=d)
    for rel in git("ls-files", "--cached", "--others", "--exclude-standard").splitlines():
        src, dst = mm.REPO / rel, d / rel
        if rel.startswith("kit/") or not src.is_file():
            continue
        if not dst.exists() or not filecmp.cmp(src, dst, shallow=False):
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    shim = d / SHIM / "gradkit"
    shim.parent.mkdir(exist_ok=True)
    if not shim.is_symlink():
        shim.symlink_to(d / "kit", target_is_directory=True)
    return d


def _imports_its_own(d: Path) -> bool:
    """Whether a process started with the worker's environment imports ``gradkit`` from ``d``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(d / SHIM), os.environ.get("PYTHONPATH", "")])}
    got = subprocess.run([sys.executable, "-c", "import gradkit, pathlib; print(pathlib.Path(gradkit.__file__)"
                          ".resolve())"], cwd=d, env=env, capture_output=True, text=True)
    return got.stdout.strip().startswith(str((d / "kit").resolve()))


def _work(root: Path, module: str, jobs, results) -> None:
    """A worker: mutants from ``jobs`` in checkout ``root``, each result onto ``results``; on a stop, its module put
    back and its pytest with its worlds gone (``run_tests``)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops the workers
    if root != mm.REPO:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(root / SHIM), os.environ.get("PYTHONPATH", "")])
        sys.path.insert(0, str(root / SHIM))
    try:
        for job in iter(jobs.get, None):
            index, job_id, mutation, args, fast_only = job
            t0 = time.monotonic()
            result = mm.mutate_and_test(module, mutation, args, fast_only, root)
            results.put((index, job_id, result, time.monotonic() - t0))
    finally:
        mm.restore(module, root)


def run(module: str, todo: list, workers: int, record) -> None:
    """``todo``: ``[(job_id, mutation, args, fast_only)]``, run on ``workers`` checkouts; ``record(index, job_id,
    result, seconds)`` in this process as each comes back."""
    roots = [checkout(i) for i in range(workers)]
    for root in roots[1:]:
        if not _imports_its_own(root):
            raise RuntimeError(f"{root}: gradkit is not imported from its own kit/ there; run with --workers 1")
    ctx = multiprocessing.get_context("fork")
    jobs, results = ctx.Queue(), ctx.Queue()
    for q in (jobs, results):  # a stop must not wait for a queue's buffer to reach a reader that is gone
        q.cancel_join_thread()
    for index, item in enumerate(todo):
        jobs.put((index, *item))
    for _ in roots:
        jobs.put(None)
    procs = [ctx.Process(target=_work, args=(root, module, jobs, results), daemon=False) for root in roots]
    for p in procs:
        p.start()
    try:
        done = 0
        while done < len(todo):
            try:
                got = results.get(timeout=1.0)
            except queue.Empty:  # see whether a worker died
                if not any(p.is_alive() for p in procs):
                    raise RuntimeError("every mutation worker stopped before its mutants were done") from None
                continue
            record(*got)
            done += 1
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(30)
        for root in roots:
            with contextlib.suppress(subprocess.CalledProcessError):
                mm.restore(module, root)
