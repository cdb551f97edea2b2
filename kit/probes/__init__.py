"""The probes: every module of this package that defines ``PROBE = gradkit.probes.probe.Probe(...)``.

    from gradkit import probes
    probes.registry()        # {"B1": Probe, ...}, in matrix order
    probes.get("B3").run(n_values=(1, 4))

A module is found by being here: adding a probe edits no list. ``register`` adds one from elsewhere
(a plugin, a test); ``unregister`` takes it back.
What a probe's ranks run is its module of ``gradkit.probes.ranks`` (``Probe.target``), which defines no ``PROBE``.
"""
from __future__ import annotations

from gradkit.probes.probe import Probe
from gradkit.registry import Registry

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
