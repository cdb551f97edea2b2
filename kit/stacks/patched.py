"""A release with one of the kit's patches applied, as an overlay of its own: ``deepspeed 0.19.8+b10`` is 0.19.8's
overlay with ``kit/stacks/patches/deepspeed/b10.diff`` applied by ``patch -p1``, its version written as
``0.19.8+b10`` (a PEP 440 local label), so its ranks, records and tables name it as the patched release. The patch
of a known bug (``gradkit report --known``) is judged on it by the same oracle as the release itself.

    patched.split("0.19.8+b10")      # ("0.19.8", "b10"): a release and a patch the kit holds; ("0.19.8", None) else
    patched.build("deepspeed", "0.19.8+b10", base_root, target)   # the folder, patched, its version said
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

from gradkit import config as kconfig

PATCHES = Path(__file__).resolve().parent / "patches"
VERSION_FILES = {"deepspeed": "deepspeed/git_version_info_installed.py"}  # where an overlay's version is written


def patch_file(package: str, name: str) -> Path:
    return PATCHES / package / f"{name}.diff"


def digest(package: str, name: str) -> str:
    """The patch's sha256: an overlay built from it, or a record measured on it, is the patch's as it is now only
    where this matches."""
    return hashlib.sha256(patch_file(package, name).read_bytes()).hexdigest()


def split(version: str, package: str = "deepspeed") -> tuple[str, str | None]:
    """``(release, patch)`` of a version the kit may build: ``0.19.8+b10`` names the patch ``b10`` where the kit holds
    ``patches/<package>/b10.diff`` (else the local label is the release's own: no patch)."""
    base, _, local = version.partition("+")
    return (base, local) if local and patch_file(package, local).exists() else (version, None)


def build(package: str, version: str, base_root: Path, target: Path) -> Path:
    """A folder holding the release's package (``base_root / <module>``: an overlay's, or the installed one's) with
    the patch applied and the version rewritten, built beside ``target`` for the caller to move in whole (it holds
    the folder's lock). A patch that does not apply is refused with ``patch``'s own lines: it was written for
    another release."""
    release, name = split(version, package)
    if name is None:
        raise kconfig.ConfigError(f"{package} {version}: the kit holds no patch {version.partition('+')[2]!r} "
                                  f"(patches: {', '.join(sorted(p.stem for p in (PATCHES / package).glob('*.diff')))})")
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    module = package.replace("-", "_")
    shutil.copytree(base_root / module, tmp / module, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    diff = str(patch_file(package, name))
    if shutil.which("patch"):
        out = subprocess.run(["patch", "-p1", "--batch", "--forward", "-d", str(tmp), "-i", diff], capture_output=True,
                             text=True)
    else:  # git's own applier where GNU patch is absent; kept from finding a repository above the folder
        out = subprocess.run(["git", "apply", "-p1", diff], cwd=tmp, capture_output=True, text=True,
                             env={**os.environ, "GIT_CEILING_DIRECTORIES": str(tmp.parent)})
    if out.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise kconfig.ConfigError(f"the patch {name} does not apply to {package} {release}: "
                                  f"{(out.stdout + out.stderr).strip()[-600:]}")
    stamp = tmp / VERSION_FILES[package]
    stamp.write_text(re.sub(r"version='[^']*'", f"version='{version}'", stamp.read_text(), count=1))
    return tmp
