"""``gradkit check --path fsdp2|accelerate|trainer``: real 2-rank worlds, the check's exit codes."""
import json
from pathlib import Path

import pytest

from gradkit import config, frameworks, launch
from gradkit.commands import check

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
    (["a.yaml", "b.yaml", "--path", "accelerate"], "at most one config file"),  # two files: refused, not the first read
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
    ("a: [unclosed\n", "is not YAML: while parsing a flow sequence$"),  # yaml's first line only
])
def test_an_accelerate_config_the_check_cannot_judge_is_refused_with_one_sentence(tmp_path, monkeypatch, yaml_text, needle):
    monkeypatch.setattr(launch, "run_world", lambda *a, **k: pytest.fail("a world was launched"))
    cfg = tmp_path / "acc.yaml"
    cfg.write_text(yaml_text)
    with pytest.raises(config.ConfigError, match=needle):
        check.main([str(cfg), "--path", "accelerate"])


# ------------------------------------------------------------------ what each path's check runs, and what it says
# (no world: the plan is asserted before anything launches; the summary and report on records made by hand)

def _plan(*argv):
    from gradkit.commands import check_paths

    return check_paths.plan(check.parser().parse_args(list(argv)))


def _names(cases):
    return [(c["name"], c["role"]) for c in cases]


def test_fsdp2_checks_the_users_setting_beside_its_control_and_adds_the_workaround_only_where_it_raises():
    probe, cases, stacks, notes = _plan("--path", "fsdp2")
    assert probe.id == "FSDP2" and stacks == [{}] and notes == []
    assert _names(cases) == [("control", "control"), ("sync_last", "measured")]
    assert cases[0]["setting"] == "plain torch" and cases[0]["dtype"] == "fp32"
    assert cases[1]["fsdp"] == [True, "fp32", "fp32", "layers"] and cases[1]["setting"] == "fp32"
    assert all(c["ga"] == 4 and c["model"] == "mlp" and c["micro_batch"] == 4 for c in cases)
    _, cases, _, _ = _plan("--path", "fsdp2", "--sync", "every", "--no-reshard", "--units", "one", "--ga", "2",
                           "--model", "conditional")
    assert _names(cases) == [("control", "control"), ("sync_every", "measured")]
    assert cases[1]["fsdp"] == [False, "fp32", "fp32", "one"] and all(c["ga"] == 2 for c in cases)
    assert all(c["model"] == "conditional" for c in cases)
    _, cases, _, _ = _plan("--path", "fsdp2", "--param-dtype", "bf16")
    assert _names(cases) == [("control", "control"), ("sync_last", "measured"), ("sync_last", "fix")]
    assert cases[1]["fsdp"] == [True, "bf16", "fp32", "layers"] and cases[1]["dtype"] == "bf16"
    assert cases[2]["fsdp"] == [True, "bf16", "bf16", "layers"] and cases[2]["fix"] == "reduce_dtype=bf16"
    assert cases[2]["fixes"] == "sync_last" and cases[2]["setting"] != cases[1]["setting"]
    _, cases, _, _ = _plan("--path", "fsdp2", "--param-dtype", "bf16", "--reduce-dtype", "bf16")
    assert _names(cases) == [("control", "control"), ("sync_last", "measured")]


