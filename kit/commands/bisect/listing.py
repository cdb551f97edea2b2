"""The releases a bisect goes through: every final release of a package on the package index (cached for a day;
offline, what the kit's cache holds), the slice ``--from`` .. ``--to`` or the ``--releases`` asked for, in order,
and the world stack that runs one of them (``stack_of``)."""
from __future__ import annotations

import json
import subprocess
import sys
import time

from gradkit import config as kconfig
from gradkit.stacks import versions
from gradkit.stacks.versions import version_key

PACKAGE = "deepspeed"
INDEX_MAX_AGE_S = 24 * 3600


def stack_of(release: str, package: str = PACKAGE) -> dict:
    """The world stack that runs ``release`` of ``package``: ``{}`` for the installed release, else its overlay (an
    older transformers with the accelerate it needs here: ``versions.accelerate_for``)."""
    if release == versions.installed_version(package).split("+")[0]:
        return {}
    companion = versions.accelerate_for(release) if package == "transformers" else None
    return {package: release, **({"accelerate": companion} if companion else {})}


def _final(v: str) -> bool:
    return all(part.isdigit() for part in v.split("."))


def index_releases(package: str = PACKAGE) -> tuple[list[str], str]:
    """Every final release of ``package`` the package index has, oldest first, and where the list came from. The
    list is cached in the kit's cache for a day; offline, the cached list, else the releases already in the kit's
    cache (overlays) and the installed one, said so."""
    cache = kconfig.cache_dir() / "releases" / f"{package}.json"
    try:
        held = json.loads(cache.read_text())
    except (OSError, ValueError):
        held = None
    if held and time.time() - held.get("fetched", 0) < INDEX_MAX_AGE_S:
        return held["releases"], f"the package index (cached {time.strftime('%Y-%m-%d', time.gmtime(held['fetched']))})"
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", package, "--disable-pip-version-check"],
                             capture_output=True, text=True, timeout=60)
        line = next(x for x in out.stdout.splitlines() if x.startswith("Available versions:"))
        found = sorted({v.strip() for v in line.split(":", 1)[1].split(",") if _final(v.strip())}, key=version_key)
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"fetched": time.time(), "releases": found}))
        return found, "the package index"
    except (StopIteration, OSError, subprocess.SubprocessError):
        pass
    if held:
        return held["releases"], "the package index as cached on " + time.strftime("%Y-%m-%d", time.gmtime(held["fetched"])) \
            + " (the index cannot be reached now)"
    here = {p.name.split("-", 1)[1] for p in versions.overlay_root().glob(f"{package}-*") if (p / ".complete").exists()}
    here.add(versions.installed_version(package))
    found = sorted((v for v in here if _final(v.split("+")[0])), key=version_key)
    return found, "the releases already in the kit's cache and the installed one (the package index cannot be reached)"


def release_list(frm: str | None, to: str, given: str | None = None, package: str = PACKAGE) -> tuple[list[str], str]:
    """The ordered releases of ``package`` to bisect: ``given`` (a comma list, in its order) or the index's between
    ``frm`` and ``to`` (both included; ``installed`` is the installed release)."""
    installed = versions.installed_version(package).split("+")[0]
    if given:
        out = [installed if v.strip() == kconfig.INSTALLED else v.strip() for v in given.split(",") if v.strip()]
        for v in out:
            kconfig.check_version(v)
        if len(out) < 2:
            raise kconfig.ConfigError(f"--releases needs at least two releases to compare, got {given!r}")
        return out, "--releases"
    for v in (frm, to):
        if v is not None:
            kconfig.check_version(v)
    hi = installed if to == kconfig.INSTALLED else to
    found, where = index_releases(package)
    if installed not in found and _final(installed):
        found = sorted([*found, installed], key=version_key)
    out = [v for v in found if (frm is None or version_key(v) >= version_key(frm)) and version_key(v) <= version_key(hi)]
    if len(out) < 2:
        raise kconfig.ConfigError(f"between {frm or 'the first release'} and {hi} {where} has {len(out)} "
                                  f"release(s) of {package}: nothing to bisect")
    return out, where
