"""What every figure of the notebooks shares: the verdict colours, the smallest legible text, panels, saving.

The figures are in ``verdict_plots`` (verdicts across bugs, releases, configurations) and ``probe_plots`` (one probe's
measurements). This module imports matplotlib at its top (0.5 s): the rest of the kit imports it, like the figure
modules, only inside the functions that draw, so that checking a notebook's parameters never pays for it.
"""
from __future__ import annotations

import matplotlib.pyplot as plt

VERDICT_COLOURS = {"affected": "#d62728", "not-affected": "#2ca02c", "inconclusive": "#ff7f0e",
                   "cannot-run": "#7f7f7f", "n/a": "#cccccc"}

# Legible at the size shown: JupyterLab shows a figure at its own width up to the cell's (about 12 inches at the
# inline backend's 100 dpi on a laptop screen) and scales a wider one down. No text may end up below MIN_POINTS there.
MIN_POINTS = 8.0
SHOWN_WIDTH_IN = 12.0
SMALL = 8  # the smallest font any figure uses (cell annotations, legends, tick labels)


def smallest_shown_points(fig) -> tuple[float, str]:
    """The smallest text of ``fig`` in points as shown (scaled down when the figure is wider than the cell),
    and that text."""
    scale = min(1.0, SHOWN_WIDTH_IN / fig.get_size_inches()[0])
    found = [(t.get_fontsize() * scale, t.get_text()) for t in fig.findobj(plt.Text)
             if t.get_visible() and t.get_text().strip()]
    return min(found) if found else (float("inf"), "")


def panels(n: int, width: float, height: float, **kw):
    """One row of ``n`` panels; with nothing to draw (every configuration cannot-run) one panel that says so,
    instead of an error in an unrelated-looking cell."""
    fig, axes = plt.subplots(1, max(1, n), figsize=(width * max(1, n), height), squeeze=False, **kw)
    if n == 0:
        axes[0][0].text(0.5, 0.5, "nothing to draw: no configuration of this figure ran\n(the cannot-run lines "
                        "above say why)", ha="center", va="center", transform=axes[0][0].transAxes, fontsize=9)
        axes[0][0].set_axis_off()
    return fig, axes


def grid_frame(ax, col_labels: list[str], row_labels: list[str], verdicts: tuple) -> None:
    """Axes of a grid of unit cells (row 0 on top) with centred tick labels and a legend of verdict colours."""
    ax.set_xlim(0, len(col_labels))
    ax.set_ylim(len(row_labels), 0)
    ax.set_xticks([j + 0.5 for j in range(len(col_labels))])
    ax.set_xticklabels(col_labels, fontsize=8)
    ax.set_yticks([i + 0.5 for i in range(len(row_labels))])
    ax.set_yticklabels(row_labels, fontsize=8)
    ax.tick_params(length=0)
    handles = [plt.Rectangle((0, 0), 1, 1, color=VERDICT_COLOURS[v], alpha=0.75) for v in verdicts]
    ax.legend(handles, verdicts, fontsize=SMALL, loc="upper left", bbox_to_anchor=(1.01, 1))


def save(fig, path) -> None:
    fig.savefig(path, dpi=110, bbox_inches="tight")
