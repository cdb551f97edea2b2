"""`gradkit check`: a user's DeepSpeed config, judged on real 2-rank worlds; bad input never launches."""
import json
import subprocess
import sys

import pytest

from gradkit import config, launch
from gradkit.commands import check
from gradkit.judge import expectations, oracle, parts
from gradkit.probes import ds_config
from gradkit.probes.ranks import ds_config as ds_ranks
from gradkit.stacks import versions

pytestmark = pytest.mark.usefixtures("warm_module")  # one import per stack for the module's runs

B3_CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "train_batch_size": "auto",
             "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}, "gradient_clipping": 1.0,
             "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8, "overlap_comm": True}}
B4_CONFIG = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
             "bf16": {"enabled": "auto"}, "data_types": {"grad_accum_dtype": "fp32"},
             "communication_data_type": "fp32", "zero_optimization": {"stage": 1}}


def _write(tmp_path, cfg, name="ds_config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.world
def test_a_b3_pattern_config_is_affected_named_b3_and_the_fix_verified(tmp_path, capsys):
    out = tmp_path / "check.json"
    code = check.main([_write(tmp_path, B3_CONFIG), "--loop", "engine,manual", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 1, text
    summary = json.loads(out.read_text())["summary"]
    manual = next(r for r in summary["loops"] if r["loop"] == "manual")
    assert manual["verdict"] == oracle.AFFECTED and manual["explained_by"] == "B3"
    # W = 2, N = 4, clip kept (step 1's reference norm is twice the clip, so the right step is the reference x 0.5,
    # 1/16 per micro-batch): only each rank's last micro-batch survives, 1/8 each and unclipped (norm 0.4 x 2 clip)
    step1 = manual["steps"][0]
    assert abs(step1["misplaced_weight"] - 0.5 * (2 * (1 / 8 - 1 / 16) + 6 / 16)) < 1e-3, step1
    assert step1["shape"] == "micro-batch 4 x2, the others x0" and step1["off"]
    assert len(manual["steps"]) == 3 and all(s["off"] for s in manual["steps"])
    assert manual["fix"]["verdict"] == oracle.NOT_AFFECTED
    engine = next(r for r in summary["loops"] if r["loop"] == "engine")
    assert engine["verdict"] == oracle.NOT_AFFECTED
    assert "explained by B3" in text and "optimizer\" removed" in text and "gradient_clipping 1 kept" in text


@pytest.mark.world
def test_the_same_config_with_the_fix_is_not_affected(tmp_path, capsys):
    fixed = {**B3_CONFIG, "managed_gradient_accumulation": False}  # the 0.19.4 opt-out, in the user's config
    assert check.main([_write(tmp_path, fixed), "--loop", "manual"]) == 0, capsys.readouterr().out
    assert check.main([_write(tmp_path, B3_CONFIG), "--loop", "boundary"]) == 0, capsys.readouterr().out


@pytest.mark.world
def test_a_b4_config_under_0_18_9_is_affected_and_named_b4(tmp_path, capsys):
    code = check.main([_write(tmp_path, B4_CONFIG), "--deepspeed", "0.18.9", "--loop", "engine",
                       "--trainer-dtype", "bf16"])
    text = capsys.readouterr().out
    assert code == 1, text
    assert "explained by B4" in text and "re-run with the fix: not-affected" in text
    assert "bf16.enabled \"auto\" -> true" in text


@pytest.mark.parametrize("args, cfg, needle", [
    (["--loop", "sideways"], B3_CONFIG, "unknown loop style"),
    (["--world-size", "999"], B3_CONFIG, "world_size=999"),
    ([], {**B3_CONFIG, "zero_optimization": {"stage": 7}}, "stage"),
    ([], {**B3_CONFIG, "bf16": {"enabled": True}, "fp16": {"enabled": True}}, "both bf16 and fp16"),
    ([], [1, 2], "config mapping"),
    (["--deepspeed", "latest"], B3_CONFIG, "latest"),
])
def test_bad_input_exits_2_before_anything_launches(tmp_path, monkeypatch, capsys, args, cfg, needle):
    monkeypatch.setattr(launch, "run_world", lambda *a, **k: pytest.fail("a world was launched"))
    with pytest.raises(config.ConfigError, match=needle):
        check.main([_write(tmp_path, cfg), *args])


def test_the_console_command_says_one_sentence_and_exits_2(tmp_path):
    bad = tmp_path / "broken.json"
    bad.write_text("{\"zero_optimization\": ")
    for argv in (["check", str(bad)], ["check", str(tmp_path / "missing.json")], ["frobnicate"], ["check"]):
        out = subprocess.run([sys.executable, "-m", "gradkit", *argv], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, (argv, out.stderr)
        lines = [line for line in out.stderr.splitlines() if line.strip() and "WARNING" not in line]
        assert len(lines) == 1 and lines[0].startswith("error: "), (argv, out.stderr)


@pytest.mark.world
def test_fp16_with_a_dynamic_loss_scale_is_judged_with_deepspeeds_own_scaler_its_skip_said_and_its_growth_named_b10(
        tmp_path, capsys):
    """DeepSpeed's CPU accelerator declares fp16 only where oneDNN has fp16 kernels; told it is supported, its own
    fp16 code runs: the dynamic loss scaler as configured (its window shortened), one overflow the check makes on
    purpose (skipped by the scaler, said as skipped, not judged), and the step where the scale grows, which ZeRO-2
    unscales by the new scale: half the update, named B10; the static scale re-run (its fix) is exact."""
    cfg = {**B3_CONFIG, "gradient_accumulation_steps": 4, "gradient_clipping": 0.0, "fp16": {"enabled": True,
                                                                                            "loss_scale": 0}}
    code = check.main([_write(tmp_path, cfg), "--loop", "engine", "--json", str(tmp_path / "out.json")])
    text = capsys.readouterr().out
    assert code == 1, text
    assert "fp16 judged on CPU: DeepSpeed's CPU accelerator is told fp16 is supported" in text and "ZeRO-2 fp16" in text
    assert "fp16.loss_scale_window 1000 -> 2" in text and "6 optimizer steps each judged" in text
    (row,) = json.loads((tmp_path / "out.json").read_text())["summary"]["loops"]
    ratios = [None if st["skipped"] else round(st["ratio"], 3) for st in row["steps"]]
    assert ratios == [1.0, None, 1.0, 1.0, 0.5, 1.0], ratios  # step 2 overflowed; after it, two clean steps, then the rise
    assert row["steps"][4]["loss_scale"] * 2 == row["steps"][4]["loss_scale_after"] > 0  # the scale doubled there
    assert row["explained_by"] == "B10" and row["worst_step"] == 4 and row["cosine"] > 0.9999, row
    assert row["fix"]["verdict"] == oracle.NOT_AFFECTED and row["fix"]["ratio"] == pytest.approx(1.0, abs=1e-3)
    assert "step 2 (loss scale 65536 kept: hysteresis) skipped by the fp16 loss scaler on an overflow" in text
    # where no release fixes it, the patch the kit verified (its report says verified: docs/reports/B10)
    assert "a patch of DeepSpeed the kit verified (gradkit report --known B10): docs/reports/B10/report.md" in text


@pytest.mark.world
def test_b9s_step_of_one_65536th_is_named_within_the_rounding_of_the_masters_it_is_read_from(tmp_path, capsys):
    """ZeRO-0 fp16, its dynamic scale at 2^16, no clip: FP16_UnfusedOptimizer divides every update by the scale (B9),
    a step about 1e-6 of the weights, which the difference of two fp32 master vectors holds to within their rounding
    (cosine 0.9995): named B9 all the same, the scale as it moved each step."""
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4, "fp16": {"enabled": True},
           "zero_optimization": {"stage": 0}}
    assert check.main([_write(tmp_path, cfg), "--loop", "engine", "--json", str(tmp_path / "out.json")]) == 1
    (row,) = json.loads((tmp_path / "out.json").read_text())["summary"]["loops"]
    assert row["explained_by"] == "B9" and row["ratio"] < 1e-4, (row, capsys.readouterr().out)


@pytest.mark.world
def test_deepspeed_refuses_this_config_is_said_only_after_it_refused_the_config_as_written(tmp_path, capsys):
    """A refusal in deepspeed.initialize is handed back to DeepSpeed as the user wrote the config ("auto" and the
    batch sizes resolved, the optimizer the kit's): prescale_gradients with ZeRO-2's reduce-scatter is refused there
    too, in DeepSpeed's own words; a refusal of the kit's own change (a test key makes the config the kit runs
    invalid) is said as the kit's, never blamed on DeepSpeed."""
    base = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}
    for cfg, words in (({**base, "prescale_gradients": True, "zero_optimization": {"stage": 2, "reduce_scatter": True}},
                        "refuses this config itself, as written (a run of it on this release stops there too): "
                        "AssertionError: pre-scale gradients is not yet supported"),
                       ({**base, "zero_optimization": {"stage": 2}, ds_ranks.REFUSE_FAULT_KEY: 1},
                        "refuses this config as the kit runs it, in deepspeed.initialize (the config as written "
                        "passes it: the kit's change is to blame): ValidationError")):
        code = check.main([_write(tmp_path, cfg), "--loop", "engine"])
        text = capsys.readouterr().out
        assert code == 3 and words in text, text


def test_the_config_as_written_resolves_only_auto_the_batch_sizes_and_the_optimizer():
    user = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 8, "train_batch_size": 1024,
            "optimizer": {"type": "AdamW"}, "wandb": {"enabled": True}, "gradient_clipping": "auto",
            "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": 5e8},
            "fp16": {"enabled": "auto", "loss_scale_window": 1000}}
    written = ds_config.resolve(user, world_size=2, trainer_dtype="fp16").as_written
    assert "optimizer" not in written and "wandb" not in written and written["train_batch_size"] == 4 * 8 * 2
    assert written["gradient_clipping"] == 1.0 and isinstance(written["zero_optimization"]["reduce_bucket_size"], int)
    assert written["zero_optimization"]["stage3_prefetch_bucket_size"] == 5e8  # as written: the kit's run shrinks it
    assert written["fp16"] == {"enabled": True, "loss_scale_window": 1000}  # the kit's run takes a window of 2


