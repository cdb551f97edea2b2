"""``gradkit check ds_config.json``: is *this* DeepSpeed config affected by a gradient-accumulation bug?

    gradkit check ds_config.json [--world-size 2] [--loop all] [--deepspeed 0.18.9] [--ga 4] [--json out.json]
    python -m kit check ...                          # the same

Runs the config on the kit's tiny model in one world of W ranks, once per loop style, next to a plain
torch.distributed control, and prints per loop: the verdict, the effective/reference ratio, the cosine and the
misplaced weight; which known bug explains an affected loop (``kit.judge.expectations``) or "not explained by any
known bug"; and the known fix, re-run and judged. Exit status: 0 not affected, 1 affected, 2 bad input
(nothing launched), 3 inconclusive or cannot run. Usable as a CI guard in a training repository.

``--path fsdp2|accelerate|trainer`` asks the same of the paths without DeepSpeed (``kit.commands.check_paths``).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from kit import config as kconfig
from kit import shapes
from kit.commands import check_paths
from kit.judge import expectations, oracle, records
from kit.judge import verdict as kverdict
from kit.probes import ds_config
from kit.shapes import hf
from kit.stacks.versions import version_key


def _expected_here(bug: str, versions: dict, **config) -> bool:
    """Upstream's table expects ``bug`` on this release: it pins it affected, or the release is newer than the
    table and no release fixes the bug (a bug with no fix stays expected)."""
    want = expectations.expected(bug, versions, **config)
    if want is not None:
        return want == oracle.AFFECTED
    k = expectations.KNOWN[bug]
    v = (versions or {}).get(k.package)
    return bool(v) and k.fixed_in is None and \
        version_key(v) > version_key(k.newest_pinned)


def ruled_out(rec: dict) -> dict:
    """``{bug: why}``: the bugs a key of the config that ran rules out (that bug's own fix is in the config)."""
    ds = (rec.get("config") or {}).get("ds_config") or {}
    version = (rec.get("versions") or {}).get("deepspeed")
    out = {}
    if ds.get("managed_gradient_accumulation") is False and version and \
            version_key(version) >= version_key(expectations.UNMANAGED_SINCE):
        out["B3"] = f"\"managed_gradient_accumulation\": false (honoured from {expectations.UNMANAGED_SINCE})"
    if (ds.get("bf16") or {}).get("immediate_grad_update"):
        out["B4"] = "\"bf16.immediate_grad_update\": true"
    return out


def candidates(rec: dict) -> list[str]:
    """The known bugs whose configuration and release this record has (before looking at its step)."""
    versions = rec.get("versions") or {}
    stage, loop = rec.get("zero_stage"), rec["config"]["loop"]
    out = []
    if loop in ("manual", "unmanaged") and stage in (1, 2) and rec.get("optimizer") == "DeepSpeedZeroOptimizer" \
            and _expected_here("B3", versions, case="manual", zero_stage=stage):
        out.append("B3")
    if rec.get("optimizer") == "BF16_Optimizer" and _expected_here("B4", versions):
        out.append("B4")
    offload = (((rec["config"].get("ds_config") or {}).get("zero_optimization") or {}).get("offload_optimizer") or {})
    if (stage in (1, 2) and offload.get("device") == "cpu" and rec["ga"] > 2 and loop in ("engine", "boundary")
            and _expected_here("B5", versions)):
        out.append("B5")
    if stage == 3 and _expected_here("B6", versions):
        out.append("B6")
    if stage in (1, 2, 3) and offload.get("device") == "cpu" and _expected_here("B7", versions):
        out.append("B7")
    return [b for b in out if b not in ruled_out(rec)]


def explain(rec: dict) -> tuple[str | None, str]:
    """``(bug id, sentence)`` for an affected loop: the known bug whose configuration, release and hypothesis
    all match, or ``(None, "not explained by any known bug")``. A step two hypotheses explain equally
    ("ambiguous between ...") names no bug: the measurement cannot tell them apart."""
    matches, shape = rec.get("matches"), rec.get("shape")
    found = candidates(rec)
    said = f" (the step is: {shape})" if shape else ""
    for bug in found:
        pattern, hypothesis, _ = expectations.KNOWN[bug].explains
        if matches == hypothesis or isinstance(hypothesis, tuple) and matches in hypothesis:
            k = expectations.KNOWN[bug]
            return bug, f"{bug} ({k.report}): {pattern}; the step is '{matches}'"
    if found:
        return None, (f"not explained by any known bug: {', '.join(found)} is expected here, but the step is "
                      f"'{matches}', not what {found[0]} leaves{said}")
    return None, "not explained by any known bug" + (f" (the step is '{matches}'{'; ' + shape if shape else ''})"
                                                    if matches not in (None, "none") else said or
                                                    " (no named hypothesis matches the step)")


SEPARATING_GA = 4  # from N = 3 on, every named hypothesis predicts its own step (at N = 2 "last / N" is "all but the first")


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
                          "off": oracle.severity({**st, "dtype": records.judge_dtype(r)}) > 1.0}
                         for st in r.get("steps") or []],
               "off": [w for w, v in (("applied step", r["verdict"]), ("logged grad norm", norm)) if v == oracle.AFFECTED],
               "explained_by": None, "explanation": None, "fix": None}
        if r["verdict"] == oracle.AFFECTED:
            row["explained_by"], row["explanation"] = explain(r)
            fix = next((f for f in recs if f["role"] == "fix" and f["config"]["loop"] == r["config"]["loop"]
                        and f["config"]["fix"] == f"fix:{row['explained_by']}"), None)
            if row["explained_by"]:
                fm = (fix or {}).get("metrics") or {}
                row["fix"] = {"what": expectations.KNOWN[row["explained_by"]].explains[2],
                              "verdict": fix["verdict"] if fix else "not re-run here (the fix is another release: "
                                                                     "run this check with --deepspeed)",
                              "ratio": fm.get("norm_ratio")}
        rows.append(row)
    worst = kverdict.worst([r["verdict"] for r in rows])
    return {"verdict": worst, "exit": kverdict.EXIT[worst], "loops": rows,
            "control": {"verdict": control["verdict"], "reason": control["reason"]} if control else None}


