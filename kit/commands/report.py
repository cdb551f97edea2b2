"""``gradkit report``: a finding as an upstream issue, ready to paste (``report.md``).

    gradkit report check.json [--loop engine] [--bisect bisect.json] [--out report.md]   # a gradkit check --json
    gradkit report runs/sweep --group repro_0.18.6_18 [--bisect bisect.json]            # a sweep's unknown group
    gradkit report gradkit-watch [--bisect bisect.json]       # a real job's affected steps (gradkit.watch's records)

The report holds: a one-line title; the environment (torch, DeepSpeed, transformers, world size, device); the
smallest config that shows it (the sweep group's conditions, the resolved config); the loop; what each step is
(fitted weights, ratio, cosine) against what it should be; the release range from ``gradkit bisect`` with the
code that changed there; and the standalone reproduction script inline, with the output it printed when the kit
ran it (a check's is written and run here; a sweep's was run by the sweep).
"""
from __future__ import annotations

import json
from pathlib import Path

from gradkit import config as kconfig
from gradkit.commands import repro
from gradkit.commands.bisect import diff, search
from gradkit.commands.sweep.grouping import when_text
from gradkit.judge import oracle, records

LOOPS = {
    "engine": "DeepSpeed's own loop: `engine.backward(loss)` and `engine.step()` after every micro-batch, "
              "`gradient_accumulation_steps` = N in the config",
    "boundary": "`engine.set_gradient_accumulation_boundary(i == N - 1)` before each of N `backward()` calls, one "
                "`step()` (as Accelerate drives DeepSpeed)",
    "manual": "config `gradient_accumulation_steps` = 1, N `engine.backward(loss / N)` calls, then one `engine.step()`",
    "unmanaged": "`\"managed_gradient_accumulation\": false`, N `backward()` calls, one `step()`",
}


def title(rec: dict) -> str:
    cfg = rec.get("resolved_config") or rec["config"].get("ds_config") or {}
    stage = (cfg.get("zero_optimization") or {}).get("stage", 0)
    ds = (rec.get("versions") or {}).get("deepspeed", "?")
    m = rec.get("metrics") or {}
    what = rec.get("matches") if rec.get("matches") not in (None, "none") else "not the mean of the micro-batches"
    return (f"[DeepSpeed {ds}] ZeRO-{stage} {rec['config'].get('dtype')}, GA {rec['ga']}, {rec['config'].get('loop')} "
            f"loop: the applied gradient is {what} (norm ratio {m.get('norm_ratio', float('nan')):.3f}, "
            f"cosine {m.get('cosine', float('nan')):.4f})")


def steps_table(rec: dict) -> str:
    lines = ["| step | norm ratio | cosine | rel. error | misplaced weight | the step is |", "|---|---|---|---|---|---|"]
    for s in rec.get("steps") or [rec]:
        m, a = s["metrics"], s["attribution"]
        lines.append(f"| {s.get('step', 0) + 1} | {m['norm_ratio']:.4f} | {m['cosine']:.5f} | {m['rel_l2']:.2e} | "
                     f"{a['misplaced_weight']:.4f} | {s.get('shape') or s.get('matches') or '-'} |")
    return "\n".join(lines)


def bisect_section(doc: dict | None, command: str) -> list[str]:
    if not doc:
        return ["Not bisected yet; to find the releases:", "", f"    {command}", ""]
    out = [f"`gradkit bisect` over {len(doc['order'])} releases ({doc['order'][0]} .. {doc['order'][-1]}, from "
           f"{doc.get('releases_from', '?')}; every {doc['stride']}th first, then a binary search, each change "
           "confirmed by a second run on both sides):", "", search.table(doc), ""]
    if not doc["changes"]:
        out.append("No change among the releases that ran.")
    for ch in doc["changes"]:
        out += [f"- **{search.describe(ch)}**"]
        if ch.get("diff"):
            out += ["", "```diff", diff.diff_text(ch["diff"]), "```", ""]
    if doc["skipped"]:
        out.append("Skipped (cannot run on this torch / machine, never counted as good): "
                   + "; ".join(f"{s['release']} ({(s.get('reason') or s['verdict'])[:120]})" for s in doc["skipped"]))
    return out + [""]


