"""`gradkit check`: a user's DeepSpeed config, judged on real 2-rank worlds; bad input never launches."""
import json
import subprocess
import sys

import pytest

from kit import check, config, launch, oracle
from kit.probes import ds_config

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
    ([], {**B3_CONFIG, "bf16": {"enabled": True}, "fp16": {"enabled": True}}, "both enabled"),
    ([], [1, 2], "JSON object"),
    (["--deepspeed", "latest"], B3_CONFIG, "latest"),
    ([], {**B3_CONFIG, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}, "NVMe"),
])
def test_bad_input_exits_2_before_anything_launches(tmp_path, monkeypatch, capsys, args, cfg, needle):
    monkeypatch.setattr(launch, "run_world", lambda *a, **k: pytest.fail("a world was launched"))
    with pytest.raises(config.ConfigError, match=needle):
        check.main([_write(tmp_path, cfg), *args])


def test_the_console_command_says_one_sentence_and_exits_2(tmp_path):
    bad = tmp_path / "broken.json"
    bad.write_text("{\"zero_optimization\": ")
    for argv in (["check", str(bad)], ["check", str(tmp_path / "missing.json")], ["frobnicate"], ["check"]):
        out = subprocess.run([sys.executable, "-m", "kit", *argv], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, (argv, out.stderr)
        lines = [line for line in out.stderr.splitlines() if line.strip() and "WARNING" not in line]
        assert len(lines) == 1 and lines[0].startswith("error: "), (argv, out.stderr)


def test_fp16_on_cpu_is_cannot_run_said_plainly_and_exit_3(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(launch, "run_world", lambda *a, **k: pytest.fail("a world was launched"))
    code = check.main([_write(tmp_path, {**B3_CONFIG, "fp16": {"enabled": True}}), "--loop", "engine"])
    text = capsys.readouterr().out
    assert code == 3 and "fp16 cannot run here" in text and "GPU" in text


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
    assert out.returncode == 2 and "cannot read" in out.stderr


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
