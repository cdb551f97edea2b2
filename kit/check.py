"""``gradkit check ds_config.json``: is *this* DeepSpeed config affected by a gradient-accumulation bug?

    gradkit check ds_config.json [--world-size 2] [--loop all] [--deepspeed 0.18.9] [--ga 4] [--json out.json]
    python -m kit check ...                          # the same

Runs the config on the kit's tiny model in one world of W ranks, once per loop style, next to a plain
torch.distributed control, and prints per loop: the verdict, the effective/reference ratio, the cosine and the
misplaced weight; which known bug explains an affected loop (``kit.expectations``) or "not explained by any
known bug"; and the known fix, re-run and judged. Exit status: 0 not affected, 1 affected, 2 bad input
(nothing launched), 3 inconclusive or cannot run. Usable as a CI guard in a training repository.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kit import config as kconfig
from kit import expectations, oracle
from kit.probes import ds_config

EXIT = {oracle.NOT_AFFECTED: 0, oracle.AFFECTED: 1, oracle.INCONCLUSIVE: 3, oracle.CANNOT_RUN: 3}

# What each known bug looks like in a check, and its fix (the case that re-runs it): (pattern, hypothesis, fix text)
EXPLAINS = {
    "B3": ("ZeRO-1/2 with config GA = 1 and several backward() per step(): every backward is a boundary, the "
           "accumulator is reset", "last micro-batch / N",
           "call engine.set_gradient_accumulation_boundary(i == N - 1) before each backward (or put N in "
           "gradient_accumulation_steps; from 0.19.4 \"managed_gradient_accumulation\": false)"),
    "B4": ("BF16_Optimizer averages its fp32 accumulator before the boundary micro-batch is added",
           "own rank's boundary micro-batch",
           "set \"bf16\": {\"immediate_grad_update\": true}, or upgrade to DeepSpeed >= 0.19.0"),
    "B5": ("ZeRO-1/2 with offload_optimizer copies a micro-step's gradient to the CPU buffer only on the first "
           "micro-step; the ones between it and the boundary are lost", "first and last micro-batch",
           "upgrade to DeepSpeed >= 0.19.0, or keep GA <= 2 with optimizer offload"),
}


def explain(rec: dict) -> tuple[str | None, str]:
    """``(bug id, sentence)`` for an affected loop: the known bug whose configuration, release and hypothesis
    all match, or ``(None, "not explained by any known bug")``."""
    versions = rec.get("versions") or {}
    stage, loop, matches = rec.get("zero_stage"), rec["config"]["loop"], rec.get("matches")
    candidates = []
    if loop in ("manual", "unmanaged") and stage in (1, 2) and rec.get("optimizer") == "DeepSpeedZeroOptimizer":
        case = "manual" if loop == "manual" else "fix_unmanaged"
        if expectations.expected("B3", versions, case=case, zero_stage=stage) == oracle.AFFECTED:
            candidates.append("B3")
    if rec.get("optimizer") == "BF16_Optimizer" and expectations.expected("B4", versions) == oracle.AFFECTED:
        candidates.append("B4")
    offload = (((rec["config"].get("ds_config") or {}).get("zero_optimization") or {}).get("offload_optimizer") or {})
    if (stage in (1, 2) and offload.get("device") == "cpu" and rec["ga"] > 2 and loop in ("engine", "boundary")
            and expectations.expected("B5", versions) == oracle.AFFECTED):
        candidates.append("B5")
    for bug in candidates:
        pattern, hypothesis, _ = EXPLAINS[bug]
        if matches == hypothesis:
            k = expectations.KNOWN[bug]
            return bug, f"{bug} ({k.report}): {pattern}; the step is '{hypothesis}'"
    if candidates:
        return None, (f"not explained by any known bug: {', '.join(candidates)} is expected here, but the step is "
                      f"'{matches}', not what {candidates[0]} leaves")
    return None, "not explained by any known bug" + (f" (the step is '{matches}')" if matches not in (None, "none")
                                                    else " (no named hypothesis matches the step)")


def summarise(recs: list[dict]) -> dict:
    """The check's answer: overall verdict, exit status, and one row per loop style."""
    control = next((r for r in recs if r["role"] == "control"), None)
    rows = []
    for r in recs:
        if r["role"] != "measured":
            continue
        m, a = r.get("metrics") or {}, r.get("attribution") or {}
        row = {"loop": r["case"], "verdict": r["verdict"], "ratio": m.get("norm_ratio"), "cosine": m.get("cosine"),
               "misplaced_weight": a.get("misplaced_weight"), "matches": r.get("matches"), "reason": r["reason"],
               "explained_by": None, "explanation": None, "fix": None}
        if r["verdict"] == oracle.AFFECTED:
            row["explained_by"], row["explanation"] = explain(r)
            fix = next((f for f in recs if f["role"] == "fix" and f["config"]["loop"] == r["config"]["loop"]
                        and f["config"]["fix"] == f"fix:{row['explained_by']}"), None)
            if row["explained_by"]:
                fm = (fix or {}).get("metrics") or {}
                row["fix"] = {"what": EXPLAINS[row["explained_by"]][2],
                              "verdict": fix["verdict"] if fix else "not re-run here (the fix is another release: "
                                                                     "run this check with --deepspeed)",
                              "ratio": fm.get("norm_ratio")}
        rows.append(row)
    worst = min((r["verdict"] for r in rows), key=oracle.WORST_FIRST.index, default=oracle.CANNOT_RUN)
    return {"verdict": worst, "exit": EXIT[worst], "loops": rows,
            "control": {"verdict": control["verdict"], "reason": control["reason"]} if control else None}