def bisect_command(config, rec: dict) -> str:
    """The ``gradkit bisect`` command that finds this record's releases (its config file, loop and model)."""
    case = rec["config"]
    model = case.get("model")
    return (f"gradkit bisect {config} --loop {case.get('loop')}" + (f" --model {model}" if model and model != "mlp" else "")
            + f" --steps {case.get('steps', 1)}")


def render(rec: dict, script: str, repro_source: str, repro_output: str, repro_exit: int | None, when: str | None,
           bisect_doc: dict | None, bisect_cmd: str) -> str:
    """The report's Markdown for one affected record; ``bisect_cmd`` is said where no bisect was run yet."""
    v = rec.get("versions") or {}
    case = rec["config"]
    cfg = rec.get("resolved_config") or case.get("ds_config") or {}
    loop = case.get("loop")
    stage = (cfg.get("zero_optimization") or {}).get("stage", 0)
    expected = (f"each of the {rec['world_size'] * rec['ga']} micro-batches (W = {rec['world_size']} ranks x N = "
                f"{rec['ga']}) with weight 1 / {rec['world_size'] * rec['ga']} of the step: the gradient of the mean "
                "loss over the global batch, as plain fp32 PyTorch computes it in one process")
    lines = [f"# {title(rec)}", "",
             "## Environment", "",
             f"- torch {v.get('torch', '?')}, DeepSpeed {v.get('deepspeed', '?')}"
             + (f", transformers {v['transformers']}" if v.get("transformers") else ""),
             f"- world size {rec['world_size']} ({rec.get('device', 'cpu')}"
             + (", gloo, `DS_ACCELERATOR=cpu`)" if rec.get("device", "cpu") == "cpu" else ", nccl)"),
             f"- model: {case.get('model') or 'mlp'} (the kit's toy model; the script below builds it)", "",
             "## The smallest config that shows it", ""]
    if when:
        lines += [f"Among the configurations swept, the affected ones are exactly: {when}.", ""]
    lines += ["```json", json.dumps(case.get("ds_config") or cfg, indent=1, sort_keys=True), "```", "",
              f"Loop: **{loop}**: {LOOPS.get(loop, loop)}.", "",
              "## What happens", "",
              f"With SGD at lr = 1 (no momentum, no weight decay) the applied update is the gradient. Each step should "
              f"be {expected}. What ZeRO-{stage} applied, step by step (fitted weights: least squares of the applied "
              "step on each micro-batch's own gradient, as multiples of the right weight):", "",
              steps_table(rec), "",
              f"Verdict: **{rec['verdict']}**: {rec.get('reason', '')}", "",
              "## Since when", ""]
    lines += bisect_section(bisect_doc, bisect_cmd)
    lines += ["## Reproduction", "",
              "Standalone: plain DeepSpeed and torch, no other import. Run it with "
              f"`torchrun --standalone --nproc_per_node={rec['world_size']} {script}`"
              + (" (on CPU with `DS_ACCELERATOR=cpu`)" if rec.get("device", "cpu") == "cpu" else "")
              + "; it prints one JSON line (per step: ratio, cosine, relative error, fitted weights) and exits 1 "
              "when a step is off.", "",
              "```python", repro_source.rstrip(), "```", "",
              f"What it printed when the kit ran it (exit status {repro_exit}):", "",
              "```", (repro_output or "(nothing)").strip()[-4000:], "```", ""]
    return "\n".join(lines)


