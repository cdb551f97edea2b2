"""The check's answer for one precision of one config: its records summarised (``summarise``: a row per loop
style, the worst verdict, the exit status), a tie between hypotheses separated by one more run (``separate``), and
the text a person reads (``report``).
"""
from __future__ import annotations

from gradkit import config as kconfig
from gradkit.commands.check.known import OWN_LOOPS, explain, if_run
from gradkit.judge import expectations, oracle, records
from gradkit.judge import verdict as kverdict
from gradkit.probes import ds_config
from gradkit.stacks import fixes

SEPARATING_GA = 4  # from N = 3 on, every named hypothesis predicts its own step (at N = 2 "last / N" is "all but the first")


FIX_CASE = {"B11": "fix:B3"}  # a bug whose fix is another's re-run: B11's, like B3's, marks the boundary

def separate(cfg, summary: dict, run) -> list[dict]:
    """Where an affected loop's step ties between named hypotheses (e.g. at N = 2), run that loop again at a GA
    that separates them (``run(resolved config, loops) -> records``) and name the bug only from that run; the
    verdict at the user's GA stands. Returns the separating run's records."""
    rows = [row for row in summary["loops"] if row["step_verdict"] == oracle.AFFECTED and row["ties"]]
    if not rows:
        return []
    n = cfg["gradient_accumulation_steps"]
    n2 = max(SEPARATING_GA, n + 1)
    recs = run(ds_config.with_ga(cfg, n2, f"run again at GA {n2} to separate the hypotheses GA {n} cannot tell apart"),
               tuple(row["loop"] for row in rows))
    other = {row["loop"]: row for row in summarise(recs)["loops"]}
    for r in recs:  # kept in the check's records, never read as the user's GA's rows again
        r["role"], r["separating_ga"] = f"separating {r['role']}", n2
    for row in rows:
        o = other.get(row["loop"])
        row["separated"] = {"ga": n2, "verdict": o["step_verdict"] if o else oracle.CANNOT_RUN,
                            "matches": o["matches"] if o else None, "shape": o["shape"] if o else None,
                            "explained_by": o["explained_by"] if o else None}
        if o and o["explained_by"] and o["matches"] in row["ties"]:
            row["explained_by"], row["fix"] = o["explained_by"], o["fix"]
            row["explanation"] = (f"{o['explanation']} (at GA {n} the step is {row['matches']}; at GA {n2}, run to "
                                  f"separate them, it is '{o['matches']}')")
        else:
            row["explanation"] = (f"not explained by any known bug: at GA {n} the step is {row['matches']}, and the "
                                  f"run at GA {n2} to separate them gives "
                                  f"{(o or {}).get('matches') or 'nothing judged'}"
                                  + (f" ({o['shape']})" if o and o.get("shape") else ""))
    return recs


def summarise(recs: list[dict]) -> dict:
    """The check's answer: overall verdict, exit status, and one row per loop style. A row's verdict is the worse
    of the applied step's (every step judged) and the logged grad norm's; ``off`` says which of the two is off."""
    control = next((r for r in recs if r["role"] == "control"), None)
    rows = []
    for r in recs:
        if r["role"] != "measured":
            continue
        m, a = r.get("metrics") or {}, r.get("attribution") or {}
        norm = r.get("norm_verdict", "n/a")
        row = {"loop": r["case"], "verdict": kverdict.worst([r["verdict"], norm]), "step_verdict": r["verdict"],
               "norm_verdict": norm, "norm_reason": r.get("norm_reason"), "ratio": m.get("norm_ratio"),
               "cosine": m.get("cosine"), "misplaced_weight": a.get("misplaced_weight"), "matches": r.get("matches"),
               "ties": r.get("ties") or [],
               "shape": r.get("shape"), "worst_step": r.get("worst_step"), "reason": r["reason"],
               "read_finding": r.get("read_finding"), "trajectory": r.get("trajectory"),
               "steps": [{"step": st["step"] + 1, "ratio": st["metrics"]["norm_ratio"], "cosine": st["metrics"]["cosine"],
                          "misplaced_weight": st["attribution"]["misplaced_weight"], "shape": st.get("shape"),
                          "logged_norm_ratio": (st["logged_norm"] / st["reference_norm"]
                                                if st.get("logged_norm") is not None else None),
                          "off": oracle.severity({**st, "dtype": records.judge_dtype(r)}) > 1.0 and not st.get("skipped"),
                          "skipped": bool(st.get("skipped")), "loss_scale": st.get("loss_scale"),
                          "loss_scale_after": st.get("loss_scale_after")}
                         for st in r.get("steps") or []],
               "off": [w for w, v in (("applied step", r["verdict"]), ("logged grad norm", norm)) if v == oracle.AFFECTED],
               "explained_by": None, "explanation": None, "fix": None}
        if r["verdict"] == oracle.AFFECTED:
            row["explained_by"], row["explanation"] = explain(r)
            fix = next((f for f in recs if f["role"] == "fix" and f["config"]["loop"] == r["config"]["loop"]
                        and f["config"]["fix"] == FIX_CASE.get(row["explained_by"], f"fix:{row['explained_by']}")),
                       None)
            if row["explained_by"]:
                fm = (fix or {}).get("metrics") or {}
                row["fix"] = {"what": expectations.KNOWN[row["explained_by"]].explains[2],
                              "verdict": fix["verdict"] if fix else "not re-run here (the fix is another release: "
                                                                     "run this check with --deepspeed)",
                              "ratio": fm.get("norm_ratio"), "patch": fixes.verified_report(row["explained_by"])}
        rows.append(row)
    worst = kverdict.worst([r["verdict"] for r in rows])
    measured = next((r for r in recs if r["role"] == "measured" and r.get("versions")), None)
    ran = {row["loop"] for row in rows}
    judged = any(row["verdict"] != oracle.CANNOT_RUN for row in rows)
    not_run = [if_run(measured, loop) for loop in OWN_LOOPS if loop not in ran] if measured and judged else []
    return {"verdict": worst, "exit": kverdict.EXIT[worst], "loops": rows, "not_run": not_run,
            "control": {"verdict": control["verdict"], "reason": control["reason"]} if control else None}


