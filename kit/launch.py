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

import atexit
import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kit import config as kconfig

REPO_ROOT = Path(__file__).resolve().parent.parent
LAUNCHERS = kconfig.LAUNCHERS
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
    expect: dict = field(default_factory=dict)  # {package: {"version", "root"}} every rank checks (kit.worker)
    # How the ranks are started (defaults from the environment, so notebooks and run-all need no new knobs):
    # "local" = the kit starts one process per rank on this machine; "torchrun" = torchrun (one per node,
    # over ssh for the other nodes of the hostfile); "deepspeed" = the DeepSpeed launcher with the hostfile.
    launcher: str = field(default_factory=lambda: os.environ.get("GRADKIT_LAUNCHER", "local"))
    nnodes: int = field(default_factory=kconfig.nnodes_setting)
    hostfile: str | None = field(default_factory=lambda: os.environ.get("GRADKIT_HOSTFILE") or None)
    master_addr: str = field(default_factory=lambda: os.environ.get("GRADKIT_MASTER_ADDR", "127.0.0.1"))

    @property
    def nproc_per_node(self) -> int:
        return self.world_size // self.nnodes

    def validate(self, here: bool = True) -> None:
        """Refuse an impossible world; ``here=False`` skips what only this machine decides (devices, cores)."""
        if here:
            kconfig.check_environment()  # before the world's folder exists: nothing is left behind on bad input
            kconfig.check_device(self.device)
        elif self.device not in kconfig.DEVICES:
            raise kconfig.ConfigError(f"device must be one of {kconfig.DEVICES}, got {self.device!r}")
        kconfig.check_timeout(self.timeout_s)
        if self.init not in ("deepspeed", "torch"):
            raise kconfig.ConfigError(f"init must be 'deepspeed' or 'torch', got {self.init!r}")
        if self.launcher not in LAUNCHERS:
            raise kconfig.ConfigError(f"launcher must be one of {LAUNCHERS}, got {self.launcher!r}")
        kconfig.check_positive_int("nnodes", self.nnodes)
        kconfig.check_positive_int("world_size", self.world_size)
        if self.world_size % self.nnodes:
            raise kconfig.ConfigError(f"world_size={self.world_size} does not split evenly over {self.nnodes} nodes")
        if self.nnodes > 1:
            if self.launcher == "local":
                raise kconfig.ConfigError("several nodes need launcher 'torchrun' or 'deepspeed' (GRADKIT_LAUNCHER)")
            hosts = read_hostfile(self.hostfile)
            if len(hosts) < self.nnodes:
                raise kconfig.ConfigError(f"{self.nnodes} nodes asked for, the hostfile {self.hostfile} names {len(hosts)}")
            slots = min(n for _, n in hosts[:self.nnodes])
            if slots < self.nproc_per_node:
                raise kconfig.ConfigError(f"{self.nproc_per_node} ranks per node asked for, the hostfile gives "
                                          f"a node only {slots} slots")
        elif here:
            kconfig.check_world_size(self.world_size, self.device)  # this machine's own limit


def main(argv=None) -> int:
    """``python -m kit.launch --dry-run``: print the command lines a world would be started with."""
    import argparse

    ap = argparse.ArgumentParser(description="Print how the kit would start a world of ranks (GRADKIT_* variables apply).")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--launcher", default=None, help="local | torchrun | deepspeed (default: GRADKIT_LAUNCHER or local)")
    ap.add_argument("--nnodes", type=int, default=None)
    ap.add_argument("--hostfile", default=None)
    ap.add_argument("--master-addr", default=None)
    ap.add_argument("--dry-run", action="store_true", help="print the command lines (the only mode)")
    a = ap.parse_args(argv)
    world = World(world_size=a.world_size, device=a.device)
    for name in ("launcher", "nnodes", "hostfile", "master_addr"):
        if getattr(a, name) is not None:
            setattr(world, name, getattr(a, name))
    world.validate(here=False)  # a dry run may describe GPUs this machine does not have
    job = Path(tempfile.gettempdir()) / "gradkit-world-JOB"
    for cmd in launch_commands(world, job, 29500):
        print(shlex.join(cmd))
    return 0


def _installed_key() -> str:
    from kit import versions
    return versions.Stack({"deepspeed": versions.installed_version("deepspeed")}).extensions_key


