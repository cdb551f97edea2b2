"""What `gradkit check` decides before anything launches, and how it adds up: the loops and precisions it judges
by default, the exit rule over precisions and over a set of configs, the features of shipped configs it replaces
or refuses, and the precision a step is judged at. No world here: the world tests are in test_check.py."""
import json
import time

import pytest

from gradkit import config, launch
from gradkit.commands import check
from gradkit.commands.check import known, many, one, plan
from gradkit.judge import oracle
from gradkit.judge.expectations import KNOWN
from gradkit.judge import verdict as kverdict
from gradkit.probes import ds_config, ds_features

A, N, C = oracle.AFFECTED, oracle.NOT_AFFECTED, oracle.CANNOT_RUN
FP16_HERE = {"fp16": "fp16 cannot run here"}


@pytest.mark.parametrize("verdicts, not_here, asked, want", [
    ({"fp32": N, "bf16": N, "fp16": C}, FP16_HERE, set(), N),         # auto: fp16 only could be: not counted
    ({"fp32": N, "bf16": N, "fp16": C}, FP16_HERE, {"fp16"}, C),      # asked for: counted
    ({"fp32": N, "bf16": A, "fp16": C}, FP16_HERE, set(), A),
    ({"fp16": C}, FP16_HERE, set(), C),                               # nothing judged is never not-affected
    ({"fp32": N, "bf16": oracle.INCONCLUSIVE}, {}, set(), oracle.INCONCLUSIVE),  # judged and unclear: counted
    ({"fp32": N}, {}, {"fp32"}, N),
])
def test_the_verdict_over_precisions_counts_what_was_judged_and_what_was_asked_for(verdicts, not_here, asked, want):
    assert kverdict.over_precisions(verdicts, not_here, asked) == want