def test_accelerate_checks_the_loop_its_config_and_flags_name_with_the_last_window_where_ga_leaves_one(tmp_path):
    probe, cases, stacks, notes = _plan("--path", "accelerate")
    assert probe.id == "ACC" and stacks == [{}] and notes == []
    assert _names(cases) == [("control", "control"), ("accumulate", "measured")] and cases[1]["ga"] == 4
    _, cases, stacks, _ = _plan("--path", "accelerate", "--sync-each-batch", "--accelerate", "0.30.1")
    assert _names(cases)[1] == ("sync_each_batch", "measured") and stacks == [{"accelerate": "0.30.1"}]
    _, _, stacks, _ = _plan("--path", "accelerate", "--accelerate", "installed")
    assert stacks == [{}]
    cfg = tmp_path / "acc.yaml"
    cfg.write_text("distributed_type: MULTI_CPU\nmixed_precision: no\ngradient_accumulation_steps: 3\nnum_processes: 2\n")
    _, cases, _, notes = _plan(str(cfg), "--path", "accelerate", "--ga", "8", "--dataloader-length", "10")
    assert [c["ga"] for c in cases] == [3, 3, 1, 1, 1]  # the config's GA wins over --ga; 10 = 3 x 3 + a window of 1
    assert _names(cases)[2:] == [("control", "control"), ("last_window", "measured"), ("last_window_fixed", "fix")]
    assert all(c["accumulation_steps"] == 3 for c in cases[2:]) and cases[4]["fixes"] == "last_window"
    assert cases[4]["fix"] == "scale the last window's loss by 3 / 1"
    assert notes == [f"from {cfg}: distributed_type MULTI_CPU, gradient_accumulation_steps 3",
                     "a dataloader of 10 micro-batches ends in a window of 1 of 3"]
    _, cases, _, notes = _plan("--path", "accelerate", "--dataloader-length", "8")
    assert len(cases) == 2 and notes == []  # 8 = 2 x 4: no short window
    cfg.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n")
    _, cases, _, notes = _plan(str(cfg), "--path", "accelerate")
    assert _names(cases)[1] == ("accumulate_fsdp2", "measured") and notes == [f"from {cfg}: distributed_type FSDP"]


@pytest.mark.parametrize("text, ok", [("mixed_precision: fp32\n", True), ("mixed_precision: 'no'\n", True),
                                      ("mixed_precision: no\n", True), ("mixed_precision:\n", True),
                                      ("mixed_precision: fp16\n", False), ("{}\n", True)])
def test_an_accelerate_config_in_fp32_is_taken_and_one_in_mixed_precision_is_not(tmp_path, text, ok):
    from gradkit.commands import check_paths

    cfg = tmp_path / "acc.yaml"
    cfg.write_text(text)
    if ok:
        got = check_paths.accelerate_settings(str(cfg))
        assert got["ga"] is None and got["world_size"] is None and got["fsdp2"] is False
    else:
        with pytest.raises(config.ConfigError, match="in fp32"):
            check_paths.accelerate_settings(str(cfg))
    with pytest.raises(config.ConfigError, match="no such Accelerate config file"):
        check_paths.accelerate_settings(str(tmp_path / "absent.yaml"))


def test_the_trainer_check_runs_the_users_arguments_and_re_runs_the_fix_unless_it_is_already_set():
    probe, cases, stacks, notes = _plan("--path", "trainer")
    assert probe.id == "HFT" and stacks == [{}]
    names = _names(cases)
    assert ("trainer", "measured") in names and ("avg_tokens_on", "fix") in names
    assert next(c for c in cases if c["name"] == "avg_tokens_on")["fixes"] == "trainer"
    assert all(c["trainer_args"] == {} for c in cases if c["name"] == "trainer")  # the release's own defaults
    assert all(c["micro_batch"] == 2 for c in cases if c["ga"] == 4)
    assert notes == ["TrainingArguments: per_device_train_batch_size 2, gradient_accumulation_steps 4 "
                     "(average_tokens_across_devices: the release's default)"]
    _, cases, _, notes = _plan("--path", "trainer", "--average-tokens-across-devices", "false",
                               "--per-device-train-batch-size", "3", "--ga", "2")
    trainer = [c for c in cases if c["name"] == "trainer"]
    assert trainer and all(c["trainer_args"] == {"average_tokens_across_devices": False} for c in trainer)
    assert notes == ["TrainingArguments: per_device_train_batch_size 3, gradient_accumulation_steps 2, "
                     "average_tokens_across_devices false"]
    _, cases, _, _ = _plan("--path", "trainer", "--average-tokens-across-devices", "true")
    assert "avg_tokens_on" not in {c["name"] for c in cases}
    assert all(c["trainer_args"] == {"average_tokens_across_devices": True} for c in cases if c["name"] == "trainer")
    assert _plan("--path", "trainer", "--transformers", "4.46.3")[2] == [{"transformers": "4.46.3", "accelerate": "1.0.1"}]
    assert _plan("--path", "trainer", "--transformers", "5.0.0")[2] == [{"transformers": "5.0.0"}]