def from_check(path: Path, loop: str | None, out: Path, bisect_doc: dict | None, world_size: int | None = None) -> Path:
    """The report of a ``gradkit check --json`` result's affected loop: its reproduction written and run here."""
    doc = json.loads(path.read_text())
    recs = doc.get("records") or [r for p in (doc.get("precisions") or {}).values() for r in p.get("records") or []]
    affected = [r for r in recs if r.get("role") == "measured" and r.get("verdict") == oracle.AFFECTED
                and (loop is None or r["config"].get("loop") == loop)]
    if not affected:
        raise kconfig.ConfigError(f"{path}: no affected loop{f' {loop!r}' if loop else ''} to report (the check's "
                                  "affected loops: " + (", ".join(sorted({r['config'].get('loop') for r in recs
                                                                          if r.get('verdict') == oracle.AFFECTED}))
                                                        or "none") + ")")
    rec = affected[0]
    script = out.with_suffix(".repro.py")
    repro.write(rec, script, title(rec))
    stack = {} if not rec.get("stack") else rec["stack"]
    rc, text = repro.verify(script, rec["world_size"], stack, rec.get("device", "cpu"))
    out.write_text(render(rec, script.name, script.read_text(), text, rc, None, bisect_doc,
                          bisect_command(doc.get("config_file") or "<your ds_config.json>", rec)))
    return out


def from_sweep(folder: Path, group: str, out: Path | None, bisect_doc: dict | None) -> Path:
    """The report of a sweep's unknown group (named by its reproduction script), from the sweep's own run of it."""
    summary = json.loads((folder / "summary.json").read_text())
    name = group if group.endswith(".py") else f"{group}.py"
    found = [(st, g) for st in summary["stacks"] for g in st["groups"] if (g.get("repro") or {}).get("script") == name]
    if not found:
        names = [g["repro"]["script"] for st in summary["stacks"] for g in st["groups"] if g.get("repro")]
        raise kconfig.ConfigError(f"{folder}: no unknown group with the reproduction {name}; its groups: "
                                  + (", ".join(names) or "none (no unknown group)"))
    st, g = found[0]
    recs = {r["id"]: r for r in records.load(folder / "records.jsonl") if r.get("stack") == st["stack"]}
    rec = recs[g["example"]]
    out = out or folder / name.replace("repro_", "report_").replace(".py", ".md")
    text = render(rec, name, (folder / name).read_text(), g["repro"]["output"], g["repro"]["exit"],
                  when_text(g["when"]), bisect_doc, bisect_command(folder / g.get("config", "config.json"), rec))
    out.write_text(text)
    return out


