"""The performance table of docs/speed.md (``python scripts/bench.py --readme docs/speed.md``): one row per number
the benchmarks of ``scripts/bench_runs.py`` and ``scripts/bench.py`` wrote under runs/, each with its target and
the flag that measures it; a row whose file is not there keeps its last measurement.
"""
from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


# (file, key, what, target, unit): the performance table (PERF_PAGE), in this order; a number not measured yet says
# which command measures it
PERF_ROWS = [
    ("profile.json", "explorer_run_warm_s", "explorer Run (B3, {configs} configurations), warm world", "≤ 5 s", "s"),
    ("profile.json", "explorer_run_s", "the same Run in a one-shot world (start-up included)", "", "s"),
    ("profile.json", "explorer_run_warm_B4_s", "explorer Run (B4, default selection), warm world", "≤ 5 s", "s"),
    ("profile.json", "explorer_run_warm_B2_s", "explorer Run (B2, default selection), warm world", "≤ 5 s", "s"),
    ("profile.json", "explorer_run_warm_B1_s", "explorer Run (B1, a real Trainer), warm world", "≤ 10 s", "s"),
    ("bench.json", "explorer_run_button_warm_s", "explorer Run-button press, second (warm)", "≤ 5 s", "s"),
    ("bench.json", "cold_launch_s", "2-rank DeepSpeed launch, empty cache (comm op built)", "", "s"),
    ("bench.json", "warm_launch_s", "2-rank DeepSpeed launch, cached comm op", "", "s"),
    ("bench.json", "warm_launch_torchrun_s", "the same, through torchrun", "", "s"),
    ("bench.json", "warm_launch_deepspeed_s", "the same, through the DeepSpeed launcher", "", "s"),
    ("bench.json", "b3_probe_s", "B3 probe, {b3_probe_configs} configurations in one world", "", "s"),
    ("bench.json", "b4_probe_s", "B4 probe, {b4_probe_configs} configurations in one world", "", "s"),
    ("bench.json", "b4_speedup", "configurations per minute, B4 probe ({configs} configurations): one world / one launch each",
     "≥ 20×", "×"),
    ("bench.json", "b4_speedup_warm", "the same configurations as a job of a warm world / one launch each", "≥ 20×",
     "×"),
    ("bench_runall.json", "runall_default_warm_s", "default run-all (every notebook, scripts/params/default.yaml), "
     "cache warm", "≤ 300 s", "s"),
    ("bench_runall.json", "runall_default_cold_s", "the same from an empty kit cache (prefetch included)", "≤ 720 s", "s"),
    ("bench_runall.json", "prefetch_cold_s", "its prefetch: {prefetch_cold_stacks} stacks' overlays and comm ops", "",
     "s"),
    ("bench_sweep.json", "check_warm_s", "`gradkit check`, a B3-pattern config, every loop style", "≤ 15 s", "s"),
    ("bench_sweep.json", "sweep_s", "default sweep ({sweep_configs} configurations: {sweep_models} model shapes, "
     "{sweep_steps} judged steps each, 0.18.6 and installed), two worlds at a time", "≤ 300 s", "s"),
    ("bench_sweep.json", "sweep_configs_per_min", "the same, configurations per minute", "≥ 1000", "/min"),
    ("bench_sweep.json", "speedup", "configurations per minute, the sweep: one world / one launch each", "≥ 20×", "×"),
    ("bench_paths.json", "check_fsdp2_s", "`gradkit check --path fsdp2` (bf16 / fp32 reduce on `conditional`, GA 2: "
     "raises, its workaround re-run)", "≤ 15 s", "s"),
    ("bench_paths.json", "check_accelerate_s", "`gradkit check --path accelerate` (sync_each_batch and the last window)",
     "≤ 15 s", "s"),
    ("bench_paths.json", "check_trainer_s", "`gradkit check --path trainer` (a real Trainer on 2 ranks, and its fix)",
     "≤ 30 s", "s"),
    ("bench_corpus.json", "check_dir_wall_per_config_s", "`gradkit check DIR` over the test corpus ({corpus_configs} "
     "configs, {corpus_judged} judged), the whole command per config (start-up included)", "≤ 3 s", "s"),
    ("bench_corpus.json", "check_dir_per_config_s", "of which one config's check in the set's warm worlds (the slowest: "
     "{check_dir_slowest_config_s} s)", "", "s"),
    ("bench_corpus.json", "check_dir_slowest_config_s", "the slowest config's check in the set's warm worlds (a target, "
     "not a test: tests/test_check_corpus.py guards a hang only)", "≤ 30 s", "s"),
    ("bench_bisect.json", "bisect_s", "`gradkit bisect`, B5's config over {bisect_releases} releases "
     "({bisect_measured} measured, each change confirmed), overlays cached", "≤ 180 s", "s"),
    ("bench_watch.json", "unjudged_over_none_large", "`gradkit.watch`, an unjudged step against none (tiny Llama "
     "{parameters_m}M parameters, AdamW, GA 4 micro-batches of {tokens_large} tokens)", "≤ 1.02×", "x"),
    ("bench_watch.json", "judged_over_none_large", "a judged step against none (the same)", "≤ 2×", "x"),
    ("bench_watch.json", "floor_over_none_large", "of which the floor: none + the reference's own fp32 forward and "
     "backward of the step's micro-batches (what any reference costs; the rest is the watch's sketches, tally, copy)",
     "", "x"),
    ("bench_watch.json", "half_over_none_large", "a judged step judging the last half of the layers (`layers=`: the "
     "reference's backward stops below them)", "", "x"),
    ("bench_watch.json", "judged_over_none_small", "the same with micro-batches of {tokens_small} tokens (the sketches' "
     "passes over the parameters weigh more)", "", "x"),
    ("bench_watch.json", "held_in_gradients", "what the watch holds at a judged step's peak (the copy's weights and "
     "gradient, the sketches and their sign pattern), in fp32 gradients", "≤ 2 + the sketch", "gradients"),
    ("bench_watch_scale.json", "time_zero3_130m_2", "the watch at the size users train (docs/watch.md's sizing "
     "table): a judged step against an unjudged one, ~130M-parameter Llama, ZeRO-3, 2 ranks (the sharded copy, the "
     "reference's fp32 forward and backward under FSDP2, the sketches, the tally)", "≤ 2.2×", "x"),
    ("bench_watch_scale.json", "floor_zero3_130m_2", "of which the floor: an unjudged step + the reference's forward "
     "and backward alone (under FSDP2: the job's own gathers and reduce-scatters of the model, made again for every "
     "micro-batch; the rest is the copy's build, the sketches, the pieces and the tally)", "", "x"),
    ("bench_watch_scale.json", "time_fsdp2_130m_2", "the same under FSDP2", "≤ 2.2×", "x"),
    ("bench_watch_scale.json", "floor_fsdp2_130m_2", "of which the floor (as above)", "", "x"),
    ("bench_watch_scale.json", "held_zero3_400m_2", "the judgement's own peak bytes per rank, ~440M, ZeRO-3, 2 ranks "
     "(bound: 2 / W + the largest unit + the sketches: {bound_zero3_400m_2})", "≤ the bound", "models"),
    ("bench_watch_scale.json", "held_fsdp2_400m_4", "the same under FSDP2 on 4 ranks (bound {bound_fsdp2_400m_4}; "
     "ZeRO-3 at this size on 4 CPU ranks of a 23 GB host: the watch's memory guard does not judge its steps, the "
     "job goes on)", "≤ the bound", "models"),
    ("bench_watch_scale.json", "window_fsdp2_400m_4", "malloc's bytes in use in the judged optimizer step above an "
     "unjudged one's, the same (FSDP2's own gather and reduce buffers of the copy's units included)", "-", "models"),
    ("bench_watch_scale.json", "held_zero3_whole_130m_2", "a whole copy instead (`shard=False`), ~130M, ZeRO-3, 2 ranks "
     "(every rank the fp32 model twice)", "-", "models"),
    ("bench_watch_scale.json", "stays_most", "left in use after a judged step, the most of any row", "≤ 0.01",
     "models"),
    ("bench_suite.json", "suite_s", "test suite, `bash scripts/test.sh` (setup, then {passed} tests), the machine's kit "
     "cache warm", "≤ 900 s", "s"),  # CI's goal (issue 58): 15 min from a fresh clone on a machine that ran it before
    ("bench_suite.json", "pytest_s", "of which pytest itself", "", "s"),
    ("bench_suite.json", "cold_suite_s", "the same from an empty kit cache (`--suite --cold`: every overlay, comm op and "
     "extra package set installed and built, as on a new machine)", "≤ 2400 s", "s"),
    ("bench_suite.json", "cold_pytest_s", "of which pytest itself", "", "s"),
    ("bench_suite.json", "passed_runs", "the suite run {repeat} time(s) in a row (`--suite --repeat N`; in a fresh "
     "clone the first run also builds the venv, overlays and comm ops), each run's wall time: {walls} s", "every run", "runs"),
]
PERF_COMMANDS = {"profile.json": "--profile", "bench.json": "", "bench_sweep.json": "--sweep",
                 "bench_runall.json": "--runall --cold", "bench_suite.json": "--suite",
                 "bench_bisect.json": "--bisect", "bench_paths.json": "--paths", "bench_corpus.json": "--corpus",
                 "bench_watch.json": "--watch", "bench_watch_scale.json": "--watch"}


