"""The probes: every module of this package that defines ``PROBE = kit.probes.probe.Probe(...)``.

    from kit import probes
    probes.registry()        # {"B1": Probe, ...}, in matrix order
    probes.get("B3").run(n_values=(1, 4))

A module is found by being here: adding a probe edits no list. ``register`` adds one from elsewhere
(a plugin, a test); ``unregister`` takes it back.
What a probe's ranks run is its module of ``kit.probes.ranks`` (``Probe.target``), which defines no ``PROBE``.
"""
from __future__ import annotations

from kit.probes.probe import Probe
from kit.registry import Registry

_REGISTRY: Registry[Probe] = Registry(__name__, "PROBE", Probe, lambda p: p.id, "probe")
registry = _REGISTRY.all
get = _REGISTRY.get
register = _REGISTRY.register
unregister = _REGISTRY.unregister


def by_notebook() -> dict[str, Probe]:
    """``{notebook file name: Probe}``: the first probe (in matrix order) of each notebook. Several probes may share
    one notebook (07 holds every path without DeepSpeed), whose own module checks its parameters."""
    out: dict[str, Probe] = {}
    for p in registry().values():
        out.setdefault(p.notebook, p)
    return out
