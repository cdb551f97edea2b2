"""An upstream issue's text, from one affected record: its title, the steps' table, the release range a bisect found,
and the whole issue (``render``) with its standalone reproduction and what it printed. ``gradkit report`` writes
it for a check, a sweep's group or the watch; the sweep writes one per unknown group.
"""
from __future__ import annotations

import json

from gradkit.commands.bisect import diff, search

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
