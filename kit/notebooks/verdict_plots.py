"""The figures of verdicts side by side, each cell coloured by its verdict: the verdict matrix (bug x DeepSpeed
release, notebook 00 and the run-all summary), a grid of records by two keys (02, 03, 07), the sweep's heatmaps (06)
a bisect's strip of releases (08), a known bug's release history as a timeline (00, 01, 07, 08 and the refresh
page) and a fix's steps on the release and patched (08). Each from records alone (no tensors, no re-runs).

Every function returns the matplotlib Figure so a notebook shows it and a script can save it. This module imports
matplotlib at its top (0.5 s): the rest of the kit imports it only inside the functions that draw (the overview's
``save_matrix`` does, so that run-all can read the overview to check parameters without it).
"""
from __future__ import annotations

import math

import matplotlib.pyplot as plt
from matplotlib import transforms
from matplotlib.patches import Patch

from gradkit import probes
from gradkit.judge import records
from gradkit.notebooks.plot_style import SHOWN_WIDTH_IN, SMALL, VERDICT_COLOURS, grid_frame
from gradkit.stacks import versions


def verdict_matrix(cells: list[dict], title: str = ""):
    """Bug x DeepSpeed version: each cell coloured by its verdict, with the measured ratio and where it was taken.

    ``cells`` come from ``gradkit.notebooks.overview.verdict_matrix``. The installed release's column is marked. With
    more releases than fit the width of a notebook cell, releases go down and bugs across (nothing is scaled down).
    """
    installed = versions.installed_version("deepspeed")
    every = probes.registry()
    bugs = [b for b in every if any(c["bug"] == b for c in cells)]
    cols = sorted({c["deepspeed"] for c in cells}, key=records.column_key)
    release_labels = [records.column_label(v, installed).replace(" (", "\n(").replace("no DeepSpeed", "no\nDeepSpeed")
                      for v in cols]
    bug_labels = [f"{b}\n{every[b].notebook[:2]}" for b in bugs]
    across = 1.8 + 1.25 * len(cols) <= SHOWN_WIDTH_IN  # releases across (the usual), else down
    n_x, n_y = (len(cols), len(bugs)) if across else (len(bugs), len(cols))
    fig, ax = plt.subplots(figsize=(1.8 + 1.25 * n_x, 1.2 + 1.05 * n_y))
    for bi, bug in enumerate(bugs):
        for vi, v in enumerate(cols):
            x, y = (vi, bi) if across else (bi, vi)
            c = next((c for c in cells if c["bug"] == bug and c["deepspeed"] == v), None)
            if c is None:
                ax.text(x + 0.5, y + 0.5, "not run", ha="center", va="center", fontsize=SMALL, color="#999999")
                continue
            ax.add_patch(plt.Rectangle((x, y), 1, 1, color=VERDICT_COLOURS.get(c["verdict"], "white"), alpha=0.75))
            ratio = f"{c['ratio']:.3f}" if c.get("ratio") else "-"
            cos = f"\ncos {c['cosine']:.3f}" if c.get("cosine") is not None and c.get("ratio") else ""
            unrun = f"\n+{c['cannot_run']} cannot-run" if c.get("cannot_run") else ""
            ax.text(x + 0.5, y + 0.3, f"{c['verdict']}\n{ratio}{cos}{unrun}", ha="center", va="center", fontsize=9)
            where = c["where"].replace(", transformers ", ", tf ").split(", ")
            ax.text(x + 0.5, y + 0.8, "\n".join(", ".join(where[k:k + 2]) for k in range(0, len(where), 2)),
                    ha="center", va="center", fontsize=SMALL)
    grid_frame(ax, release_labels if across else bug_labels, bug_labels if across else release_labels,
                ("affected", "not-affected", "inconclusive", "cannot-run"))
    ax.set_xlabel("DeepSpeed release" if across else "bug", fontsize=9)
    ax.set_title(title or "verdict per bug and DeepSpeed release\nnumber = effective / reference ratio "
                          "(1.000 = correct)", fontsize=10)
    fig.tight_layout()
    return fig