def _rec(case, role, verdict, ga=4, bug="ACC", ratio=1.0, **kw):
    return {"bug": bug, "case": case, "role": role, "verdict": verdict, "ga": ga, "reason": f"{case}: why",
            "metrics": {"norm_ratio": ratio, "cosine": 0.5, "rel_l2": 0.1}, "attribution": {"misplaced_weight": 0.25},
            "config": {"model": "mlp", **kw.pop("config", {})}, "versions": {"torch": "2.13.0", "accelerate": "0.30.1"},
            "world_size": 2, **kw}


def _path_recs():
    return [_rec("control", "control", "not-affected"),
            _rec("sync_each_batch", "measured", "affected", ratio=0.9457, shape="4 optimizer steps per window"),
            _rec("sync_each_batch", "fix", "not-affected", config={"fix": "accelerate 0.31.0", "fixes": "sync_each_batch"}),
            _rec("sync_each_batch", "fix", "affected", ga=2, ratio=7.0, config={"fixes": "sync_each_batch"}),
            _rec("accumulate", "measured", "not-affected"),
            _rec("mystery", "measured", "cannot-run", metrics=None, attribution=None)]


def test_a_path_check_summary_judges_each_measured_loop_with_its_own_fix_and_the_worst_verdict():
    from gradkit.commands import check_paths

    s = check_paths.summarise(_path_recs())
    assert (s["verdict"], s["exit"]) == ("affected", 1)
    rows = {r["loop"]: r for r in s["loops"]}
    assert list(rows) == ["sync_each_batch", "accumulate", "mystery"]
    row = rows["sync_each_batch"]
    assert (row["ratio"], row["cosine"], row["misplaced_weight"]) == (0.9457, 0.5, 0.25)
    assert row["fix"] == {"what": "accelerate 0.31.0", "verdict": "not-affected", "ratio": 1.0}  # its GA's fix only
    assert row["explanation"].startswith("sync_each_batch forces sync_gradients to True")
    assert rows["accumulate"]["fix"] is None and rows["accumulate"]["explanation"] is None
    assert rows["mystery"]["ratio"] is None and rows["mystery"]["explanation"] is None
    assert s["control"] == {"verdict": "not-affected", "reason": "control: why"}
    only = check_paths.summarise([r for r in _path_recs() if r["case"] == "accumulate"])
    assert (only["verdict"], only["exit"], only["control"]) == ("not-affected", 0, None)
    bad = check_paths.summarise([_rec("control", "control", "affected"), _rec("accumulate", "measured", "cannot-run")])
    assert (bad["verdict"], bad["exit"], bad["control"]["verdict"]) == ("cannot-run", 3, "affected")
    nofix = _path_recs()[:2] + [_rec("sync_each_batch", "fix", "not-affected", config={"fixes": "sync_each_batch"})]
    assert check_paths.summarise(nofix)["loops"][0]["fix"]["what"] == "sync_each_batch"  # the fix case's name


def test_a_path_check_report_prints_each_loops_numbers_and_what_is_known_of_it():
    from gradkit.commands import check_paths

    recs = _path_recs()
    a = check.parser().parse_args(["--path", "accelerate"])
    text = check_paths.report(recs, check_paths.summarise(recs), a, ["a note"])
    lines = text.splitlines()
    assert lines[0] == "gradkit check --path accelerate: torch 2.13.0, accelerate 0.30.1; 2 ranks (cpu), mlp"
    assert lines[1] == "  as run: a note"
    row = next(i for i, line in enumerate(lines) if line.lstrip().startswith("sync_each_batch"))
    assert lines[row].split() == ["sync_each_batch", "4", "affected", "0.9457", "0.50000", "0.2500"]
    assert lines[row + 1] == "      the step is: 4 optimizer steps per window"
    assert lines[row + 2] == "      sync_each_batch: why"
    assert lines[row + 3].startswith("      known: sync_each_batch forces")
    assert lines[row + 4] == "      fix: accelerate 0.31.0; re-run with the fix: not-affected (ratio 1.0000)"
    ok = next(i for i, line in enumerate(lines) if line.lstrip().startswith("accumulate"))
    assert lines[ok + 1].lstrip().startswith("mystery")  # a loop that is not affected says nothing more
    mystery = lines[ok + 1:ok + 4]
    assert mystery[0].split() == ["mystery", "4", "cannot-run", "-", "-", "-"]
    assert mystery[1:] == ["      mystery: why", "      not explained by any mechanism the kit knows"]
    assert lines[-2:] == ["  control (plain torch.distributed, not the library under test): not-affected",
                          "verdict: affected (exit 1)"]
    t = check.parser().parse_args(["--path", "trainer"])
    text = check_paths.report([{**r, "config": {}} for r in recs[:1]], {"loops": [], "control": None,
                                                                         "verdict": "cannot-run", "exit": 3}, t, [])
    assert text.splitlines()[0].endswith("2 ranks (cpu), Llama (tiny)") and "): absent" in text


