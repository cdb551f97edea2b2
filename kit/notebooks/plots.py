"""The figures the notebooks draw, each from records alone (no tensors, no re-runs).

Every function returns the matplotlib Figure so a notebook shows it and a script can save it.
"""
from __future__ import annotations

import matplotlib.pyplot as plt

from kit import probes
from kit.judge import records
from kit.stacks import versions

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


def accumulator_norms(recs: list[dict], title: str = ""):
    """Per-rank fp32 accumulator norm after each micro-batch, one panel per record (the seed's view).

    Ranks agree on the accumulator after the boundary micro-batch only when it was reduced
    together with the others; a rank-private boundary gradient shows as lines that split at the end.
    """
    fig, axes = _panels(len(recs), 4.2, 3.2)
    for ax, rec in zip(axes[0], recs):
        norms = rec.get("accumulator_norms") or []
        for r, row in enumerate(norms):
            ax.plot(range(len(row)), row, marker="o", label=f"rank {r}")
        ga = rec["ga"]
        ax.axvline(ga - 1, color="grey", ls=":", lw=1)
        ax.set_xticks(range(ga))
        ax.set_xlabel("micro-batch (last = boundary)")
        ax.set_ylabel("fp32 accumulator norm")
        ax.set_title(f"{rec['case']}  deepspeed {rec['versions'].get('deepspeed', rec['version'])}\nGA={ga}, "
                     f"W={rec['world_size']}: {rec['verdict']}", fontsize=9)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def misplaced_vs_predicted(recs: list[dict], title: str = ""):
    """Measured misplaced weight of each rank's accumulator against the predicted (W-1)/W * 1/GA."""
    fig, ax = plt.subplots(figsize=(5, 4.2))
    top = 0.0
    for w in sorted({r["world_size"] for r in recs}):
        pts = [(r["predicted_misplaced_weight"], b["attribution"]["misplaced_weight"], r["ga"])
               for r in recs if r["world_size"] == w for b in r.get("rank_buffers") or []]
        if not pts:
            continue
        xs, ys, gas = zip(*pts)
        ax.scatter(xs, ys, label=f"W={w} (every rank)", s=30)
        for x, y, ga in sorted(set(pts)):
            ax.annotate(f"GA={ga}", (x, y), fontsize=SMALL, xytext=(3, -9), textcoords="offset points")
        top = max(top, *xs, *ys)
    ax.plot([0, top * 1.05], [0, top * 1.05], color="grey", ls="--", lw=1, label="measured = predicted")
    ax.set_xlabel("predicted misplaced weight (W-1)/W * 1/GA")
    ax.set_ylabel("measured misplaced weight")
    ax.set_title(title or "share of the gradient that reached the wrong micro-batches", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def ratio_by_version(recs: list[dict], cases=("leak", "workaround", "control"), title: str = ""):
    """Effective/reference norm ratio and relative error per version and case, bars coloured by verdict."""
    versions = list(dict.fromkeys(r["version"] for r in recs))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    width = 0.8 / max(1, len(cases))
    for j, case in enumerate(cases):
        for i, v in enumerate(versions):
            sel = [r for r in recs if r["version"] == v and r["case"] == case and r["role"] != "symptom"]
            for rec in sel[-1:]:  # the largest GA is last in a plan
                m = rec.get("metrics") or {}
                x = i + (j - (len(cases) - 1) / 2) * width
                colour = VERDICT_COLOURS.get(rec["verdict"], "black")
                axes[0].bar(x, m.get("norm_ratio", 0.0), width, color=colour, edgecolor="black", lw=0.5)
                axes[1].bar(x, m.get("rel_l2", 0.0), width, color=colour, edgecolor="black", lw=0.5)
                for ax in axes:
                    ax.annotate(case, (x, 0), rotation=90, fontsize=SMALL, ha="center", va="bottom",
                                xytext=(0, 2), textcoords="offset points")
    labels = [f"{v}\n(ds {next(r['versions'].get('deepspeed', '?') for r in recs if r['version'] == v)})" for v in versions]
    for ax, name in zip(axes, ("effective / reference norm", "relative L2 error")):
        ax.set_xticks(range(len(versions)))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_ylabel(name)
    axes[0].axhline(1.0, color="grey", ls="--", lw=1)
    axes[1].set_yscale("symlog", linthresh=1e-4)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in VERDICT_COLOURS.values()]
    axes[1].legend(handles, VERDICT_COLOURS.keys(), fontsize=SMALL, loc="upper right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def trajectories(recs: list[dict], title: str = ""):
    """Loss and grad norm per step for each split (micro_batch x GA) of the same global batch."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for rec in recs:
        if not rec.get("losses"):
            continue
        label = f"{rec['case']}: {rec['config']['micro_batch']} x GA {rec['ga']} (ds {rec['versions'].get('deepspeed')})"
        style = "-" if rec["case"] == "leak" else ":"
        axes[0].plot(range(1, len(rec["losses"]) + 1), rec["losses"], style, marker=".", label=label)
        axes[1].plot(range(1, len(rec["grad_norms"]) + 1), rec["grad_norms"], style, marker=".", label=label)
    axes[0].set_ylabel("training loss")
    axes[1].set_ylabel("applied gradient norm")
    for ax in axes:
        ax.set_xlabel("optimizer step")
        ax.legend(fontsize=SMALL)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def _panels(n: int, width: float, height: float, **kw):
    """One row of ``n`` panels; with nothing to draw (every configuration cannot-run) one panel that says so,
    instead of an error in an unrelated-looking cell."""
    fig, axes = plt.subplots(1, max(1, n), figsize=(width * max(1, n), height), squeeze=False, **kw)
    if n == 0:
        axes[0][0].text(0.5, 0.5, "nothing to draw: no configuration of this figure ran\n(the cannot-run lines "
                        "above say why)", ha="center", va="center", transform=axes[0][0].transAxes, fontsize=9)
        axes[0][0].set_axis_off()
    return fig, axes


def save(fig, path) -> None:
    fig.savefig(path, dpi=110, bbox_inches="tight")


def ratio_cosine_vs_n(recs: list[dict], case: str = "manual", predicted: str | None = None, title: str = ""):
    """Effective/reference norm ratio and cosine against N (micro-batches per step), one line per (stage, dtype).

    ``predicted`` names a hypothesis (e.g. "last micro-batch / N") whose predicted ratio is drawn grey,
    from the records' ``hypotheses.predicted_ratio``: where a stage's line lies on it, that hypothesis holds.
    """
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    sel = [r for r in recs if r["case"] == case and r.get("metrics")]
    for stage, dtype in sorted({(r["zero_stage"], r["dtype"]) for r in sel}):
        pts = sorted((r["ga"], r["metrics"]["norm_ratio"], r["metrics"]["cosine"]) for r in sel
                     if r["zero_stage"] == stage and r["dtype"] == dtype)
        ns, ratios, cosines = zip(*pts)
        style = "-" if dtype == "fp32" else "--"
        look = {"color": f"C{stage}", "marker": "osD^"[stage % 4], "markersize": 9 - 1.5 * stage,
                "label": f"ZeRO-{stage} {dtype}"}  # markers shrink with the stage: overlapping lines stay visible
        axes[0].plot(ns, ratios, style, **look)
        axes[1].plot(ns, cosines, style, **look)
    if predicted:
        pred = sorted({(r["ga"], r["hypotheses"]["predicted_ratio"][predicted]) for r in sel
                       if r.get("hypotheses", {}).get("predicted_ratio") and r["dtype"] == "fp32"})
        if pred:
            axes[0].plot(*zip(*pred), color="grey", lw=6, alpha=0.3, label=f"if only '{predicted}'")
    axes[0].axhline(1.0, color="black", ls=":", lw=1)
    axes[1].axhline(1.0, color="black", ls=":", lw=1)
    for ax, name in zip(axes, ("effective / reference norm", "cosine(effective, reference)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("N: backward() calls per step() (config GA = 1)")
        ax.set_ylabel(name)
        ax.legend(fontsize=SMALL)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def attribution_bars(recs: list[dict], title: str = ""):
    """The oracle's least-squares weight of every (rank, micro-batch), one panel per record.

    A correct step gives every bar the same height 1/(W*N) (dashed line); "only the last survives"
    leaves one bar per rank.
    """
    fig, axes = _panels(len(recs), 4.2, 3.0, sharey=True)
    for ax, rec in zip(axes[0], recs):
        a = rec.get("attribution") or {}
        w, exp = a.get("weights", []), a.get("expected_weights", [])
        n = rec["ga"]
        colours = [f"C{k // n}" for k in range(len(w))]
        ax.bar(range(len(w)), w, color=colours)
        if exp:
            ax.axhline(exp[0], color="black", ls="--", lw=1, label="correct: 1/(W·N)")
        ax.set_xticks(range(len(w)))
        ax.set_xticklabels([f"r{k // n}\nmb{k % n}" for k in range(len(w))], fontsize=SMALL)
        ax.set_title(f"{rec['case']} ZeRO-{rec['zero_stage']} {rec['dtype']}, N={n}\n"
                     f"ds {rec['versions'].get('deepspeed', rec['version'])}: {rec['verdict']}", fontsize=8)
        ax.legend(fontsize=SMALL)
    axes[0][0].set_ylabel("weight in the applied gradient")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def _grid_frame(ax, col_labels: list[str], row_labels: list[str], verdicts: tuple) -> None:
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
    _grid_frame(ax, [str(c) for c in cols], [str(r) for r in rows], tuple(VERDICT_COLOURS))
    ax.set_title(title or f"verdict (colour) and {value} (number)", fontsize=9)
    fig.tight_layout()
    return fig


def _split(rec: dict) -> str:
    return f"{rec['config']['micro_batch']}x{rec['ga']}"


def logged_norm_vs_ga(recs: list[dict], case: str = "pipeline", title: str = ""):
    """The seed's view: the grad norm a user logs (from inside the optimizer) against GA at a fixed global batch.

    One line per (version, dtype, ZeRO stage); the dashed line is the fp32 reference gradient's norm.
    A correct engine keeps every line on it whatever the split.
    """
    fig, ax = plt.subplots(figsize=(6, 3.8))
    sel = [r for r in recs if r["case"] in (case, "control") and r.get("logged_grad_norm")]
    keys = sorted({(r["version"], r["dtype"], r["zero_stage"]) for r in sel if r["case"] == case}, key=str)
    for i, (v, dtype, stage) in enumerate(keys):
        pts = sorted((r["ga"], r["logged_grad_norm"]) for r in sel if r["version"] == v  # the GA=1 control included
                     and r["dtype"] == dtype and r["zero_stage"] == stage)
        ds = next(r["versions"].get("deepspeed", v) for r in sel if r["version"] == v)
        ax.plot(*zip(*pts), "-" if dtype == "fp32" else "--", marker="osD^v<>"[i % 7], color=f"C{i % 10}",
                label=f"ds {ds} {dtype} ZeRO-{stage}")
    refs = [r["reference_grad_norm"] for r in sel if r.get("reference_grad_norm")]
    if refs:
        ax.axhline(refs[0], color="black", ls=":", lw=1.2, label="reference (fp32, whole batch)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("GA (micro-batch x GA = constant global batch)")
    ax.set_ylabel("logged grad norm")
    ax.legend(fontsize=SMALL)
    ax.set_title(title or "what the user logs", fontsize=10)
    fig.tight_layout()
    return fig


def stage_ratio_vs_ga(recs: list[dict], case: str = "pipeline", title: str = ""):
    """Effective/reference norm ratio of every pipeline stage against GA, one panel per version.

    One colour per stage; solid fp32, dashed bf16, every ZeRO stage drawn (coinciding lines overlap).
    1 is correct; GA would be "summed", 1/GA "scaled twice". The GA=1 point is the control.
    """
    versions = list(dict.fromkeys(r["version"] for r in recs if r["case"] == case))
    fig, axes = _panels(len(versions), 3.6, 3.4, sharey=True)
    for ax, v in zip(axes[0], versions):
        sel = [r for r in recs if r["version"] == v and r["case"] in (case, "control") and r.get("stages")]
        labelled = set()
        for dtype, stage_z in sorted({(r["dtype"], r["zero_stage"]) for r in sel}):
            rows = sorted((r for r in sel if r["dtype"] == dtype and r["zero_stage"] == stage_z), key=lambda r: r["ga"])
            for s in range(len(rows[0]["stages"])):
                label = None if s in labelled else f"stage {s}"
                labelled.add(s)
                ax.plot([r["ga"] for r in rows], [r["stages"][s]["metrics"]["norm_ratio"] for r in rows],
                        "-" if dtype == "fp32" else "--", color=f"C{s}", marker="os"[s % 2], label=label)
        ds = next((r["versions"].get("deepspeed", v) for r in sel), v)
        ax.set_title(f"DeepSpeed {ds}", fontsize=9)
        ax.axhline(1.0, color="black", ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("GA (GA=1: the control)")
        ax.legend(fontsize=SMALL)
    axes[0][0].set_ylabel("effective / reference norm, per stage")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def path_ratio_vs_ga(recs: list[dict], case: str = "trainer", title: str = ""):
    """Effective/reference ratio against GAS, one line per training path, one panel per version stack.

    The GAS=1 point is the path's own GAS = 1 step (``gas1``). A correct Trainer keeps every line at 1 for every GAS.
    """
    stacks = list(dict.fromkeys(r["version"] for r in recs))
    fig, axes = _panels(len(stacks), 4.2, 3.4, sharey=True)
    for ax, st in zip(axes[0], stacks):
        sel = [r for r in recs if r["version"] == st and r["case"] in (case, "gas1") and r.get("metrics")]
        for i, path in enumerate(dict.fromkeys(r["path"] for r in sel)):
            pts = sorted((r["ga"], r["metrics"]["norm_ratio"]) for r in sel if r["path"] == path)
            ax.plot(*zip(*pts), marker="osD^"[i % 4], color=f"C{i}", markersize=8 - 1.5 * i, label=path)
        ax.axhline(1.0, color="black", ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("GAS (global batch fixed; GAS=1: the path's own step)")
        ax.set_title(st, fontsize=8)
        ax.legend(fontsize=SMALL)
    axes[0][0].set_ylabel("effective / reference norm")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def verdict_matrix(cells: list[dict], title: str = ""):
    """Bug x DeepSpeed version: each cell coloured by its verdict, with the measured ratio and where it was taken.

    ``cells`` come from ``kit.notebooks.overview.verdict_matrix``. The installed release's column is marked. With more
    releases than fit the width of a notebook cell, releases go down and bugs across (nothing is scaled down).
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
            ax.text(x + 0.5, y + 0.3, f"{c['verdict']}\n{ratio}{cos}", ha="center", va="center", fontsize=9)
            where = c["where"].replace(", transformers ", ", tf ").split(", ")
            ax.text(x + 0.5, y + 0.8, "\n".join(", ".join(where[k:k + 2]) for k in range(0, len(where), 2)),
                    ha="center", va="center", fontsize=SMALL)
    _grid_frame(ax, release_labels if across else bug_labels, bug_labels if across else release_labels,
                ("affected", "not-affected", "inconclusive", "cannot-run"))
    ax.set_xlabel("DeepSpeed release" if across else "bug", fontsize=9)
    ax.set_title(title or "verdict per bug and DeepSpeed release\nnumber = effective / reference ratio "
                          "(1.000 = correct)", fontsize=10)
    fig.tight_layout()
    return fig


def explorer_result(rows: list[dict], title: str = ""):
    """Two bar panels, effective/reference ratio and cosine, one bar per case (per stage), coloured by verdict.

    ``rows`` come from ``kit.notebooks.explore.result_rows``. The grey line marks 1.0: a correct engine's bar ends on it.
    """
    fig, axes = plt.subplots(1, 2, figsize=(10, 0.9 + 0.42 * max(1, len(rows))), sharey=True)
    labels = [r["label"] for r in rows]
    colours = [VERDICT_COLOURS.get(r["verdict"], "#cccccc") for r in rows]
    for ax, key, name in zip(axes, ("ratio", "cosine"), ("effective / reference norm", "cosine(effective, reference)")):
        vals = [r[key] if r[key] is not None else 0.0 for r in rows]
        ax.barh(range(len(rows)), vals, color=colours, alpha=0.8)
        ax.axvline(1.0, color="#555555", lw=1, ls="--")
        for i, (v, r) in enumerate(zip(vals, rows)):
            ax.text(v, i, f" {v:.3f}" if r[key] is not None else " cannot run", va="center", fontsize=SMALL)
        ax.set_xlabel(name, fontsize=8)
        ax.set_xlim(0, max(1.25, max(vals or [1]) * 1.2))
    axes[0].set_yticks(range(len(rows)))
    axes[0].set_yticklabels(labels, fontsize=SMALL)
    axes[0].invert_yaxis()
    fig.suptitle(title + "  (colour = verdict, dashed = correct)", fontsize=9)
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


def fitted_weights_per_step(rec: dict, title: str = ""):
    """Each judged step of one record: every (rank, micro-batch)'s fitted weight as a multiple of its right weight
    (1 = the micro-batch counted as it should be, 0 = lost), and the previous step's micro-batches (right weight 0:
    a bar there is a gradient applied again). One panel per step."""
    steps = rec.get("steps") or [rec]
    n, w = rec["ga"], rec["world_size"]
    k = n * w
    fig, axes = _panels(len(steps), 4.0, 3.0, sharey=True)
    for ax, st in zip(axes[0], steps):
        a = st["attribution"]
        weights, expected = a["weights"], a["expected_weights"]
        right = expected[0] if expected and expected[0] else 1.0 / k
        xs = [x / right for x in weights]
        ax.bar(range(k), xs[:k], color=[f"C{i // n}" for i in range(k)])
        if len(xs) > k:
            ax.bar(range(k, len(xs)), xs[k:], color="#999999")
        ax.axhline(1.0, color="black", ls="--", lw=1)
        ax.axhline(0.0, color="black", lw=0.5)
        ax.set_xticks(range(len(xs)))
        ax.set_xticklabels([f"r{i // n}\n{i % n + 1}" if i < k else f"p{(i - k) // n}\n{(i - k) % n + 1}"
                            for i in range(len(xs))], fontsize=SMALL)
        m = st["metrics"]
        ax.set_title(f"step {st.get('step', 0) + 1}: ratio {m['norm_ratio']:.3f}, cosine {m['cosine']:.3f}", fontsize=9)
    axes[0][0].set_ylabel("fitted weight / right weight")
    fig.suptitle(title or f"{rec.get('case')} (rank r, micro-batch; p = the previous step's, grey)", fontsize=10)
    fig.tight_layout()
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