def from_watch(path: Path, out: Path | None, bisect_doc: dict | None) -> Path:
    """The report of a real job's affected steps, from the records ``gradkit.watch`` wrote (``watch.jsonl``): the
    job's releases and setup, every judged step, the known bug it matches, and how to reproduce it (the job itself
    with the watch on it; on DeepSpeed, also the replica: ``gradkit check`` on the job's own config)."""
    file = path / "watch.jsonl" if path.is_dir() else path
    if not file.exists():
        raise kconfig.ConfigError(f"{path}: no watch.jsonl (the records gradkit.watch writes into its output folder)")
    recs = [r for r in records.load(file) if r.get("probe") == "watch"]
    applied = [r for r in recs if "logged_norm" not in r and (r.get("measured") or {}).get("metrics")]
    bad = [r for r in recs if r.get("verdict") == oracle.AFFECTED]
    if not bad:
        raise kconfig.ConfigError(f"{file}: no affected step to report ({len(recs)} records: "
                                  + (", ".join(sorted({r['verdict'] for r in recs})) or "none") + ")")
    first, v = (applied or bad)[0], (bad[0].get("versions") or {})
    m = ((bad[0].get("measured") or {}).get("metrics")) or {}
    what = bad[0].get("matches") if bad[0].get("matches") not in (None, "none") else "not the mean over the global batch"
    stack = ", ".join(f"{k} {x}" for k, x in v.items())
    lines = [f"# [{stack}] the gradient the optimizer consumes is {what}"
             + (f" (norm ratio {m['norm_ratio']:.3f}, cosine {m['cosine']:.4f})" if m else ""), "",
             "## Environment", "", f"- {stack}", f"- world size {first['world_size']}", "",
             "## The job", "",
             f"- loss as meant: {first.get('loss')} over every rank and micro-batch; {first.get('ga')} micro-batches "
             f"per rank per step ({first.get('per_rank')}), precision judged at {first.get('dtype')}",
             f"- the gradient read where the optimizer consumes it: {first.get('read')}"
             + (f" of {first['optimizer']}, ZeRO stage {first.get('zero_stage')}, config GA {first.get('engine_ga')}"
                if first.get("optimizer") else ""), "",
             "## What happens", "",
             "Each judged step's consumed gradient against the exact gradient of its global batch (fp32, plain "
             "autograd on the same micro-batches and starting weights; fitted weights over each micro-batch's own "
             "gradient, as multiples of its right weight):", "",
             "| step | verdict | norm ratio | cosine | rel. error | misplaced weight | the step is |",
             "|---|---|---|---|---|---|---|"]
    for r in recs:
        mm, att = ((r.get("measured") or {}).get("metrics")) or {}, ((r.get("measured") or {}).get("attribution")) or {}
        if "logged_norm" in r:
            lines.append(f"| {r['step']} (logged grad norm) | {r['verdict']} | "
                         f"{r['logged_norm'] / r['reference_norm']:.4f} | - | - | - | - |")
        elif mm:
            lines.append(f"| {r['step']} | {r['verdict']} | {mm['norm_ratio']:.4f} | {mm['cosine']:.5f} | "
                         f"{mm['rel_l2']:.2e} | {att.get('misplaced_weight', float('nan')):.4f} | "
                         f"{r.get('shape') or r.get('matches') or '-'} |")
    known = next((r["known"] for r in bad if r.get("known")), None)
    lines += ["", f"Known bug: {known or 'none named'}.", "", "## Since when", ""]
    lines += bisect_section(bisect_doc, "gradkit bisect --known <bug> (a known bug), or gradkit bisect <config> "
                                        "(the replica of this job's config)")
    lines += ["## Reproduction", "", "The job itself, with one line added (`gradkit.watch`: its records are this "
              "report's source; `docs/watch.md`)."]
    if first.get("ds_config"):
        lines += ["", "The replica, on the kit's toy model with the job's own DeepSpeed config (write it to "
                  "`ds_config.json`, then `gradkit check ds_config.json --loop "
                  + ("manual" if first.get("engine_ga") == 1 and (first.get("ga") or 1) > 1 else "engine") + "`):",
                  "", "```json", json.dumps(first["ds_config"], indent=1, sort_keys=True), "```"]
    out = out or file.with_name("report.md")
    out.write_text("\n".join(lines) + "\n")
    return out


def parser():
    p = kconfig.Parser(prog="gradkit report", description=__doc__.split("\n\n")[0])
    p.add_argument("source", help="a gradkit check --json file, a sweep's output folder (with --group), or the "
                                  "watch's output folder / watch.jsonl")
    p.add_argument("--group", help="with a sweep folder: the unknown group, by its reproduction script's name")
    p.add_argument("--loop", help="with a check result: the affected loop to report (default: the first)")
    p.add_argument("--bisect", help="a gradkit bisect --json file: the release range and the code that changed")
    p.add_argument("--out", help="where report.md goes (default: report.md beside a check result; "
                                 "report_<group>.md in a sweep folder)")
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    src = Path(a.source)
    if not src.exists():
        raise kconfig.ConfigError(f"{src}: no such file or folder")
    bisect_doc = None
    if a.bisect:
        try:
            bisect_doc = json.loads(Path(a.bisect).read_text())
        except (OSError, ValueError) as e:
            raise kconfig.ConfigError(f"--bisect {a.bisect}: not a gradkit bisect --json file ({e})") from None
    out = Path(a.out) if a.out else None
    if out and not out.parent.exists():
        raise kconfig.ConfigError(f"--out {out}: the folder {out.parent} does not exist")
    if src.name == "watch.jsonl" or src.is_dir() and (src / "watch.jsonl").exists():
        path = from_watch(src, out, bisect_doc)
    elif src.is_dir():
        if not a.group:
            raise kconfig.ConfigError(f"{src} is a sweep folder: name the group with --group repro_<...>")
        if not (src / "summary.json").exists():
            raise kconfig.ConfigError(f"{src}: no summary.json (not a finished sweep's folder)")
        path = from_sweep(src, a.group, out, bisect_doc)
    else:
        path = from_check(src, a.loop, out or src.with_name("report.md"), bisect_doc)
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    kconfig.run_cli(main)
