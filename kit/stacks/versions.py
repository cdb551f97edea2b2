"""Other DeepSpeed / transformers / accelerate versions, side by side, without touching the base environment.

A version is an *overlay*: ``pip install --no-deps --target <cache>/overlays/<pkg>-<ver>``
put first on the ``PYTHONPATH`` of a launched world. The base environment's
torch is reused (DeepSpeed is built against it with ``--no-build-isolation``
and ``DS_BUILD_OPS=0``, so only pure-Python code lands in the overlay; ops are
JIT-built at run time into a per-version extensions cache).

Outcomes, and what they mean for a verdict:
- the release does not exist on the index -> ``UnknownVersion`` (bad input, raised before any launch);
- it exists but does not install or build here -> ``CannotRun`` (verdict ``cannot-run``, never ``not-affected``).

Releases are ordered by ``version_key`` ('0.19.10' after '0.19.9'), wherever the kit sorts or compares them.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from gradkit import config as kconfig
from gradkit.stacks import patched

PACKAGES = ("deepspeed", "transformers", "accelerate")
# Libraries a transformers release pins and checks at import time; an overlay of an older transformers
# gets a companion overlay of each whose installed version falls outside that release's range.
COMPANIONS = ("tokenizers", "huggingface-hub", "safetensors")
# transformers releases that import only beside an older accelerate on this torch: (first release that does not
# need it, the accelerate release it needs). transformers 4.45 - 4.46 run with accelerate 1.0.1 here.
ACCELERATE_FOR = (("4.47.0", "1.0.1"),)


def accelerate_for(transformers: str) -> str | None:
    """The accelerate release an older ``transformers`` release needs beside it here (None: the installed one)."""
    for below, accelerate in ACCELERATE_FOR:
        if version_key(transformers) < version_key(below):
            return accelerate
    return None
INSTALL_TIMEOUT_S = 900
MANIFEST = ".manifest.json"  # {relative path: [size, sha256]} of every file an overlay install wrote
_NOT_ON_INDEX = ("No matching distribution found", "Could not find a version that satisfies")


class UnknownVersion(kconfig.ConfigError):
    """The package index has no such release."""


class CannotRun(RuntimeError):
    """This version cannot be run here, for a reason unrelated to the bug under test."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def version_key(v: str) -> tuple:
    """'0.19.3' -> (0, 19, 3); a local tag or suffix ('0.19.8+cpu', '1.2rc1') does not count."""
    out = []
    for part in v.split("+")[0].split("."):
        digits = re.match(r"\d+", part)  # the leading number: '2rc1' is 2, not 21
        out.append(int(digits.group(0)) if digits else 0)
    return tuple(out)


def installed_version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def overlay_root() -> Path:
    d = kconfig.cache_dir() / "overlays"
    d.mkdir(parents=True, exist_ok=True)
    return d


def manifest(root: Path) -> dict[str, list]:
    """``{relative path: [size, sha256]}`` of every file under ``root`` (the kit's own marker files aside)."""
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.name not in (".complete", MANIFEST):
            data = path.read_bytes()
            out[str(path.relative_to(root))] = [len(data), hashlib.sha256(data).hexdigest()]
    return out


def overlay_damage(root: Path) -> list[str]:
    """What is wrong with an installed overlay, against the manifest written at install (empty: intact)."""
    try:
        want = json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError):
        return [f"{root.name} has no readable {MANIFEST} (installed by an older kit, or damaged)"]
    have = manifest(root)
    missing = sorted(set(want) - set(have))
    changed = sorted(k for k in set(want) & set(have) if want[k] != have[k])
    return [f"missing: {k}" for k in missing] + [f"changed: {k}" for k in changed]


def ensure_overlay(package: str, version: str) -> Path:
    """Install ``package==version`` into its overlay folder once, verified by its manifest; return the folder.

    An overlay whose files no longer match the manifest written at install (a file deleted or truncated) is
    reinstalled, with a warning on stderr: a damaged overlay would let the ranks import another release.
    """
    if package not in PACKAGES + COMPANIONS:
        raise kconfig.ConfigError(f"overlays exist for {PACKAGES}, not {package!r}")
    kconfig.check_version(version)
    target = overlay_root() / f"{package}-{version}"
    lock = overlay_root() / f".{package}-{version}.lock"
    release, patch = patched.split(version, package)
    if patch:  # one of the kit's patches on a release: that release's package, patched, in a folder of its own
        return ensure_patched(package, version, release, target, lock)
    try:
        return ensure_folder(target, [f"{package}=={version}"], lock)
    except UnknownVersion:
        lock.unlink(missing_ok=True)  # nothing left behind
        raise