def test_the_check_runs_the_runs_own_world_size_up_to_what_the_machine_runs_and_says_what_differs():
    from types import SimpleNamespace as NS

    from gradkit.commands.check import one

    limit = config.max_world_size("cpu")
    args = NS(world_size=None, device="cpu")
    assert one.world_of(NS(world_size=4), args) == (4, "world size 4: your run's")
    w, why = one.world_of(NS(world_size=limit * 2), args)
    assert w == limit and f"world size {limit * 2} (your run) -> {limit}: this machine runs at most {limit}" in why
    assert "B4's leaked share, 1 / W) is measured at W = " in why
    w, why = one.world_of(NS(world_size=None), args)
    assert w == 2 and "does not say how many ranks" in why
    assert one.world_of(NS(world_size=4), NS(world_size=3, device="cpu")) == (
        3, "world size 4 (your run) -> 3 (--world-size)")


@pytest.mark.world
def test_a_launch_line_of_four_ranks_is_checked_on_four_and_b4_leaks_on_each(tmp_path, capsys):
    """B4 leaks each rank's own boundary micro-batch (1 / W of the step): the run's four ranks, read from its torchrun
    line, are the check's; each of the four ranks' accumulators is read and named."""
    ds = _write(tmp_path, B4_CONFIG)
    code = check.main(["--command", f"torchrun --nproc_per_node 4 train.py --deepspeed {ds} --bf16 "
                                    "--gradient_accumulation_steps 4", "--deepspeed", "0.18.6", "--json",
                       str(tmp_path / "out.json")])
    text = capsys.readouterr().out
    assert code == 1 and "as run: world size 4: your run's" in text, text
    doc = json.loads((tmp_path / "out.json").read_text())
    (rec,) = [r for r in doc["records"] if r["case"] == "boundary"]
    assert rec["world_size"] == 4 and len(rec["steps"][0]["rank_buffers"]) == 4
    assert doc["summary"]["loops"][0]["explained_by"] == "B4"


