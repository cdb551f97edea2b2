"""The watch at the size users train (issue 46), for scripts/bench.py --watch: Llamas of ~25M, ~130M and ~440M
parameters (transformers' own class from a config) trained on W = 2 and 4 CPU ranks under ZeRO-3 and FSDP2 (the
engines that shard the model: the watch's reference is sharded too) and ZeRO-2 (every rank holds the model: a whole
copy), AdamW (SGD at ~440M: the state would not fit here), ZeRO-3's model built under ``deepspeed.zero.Init`` (as the
Trainer does), GA 2 micro-batches of one row of 32 tokens, five steps of which the 3rd and 5th are judged, DeepSpeed's
buckets and live parameters at 3e7 (its defaults hold a 440M model whole)
(scripts/watch_scale_job.py, one world per row). Per row, the largest over the ranks of:

- the watch's own bytes (the judged step's record, ``held_bytes``: the copy's weights and gradient, the reference's
  pieces, the unit gathered, the sketches and their sign pattern, the recorded inputs);
- malloc's peak bytes in use during a judged step above an unjudged step's (``mallinfo2``, sampled every 2 ms);
- what stays in use after the judged step (in use after minus before it, against an unjudged step's);

each in fp32 models (4 bytes a parameter), beside the bound the issue sets (2 x the fp32 model / W + the largest
unit gathered where the engine shards the model, 2 x the fp32 model where it does not), and the judged step's time
over an unjudged one's (medians), with what it adds split in two (the records' ``seconds``): the reference's forward
and backward of every micro-batch (under FSDP2: its gathers and reduce-scatters), and the rest of the watch's work. Writes runs/bench_watch_scale.json; the sizing table of docs/watch.md is made from
it (``table``)."""
from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

GRID = [(e, s, w) for s in ("25m", "130m", "400m") for w in (2, 4) for e in ("zero3", "fsdp2")] + \
       [("zero2", s, w) for s in ("25m", "130m") for w in (2, 4)] + [("zero3 whole", "130m", 2)]


def one(engine: str, size: str, w: int, timeout_s: int = 1500) -> dict:
    from gradkit.launch import scripts

    out = Path(tempfile.mkdtemp(prefix="gradkit-scale-"))
    args = ["--engine", engine.split()[0], "--size", size, "--out", out]
    if engine.endswith("whole"):
        args += ["--shard", "off"]
    if size == "400m":  # its optimizer state does not fit beside DeepSpeed's own buffers on a 23 GB host
        args += ["--optim", "sgd"]
    t0 = time.perf_counter()
    rc, stdout, stderr = scripts.torchrun(REPO / "scripts" / "watch_scale_job.py", args, world_size=w,
                                          packages=("deepspeed", "transformers"), timeout_s=timeout_s)
    took = time.perf_counter() - t0
    ranks = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    shutil.rmtree(out, ignore_errors=True)
    if rc or len(ranks) != w:
        return {"engine": engine, "size": size, "world_size": w, "rc": rc, "tail": (stdout + stderr)[-2000:]}
    if all(v == "cannot-run" for v in ranks[0]["verdicts"]):  # the memory guard (or another refusal): said as such
        print(f"{engine:12s} {size:5s} W={w}: not judged: {ranks[0]['whys'][0]}", flush=True)
        return {"engine": engine, "size": size, "world_size": w, "rc": 0, "parameters": ranks[0]["parameters"],
                "cannot": ranks[0]["whys"][0], "unjudged_s": max(r["unjudged_s"] for r in ranks), "wall_s": took}
    model = ranks[0]["fp32_model_bytes"]
    held = [max((h or {}).get("peak", 0) for h in r["held_bytes"]) for r in ranks]  # the judgement's own peak
    extra = max(max((h or {}).get("sketches", 0) + (h or {}).get("sign pattern", 0) for h in r["held_bytes"])
                for r in ranks)
    unit = max(max((h or {}).get("gathered unit", 0) for h in r["held_bytes"]) for r in ranks)
    sharded = ranks[0]["reference"][0] == "sharded"
    secs = lambda r, keys: statistics.median(sum(x.get(k, 0.0) for k in keys) for x in r["seconds"] if x)  # noqa
    own = ("copy", "agree", "build", "gather", "read", "judgement")
    bound = (2 * model / w + unit if sharded else 2 * model) + extra  # + the sketches
    row = {"engine": engine, "size": size, "world_size": w, "parameters": ranks[0]["parameters"],
           "fp32_model_bytes": model, "reference": ranks[0]["reference"], "verdicts": ranks[0]["verdicts"],
           "held": max(held) / model, "peak_above_unjudged": max(r["peak_above_unjudged"] for r in ranks) / model,
           "window_above_unjudged": max(r["window_above_unjudged"] for r in ranks) / model,
           "stays": max(r["stays"] for r in ranks) / model, "bound": bound / model,
           "judged_over_unjudged": max(r["judged_s"] / r["unjudged_s"] for r in ranks),
           "unjudged_s": max(r["unjudged_s"] for r in ranks), "judged_s": max(r["judged_s"] for r in ranks),
           "held_bytes": ranks[0]["held_bytes"][0], "wall_s": took,
           "reference_s": max(secs(r, ("reference",)) for r in ranks), "own_s": max(secs(r, own) for r in ranks)}
    print(f"{engine:12s} {size:5s} W={w}: {row['parameters'] / 1e6:.0f}M, reference {row['reference'][0]}, "
          f"held {row['held']:.2f} (bound {row['bound']:.2f}), in the optimizer's step above an unjudged one's "
          f"{row['window_above_unjudged']:.2f}, the step's peak above {row['peak_above_unjudged']:.2f}, "
          f"stays {row['stays']:.3f} fp32 models; judged {row['judged_over_unjudged']:.2f}x an unjudged step "
          f"({row['unjudged_s']:.1f} s), of which the reference's forward and backward {row['reference_s']:.1f} s and "
          f"the rest of the watch's work {row['own_s']:.1f} s; {row['verdicts']}", flush=True)
    return row