def ensure_patched(package: str, version: str, release: str, target: Path, lock: Path) -> Path:
    """``target`` holding ``release`` with the kit's patch of ``version`` applied (``gradkit.stacks.patched``), built
    once under ``lock``, its manifest written and checked as an installed overlay's; rebuilt where the patch changed
    since (its digest is written in ``.complete``)."""
    name = version.partition("+")[2]
    stamp = f"{release} + {name}.diff sha256 {patched.digest(package, name)}"

    def built() -> bool:
        done = target / ".complete"
        return done.exists() and done.read_text() == stamp and not overlay_damage(target)

    if built():
        return target
    base = (Path(importlib.util.find_spec(module_name(package)).submodule_search_locations[0]).parent
            if release == installed_version(package) else ensure_overlay(package, release))
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if built():
            return target
        tmp = patched.build(package, version, base, target)
        (tmp / MANIFEST).write_text(json.dumps(manifest(tmp)))
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
        (target / ".complete").write_text(stamp)
    return target


def ensure_folder(target: Path, requirements: list[str], lock: Path) -> Path:
    """``target`` holding ``requirements`` (``install``), once, under the file lock ``lock`` (two notebooks or jobs
    asking at once build it once), verified by its manifest: a damaged folder is reinstalled with a warning."""
    if (target / ".complete").exists() and not overlay_damage(target):
        return target
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if (target / ".complete").exists():
            damage = overlay_damage(target)
            if not damage:
                return target
            print(f"gradkit: the overlay {target} is damaged ({len(damage)} file(s): {', '.join(damage[:3])}); "
                  f"reinstalling {' '.join(requirements)}", file=sys.stderr)
            (target / ".complete").unlink()
        return install(target, requirements)


def install(target: Path, requirements: list[str]) -> Path:
    """``pip install --no-deps --target`` of pinned ``requirements`` into a fresh ``target`` (built beside it and
    moved in whole, its manifest written, ``.complete`` last); the caller holds the folder's lock."""
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    # pip compiles the bytecode once, here: a process that imports the overlay then reads it instead of compiling
    # every module again (where PYTHONDONTWRITEBYTECODE is set, as on CI's machines, nothing else ever writes it)
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
           "--target", str(tmp), *requirements]
    env = dict(os.environ, DS_BUILD_OPS="0", PIP_DISABLE_PIP_VERSION_CHECK="1")
    said = " ".join(requirements)
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CannotRun(f"installing {said} took more than {INSTALL_TIMEOUT_S} s")
    if out.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        text = (out.stdout + out.stderr)[-2000:]
        if any(s in text for s in _NOT_ON_INDEX):
            raise UnknownVersion(f"{said} is not a release on the package index")
        raise CannotRun(f"{said} did not install here: {text.strip()[-800:]}")
    (tmp / MANIFEST).write_text(json.dumps(manifest(tmp)))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    (target / ".complete").write_text(" ".join(requirements))
    return target


@dataclass
class Stack:
    """The package versions one world runs with, and how to put them on its path."""

    versions: dict[str, str]  # package -> version the world must import
    pythonpath: list[str] = field(default_factory=list)
    roots: dict[str, str] = field(default_factory=dict)  # package -> the folder it must be imported from

    @property
    def expect(self) -> dict[str, dict]:
        """What every rank checks before it runs (``gradkit.launch.worker.check_stack``): version and folder per
        package."""
        return {p: {"version": v, "root": self.roots.get(p)} for p, v in self.versions.items() if v != "absent"}

    @property
    def label(self) -> str:
        return " ".join(f"{p}={v}" for p, v in self.versions.items())

    @property
    def extensions_key(self) -> str:
        """The folder of this stack's JIT-built ops in the kit's cache: per DeepSpeed source tree (a release, or a
        release the kit patched) and build environment. A patched release has a folder of its own although no kit
        patch touches an op's source: torch keys a build by its arguments, which name the sources' folder, so a
        patched overlay and its release sharing a folder rebuilt the op at every switch between them (about 55 s
        of a core each time; six builds in one warm run of the suite)."""
        return f"deepspeed-{self.versions.get('deepspeed', 'absent')}-{build_environment()}"


