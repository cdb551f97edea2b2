"""One probe's figures, each from records alone (no tensors, no re-runs): notebook 04's (B4: accumulator norms,
misplaced weight, ratio per release, trajectories), 03's (B3: attribution bars, ratio and cosine against N), 02's
(B2: logged norm and per-stage ratio against GA), 01's (B1: ratio per training path), 08's (fitted weights per step)
and the 05 explorer's result.

Every function returns the matplotlib Figure so a notebook shows it and a script can save it. This module imports
matplotlib at its top (0.5 s): the rest of the kit imports it only inside the functions that draw.
"""
from __future__ import annotations

import matplotlib.pyplot as plt

from gradkit.notebooks.plot_style import SMALL, VERDICT_COLOURS, panels


def accumulator_norms(recs: list[dict], title: str = ""):
    """Per-rank fp32 accumulator norm after each micro-batch, one panel per record (the seed's view).

    Ranks agree on the accumulator after the boundary micro-batch only when it was reduced
    together with the others; a rank-private boundary gradient shows as lines that split at the end.
    """
    fig, axes = panels(len(recs), 4.2, 3.2)
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


def attribution_bars(recs: list[dict], title: str = ""):
    """The oracle's least-squares weight of every (rank, micro-batch), one panel per record.

    A correct step gives every bar the same height 1/(W*N) (dashed line); "only the last survives"
    leaves one bar per rank.
    """
    fig, axes = panels(len(recs), 4.2, 3.0, sharey=True)
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
    fig, axes = panels(len(versions), 3.6, 3.4, sharey=True)
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
    fig, axes = panels(len(stacks), 4.2, 3.4, sharey=True)
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


def fitted_weights_per_step(rec: dict, title: str = ""):
    """Each judged step of one record: every (rank, micro-batch)'s fitted weight as a multiple of its right weight
    (1 = the micro-batch counted as it should be, 0 = lost), and the previous step's micro-batches (right weight 0:
    a bar there is a gradient applied again). One panel per step."""
    steps = rec.get("steps") or [rec]
    n, w = rec["ga"], rec["world_size"]
    k = n * w
    fig, axes = panels(len(steps), 4.0, 3.0, sharey=True)
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


def explorer_result(rows: list[dict], title: str = ""):
    """Two bar panels, effective/reference ratio and cosine, one bar per case (per stage), coloured by verdict.

    ``rows`` come from ``gradkit.notebooks.explore.result_rows``. The grey line marks 1.0: a correct engine's bar ends on it.
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
