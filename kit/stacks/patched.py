"""A release with one of the kit's patches applied, as an overlay of its own: ``deepspeed 0.19.8+b10`` is 0.19.8's
overlay with ``kit/stacks/patches/deepspeed/b10.diff`` applied by ``patch -p1``, its version written as
``0.19.8+b10`` (a PEP 440 local label), so its ranks, records and tables name it as the patched release. The patch
of a known bug (``gradkit report --known``) is judged on it by the same oracle as the release itself.

    patched.split("0.19.8+b10")      # ("0.19.8", "b10"): a release and a patch the kit holds; ("0.19.8", None) else
    patched.build("deepspeed", "0.19.8+b10", base_root, target)   # the folder, patched, its version said

Several patches, applied in the label's order, are one label joined by dots (``0.19.8+b9.b10``: B10's patch on top of
B9's, where B9 hides B10).
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
    """The patch's sha256 (of several, ``b9.b10``: of their diffs in that order): an overlay built from it, or a
    record measured on it, is the patch's as it is now only where this matches."""
    return hashlib.sha256(b"".join(patch_file(package, part).read_bytes() for part in name.split("."))).hexdigest()


def split(version: str, package: str = "deepspeed") -> tuple[str, str | None]:
    """``(release, patch)`` of a version the kit may build: ``0.19.8+b10`` names the patch ``b10`` where the kit holds
    ``patches/<package>/b10.diff``, ``0.19.8+b9.b10`` both (else the local label is the release's own: no patch)."""
    base, _, local = version.partition("+")
    ok = local and all(part and patch_file(package, part).exists() for part in local.split("."))
    return (base, local) if ok else (version, None)


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
    for part in name.split("."):  # in the label's order
        out = apply(tmp, patch_file(package, part))
        if out.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise kconfig.ConfigError(f"the patch {part} does not apply to {package} {release}"
                                      f"{'' if part == name else f' (with {name})'}: "
                                      f"{(out.stdout + out.stderr).strip()[-600:]}")
    stamp = tmp / VERSION_FILES[package]
    stamp.write_text(re.sub(r"version='[^']*'", f"version='{version}'", stamp.read_text(), count=1))
    return tmp


def apply(folder: Path, diff: Path) -> subprocess.CompletedProcess:
    if shutil.which("patch"):
        return subprocess.run(["patch", "-p1", "--batch", "--forward", "-d", str(folder), "-i", str(diff)],
                              capture_output=True, text=True)
    # git's own applier where GNU patch is absent; kept from finding a repository above the folder
    return subprocess.run(["git", "apply", "-p1", str(diff)], cwd=folder, capture_output=True, text=True,
                          env={**os.environ, "GIT_CEILING_DIRECTORIES": str(folder.parent)})