def report(recs: list[dict], summary: dict, source: str, world_size: int, device: str) -> str:
    first = recs[0]
    v = next((r.get("versions") for r in recs if r.get("versions")), {}) or {}
    cfg = first.get("resolved_config") or {}
    steps = first.get("step_count") or 1
    lines = [f"gradkit check {source}: DeepSpeed {v.get('deepspeed', first.get('version'))}, torch "
             f"{v.get('torch', '?')}, {world_size} rank{'s' if world_size > 1 else ''} ({device}); "
             f"ZeRO-{cfg.get('zero_optimization', {}).get('stage')} {ds_config.dtype_of(cfg) if cfg else '?'}, "
             f"GA {cfg.get('gradient_accumulation_steps')}, {steps} optimizer step{'s' if steps > 1 else ''} each judged, "
             f"model: {(first.get('config') or {}).get('model') or 'mlp'}"]
    if world_size == 1:
        lines.append("  ONE RANK (asked for with --allow-one-rank): no bug that lives between ranks can show here")
    lines += [f"  as run: {n}" for n in first.get("config_notes") or []]
    lines.append(f"  {'loop':<10} {'verdict':<13} {'ratio':>7} {'cosine':>8} {'misplaced':>9}  per step (ratio; "
                 f"* off)  logged norm")
    for row in summary["loops"]:
        per_step = " ".join(f"{kverdict.num(st['ratio'], '.3f')}{'*' if st['off'] else ''}" for st in row["steps"])
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
        elif row["verdict"] != oracle.NOT_AFFECTED:
            lines.append(f"      {row['reason'][:300]}")
        if row.get("read_finding"):
            lines.append(f"      finding (not an accumulation bug): {row['read_finding']}")
    c = summary["control"]
    lines.append(f"  control (plain torch.distributed, no DeepSpeed): {c['verdict'] if c else 'absent'}")
    lines.append(f"verdict: {summary['verdict']} (exit {summary['exit']})")
    return "\n".join(lines)


def precisions(user: dict, trainer_dtype: str | None) -> list[str]:
    """The precisions to check: ``--trainer-dtype`` where given; else every one an ``"auto"`` in ``bf16.enabled`` /
    ``fp16.enabled`` could resolve to (fp32 and each auto one: the Trainer's --bf16 / --fp16 decide at run time)."""
    if trainer_dtype is not None:
        return [trainer_dtype]
    out = ["fp32"]
    for name in ("bf16", "fp16"):
        section = user.get(name) if isinstance(user, dict) else None
        if isinstance(section, dict) and section.get("enabled") == "auto":
            out.append(name)
    return out


def _shape_names() -> list[str]:
    return list(shapes.registry())


def model_of(where: str | None, adapter: str | None) -> tuple[object, list[str]]:
    """``--model`` / ``--adapter`` as ``ds_config.plan``'s ``model`` and the lines that say what was built: a
    registered shape by name, else the user's architecture from its Hugging Face config at toy size."""
    if where is None or where in shapes.registry():
        if adapter:
            raise kconfig.ConfigError("--adapter needs --model naming a Hugging Face config (the adapter goes on it)")
        return where or shapes.DEFAULT, []
    return hf.user_model(where, adapter)


