"""Records: how one is found, checked, saved and read back, which run's records reach the matrix, and which
DeepSpeed column a record belongs to (the mutation run's survivors in kit/judge/records.py)."""
import json

import pytest

from gradkit.judge import oracle, records
from gradkit.stacks import versions
from gradkit.judge.records import NO_DEEPSPEED


def test_one_record_means_exactly_one():
    recs = [{"case": "a", "ga": 1}, {"case": "a", "ga": 2}, {"case": "b", "ga": 2}]
    assert records.one(recs, case="b") is recs[2]
    assert records.one(recs, case="a", ga=2) is recs[1]
    with pytest.raises(LookupError, match="found 2"):
        records.one(recs, case="a")
    with pytest.raises(LookupError, match="found 0"):
        records.one(recs, case="c")
    assert records.group_by(recs, ("case",), ga=2) == {("a",): [recs[1]], ("b",): [recs[2]]}


def test_a_record_must_have_every_key_and_a_known_verdict():
    rec = {k: None for k in records.RECORD_KEYS}
    for verdict in (*oracle.VERDICTS, "n/a"):
        records.check({**rec, "verdict": verdict})
    with pytest.raises(ValueError, match="unknown verdict 'fine'"):
        records.check({**rec, "verdict": "fine"})
    with pytest.raises(ValueError, match="lacks \\['metrics'\\]"):
        records.check({k: v for k, v in {**rec, "verdict": "n/a"}.items() if k != "metrics"})


def test_records_are_saved_line_by_line_with_sorted_keys_into_a_new_folder(tmp_path):
    path = records.save([{"b": 1, "a": 2}, {"c": 3}], tmp_path / "new" / "deeper" / "x.jsonl")
    assert path.read_text() == '{"a": 2, "b": 1}\n{"c": 3}\n'
    assert records.load(path) == [{"a": 2, "b": 1}, {"c": 3}]


def test_only_the_last_run_of_each_notebook_that_ended_well_reaches_the_matrix(tmp_path):
    records.save([{"run_id": "r1", "n": 1}, {"run_id": "r0", "n": 0}], tmp_path / "01_a.jsonl")
    records.save([{"run_id": "r1", "n": 2}], tmp_path / "02_b.jsonl")
    records.save([{"run_id": "r2", "n": 3}], tmp_path / "03_c.jsonl")
    (tmp_path / records.RUN_FILE).write_text(json.dumps({"run_id": "r1", "notebooks": {
        "00_gone.ipynb": "ok", "01_a.ipynb": "ok", "02_b.ipynb": "failed", "03_c.ipynb": {"status": "ok", "run_id": "r2"},
        "04_d.ipynb": "ok"}}))
    recs, said = records.run_records(tmp_path)
    assert sorted(r["n"] for r in recs) == [1, 3]
    assert "02_b: not used (failed: its records never reach the matrix)" in said
    assert records.run_records(tmp_path, {"03_c"})[0] == [{"run_id": "r2", "n": 3}]
    with pytest.raises(FileNotFoundError, match="run.json"):
        records.run_records(tmp_path / "nothing")


def test_a_record_belongs_to_the_deepspeed_release_it_imported():
    assert records.deepspeed_version({"init": "torch", "versions": {"deepspeed": "0.18.6"}}) == NO_DEEPSPEED
    assert records.deepspeed_version({"config": {"path": "no_ds"}, "versions": {"deepspeed": "0.18.6"}}) == NO_DEEPSPEED
    assert records.deepspeed_version({"versions": {"deepspeed": "0.18.6"}, "stack": {"deepspeed": "0.18.9"}}) == "0.18.6"
    assert records.deepspeed_version({"versions": {}, "stack": {"deepspeed": "0.18.9"}}) == "0.18.9"
    assert records.deepspeed_version({"version": "deepspeed=0.18.2"}) == "0.18.2"  # it never got that far
    assert records.deepspeed_version({"version": "0.18.9"}) == "0.18.9"
    assert records.deepspeed_version({"version": "installed"}) == versions.installed_version("deepspeed")


def test_the_matrix_columns_run_from_no_deepspeed_to_the_newest_release():
    cols = sorted(["0.19.0", NO_DEEPSPEED, "0.18.10", "0.18.9"], key=records.column_key)
    assert cols == [NO_DEEPSPEED, "0.18.9", "0.18.10", "0.19.0"]
    assert records.column_key(NO_DEEPSPEED) < records.column_key("0.0.1")
    assert [records.column_label(v, "0.19.0") for v in cols] == ["no DeepSpeed", "0.18.9", "0.18.10", "0.19.0 (installed)"]


def test_a_run_id_comes_from_the_environment_or_is_made_fresh_and_a_failed_record_says_why():
    import re
    import subprocess
    import sys

    code = "from gradkit.judge import records; print(records.RUN_ID)"
    given = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={"GRADKIT_RUN_ID": "run-42", "PATH": "/usr/bin:/bin"}, cwd=str(records.Path(__file__).parents[1]))
    assert given.stdout.strip() == "run-42", given.stderr[-500:]
    assert re.fullmatch(r"\d{8}T\d{6}-[0-9a-f]{6}", records.RUN_ID if not __import__("os").environ.get(records.RUN_ID_ENV)
                        else "20260101T000000-abcdef")
    (rec,) = records.failed_records([{"name": "c", "role": "measured", "ga": 2, "dtype": "fp32"}], {"bug": "B3"}, "v",
                                    "it broke")
    assert rec["versions"] == {} and rec["verdict"] == oracle.CANNOT_RUN and rec["reason"] == "could not run: it broke"
