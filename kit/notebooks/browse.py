"""Record browsers for JupyterLab (``INTERACTIVE = True``; papermill never calls them): dropdowns over the records a
notebook already has that redraw one of its probe's figures (notebooks 01-04). The explorer that runs a probe with a
Run button is ``gradkit.notebooks.explore``.

Each browser imports ``gradkit.notebooks.probe_plots`` (matplotlib) only when called.
"""
from __future__ import annotations

from gradkit.judge import records


def _explorer(grad: list[dict], what: str, select: dict, figure, options: dict | None = None,
              missing: str = "no record for that combination"):
    """Dropdowns that redraw ``figure(found, chosen)`` for the records matching the chosen values.

    ``select`` maps a dropdown's name to the record key it filters on (its choices are the values
    found in ``grad``); ``options`` are extra dropdowns handed to ``figure`` only.
    """
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    if not grad:
        raise ValueError(f"no record with {what} to explore")

    def draw(**chosen):
        found = records.select(grad, **{key: chosen[name] for name, key in select.items()})
        if not found:
            print(missing)
            return
        figure(found, chosen)
        plt.show()

    choices = {name: sorted({r[key] for r in grad}, key=str) for name, key in select.items()}
    return widgets.interact(draw, **choices, **(options or {}))


def accumulator_explorer(recs: list[dict]):
    """Dropdowns over version, case and GA that redraw the per-rank accumulator-norm figure."""
    from gradkit.notebooks import probe_plots

    return _explorer([r for r in recs if r.get("accumulator_norms") and r["role"] != "symptom"], "accumulator norms",
                     {"version": "version", "case": "case", "ga": "ga"},
                     lambda found, chosen: probe_plots.accumulator_norms(found[:1]))


def attribution_explorer(recs: list[dict]):
    """Dropdowns over version, case, ZeRO stage, dtype, world size and N that redraw the attribution bars."""
    from gradkit.notebooks import probe_plots

    def figure(found, chosen):
        probe_plots.attribution_bars(found[:1])
        print(found[0]["reason"])

    return _explorer([r for r in recs if r.get("attribution")], "an attribution",
                     {"version": "version", "case": "case", "zero_stage": "zero_stage", "dtype": "dtype",
                      "world_size": "world_size", "n": "ga"}, figure,
                     missing="no record for that combination (the fixes run only at FIX_N_VALUES)")


def pipeline_explorer(recs: list[dict]):
    """Dropdowns over version, world size, dtype and ZeRO stage that redraw the per-stage ratio figure."""
    from gradkit.notebooks import probe_plots

    return _explorer([r for r in recs if r.get("stages")], "per-stage pipeline results",
                     {k: k for k in ("version", "world_size", "dtype", "zero_stage")},
                     lambda found, chosen: probe_plots.stage_ratio_vs_ga(found))


def path_explorer(recs: list[dict]):
    """Dropdowns over version stack and case that redraw the effective/reference ratio per training path."""
    from gradkit.notebooks import probe_plots

    grad = [r for r in recs if r.get("metrics") and r.get("path")]
    return _explorer(grad, "Trainer metrics", {"version": "version"},
                     lambda found, chosen: probe_plots.path_ratio_vs_ga(found, case=chosen["case"]),
                     options={"case": sorted({r["case"] for r in grad if r["case"] not in ("gas1", "harness")})})