def parser() -> argparse.ArgumentParser:
    p = kconfig.Parser(prog="gradkit check", description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", default=None,
                   help="a DeepSpeed JSON config (HF Trainer's \"auto\" values allowed); with --path accelerate, an "
                        "`accelerate config` YAML (optional)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--loop", default="all", help=f"all, or a comma list of {', '.join(ds_config.LOOPS)}")
    p.add_argument("--deepspeed", default=kconfig.INSTALLED, help="a DeepSpeed release (default: the installed one)")
    p.add_argument("--ga", type=int, default=4, help="gradient_accumulation_steps where the config says \"auto\"")
    p.add_argument("--trainer-dtype", default=None, help="what \"auto\" in bf16/fp16.enabled resolves to (default: "
                                                         "check every precision it could resolve to)")
    p.add_argument("--steps", type=int, default=ds_config.STEPS, help="optimizer steps per loop style, each judged")
    p.add_argument("--allow-one-rank", action="store_true", help="accept --world-size 1 (it hides every bug that "
                                                                  "lives between ranks)")
    p.add_argument("--model", default=None, help="judge it on a model shape (" + ", ".join(_shape_names()) + "), "
                   "or on your architecture at toy size: a Hugging Face config.json, its folder, or a model id whose "
                   "config is in the local cache (nothing is downloaded)")
    p.add_argument("--adapter", default=None, help="a PEFT LoRA adapter_config.json to put on --model")
    p.add_argument("--device", default="cpu")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--json", help="write the records and the summary here")
    check_paths.add_arguments(p)
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    if a.path != "deepspeed":
        return check_paths.main(a)
    check_paths.refuse_path_flags(a)
    if a.config is None:
        raise kconfig.ConfigError("gradkit check needs a DeepSpeed config file (or --path fsdp2|accelerate|trainer)")
    loops = ds_config.LOOPS if a.loop == "all" else tuple(x.strip() for x in a.loop.split(",") if x.strip())
    kconfig.check_version(a.deepspeed)
    kconfig.check_device(a.device)
    kconfig.check_timeout(a.timeout)
    kconfig.check_positive_int("--steps", a.steps)
    if a.world_size == 1 and not a.allow_one_rank:
        raise kconfig.ConfigError("--world-size 1 hides every bug that lives between ranks (B4, B5, any reduction); "
                                  "use 2 or more, or add --allow-one-rank to check one rank anyway")
    if a.json and not Path(a.json).parent.exists():
        raise kconfig.ConfigError(f"--json {a.json}: the folder {Path(a.json).parent} does not exist")
    user = ds_config.load(a.config)
    model, model_notes = model_of(a.model, a.adapter)
    todo = {}
    for dtype in precisions(user, a.trainer_dtype):
        cfg = ds_config.resolve(user, a.world_size, a.ga, dtype)
        cfg.notes += model_notes
        ds_config.plan(cfg, loops, steps=a.steps, model=model)  # an unknown loop style is refused here, before any launch
        todo[ds_config.dtype_of(cfg)] = cfg  # named by what runs (a config that enables bf16 itself is bf16)
    if len(todo) > 1:
        print(f"{a.config}: \"auto\" precision and no --trainer-dtype: checking each precision it could resolve to "
              f"({', '.join(todo)})")
    stack = {} if a.deepspeed == kconfig.INSTALLED else {"deepspeed": a.deepspeed}
    out = {}
    for dtype, cfg in todo.items():
        try:
            def run(c, ls):
                return ds_config.run(c, ls, a.world_size, stack, a.device, a.timeout, steps=a.steps, model=model)

            recs = run(cfg, loops)
            summary = summarise(recs)
            recs += separate(cfg, summary, run)
            text = report(recs, summary, a.config if len(todo) == 1 else f"{a.config} [{dtype}]", a.world_size,
                          a.device)
        except Exception as e:  # noqa: BLE001 - the kit's own failure is never a verdict on the user's config
            import traceback
            traceback.print_exc()
            print(f"internal error while checking {dtype}: {type(e).__name__}: {e} (nothing was measured: exit 3)")
            recs, summary = [], {"verdict": oracle.CANNOT_RUN, "exit": kverdict.EXIT[oracle.CANNOT_RUN], "loops": [],
                                 "control": None, "error": f"{type(e).__name__}: {e}"}
        if recs:
            print(text)
        out[dtype] = {"summary": summary, "records": recs}
    worst = kverdict.worst([o["summary"]["verdict"] for o in out.values()])
    if len(out) > 1:
        print("verdict over every precision: " + ", ".join(f"{d} {o['summary']['verdict']}" for d, o in out.items())
              + f" -> {worst} (exit {kverdict.EXIT[worst]})")
    if a.json:
        first = next(iter(out.values()))
        doc = {"config_file": str(Path(a.config).resolve()),
               "summary": {**first["summary"], "verdict": worst, "exit": kverdict.EXIT[worst]} if len(out) == 1 else
               {"verdict": worst, "exit": kverdict.EXIT[worst]}, "records": first["records"] if len(out) == 1 else [],
               "precisions": out}
        Path(a.json).write_text(json.dumps(doc, indent=1, default=str))
    return kverdict.EXIT[worst]


if __name__ == "__main__":
    kconfig.run_cli(main)
