"""The probes: every module of this package that defines ``PROBE = kit.probe.Probe(...)``.

    from kit import probes
    probes.registry()        # {"B1": Probe, ...}, in matrix order
    probes.get("B3").run(n_values=(1, 4))

A module is found by being here: adding a probe edits no list. ``register`` adds one from elsewhere
(a plugin, a test); ``unregister`` takes it back.
"""
from __future__ import annotations

import importlib
import pkgutil

from kit.probe import Probe

_EXTRA: dict[str, Probe] = {}
_FOUND: dict[str, Probe] | None = None


def _discover() -> dict[str, Probe]:
    found = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_") or info.name == "common":
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        probe = getattr(module, "PROBE", None)
        if isinstance(probe, Probe):
            if probe.id in found:
                raise RuntimeError(f"two probes have the id {probe.id!r}: {found[probe.id].module} and {probe.module}")
            found[probe.id] = probe
    return found


def registry() -> dict[str, Probe]:
    """Every probe, ``{id: Probe}``, sorted by (order, id)."""
    global _FOUND
    if _FOUND is None:
        _FOUND = _discover()
    every = {**_FOUND, **_EXTRA}
    return {p.id: p for p in sorted(every.values(), key=lambda p: (p.order, p.id))}


def get(probe_id: str) -> Probe:
    from kit import config as kconfig

    every = registry()
    if probe_id not in every:
        raise kconfig.ConfigError(f"unknown probe {probe_id!r}; the kit knows {sorted(every)}")
    return every[probe_id]


def by_notebook() -> dict[str, Probe]:
    """``{notebook file name: Probe}``: the first probe (in matrix order) of each notebook. Several probes may share
    one notebook (07 holds every path without DeepSpeed); they share its ``check_notebook`` too."""
    out: dict[str, Probe] = {}
    for p in registry().values():
        out.setdefault(p.notebook, p)
    return out


def register(probe: Probe) -> Probe:
    _EXTRA[probe.id] = probe
    return probe


def unregister(probe_id: str) -> None:
    _EXTRA.pop(probe_id, None)
