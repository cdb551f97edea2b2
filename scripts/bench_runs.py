"""The benchmarks of scripts/bench.py that time one thing each, every one writing its JSON file under runs/: the
oracle's noise (``noise``, with DeepSpeed's fp16 engine: ``fp16_noise``), one explorer Run phase by phase
(``profile``), gradkit check and the sweep (``sweep_bench``), the default run-all warm and cold (``runall_bench``),
gradkit bisect of B5's config (``bisect_bench``), gradkit check DIR over the test corpus (``corpus_bench``), the path
checks (``paths_bench``) and the test command (``suite_bench``). ``python scripts/bench.py --help`` says which flag
runs which; ``scripts/bench_table.py`` turns the files into the performance table.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def noise(json_path: str) -> int:
    """The noise of correct engines, every signal the oracle judges: what kit/judge/tolerances.py's tolerances are set against.

    The installed DeepSpeed (B4's fix is in): the B4 probe's bf16 cases with an fp32 and a bf16 accumulator at
    GA 8 / 32 / 64 (W = 2), and the B3 probe's stages that keep every micro-batch (ZeRO-0 and ZeRO-3, fp32 and
    bf16, N = 8, W = 2), each with its rel. error, |ratio - 1|, misplaced weight and rank spread.
    """
    from gradkit.probes import bf16_leak, zero_boundary

    rows = []
    for r in bf16_leak.run(world_size=2, ga_values=(8, 32, 64), cases=("leak", "bf16_accum", "control"), timeout_s=900):
        rows.append(("B4", r["case"], r["dtype"], r["ga"], r))
    for r in zero_boundary.run(world_sizes=(2,), n_values=(1, 8), stages=(0, 3), fixes=(), timeout_s=900):
        if r["case"] == "manual" and r["ga"] == 8:
            rows.append(("B3", f"ZeRO-{r['zero_stage']}", r["dtype"], r["ga"], r))
    out = []
    for bug, case, dtype, ga, r in rows:
        m = r["metrics"]
        mis = [(r.get("attribution") or {}).get("misplaced_weight", 0.0)]
        mis += [b["attribution"]["misplaced_weight"] for b in r.get("rank_buffers") or []]
        out.append({"probe": bug, "case": case, "dtype": dtype, "GA": ga, "rel_l2": m["rel_l2"],
                    "ratio_minus_1": abs(m["norm_ratio"] - 1), "misplaced_weight": max(mis),
                    "rank_spread": max((r.get("rank_spread") or {"-": 0.0}).values()), "verdict": r["verdict"]})
        print(f"{bug} {case:11s} {dtype} GA {ga:3d}: rel. error {m['rel_l2']:.2e}, |ratio-1| {abs(m['norm_ratio'] - 1):.1e}, "
              f"misplaced {max(mis):.1e}, rank spread {out[-1]['rank_spread']:.1e} -> {r['verdict']}")
    out += fp16_noise()
    for dtype in ("fp32", "bf16", "fp16"):
        sel = [o for o in out if o["dtype"] == dtype]
        if not sel:
            continue
        print(f"{dtype}: largest noise of a correct engine: rel. error {max(o['rel_l2'] for o in sel):.2e}, "
              f"misplaced weight {max(o['misplaced_weight'] for o in sel):.2e}, rank spread {max(o['rank_spread'] for o in sel):.1e}")
    Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(json_path).write_text(json.dumps({"cpus": os.cpu_count(), "rows": out}, indent=1))
    print(f"written to {json_path}")
    return 0


def fp16_noise() -> list[dict]:
    """fp16's noise: DeepSpeed's own fp16 engine (`gradkit check`'s probe, DeepSpeed's own loop, ZeRO-1/2/3, a static
    loss scale, clip 0 and 1, W = 2, GA 8 / 32 / 64; on CPU its accelerator is told fp16 is supported, on a GPU as
    it is), and beside it the engine's arithmetic emulated in plain torch ("fp16 emulated": the kit's check model in
    fp16, loss scale 2**8, micro-batch gradients accumulated in fp16 or fp32, reduced in fp16, unscaled into fp32)."""
    import copy

    import torch

    from gradkit.judge import oracle
    from gradkit.probes import ds_config as dc
    from gradkit.probes.ranks import common as c, ds_config as rank_dc

    out = []
    for accum in ("fp16", "fp32"):
        for ga in (8, 32, 64):
            every = [b for r in range(2)
                     for b in c.micro_batches(rank_dc.SEED, r, ga, rank_dc.MICRO_BATCH, rank_dc.HIDDEN, 0)]
            model = c.tiny_mlp(rank_dc.HIDDEN, rank_dc.SEED, rank_dc.DEPTH)
            basis, weights, ref = oracle.reference_gradients(model, every, c.mse)
            half, scale, total = copy.deepcopy(model).half(), 2.0 ** 8, 0.0
            for r in range(2):
                acc = 0.0
                for x, y in every[r * ga:(r + 1) * ga]:
                    half.zero_grad(set_to_none=True)
                    (c.mse(half(x.half()), y) * scale / ga).backward()
                    g = torch.cat([p.grad.reshape(-1) for p in half.parameters()])
                    acc = acc + (g if accum == "fp16" else g.float())
                total = total + acc.half().float() / 2  # the reduction in fp16, averaged over the ranks
            eff = total.double() / scale
            m, a = oracle.compare(eff, ref), oracle.attribute(eff, basis, weights)
            out.append({"probe": "fp16 emulated", "case": f"{accum} accumulator", "dtype": "fp16", "GA": ga,
                        "rel_l2": m["rel_l2"], "ratio_minus_1": abs(m["norm_ratio"] - 1),
                        "misplaced_weight": a["misplaced_weight"], "rank_spread": 0.0, "verdict": "-"})
            print(f"fp16 emulated, {accum} accumulator, GA {ga:3d}: rel. error {m['rel_l2']:.2e}, |ratio-1| "
                  f"{abs(m['norm_ratio'] - 1):.1e}, misplaced {a['misplaced_weight']:.1e}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for stage in (1, 2, 3):
        for ga in (8, 32, 64):
            for clip in (0.0, 1.0):
                cfg = dc.resolve({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": ga,
                                  "gradient_clipping": clip, "fp16": {"enabled": True},
                                  "zero_optimization": {"stage": stage}}, 2, ga, "fp16")
                for r in dc.run(cfg, ("engine",), 2, {}, device, 900):
                    if r["role"] == "measured" and r.get("metrics"):
                        m = r["metrics"]
                        out.append({"probe": "check", "case": f"ZeRO-{stage} engine clip {clip:g}", "dtype": "fp16",
                                    "GA": ga, "rel_l2": m["rel_l2"], "ratio_minus_1": abs(m["norm_ratio"] - 1),
                                    "misplaced_weight": r["attribution"]["misplaced_weight"],
                                    "rank_spread": max((r.get("rank_spread") or {"-": 0.0}).values()),
                                    "verdict": r["verdict"]})
                        print(f"fp16 ZeRO-{stage} engine GA {ga} clip {clip:g} ({device}): rel. error {m['rel_l2']:.2e}, "
                              f"misplaced {out[-1]['misplaced_weight']:.1e} -> {r['verdict']}")
    return out


def profile(json_path: str) -> int:
    """Where the explorer's warm B3 Run goes: the caller, each rank's start-up (interpreter and ``import gradkit``,
    the imports of the stack, ``init_distributed``), and per configuration (``gradkit.probes.ranks.common.phase``)."""
    import matplotlib
    matplotlib.use("Agg")

    from gradkit import launch
    from gradkit.notebooks import explore
    from gradkit.probes import zero_boundary as zb

    _, kw = explore.probe_call(explore.default_selection("B3"))
    cases = zb.plan(kw["n_values"], kw["stages"], kw["dtypes"], kw["fixes"], kw["fix_n_values"])
    world = launch.World(world_size=2, timeout_s=600)
    launch.run_world("gradkit.launch.selftest:ping", {}, world)  # warm: comm op built, page cache
    ex = explore.ProbeExplorer(explore.default_selection("B3"), interactive=False)  # a one-shot world, profiled
    explorer_s, _ = timed(ex.run)
    warm = explore.ProbeExplorer(explore.default_selection("B3"), interactive=True)
    warm.run()
    warm_s, _ = timed(warm.run)  # the same Run in the warm world the first started
    by_bug = {}
    for bug in ("B1", "B2", "B4"):  # each probe's default explorer selection, first and warm
        ex = explore.ProbeExplorer(explore.default_selection(bug), interactive=True)
        first, _ = timed(ex.run)
        again, _ = timed(ex.run)
        by_bug[bug] = {"first_s": round(first, 2), "warm_s": round(again, 2), "status": ex.status.value[:200]}
    launch.stop_warm_worlds()
    with tempfile.TemporaryDirectory(prefix="gradkit-bench-profile-") as job:
        world_s, results = timed(lambda: launch.run_world(zb.PROBE.target, {"cases": cases}, world, keep_dir=job))
        startup = json.loads((Path(job) / "rank0.json").read_text())["timing"]
    phases: dict = {}
    for res in results[0]:
        for name, s in (res.get("phases") or {}).items():
            phases[name] = phases.get(name, 0.0) + s
    per_config = {k: round(v / len(cases), 4) for k, v in phases.items()}
    inits = [(res.get("phases") or {}).get("initialize") for res in results[0]]
    inits = [i for i in inits if i is not None]  # the controls build no engine
    ranks_s = sum(startup.values())
    out = {"cpus": os.cpu_count(), "selection": "B3 explorer default (W 2, N 4, ZeRO-2, fp32)", "configs": len(cases),
           "explorer_run_s": round(explorer_s, 2), "explorer_run_warm_s": round(warm_s, 2),
           **{f"explorer_run_warm_{bug}_s": v["warm_s"] for bug, v in by_bug.items()}, "explorer_other_probes": by_bug,
           "world_s": round(world_s, 2),
           "rank0_startup_s": {k: v for k, v in startup.items() if k != "work_s"}, "rank0_work_s": startup["work_s"],
           "launch_and_teardown_s": round(world_s - ranks_s, 2),
           "caller_outside_the_world_s": round(explorer_s - world_s, 2), "per_config_s": per_config,
           "initialize_first_engine_s": inits[0], "initialize_later_engines_s": inits[1:]}
    print(json.dumps(out, indent=1))
    Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(json_path).write_text(json.dumps(out, indent=1))
    print(f"written to {json_path}")
    return 0


SWEEP_TARGETS = {"check_warm_s": 15.0, "sweep_configs_min": 200, "sweep_s": 300.0, "speedup_min": 20.0,
                 "configs_per_min_min": 1000.0}
SWEEP_RELEASES = ("0.18.6", "installed")  # the sweep table of docs/sweep.md


def sweep_bench(json_path: str) -> int:
    """``gradkit check`` and the sweep, against their targets (``SWEEP_TARGETS``), on this machine.

    - check: ``python -m gradkit check`` of a B3-pattern config (ZeRO-2, config GA = 1, N = 4), every loop style, as a
      user runs it (a fresh process), after one warm-up run;
    - sweep: the default spec (``scripts/sweeps/default.yaml``: every model shape, 3 judged steps a point) on the
      sweep table's releases (docs/sweep.md, ``SWEEP_RELEASES``) into an empty folder, ``gradkit.commands.sweep.run.JOBS`` worlds at a
      time, the points alone (the reproductions of unknown groups are not timed), in configurations per minute;
    - side by side: a sample of the same points, one launch per point (each with its control), in configs/min.
    """
    import random
    import subprocess

    from gradkit import launch
    from gradkit.commands.sweep import run as sweep_run
    from gradkit.commands.sweep import spec as sweep_spec
    from gradkit.probes import runner
    from gradkit.probes import ds_config

    res = {"cpus": os.cpu_count(), "targets": SWEEP_TARGETS}
    with tempfile.TemporaryDirectory(prefix="gradkit-bench-sweep-") as tmp:
        cfg = Path(tmp) / "b3.json"
        cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
                                   "zero_optimization": {"stage": 2}}))
        cmd = [sys.executable, "-m", "gradkit", "check", str(cfg), "--loop", "all"]
        subprocess.run(cmd, capture_output=True, cwd=REPO)  # warm-up: overlays, comm op, page cache
        res["check_warm_s"], out = timed(lambda: subprocess.run(cmd, capture_output=True, text=True, cwd=REPO))
        res["check_exit"] = out.returncode
        spec = sweep_spec.load_spec("scripts/sweeps/default.yaml")
        spec = sweep_spec.check_spec({**spec, "stacks": runner.stacks_of(list(SWEEP_RELEASES))})
        res["sweep_configs"] = len(sweep_spec.points(spec)) * len(spec["stacks"])
        res["sweep_models"] = len(spec["axes"].get("model", ["mlp"]))
        res["sweep_steps"] = spec["steps"]
        res["sweep_s"], recs = timed(lambda: sweep_run.run(spec, Path(tmp) / "sweep", progress=False))
        res["sweep_configs_per_min_one_world"] = 60 * len(recs) / res["sweep_s"]
        res["sweep_configs_per_min"] = res["sweep_configs_per_min_one_world"]
        sample = random.Random(0).sample(sweep_spec.points(spec), 8)
        world = launch.World(world_size=spec["world_size"], timeout_s=600)

        def one_launch_each():
            for point in sample:
                case = sweep_spec.point_case(spec, point)
                launch.run_world(ds_config.CHECK.target, {"cases": sweep_run._controls([case]) + [case]}, world)

        res["one_launch_per_config_s"], _ = timed(one_launch_each)
        res["one_launch_per_config_configs"] = len(sample)
        res["sweep_configs_per_min_one_launch_each"] = 60 * len(sample) / res["one_launch_per_config_s"]
    res["speedup"] = res["sweep_configs_per_min_one_world"] / res["sweep_configs_per_min_one_launch_each"]
    res["meets"] = {"check_warm_s": res["check_warm_s"] <= SWEEP_TARGETS["check_warm_s"],
                    "sweep_configs": res["sweep_configs"] >= SWEEP_TARGETS["sweep_configs_min"],
                    "sweep_s": res["sweep_s"] <= SWEEP_TARGETS["sweep_s"],
                    "speedup": res["speedup"] >= SWEEP_TARGETS["speedup_min"],
                    "configs_per_min": res["sweep_configs_per_min"] >= SWEEP_TARGETS["configs_per_min_min"]}
    print("\n".join(f"{k:40s} {v:.2f}" if isinstance(v, float) else f"{k:40s} {v}" for k, v in res.items()))
    Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(json_path).write_text(json.dumps(res, indent=1))
    print(f"written to {json_path}")
    return 0


def runall_bench(json_path: str, cold: bool) -> int:
    """The default run-all into a temporary folder, warm, then (``cold``) from an empty kit cache."""
    from gradkit.notebooks import runall

    path = Path(json_path)
    try:
        res = json.loads(path.read_text())
    except (OSError, ValueError):
        res = {}
    res["cpus"] = os.cpu_count()
    args = ["--params", str(REPO / "scripts" / "params" / "default.yaml"), "--no-progress"]
    for kind in ("warm", "cold") if cold else ("warm",):
        with tempfile.TemporaryDirectory(prefix="gradkit-bench-runall-") as out, \
                tempfile.TemporaryDirectory(prefix="gradkit-bench-cache-") as cache:
            saved = os.environ.get("GRADKIT_CACHE")
            if kind == "cold":
                os.environ["GRADKIT_CACHE"] = cache
            try:
                res[f"runall_default_{kind}_s"], code = timed(lambda: runall.main(args + ["--out", out]))
            finally:
                if kind == "cold":
                    os.environ.pop("GRADKIT_CACHE") if saved is None else os.environ.__setitem__("GRADKIT_CACHE", saved)
            summary = json.loads((Path(out) / "summary.json").read_text())
        res[f"runall_default_{kind}_ok"] = code == 0
        res[f"runall_default_{kind}_notebooks_s"] = {e["notebook"]: e["wall_s"] for e in summary["notebooks"]}
        res[f"prefetch_{kind}_s"] = (summary.get("prefetch") or {}).get("wall_s")
        res[f"prefetch_{kind}_stacks"] = (summary.get("prefetch") or {}).get("stacks")
        print(f"run-all ({kind}): {res[f'runall_default_{kind}_s']:.1f} s, exit {code}; prefetch "
              f"{res[f'prefetch_{kind}_s']} s; " + ", ".join(f"{k} {v} s" for k, v in res[f'runall_default_{kind}_notebooks_s'].items()))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))
    print(f"written to {path}")
    return 0 if all(res.get(f"runall_default_{k}_ok", True) for k in ("warm", "cold")) else 1


BISECT_FROM = "0.14.0"  # B5's config from here to the installed release: 47 releases on the index (2026-11)
BISECT_TARGET_S = 180.0


def bisect_bench(json_path: str) -> int:
    """``gradkit bisect`` of B5's config (``gradkit.commands.bisect.known``) from ``BISECT_FROM`` to the installed release, as a
    user runs it: once to fill the kit's cache (overlays, comm ops; not timed), then timed with them cached."""
    import subprocess

    from gradkit.commands.bisect import known

    res = {"cpus": os.cpu_count(), "target_s": BISECT_TARGET_S}
    with tempfile.TemporaryDirectory(prefix="gradkit-bench-bisect-") as tmp:
        cfg = Path(tmp) / "b5.json"
        user, loop = known.RECIPES["B5"].config, known.RECIPES["B5"].loop
        cfg.write_text(json.dumps(user))
        out = Path(tmp) / "bisect.json"
        cmd = [sys.executable, "-m", "gradkit", "bisect", str(cfg), "--loop", loop, "--from", BISECT_FROM, "--no-progress",
               "--json", str(out)]
        res["cold_s"], first = timed(lambda: subprocess.run(cmd, capture_output=True, text=True, cwd=REPO))
        res["bisect_s"], again = timed(lambda: subprocess.run(cmd, capture_output=True, text=True, cwd=REPO))
        doc = json.loads(out.read_text())
    res.update(exit=again.returncode, bisect_releases=len(doc["order"]), bisect_measured=len(doc["measured"]),
               skipped=len(doc["skipped"]), changes=[c["before"] + " -> " + c["after"] for c in doc["changes"]],
               output=again.stdout[-3000:])
    res["meets"] = res["bisect_s"] <= BISECT_TARGET_S
    print("\n".join(f"{k:20s} {v}" for k, v in res.items() if k != "output"))
    Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(json_path).write_text(json.dumps(res, indent=1))
    print(f"written to {json_path}")
    return 0