def test_the_precisions_asked_for_are_the_flag_the_run_or_what_the_config_enables_itself():
    auto = {"bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}
    assert plan.asked(auto, None, None) == set()
    assert plan.asked(auto, "bf16", None) == {"bf16"} and plan.asked(auto, "bf16", "fp16") == {"fp16"}
    assert plan.asked({"fp16": {"enabled": True}}, None, None) == {"fp16"}
    assert plan.asked({}, None, None) == {"fp32"}
    assert plan.not_here("fp16", "cpu") is None and plan.not_here("bf16", "cpu") is None  # fp16 runs on CPU too
    assert plan.not_here("fp8", "cpu").startswith("fp8 cannot run here") and "--precision bf16" in plan.not_here("fp8", "cpu")


def test_the_default_loops_are_the_frameworks_and_others_are_asked_for():
    assert plan.loops_of(None, ("boundary",)) == ("boundary",)
    assert plan.loops_of(None, ()) == ("engine", "boundary")
    assert plan.loops_of("all", ("boundary",)) == ds_config.LOOPS
    assert plan.loops_of("manual, engine", ("boundary",)) == ("manual", "engine")


def _rec(version="0.19.8", stage=2, optimizer="DeepSpeedZeroOptimizer", ds=None):
    return {"zero_stage": stage, "optimizer": optimizer, "ga": 4, "versions": {"deepspeed": version},
            "config": {"loop": "engine", "ds_config": ds or {}, "model": "mlp"}}


def test_a_loop_not_run_is_said_in_one_line_from_the_bug_table():
    line = known.if_run(_rec(), "manual")
    assert line == ("if your own loop calls backward() several times per step() with GA 1 in the config: "
                    f"B3 is expected on DeepSpeed 0.19.8 (allenai/open-instruct#1498); fix: {KNOWN['B3'].explains[2]}")
    # the user's own config already opts out (0.19.4+): the manual loop's line says so
    assert known.if_run(_rec(ds={"managed_gradient_accumulation": False}), "manual").endswith(
        "B3 is ruled out by \"managed_gradient_accumulation\": false (honoured from 0.19.4)")
    assert known.if_run(_rec(), "unmanaged").endswith(
        "B3 is ruled out by \"managed_gradient_accumulation\": false (honoured from 0.19.4)")
    assert known.if_run(_rec("0.18.2"), "manual").endswith("no known bug is expected on DeepSpeed 0.18.2")
    assert known.if_run(_rec(stage=3), "manual").endswith("no known bug is expected on DeepSpeed 0.19.8")
    assert "\": false: B3 is expected on DeepSpeed 0.19.3" in known.if_run(_rec("0.19.3"), "unmanaged")  # ignored


def _features(cfg, fp16=False):
    notes = []
    return ds_features.apply(cfg, notes, fp16), notes, cfg


def test_shipped_config_features_are_kept_replaced_or_refused_with_a_sentence():
    why, notes, cfg = _features({"compile": {"disable": False, "backend": "inductor"}})
    assert why is None and "compile" not in cfg and notes[0].startswith("compile removed")
    why, _, _ = _features({"compile": {"deepcompile": True}})
    assert why.startswith("compile.deepcompile") and "remove compile.deepcompile" in why
    why, _, _ = _features({"zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 0.1}}})
    assert why.startswith("zero_optimization.zenflow") and "remove the zenflow block" in why
    assert _features({"tensor_parallel": {"autotp_size": 2}})[0] is None  # judged (on a tiny Llama): 2 ranks, one group
    why = ds_features.apply({"tensor_parallel": {"autotp_size": 4}}, [], False, world_size=2)
    assert why.startswith("tensor_parallel.autotp_size 4 splits") and "--world-size 4" in why
    assert ds_features.autotp_size({"tensor_parallel": {"autotp_size": 2}}) == 2 and ds_features.autotp_size({}) == 1
    assert _features({"tensor_parallel": {"autotp_size": 1}})[0] is None
    why, notes, cfg = _features({"fp16": {"enabled": False, "auto_cast": True}})
    assert why is None and "auto_cast" not in cfg["fp16"] and notes[0].startswith("fp16.auto_cast removed")
    assert _features({"fp16": {"enabled": True, "auto_cast": True}}, fp16=True)[2]["fp16"]["auto_cast"] is True
    why, notes, cfg = _features({"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": "/x"}}})
    assert cfg["zero_optimization"]["offload_param"] == {"device": "cpu"} and "nvme -> cpu" in notes[0]
    assert ds_features.optimizer_refusal({"optimizer": {"type": "OneBitAdam"}}).startswith('the optimizer "OneBitAdam"')
    assert ds_features.optimizer_refusal({"optimizer": {"type": "AdamW"}}) is None


def test_a_refused_feature_is_cannot_run_with_its_sentence_and_nothing_launches(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(launch, "run_world", lambda *a, **k: pytest.fail("a world was launched"))
    path = tmp_path / "zenflow.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 0.1}}}))
    assert check.main([str(path)]) == 3
    assert "remove the zenflow block" in capsys.readouterr().out


def test_a_step_is_judged_at_the_coarsest_precision_its_gradient_passes_through():
    fp32 = ds_config.resolve({"bf16": {"enabled": "auto", "bf16_master_weights_and_grads": True,
                                       "bf16_optimizer_states": True}, "zero_optimization": {"stage": 2}}, 2, 4, "fp32")
    assert ds_config.dtype_of(fp32) == "fp32" and ds_config.judge_dtype(fp32) == "bf16"
    assert ds_config.judge_note(fp32).startswith("judged at bf16's limits (rel. error 0.03, misplaced weight 0.005): "
                                                 "bf16.bf16_master_weights_and_grads puts the gradient through bf16")
    plain = ds_config.resolve({"zero_optimization": {"stage": 2}}, 2, 4, "fp32")
    assert ds_config.judge_dtype(plain) == "fp32" and ds_config.judge_note(plain) is None
    both = ds_config.resolve({"communication_data_type": "bf16", "data_types": {"grad_accum_dtype": "bf16"},
                              "zero_optimization": {"stage": 1}}, 2, 4, "fp32")
    assert "communication_data_type and data_types.grad_accum_dtype put the gradient" in ds_config.judge_note(both)
    cases, _ = ds_config.plan(fp32, ("engine",))
    assert cases[1]["judge_dtype"] == "bf16" and cases[1]["dtype"] == "fp32"


def _fake_run(calls):
    def run(cfg, loops, world_size, stack, device, timeout, steps, model):
        calls.append((ds_config.dtype_of(cfg), loops))
        rec = {"case": "x", "role": "measured", "verdict": N, "reason": "ok", "zero_stage": 2,
               "optimizer": "DeepSpeedZeroOptimizer", "ga": 4, "dtype": "fp32",
               "versions": {"deepspeed": "0.19.8", "torch": "2.13.0"}, "metrics": {"norm_ratio": 1.0, "cosine": 1.0},
               "attribution": {"misplaced_weight": 0.0}, "config": {"ds_config": {}, "model": "mlp"}}
        return [{**rec, "case": loop, "config": {**rec["config"], "loop": loop}} for loop in loops]
    return run


def test_a_bare_auto_config_is_judged_in_the_frameworks_loops_and_the_precisions_this_machine_runs(
        tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(ds_config, "run", _fake_run(calls))
    monkeypatch.setattr(plan, "not_here", lambda dtype, device: "fp16 cannot run here" if dtype == "fp16" else None)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                                "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
                                "zero_optimization": {"stage": 2}}))
    assert check.main([str(path)]) == 0
    text = capsys.readouterr().out
    assert calls == [("fp32", ("engine", "boundary")), ("bf16", ("engine", "boundary"))]
    assert "fp16 cannot run here" in text and "the exit status does not count it" in text
    assert "not run (manual, unmanaged; --loop asks for them; the exit status does not count them):" in text
    assert "B3 is expected on DeepSpeed 0.19.8" in text
    assert "fp32 not-affected, bf16 not-affected, fp16 not run here -> not-affected (exit 0)" in text
    calls.clear()
    assert check.main([str(path), "--precision", "fp16"]) == 3 and calls == []  # asked for, and cannot run here