def test_the_path_check_runs_its_plan_in_one_world_and_writes_what_it_printed(tmp_path, monkeypatch, capsys):
    from gradkit.probes import runner

    seen = {}

    def run(probe, cases, stacks, world_sizes, device, timeout_s, meta, label):
        seen.update(probe=probe.id, cases=cases, stacks=stacks, world_sizes=world_sizes, device=device, meta=meta)
        return _path_recs()

    monkeypatch.setattr(runner, "run", run)
    out = tmp_path / "check.json"
    assert check.main(["--path", "accelerate", "--steps", "3", "--world-size", "3", "--json", str(out)]) == 1
    assert seen["probe"] == "ACC" and seen["world_sizes"] == (3,) and seen["stacks"] == [{}]
    assert seen["meta"] == {"seed": 0}  # the data seed notebook 07 uses
    assert all(c["steps"] == 3 for c in seen["cases"]) and len(seen["cases"]) == 2
    printed = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["path"] == "accelerate" and doc["summary"]["exit"] == 1 and len(doc["records"]) == 6
    assert "verdict: affected (exit 1)" in printed
    monkeypatch.setattr(runner, "run", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("planted")))
    assert check.main(["--path", "fsdp2", "--json", str(out)]) == 3
    assert "internal error while checking --path fsdp2: RuntimeError: planted (nothing was measured: exit 3)" in \
        capsys.readouterr().out
    assert json.loads(out.read_text())["summary"]["error"] == "RuntimeError: planted"
    monkeypatch.setattr(runner, "run", lambda *a, **k: pytest.fail("a world was launched"))
    with pytest.raises(config.ConfigError, match="--json .* does not exist"):
        check.main(["--path", "fsdp2", "--json", str(tmp_path / "no" / "x.json")])
    monkeypatch.setattr(runner, "run", lambda *a, **k: [_rec("accumulate", "measured", "not-affected")])
    assert check.main(["--path", "accelerate", "--world-size", "1", "--allow-one-rank"]) == 0


def test_the_path_checks_measure_the_world_notebook_07_measures():
    """The check's cases are the probe's own at the user's setting: the same model size, micro-batch and data seed
    as notebook 07's cells, so that a check's numbers are the notebook's."""
    from gradkit.probes import accelerate_ga, fsdp2

    for path, probe_plan in (("fsdp2", fsdp2.plan((4,))), ("accelerate", accelerate_ga.plan((4,)))):
        _, cases, _, _ = _plan("--path", path)
        ref = probe_plan[0]
        assert all((c["micro_batch"], c["hidden"], c["seed"]) == (ref["micro_batch"], ref["hidden"], ref["seed"])
                   for c in cases), path


def test_an_fsdp_accelerate_config_without_a_version_is_fsdp1_and_refused(tmp_path):
    from gradkit.commands import check_paths

    cfg = tmp_path / "acc.yaml"
    cfg.write_text("distributed_type: FSDP\nfsdp_config: {}\n")
    with pytest.raises(config.ConfigError, match="FSDP version 1: the kit checks FSDP2 only"):
        check_paths.accelerate_settings(str(cfg))


