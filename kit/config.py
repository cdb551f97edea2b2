"""Knobs, their limits, and the one error type for bad input.

Every check here runs before anything is launched, so bad input costs
milliseconds and says what is wrong, never a hang or a silent "ok".
"""
from __future__ import annotations

import os
import re
from pathlib import Path

DEFAULT_TIMEOUT_S = 120.0
MAX_TIMEOUT_S = 3600.0
DEVICES = ("cpu", "cuda")
DTYPES = ("fp32", "bf16")
ZERO_STAGES = (0, 1, 2, 3)
MAX_GA = 64
# CPU ranks of the kit's tiny models mostly wait on each other in collectives,
# so two ranks per core still finish in seconds; beyond that gloo timeouts
# become likely on a loaded machine.
RANKS_PER_CORE = 4  # ranks of a CPU world per core: 8 on 2 cores (a run of 8 GPUs checked at its own size)
# a release number as package indexes write them (PEP 440's common forms): 0.18.9, 1.2, 0.19.0rc1, 0.19.8+cpu
VERSION_RE = re.compile(r"\d+\.\d+(\.\d+)?((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?(\+[a-z0-9.]+)?")
INSTALLED = "installed"  # the version string that means "whatever the base environment has"


class ConfigError(ValueError):
    """Bad input: a knob out of range, an unknown name, an impossible world."""


REPO_ROOT = Path(__file__).resolve().parent.parent


def repo_path(path) -> Path:
    """A path as the kit means it: relative ones against the repository root, whatever the working directory
    (JupyterLab starts kernels in notebooks/, papermill and the command line in the root)."""
    path = Path(path).expanduser()
    return path if path.is_absolute() else REPO_ROOT / path


def cache_dir() -> Path:
    """Where overlays and JIT-built ops live between runs (``GRADKIT_CACHE`` overrides); checked writable."""
    d = Path(os.environ.get("GRADKIT_CACHE") or Path.home() / ".cache" / "gradkit").expanduser()
    try:
        d.mkdir(parents=True, exist_ok=True)
        if not os.access(d, os.W_OK | os.X_OK):
            raise PermissionError(13, "not writable")
    except OSError as e:
        why = "is a file, not a folder" if d.exists() and not d.is_dir() else (e.strerror or str(e))
        raise ConfigError(f"GRADKIT_CACHE={d} cannot hold the kit's cache: it {why}" if "GRADKIT_CACHE" in os.environ
                          else f"the kit's cache {d} cannot be used: {why}; set GRADKIT_CACHE to a writable folder") from None
    return d


LAUNCHERS = ("local", "torchrun", "deepspeed")  # how a world's ranks are started (``gradkit.launch.World.launcher``)
ENVIRONMENT = ("GRADKIT_CACHE", "GRADKIT_LAUNCHER", "GRADKIT_NNODES", "GRADKIT_HOSTFILE", "GRADKIT_MASTER_ADDR",
               "GRADKIT_SYNC_TIMEOUT_S", "GRADKIT_RUN_ID", "GRADKIT_PROGRESS", "GRADKIT_NO_FORK_SERVER",
               "GRADKIT_WARM_JOBS")


def check_environment() -> None:
    """Every ``GRADKIT_*`` variable, checked before anything starts; ``ConfigError`` names the variable."""
    # set by the kit itself (a rank's partial results), and by tests (a fault planted in the watch, kit/watch/guard.py)
    known = set(ENVIRONMENT) | {"GRADKIT_PARTIAL", "GRADKIT_WATCH_FAULT"}
    unknown = sorted(k for k in os.environ if k.startswith("GRADKIT_") and k not in known)
    if unknown:
        raise ConfigError(f"unknown variable(s) {unknown}; the kit reads {list(ENVIRONMENT)}")
    cache_dir()
    launcher = os.environ.get("GRADKIT_LAUNCHER", "local")
    if launcher not in LAUNCHERS:
        raise ConfigError(f"GRADKIT_LAUNCHER={launcher!r}: use {', '.join(map(repr, LAUNCHERS[:-1]))} or {LAUNCHERS[-1]!r}")
    nnodes_setting()
    hostfile = os.environ.get("GRADKIT_HOSTFILE")
    if hostfile and not Path(hostfile).is_file():
        raise ConfigError(f"GRADKIT_HOSTFILE={hostfile}: no such file")
    sync = os.environ.get("GRADKIT_SYNC_TIMEOUT_S")
    if sync is not None:
        try:
            ok = 0 < float(sync) <= MAX_TIMEOUT_S
        except ValueError:
            ok = False
        if not ok:
            raise ConfigError(f"GRADKIT_SYNC_TIMEOUT_S={sync!r}: give seconds in (0, {MAX_TIMEOUT_S:g}]")


