"""Notebook 09's logic: real training jobs with the watch on them (``examples/watch``), run as users run them
(torchrun, W ranks), their records read back, tabulated, drawn over the run's steps, and checked against an
expectation that does not come from the watch: the bug table (``gradkit.judge.expectations``) for a job on a release
with or without a known bug, the defect the job plants in itself (a ``compute_loss`` that forgets to divide, a
packing collator that counts each sequence's first token) for the others."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from gradkit import config as kconfig
from gradkit.judge import expectations, oracle
from gradkit.launch import scripts
from gradkit.stacks import extras
from gradkit.watch import known

JOBS_DIR = kconfig.REPO_ROOT / "examples" / "watch"
PACKAGES = {"trainer_job.py": ("transformers", "accelerate"), "trl_job.py": ("transformers", "accelerate"),
            "accelerate_job.py": ("accelerate",), "deepspeed_job.py": ("deepspeed",), "fsdp2_job.py": ("torch",)}
EXTRAS = {"trl_job.py": "trl"}  # a job's extra package set (gradkit.stacks.extras), not in the kit's environment
EXPECTS = (oracle.AFFECTED, oracle.NOT_AFFECTED)
TIE = known.TIE  # the watch's sentence where several known bugs are expected and the step does not tell them apart


def check_notebook(p: dict) -> list:
    """Every parameter of notebook 09 (``gradkit.notebooks.runall`` runs it before any kernel). The jobs install the
    overlays they name themselves: nothing for the prefetch."""
    kconfig.check_list("JOBS", p["JOBS"])
    for job in p["JOBS"]:
        if not isinstance(job, dict) or not {"name", "job", "args", "expect"} <= set(job):
            raise kconfig.ConfigError(f"JOBS: each job is a mapping with name, job, args, expect (and stack), got {job!r}")
        if job["job"] not in PACKAGES:
            raise kconfig.ConfigError(f"JOBS: {job['name']}: job must be one of {', '.join(PACKAGES)}, got {job['job']!r}")
        expect = job["expect"]
        if not (expect in EXPECTS or isinstance(expect, dict) and expect.get("bug") in expectations.KNOWN):
            raise kconfig.ConfigError(f"JOBS: {job['name']}: expect is {' or '.join(EXPECTS)} (a defect the job "
                                      f"plants) or {{'bug': ID, 'case': ...}} (the bug table), got {expect!r}")
        for package, version in (job.get("stack") or {}).items():
            kconfig.check_version(version)
    kconfig.check_positive_int("WORLD_SIZE", p["WORLD_SIZE"])
    kconfig.check_positive_int("TIMEOUT_S", p["TIMEOUT_S"])
    return []


def launch(script: str, args: list, world_size: int = 2, stack: dict | None = None, timeout_s: float = 300,
           env: dict | None = None, paths=()):
    """``(exit status, stdout, stderr)`` of one example job (``examples/watch/<script>``) under torchrun, on
    ``stack``, with the extra packages it needs (``EXTRAS``) and ``paths`` on its ranks' path (and ``env`` in their
    environment)."""
    paths = [*paths, *([extras.ensure(EXTRAS[script])] if script in EXTRAS else [])]
    return scripts.torchrun(JOBS_DIR / script, args, world_size=world_size, stack=stack, packages=PACKAGES[script],
                            timeout_s=timeout_s, paths=paths, env=env)


def run(jobs: list, out, world_size: int = 2, timeout_s: int = 300) -> dict:
    """``{name: {"records", "rc", "tail"}}``: each job run with torchrun, its records from its output folder."""
    results = {}
    for k, job in enumerate(jobs):
        folder = Path(out) / f"watch_{k}"
        for old in (folder, folder.with_name(folder.name + "-trainer"), folder.with_name(folder.name + "-trl")):
            shutil.rmtree(old, ignore_errors=True)  # this notebook's own job folders: a rerun starts them afresh
        rc, stdout, stderr = launch(job["job"], [*job["args"], "--out", folder], world_size=world_size,
                                    stack=job.get("stack") or None, timeout_s=timeout_s)
        file = folder / "watch.jsonl"
        recs = [json.loads(x) for x in file.read_text().splitlines()] if file.exists() else []
        results[job["name"]] = {"records": recs, "rc": rc, "tail": (stdout + stderr)[-1500:], "job": job}
    return results


def expected(job: dict, rec: dict) -> str | None:
    """What the job's step must be, from outside the watch: the defect it plants, or the bug table on the releases
    the job's ranks imported (None: the table does not pin them)."""
    want = job["expect"]
    if isinstance(want, str):
        return want
    return expectations.expected(want["bug"], rec.get("versions") or {}, case=want.get("case"),
                                 zero_stage=want.get("zero_stage"), ga=want.get("ga"))


def applied(recs: list) -> list:
    """The records of the applied steps (not the logged-norm verdicts beside them)."""
    return [r for r in recs if "logged_norm" not in r]


