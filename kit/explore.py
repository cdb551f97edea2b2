"""Interactive views over records, for JupyterLab (``INTERACTIVE = True``); papermill never calls them."""
from __future__ import annotations


def accumulator_explorer(recs: list[dict]):
    """Dropdowns over version, case and GA that redraw the per-rank accumulator-norm figure."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    from kit import plots, records

    grad = [r for r in recs if r.get("accumulator_norms") and r["role"] != "symptom"]
    if not grad:
        raise ValueError("no record with accumulator norms to explore")

    def draw(version, case, ga):
        found = records.select(grad, version=version, case=case, ga=ga)
        if found:
            plots.accumulator_norms(found[:1])
            plt.show()
        else:
            print(f"no record for {version} / {case} / GA={ga}")

    return widgets.interact(draw, version=sorted({r["version"] for r in grad}),
                            case=sorted({r["case"] for r in grad}), ga=sorted({r["ga"] for r in grad}))


def attribution_explorer(recs: list[dict]):
    """Dropdowns over version, case, ZeRO stage, dtype, world size and N that redraw the attribution bars."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    from kit import plots, records

    grad = [r for r in recs if r.get("attribution")]
    if not grad:
        raise ValueError("no record with an attribution to explore")

    def draw(version, case, zero_stage, dtype, world_size, n):
        found = records.select(grad, version=version, case=case, zero_stage=zero_stage, dtype=dtype,
                               world_size=world_size, ga=n)
        if found:
            plots.attribution_bars(found[:1])
            plt.show()
            print(found[0]["reason"])
        else:
            print("no record for that combination (the fixes run only at FIX_N_VALUES)")

    return widgets.interact(draw, **{k: sorted({r[f] for r in grad}, key=str) for k, f in (
        ("version", "version"), ("case", "case"), ("zero_stage", "zero_stage"), ("dtype", "dtype"),
        ("world_size", "world_size"), ("n", "ga"))})


def pipeline_explorer(recs: list[dict]):
    """Dropdowns over version, world size, dtype and ZeRO stage that redraw the per-stage ratio figure."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    from kit import plots, records

    grad = [r for r in recs if r.get("stages")]
    if not grad:
        raise ValueError("no pipeline record with per-stage results to explore")

    def draw(version, world_size, dtype, zero_stage):
        found = records.select(grad, version=version, world_size=world_size, dtype=dtype, zero_stage=zero_stage)
        if found:
            plots.stage_ratio_vs_ga(found)
            plt.show()
        else:
            print("no record for that combination")

    return widgets.interact(draw, **{k: sorted({r[k] for r in grad}, key=str)
                                     for k in ("version", "world_size", "dtype", "zero_stage")})


def path_explorer(recs: list[dict]):
    """Dropdowns over version stack and case that redraw the effective/reference ratio per training path."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    from kit import plots, records

    grad = [r for r in recs if r.get("metrics") and r.get("path")]
    if not grad:
        raise ValueError("no Trainer record with metrics to explore")

    def draw(version, case):
        found = records.select(grad, version=version)
        if found:
            plots.path_ratio_vs_ga(found, case=case)
            plt.show()

    return widgets.interact(draw, version=sorted({r["version"] for r in grad}),
                            case=sorted({r["case"] for r in grad if r["case"] != "control"}))