def read_hostfile(path) -> list[tuple[str, int]]:
    """``[(host, slots)]`` from a DeepSpeed-style hostfile (``worker-1 slots=8``; ``#`` comments)."""
    if not path:
        raise kconfig.ConfigError("several nodes need a hostfile (GRADKIT_HOSTFILE): lines like 'node-1 slots=8'")
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise kconfig.ConfigError(f"cannot read the hostfile {path}: {e}") from None
    hosts = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#")[0].strip()
        if not line:
            continue
        parts = line.split()
        slots = [p for p in parts[1:] if p.startswith("slots=")]
        if len(parts) > 2 or (len(parts) == 2 and not slots) or (slots and not slots[0][6:].isdigit()):
            raise kconfig.ConfigError(f"{path}:{n}: expected 'HOST slots=N', got {line!r}")
        hosts.append((parts[0], int(slots[0][6:]) if slots else 1))
    return hosts


def worker_module_args(job: Path) -> list[str]:
    return ["kit.worker", str(job)]


def launch_commands(world: World, job: Path, port: int) -> list[list[str]]:
    """The command line(s) that start ``world``: one per rank (local), per node (torchrun), or one (deepspeed).

    torchrun on several nodes: node 0 (this machine) runs torchrun itself, every other node of the hostfile
    is reached with ``ssh HOST cd REPO && ...`` (the repo and the job folder must be at the same path there:
    a shared filesystem). The DeepSpeed launcher reads the hostfile and reaches the nodes itself (pdsh).
    """
    py = sys.executable
    if world.launcher == "local":
        return [[py, "-m", *worker_module_args(job)] for _ in range(world.world_size)]
    if world.launcher == "deepspeed":
        cmd = [py, "-m", "deepspeed.launcher.runner", "--master_addr", world.master_addr, "--master_port", str(port)]
        if world.nnodes > 1:
            cmd += ["--hostfile", str(world.hostfile), "--num_nodes", str(world.nnodes)]
        return [cmd + ["--num_gpus", str(world.nproc_per_node), "--no_local_rank", "--module", *worker_module_args(job)]]
    cmds = []
    hosts = read_hostfile(world.hostfile)[:world.nnodes] if world.nnodes > 1 else [("localhost", world.world_size)]
    for node, (host, _) in enumerate(hosts):
        cmd = [py, "-m", "torch.distributed.run", "--nnodes", str(world.nnodes), "--nproc_per_node",
               str(world.nproc_per_node), "--node_rank", str(node), "--master_addr", world.master_addr,
               "--master_port", str(port), "-m", *worker_module_args(job)]
        if node > 0:  # the other nodes: over ssh, in the same folder, with the kit's PYTHONPATH
            cmd = ["ssh", host, f"cd {REPO_ROOT} && PYTHONPATH={REPO_ROOT} " + " ".join(cmd)]
        cmds.append(cmd)
    return cmds


def launcher_env(world: World, port: int) -> dict[str, str]:
    """The environment of a torchrun / DeepSpeed launcher: the kit's variables, ranks numbered by the launcher."""
    env = rank_env(world, 0, port)
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    if world.device == "cpu":
        env["LOCAL_SIZE"] = str(world.nproc_per_node)  # DeepSpeed's CPU accelerator counts "devices" from it
    return env


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


def elf_damage(path: Path) -> str | None:
    """Why a built ``.so`` / ``.o`` cannot be loaded (not ELF, or its tables run past the end), else None.

    A truncated shared object is mapped by the loader and then read past its end: the rank dies of SIGBUS
    (exit code -7) with no Python traceback. Checking the ELF header's own tables against the file size
    catches that before any rank starts.
    """
    import struct

    data = path.read_bytes()
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2:  # 64-bit ELF only (what torch builds here)
        return f"{path.name} is not a complete 64-bit ELF file ({len(data)} bytes)"
    end = "<" if data[5] == 1 else ">"
    phoff, shoff = struct.unpack_from(end + "QQ", data, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from(end + "HHHH", data, 0x36)
    if phoff + phentsize * phnum > len(data) or shoff + shentsize * shnum > len(data):
        return f"{path.name} is truncated ({len(data)} bytes; its headers reach past the end)"
    for i in range(phnum):  # every loadable segment must lie inside the file
        _, _, off, _, _, filesz = struct.unpack_from(end + "IIQQQQ", data, phoff + i * phentsize)
        if off + filesz > len(data):
            return f"{path.name} is truncated ({len(data)} bytes; segment {i} ends at {off + filesz})"
    return None


def repair_extensions(folder: Path) -> list[str]:
    """Remove damaged build outputs from a torch-extensions cache so the next rank rebuilds them; what was removed."""
    removed = []
    for path in sorted(folder.rglob("*")) if folder.exists() else []:
        if path.is_file() and path.suffix in (".so", ".o"):
            why = elf_damage(path)
            if why:
                path.unlink()
                removed.append(why)
    if removed:
        print(f"gradkit: removed damaged build outputs in {folder} (rebuilt at the next launch): "
              + "; ".join(removed), file=sys.stderr)
    return removed


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux; a no-op elsewhere).

    Used as ``preexec_fn`` of every process the kit starts (ranks, launchers, papermill): a kernel restart or a
    ``kill -9`` of the caller then takes its ranks with it instead of leaving them re-parented to PID 1. The
    setting survives ``exec``; ``kit.worker`` also watches its parent's pid, for the platforms without it.
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


