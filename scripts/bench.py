"""Benchmark the kit's launch path and probes (numbers for the notes, never a timed test). The one-thing benchmarks
are in scripts/bench_runs.py, the performance table in scripts/bench_table.py; this is the command.

    .venv/bin/python scripts/bench.py [--json runs/bench.json]
    .venv/bin/python scripts/bench.py --runall [--cold]   # the default run-all, warm (and from an empty kit cache)
    .venv/bin/python scripts/bench.py --noise      # the noise the oracle's tolerances are set against
    .venv/bin/python scripts/bench.py --sweep      # gradkit check and the default sweep (runs/bench_sweep.json)
    .venv/bin/python scripts/bench.py --profile    # where one warm explorer Run's time goes (runs/profile.json)
    .venv/bin/python scripts/bench.py --suite      # the test command (bash scripts/test.sh), timed (runs/bench_suite.json)
    python3 scripts/bench.py --suite --repeat 5    # in a fresh clone: five runs in a row, each timed
    .venv/bin/python scripts/bench.py --suite --cold   # first from an empty kit cache (a new machine's), then warm
    .venv/bin/python scripts/bench.py --bisect     # gradkit bisect of B5's config, overlays cached (runs/bench_bisect.json)
    .venv/bin/python scripts/bench.py --watch      # the watch's cost on a tiny Llama, and at the size users train
                                                   # (runs/bench_watch.json, runs/bench_watch_scale.json)
    .venv/bin/python scripts/bench.py --readme docs/speed.md   # the performance table of docs/speed.md from those files

Measures, side by side in one run, on this machine:
- cold launch: a 2-rank DeepSpeed world with an empty extensions cache (DeepSpeed JIT-builds its CPU comm op);
- warm launch: the same world again (op loaded from the cache);
- the B4 probe: all 4 cases x GA in {1, 2, 4, 8} in one warm world;
- the B3 probe: 4 ZeRO stages x 2 dtypes x N in {1, 2, 4, 8}, fixes at N=4 (60 configs) in one warm world;
- the B2 probe: 2 pipeline stages, 4 splits x 2 dtypes x ZeRO-0/1 (28 configs, one world per ZeRO stage);
- configs per minute: N configs in one world against one launch per config;
- launchers: the same warm 2-rank world started by the kit itself, by torchrun and by the DeepSpeed launcher;
- the explorer: a first and a second Run-button press (B3 default selection), widgets to redrawn figure (the second
  in the warm world the first started);
- with --runall (runs/bench_runall.json): the default run-all (scripts/params/default.yaml, every notebook, its
  site) with the kit's cache as it is, and with --cold also from an empty kit cache (its prefetch step installs
  every overlay and builds every comm op the notebooks need), each notebook's wall time, the prefetch's;
- with --suite (runs/bench_suite.json): `bash scripts/test.sh` (setup, then the whole test suite on two xdist
  workers) from a clean environment, as CI runs it; its wall time and pytest's own count and time; with
  --repeat N, N times in a row (issue 27's check for flaky tests: run it in a fresh clone), every run kept; with
  --cold, a first run from an empty kit cache (every overlay, comm op and extra package set installed and built, as
  on a new machine; pip's own download cache and the venv as they are), then the warm ones.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from bench_runs import (REPO, bisect_bench, corpus_bench, noise, paths_bench, profile, runall_bench, suite_bench,
                        sweep_bench, timed)
from bench_watch import watch_bench
from bench_watch_scale import scale_bench
from bench_table import PERF_PAGE, perf_table, write_readme  # noqa: F401 (perf_table: tests/test_docs.py reads it here)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runall", action="store_true", help="only time the default run-all (runs/bench_runall.json)")
    ap.add_argument("--cold", action="store_true", help="with --runall or --suite: also from an empty kit cache")
    ap.add_argument("--noise", action="store_true",
                    help="only measure the noise of correct engines that the oracle's tolerances are set against")
    ap.add_argument("--json", default=None, help="where the numbers go (default runs/bench.json, runs/noise.json)")
    ap.add_argument("--sweep", action="store_true", help="only measure gradkit check and the sweep")
    ap.add_argument("--profile", action="store_true", help="only profile one warm explorer Run (B3), phase by phase")
    ap.add_argument("--suite", action="store_true", help="only time the test command, bash scripts/test.sh (runs/bench_suite.json)")
    ap.add_argument("--repeat", type=int, default=1, help="with --suite: run it this many times in a row")
    ap.add_argument("--corpus", action="store_true", help="only time gradkit check DIR over the test corpus "
                    "(runs/bench_corpus.json)")
    ap.add_argument("--bisect", action="store_true", help="only time gradkit bisect of B5's config (runs/bench_bisect.json)")
    ap.add_argument("--paths", action="store_true",
                    help="only time gradkit check --path fsdp2|accelerate|trainer (runs/bench_paths.json)")
    ap.add_argument("--readme", nargs="?", const=str(REPO / PERF_PAGE), metavar="FILE",
                    help=f"write the performance table of FILE (default {PERF_PAGE}) from the JSON files in runs/")
    ap.add_argument("--watch", action="store_true",
                    help="only time the watch: unjudged and judged steps against none (runs/bench_watch.json)")
    a = ap.parse_args()
    if a.watch:  # a tiny Llama in one process, then Llamas of ~25M to ~440M on 2 and 4 ranks (tens of minutes)
        code = watch_bench(a.json or str(REPO / "runs" / "bench_watch.json"))
        scale_bench(str(REPO / "runs" / "bench_watch_scale.json"))
        return code
    if a.paths:
        return paths_bench(a.json or str(REPO / "runs" / "bench_paths.json"))
    if a.corpus:
        return corpus_bench(a.json or str(REPO / "runs" / "bench_corpus.json"))
    if a.readme:
        return write_readme(a.readme)
    if a.profile:
        return profile(a.json or str(REPO / "runs" / "profile.json"))
    if a.sweep:
        return sweep_bench(a.json or str(REPO / "runs" / "bench_sweep.json"))
    if a.noise:
        return noise(a.json or str(REPO / "runs" / "noise.json"))
    if a.bisect:
        return bisect_bench(a.json or str(REPO / "runs" / "bench_bisect.json"))
    if a.suite:
        return suite_bench(a.json or str(REPO / "runs" / "bench_suite.json"), a.repeat, a.cold)
    if a.runall:
        return runall_bench(a.json or str(REPO / "runs" / "bench_runall.json"), a.cold)
    a.json = a.json or str(REPO / "runs" / "bench.json")

    from gradkit import launch
    from gradkit.probes import bf16_leak, pipeline_ga, zero_boundary

    res = {"cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="gradkit-bench-") as cold_cache:
        saved = os.environ.get("GRADKIT_CACHE")
        os.environ["GRADKIT_CACHE"] = cold_cache
        res["cold_launch_s"], _ = timed(lambda: launch.run_world("gradkit.launch.selftest:ping", {}, world_size=2, timeout_s=600))
        res["warm_launch_s"], _ = timed(lambda: launch.run_world("gradkit.launch.selftest:ping", {}, world_size=2, timeout_s=600))
        if saved is None:
            os.environ.pop("GRADKIT_CACHE")
        else:
            os.environ["GRADKIT_CACHE"] = saved
    launch.run_world("gradkit.launch.selftest:ping", {}, world_size=2, timeout_s=600)  # warm the real cache
    res["b4_probe_s"], recs = timed(lambda: bf16_leak.run(world_size=2, ga_values=(1, 2, 4, 8), timeout_s=600))
    res["b4_probe_configs"] = len(recs)
    res["b3_probe_s"], recs = timed(lambda: zero_boundary.run(world_sizes=(2,), fix_n_values=(4,), timeout_s=600))
    res["b3_probe_configs"] = len(recs)
    res["b2_probe_s"], recs = timed(lambda: pipeline_ga.run(world_sizes=(2,), dtypes=("fp32", "bf16"), zero_stages=(0, 1),
                                                            timeout_s=600))
    res["b2_probe_configs"] = len(recs)

    cases = bf16_leak.plan((1, 2), cases=tuple(bf16_leak.CASES))
    world = launch.World(world_size=2, timeout_s=600)
    t_one, _ = timed(lambda: launch.run_world("gradkit.probes.ranks.bf16_leak:run_rank", {"cases": cases}, world))
    t_each, _ = timed(lambda: [launch.run_world("gradkit.probes.ranks.bf16_leak:run_rank", {"cases": [c]}, world) for c in cases])
    res["configs"] = len(cases)
    res["one_world_s"], res["one_launch_per_config_s"] = t_one, t_each
    res["configs_per_min_one_world"] = 60 * len(cases) / t_one
    res["configs_per_min_one_launch_per_config"] = 60 * len(cases) / t_each
    with launch.warm_worlds():  # the same configurations as a job of a warm world (its start-up paid by a first job)
        launch.run_world("gradkit.probes.ranks.bf16_leak:run_rank", {"cases": cases[:1]}, world)
        t_warm, _ = timed(lambda: launch.run_world("gradkit.probes.ranks.bf16_leak:run_rank", {"cases": cases}, world))
    launch.stop_warm_worlds()
    res["warm_world_s"] = t_warm
    res["configs_per_min_warm_world"] = 60 * len(cases) / t_warm

    for name in launch.LAUNCHERS:
        w = launch.World(world_size=2, timeout_s=600, launcher=name)
        res[f"warm_launch_{name}_s"], _ = timed(lambda: launch.run_world("gradkit.launch.selftest:ping", {}, w))

    import matplotlib
    matplotlib.use("Agg")
    from gradkit.notebooks import explore
    ex = explore.ProbeExplorer(explore.default_selection("B3"), interactive=True)
    res["explorer_run_button_first_s"], _ = timed(ex.run)  # starts the explorer's warm world
    res["explorer_run_button_warm_s"], _ = timed(ex.run)  # its ranks stayed up (gradkit.launch.warm_worlds)
    launch.stop_warm_worlds()


    print("\n".join(f"{k:40s} {v:.2f}" if isinstance(v, float) else f"{k:40s} {v}" for k, v in res.items()))
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(res, indent=1))
    print(f"written to {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
