"""The support range, proven: gradkit installed from its wheel into fresh virtual environments that are not the kit's
(torch 2.13.0 from this machine's wheel, every other release from the index), the watch's example jobs (the Trainer,
TRL, Accelerate, DeepSpeed) run there on 2 ranks and judged as the bug table expects, and ``gradkit check`` run on
the environment's own stack; the table of docs/watch.md from the result.

    .venv/bin/python scripts/support_range.py                     # every environment of ENVS (about 10 min)
    .venv/bin/python scripts/support_range.py --only oldest       # one of them
    .venv/bin/python scripts/support_range.py --readme [docs/watch.md]   # runs/support/support.json as that table

Each environment: a new venv, its stack installed first (as a user's environment is), ``pip freeze`` taken, then the
wheel installed and ``pip freeze`` taken again: any release of the user's that changed fails the environment. The
jobs' verdicts are checked by notebook 09's own check (``gradkit.notebooks.watch.problems``): against the bug table
for the releases each job's ranks imported, or against the defect the job plants in itself.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from gradkit.notebooks import readme_tables
from gradkit.notebooks import watch as nbwatch

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "runs" / "support"
PAGE = "docs/watch.md"  # the page whose <!-- gradkit:table SUPPORT --> block --readme writes without a file
TORCH = "torch==2.13.0"  # the only torch this machine has (a CPU wheel on its disk)
TRL_DEPS = ("datasets",)  # TRL's SFTTrainer takes a datasets.Dataset
ENVS = {
    # torch alone: the watch on a plain torch job (FSDP2), the check on torch's own path, and a DeepSpeed config refused
    # in one sentence where DeepSpeed is not installed
    "torch only": {"jobs": [("FSDP2, mean over micro-batches", "fsdp2_job.py", ["--loop", "mean"], "not-affected"),
                            ("FSDP2, a loop that does not divide", "fsdp2_job.py", ["--loop", "sum"], "affected")],
                   "checks": [("--path fsdp2", ["--path", "fsdp2"], (0, 1)),
                              ("a DeepSpeed config", ["CONFIG"], (2,))]},
    # the oldest releases the kit claims (pyproject.toml's floors): the Trainer with B1 (TRL's trainers are the
    # Trainer's, B1 with it), Accelerate after ACC's fix, DeepSpeed with B5 (before B3, which the table does not
    # assert below its start)
    "oldest": {"transformers": "4.46.3", "accelerate": "1.0.1", "deepspeed": "0.16.9", "trl": "0.12.2",
               "jobs": [
                   ("Trainer, padded rows", "trainer_job.py", ["--collator", "pad"], {"bug": "B1"}),
                   ("Trainer, compute_loss without /N", "trainer_job.py", ["--collator", "pad", "--custom-loss"],
                    "affected"),
                   ("TRL SFT", "trl_job.py", ["--fp32"], {"bug": "B1"}),
                   ("Accelerate sync_each_batch", "accelerate_job.py", ["--sync-each-batch"],
                    {"bug": "ACC", "case": "sync_each_batch", "ga": 4}),
                   ("DeepSpeed ZeRO-2 offload, its own loop", "deepspeed_job.py",
                    ["--stage", "2", "--loop", "engine", "--offload"], {"bug": "B5"}),
               ],
               "checks": [("a DeepSpeed config", ["CONFIG"], (0, 1))]},
    # the newest: the kit's own pins (constraints.txt), here in an environment that is not the kit's
    "newest": {"transformers": "5.23.0", "accelerate": "1.15.0", "deepspeed": "0.19.8", "trl": "1.16.0",
               "jobs": [
                   ("Trainer, padded rows", "trainer_job.py", ["--collator", "pad"], {"bug": "HFT", "case": "trainer"}),
                   ("Trainer, compute_loss without /N", "trainer_job.py", ["--collator", "pad", "--custom-loss"],
                    "affected"),
                   ("TRL SFT, packed, bf16", "trl_job.py", ["--packing"], "not-affected"),
                   ("TRL SFT, per-rank token mean", "trl_job.py", ["--fp32", "--per-rank-mean"], "affected"),
                   ("Accelerate sync_each_batch", "accelerate_job.py", ["--sync-each-batch"],
                    {"bug": "ACC", "case": "sync_each_batch", "ga": 4}),
                   ("DeepSpeed ZeRO-2, 4 backward per step", "deepspeed_job.py", ["--stage", "2", "--loop", "manual"],
                    {"bug": "B3", "case": "manual", "zero_stage": 2}),
                   ("DeepSpeed ZeRO-2 offload, its own loop", "deepspeed_job.py",
                    ["--stage", "2", "--loop", "engine", "--offload"], {"bug": "B5"}),
               ],
               "checks": [("a DeepSpeed config", ["CONFIG"], (0, 1))]},
}
STACK = ("transformers", "accelerate", "deepspeed", "trl")
# a DeepSpeed config the check judges (a shipped one, its precision "auto")
CHECK_CONFIG = REPO / "tests" / "configs" / "corpus" / "chinese-llama-alpaca__ds_zero2_no_offload.json"


def sh(cmd, timeout=1800, check=True, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))[:200]} failed ({out.returncode}): {out.stderr[-2000:]}")
    return out


def freeze(python: Path) -> dict[str, str]:
    lines = sh([python, "-m", "pip", "list", "--format", "json", "--disable-pip-version-check"]).stdout
    return {p["name"].lower().replace("_", "-"): p["version"] for p in json.loads(lines)}


def build_wheel() -> Path:
    dist = OUT / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    # the sdist, then the wheel built from it, as a release is made
    sh([sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, REPO])
    return next(dist.glob("gradkit-*.whl"))


def job_env(venv: Path) -> dict:
    """What a user's shell would have: the venv's interpreter first, none of the kit's own path or variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRADKIT_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="",
               OMP_NUM_THREADS="1", LOCAL_SIZE="2", TORCH_EXTENSIONS_DIR=str(venv / "torch_extensions"),
               GRADKIT_CACHE=str(venv / "gradkit-cache"))
    return env


