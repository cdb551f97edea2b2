"""A training run without DeepSpeed, turned into the path check's flags (``gradkit.commands.check.paths``), with the
path check itself replaced by what it would write: the flags a person would have typed for each framework and path,
the line said for each, the result shaped as a DeepSpeed check's, and a DeepSpeed run whose framework overrides its
Trainer's loss counting judged by the worse of the engine's and the Trainer's verdicts. The real path checks of such
runs: test_check_corpus.py, test_check_paths.py."""
import argparse
import json
from pathlib import Path

import pytest

from gradkit import config as kconfig
from gradkit.commands import check_paths
from gradkit.commands.check import paths
from gradkit.frameworks.run import TrainingRun
from gradkit.judge import oracle
from gradkit.judge import verdict as kverdict


def run(framework="hf-trainer", path="ddp", ga=4, precision="bf16", **kw):
    return TrainingRun(framework=framework, source="train.yaml", loops=("trainer",), precision=precision,
                       precisions=(precision,), ga=ga, micro_batch=2, world_size=8, path=path, **kw)


def flags(**kw):
    return argparse.Namespace(ga=4, model="mlp", adapter=None, sync="x", units=3, deepspeed="installed", **kw)


def test_each_framework_and_path_takes_the_flags_a_person_would_type_with_a_line_saying_why():
    b, notes = paths.path_args(run(path="fsdp", ga=8), flags())
    assert (b.path, b.param_dtype, b.reduce_dtype, b.ga, b.model, b.config, b.json) == \
        ("fsdp2", "bf16", "bf16", 8, "mlp", None, None)
    assert b.sync is None and b.units is None  # every path flag cleared, then the run's own set
    assert notes == ["FSDP in bf16: fully_shard with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16) "
                     "(accelerate utils/dataclasses.py set_mixed_precision gives both the run's dtype); an FSDP1 run "
                     "is judged on FSDP2's reduction, not its FlatParameter code"]
    b, _ = paths.path_args(run(path="fsdp", precision="fp16"), flags())
    assert (b.param_dtype, b.reduce_dtype) == ("fp32", "fp32")
    for framework in paths.TRAINER_BASED:
        b, notes = paths.path_args(run(framework, trainer_overrides={"average_tokens_across_devices": False}), flags())
        assert (b.path, b.per_device_train_batch_size, b.ga, b.model) == ("trainer", 2, 4, None)
        assert b.average_tokens_across_devices == "false" and b.model_accepts_loss_kwargs is None
        assert notes == ["the HF Trainer on 8 DDP ranks: --path trainer with per_device_train_batch_size 2, GA 4, "
                         "average_tokens_across_devices false"]
    b, notes = paths.path_args(run("axolotl", trainer_overrides={"model_accepts_loss_kwargs": True}), flags())
    assert b.model_accepts_loss_kwargs == "true" and b.average_tokens_across_devices is None
    for config, kept in (("acc.yaml", "acc.yaml"), ("acc.json", None), (None, None)):
        b, notes = paths.path_args(run("accelerate", config_file=config), flags())
        assert (b.path, b.config) == ("accelerate", kept) and notes == ["Accelerate's own loop on DDP: --path "
                                                                         "accelerate, GA 4"]
    with pytest.raises(kconfig.ConfigError, match="train.yaml: a lightning run on ddp: the kit has no path check"):
        paths.path_args(run("lightning"), flags())


def test_ga_1_is_judged_at_the_ga_asked_for_and_said_so():
    for ga in (1, None):
        b, notes = paths.path_args(run(ga=ga), flags())
        assert b.ga == 4 and notes[0] == (f"GA {ga or 1} in your run: nothing is accumulated; judged at GA 4 (--ga), "
                                          "what raising it would do")
    assert paths.path_args(run(ga=2), flags())[0].ga == 2


def _path_check(verdict, code):
    def main(b):
        print(f"checked {b.path}")
        if verdict is not None:
            Path(b.json).write_text(json.dumps({"summary": {"verdict": verdict, "exit": code}, "records": [{"r": 1}]}))
        return code
    return main


def test_the_path_checks_result_is_shaped_as_a_deepspeed_checks_and_a_missing_summary_cannot_run(monkeypatch):
    said = []
    monkeypatch.setattr(check_paths, "main", _path_check(oracle.AFFECTED, 1))
    out = paths.check(run(notes=["a note"]), flags(), said.append)
    assert out == {"source": "train.yaml", "framework": "hf-trainer", "loops": ["trainer"], "asked": ["bf16"],
                   "precisions": {"bf16": {"summary": {"verdict": oracle.AFFECTED, "exit": 1}, "records": [{"r": 1}]}},
                   "verdict": oracle.AFFECTED, "exit": 1}
    assert said[:2] == ["  as run: hf-trainer: a note", "  as run: the HF Trainer on 8 DDP ranks: --path trainer with "
                        "per_device_train_batch_size 2, GA 4"] and said[-1] == "checked trainer"
    monkeypatch.setattr(check_paths, "main", _path_check(None, 2))
    out = paths.check(run(precision=None), flags(), said.append)
    assert out["verdict"] == oracle.CANNOT_RUN and out["exit"] == kverdict.EXIT[oracle.CANNOT_RUN] != 2
    assert out["asked"] == ["fp32"] and out["precisions"]["fp32"]["summary"]["loops"] == []


def test_a_deepspeed_run_whose_framework_overrides_its_trainer_takes_the_worse_of_the_engine_and_the_trainer(
        monkeypatch):
    engine = {"verdict": oracle.NOT_AFFECTED, "exit": 0, "source": "train.yaml"}
    plain = run("hf-trainer", path="deepspeed")
    assert paths.trainer_side(plain, flags(), engine) is engine  # no override: the engine's check says it all
    overridden = run("axolotl", path="deepspeed", trainer_overrides={"model_accepts_loss_kwargs": False})
    assert paths.trainer_side(run("axolotl", path="ddp", trainer_overrides={"x": 1}), flags(), engine) is engine
    monkeypatch.setattr(check_paths, "main", _path_check(oracle.AFFECTED, 1))
    said = []
    out = paths.trainer_side(overridden, flags(), engine, said.append)
    assert (out["verdict"], out["exit"], out["trainer"]["verdict"], out["trainer"]["loops"]) == \
        (oracle.AFFECTED, 1, oracle.AFFECTED, ["trainer"])
    assert said[0].startswith("train.yaml: axolotl sets model_accepts_loss_kwargs=False on its Trainer")
    assert said[-1] == "verdict over the engine and the Trainer: not-affected, affected -> affected (exit 1)"
    monkeypatch.setattr(check_paths, "main", _path_check(oracle.NOT_AFFECTED, 0))
    affected = {**engine, "verdict": oracle.AFFECTED, "exit": 1}
    assert paths.trainer_side(overridden, flags(), affected, said.append)["verdict"] == oracle.AFFECTED
