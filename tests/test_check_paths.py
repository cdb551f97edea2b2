"""``gradkit check --path fsdp2|accelerate|trainer``: real 2-rank worlds, the check's exit codes."""
import json

import pytest

from kit import check, config, launch

pytestmark = pytest.mark.usefixtures("warm_module")


@pytest.mark.world
def test_fsdp2_in_fp32_is_exact_and_bf16_with_fp32_reduce_raises_with_its_workaround_verified(tmp_path, capsys):
    assert check.main(["--path", "fsdp2", "--ga", "4", "--model", "conditional"]) == 0, capsys.readouterr().out
    out = tmp_path / "f.json"
    code = check.main(["--path", "fsdp2", "--ga", "2", "--model", "conditional", "--param-dtype", "bf16",
                       "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 3, text  # FSDP2 raised: cannot-run, never a verdict
    assert "_unsharded_param" in text and "pytorch/pytorch#194058" in text
    assert "fix: reduce_dtype=bf16; re-run with the fix: not-affected" in text
    doc = json.loads(out.read_text())
    assert doc["summary"]["exit"] == 3 and doc["summary"]["loops"][0]["fix"]["verdict"] == "not-affected"


@pytest.mark.world
def test_accelerate_sync_each_batch_on_0_30_1_and_a_short_last_window_are_affected_and_explained(tmp_path, capsys):
    cfg = tmp_path / "acc.yaml"
    cfg.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\ngradient_accumulation_steps: 4\nmixed_precision: no\n")
    code = check.main([str(cfg), "--path", "accelerate", "--sync-each-batch", "--accelerate", "0.30.1",
                       "--dataloader-length", "10"])
    text = capsys.readouterr().out
    assert code == 1, text
    assert "sync_each_batch" in text and "huggingface/accelerate#2790" in text
    assert "a dataloader of 10 micro-batches ends in a window of 2 of 4" in text
    assert "the step is: every micro-batch x0.5" in text and "re-run with the fix: not-affected" in text
    assert check.main([str(cfg), "--path", "accelerate", "--sync-each-batch"]) == 0, capsys.readouterr().out


@pytest.mark.world
def test_the_trainer_on_two_ranks_is_exact_as_shipped_and_affected_with_per_rank_token_counts(capsys):
    assert check.main(["--path", "trainer"]) == 0, capsys.readouterr().out
    code = check.main(["--path", "trainer", "--average-tokens-across-devices", "false"])
    text = capsys.readouterr().out
    assert code == 1, text
    assert "each rank divides its summed token loss by its own token count" in text
    assert "fix: average_tokens_across_devices=True; re-run with the fix: not-affected" in text


@pytest.mark.parametrize("argv, needle", [
    (["--path", "fsdp2", "--sync-each-batch"], "--sync-each-batch belongs to --path accelerate"),
    (["--path", "accelerate", "--param-dtype", "bf16"], "--param-dtype belongs to --path fsdp2"),
    (["--path", "trainer", "--model", "mlp"], "--model is not taken"),
    (["--path", "fsdp2", "--model", "gpt9"], "takes a model shape"),
    (["--path", "fsdp2", "--reduce-dtype", "bf16"], "with fp32 parameters"),
    (["--path", "trainer", "--ga", "1"], "needs --ga > 1"),
    (["--path", "trainer", "--transformers", "latest"], "latest"),
    (["--path", "fsdp2", "--world-size", "1"], "hides every bug"),
    ([], "needs a DeepSpeed config file"),
])
def test_bad_path_input_exits_2_before_anything_launches(monkeypatch, argv, needle):
    monkeypatch.setattr(launch, "run_world", lambda *a, **k: pytest.fail("a world was launched"))
    with pytest.raises(config.ConfigError, match=needle):
        check.main(argv)


@pytest.mark.parametrize("yaml_text, needle", [
    ("distributed_type: DEEPSPEED\n", "gradkit check ds_config.json"),
    ("mixed_precision: bf16\n", "judges Accelerate's accumulation in fp32"),
    ("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 1\n", "FSDP2 only"),
    ("- a\n- list\n", "mapping of keys"),
    ("a: [unclosed\n", "is not YAML"),
])
def test_an_accelerate_config_the_check_cannot_judge_is_refused_with_one_sentence(tmp_path, monkeypatch, yaml_text, needle):
    monkeypatch.setattr(launch, "run_world", lambda *a, **k: pytest.fail("a world was launched"))
    cfg = tmp_path / "acc.yaml"
    cfg.write_text(yaml_text)
    with pytest.raises(config.ConfigError, match=needle):
        check.main([str(cfg), "--path", "accelerate"])