def build_environment() -> str:
    """What a JIT-built op is compiled against besides DeepSpeed's sources, as a short digest: this Python
    environment (its prefix holds torch's headers and libraries, and the build file names their paths) and torch's
    release. Two environments sharing the kit's cache (two clones, two venvs) must not share a build folder: torch
    rewrites the folder's build file for whichever loads the op, so each switch rebuilt it (about a minute, every
    rank of that release waiting on the build lock) and left the other's ranks loading a library being rewritten."""
    text = f"{sys.prefix}|{installed_version('torch')}|{sys.version_info.major}.{sys.version_info.minor}"
    return hashlib.sha1(text.encode()).hexdigest()[:8]


def companion_requirements(transformers_root: Path) -> dict[str, str]:
    """``{package: specifier}`` that this transformers overlay checks at import, for the ``COMPANIONS``."""
    import ast

    table = transformers_root / "transformers" / "dependency_versions_table.py"
    deps = ast.literal_eval(table.read_text().split("=", 1)[1].strip()) if table.exists() else {}
    return {pkg: deps[pkg][len(pkg):] for pkg in COMPANIONS if pkg in deps}


def newest_matching(package: str, specifier: str) -> str:
    """The newest release of ``package`` on the index that satisfies ``specifier`` (e.g. ">=0.22.0,<=0.23.0")."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", package], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"))
    line = next((l for l in out.stdout.splitlines() if l.startswith("Available versions:")), "")
    spec = SpecifierSet(specifier)
    ok = [v for v in (x.strip() for x in line.split(":", 1)[-1].split(",")) if v and Version(v) in spec]
    if not ok:
        raise CannotRun(f"no release of {package} on the index satisfies {specifier}")
    return max(ok, key=Version)


def _companions(transformers_root: Path) -> tuple[dict[str, str], list[str]]:
    from packaging.specifiers import SpecifierSet

    versions, path = {}, []
    for package, spec in companion_requirements(transformers_root).items():
        have = installed_version(package)
        if have != "absent" and have in SpecifierSet(spec):
            continue
        version = newest_matching(package, spec)
        path.append(str(ensure_overlay(package, version)))
        versions[package] = version
    return versions, path


def module_name(package: str) -> str:
    """The import name of a distribution ("huggingface-hub" -> "huggingface_hub")."""
    return package.replace("-", "_")


def resolve_stack(wanted: dict[str, str] | None = None, packages=PACKAGES) -> Stack:
    """Turn ``{"deepspeed": "0.18.9"}`` (the other ``packages``: installed) into a ready ``Stack``.

    ``packages`` are what the probe's stack names: only those are put in the stack, so only those are
    imported and checked by its ranks (``"torch"`` is always the installed one: the kit has no torch overlays).

    An older transformers also gets companion overlays (``COMPANIONS``) where the installed
    tokenizers / huggingface-hub / safetensors fall outside the ranges it checks at import.
    Raises ``UnknownVersion`` / ``ConfigError`` for bad input and ``CannotRun``
    when an existing release does not install here.
    """
    wanted = dict(wanted or {})
    torch_now = installed_version("torch")
    if wanted.get("torch", kconfig.INSTALLED) not in (kconfig.INSTALLED, torch_now, torch_now.split("+")[0]):
        raise kconfig.ConfigError(f"torch {wanted['torch']} was asked for: the kit runs the installed torch "
                                  f"({torch_now}) only (other releases are multi-GB downloads)")
    wanted.pop("torch", None)
    for package, version in wanted.items():
        if package not in PACKAGES:
            raise kconfig.ConfigError(f"overlays exist for {PACKAGES}, not {package!r}")
        if package not in packages:
            raise kconfig.ConfigError(f"this probe's stack names {list(packages)}, not {package!r}")
        kconfig.check_version(version)
    versions, path, roots = {}, [], {}
    if "torch" in packages:
        versions["torch"] = torch_now
    for package in (p for p in PACKAGES if p in packages):
        version = wanted.get(package, kconfig.INSTALLED)
        base = installed_version(package)
        if version in (kconfig.INSTALLED, base):
            versions[package] = base
            spec = importlib.util.find_spec(package) if base != "absent" else None
            if spec is not None and spec.submodule_search_locations:
                roots[package] = str(Path(list(spec.submodule_search_locations)[0]).parent)
        else:
            root = ensure_overlay(package, version)
            path.append(str(root))
            versions[package] = version
            roots[package] = str(root)
            if package == "transformers":
                extra, extra_path = _companions(root)
                versions.update(extra)
                path += extra_path
                roots.update(zip(extra, extra_path))
    return Stack(versions=versions, pythonpath=path, roots=roots)