def verdict_grid(recs: list[dict], row_key, col_key, title: str = "", value: str = "norm_ratio"):
    """A coloured table: one cell per (row, column) with the verdict's colour and the measured ``value``.

    ``row_key`` / ``col_key`` are record keys or functions of a record. Where several records share a
    cell, the worst verdict wins (affected > inconclusive > cannot-run > not-affected).
    """
    rank = {"affected": 3, "inconclusive": 2, "cannot-run": 1, "not-affected": 0, "n/a": -1}
    get = lambda k: (k if callable(k) else (lambda r: r.get(k)))  # noqa: E731
    rk, ck = get(row_key), get(col_key)
    rows = list(dict.fromkeys(rk(r) for r in recs))
    cols = list(dict.fromkeys(ck(r) for r in recs))
    cells = {}
    for r in recs:
        key = (rk(r), ck(r))
        if key not in cells or rank.get(r["verdict"], 0) > rank.get(cells[key]["verdict"], 0):
            cells[key] = r
    fig, ax = plt.subplots(figsize=(1.6 + 1.5 * len(cols), 0.6 + 0.45 * len(rows)))
    for i, row in enumerate(rows):
        for j, col in enumerate(cols):
            r = cells.get((row, col))
            if r is None:
                continue
            ax.add_patch(plt.Rectangle((j, i), 1, 1, color=VERDICT_COLOURS.get(r["verdict"], "white"), alpha=0.75))
            m = r.get("metrics") or {}
            text = f"{m[value]:.3f}" if value in m else r["verdict"]
            ax.text(j + 0.5, i + 0.5, text, ha="center", va="center", fontsize=8)
    grid_frame(ax, [str(c) for c in cols], [str(r) for r in rows], tuple(VERDICT_COLOURS))
    ax.set_title(title or f"verdict (colour) and {value} (number)", fontsize=9)
    fig.tight_layout()
    return fig


