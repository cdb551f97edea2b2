"""Every figure the notebooks show is legible at the size JupyterLab shows it (no text below 8 pt there)."""
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from gradkit.notebooks import plot_style, probe_plots, verdict_plots  # noqa: E402

RELEASES = ["0.18.0", "0.18.2", "0.18.3", "0.18.4", "0.18.6", "0.18.9", "0.19.0", "0.19.2", "0.19.3", "0.19.4",
            "0.19.8", "none"]


def _cells(n_releases):
    return [{"bug": b, "deepspeed": v, "verdict": "affected" if k % 2 else "not-affected", "ratio": 0.403 + k / 100,
             "cosine": 0.62, "where": "GA 4, ZeRO-2, fp32, W 2, transformers 5.3.0" if b == "B1" else "GA 4, ZeRO-2, fp32, W 2"}
            for k, (b, v) in enumerate((b, v) for b in ("B1", "B2", "B3", "B4", "DDP") for v in RELEASES[:n_releases])]


def _sweep(n_ga=4):
    return [{"point": {"zero_optimization.stage": s, "loop": loop, "ga": ga, "dtype": d, "offload": o},
             "verdict": "affected" if loop == "manual" else "not-affected", "metrics": {"norm_ratio": 0.4}}
            for s in range(4) for loop in ("engine", "boundary", "manual") for ga in (1, 2, 4, 8)[:n_ga]
            for d in ("fp32", "bf16") for o in ("none", "cpu")]


FIGURES = {
    "verdict matrix, 3 releases": lambda: verdict_plots.verdict_matrix(_cells(3)),
    "verdict matrix, 8 releases": lambda: verdict_plots.verdict_matrix(_cells(8)),
    "verdict matrix, 12 releases (full.yaml)": lambda: verdict_plots.verdict_matrix(_cells(12)),
    "sweep heatmaps, default spec": lambda: verdict_plots.sweep_heatmaps(_sweep(), "zero_optimization.stage",
                                                                        ("loop", "ga"), ("dtype", "offload")),
    "sweep heatmaps, small": lambda: verdict_plots.sweep_heatmaps(_sweep(2), "zero_optimization.stage", ("loop", "ga"),
                                                                  ()),
    "explorer result": lambda: probe_plots.explorer_result(
        [{"label": f"case {k} (measured, GA 4)", "ratio": 0.4, "cosine": 0.6, "verdict": "affected"} for k in range(6)]),
    "verdict grid": lambda: verdict_plots.verdict_grid(
        [{"case": c, "ga": g, "verdict": "not-affected", "metrics": {"norm_ratio": 1.0}} for c in ("a", "b") for g in (1, 2, 4, 8)],
        "case", "ga"),
}


@pytest.mark.parametrize("name", FIGURES)
def test_no_text_is_smaller_than_8_points_as_shown(name):
    fig = FIGURES[name]()
    fig.canvas.draw()
    points, text = plot_style.smallest_shown_points(fig)
    plt.close(fig)
    assert points >= plot_style.MIN_POINTS, f"{name}: {text!r} is {points:.1f} pt as shown"


def test_the_old_verdict_matrix_would_have_failed():
    """The rule has teeth: a matrix cell at 5 pt (what the overview drew before) is refused."""
    fig, ax = plt.subplots(figsize=(14, 3))
    ax.text(0.5, 0.5, "GA 4, ZeRO-2, fp32, W 2", fontsize=5)
    assert plot_style.smallest_shown_points(fig)[0] < plot_style.MIN_POINTS
    plt.close(fig)