def test_auto_values_resolve_as_the_trainer_does():
    cfg = ds_config.resolve({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                             "train_batch_size": "auto", "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                                                               "stage3_prefetch_bucket_size": "auto"}},
                            world_size=2, ga=8)
    assert cfg["gradient_accumulation_steps"] == 8 and cfg["train_batch_size"] == 4 * 8 * 2
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 704  # hidden**2 = 1024, then 3 buckets of the model
    assert any("auto -> 1024" in n for n in cfg.notes)


def test_the_gradkit_console_script_is_installed_and_refuses_bad_input(tmp_path):
    from pathlib import Path

    script = Path(sys.executable).parent / "gradkit"
    assert script.exists(), "scripts/setup.sh installs the kit with its console script"
    out = subprocess.run([str(script), "check", str(tmp_path / "none.json")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "no such file" in out.stderr


B5_CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4,
             "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}


@pytest.mark.world
def test_zero2_optimizer_offload_is_b5_on_0_18_6_and_fixed_on_the_installed_release(tmp_path, capsys):
    """Found by the sweep: DeepSpeed's own loop, ZeRO-2 + CPU optimizer offload, GA 4 keeps the first and the last
    micro-batch only on 0.18.6 (deepspeedai/DeepSpeed#7967 fixes it in 0.19.0)."""
    path = _write(tmp_path, B5_CONFIG)
    assert check.main([path, "--deepspeed", "0.18.6", "--loop", "engine"]) == 1
    text = capsys.readouterr().out
    assert "explained by B5" in text and "'first and last micro-batch'" in text, text
    assert check.main([path, "--loop", "engine"]) == 0, capsys.readouterr().out


@pytest.mark.world
def test_a_shipped_zero2_config_is_exact_in_deepspeeds_loop_and_a_tie_at_ga_2_is_separated_before_naming_b3(
        tmp_path, repo, capsys):
    """LLaMA-Factory's ds_z2_config.json (round_robin_gradients on): the fp32 masters read through DeepSpeed's API
    are assigned to the wrong parameters, while the weights the model uses are exact. The check judges those, says
    the read misreports as a finding of its own, and DeepSpeed's own loop is not-affected. At GA 2 the manual loop's
    step ties between 'last micro-batch / N' and 'all but the first micro-batch': B3 is named only after a run at
    GA 4 separates them."""
    out = tmp_path / "check.json"
    path = repo / "scripts/configs/shipped/llamafactory/ds_z2_config.json"
    code = check.main([str(path), "--loop", "engine,manual", "--ga", "2", "--trainer-dtype", "fp32", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 1, text
    loops = {r["loop"]: r for r in json.loads(out.read_text())["summary"]["loops"]}
    engine, manual = loops["engine"], loops["manual"]
    assert engine["verdict"] == oracle.NOT_AFFECTED and "safe_get_full_fp32_param" in engine["read_finding"], engine
    assert manual["verdict"] == oracle.AFFECTED and manual["ties"] == [
        "all but the first micro-batch", "last micro-batch / N"]
    assert manual["separated"]["ga"] == 4 and manual["separated"]["matches"] == "last micro-batch / N"
    assert manual["explained_by"] == "B3" and "run to separate them" in manual["explanation"]
    assert "finding (not an accumulation bug)" in text and "explained by B3" in text


# ------------------------------------------------------------------ the check's judgement on records made by hand
# (no world: which known bug a record can be, which it is, the summary, the report, and main's flow with the
# world replaced by records; the world tests above run the same code on real 2-rank worlds)

def _ds(case="engine", role="measured", verdict=oracle.AFFECTED, stage=2, optimizer="DeepSpeedZeroOptimizer",
        ds=None, version="0.18.6", ga=4, matches=None, shape=None, fix=None, loop=None, model="mlp", model_config=None,
        dtype="fp32", **kw):
    return {"case": case, "role": role, "verdict": verdict, "reason": f"{case}: why", "zero_stage": stage,
            "optimizer": optimizer, "ga": ga, "dtype": dtype, "versions": {"deepspeed": version, "torch": "2.13.0"},
            "config": {"loop": loop or case, "ds_config": ds or {}, "fix": fix, "model": model,
                       **({"model_config": model_config} if model_config else {})}, "matches": matches,
            "shape": shape, "metrics": {"norm_ratio": 0.25, "cosine": 0.9, "rel_l2": 0.75},
            "attribution": {"misplaced_weight": 0.375}, **kw}


OFFLOAD = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}


@pytest.mark.parametrize("rec, want", [
    (_ds("manual"), ["B3"]),
    (_ds("unmanaged"), ["B3"]),
    (_ds("manual", stage=1, version="0.18.3"), ["B3"]),
    (_ds("manual", version="0.18.2"), []),                        # before B3's first affected release
    (_ds("manual", version="0.20.1"), ["B3"]),                    # newer than the table, and no release fixes B3
    (_ds("manual", stage=3), []),                                 # the MLP reaches every parameter: no B6
    (_ds("manual", stage=3, model="conditional"), ["B6"]),
    (_ds("manual", optimizer="BF16_Optimizer"), ["B4"]),
    (_ds("manual", ds={"managed_gradient_accumulation": False}, version="0.19.4"), []),
    (_ds("manual", ds={"managed_gradient_accumulation": False}, version="0.19.3"), ["B3"]),  # ignored before 0.19.4
    (_ds("engine"), []),
    (_ds("engine", optimizer="BF16_Optimizer"), ["B4"]),
    (_ds("engine", optimizer="BF16_Optimizer", version="0.19.0"), []),
    (_ds("engine", optimizer="BF16_Optimizer", version="0.20.0"), []),  # newer than the table, but fixed
    (_ds("engine", optimizer="BF16_Optimizer", ds={"bf16": {"immediate_grad_update": True}}), []),
    (_ds("engine", optimizer="FP16_UnfusedOptimizer", stage=0), ["B9"]),  # a torch optimizer, no ZeRO optimizer
    (_ds("engine", optimizer="FP16_UnfusedOptimizer", stage=0, version="0.18.2"), []),  # before B9's start
    (_ds("engine", optimizer="FP16_Optimizer", stage=0), []),
    (_ds("engine", ds=OFFLOAD), ["B5"]),
    (_ds("engine", ds=OFFLOAD, model="conditional"), ["B5", "B7"]),
    (_ds("engine", ds={"zero_optimization": {"cpu_offload": True}}, model="conditional"), ["B5", "B7"]),  # legacy key
    (_ds("engine", ds={"zero_optimization": {"cpu_offload": False}}, model="conditional"), []),
    (_ds("boundary", ds=OFFLOAD, stage=1, model="no_grad_step"), ["B5", "B7"]),
    (_ds("engine", ds=OFFLOAD, ga=2, model="conditional"), ["B7"]),  # B5 needs a micro-step between first and last
    (_ds("engine", ds=OFFLOAD, ga=3, model="conditional"), ["B5", "B7"]),
    (_ds("manual", ds=OFFLOAD, model="conditional"), ["B3", "B7"]),
    (_ds("manual", ds=OFFLOAD, model="conditional", version="0.19.8"), ["B3", "B7", "B11"]),
    (_ds("manual", ds=OFFLOAD, version="0.19.8"), ["B3", "B11"]),  # ZeRO-1/2's manual loop shows B11 on any model
    (_ds("manual", ds=OFFLOAD, stage=1, version="0.19.0"), ["B3", "B11"]),
    (_ds("manual", ds=OFFLOAD), ["B3"]),                        # 0.18.6, before #7981: the loop keeps the last only
    (_ds("engine", version="0.18.2"), ["B12"]),                  # ZeRO-2 keeps only the boundary micro-batch
    (_ds("boundary", version="0.17.6", ga=2), ["B12"]),
    (_ds("engine", version="0.17.5"), []),
    (_ds("engine", version="0.18.2", ga=1), []),                  # nothing to accumulate
    (_ds("engine", version="0.18.2", stage=1), []),               # ZeRO-1 reduces at the boundary only
    (_ds("engine", ds=OFFLOAD, version="0.18.2"), ["B5"]),        # offload accumulates on the CPU
    (_ds("engine", ds={"zero_optimization": {"contiguous_gradients": False}}, version="0.19.7"), ["B8"]),
    (_ds("engine", ds={"zero_optimization": {"contiguous_gradients": False}}, version="0.19.8"), []),  # fixed there
    (_ds("engine", ds={"zero_optimization": {"contiguous_gradients": False, "offload_optimizer": {"device": "cpu"}}},
         version="0.19.7"), []),                                  # offload turns contiguous gradients on: no B8
    # B13: ZeRO-1 accumulating in another dtype than the parameters' (fp16 + fp32; bf16 + fp32 with offload)
    (_ds("engine", stage=1, ds={"data_types": {"grad_accum_dtype": "fp32"}}, dtype="fp16", version="0.19.6"), ["B13"]),
    (_ds("engine", stage=1, ds={"data_types": {"grad_accum_dtype": "fp32"}}, dtype="fp16", version="0.19.8"), []),
    (_ds("engine", stage=1, ds={"data_types": {"grad_accum_dtype": "fp16"}}, dtype="fp16", version="0.19.6"), []),
    (_ds("engine", stage=2, ds={"data_types": {"grad_accum_dtype": "fp32"}}, dtype="fp16", version="0.19.6"), []),
    (_ds("engine", stage=1, ds={"data_types": {"grad_accum_dtype": "fp32"}}, dtype="bf16", version="0.18.6",
         optimizer="BF16_Optimizer"), ["B4"]),                    # bf16 + fp32 without offload: B4's optimizer
    (_ds("engine", ds={"fp16": {"enabled": True}}), ["B10"]),   # a dynamic fp16 loss scale
    (_ds("engine", ds={"fp16": {"enabled": True, "loss_scale": 128}}), []),  # a static one
    (_ds("unmanaged", ds=OFFLOAD), ["B3"]),                     # ... not the unmanaged one (measured exact)
    (_ds("manual", ds=OFFLOAD, stage=3), []),                   # ... nor ZeRO-3's (measured exact on the MLP)
    (_ds("manual", ds=OFFLOAD, stage=3, model="conditional"), ["B6", "B7"]),
    (_ds("engine", ds=OFFLOAD, version="0.19.0", model="conditional"), ["B7"]),
    (_ds("engine", ds=OFFLOAD, version="0.19.0", model=None, model_config={"model_type": "llama"}), ["B7"]),
    (_ds("engine", ds=OFFLOAD, version="0.15.1"), []),
    (_ds("engine", ds=OFFLOAD, version="0.15.2"), ["B5"]),        # B7 is pinned from 0.18.6 only
    (_ds("engine", ds=OFFLOAD, stage=3, model="conditional"), ["B6", "B7"]),
    (_ds("engine", ds=OFFLOAD, stage=3, model="tied"), []),       # tied reaches every parameter too
    (_ds("engine", ds=OFFLOAD, stage=0), []),
    (_ds("engine", stage=3, version="0.18.5"), []),
    (_ds("engine", stage=3, versions={}), []),                    # no DeepSpeed release read: nothing expected
])
def test_the_known_bugs_a_record_can_be_follow_its_config_and_release(rec, want):
    assert check.candidates(rec) == want


def test_a_tie_is_two_or_more_expected_bugs_that_each_leave_the_very_step_and_one_bug_is_none():
    stale = _ds("manual", ds=OFFLOAD, stage=3, model="conditional", version="0.19.8", matches=parts.PART_STALE)
    assert check.tied(stale) == ["B6", "B7"]
    assert check.explain(stale)[0] is None and "B6 and B7 are expected here" in check.explain(stale)[1]
    assert check.tied({**stale, "config": {**stale["config"], "ds_config": {}}}) == []  # no offload: B6 alone
    assert check.tied(_ds("manual", matches="last micro-batch / N")) == []  # one bug leaves it: named, no tie


def test_a_bugs_own_fix_in_the_config_rules_it_out_and_says_which_key():
    rec = _ds("manual", ds={"managed_gradient_accumulation": False, "bf16": {"immediate_grad_update": True}},
              version="0.19.4")
    assert check.ruled_out(rec) == {"B3": "\"managed_gradient_accumulation\": false (honoured from 0.19.4)",
                                    "B4": "\"bf16.immediate_grad_update\": true"}
    assert check.ruled_out(_ds("manual", ds={"managed_gradient_accumulation": False}, version="0.19.3")) == {}
    assert check.ruled_out(_ds("manual", ds={"managed_gradient_accumulation": False}, versions={})) == {}
    assert check.ruled_out({"config": None}) == {}


@pytest.mark.parametrize("rec, bug, words", [
    (_ds("manual", matches="last micro-batch / N"), "B3",
     "B3 (allenai/open-instruct#1498): ZeRO-1/2 with config GA = 1"),
    (_ds("engine", optimizer="BF16_Optimizer", matches="own rank's boundary micro-batch"), "B4",
     "B4 (deepspeedai/DeepSpeed#7985): BF16_Optimizer averages"),
    (_ds("engine", ds=OFFLOAD, matches="first and last micro-batch"), "B5", "B5 (deepspeedai/DeepSpeed#7967)"),
    (_ds("engine", stage=3, matches=parts.PART_STALE, model="conditional"), "B6", f"the step is '{parts.PART_STALE}'"),
    (_ds("engine", ds=OFFLOAD, ga=2, matches=parts.PART_LOST, model="conditional"), "B7", "B7 (found by gradkit"),
    (_ds("engine", ds=OFFLOAD, ga=2, matches=f"{parts.PART_LOST} and {parts.PART_STALE}", model="conditional"), "B7",
     "B7"),
])
def test_an_affected_record_is_named_only_by_the_bug_whose_step_it_shows(rec, bug, words):
    got, sentence = check.explain(rec)
    assert got == bug and sentence.startswith(f"{bug} (") and words in sentence
    assert sentence.endswith(f"the step is '{rec['matches']}'")


@pytest.mark.parametrize("rec, sentence", [
    (_ds("manual", matches="sum of all", shape="each x1"),
     "not explained by any known bug: B3 is expected here, but the step is 'sum of all', not what B3 leaves "
     "(the step is: each x1)"),
    (_ds("manual", matches="sum of all"),
     "not explained by any known bug: B3 is expected here, but the step is 'sum of all', not what B3 leaves"),
    (_ds("manual", ds=OFFLOAD, matches="sum of all", model="conditional"),
     "not explained by any known bug: B3, B7 is expected here, but the step is 'sum of all', not what B3 leaves"),
    (_ds("engine", matches="sum of all", shape="each x1"),
     "not explained by any known bug (the step is 'sum of all'; each x1)"),
    (_ds("engine", stage=3, matches="sum of all", model="conditional"),  # B6's hypotheses are a tuple: one of them
     "not explained by any known bug: B6 is expected here, but the step is 'sum of all', not what B6 leaves"),
    (_ds("manual", matches="last micro-batch"),  # a part of B3's name is not B3's step
     "not explained by any known bug: B3 is expected here, but the step is 'last micro-batch', not what B3 leaves"),
    (_ds("engine", matches="sum of all"), "not explained by any known bug (the step is 'sum of all')"),
    (_ds("engine", matches="none", shape="each x1"), "not explained by any known bug (the step is: each x1)"),
    (_ds("engine", shape="each x1"), "not explained by any known bug (the step is: each x1)"),
    (_ds("engine"), "not explained by any known bug (no named hypothesis matches the step)"),
])
def test_an_affected_record_no_known_bug_explains_says_what_its_step_is(rec, sentence):
    assert check.explain(rec) == (None, sentence)


def _steps(*specs):
    return [{"step": i, "metrics": {"norm_ratio": r, "cosine": 1.0, "rel_l2": abs(r - 1)},
             "attribution": {"misplaced_weight": abs(r - 1) / 2}, "logged_norm": logged, "reference_norm": 2.0,
             "shape": f"step {i}"} for i, (r, logged) in enumerate(specs)]


def test_the_check_summary_takes_the_worse_of_the_step_and_the_logged_norm_and_each_steps_numbers():
    recs = [_ds("control", role="control", verdict=oracle.NOT_AFFECTED, loop="torch"),
            _ds("engine", verdict=oracle.NOT_AFFECTED, norm_verdict=oracle.AFFECTED, norm_reason="logged x2",
                steps=_steps((1.0, 4.0), (1.0, None)), worst_step=0),
            _ds("manual", matches="last micro-batch / N", shape="the last x1", steps=_steps((1.0, None), (0.25, None)),
                worst_step=1, ties=["a", "b"], read_finding="the masters misreport"),
            _ds("manual fix:B3", role="fix", verdict=oracle.NOT_AFFECTED, fix="fix:B3", loop="manual",
                metrics={"norm_ratio": 1.0, "cosine": 1.0, "rel_l2": 0.0})]
    s = check.summarise(recs)
    assert (s["verdict"], s["exit"]) == (oracle.AFFECTED, 1)
    assert s["control"] == {"verdict": oracle.NOT_AFFECTED, "reason": "control: why"}
    engine, manual = s["loops"]
    assert (engine["verdict"], engine["step_verdict"], engine["norm_verdict"]) == (oracle.AFFECTED,
                                                                                   oracle.NOT_AFFECTED, oracle.AFFECTED)
    assert engine["off"] == ["logged grad norm"] and engine["norm_reason"] == "logged x2"
    assert engine["explained_by"] is None and engine["fix"] is None
    assert [st["step"] for st in engine["steps"]] == [1, 2]
    assert [st["logged_norm_ratio"] for st in engine["steps"]] == [2.0, None]
    assert manual["off"] == ["applied step"] and manual["ties"] == ["a", "b"] and manual["worst_step"] == 1
    assert [st["off"] for st in manual["steps"]] == [False, True] and manual["steps"][1]["ratio"] == 0.25
    near = check.summarise([_ds("engine", verdict=oracle.NOT_AFFECTED, steps=_steps((1.00005, None)))])
    assert near["loops"][0]["steps"][0]["off"] is False  # half its limit off the reference: within it
    edge = [{"step": i, "metrics": {"norm_ratio": 1.0, "cosine": 1.0, "rel_l2": rel}, "attribution": {
        "misplaced_weight": 0.0}, "reference_norm": 2.0} for i, rel in enumerate((1e-4, 1.5e-4))]
    at = check.summarise([_ds("engine", verdict=oracle.AFFECTED, steps=edge)])["loops"][0]["steps"]
    assert [st["off"] for st in at] == [False, True]  # exactly at the limit: within; 1.5x: off
    assert manual["read_finding"] == "the masters misreport" and manual["shape"] == "the last x1"
    assert manual["explained_by"] == "B3" and manual["fix"]["verdict"] == oracle.NOT_AFFECTED
    assert manual["fix"]["ratio"] == 1.0 and manual["fix"]["what"] == expectations.KNOWN["B3"].explains[2]
    s = check.summarise(recs[:3])  # the fix is another release: said, not run
    assert s["loops"][1]["fix"]["verdict"].startswith("not re-run here") and s["loops"][1]["fix"]["ratio"] is None
    s = check.summarise([_ds("engine", verdict=oracle.NOT_AFFECTED), _ds("boundary", verdict=oracle.CANNOT_RUN)])
    assert (s["verdict"], s["exit"], s["control"]) == (oracle.CANNOT_RUN, 3, None)
    assert check.summarise([_ds("engine", verdict=oracle.NOT_AFFECTED)])["exit"] == 0
    assert check.summarise([_ds("engine", verdict=oracle.INCONCLUSIVE)])["exit"] == 3
    assert check.summarise([])["verdict"] == oracle.CANNOT_RUN  # nothing measured is never "not affected"


def _resolved(ga=2):
    from gradkit.probes import ds_config

    return ds_config.resolve({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": ga,
                              "zero_optimization": {"stage": 2}}, 2, ga, "fp32")


def test_a_tie_is_run_again_at_a_ga_that_separates_it_and_named_only_from_that_run():
    calls = []
    tie = ["last micro-batch / N", "all but the first"]

    def run(cfg, loops):
        calls.append((cfg["gradient_accumulation_steps"], loops, cfg.notes[-1]))
        return [_ds("manual", ga=cfg["gradient_accumulation_steps"], matches="last micro-batch / N", shape="x")]

    summary = {"loops": [{"loop": "manual", "step_verdict": oracle.AFFECTED, "ties": tie, "matches": " or ".join(tie)},
                         {"loop": "engine", "step_verdict": oracle.AFFECTED, "ties": [], "matches": "sum"}]}
    recs = check.separate(_resolved(2), summary, run)
    assert calls == [(4, ("manual",), "gradient_accumulation_steps 2 -> 4 (run again at GA 4 to separate the "
                                       "hypotheses GA 2 cannot tell apart)")]
    assert [(r["role"], r["separating_ga"]) for r in recs] == [("separating measured", 4)]
    row = summary["loops"][0]
    assert row["explained_by"] == "B3" and row["separated"]["ga"] == 4 and row["separated"]["verdict"] == oracle.AFFECTED
    assert row["explanation"].endswith("(at GA 2 the step is last micro-batch / N or all but the first; at GA 4, run "
                                       "to separate them, it is 'last micro-batch / N')")
    assert "separated" not in summary["loops"][1]
    calls.clear()
    check.separate(_resolved(5), {"loops": [dict(summary["loops"][0], explained_by=None)]}, run)
    assert calls[0][0] == 6  # above the user's GA where it is already 4 or more

    def other(cfg, loops):
        return [_ds("manual", ga=4, matches="sum of all", shape="each x1")]

    summary = {"loops": [{"loop": "manual", "step_verdict": oracle.AFFECTED, "ties": tie, "matches": "a or b"}]}
    check.separate(_resolved(2), summary, other)
    assert summary["loops"][0]["explanation"] == ("not explained by any known bug: at GA 2 the step is a or b, and "
                                                  "the run at GA 4 to separate them gives sum of all (each x1)")
    summary = {"loops": [{"loop": "manual", "step_verdict": oracle.AFFECTED, "ties": tie, "matches": "a or b"}]}
    check.separate(_resolved(2), summary, lambda cfg, loops: [])
    assert summary["loops"][0]["separated"]["verdict"] == oracle.CANNOT_RUN
    assert summary["loops"][0]["explanation"].endswith("gives nothing judged")
    assert check.separate(_resolved(2), {"loops": [{"loop": "x", "step_verdict": oracle.NOT_AFFECTED, "ties": tie}]},
                          lambda *a: pytest.fail("nothing to separate")) == []


def test_the_check_report_prints_the_run_each_loop_its_steps_and_what_explains_it():
    recs = [_ds("control", role="control", verdict=oracle.NOT_AFFECTED, loop="torch"),
            _ds("engine", verdict=oracle.NOT_AFFECTED, norm_verdict=oracle.AFFECTED, norm_reason="logged x2",
                steps=_steps((1.0, 4.0))),
            _ds("manual", matches="last micro-batch / N", shape="the last x1", steps=_steps((1.0, None), (0.25, None)),
                worst_step=1, read_finding="the masters misreport"),
            _ds("boundary", verdict=oracle.CANNOT_RUN, metrics=None, attribution=None, reason="q" * 700)]
    recs[0].update(resolved_config={**_resolved(4), "zero_optimization": {"stage": 2}}, step_count=2,
                   config_notes=["a note"])
    lines = check.report(recs, check.summarise(recs), "ds.json", 2, "cpu").splitlines()
    assert lines[0] == ("gradkit check ds.json: DeepSpeed 0.18.6, torch 2.13.0, 2 ranks (cpu); ZeRO-2 fp32, GA 4, "
                        "2 optimizer steps each judged, model: mlp")
    assert lines[1] == "  as run: a note"
    at = {line.split()[0]: i for i, line in enumerate(lines) if line.startswith("  ") and not line.startswith("    ")}
    assert lines[at["engine"]].split() == ["engine", "affected", "0.2500", "0.90000", "0.3750", "1.000", "affected"]
    assert lines[at["engine"] + 1] == "      off: logged grad norm"
    assert lines[at["engine"] + 2] == "      logged grad norm: logged x2"
    assert lines[at["manual"]].split()[5:] == ["1.000", "0.250*", "n/a"]
    assert lines[at["manual"] + 1] == "      off: applied step (worst at step 2); the step is: the last x1"
    assert lines[at["manual"] + 2].startswith("      explained by B3 (allenai/open-instruct#1498)")
    assert lines[at["manual"] + 3].startswith("      fix: call engine.set_gradient_accumulation_boundary")
    assert lines[at["manual"] + 3].endswith("re-run with the fix: not re-run here (the fix is another release: run this "
                                            "check with --deepspeed)")
    assert lines[at["manual"] + 4] == "      finding (not an accumulation bug): the masters misreport"
    skipped = _steps((1.0, None), (1.0, None), (1.0, None))
    skipped[1].update(skipped=True, loss_scale=65536.0, loss_scale_after=65536.0)  # the second step: a skip
    fp16 = [_ds("engine", verdict=oracle.NOT_AFFECTED, steps=skipped)]
    said = check.report(fp16, check.summarise(fp16), "ds.json", 2, "cpu").splitlines()
    assert "1.000 skip  1.000" in next(x for x in said if x.startswith("  engine"))
    assert "      step 2 (loss scale 65536 kept: hysteresis) skipped by the fp16 loss scaler on an overflow: nothing " \
           "applied, as designed (not judged)" in said
    assert lines[at["boundary"]].split()[:6] == ["boundary", "cannot-run", "-", "-", "-", "-"]
    assert lines[at["boundary"] + 1] == "      " + "q" * 600  # a long reason: its first 600 characters
    assert lines[-4:-2] == ["  control (plain torch.distributed, no DeepSpeed): not-affected",
                            "  not run (unmanaged; --loop asks for them; the exit status does not count them):"]
    assert lines[-2].startswith("    if your own loop does that with \"managed_gradient_accumulation\": false: B3 is "
                                "expected on DeepSpeed 0.18.6") and lines[-1] == "verdict: affected (exit 1)"
    one = check.report([_ds("engine", verdict=oracle.NOT_AFFECTED)], check.summarise([_ds("engine",
                       verdict=oracle.NOT_AFFECTED)]), "ds.json", 1, "cpu").splitlines()
    assert one[0].startswith("gradkit check ds.json: DeepSpeed 0.18.6, torch 2.13.0, 1 rank (cpu); ZeRO-None ?, GA None, "
                             "1 optimizer step each judged")
    assert one[1].startswith("  ONE RANK") and "  control (plain torch.distributed, no DeepSpeed): absent" in one
    here = {**_ds("engine", verdict=oracle.NOT_AFFECTED), "version": "installed",  # no overlay: the environment's own
            "versions": {"deepspeed": "0.19.8", "torch": "2.13.0", "transformers": "5.23.0"}}
    head = check.report([here], check.summarise([here]), "ds.json", 2, "cpu").splitlines()[0]
    assert head.startswith("gradkit check ds.json: DeepSpeed 0.19.8 (installed here), torch 2.13.0, transformers 5.23.0, "
                           "2 ranks (cpu)"), head
    assert one[-4] == "  not run (manual, unmanaged; --loop asks for them; the exit status does not count them):"
    shaped = _ds("engine", verdict=oracle.NOT_AFFECTED)
    shaped["config"]["model"] = "conditional"
    assert check.report([shaped], check.summarise([shaped]), "ds.json", 2, "cpu").splitlines()[0].endswith(
        "model: conditional")


def test_the_check_says_what_it_does_in_its_help(capsys):
    with pytest.raises(SystemExit):
        check.main(["--help"])
    assert "CONFIG``: is the run this config describes affected by a gradient-accumulation bug?" in \
        " ".join(capsys.readouterr().out.split())


def test_the_precisions_checked_are_the_trainers_or_every_one_auto_could_resolve_to():
    assert check.precisions({}, None) == ["fp32"]
    assert check.precisions({"bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}, None) == ["fp32", "bf16", "fp16"]
    assert check.precisions({"bf16": {"enabled": True}, "fp16": {"enabled": "auto"}}, None) == ["fp32", "fp16"]
    assert check.precisions({"bf16": {"enabled": "auto"}}, "fp16") == ["fp16"]
    assert check.precisions([], None) == ["fp32"]


def test_a_model_is_a_shape_by_name_and_an_adapter_needs_a_hugging_face_model():
    assert check.model_of(None, None) == ("mlp", []) and check.model_of("conditional", None) == ("conditional", [])
    with pytest.raises(config.ConfigError, match="--adapter needs --model"):
        check.model_of("mlp", "adapter_config.json")
    with pytest.raises(config.ConfigError, match="--adapter needs --model"):
        check.model_of(None, "adapter_config.json")


def test_the_check_runs_each_precision_separates_a_tie_and_writes_one_document(tmp_path, monkeypatch, capsys):
    from gradkit.probes import ds_config

    runs = []

    def run(cfg, loops, world_size, stack, device, timeout, steps, model):
        runs.append((ds_config.dtype_of(cfg), cfg["gradient_accumulation_steps"], loops, stack, steps, model))
        ties = ["last micro-batch / N", "all but the first"] if cfg["gradient_accumulation_steps"] == 2 else []
        bf16 = ds_config.dtype_of(cfg) == "bf16"
        return [_ds("control", role="control", verdict=oracle.NOT_AFFECTED, loop="torch"),
                _ds("manual", verdict=oracle.AFFECTED if bf16 or ties else oracle.NOT_AFFECTED,
                    matches="last micro-batch / N", ties=ties, ga=cfg["gradient_accumulation_steps"])]

    monkeypatch.setattr(ds_config, "run", run)
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                               "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2}}))
    out = tmp_path / "check.json"
    code = check.main([str(cfg), "--loop", "manual", "--deepspeed", "0.18.6", "--steps", "2", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 1
    assert runs == [("fp32", 2, ("manual",), {"deepspeed": "0.18.6"}, 2, "mlp"), ("fp32", 4, ("manual",),
                    {"deepspeed": "0.18.6"}, 2, "mlp"), ("bf16", 2, ("manual",), {"deepspeed": "0.18.6"}, 2, "mlp"),
                    ("bf16", 4, ("manual",), {"deepspeed": "0.18.6"}, 2, "mlp")]
    assert "checking each it could resolve to (fp32, bf16)" in printed
    assert "verdict over every precision: fp32 affected, bf16 affected -> affected (exit 1)" in printed
    assert f"gradkit check {cfg} [bf16]" in printed
    assert out.read_text().startswith('{\n "config_file": ')
    doc = json.loads(out.read_text())
    assert doc["summary"] == {"verdict": "affected", "exit": 1} and doc["records"] == []
    assert set(doc["precisions"]) == {"fp32", "bf16"} and doc["config_file"] == str(cfg.resolve())
    assert [r["role"] for r in doc["precisions"]["fp32"]["records"]] == ["control", "measured", "separating control",
                                                                         "separating measured"]
    runs.clear()
    code = check.main([str(cfg), "--loop", "manual", "--trainer-dtype", "fp32", "--ga", "3", "--json", str(out)])
    assert code == 1 and [r[:3] for r in runs] == [("fp32", 2, ("manual",)), ("fp32", 4, ("manual",))]
    printed = capsys.readouterr().out
    assert f"gradkit check {cfg}: DeepSpeed" in printed and "[fp32]" not in printed  # one precision: not named
    assert "checking each" not in printed
    assert runs[0][3] == {}  # the installed release
    doc = json.loads(out.read_text())
    assert doc["summary"]["loops"][0]["loop"] == "manual" and len(doc["records"]) == 4
    assert "verdict over every precision" not in printed
    monkeypatch.setattr(ds_config, "run", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("planted")))
    assert check.main([str(cfg), "--trainer-dtype", "fp32", "--json", str(out)]) == 3
    assert "internal error while checking fp32: RuntimeError: planted (nothing was measured: exit 3)" in \
        capsys.readouterr().out
    assert json.loads(out.read_text())["summary"]["error"] == "RuntimeError: planted"


def test_a_deepspeed_config_in_an_environment_without_deepspeed_is_refused_before_any_launch(tmp_path, monkeypatch):
    """In a user's environment the check judges the installed stack; with no DeepSpeed there (and no --deepspeed
    release to put in an overlay) it says so in one sentence, exit 2, nothing launched."""
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
                               "zero_optimization": {"stage": 2}}))
    have = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda p: "absent" if p == "deepspeed" else have(p))
    monkeypatch.setattr(ds_config, "run", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(config.ConfigError, match=r"runs on DeepSpeed, which is not installed in this environment"):
        check.main([str(cfg)])
