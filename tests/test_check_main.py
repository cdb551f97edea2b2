"""``gradkit check``'s command (``gradkit.commands.check.main``) with every checker replaced by a recorder: which
checker an input goes to (one config on DeepSpeed, a run without DeepSpeed on its path, a set of several), with the
flags its table in docs/check.md documents, and what ``--json`` writes. The checkers themselves run for real in
test_check.py, test_check_corpus.py and test_check_paths.py."""
import json
from pathlib import Path

import pytest

from gradkit import config as kconfig
from gradkit.commands import check
from gradkit.commands.check import many, one, paths

REPO = Path(__file__).resolve().parents[1]
DS = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4, "zero_optimization": {"stage": 2}}
TRAINER = "per_device_train_batch_size: 2\ngradient_accumulation_steps: 4\nbf16: true\n"


@pytest.fixture
def calls(monkeypatch):
    said = []
    result = {"precisions": {"fp32": {"summary": {"verdict": "affected", "exit": 1, "loops": ["engine"]},
                                      "records": [{"r": 1}]}}, "verdict": "affected", "exit": 1}
    monkeypatch.setattr(many, "main", lambda sources, skipped, a: said.append(("many", sources, skipped, a)) or 7)
    monkeypatch.setattr(one, "prepare", lambda run, a, model, notes: "todo")
    monkeypatch.setattr(one, "check", lambda run, todo, a, model: said.append(("one", run, a)) or result)
    monkeypatch.setattr(paths, "trainer_side", lambda run, a, r: r)
    monkeypatch.setattr(paths, "check", lambda run, a: said.append(("path", run, a)) or {**result, "exit": 0})
    return said


def _files(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps(DS))
    (tmp_path / "ds2.json").write_text(json.dumps(DS))
    (tmp_path / "args.yaml").write_text(TRAINER)
    return tmp_path


def test_one_deepspeed_config_is_checked_alone_at_its_release_and_its_json_names_its_file(calls, tmp_path,
                                                                                           monkeypatch):
    d = _files(tmp_path)
    monkeypatch.chdir(d)  # named relative to here: the JSON names it whole
    assert check.main(["ds.json", "--deepspeed", "0.18.6", "--json", str(d / "out.json")]) == 1
    ((kind, run, a),) = calls
    assert kind == "one" and run.source == "ds.json" and a.deepspeed == "0.18.6" and a.releases == ["0.18.6"]
    doc = json.loads((d / "out.json").read_text())
    assert doc["config_file"] == str((d / "ds.json").resolve()) and doc["records"] == [{"r": 1}]
    assert doc["summary"] == {"verdict": "affected", "exit": 1, "loops": ["engine"]}


def test_several_configs_a_folder_several_releases_or_another_scheduler_are_a_set(calls, tmp_path):
    d = _files(tmp_path)
    for argv in ([str(d / "ds.json"), str(d / "ds2.json")], [str(d)], [str(d / "ds.json"), "--deepspeed",
                                                                       "0.18.6,installed"],
                 [str(d / "ds.json"), "--scheduler", "dask"], [str(d / "ds.json"), "--command", "torchrun x.py"]):
        calls.clear()
        assert check.main(argv) == 7, argv
        assert [c[0] for c in calls] == ["many"], argv
    assert calls[0][3].deepspeed == check.kconfig.INSTALLED  # the last argv's: one release, the default
    calls.clear()
    check.main([str(d / "ds.json"), "--deepspeed", "0.18.6,installed"])
    assert calls[0][3].deepspeed == "0.18.6" and calls[0][3].releases == ["0.18.6", "installed"]


def test_a_run_without_deepspeed_goes_to_its_path_check_on_the_documented_world_size(calls, tmp_path):
    d = _files(tmp_path)
    assert check.main([str(d / "args.yaml")]) == 0
    ((kind, run, a),) = calls
    assert kind == "path" and run.framework == "hf-trainer" and a.world_size == 2
    calls.clear()
    check.main([str(d / "args.yaml"), "--world-size", "4", "--json", str(d / "p.json")])
    assert calls[0][2].world_size == 4
    assert json.loads((d / "p.json").read_text())["config_file"] == str((d / "args.yaml").resolve())


def test_the_flags_take_the_defaults_docs_check_md_documents():
    rows = {r.split("|")[1].strip(): r.split("|")[2].strip() for r in (REPO / "docs/check.md").read_text().splitlines()
            if r.startswith("| `--")}
    a = check.parser().parse_args([])
    assert a.timeout == float(rows["`--timeout S`"]) and a.steps == int(rows["`--steps N`"])
    assert a.device == rows["`--device D`"].strip("`") and a.scheduler == rows["`--scheduler S`"].strip("`")
    assert rows["`--deepspeed R`"] == "the installed release" and a.deepspeed == kconfig.INSTALLED


def test_a_json_or_out_file_in_a_folder_that_is_not_there_is_refused_before_anything_runs(calls, tmp_path):
    d = _files(tmp_path)
    for flag in ("--json", "--out"):
        with pytest.raises(kconfig.ConfigError, match=f"{flag} {d}/no/x: the folder {d}/no does not exist"):
            check.main([str(d / "ds.json"), flag, str(d / "no" / "x")])
    assert calls == []