def sweep_heatmaps(recs: list[dict], rows: str, cols: tuple, facets: tuple = (), title: str = ""):
    """The sweep as heatmaps: one panel per value of the ``facets`` axes, ``rows`` down, ``cols`` across
    (several axes joined), each cell coloured by its verdict with the effective/reference ratio written in it.

    Axis names are the spec's (``"zero_optimization.stage"``, ``"loop"`` ...); a record's values are in
    ``rec["point"]``. Empty cells were skipped by the spec.
    """
    import math

    def val(r, axes):
        return tuple(r["point"].get(a) for a in axes)

    def short(axis):
        parts = axis.split(".")
        name = parts[-2] if parts[-1] == "device" and len(parts) > 1 else parts[-1]  # offload_optimizer.device
        return name.replace("offload_optimizer", "offload").replace("offload_param", "offload params")

    panels = sorted({val(r, facets) for r in recs}, key=str) or [()]
    row_values = sorted({r["point"].get(rows) for r in recs}, key=str)
    col_values = sorted({val(r, cols) for r in recs}, key=str)
    n = len(panels)
    width = max(4.0, 0.62 * len(col_values) + 1.6)
    ncols = min(n, 2) if 2 * width <= SHOWN_WIDTH_IN else 1  # never wider than the cell: nothing shrinks
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, 0.55 * len(row_values) * nrows + 1.6 * nrows),
                             squeeze=False)
    for k, panel in enumerate(panels):
        ax = axes[k // ncols][k % ncols]
        mine = [r for r in recs if val(r, facets) == panel]
        for i, rv in enumerate(row_values):
            for j, cv in enumerate(col_values):
                found = [r for r in mine if r["point"].get(rows) == rv and val(r, cols) == cv]
                if not found:
                    continue
                r = found[0]
                ax.add_patch(plt.Rectangle((j, i), 1, 1, color=VERDICT_COLOURS.get(r["verdict"], "white"), alpha=0.75))
                ratio = (r.get("metrics") or {}).get("norm_ratio")
                ax.text(j + 0.5, i + 0.5, f"{ratio:.2f}" if ratio is not None else "x", ha="center", va="center",
                        fontsize=8)
        ax.set_xlim(0, len(col_values))
        ax.set_ylim(len(row_values), 0)
        ax.set_xticks([j + 0.5 for j in range(len(col_values))])
        ax.set_xticklabels(["\n".join(map(str, cv)) for cv in col_values], fontsize=8)
        ax.set_yticks([i + 0.5 for i in range(len(row_values))])
        ax.set_yticklabels([f"{short(rows)} {rv}" for rv in row_values], fontsize=9)
        ax.tick_params(length=0)
        ax.set_title(", ".join(f"{short(a)} {v}" for a, v in zip(facets, panel)) or "every point", fontsize=10)
        ax.set_xlabel(" / ".join(short(c) for c in cols), fontsize=9)
    for k in range(n, nrows * ncols):
        axes[k // ncols][k % ncols].axis("off")
    handles = [plt.Rectangle((0, 0), 1, 1, color=VERDICT_COLOURS[v], alpha=0.75)
               for v in ("affected", "not-affected", "inconclusive", "cannot-run")]
    fig.legend(handles, ["affected", "not-affected", "inconclusive", "cannot-run (x)"], fontsize=9, loc="upper right",
               ncol=4, bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(title or "sweep: verdict (colour) and effective / reference ratio (number)", fontsize=11, x=0.01,
                 ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig


def bisect_strip(found: dict, title: str = ""):
    """A bisect's releases left to right, coloured by verdict (grey: skipped, white: not run), each change marked
    between its two releases."""
    order = found["order"]
    fig, ax = plt.subplots(figsize=(min(12.0, 1.0 + 0.8 * len(order)), 1.9))
    for i, rel in enumerate(order):
        r = found["measured"].get(rel)
        colour = VERDICT_COLOURS.get(r["verdict"], "#cccccc") if r else "#ffffff"
        ax.add_patch(plt.Rectangle((i, 0), 0.92, 1, facecolor=colour, edgecolor="black", lw=0.5))
        ax.text(i + 0.46, 0.5, rel, ha="center", va="center", fontsize=SMALL, rotation=90 if len(order) > 10 else 0)
    for ch in found["changes"]:
        x = order.index(ch["after"]) - 0.04
        ax.axvline(x, color="black", lw=2.5)
    ax.set_xlim(-0.1, len(order))
    ax.set_ylim(0, 1)
    ax.axis("off")
    ax.set_title(title or "releases (red affected, green not affected, grey skipped, white not run; bar: a change)",
                 fontsize=9)
    fig.tight_layout()
    return fig


def worst_ratio(res: dict) -> float | None:
    """A result's ratio furthest from 1 (on a log scale) over its judged steps; None where none is a number."""
    nums = [x for x in res.get("ratios") or [] if isinstance(x, (int, float)) and x > 0]
    return max(nums, key=lambda x: abs(math.log(x))) if nums else None


def timeline(series: dict, pins=(), title: str = ""):
    """A known bug's release history (``gradkit.judge.history.series``): one panel per series, its releases left to
    right, each at the norm ratio of its worst judged step (log scale; 1 is the right step) coloured by its verdict;
    a release that cannot run here is a grey x at the panel's foot. Each pin (``gradkit.judge.expectations.Pin``) of the
    series is a dashed line between its two releases, with what starts there."""
    fig, axes = plt.subplots(max(1, len(series)), 1, figsize=(SHOWN_WIDTH_IN, 2.5 * max(1, len(series))), squeeze=False)
    for ax, (name, s) in zip(axes[:, 0], series.items()):
        order = sorted(s["releases"], key=versions.version_key)
        ys = [worst_ratio(s["releases"][r]) for r in order]
        floor = min([y for y in ys if y] + [1.0]) / 2
        for i, (rel, y) in enumerate(zip(order, ys)):
            verdict = s["releases"][rel]["verdict"]
            if y is None:
                ax.plot(i, floor, "x", color=VERDICT_COLOURS.get(verdict, "#7f7f7f"), ms=7)
            else:
                ax.plot(i, y, "o", color=VERDICT_COLOURS.get(verdict, "#7f7f7f"), ms=7)
        ax.plot([i for i, y in enumerate(ys) if y], [y for y in ys if y], "-", color="#999999", lw=0.8, zorder=0)
        ax.axhline(1.0, color="black", lw=0.6, ls=":")
        ax.set_yscale("log")
        foot = transforms.blended_transform_factory(ax.transData, ax.transAxes)  # x in releases, y in the panel
        for p in pins:
            if p.series == name and p.before in order and p.after in order:
                x = (order.index(p.before) + order.index(p.after)) / 2
                ax.axvline(x, color="black", lw=1.2, ls="--")
                ax.text(x, 0.97, p.what.split(":")[0].replace("the step changes", "step changes") + " ",
                        rotation=90, fontsize=SMALL, va="top", ha="right", transform=foot)
        ax.set_xticks(range(len(order)))
        ax.set_xticklabels(order, rotation=90, fontsize=SMALL)
        ax.tick_params(axis="y", labelsize=SMALL)
        ax.set_xlim(-0.5, len(order) - 0.5)
        held = ", ".join(f"{k} {v}" for k, v in (s.get("with") or {}).items())
        ax.set_ylabel("ratio (worst step)", fontsize=SMALL)
        ax.set_title(f"{name}: {s['axis']} releases" + (f" ({held} throughout)" if held else ""), fontsize=9, loc="left")
    handles = [plt.Line2D([], [], marker="o", ls="", color=VERDICT_COLOURS[v], label=v)
               for v in ("affected", "not-affected", "inconclusive")]
    handles.append(plt.Line2D([], [], marker="x", ls="", color=VERDICT_COLOURS["cannot-run"], label="cannot run here"))
    axes[0][0].legend(handles=handles, fontsize=SMALL, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def fix_steps(doc: dict, title: str = ""):
    """A fix's verification (``gradkit.commands.fix.verify``): the norm ratio of each judged step of the bug's recipe,
    on the release and on it patched (hatched), side by side, red where the step is off by more than 1 %; a skipped
    step (fp16 overflow) is marked, not drawn."""
    sides = [(doc["release"], doc["recipe"][doc["release"]]), (doc["patched"], doc["recipe"][doc["patched"]])]
    n = max(len(r.get("ratios") or []) for _, r in sides)
    fig, ax = plt.subplots(figsize=(min(SHOWN_WIDTH_IN, 2.5 + 0.9 * n), 3.0))
    handles = [Patch(color=VERDICT_COLOURS["affected"], label="step off by > 1 %"),
               Patch(color=VERDICT_COLOURS["not-affected"], label="step right")]
    for k, (name, r) in enumerate(sides):
        ratios = r.get("ratios") or []
        xs = [i + (k - 0.5) * 0.38 for i in range(len(ratios))]
        ax.bar(xs, [y or 0 for y in ratios], width=0.36, edgecolor="black", lw=0.5, hatch="" if k == 0 else "//",
               color=[VERDICT_COLOURS["affected" if y and abs(y - 1) > 0.01 else "not-affected"] for y in ratios])
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="" if k == 0 else "//",
                             label=f"{name}: {r['verdict']}"))
        for x, y in zip(xs, ratios):
            ax.text(x, (y or 0) + 0.03, "skip" if not y else f"{y:.2f}", ha="center", fontsize=SMALL)
    ax.axhline(1.0, color="black", lw=0.8, ls=":")
    ax.set_xticks(range(n))
    ax.set_xticklabels([f"step {i + 1}" for i in range(n)], fontsize=SMALL)
    ax.set_ylabel("applied / reference norm", fontsize=SMALL)
    ax.set_ylim(0, max(1.25, *[(y or 0) + 0.2 for _, r in sides for y in r.get("ratios") or []]))
    ax.legend(handles=handles, fontsize=SMALL, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if title:
        ax.set_title(title, fontsize=9, loc="left")
    fig.tight_layout()
    return fig
