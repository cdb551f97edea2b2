"""The world spec and the commands that start it: ``World``, the errors a launch raises, and each rank's or
launcher's command line and environment (``python -m gradkit.launch --dry-run`` prints them). Also the torch-extensions
cache's check for damaged build outputs, run before any rank starts."""
from __future__ import annotations

import os
import shlex
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from gradkit import config as kconfig
from gradkit.stacks import versions

REPO_ROOT = kconfig.REPO_ROOT
LAUNCHERS = kconfig.LAUNCHERS
RANK_NAME = "gradkit-rank"  # a rank's process name (what ps -e and psutil's name() show): gradkit-rank<R>


class LaunchError(RuntimeError):
    """The world did not produce a result for every rank."""

    def __init__(self, message: str, rank: int | None = None, traceback: str = "", logs: dict | None = None,
                 partial: dict | None = None):
        super().__init__(message)
        self.rank = rank
        self.traceback = traceback
        self.logs = logs or {}
        self.partial = partial or {}  # rank -> the pieces it reported with gradkit.launch.worker.report_partial


class RankFailed(LaunchError):
    """A rank raised (its traceback is in ``.traceback``) or died."""


class RankTimeout(LaunchError):
    """The world ran past its timeout; every rank was killed."""


class WorldStopped(LaunchError):
    """``stop_worlds`` ran while this world was starting or running (the user's Stop or Interrupt): its ranks were
    killed, whenever they came up. Never a failed world to record or launch again: the caller stops too."""


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
    # {package: {"version", "root"}} every rank checks (gradkit.launch.worker)
    expect: dict = field(default_factory=dict)
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
    """``python -m gradkit.launch --dry-run``: print the command lines a world would be started with."""
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


def installed_key() -> str:
    """The torch-extensions cache folder of the installed DeepSpeed (a world that names no ``extensions_key``)."""
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
    return ["gradkit.launch.worker", str(job)]


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
        if node > 0:  # the other nodes: over ssh, in the job's folder (the same interpreter imports gradkit there)
            cmd = ["ssh", host, f"cd {job} && " + " ".join(cmd)]
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
        "TORCH_EXTENSIONS_DIR": str(kconfig.cache_dir() / "torch_extensions" / (world.extensions_key or installed_key())),
    })
    if world.device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
        # DeepSpeed's CPU accelerator counts its "devices" from LOCAL_SIZE (as its own launcher sets it); without it
        # every device_count() forks `numactl --hardware`, four times per engine
        env.setdefault("LOCAL_SIZE", str(world.world_size))
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env["CUDA_VISIBLE_DEVICES"] = ""
    paths = [*world.pythonpath, env.get("PYTHONPATH", "")]  # gradkit itself: installed in this interpreter
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
