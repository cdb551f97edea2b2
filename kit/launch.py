"""Run one importable function on W ranks and get each rank's JSON result back.

Modelled on DeepSpeed's ``tests/unit/common.py`` ``DistributedTest``: one call
starts a world, waits with a timeout, and either returns every rank's result or
raises an error that names the rank and carries its traceback.

The world is a set of fresh ``python -m kit.worker`` processes, never a fork of
the caller, so it works from a notebook kernel (nothing from ``__main__`` is
pickled) and under a DeepSpeed/transformers version overlay (``kit.versions``)
that the caller itself does not import.

    results = run_world("kit.selftest:ping", {"x": 1}, world_size=2)

Each rank runs ``fn(payload)``; the function returns something
JSON-serialisable. Ranks find each other on 127.0.0.1 (gloo on CPU, nccl on
CUDA). The CPU comm op DeepSpeed JIT-builds in ``init_distributed`` is kept in
``<cache>/torch_extensions/<deepspeed version>`` so only the first launch of a
version pays for the build.
"""
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
from dataclasses import dataclass, field
from pathlib import Path

from kit import config as kconfig

REPO_ROOT = Path(__file__).resolve().parent.parent
GRACE_AFTER_FAILURE_S = 5.0  # other ranks usually block in a collective once one dies
POLL_S = 0.1


class LaunchError(RuntimeError):
    """The world did not produce a result for every rank."""

    def __init__(self, message: str, rank: int | None = None, traceback: str = "", logs: dict | None = None,
                 partial: dict | None = None):
        super().__init__(message)
        self.rank = rank
        self.traceback = traceback
        self.logs = logs or {}
        self.partial = partial or {}  # rank -> the pieces it reported with kit.worker.report_partial


class RankFailed(LaunchError):
    """A rank raised (its traceback is in ``.traceback``) or died."""


class RankTimeout(LaunchError):
    """The world ran past its timeout; every rank was killed."""


@dataclass
class World:
    """How to start the ranks. Everything that is not the probe itself."""

    world_size: int = 2
    device: str = "cpu"  # "cpu" (gloo) or "cuda" (nccl)
    timeout_s: float = kconfig.DEFAULT_TIMEOUT_S
    pythonpath: list[str] = field(default_factory=list)  # overlays, searched first
    env: dict[str, str] = field(default_factory=dict)
    init: str = "deepspeed"  # "deepspeed" | "torch": how the worker initialises the process group
    extensions_key: str | None = None  # names the torch-extensions cache; default: the installed DeepSpeed

    def validate(self) -> None:
        kconfig.check_device(self.device)
        kconfig.check_world_size(self.world_size, self.device)
        kconfig.check_timeout(self.timeout_s)
        if self.init not in ("deepspeed", "torch"):
            raise kconfig.ConfigError(f"init must be 'deepspeed' or 'torch', got {self.init!r}")


def _installed_key() -> str:
    from kit import versions
    return versions.Stack({"deepspeed": versions.installed_version("deepspeed")}).extensions_key


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(world: World, rank: int, port: int) -> dict[str, str]:
    """The environment of one rank: torch.distributed's variables plus the kit's."""
    env = dict(os.environ)
    env.update(world.env)
    env.update({
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world.world_size),
        "LOCAL_WORLD_SIZE": str(world.world_size),
        "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
        "PYTHONUNBUFFERED": "1",
        "TORCH_EXTENSIONS_DIR": str(kconfig.cache_dir() / "torch_extensions" / (world.extensions_key or _installed_key())),
    })
    if world.device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env["CUDA_VISIBLE_DEVICES"] = ""
    paths = [*world.pythonpath, str(REPO_ROOT), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except FileNotFoundError:
        return ""


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


def run_world(target: str, payload: dict, world: World | None = None, keep_dir: str | None = None, **kw) -> list:
    """Run ``target`` ("package.module:function") on every rank of ``world``.

    Returns the list of per-rank return values (index = rank). Raises
    ``RankFailed`` when a rank raises or exits non-zero (the first failing
    rank's traceback is attached), ``RankTimeout`` when the world outlives
    ``world.timeout_s`` (all ranks are killed first), ``ConfigError`` on bad
    input before anything starts.
    """
    world = world or World(**kw)
    world.validate()
    if ":" not in target:
        raise kconfig.ConfigError(f"target must look like 'package.module:function', got {target!r}")
    job = Path(keep_dir) if keep_dir else Path(tempfile.mkdtemp(prefix="gradkit-world-"))
    job.mkdir(parents=True, exist_ok=True)
    (job / "spec.json").write_text(json.dumps({"target": target, "payload": payload, "device": world.device,
                                               "init": world.init, "timeout_s": world.timeout_s}))
    port = free_port()
    procs: list[subprocess.Popen] = []
    logs = [job / f"rank{r}.log" for r in range(world.world_size)]
    try:
        for r in range(world.world_size):
            with open(logs[r], "wb") as log:
                procs.append(subprocess.Popen([sys.executable, "-m", "kit.worker", str(job)], env=rank_env(world, r, port),
                                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        try:
            _wait(procs, world, job, logs)
        except LaunchError as e:
            e.partial = _partials(job, world.world_size)
            raise
        results = []
        for r in range(world.world_size):
            rec = json.loads((job / f"rank{r}.json").read_text())
            results.append(rec["result"])
        return results
    finally:
        _kill(procs)
        if keep_dir is None:
            shutil.rmtree(job, ignore_errors=True)


def _wait(procs: list[subprocess.Popen], world: World, job: Path, logs: list[Path]) -> None:
    deadline = time.monotonic() + world.timeout_s
    failed_at = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c == 0 for c in codes):
            return
        bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if bad and failed_at is None:
            failed_at = time.monotonic()
        if failed_at is not None and (all(c is not None for c in codes) or time.monotonic() - failed_at > GRACE_AFTER_FAILURE_S):
            _kill(procs)
            raise _failure(bad, codes, job, logs)
        if time.monotonic() > deadline:
            running = [r for r, c in enumerate(codes) if c is None]
            _kill(procs)
            tails = {r: _tail(logs[r]) for r in range(len(procs))}
            raise RankTimeout(f"world of {world.world_size} ranks ran past its timeout of {world.timeout_s:g} s; "
                              f"ranks still running (killed): {running}. Last output of rank {running[0]}:\n"
                              f"{tails[running[0]][-1500:]}", rank=running[0], logs=tails)
        time.sleep(POLL_S)


def _partials(job: Path, world_size: int) -> dict:
    out = {}
    for r in range(world_size):
        path = job / f"rank{r}.partial.jsonl"
        if path.exists():
            out[r] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return out


def _failure(bad: list[int], codes: list, job: Path, logs: list[Path]) -> RankFailed:
    tails = {r: _tail(logs[r]) for r in range(len(logs))}
    # When one rank raises, its peers fail a moment later in their collectives ("remote worker crashed"):
    # report the rank whose exception came first, with its traceback.
    errors = [json.loads(p.read_text()) for p in job.glob("rank*.error.json")]
    if errors:
        e = min(errors, key=lambda x: x["time"])
        r = e["rank"]
        return RankFailed(f"rank {r} raised {e['type']}: {e['message']}\n--- traceback of rank {r} ---\n"
                          f"{e['traceback']}", rank=r, traceback=e["traceback"], logs=tails)
    r = bad[0]  # died without a Python traceback (killed, segfault, os._exit)
    return RankFailed(f"rank {r} exited with code {codes[r]} without a Python traceback; last output:\n"
                      f"{tails[r][-1500:]}", rank=r, logs=tails)