def stop_worlds() -> int:
    """Kill the ranks of every world this process is running (an interrupted cell or explorer Run); how many."""
    live = list(_LIVE.values())
    for procs in live:
        _kill(procs)
    return len(live)


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
    A rank names itself ``gradkit-rank<R>`` (``kit.worker``); one still starting is found by its command line
    (``kit.worker``), or as a fork of a fork server, with rank -1 until it has named itself."""
    import psutil

    from kit.worker import RANK_NAME

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
            elif "kit.worker" in cmd:
                out.append((int(p.environ().get("RANK", -1)), p))
            elif "kit.forkserver" in cmd and "kit.forkserver" in " ".join(p.parent().cmdline()):
                out.append((-1, p))
        except (psutil.Error, ValueError):
            pass  # gone while being looked at
    return out


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


def run_world(target: str, payload: dict, world: World | None = None, keep_dir: str | None = None, on_partial=None,
              **kw) -> list:
    """Run ``target`` ("package.module:function") on every rank of ``world``.

    Returns the list of per-rank return values (index = rank). Raises
    ``RankFailed`` when a rank raises or exits non-zero (the first failing
    rank's traceback is attached), ``RankTimeout`` when the world outlives
    ``world.timeout_s`` (all ranks are killed first), ``ConfigError`` on bad
    input before anything starts. ``on_partial(piece)`` is called in the caller, while the world runs, with
    each piece rank 0 reports (``kit.worker.report_partial``): progress, and results kept as they come.
    """
    world = world or World(**kw)
    world.validate()
    if ":" not in target:
        raise kconfig.ConfigError(f"target must look like 'package.module:function', got {target!r}")
    warm = keep_dir is None and _warm_wanted(world)
    for attempt in range(1 + RENDEZVOUS_RETRIES):
        try:
            if warm:
                return _run_warm(target, payload, world, on_partial)
            return _run_world_once(target, payload, world, keep_dir, on_partial)
        except RankFailed as e:
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


def remove_stale_worlds() -> list[Path]:
    """Remove the world folders whose owner is gone (a caller killed with SIGKILL never ran its clean-up)."""
    import psutil

    removed = []
    for folder in Path(tempfile.gettempdir()).glob("gradkit-world-*"):
        try:
            pid, started = (folder / OWNER_FILE).read_text().split()
            alive = psutil.pid_exists(int(pid)) and abs(psutil.Process(int(pid)).create_time() - float(started)) < 1
        except (OSError, ValueError, psutil.Error):
            continue  # no owner written yet (a world starting now), or not the kit's
        if not alive:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _start_ranks(world: World, job: Path, task: dict, server: "_Server | None" = None):
    """Write the world's spec into ``job`` and start its processes: ``(procs, logs, holder)``; ``task`` is the
    spec's target and payload (a one-shot world) or ``{"serve": True, ...}`` (a warm world). With ``server`` (a
    fork server of the world's stack, ``kit.forkserver``) the ranks are forked from it, imports paid."""
    import psutil

    (job / OWNER_FILE).write_text(f"{os.getpid()} {psutil.Process().create_time()}")
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


def _run_world_once(target: str, payload: dict, world: World, keep_dir: str | None, on_partial=None) -> list:
    remove_stale_worlds()
    job = Path(keep_dir) if keep_dir else Path(tempfile.mkdtemp(prefix="gradkit-world-"))
    job.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    _LIVE[id(procs)] = procs
    holder = None
    try:
        started, logs, holder = _start_ranks(world, job, {"target": target, "payload": payload})
        procs += started
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
            holder.close()
        if keep_dir is None:
            shutil.rmtree(job, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- warm worlds
#
# A warm world keeps its ranks between calls: they joined the process group and paid their imports once
# (``kit.worker.serve``: torch._dynamo, DeepSpeed's engine), and each call writes one job for them. Used where
# the same probe is asked again and again by a person waiting (the explorer's Run); one-shot worlds stay the
# default. A warm world serves one target only (one probe): jobs of the same target are what the cases of one
# world already are, while another probe's job could inherit global state (B2's pipeline topology broke a B4 job
# that followed it in the same ranks). At most ``WARM_MAX`` are kept (the least recently used is stopped). A job
# that fails in any way takes its warm world down with it (the next call starts a fresh one); the ranks die with
# their caller (parent-death signal), on ``stop_warm_worlds()`` and after ``WARM_IDLE_S``.

WARM_IDLE_S = 600.0
WARM_MAX = 2
_WARM_FLAG = threading.local()


@dataclass
class _Warm:
    procs: list
    logs: list
    holder: object
    job: Path
    jobs: int = 0
    used: float = 0.0
    server_key: str = ""  # the fork server its ranks came from ("" none)


_WARM: dict[str, _Warm] = {}
_WARM_LOCK = threading.Lock()


@contextlib.contextmanager
def warm_worlds(keep: bool = True):
    """While the block runs (in this thread), ``run_world`` runs each local world as a job of a warm world of the
    same stack, started on first use: ``with launch.warm_worlds(): probe.run(...)``.

    ``keep=False``: the warm worlds the block started are stopped when it ends, unless an enclosing block keeps
    them (``kit.runner.run`` reuses the ranks of one stack between its own worlds, and leaves no rank behind).
    Their fork servers stay for the next run of their stack, until ``SERVER_IDLE_S`` without a rank."""
    before = getattr(_WARM_FLAG, "on", False)
    with _WARM_LOCK:
        had, had_servers = set(_WARM), set(_SERVERS)
    _WARM_FLAG.on = True
    try:
        yield
    finally:
        _WARM_FLAG.on = before
        if not keep and not before:
            with _WARM_LOCK:
                for key in set(_WARM) - had:
                    _discard(key)
                for key in set(_SERVERS) - had_servers:
                    if _SERVERS.get(key) is None:
                        _SERVERS.pop(key, None)  # could not start: the next run tries again


def _warm_wanted(world: World) -> bool:
    return getattr(_WARM_FLAG, "on", False) and world.launcher == "local" and world.nnodes == 1


def _stack_fields(world: World) -> list:
    """What a world's ranks import and how they start: the same for every world size (a fork server's key)."""
    return [world.device, world.pythonpath, world.env, world.init, world.extensions_key, world.expect,
            str(kconfig.cache_dir())]


def _warm_key(world: World, target: str) -> str:
    return json.dumps([target, world.world_size, *_stack_fields(world)], sort_keys=True, default=str)


_SPAWNER = None  # the one thread that starts warm worlds (see _start_warm)


def _start_warm(world: World) -> _Warm:
    """Started from a thread that lives as long as this process: the parent-death signal fires when the *thread*
    that started a process ends, and a warm world outlives the explorer thread that first asked for it."""
    global _SPAWNER
    from concurrent.futures import ThreadPoolExecutor

    if _SPAWNER is None:
        _SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradkit-warm-spawner")
    return _SPAWNER.submit(_start_warm_here, world).result()


def _start_warm_here(world: World) -> _Warm:
    remove_stale_worlds()
    job = Path(tempfile.mkdtemp(prefix="gradkit-world-"))
    server = _server_for(world)
    try:
        procs, logs, holder = _start_ranks(world, job, {"serve": True, "idle_s": WARM_IDLE_S}, server)
    except BaseException:
        shutil.rmtree(job, ignore_errors=True)
        raise
    forked = server is not None and any(isinstance(p, _Forked) for p in procs)
    return _Warm(procs, logs, holder, job, server_key=_server_key(world) if forked else "")


def prewarm(world: World, target: str) -> _Warm:
    """Start the warm world that serves ``target`` on ``world``'s stack now, if there is none (a person is about
    to ask for it); the least recently used one goes if ``WARM_MAX`` would be passed."""
    world.validate()
    with _WARM_LOCK:
        key = _warm_key(world, target)
        if key in _WARM and any(p.poll() is not None for p in _WARM[key].procs):
            _discard(key)
        if key not in _WARM:
            for old in sorted(_WARM, key=lambda k: _WARM[k].used)[:max(0, len(_WARM) - WARM_MAX + 1)]:
                _discard(old)
            _WARM[key] = _start_warm(world)
        _WARM[key].used = time.monotonic()
        return _WARM[key]


def _discard(key: str) -> None:
    w = _WARM.pop(key, None)
    if w is not None:
        _kill(w.procs)
        w.holder.close()
        shutil.rmtree(w.job, ignore_errors=True)
        # its server stays for the next world of its stack (leaving after SERVER_IDLE_S without a rank)


def stop_warm_worlds(servers: bool = True) -> int:
    """Kill every warm world of this process, and (``servers``) its fork servers; how many worlds there were."""
    with _WARM_LOCK:
        keys = list(_WARM)
        for key in keys:
            _discard(key)
        for key in list(_SERVERS) if servers else []:
            _stop_server(key)
    return len(keys)


# ---------------------------------------------------------------------------------------------- fork servers
#
# Inside a warm_worlds block, the ranks of a stack's warm worlds are forked from one process that imported the
# stack once (``kit.forkserver``): a probe that runs a stack at several world sizes, or groups of cases in
# several worlds, pays DeepSpeed's import once (0.18.x: ~7 s of a core per rank). CPU worlds only (a fork after
# CUDA is initialised is not safe); a server that cannot start (its stack does not import) means ranks started
# the usual way, which then say why themselves. A server outlives the run that started it, for the next run of
# its stack (a test module, a script's next probe: ~5 s of a core each); it leaves after ``SERVER_IDLE_S``
# without a rank, when ``SERVER_MAX`` others were used since, on ``stop_warm_worlds()``, and with this process
# (parent-death signal). Its ranks never outlive their run: they are the warm worlds' (above).

SERVER_MAX = 3  # servers kept at once (each holds a whole stack in memory): the least recently used goes
SERVER_IDLE_S = 60.0  # a server with no rank for this long leaves (a kernel's warm worlds idled out after WARM_IDLE_S)
NO_FORK_ENV = "GRADKIT_NO_FORK_SERVER"  # set (to anything): every rank is a process of its own, as before


class _Forked:
    """A rank forked by a fork server, read like a ``subprocess.Popen``: its exit status comes from the server."""

    def __init__(self, pid: int, exit_file: Path, server: "_Server"):
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


class _Server:
    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.lock = threading.Lock()
        self.used = time.monotonic()

    def fork(self, job: Path, env: dict, log: Path, exit_file: Path) -> _Forked:
        with self.lock:
            self.proc.stdin.write(json.dumps({"job": str(job), "env": env, "log": str(log), "exit_file": str(exit_file)}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        return _Forked(int(json.loads(line)["pid"]), exit_file, self)


_SERVERS: dict[str, "_Server | None"] = {}  # None: this stack's server could not start; its ranks start as before


def _server_key(world: World) -> str:
    return json.dumps(_stack_fields(world), sort_keys=True, default=str)


def _server_for(world: World) -> "_Server | None":
    """The fork server of ``world``'s stack, started now if there is none (from the spawner thread)."""
    if world.device != "cpu" or world.launcher != "local" or world.nnodes != 1 or os.environ.get(NO_FORK_ENV):
        return None
    key = _server_key(world)
    server = _SERVERS.get(key, False)
    if server is False or (server is not None and server.proc.poll() is not None):
        busy = {w.server_key for w in _WARM.values()}
        idle = sorted((k for k, s in _SERVERS.items() if s is not None and k != key and k not in busy),
                      key=lambda k: _SERVERS[k].used)
        for old in idle[:max(0, sum(s is not None for s in _SERVERS.values()) + 1 - SERVER_MAX)]:
            _stop_server(old)
        _SERVERS[key] = server = _start_server(world)
    if server is not None:
        server.used = time.monotonic()
    return server


def _start_server(world: World) -> "_Server | None":
    import select

    env = rank_env(world, 0, 0)
    proc = subprocess.Popen([sys.executable, "-m", "kit.forkserver"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env=env, cwd=str(REPO_ROOT), text=True,
                            preexec_fn=_session_dying_with_parent)
    proc.stdin.write(json.dumps({"pythonpath": [*world.pythonpath, str(REPO_ROOT)], "expect": world.expect,
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
        return _Server(proc)
    _kill([proc])
    return None


def _stop_server(key: str) -> None:
    server = _SERVERS.pop(key, None)
    if server is not None:
        _kill([server.proc])  # its ranks die with it (parent-death signal)
        for f in (server.proc.stdin, server.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


atexit.register(stop_warm_worlds)


def _run_warm(target: str, payload: dict, world: World, on_partial=None) -> list:
    w = prewarm(world, target)
    key = _warm_key(world, target)
    w.jobs += 1
    folder = w.job / f"job-{w.jobs}"
    folder.mkdir()
    tmp = folder / "spec.json.tmp"
    tmp.write_text(json.dumps({"target": target, "payload": payload}))
    os.replace(tmp, folder / "spec.json")  # the ranks see the job whole or not at all
    _LIVE[id(w.procs)] = w.procs
    ok = False
    try:
        try:
            _wait(w.procs, world, folder, w.logs, on_partial, serving=True, started_in=w.job)
        except LaunchError as e:
            e.partial = _partials(folder, world.world_size)
            raise
        results = [json.loads((folder / f"rank{r}.json").read_text())["result"] for r in range(world.world_size)]
        ok = True
        return results
    finally:
        _LIVE.pop(id(w.procs), None)
        if ok:
            shutil.rmtree(folder, ignore_errors=True)
        else:
            with _WARM_LOCK:
                if _WARM.get(key) is w:
                    _discard(key)


def _complete(path: Path) -> bool:
    """A rank's result file that is whole (the worker renames it into place; a foreign writer may not)."""
    return _read_whole(path) is not None


class _PartialReader:
    """Hands each complete line rank 0 appended to its partial file to ``on_partial``, once."""

    def __init__(self, path: Path, on_partial):
        self.path, self.on_partial, self.offset = path, on_partial, 0

    def __call__(self) -> None:
        if self.on_partial is None or not self.path.exists():
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        done = data.rfind(b"\n") + 1  # a line still being written waits for the next poll
        self.offset += done
        for line in data[:done].decode().splitlines():
            if line.strip():
                self.on_partial(json.loads(line))


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


def _partials(job: Path, world_size: int) -> dict:
    out = {}
    for r in range(world_size):
        path = job / f"rank{r}.partial.jsonl"
        if path.exists():
            out[r] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return out


def how_it_ended(code: int) -> str:
    """'killed by signal 9 (SIGKILL)' / 'exited with code 1'."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        return f"killed by signal {-code} ({name})"
    return f"exited with code {code}"


def _read_whole(path: Path) -> dict | None:
    """A rank's record (result or error), or None when it cannot be read: missing, or half-written (a rank
    killed mid-write by an older kit, or a foreign writer)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _failure(bad: list[int], codes: list, job: Path, logs: list[Path], by_exit: bool = True,
             started_in: Path | None = None) -> RankFailed:
    """The rank to blame: the first to go (``bad`` is in exit order). Its own exception if it raised one;
    else how it died (a signal, an exit code) and its last output. The others' errors come after, as context:
    when one rank dies, its peers fail a moment later in their collectives. Under torchrun or the DeepSpeed
    launcher (``by_exit=False``) the kit sees launchers, not ranks: the first rank to raise is blamed."""
    tails = {r: _tail(logs[r]) for r in range(len(logs))}
    found = [*(started_in.glob("rank*.error.json") if started_in else []), *job.glob("rank*.error.json")]
    errors = {e["rank"]: e for e in map(_read_whole, found) if e}
    first = bad[0]
    if errors and (not by_exit or all(codes[r] >= 0 for r in bad)):
        first = min(errors.values(), key=lambda x: x["time"])["rank"]  # every rank exited itself: the first raise
    if not by_exit:
        bad = [first]
    later = [f"rank {r} {how_it_ended(codes[r])}" + (f" after {errors[r]['type']}: {errors[r]['message'][:200]}"
                                                     if r in errors else "") for r in bad if r != first]
    context = ("\nThen: " + "; ".join(later)) if later else ""
    if first in errors:
        e = errors[first]
        return RankFailed(f"rank {first} raised {e['type']}: {e['message']}{context}\n--- traceback of rank {first} ---\n"
                          f"{e['traceback']}", rank=first, traceback=e["traceback"], logs=tails)
    return RankFailed(f"rank {first} died: {how_it_ended(codes[first])}, without a Python traceback{context}\n"
                      f"--- last output of rank {first} ---\n{tails[first][-1500:]}", rank=first, logs=tails)


if __name__ == "__main__":
    kconfig.run_cli(main)