def test_a_set_of_configs_is_one_table_and_one_exit_status(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(ds_config, "run", _fake_run(calls))
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "a.json").write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    (folder / "b.json").write_text(json.dumps({"zero_optimization": {"stage": 9}}))  # bad input: a row, not a crash
    (folder / "notes.json").write_text(json.dumps({"hello": 1}))  # no config: skipped, said
    out = tmp_path / "table"
    code = check.main([str(folder), "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 2, text
    assert f"skipped {folder / 'notes.json'}" in text
    doc = json.loads((tmp_path / "table.json").read_text())
    assert [(r["config"].split("/")[-1], r["loop"], r["verdict"]) for r in doc["rows"]] == [
        ("a.json", "engine", N), ("a.json", "boundary", N), ("b.json", "-", "bad input")]
    assert (tmp_path / "table.md").read_text().startswith("| config | precision | loop | verdict |")
    assert many.set_exit([{"verdict": N}, {"verdict": A}, {"verdict": many.BAD_INPUT}]) == (A, 1)
    assert many.set_exit([{"verdict": N}, {"verdict": C}]) == (C, 3)
    assert many.set_exit([{"verdict": N}, {"verdict": N}]) == (N, 0)


def test_a_folder_with_no_config_or_a_missing_path_is_bad_input(tmp_path):
    with pytest.raises(config.ConfigError, match="no config file"):
        many.expand([str(tmp_path)])
    with pytest.raises(config.ConfigError, match="no such file"):
        many.expand([str(tmp_path / "nope.json")])


@pytest.mark.parametrize("argv, needle", [
    (["--scheduler", "slurm"], "--scheduler must be here, dask or a Dask scheduler's address"),
    (["--deepspeed", "0.18.6,latest"], "latest"),
])
def test_a_bad_matrix_flag_is_refused_before_anything_launches(tmp_path, monkeypatch, argv, needle):
    monkeypatch.setattr(launch, "run_world", lambda *a, **k: pytest.fail("a world was launched"))
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    with pytest.raises(config.ConfigError, match=needle):
        check.main([str(path), *argv])


def test_the_loops_not_run_are_said_from_a_measured_deepspeed_record_never_from_the_control():
    """The control (plain torch, no ZeRO stage) comes first in a world's records; what the user's own loop would give
    is read from a measured DeepSpeed record of the same world: B3 on ZeRO-2, DeepSpeed 0.19.8."""
    control = {"case": "control", "role": "control", "verdict": N, "reason": "ok", "zero_stage": None,
               "optimizer": "torch.optim.SGD", "ga": 4, "dtype": "fp32", "versions": {"deepspeed": "0.19.8"},
               "config": {"loop": "torch", "ds_config": {}, "model": "mlp"}}
    engine = {**control, "case": "engine", "role": "measured", "zero_stage": 2, "optimizer": "DeepSpeedZeroOptimizer",
              "metrics": {"norm_ratio": 1.0, "cosine": 1.0}, "attribution": {"misplaced_weight": 0.0},
              "config": {"loop": "engine", "ds_config": {}, "model": "mlp"}}
    lines = check.summarise([control, engine])["not_run"]
    assert len(lines) == 2 and "B3 is expected on DeepSpeed 0.19.8" in lines[0], lines
    assert check.summarise([control])["not_run"] == []  # nothing measured: nothing said


def test_a_pipeline_zenflow_off_and_each_spelling_of_autotp_are_read_as_deepspeed_reads_them():
    for cfg in ({"pipeline": {"stages": 2}}, {"pipe_parallel_size": 2}):
        why, notes, _ = _features(dict(cfg))
        assert why is None and notes == ["pipeline keys ignored: the check runs data parallelism (notebook 02 judges "
                                         "the pipeline)"], (cfg, notes)
    assert _features({"zero_optimization": {"stage": 2}})[1] == []            # nothing to say
    assert _features({"zero_optimization": {"zenflow": False}})[0] is None    # ZenFlow off
    assert _features({"zero_optimization": {"zenflow": True}})[0].startswith("zero_optimization.zenflow")
    assert [ds_features.autotp_size(c) for c in ({"tensor_parallel": {}}, {"tensor_parallel": {"tp_size": 2}},
                                                 {"tensor_parallel": "2"}, {"tensor_parallel": {"autotp_size": 1}},
                                                 {"tensor_parallel": {"autotp_size": 0}},
                                                 {"tensor_parallel": {"autotp_size": "2"}})] == [1, 2, 1, 1, 1, 1]
    assert ds_features.apply({"tensor_parallel": {"autotp_size": 2}}, [], False, world_size=3).startswith(
        "tensor_parallel.autotp_size 2 splits each linear layer across 2 ranks, and 3 ranks make no whole number")


def _args(*argv):
    a = check.parser().parse_args(list(argv) or ["x.json"])
    a.ga_given, a.ga = a.ga, a.ga or 4
    a.releases = [a.deepspeed]
    return a


def test_a_training_configs_own_ga_precision_and_notes_are_what_runs(repo):
    """LLaMA-Factory's run (GA 2, --bf16, ZeRO-3 with "auto" values) is resolved with its own GA and precision, its
    lines said once (the framework's, not resolve's "auto" lines again); --ga and --precision still win; a world
    size the run names is said beside the one the check runs."""
    from gradkit import frameworks

    run = frameworks.read(repo / "tests/configs/frameworks/llamafactory_full_sft.yaml")
    todo = one.prepare(run, _args(), "mlp", [])
    (dtype, cfg), = todo.items()
    assert dtype == "bf16" and cfg["gradient_accumulation_steps"] == 2 and cfg["zero_optimization"]["stage"] == 3
    assert cfg.notes[0].startswith("llamafactory: ") and any(n.startswith("train_micro_batch_size_per_gpu auto -> 4")
                                                             for n in cfg.notes)
    assert not any(n.startswith(("gradient_accumulation_steps auto", "bf16.enabled \"auto\"")) for n in cfg.notes)
    assert cfg.notes[-1].startswith("world size 2: your config does not say how many ranks")  # the file names none
    (cfg8,) = one.prepare(run, _args("x.json", "--ga", "8"), "mlp", []).values()
    assert cfg8["gradient_accumulation_steps"] == 8
    assert list(one.prepare(run, _args("x.json", "--precision", "fp32"), "mlp", [])) == ["fp32"]
    run.world_size = 8
    (cfg,) = one.prepare(run, _args(), "mlp", []).values()
    assert cfg.notes[-1] == "world size 8: your run's" and cfg.world_size == 8 and cfg["train_batch_size"] == 4 * 2 * 8
    (cfg,) = one.prepare(run, _args("x.json", "--world-size", "2"), "mlp", []).values()
    assert cfg.notes[-1] == "world size 8 (your run) -> 2 (--world-size)" and cfg.world_size == 2


def test_an_open_precision_of_a_framework_is_said_with_its_own_rule_and_a_precision_not_here_is_skipped(
        repo, monkeypatch):
    from gradkit import frameworks

    calls = []
    monkeypatch.setattr(ds_config, "run", _fake_run(calls))
    run = frameworks.read(repo / "tests/configs/frameworks/axolotl_lora.yml")  # bf16: auto -> bf16 or fp16
    said = []
    result = one.check(run, one.prepare(run, _args(), "mlp", []), _args(), "mlp", say=said.append)
    assert [c[0] for c in calls] == ["bf16", "fp16"] and result["asked"] == []
    assert said[0].startswith(f"{run.source}: the precision is not fixed (bf16: \"auto\" -> bf16 on a GPU with bf16 "
                              "support") and "micro_batch_size" not in said[0]
    assert 'bf16.enabled: "auto" -> true on a GPU with bf16 support' in said[0]  # each line that leaves it open
    run.precisions, run.precision = ("fp8", "bf16"), None  # a precision this machine cannot run, first
    todo = one.prepare(run, _args(), "mlp", [])
    assert list(todo) == ["fp8", "bf16"] and todo["fp8"] is None and todo["bf16"] is not None
    calls.clear()
    result = one.check(run, todo, _args(), "mlp", say=said.append)  # fp8 said as not run here, bf16 still checked
    assert [c[0] for c in calls] == ["bf16"] and result["precisions"]["fp8"]["not_here"].startswith("fp8 cannot run")
    run.precision, run.precisions = "bf16", ("bf16",)
    calls.clear()
    assert one.check(run, one.prepare(run, _args(), "mlp", []), _args(), "mlp", say=said.append)["asked"] == ["bf16"]


def _summary(loops=(), verdict=N, error=None):
    return {"verdict": verdict, "exit": kverdict.EXIT[verdict], "loops": list(loops), "control": None, "not_run": [],
            **({"error": error} if error else {})}


def _loop(loop, verdict, **kw):
    return {"loop": loop, "verdict": verdict, "ratio": kw.pop("ratio", 1.0), "cosine": kw.pop("cosine", 1.0),
            "explained_by": None, "explanation": None, "reason": "why " + loop, **kw}


def test_a_sets_table_has_a_row_per_precision_and_loop_with_the_bug_or_the_reason():
    result = {"source": "a.json", "release": "0.18.6", "precisions": {
        "fp32": {"summary": _summary([_loop("engine", N), _loop("boundary", A, explained_by="B5", explanation="x"),
                                      _loop("manual", A, explanation="not explained " + "y" * 300),
                                      _loop("unmanaged", oracle.INCONCLUSIVE, reason="r|s\nt")])},
        "bf16": {"summary": _summary(verdict=C, error="boom")},
        "fp16": {"summary": _summary(verdict=C), "not_here": "fp16 cannot run here"},
        "fp8": {"summary": _summary(verdict=C)}}}
    rows = many._rows(result)
    assert [(r["precision"], r["loop"], r["verdict"], r["bug_or_reason"][:20]) for r in rows] == [
        ("fp32", "engine", N, ""), ("fp32", "boundary", A, "B5"), ("fp32", "manual", A, "not explained yyyyyy"),
        ("fp32", "unmanaged", oracle.INCONCLUSIVE, "r|s\nt"), ("bf16", "-", C, "boom"),
        ("fp16", "-", "not run here", "fp16 cannot run here"), ("fp8", "-", C, "nothing judged")]
    assert len(rows[2]["bug_or_reason"]) == 200 and "deepspeed" not in rows[0]
    assert [r["deepspeed"] for r in many._rows(result, several=True)] == ["0.18.6"] * 7
    md = many.markdown(many._rows(result, several=True), A, 1).splitlines()
    assert md[:2] == ["| config | deepspeed | precision | loop | verdict | ratio | cosine | known bug or reason |",
                      "|---|---|---|---|---|---|---|---|"]
    assert md[2] == "| a.json | 0.18.6 | fp32 | engine | not-affected | 1.0000 | 1.00000 |  |"
    assert md[5] == "| a.json | 0.18.6 | fp32 | unmanaged | inconclusive | 1.0000 | 1.00000 | r/s t |"
    assert md[-2:] == ["", "set verdict: affected (exit 1)"] and len(md) == 2 + 7 + 2
    plain = many.markdown(many._rows(result), A, 1).splitlines()
    assert plain[0].startswith("| config | precision |") and plain[1] == "|---|---|---|---|---|---|---|"


def test_a_matrix_set_orders_its_rows_as_named_then_by_release_and_says_each_cell(tmp_path, monkeypatch, capsys):
    calls = []
    fake = _fake_run(calls)

    def slow(*a, **k):  # a cell that takes measurable time, so the per-config time is a number worth checking
        time.sleep(0.2)
        return fake(*a, **k)

    monkeypatch.setattr(ds_config, "run", slow)
    folder = tmp_path / "cfgs"
    folder.mkdir()
    b, a = folder / "b.json", folder / "a.json"
    for p in (b, a):
        p.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    (folder / "notes.txt").write_text("not a config")
    out, full = tmp_path / "table", tmp_path / "full.json"
    line = f"torchrun --nproc_per_node 2 train.py --deepspeed {a} --gradient_accumulation_steps 4"
    code = check.main([str(b), str(a), "--command", line, "--deepspeed", "installed,0.18.6", "--precision", "fp32",
                       "--loop", "engine", "--out", str(out), "--json", str(full)])
    text = capsys.readouterr().out
    assert code == 0, text
    doc = json.loads((tmp_path / "table.json").read_text())
    assert [(r["config"].split("/")[-1], r["deepspeed"]) for r in doc["rows"]] == [
        ("command line", "0.18.6"), ("command line", "installed"), ("b.json", "0.18.6"), ("b.json", "installed"),
        ("a.json", "0.18.6"), ("a.json", "installed")]
    said = [x for x in text.splitlines() if " @ DeepSpeed " in x]
    assert [x.split(":")[0] for x in said] == [f"command line @ DeepSpeed installed", "command line @ DeepSpeed 0.18.6",
                                               f"{b} @ DeepSpeed installed", f"{b} @ DeepSpeed 0.18.6",
                                               f"{a} @ DeepSpeed installed", f"{a} @ DeepSpeed 0.18.6"]
    walls = [c["wall_s"] for c in doc["configs"]]
    assert min(walls) >= 0.2 and f"6 configs checked in {sum(walls):.1f} s ({sum(walls) / 6:.1f} s per config)" in text
    assert (tmp_path / "table.json").read_text().startswith('{\n "verdict": "not-affected"')
    assert full.read_text().startswith('{\n "verdict"') and len(json.loads(full.read_text())["results"]) == 6
    files, skipped = many.expand([str(b), str(a)])
    assert files == [str(b), str(a)] and skipped == []
    files, skipped = many.expand([str(folder)])
    assert files == [str(a), str(b)] and skipped == []  # a folder: its config files, sorted; notes.txt is not looked at


def test_a_runs_own_ga_of_1_is_judged_as_such_and_autotp_picks_a_model_with_a_tensor_parallel_policy(repo):
    from gradkit import frameworks

    run = frameworks.read(repo / "tests/configs/frameworks/llamafactory_full_sft.yaml")
    run.ga = 1  # the Trainer accumulates nothing: judged at GA 1, not at --ga as a bare config's GA 1 is
    (cfg,) = one.prepare(run, _args(), "mlp", []).values()
    assert cfg["gradient_accumulation_steps"] == 1 and not any("every loop style takes" in n for n in cfg.notes)
    bare = frameworks.read(repo / "scripts/configs/shipped/llamafactory/ds_z2_config.json")
    bare.ds_config = {**bare.ds_config, "gradient_accumulation_steps": 1}
    (cfg,) = one.prepare(bare, _args("x.json", "--precision", "fp32"), "mlp", []).values()
    assert cfg["gradient_accumulation_steps"] == 4 and any("every loop style takes N = 4" in n for n in cfg.notes)
    tp = frameworks.read(repo / "tests/configs/corpus/llamafactory__ds_z2_autotp_config.json")
    (cfg,) = one.prepare(tp, _args("x.json", "--precision", "fp32"), "mlp", ["a note"]).values()
    assert isinstance(cfg.model, dict) and cfg.model["model_config"]["model_type"] == "llama"
    assert "a note" in cfg.notes and any(n.startswith("model: a tiny Llama") and "not the MLP" in n for n in cfg.notes)
    (cfg,) = one.prepare(bare, _args("x.json", "--precision", "fp32"), "mlp", []).values()
    assert cfg.model == "mlp"  # no AutoTP: the model asked for


def test_a_loop_not_run_is_said_from_a_record_that_carries_no_config_of_its_own():
    # if_run reads only the release, stage and optimizer: a record without a config (or with None) is its default one
    bare = {k: v for k, v in _rec().items() if k != "config"}
    for rec in (bare, {**bare, "config": None}):
        assert known.if_run(rec, "manual") == known.if_run(_rec(), "manual")
        assert known.if_run(rec, "manual").endswith(f"B3 is expected on DeepSpeed 0.19.8 (allenai/open-instruct#1498); "
                                                    f"fix: {KNOWN['B3'].explains[2]}")
        assert known.if_run(rec, "unmanaged").endswith(
            "B3 is ruled out by \"managed_gradient_accumulation\": false (honoured from 0.19.4)")