PATH_CHECKS = {"fsdp2": ["--path", "fsdp2", "--model", "conditional", "--param-dtype", "bf16", "--ga", "2"],
               "accelerate": ["--path", "accelerate", "--sync-each-batch", "--dataloader-length", "10"],
               "trainer": ["--path", "trainer", "--average-tokens-across-devices", "false"]}


def corpus_bench(json_path: str) -> int:
    """``gradkit check DIR`` over the test corpus (tests/configs/corpus/, configs in the shapes well-known projects
    ship) as a user runs it (a fresh process), once to fill the caches (not timed), then timed: the whole command,
    and per config the check's own wall time in the set's warm worlds (the JSON's ``wall_s``)."""
    import subprocess

    res = {"cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="gradkit-bench-corpus-") as tmp:
        cmd = [sys.executable, "-m", "gradkit", "check", "tests/configs/corpus", "--out", str(Path(tmp) / "table")]
        subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        res["check_dir_s"], out = timed(lambda: subprocess.run(cmd, capture_output=True, text=True, cwd=REPO))
        doc = json.loads((Path(tmp) / "table.json").read_text())
    walls = [c["wall_s"] for c in doc["configs"] if "wall_s" in c]
    res.update(check_dir_exit=out.returncode, corpus_configs=len(doc["configs"]),
               corpus_judged=sum(c["verdict"] in ("affected", "not-affected") for c in doc["configs"]),
               check_dir_per_config_s=round(sum(walls) / len(walls), 2), check_dir_slowest_config_s=max(walls),
               check_dir_wall_per_config_s=round(res["check_dir_s"] / len(doc["configs"]), 2))
    print("\n".join(f"{k:30s} {v}" for k, v in res.items()))
    Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(json_path).write_text(json.dumps(res, indent=1))
    print(f"written to {json_path}")
    return 0


def paths_bench(json_path: str) -> int:
    """``gradkit check --path`` on each path without DeepSpeed, as a user runs it (a fresh process): once to fill the
    caches (not timed), then timed."""
    import subprocess

    res = {"cpus": os.cpu_count()}
    for name, args in PATH_CHECKS.items():
        cmd = [sys.executable, "-m", "gradkit", "check", *args]
        subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        res[f"check_{name}_s"], out = timed(lambda: subprocess.run(cmd, capture_output=True, text=True, cwd=REPO))
        res[f"check_{name}_exit"] = out.returncode
        res[f"check_{name}_verdict"] = (out.stdout.strip().splitlines() or ["?"])[-1]
    print("\n".join(f"{k:28s} {v}" for k, v in res.items()))
    Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(json_path).write_text(json.dumps(res, indent=1))
    print(f"written to {json_path}")
    return 0


def suite_bench(json_path: str, repeat: int = 1, cold: bool = False) -> int:
    """The test command (``bash scripts/test.sh``), as CI runs it (a clean environment), timed from outside; ``repeat`` times in a row
    (run from a fresh clone, the first run also builds the venv, the overlays and the comm ops). With ``cold``, a
    first run from an empty kit cache (``GRADKIT_CACHE`` a new folder: what a new machine installs and builds).
    The rows of the table are the cold run and the last warm run; every run's wall time, count and exit status are
    kept."""
    import re
    import subprocess
    import tempfile

    def once(label: str, cache: str | None) -> dict:
        env = {"HOME": os.environ.get("HOME", "/root"), "PATH": "/usr/local/bin:/usr/bin:/bin",
               **({"GRADKIT_CACHE": cache} if cache else {})}
        t0 = time.monotonic()
        out = subprocess.run(["bash", "scripts/test.sh"], cwd=str(REPO), env=env, capture_output=True, text=True)
        wall = time.monotonic() - t0
        tail = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
        m = re.search(r"(\d+) passed.* in ([\d.]+)s", tail)
        slowest = re.findall(r"^([\d.]+)s (call|setup|teardown) +(\S+)$", out.stdout, re.M)  # --durations
        run = {"suite_s": round(wall, 1), "exit": out.returncode, "summary": tail, "kit_cache": label,
               "passed": int(m.group(1)) if m else None, "pytest_s": float(m.group(2)) if m else None,
               "slowest": [{"s": float(t), "when": w, "test": name} for t, w, name in slowest]}
        print(f"{label}: bash scripts/test.sh: {tail} ({wall:.1f} s with setup, exit {out.returncode})", flush=True)
        if out.returncode:  # what failed, kept (a fresh clone has no runs/ folder yet)
            log = Path(json_path).with_suffix(f".{label.split()[0]}{len(runs) + 1}.log")
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text(out.stdout[-20000:] + out.stderr[-5000:])
        return run

    runs: list[dict] = []
    first = None
    if cold:
        with tempfile.TemporaryDirectory(prefix="gradkit-cold-cache-") as empty:
            first = once("empty", empty)
    for i in range(repeat):
        runs.append(once(f"warm run {i + 1} of {repeat}", None))
    res = {"cpus": os.cpu_count(), **runs[-1], "repeat": repeat, "runs": runs,
           "passed_runs": sum(r["exit"] == 0 for r in runs), "walls": ", ".join(f"{r['suite_s']:.0f}" for r in runs)}
    if first is not None:  # without --cold, the cold row keeps its last measurement
        res.update(cold_suite_s=first["suite_s"], cold_pytest_s=first["pytest_s"], cold_exit=first["exit"],
                   cold_run=first)
    elif Path(json_path).exists():
        res.update({k: v for k, v in json.loads(Path(json_path).read_text()).items() if k.startswith("cold_")})
    path = Path(json_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))
    print(f"{res['passed_runs']} of {repeat} runs passed ({res['walls']} s); written to {path}")
    return 0 if res["passed_runs"] == repeat and (first is None or first["exit"] == 0) else 1