def measure(name: str, spec: dict, wheel: Path) -> dict:
    venv = OUT / name
    shutil.rmtree(venv, ignore_errors=True)
    t0 = time.monotonic()
    sh([sys.executable, "-m", "venv", venv])
    py = venv / "bin" / "python"
    pip = [py, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    sh([*pip, "--upgrade", "pip", "setuptools", "wheel"])
    sh([*pip, TORCH])
    # the user's stack, as it already is before gradkit arrives (DeepSpeed is an sdist built against that torch)
    hf = [f"{p}=={spec[p]}" for p in ("transformers", "accelerate", "trl") if p in spec]
    if hf:
        sh([*pip, *hf, *(TRL_DEPS if "trl" in spec else ())])
    if "deepspeed" in spec:
        sh([*pip, "--no-build-isolation", f"deepspeed=={spec['deepspeed']}"], env={**os.environ, "DS_BUILD_OPS": "0"})
    before = freeze(py)
    sh([*pip, wheel])
    after = freeze(py)
    changed = {k: f"{before[k]} -> {after.get(k, 'removed')}" for k in before if after.get(k) != before[k]}
    added = {k: after[k] for k in after if k not in before}
    site = next((venv / "lib").glob("python*/site-packages"))
    size = {"wheel_bytes": wheel.stat().st_size,  # what pip installed of gradkit, its bytecode included
            "installed_bytes": sum(f.stat().st_size for d in site.glob("gradkit*") for f in d.rglob("*") if f.is_file())}
    setup_s = time.monotonic() - t0
    results, env = {}, job_env(venv)
    for k, (label, script, args, expect) in enumerate(spec["jobs"]):
        folder = venv / "jobs" / f"watch_{k}"
        cmd = [py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", REPO / "examples" / "watch" /
               script, *args, "--out", folder]
        folder.parent.mkdir(parents=True, exist_ok=True)
        out = sh(cmd, timeout=900, check=False, env=env, cwd=folder.parent)
        file = folder / "watch.jsonl"
        recs = [json.loads(x) for x in file.read_text().splitlines()] if file.exists() else []
        results[label] = {"records": recs, "rc": out.returncode, "tail": (out.stdout + out.stderr)[-1500:],
                          "job": {"name": label, "job": script, "args": args, "expect": expect}}
    problems = nbwatch.problems(results)
    checks = {}
    for label, args, exits in spec["checks"]:
        args = [CHECK_CONFIG if a == "CONFIG" else a for a in args]
        out = sh([venv / "bin" / "gradkit", "check", *args], timeout=900, check=False, env=env, cwd=venv)
        said = out.stdout.strip().splitlines() or out.stderr.strip().splitlines()[-1:]  # a refusal is on stderr
        checks[label] = {"exit": out.returncode, "expected": list(exits), "first_line": said[0] if said else "",
                         "verdict_line": said[-1] if said else ""}
    return {"env": name, "versions": {p: after.get(p, "-") for p in ("torch", *STACK)},
            "pip_changed": changed, "pip_added": added, "setup_s": round(setup_s, 1), "size": size,
            "jobs": {label: {"steps": steps(res["records"]), "rc": res["rc"]} for label, res in results.items()},
            "problems": problems, "checks": checks,
            "wall_s": round(time.monotonic() - t0, 1)}


def steps(recs: list[dict]) -> list[dict]:
    """Each judged step: its applied step's verdict, its logged grad norm's where the Trainer logged one, and the
    known bug the watch named (several where it said it cannot tell them apart)."""
    logged = {r["step"]: r["verdict"] for r in recs if "logged_norm" in r}
    out = []
    for r in nbwatch.applied(recs):
        known = r.get("known") or ""
        named = re.findall(r"(?:^|; )(\w+) \(", known.split(": ", 1)[1] if known.startswith(nbwatch.TIE) else known)
        out.append({"step": r["step"], "verdict": r["verdict"], "logged": logged.get(r["step"]),
                    "named": "/".join(named[:1] if not known.startswith(nbwatch.TIE) else named)})
    return out


def said(job: dict) -> str:
    """``affected (B5), affected (B5)``: each step's verdict (its logged norm's where that differs), the bug named."""
    out = []
    for st in job["steps"]:
        text = st["verdict"] + (f" (logged norm {st['logged']})" if st["logged"] not in (None, st["verdict"]) else "")
        out.append(text + (f" {st['named']}" if st["named"] else ""))
    return ", ".join(out) or f"no step judged (exit {job['rc']})"


def table(rows: list[dict]) -> str:
    body = []
    for r in rows:
        v = r["versions"]
        jobs = sum(1 for j in r["jobs"].values() if j["rc"] == 0 and j["steps"])
        verdicts = "; ".join(f"{label}: {said(j)}" for label, j in r["jobs"].items())
        body.append({"environment": r["env"], "torch": v["torch"], "transformers": v["transformers"],
                     "accelerate": v["accelerate"], "deepspeed": v["deepspeed"], "trl": v["trl"],
                     "installing gradkit changed": ", ".join(r["pip_changed"]) or "nothing",
                     "and added": ", ".join(f"{k} {v}" for k, v in r["pip_added"].items()),
                     "gradkit's wheel / installed": (f"{r['size']['wheel_bytes'] / 1e6:.1f} MB / "
                                                     f"{r['size']['installed_bytes'] / 1e6:.1f} MB" if "size" in r
                                                     else "not measured yet"),
                     "jobs as the table expects": f"{jobs - len(r['problems'])} of {len(r['jobs'])}" if
                     not r["problems"] else f"**{len(r['problems'])} problem(s)**",
                     "each job's judged steps (the bug named)": verdicts,
                     "gradkit check (exit)": "; ".join(f"{label}: {c['exit']}" + ("" if c["exit"] in c["expected"] else
                                                                                  " **unexpected**")
                                                        for label, c in r["checks"].items())})
    return readme_tables.markdown_table(body, list(body[0]))


def write_page(page: Path, rows: list[dict]) -> None:
    name = page.relative_to(REPO).as_posix() if page.is_relative_to(REPO) else str(page)
    text = (f"<sub>measured by `.venv/bin/python scripts/support_range.py`, written by "
            f"`python scripts/support_range.py --readme {name}`: fresh venvs on a {os.cpu_count()}-core CPU machine, gloo, 2 ranks, Python "
            f"{sys.version_info.major}.{sys.version_info.minor}</sub>\n\n{table(rows)}\n")
    before = page.read_text()
    after, done = readme_tables.fill(before, {"SUPPORT": text})
    page.write_text(after)
    print(f"{page}: {'replaced the support table' if done else 'has no <!-- gradkit:table SUPPORT --> block'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=list(ENVS), action="append", help="measure only this environment")
    ap.add_argument("--readme", nargs="?", const=PAGE, help="write runs/support/support.json into that page's table")
    args = ap.parse_args()
    file = OUT / "support.json"
    if args.readme:
        write_page(REPO / args.readme, json.loads(file.read_text()))
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    wheel = build_wheel()
    old = {r["env"]: r for r in (json.loads(file.read_text()) if file.exists() else [])}
    for name in args.only or list(ENVS):
        old[name] = row = measure(name, ENVS[name], wheel)
        print(json.dumps(row, indent=1))
        file.write_text(json.dumps([old[n] for n in ENVS if n in old], indent=1))
    bad = [r for r in old.values() if r["problems"] or r["pip_changed"] or
           any(c["exit"] not in c["expected"] for c in r["checks"].values())]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