def rows(results: dict) -> list[dict]:
    out = []
    for name, res in results.items():
        for r in res["records"]:
            m = (r.get("measured") or {}).get("metrics") or {}
            att = (r.get("measured") or {}).get("attribution") or {}
            out.append({"job": name, "step": r["step"], "what": "logged norm" if "logged_norm" in r else "applied step",
                        "verdict": r["verdict"], "ratio": f"{m['norm_ratio']:.4f}" if m else
                        (f"{r['logged_norm'] / r['reference_norm']:.4f}" if "logged_norm" in r else "-"),
                        "cosine": f"{m['cosine']:.5f}" if m else "-",
                        "misplaced": f"{att['misplaced_weight']:.2e}" if att else "-",
                        "the step is": r.get("matches") or "-", "known bug": (r.get("known") or "-")[:90]})
    return out


def names(known: str, bug: str) -> bool:
    """Whether the watch's sentence names ``bug`` as what explains the step: first, or in a tie it says it cannot
    break; a sentence that only mentions the bug ("not explained by any known bug: B5 is expected here, but ...")
    does not."""
    return known.startswith(f"{bug} (") or known.startswith(TIE) and f"{bug} (" in known


def problems(results: dict) -> list[str]:
    """What the notebook claims, checked: every job ran; every step it judged has the expected verdict, the step
    judged by both its verdicts where the Trainer logged a grad norm (a step is affected where its applied step or
    its logged norm is: clipping can make the applied step right while the gradient was not, as a ``compute_loss``
    that forgets to divide leaves it; it is not-affected where both are); an affected job names a known bug where the
    table expects one."""
    out = []
    for name, res in results.items():
        recs = applied(res["records"])
        if res["rc"] != 0 or not recs:
            out.append(f"{name}: the job failed (exit {res['rc']}): {res['tail'][-300:]}")
            continue
        logged = {r["step"]: r for r in res["records"] if "logged_norm" in r}
        for r in recs:
            want = expected(res["job"], r)
            verdicts = [r["verdict"]] + ([logged[r["step"]]["verdict"]] if r["step"] in logged else [])
            seen = oracle.AFFECTED if oracle.AFFECTED in verdicts else \
                oracle.NOT_AFFECTED if set(verdicts) == {oracle.NOT_AFFECTED} else r["verdict"]
            if want is None:
                out.append(f"{name}: step {r['step']}: the bug table does not pin {r.get('versions')}")
            elif seen != want:
                said = "; its logged norm " + logged[r["step"]]["verdict"] if r["step"] in logged else ""
                out.append(f"{name}: step {r['step']} is {r['verdict']}{said}, expected {want}: {r['line'][:200]}")
            elif want == oracle.AFFECTED and isinstance(res["job"]["expect"], dict) and \
                    not names(r.get("known") or "", res["job"]["expect"]["bug"]):
                out.append(f"{name}: step {r['step']} is affected but not named {res['job']['expect']['bug']}: "
                           f"{r.get('known')}")
    return out


def plot(results: dict, title: str = "the watch over each job's judged steps"):
    """Norm ratio and cosine of each job's applied steps over the run's steps: one line colour per job (the legend
    below), the marker its verdict (a cross: affected; a dot: not-affected; a square: anything else)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    from gradkit.notebooks.plot_style import SMALL

    fig, (ax_r, ax_c) = plt.subplots(1, 2, figsize=(12, 4.6))
    colours = plt.get_cmap("tab10").colors
    markers = {oracle.AFFECTED: "X", oracle.NOT_AFFECTED: "o"}
    lines = []
    for k, (name, res) in enumerate(results.items()):
        recs = [r for r in applied(res["records"]) if (r.get("measured") or {}).get("metrics")]
        colour = colours[k % len(colours)]
        for ax, key in ((ax_r, "norm_ratio"), (ax_c, "cosine")):
            steps = [r["step"] for r in recs]
            values = [r["measured"]["metrics"][key] for r in recs]
            line, = ax.plot(steps, values, "-", color=colour, lw=1.2, alpha=0.8)
            for x, y, r in zip(steps, values, recs):
                ax.plot([x], [y], markers.get(r["verdict"], "s"), color=colour, ms=9, mec="black", mew=0.5)
        lines.append((line, name))
    for ax, what in ((ax_r, "consumed / reference norm ratio"), (ax_c, "cosine with the reference")):
        ax.axhline(1.0, color="black", lw=0.6, ls=":")
        ax.set_title(what, fontsize=10)
        ax.set_xlabel("optimizer step", fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=SMALL)
    verdicts = [plt.Line2D([], [], marker=m, ls="", color="#555555", ms=8) for m in markers.values()]
    fig.legend([ln for ln, _ in lines] + verdicts, [n for _, n in lines] + list(markers), fontsize=SMALL,
               loc="lower center", ncol=min(4, len(lines) + 2), frameon=False)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.06 + 0.045 * ((len(lines) + 1) // 4), 1, 1))
    return fig