def nnodes() -> int:
    """Nodes a world spans (``GRADKIT_NNODES``, with ``GRADKIT_LAUNCHER`` torchrun or deepspeed); 1 by default."""
    return 1 if os.environ.get("GRADKIT_LAUNCHER", "local") == "local" else nnodes_setting()


def nnodes_setting() -> int:
    """``GRADKIT_NNODES`` as set (1 when unset), checked."""
    try:
        n = int(os.environ.get("GRADKIT_NNODES", "1"))
    except ValueError:
        raise ConfigError(f"GRADKIT_NNODES must be an integer, got {os.environ['GRADKIT_NNODES']!r}") from None
    if n < 1:
        raise ConfigError(f"GRADKIT_NNODES must be >= 1, got {n}")
    return n


def max_world_size(device: str) -> int:
    """Ranks this machine can run, times the nodes when a multi-node launcher is configured."""
    if device == "cuda":
        import torch
        per_node = torch.cuda.device_count() if torch.cuda.is_available() else 0
    else:
        per_node = RANKS_PER_CORE * (os.cpu_count() or 1)
    return per_node * nnodes()


def check_device(device: str) -> None:
    if device not in DEVICES:
        raise ConfigError(f"device must be one of {DEVICES}, got {device!r}")
    if device == "cuda" and max_world_size("cuda") == 0:
        raise ConfigError("device='cuda' asked for, but torch sees no CUDA device here; use device='cpu'")


def check_world_size(world_size, device: str = "cpu") -> None:
    check_positive_int("world_size", world_size)
    if device in DEVICES:
        limit = max_world_size(device)
        if world_size > limit:
            why = (f"{os.cpu_count()} CPU cores x {RANKS_PER_CORE} ranks per core" if device == "cpu"
                   else f"{limit // nnodes()} visible GPUs") + (f" x {nnodes()} nodes" if nnodes() > 1 else "")
            raise ConfigError(f"world_size={world_size} is more than this machine can run on {device} "
                              f"(at most {limit}: {why})")


def check_positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")


def check_list(name: str, values) -> None:
    """A notebook's list parameter: present, non-empty, and not a string (papermill -p passes lists as strings)."""
    if not values or isinstance(values, (str, dict)):
        raise ConfigError(f"{name} must be a non-empty list, got {values!r}")


def check_ga(ga) -> None:
    if not isinstance(ga, int) or isinstance(ga, bool) or not 1 <= ga <= MAX_GA:
        raise ConfigError(f"gradient accumulation steps must be an integer in 1..{MAX_GA}, got {ga!r}")


def check_zero_stage(stage) -> None:
    if stage not in ZERO_STAGES or isinstance(stage, bool):
        raise ConfigError(f"unknown ZeRO stage {stage!r}; DeepSpeed has stages {ZERO_STAGES}")


def check_dtype(dtype) -> None:
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {DTYPES}, got {dtype!r}")


def check_timeout(timeout_s) -> None:
    if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise ConfigError(f"timeout must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], got {timeout_s!r}")


AUTO = "auto"
FRONTEND_ENV = "JPY_SESSION_NAME"  # jupyter_server sets it for the kernels of the notebooks it opens, papermill does not


def interactive(value=AUTO) -> bool:
    """A notebook's ``INTERACTIVE``: True / False as given; "auto" (the stored default, so that nobody edits and
    autosaves a tracked notebook to get widgets) is True in a JupyterLab or Notebook session, False under
    papermill or nbconvert. ``gradkit.notebooks.runall`` passes False and keeps the variable out of its kernels."""
    if isinstance(value, bool):
        return value
    if value != AUTO:
        raise ConfigError(f"INTERACTIVE must be True, False or {AUTO!r}, got {value!r}")
    return bool(os.environ.get(FRONTEND_ENV))


def in_kernel() -> bool:
    """This process is a Jupyter kernel (JupyterLab's, or papermill's under run-all)."""
    import sys

    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return type(shell).__name__ == "ZMQInteractiveShell"


def check_version(version) -> None:
    if version == INSTALLED:
        return
    if not isinstance(version, str) or not VERSION_RE.fullmatch(version):
        raise ConfigError(f"a version must be {INSTALLED!r} or a release number like '0.18.9', got {version!r}")


class Parser(__import__("argparse").ArgumentParser):
    """An argument parser whose errors are bad input like any other: ``ConfigError``, one sentence, exit 2."""

    def error(self, message):
        raise ConfigError(message)


def run_cli(main) -> None:
    """Exit with ``main()``'s status; bad input (``ConfigError``) is one line on stderr and status 2."""
    import sys

    try:
        sys.exit(main())
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
