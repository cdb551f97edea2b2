"""What a probe is: one object per probe module (``PROBE = Probe(...)``), found by ``gradkit.probes.registry()``.

Everything the overview, the explorer and run-all need to know about a probe is here, so that a new
bug or accumulation path is one module (with its ``PROBE``), one notebook and its tests:

- what it is: ``id`` (the row of the matrix, the ``bug`` key of its records), ``title``, ``notebook``;
- how it runs: ``run(**kwargs) -> records`` (which calls ``gradkit.probes.runner.run``), ``init`` (how its world
  starts: ``"deepspeed"`` or plain ``"torch"``), ``packages`` (what its stack names: only those are
  imported and checked in its ranks), and for the runner ``control_key``, ``world_key``, ``annotate``;
- how it is judged and read: ``measured_case`` and ``verdict_key`` (the cell of the matrix),
  ``ratio_meaning``, ``advice`` (what to do when affected), ``violations`` (what its notebook asserts);
- how it is asked: ``check_notebook(params)`` (its notebook's parameters, before any kernel; it returns the
  ``(probe, stack)`` pairs the notebook's worlds will run, which ``gradkit.stacks.prefetch`` prepares up front),
  ``quick_plan(world_size)`` (the overview's small run: ``run`` keyword arguments), ``knobs`` and
  ``explorer_kwargs(selection, device, timeout_s)`` (the explorer's choices, first value the default).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


def _no_annotation(recs: list[dict]) -> list[dict]:
    return recs


@dataclass(frozen=True)
class Probe:
    id: str
    title: str
    module: str  # gradkit.probes.<module>; its ranks run ``gradkit.probes.ranks.<module>.run_rank``
    notebook: str
    measured_case: str
    ratio_meaning: str
    advice: str
    run: Callable[..., list]
    quick_plan: Callable[[int], dict]
    knobs: dict
    explorer_kwargs: Callable[[dict, str, float], dict]
    # None: the notebook's own logic module checks its parameters (``gradkit.notebooks.runall_params.TOOL_NOTEBOOKS``), as for
    # notebook 07, which four probes share
    check_notebook: Callable[[dict], list] | None = None
    verdict_key: str = "verdict"
    init: str = "deepspeed"
    packages: tuple = ("deepspeed",)
    typical_s: float = 30.0  # one warm world on 2 CPU cores (the explorer's progress bar)
    control_key: Callable[[dict], object] = field(default=lambda rec: rec["ga"])
    world_key: Callable[[dict], object] | None = None  # cases with different keys run in different worlds
    annotate: Callable[[list], list] = _no_annotation  # a world's records, after their verdicts
    violations: Callable[..., list] | None = None
    order: int = 100  # rows of the matrix: by order, then id

    @property
    def target(self) -> str:
        return f"gradkit.probes.ranks.{self.module}:run_rank"

    def reason_key(self) -> str:
        return self.verdict_key.replace("verdict", "reason")
