"""A sweep's tables: the groups per release (the ``<!-- gradkit:table SWEEP -->`` block ``--readme`` fills), each
one-at-a-time key's verdicts, each model shape's, and a point's steps in words."""
from __future__ import annotations

import json
import os

from gradkit.commands.sweep.grouping import when_text
from gradkit.commands.sweep.spec import DEFAULT, release_of
from gradkit.judge import oracle
from gradkit.judge.tables import markdown_table, per_step


def steps_text(rec: dict) -> str:
    """A point's steps in one line: each step's ratio (``*``: off), and which one is the worst."""
    if not rec.get("steps"):
        return "no step judged"
    return f"ratio per step {per_step(rec)} (* off); worst: step {rec.get('worst_step', 0) + 1}"


def one_at_a_time_table(spec: dict, recs: list[dict]) -> str:
    """Per one-at-a-time key and value, per stack: how many points of each verdict, and DeepSpeed's reason for
    the first that could not run (markdown)."""
    keys = (spec.get("one_at_a_time") or {}).get("keys") or {}
    rows = []
    for key, values in keys.items():
        for value in values:
            for st in spec["stacks"]:
                mine = [r for r in recs if r["stack"] == st and (r.get("point") or {}).get(key) == value]
                if not mine:
                    continue
                counts = {v: sum(r["verdict"] == v for r in mine) for v in oracle.VERDICTS}
                refused = next((r for r in mine if r["verdict"] == oracle.CANNOT_RUN), None)
                rows.append({"key = value": f"`{key}` = {json.dumps(value)}", "DeepSpeed": release_of(st),
                             **{v: counts[v] for v in oracle.VERDICTS},
                             "why a point could not run": (refused["reason"].replace("|", "/")[:160] if refused else "")})
    return markdown_table(rows, list(rows[0])) if rows else "no one-at-a-time keys in this spec"


def model_table(spec: dict, recs: list[dict]) -> str:
    """Per model shape other than the MLP, ZeRO stage, loop and optimizer offload: each precision's verdict per
    release, as the known bug that explains it (``B6``), ``ok`` (not affected), ``?`` (affected, unexplained),
    ``x`` (cannot run), ``~`` (inconclusive). Markdown; what a reader scans for the parts some micro-batches miss."""
    def cell(r):
        if r is None:
            return "-"
        return {oracle.NOT_AFFECTED: "ok", oracle.CANNOT_RUN: "x", oracle.INCONCLUSIVE: "~"}.get(
            r["verdict"], r.get("explained_by") or "?")

    shaped = [r for r in recs if (r.get("point") or {}).get("model") not in (None, DEFAULT, "mlp")]
    keys = sorted({(r["point"]["model"], r["zero_stage"], r["point"].get("loop", "engine"),
                    str(r["point"].get("zero_optimization.offload_optimizer.device", "none"))) for r in shaped},
                  key=lambda k: (list(spec["axes"].get("model", [])).index(k[0]) if k[0] in spec["axes"].get("model", [])
                                 else 99, k[1:]))
    dtypes = sorted({r["dtype"] for r in shaped})
    rows = []
    for model, stage, loop, offload in keys:
        row = {"model": model, "ZeRO": stage, "loop": loop, "offload": offload}
        for st in spec["stacks"]:
            mine = {r["dtype"]: r for r in shaped if r["stack"] == st and (r["point"]["model"], r["zero_stage"],
                    r["point"].get("loop", "engine"), str(r["point"].get("zero_optimization.offload_optimizer.device",
                                                                           "none"))) == (model, stage, loop, offload)}
            row[f"DeepSpeed {release_of(st)}"] = " / ".join(cell(mine.get(d)) for d in dtypes)
        rows.append(row)
    if not rows:
        return "no model shape other than the MLP in this spec"
    return f"cells: {' / '.join(dtypes)}\n\n" + markdown_table(rows, list(rows[0]))


def tie_text(names: list[str]) -> str:
    """A tie group's cell: the known bugs (or named steps) it ties between, none of them claimed."""
    what = "each expected here leaves this step" if all(n[:1] == "B" for n in names) else \
        "the measurement cannot tell these steps apart here"
    return f"tie: {' or '.join(names)} ({what})"


def table(summary: dict, command: str) -> str:
    """The sweep table of docs/sweep.md (``--readme``): per stack, its counts; per known bug one row (its largest
    group's conditions, how many more groups it has: notebook 06 lists each); then every tie and every unknown group,
    one row each."""
    def short(a):
        return a.split(".")[-1] if not a.endswith("device") else "offload"

    rows = []
    for s in summary["stacks"]:
        counts = ", ".join(f"{n} {v}" for v, n in s["counts"].items() if n)
        rows.append({"DeepSpeed": s["deepspeed"], "group (smallest key set)": f"*{s['configs']} configs: {counts}*",
                     "configs": "", "ratio": "", "the step is": "", "explained by": ""})
        for bug in sorted({g["known_bug"] for g in s["groups"] if g["known_bug"]}):
            mine = [g for g in s["groups"] if g["known_bug"] == bug]  # largest first (``groups`` sorts them)
            ratios = [x for g in mine for x in (g["ratio_range"] or [])]
            more = f" (+ {len(mine) - 1} smaller group{'s' if len(mine) > 2 else ''})" if len(mine) > 1 else ""
            rows.append({"DeepSpeed": s["deepspeed"],
                         "group (smallest key set)": when_text(mine[0]["when"], short).replace(" x ", " × ") + more,
                         "configs": sum(g["count"] for g in mine),
                         "ratio": f"{min(ratios):.3f}–{max(ratios):.3f}" if ratios else "",
                         "the step is": ", ".join(sorted({m for g in mine for m in g["matches"]})), "explained by": bug})
        for g in s["groups"]:
            if g["known_bug"]:
                continue
            lo, hi = g["ratio_range"] or (0, 0)
            repro = g.get("repro")
            rows.append({"DeepSpeed": s["deepspeed"], "group (smallest key set)": when_text(g["when"], short).replace(
                " x ", " × "), "configs": g["count"], "ratio": f"{lo:.3g}–{hi:.3g}",
                "the step is": ", ".join(g["matches"]) if g.get("tie") else "; ".join(g.get("shapes") or g["matches"]),
                "explained by": tie_text(g["tie"]) if g.get("tie") else
                f"**unknown**: `{repro['script']}` {'reproduces' if repro['reproduced'] else 'does not reproduce'}"
                if repro else "**unknown**"})
    worlds = "; ".join(f"{st['wall_s']} s on {st['deepspeed']}" for st in summary["stacks"] if st.get("wall_s"))
    return (f"<sub>generated by `{command}` ({summary.get('wall_s', '?')} s"
            + (f"; the points' own time in their worlds: {worlds}" if worlds else "")
            + f"; {os.cpu_count()}-core CPU, gloo)</sub>\n\n"
            + markdown_table(rows, list(rows[0])) + "\n")
