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
from gradkit.commands import fix, repro
from gradkit.commands.issue import bisect_command, bisect_section, render, title
from gradkit.commands.sweep.grouping import when_text
from gradkit.judge import oracle, records

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
    p.add_argument("source", nargs="?", help="a gradkit check --json file, a sweep's output folder (with --group), "
                                             "or the watch's output folder / watch.jsonl")
    p.add_argument("--known", help="instead of a source: a known bug with no fix upstream (" + ", ".join(fix.FIXES)
                   + "), written up with the kit's patch, verified on the release and on it patched (docs/reports/)")
    p.add_argument("--deepspeed", default=kconfig.INSTALLED, help="with --known: the release the patch is verified on "
                                                                  "(default: the installed one)")
    p.add_argument("--sweep", default=fix.SWEEP, help="with --known: the sweep spec run on both sides (fp16 added "
                                                      "where it has a dtype axis without it), or none")
    p.add_argument("--no-progress", action="store_true", help="with --known: no progress bar for the sweep")
    p.add_argument("--group", help="with a sweep folder: the unknown group, by its reproduction script's name")
    p.add_argument("--loop", help="with a check result: the affected loop to report (default: the first)")
    p.add_argument("--bisect", help="a gradkit bisect --json file: the release range and the code that changed")
    p.add_argument("--out", help="where report.md goes (default: report.md beside a check result; "
                                 "report_<group>.md in a sweep folder; with --known, the folder docs/reports/<BUG>)")
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    if a.known:
        return from_known(a)
    if not a.source:
        raise kconfig.ConfigError("gradkit report needs a source (a check --json file, a sweep folder, the watch's "
                                  "records) or --known BUG")
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


def from_known(a) -> int:
    """``--known``: the bug's report and its fix verified (``gradkit.commands.fix``); exit 0 where every judgement went
    the way a fix must, 3 where one did not (the report says which)."""
    bug = fix.parse_bug(a.known)
    if bug not in fix.FIXES:
        raise kconfig.ConfigError(f"--known {a.known}: the kit holds a verified fix for {', '.join(fix.FIXES)} only")
    sweep = None if a.sweep == "none" else a.sweep
    if sweep and not kconfig.repo_path(sweep).exists():
        raise kconfig.ConfigError(f"--sweep {a.sweep}: no such spec")
    out = Path(a.out) if a.out else fix.default_out(bug)
    doc = fix.verify(bug, fix.known_release(a.deepspeed), out, sweep, progress=not a.no_progress)
    print(f"written to {out / 'report.md'}: the fix is {'verified' if doc['verified'] else 'NOT verified'}")
    return 0 if doc["verified"] else 3


if __name__ == "__main__":
    kconfig.run_cli(main)