PERF_PAGE = "docs/speed.md"  # the page whose <!-- gradkit:table PERF --> block --readme writes (without a file)


def _rows_by_command(table: str) -> dict[str, list[str]]:
    """The rows of a performance table already on its page, by the command in their last column, in order."""
    out: dict[str, list[str]] = {}
    for line in table.splitlines():
        if line.startswith("| ") and line.rstrip().endswith("` |") and "scripts/bench.py" in line:
            out.setdefault(line.rsplit("`", 2)[-2], []).append(line)
    return out


def perf_table(folder: Path, old: str = "", page: str = PERF_PAGE) -> str:
    """The performance table of ``page`` from the JSON files bench.py wrote into ``folder`` (runs/); a row whose file
    is not there keeps its row in ``old`` (the table as the page has it: measured earlier by the same command)."""
    kept = _rows_by_command(old)
    data = {}
    for name in PERF_COMMANDS:
        try:
            data[name] = json.loads((folder / name).read_text())
            if not isinstance(data[name], dict):
                raise ValueError("an older layout")
        except (OSError, ValueError):
            data[name] = {}
    cpus = sorted({d["cpus"] for d in data.values() if d.get("cpus")})
    b = data["bench.json"]
    if b.get("configs_per_min_one_world") and b.get("configs_per_min_one_launch_per_config"):
        b["b4_speedup"] = b["configs_per_min_one_world"] / b["configs_per_min_one_launch_per_config"]
    if b.get("configs_per_min_warm_world") and b.get("configs_per_min_one_launch_per_config"):
        b["b4_speedup_warm"] = b["configs_per_min_warm_world"] / b["configs_per_min_one_launch_per_config"]
    lines = [f"<sub>generated by `python scripts/bench.py --readme {page}` from runs/{{{','.join(PERF_COMMANDS)}}} "
             f"(a row whose file is not there keeps its last measurement); measured on "
             f"{' / '.join(map(str, cpus)) or '?'} CPU cores</sub>", "",
             "| what | measured | target | measured by |", "|---|---|---|---|"]
    for name, key, what, target, unit in PERF_ROWS:
        value = data[name].get(key)
        cmd = " ".join(["scripts/bench.py", PERF_COMMANDS[name]]).strip()
        if not data[name] and kept.get(cmd):
            lines.append(kept[cmd].pop(0))
            continue
        shown = "not measured yet" if value is None else (f"{value:.1f}{unit}" if unit == "×" else
                                                          f"{value:.2f}×" if unit == "x" else
                                                          f"{value} of {data[name].get('repeat')} passed" if unit == "runs"
                                                          else f"{value:.2f} fp32 models" if unit == "models"
                                                          else f"{value:.1f} {unit}")
        what = what.format_map(collections.defaultdict(lambda: "?", data[name]))
        lines.append(f"| {what} | {shown} | {target or '-'} | `{cmd}` |")
    return "\n".join(lines) + "\n"


def write_readme(readme: str) -> int:
    """Write the performance table into the PERF block of ``readme`` (a path, relative ones against the working
    directory; ``PERF_PAGE`` by default)."""
    sys.path.insert(0, str(REPO))
    from gradkit.notebooks import readme_tables

    path = Path(readme).resolve()
    before = path.read_text()
    start, end = before.find("<!-- gradkit:table PERF -->"), before.find("<!-- /gradkit:table -->", before.find("<!-- gradkit:table PERF -->"))
    page = path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else str(path)
    text, done = readme_tables.fill(before, {"PERF": perf_table(REPO / "runs", before[start:end] if start >= 0 else "", page)})
    path.write_text(text)
    print(f"{path}: {'replaced the performance table' if done else 'has no <!-- gradkit:table PERF --> block'}")
    return 0