def test_each_record_is_explained_by_its_own_paths_mechanism_and_each_loop_gets_its_own_fix():
    from gradkit.commands import check_paths

    hft = _rec("trainer", "measured", "affected", bug="HFT", versions={"torch": "2.13.0", "transformers": "4.45.2"})
    assert check_paths.explanation(hft).startswith("each micro-batch's loss is the mean over its own label tokens")
    assert check_paths.explanation({**hft, "case": "no such case"}) is None
    recs = [_rec("sync_each_batch", "measured", "affected"), _rec("last_window", "measured", "affected"),
            _rec("last_window_fixed", "fix", "not-affected", config={"fix": "scale", "fixes": "last_window"}),
            _rec("sync_each_batch", "fix", "affected", ratio=0.9, config={"fix": "upgrade", "fixes": "sync_each_batch"})]
    rows = {r["loop"]: r for r in check_paths.summarise(recs)["loops"]}
    assert rows["sync_each_batch"]["fix"] == {"what": "upgrade", "verdict": "affected", "ratio": 0.9}
    assert rows["last_window"]["fix"] == {"what": "scale", "verdict": "not-affected", "ratio": 1.0}


def test_a_long_reason_is_cut_at_300_characters_and_the_json_is_indented_by_one(tmp_path, monkeypatch):
    from gradkit.commands import check_paths
    from gradkit.probes import runner

    recs = [_rec("accumulate", "measured", "affected", reason="r" * 400),
            _rec("sync_each_batch", "measured", "not-affected", shape="every micro-batch x1")]
    a = check.parser().parse_args(["--path", "accelerate"])
    lines = check_paths.report(recs, check_paths.summarise(recs), a, []).splitlines()
    assert "      " + "r" * 300 in lines and "r" * 301 not in "\n".join(lines)
    assert not [line for line in lines if "the step is" in line]  # a step's words only where it is affected
    monkeypatch.setattr(runner, "run", lambda *a, **k: recs)
    out = tmp_path / "c.json"
    check.main(["--path", "accelerate", "--json", str(out)])
    assert out.read_text().startswith('{\n "path": "accelerate",\n "summary": {\n  "verdict"')


@pytest.mark.world
def test_an_axolotl_config_is_checked_with_what_axolotl_sets_on_its_trainer_and_its_fix_verified(capsys):
    """axolotl 0.19.0 sets model_accepts_loss_kwargs and average_tokens_across_devices False on its Trainer, whatever
    the YAML says (what tests/test_recipes.py measures on axolotl itself): the check runs the Trainer so, names the
    mechanism and re-runs the recipe's plugin fix in the same world; the same Trainer left as transformers sets it up
    is exact (the control of the setting, not of the library)."""
    recipe = Path(__file__).resolve().parents[1] / "examples" / "recipes" / "axolotl" / "lora.yml"
    assert frameworks.read(recipe).trainer_overrides == {"average_tokens_across_devices": False,
                                                          "model_accepts_loss_kwargs": False}
    assert check.main([str(recipe)]) == 1
    out = capsys.readouterr().out
    assert "model_accepts_loss_kwargs=False (axolotl sets it" in out, out
    assert "fix: average_tokens_across_devices=True and model_accepts_loss_kwargs=True" in out
    assert "re-run with the fix: not-affected" in out
    assert check.main(["--path", "trainer", "--ga", "4"]) == 0, capsys.readouterr().out
    # the flag alone, with one token count over the ranks: what makes the step the mean of micro-batch means
    assert check.main(["--path", "trainer", "--ga", "4", "--average-tokens-across-devices", "true",
                       "--model-accepts-loss-kwargs", "false"]) == 1, capsys.readouterr().out


def test_a_path_check_takes_the_ga_and_world_size_its_flags_table_documents_unless_given(repo):
    """docs/check.md's table of flags: `--ga` 4 where nothing gives it, `--world-size` else 2; a path check's settings
    are its flags, so those are its run's, and a flag given is taken as given."""
    from gradkit.commands import check_paths

    rows = {r.split("|")[1].strip(): r.split("|")[2] for r in (repo / "docs/check.md").read_text().splitlines()
            if r.startswith("| `--")}
    ga, world = int(rows["`--ga N`"].split(",")[0]), int(rows["`--world-size N`"].split("else ")[1].split()[0])
    assert (ga, world) == (4, 2)  # the table as written, read apart from the code
    for path in ("fsdp2", "accelerate", "trainer"):
        a = check.parser().parse_args(["--path", path])
        check_paths.settle(a)
        assert (a.ga, a.world_size) == (ga, world), path
        a = check.parser().parse_args(["--path", path, "--ga", "3", "--world-size", "4"])
        check_paths.settle(a)
        assert (a.ga, a.world_size) == (3, 4), path