def report(recs: list[dict], summary: dict, source: str, world_size: int, device: str) -> str:
    first = recs[0]
    v = next((r.get("versions") for r in recs if r.get("versions")), {}) or {}
    cfg = first.get("resolved_config") or {}
    steps = first.get("step_count") or 1
    # the releases the ranks ran: the environment's own (no overlay) said so, and the HF stack where it was imported
    here = " (installed here)" if first.get("version") == kconfig.INSTALLED else ""
    hf = "".join(f", {name} {v[name]}" for name in ("transformers", "accelerate") if name in v)
    lines = [f"gradkit check {source}: DeepSpeed {v.get('deepspeed', first.get('version'))}{here}, torch "
             f"{v.get('torch', '?')}{hf}, {world_size} rank{'s' if world_size > 1 else ''} ({device}); "
             f"ZeRO-{cfg.get('zero_optimization', {}).get('stage')} {ds_config.dtype_of(cfg) if cfg else '?'}, "
             f"GA {cfg.get('gradient_accumulation_steps')}, {steps} optimizer step{'s' if steps > 1 else ''} each judged, "
             f"model: {(first.get('config') or {}).get('model') or 'mlp'}"]
    if world_size == 1:
        lines.append("  ONE RANK (asked for with --allow-one-rank): no bug that lives between ranks can show here")
    lines += [f"  as run: {n}" for n in first.get("config_notes") or []]
    lines.append(f"  {'loop':<10} {'verdict':<13} {'ratio':>7} {'cosine':>8} {'misplaced':>9}  per step (ratio; "
                 f"* off)  logged norm")
    for row in summary["loops"]:
        per_step = " ".join("skip " if st["skipped"] else f"{kverdict.num(st['ratio'], '.3f')}{'*' if st['off'] else ''}"
                            for st in row["steps"])
        lines.append(f"  {row['loop']:<10} {row['verdict']:<13} {kverdict.num(row['ratio'], '7.4f')} "
                     f"{kverdict.num(row['cosine'], '8.5f')} {kverdict.num(row['misplaced_weight'], '9.4f')}  {per_step or '-':<21}"
                     f"  {row['norm_verdict']}")
        if row["verdict"] == oracle.AFFECTED:
            lines.append(f"      off: {' and '.join(row['off'])}"
                         + (f" (worst at step {row['worst_step'] + 1}); the step is: {row['shape']}"
                            if row["step_verdict"] == oracle.AFFECTED and row.get("shape") else ""))
            if row["norm_verdict"] == oracle.AFFECTED:
                lines.append(f"      logged grad norm: {row['norm_reason']}")
        if row["step_verdict"] == oracle.AFFECTED:
            lines.append(f"      explained by {row['explanation']}" if row["explained_by"] else f"      {row['explanation']}")
            if row["fix"]:
                f = row["fix"]
                lines.append(f"      fix: {f['what']}; re-run with the fix: {f['verdict']}"
                             + (f" (ratio {f['ratio']:.4f})" if f.get("ratio") else ""))
                if f.get("patch"):
                    lines.append(f"      a patch of DeepSpeed the kit verified (gradkit report --known "
                                 f"{row['explained_by']}): {f['patch']}")
        elif row["verdict"] != oracle.NOT_AFFECTED:
            said = [r["reason"] for r in summary["loops"][:summary["loops"].index(row)]]
            lines.append("      the same" if row["reason"] in said else f"      {row['reason'][:600]}")
        skipped = oracle.skipped_text([{**st, "step": st["step"] - 1} for st in row["steps"]])
        if skipped and row["verdict"] in (oracle.AFFECTED, oracle.NOT_AFFECTED):
            lines.append(f"      {skipped}")
        if row.get("read_finding"):
            lines.append(f"      finding (not an accumulation bug): {row['read_finding']}")
    c = summary["control"]
    lines.append(f"  control (plain torch.distributed, no DeepSpeed): {c['verdict'] if c else 'absent'}")
    if summary.get("not_run"):
        lines.append(f"  not run ({', '.join(x for x in OWN_LOOPS if x not in [r['loop'] for r in summary['loops']])}"
                     f"; --loop asks for them; the exit status does not count them):")
        lines += [f"    {line}" for line in summary["not_run"]]
    lines.append(f"verdict: {summary['verdict']} (exit {summary['exit']})")
    return "\n".join(lines)