def _num(x, fmt: str) -> str:
    return format(x, fmt) if isinstance(x, (int, float)) else "-"


def report(recs: list[dict], summary: dict, source: str, world_size: int, device: str) -> str:
    first = recs[0]
    v = next((r.get("versions") for r in recs if r.get("versions")), {}) or {}
    cfg = first.get("resolved_config") or {}
    lines = [f"gradkit check {source}: DeepSpeed {v.get('deepspeed', first.get('version'))}, torch "
             f"{v.get('torch', '?')}, {world_size} ranks ({device}); ZeRO-{cfg.get('zero_optimization', {}).get('stage')}"
             f" {ds_config.dtype_of(cfg) if cfg else '?'}, GA {cfg.get('gradient_accumulation_steps')}"]
    lines += [f"  as run: {n}" for n in first.get("config_notes") or []]
    lines.append(f"  {'loop':<10} {'verdict':<13} {'ratio':>7} {'cosine':>8} {'misplaced':>9}")
    for row in summary["loops"]:
        lines.append(f"  {row['loop']:<10} {row['verdict']:<13} {_num(row['ratio'], '7.4f')} "
                     f"{_num(row['cosine'], '8.5f')} {_num(row['misplaced_weight'], '9.4f')}")
        if row["verdict"] == oracle.AFFECTED:
            lines.append(f"      explained by {row['explanation']}" if row["explained_by"] else f"      {row['explanation']}")
            if row["fix"]:
                f = row["fix"]
                lines.append(f"      fix: {f['what']}; re-run with the fix: {f['verdict']}"
                             + (f" (ratio {f['ratio']:.4f})" if f.get("ratio") else ""))
        elif row["verdict"] != oracle.NOT_AFFECTED:
            lines.append(f"      {row['reason'][:300]}")
    c = summary["control"]
    lines.append(f"  control (plain torch.distributed, no DeepSpeed): {c['verdict'] if c else 'absent'}")
    lines.append(f"verdict: {summary['verdict']} (exit {summary['exit']})")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = kconfig.Parser(prog="gradkit check", description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="a DeepSpeed JSON config (HF Trainer's \"auto\" values allowed)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--loop", default="all", help=f"all, or a comma list of {', '.join(ds_config.LOOPS)}")
    p.add_argument("--deepspeed", default=kconfig.INSTALLED, help="a DeepSpeed release (default: the installed one)")
    p.add_argument("--ga", type=int, default=4, help="gradient_accumulation_steps where the config says \"auto\"")
    p.add_argument("--trainer-dtype", default="fp32", help="what \"auto\" in bf16/fp16.enabled resolves to")
    p.add_argument("--device", default="cpu")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--json", help="write the records and the summary here")
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    loops = ds_config.LOOPS if a.loop == "all" else tuple(x.strip() for x in a.loop.split(",") if x.strip())
    kconfig.check_version(a.deepspeed)
    kconfig.check_device(a.device)
    kconfig.check_timeout(a.timeout)
    if a.json and not Path(a.json).parent.exists():
        raise kconfig.ConfigError(f"--json {a.json}: the folder {Path(a.json).parent} does not exist")
    cfg = ds_config.resolve(ds_config.load(a.config), a.world_size, a.ga, a.trainer_dtype)
    ds_config.plan(cfg, loops)  # an unknown loop style is refused here, before anything launches
    stack = {} if a.deepspeed == kconfig.INSTALLED else {"deepspeed": a.deepspeed}
    recs = ds_config.run(cfg, loops, a.world_size, stack, a.device, a.timeout)
    summary = summarise(recs)
    print(report(recs, summary, a.config, a.world_size, a.device))
    if a.json:
        Path(a.json).write_text(json.dumps({"summary": summary, "records": recs}, indent=1, default=str))
    return summary["exit"]


if __name__ == "__main__":
    kconfig.run_cli(main)