PAGE = "docs/watch.md"  # the page whose <!-- gradkit:table SCALE --> block --readme writes


def table(res: dict, page: str = PAGE) -> str:
    """The sizing table of ``page`` from ``res`` (runs/bench_watch_scale.json)."""
    from gradkit.notebooks import readme_tables

    body = []
    for r in res["rows"]:
        if "cannot" in r:
            first = r["cannot"].split("; rank 1")[0].split("copy: ")[-1].rstrip(")")  # rank 0's sentence
            body.append({"model": f"{r['parameters'] / 1e6:.0f}M", "engine": r["engine"], "W": r["world_size"],
                         "reference": f"not judged (rank 0: {first})"})
            continue
        if "held" not in r:
            why = ("a rank was killed, out of the host's memory, in DeepSpeed's own start" if "SIGKILL" in r["tail"]
                   else f"exit {r.get('rc')}")
            body.append({"model": r["size"], "engine": r["engine"], "W": r["world_size"],
                         "reference": f"did not run ({why})"})
            continue
        body.append({"model": f"{r['parameters'] / 1e6:.0f}M", "engine": r["engine"], "W": r["world_size"],
                     "reference": r["reference"][0],
                     "the judgement's own peak": f"{r['held']:.2f}", "bound": f"{r['bound']:.2f}",
                     "malloc, in the optimizer's step, above an unjudged one's": f"{r['window_above_unjudged']:.2f}",
                     "the step's peak raised by": f"{max(r['peak_above_unjudged'], 0.0):.2f}",
                     "left after": f"{r['stays']:.3f}",
                     "judged / unjudged time": f"{r['judged_over_unjudged']:.2f}x ({r['unjudged_s']:.1f} s)",
                     "added: the reference's forward and backward + the rest":
                         f"{r['reference_s']:.1f} s + {r['own_s']:.1f} s" if "own_s" in r else "-",
                     "verdicts": ", ".join(sorted(set(r["verdicts"])))})
    return (f"<sub>measured by `.venv/bin/python scripts/bench.py --watch`, written by `python "
            f"scripts/bench_watch_scale.py --readme {page}`: {res['grid']}, gloo on {res.get('cpus', '?')} CPU cores; "
            f"bytes per rank, the largest rank's, in fp32 models (4 bytes a parameter)</sub>\n\n"
            + readme_tables.markdown_table(body, list(body[0])) + "\n")


def write_page(page: str, json_path: str) -> None:
    from gradkit.notebooks import readme_tables

    path = REPO / page
    after, done = readme_tables.fill(path.read_text(), {"SCALE": table(json.loads(Path(json_path).read_text()), page)})
    path.write_text(after)
    print(f"{page}: {'replaced the sizing table' if done else 'has no <!-- gradkit:table SCALE --> block'}")


def scale_bench(json_path: str, grid=None) -> dict:
    """Every row of ``grid`` (default ``GRID``); a partial grid replaces its rows in ``json_path``, keeping the others."""
    rows = [one(*g) for g in (grid or GRID)]
    if grid and Path(json_path).exists():
        fresh = {(r["engine"], r["size"], r["world_size"]) for r in rows}
        rows = [r for r in json.loads(Path(json_path).read_text())["rows"]
                if (r["engine"], r["size"], r["world_size"]) not in fresh] + rows
        rows.sort(key=lambda r: GRID.index((r["engine"], r["size"], r["world_size"])))
    res = {"rows": rows, "grid": "AdamW (SGD at ~440M), GA 2 x 1 row x 32 tokens, steps 3 and 5 of 5 judged",
           "cpus": os.cpu_count()}
    done = {(r["engine"], r["size"], r["world_size"]): r for r in rows if "held" in r}
    for (engine, size, w), r in done.items():  # the rows of docs/speed.md (scripts/bench_table.py)
        key = f"{engine.replace(' ', '_')}_{size}_{w}"
        res[f"time_{key}"], res[f"held_{key}"] = r["judged_over_unjudged"], r["held"]
        res[f"window_{key}"], res[f"bound_{key}"] = r["window_above_unjudged"], round(r["bound"], 2)
        if "reference_s" in r:  # an unjudged step plus the reference's forward and backward alone
            res[f"floor_{key}"] = 1.0 + r["reference_s"] / r["unjudged_s"]
    if done:
        res["stays_most"] = max(r["stays"] for r in done.values())
    Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(json_path).write_text(json.dumps(res, indent=1))
    print(f"-> {json_path}")
    return res


if __name__ == "__main__":
    if sys.argv[1:2] == ["--readme"]:  # the sizing table of docs/watch.md from runs/bench_watch_scale.json
        write_page(sys.argv[2] if len(sys.argv) > 2 else PAGE, str(REPO / "runs" / "bench_watch_scale.json"))
        sys.exit(0)
    only = [tuple(x.split(":")) for x in sys.argv[2:]]  # engine:size:W
    scale_bench(sys.argv[1] if len(sys.argv) > 1 else str(REPO / "runs" / "bench_watch_scale.json"),
                [(e.replace("_", " "), s, int(w)) for e, s, w in only] or None)
