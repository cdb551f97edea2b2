"""``gradkit bisect``: the search over releases (on a measure that says what each release gives), then real 2-rank
worlds over real releases: B4's fix between 0.18.9 and 0.19.0 found exactly there, with the change in the code."""
import json

import pytest

from gradkit.commands import bisect
from gradkit.commands.bisect import diff, search
from gradkit.judge import oracle

GOOD = {"verdict": oracle.NOT_AFFECTED, "step": None, "ratios": [1.0]}


def bad(step="last micro-batch / N"):
    return {"verdict": oracle.AFFECTED, "step": step, "ratios": [0.4]}


SKIP = {"verdict": oracle.CANNOT_RUN, "step": None, "ratios": [], "reason": "Output 0 of Split is a view"}


def measuring(results: dict):
    calls = []

    def measure(release):
        calls.append(release)
        return {"release": release, **results[release]}

    return measure, calls


def releases(n):
    return [f"0.{i}.0" for i in range(n)]


def test_a_boundary_among_many_releases_is_found_exactly_by_binary_search_and_confirmed_on_both_sides():
    order = releases(13)
    results = {r: (bad() if i < 7 else GOOD) for i, r in enumerate(order)}
    measure, calls = measuring(results)
    found = search.search(order, measure, stride=4)
    assert [(c["before"], c["after"]) for c in found["changes"]] == [("0.6.0", "0.7.0")]
    ch = found["changes"][0]
    assert ch["from"]["verdict"] == oracle.AFFECTED and ch["to"]["verdict"] == oracle.NOT_AFFECTED and ch["confirmed"]
    assert "last bad 0.6.0" in search.describe(ch) and "first good 0.7.0" in search.describe(ch)
    assert calls.count("0.6.0") == 2 and calls.count("0.7.0") == 2  # measured, then confirmed in a second run
    assert len(set(calls)) < len(order)  # a search, not a scan: releases between equal results are not run


def test_a_change_of_shape_is_a_change_and_one_that_does_not_repeat_is_said_unconfirmed():
    order = releases(5)
    results = {r: bad("all but the first micro-batch" if i < 3 else "first and last micro-batch")
               for i, r in enumerate(order)}
    first = {"n": 0}

    def measure(release):  # the second run of 0.3.0 gives the other shape: the change is not confirmed
        if release == "0.3.0":
            first["n"] += 1
            if first["n"] > 1:
                return {"release": release, **bad("all but the first micro-batch")}
        return {"release": release, **results[release]}

    found = search.search(order, measure, stride=2)
    assert [(c["before"], c["after"]) for c in found["changes"]] == [("0.2.0", "0.3.0")]
    assert "the step is all but the first micro-batch until 0.2.0, first and last micro-batch from 0.3.0" \
        in search.describe(found["changes"][0])
    assert found["changes"][0]["confirmed"] is False and "NOT confirmed" in search.describe(found["changes"][0])


def test_a_release_that_cannot_run_is_skipped_never_good_and_a_change_next_to_it_is_a_range():
    order = releases(6)
    results = {"0.0.0": bad(), "0.1.0": bad(), "0.2.0": SKIP, "0.3.0": SKIP, "0.4.0": GOOD, "0.5.0": GOOD}
    measure, _ = measuring(results)
    found = search.search(order, measure, stride=1)
    [ch] = found["changes"]
    assert (ch["before"], ch["after"], ch["between"]) == ("0.1.0", "0.4.0", ["0.2.0", "0.3.0"])
    assert "between 0.1.0 and 0.4.0 (not run here: 0.2.0, 0.3.0)" in search.describe(ch)
    assert [s["release"] for s in found["skipped"]] == ["0.2.0", "0.3.0"]
    assert all(s["verdict"] == oracle.CANNOT_RUN for s in found["skipped"])
    text = search.table(found)
    assert "| 0.2.0 | cannot-run | skipped: Output 0 of Split is a view" in text
    # only skipped releases after a bad one: never a "first good" made of a release that did not run
    found = search.search(["0.0.0", "0.2.0", "0.3.0"], measuring(results)[0], stride=1)
    assert found["changes"] == [] and len(found["skipped"]) == 2


def test_a_change_and_its_undoing_inside_one_stride_is_seen_with_stride_one():
    order = releases(5)
    results = {r: (bad("first and last micro-batch") if i == 2 else GOOD) for i, r in enumerate(order)}
    assert search.search(order, measuring(results)[0], stride=4)["changes"] == []  # said in the output
    found = search.search(order, measuring(results)[0], stride=1)
    assert [(c["before"], c["after"]) for c in found["changes"]] == [("0.1.0", "0.2.0"), ("0.2.0", "0.3.0")]
    assert "first bad 0.2.0" in search.describe(found["changes"][0])
    assert "first good 0.3.0" in search.describe(found["changes"][1])


def test_bad_input_is_refused_before_anything_launches(tmp_path):
    from gradkit import config as kconfig

    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}))
    with pytest.raises(kconfig.ConfigError, match="--loop must be one of"):
        bisect.main([str(cfg), "--loop", "sideways", "--releases", "0.18.9,0.19.0"])
    with pytest.raises(kconfig.ConfigError, match="at least two releases"):
        bisect.main([str(cfg), "--releases", "0.18.9"])
    with pytest.raises(kconfig.ConfigError, match="release number"):
        bisect.main([str(cfg), "--releases", "0.18.9,latest"])
    with pytest.raises(kconfig.ConfigError, match="one of the three"):
        bisect.main([str(cfg), "--probe", "B4", "--releases", "0.18.9,0.19.0"])
    with pytest.raises(kconfig.ConfigError, match="needs --probe"):
        bisect.main([str(cfg), "--axis", "transformers", "--releases", "5.3.0,5.23.0"])
    with pytest.raises(kconfig.ConfigError, match="the B4 probe's stack names"):
        bisect.main(["--probe", "B4", "--axis", "transformers", "--releases", "5.3.0,5.23.0"])


def test_the_changed_functions_are_read_from_both_sources_on_the_gradient_path(tmp_path):
    before = "class BF16_Optimizer:\n    def step(self):\n        a = 1\n    def describe(self):\n        return 1\n"
    after = "class BF16_Optimizer:\n    def step(self):\n        a = 2\n    def describe(self):\n        return 2\n"
    fa, fb = diff._functions(before, "BF16_Optimizer"), diff._functions(after, "BF16_Optimizer")
    assert set(fa) == {"BF16_Optimizer.step"} and fa["BF16_Optimizer.step"] != fb["BF16_Optimizer.step"]  # not describe()
    # a module-level helper a gradient-path method calls is on the path too (B8's split_half_float_double)
    helper = ("def split_half_float_double(tensors):\n    return [tensors]\n\ndef unrelated():\n    pass\n\n"
              "class DeepSpeedZeroOptimizer:\n    def buffered_reduce_fallback(self, grads):\n"
              "        return split_half_float_double(grads)\n")
    assert set(diff._functions(helper, "DeepSpeedZeroOptimizer")) == {"DeepSpeedZeroOptimizer.buffered_reduce_fallback",
                                                                         "split_half_float_double"}


B4_CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4, "bf16": {"enabled": True},
             "data_types": {"grad_accum_dtype": "fp32"}, "zero_optimization": {"stage": 1}}


@pytest.mark.world
def test_b4_fix_is_found_exactly_between_0_18_9_and_0_19_0_with_the_change_in_the_engine(tmp_path, capsys):
    cfg = tmp_path / "b4.json"
    cfg.write_text(json.dumps(B4_CONFIG))
    out = tmp_path / "bisect.json"
    code = bisect.main([str(cfg), "--loop", "engine", "--releases", "0.18.9,0.19.0,installed", "--stride", "2",
                        "--json", str(out)])
    text = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert code == 0  # the newest release that ran (the installed one) is not affected
    [ch] = doc["changes"]
    assert (ch["before"], ch["after"], ch["between"]) == ("0.18.9", "0.19.0", []) and ch["confirmed"]
    assert ch["from"]["verdict"] == oracle.AFFECTED and ch["from"]["step"] == "own rank's boundary micro-batch"
    assert ch["to"]["verdict"] == oracle.NOT_AFFECTED
    assert doc["measured"]["0.18.9"]["explained_by"] == "B4"
    assert "last bad 0.18.9 (own rank's boundary micro-batch), first good 0.19.0" in text
    engine = next(f for f in ch["diff"]["files"] if f["file"] == "deepspeed/runtime/engine.py")
    epilogue = next(f for f in engine["functions"] if f["name"] == "DeepSpeedEngine._backward_epilogue")
    assert "+        if bf16_optimizer:" in epilogue["diff"] and "self.optimizer.backward_epilogue()" in epilogue["diff"]
    assert "git log --oneline v0.18.9..v0.19.0 -- deepspeed/runtime/bf16_optimizer.py" in text
    # the report of the check on the bad release: config, range, the change, the reproduction and what it printed
    from gradkit.commands import check, report as upstream

    checked = tmp_path / "check.json"
    assert check.main([str(cfg), "--deepspeed", "0.18.9", "--loop", "engine", "--json", str(checked)]) == 1
    report = tmp_path / "report.md"
    assert upstream.main([str(checked), "--bisect", str(out), "--out", str(report)]) == 0
    md = report.read_text()
    assert md.startswith("# [DeepSpeed 0.18.9] ZeRO-1 bf16, GA 4, engine loop")
    assert '"grad_accum_dtype": "fp32"' in md and "- torch " in md and "world size 2" in md
    assert "**0.18.9 -> 0.19.0: last bad 0.18.9 (own rank's boundary micro-batch), first good 0.19.0**" in md
    assert "DeepSpeedEngine._backward_epilogue" in md and "| 0.19.0 | not-affected | global mean |" in md
    assert "REPRODUCED" in md and "(exit status 1)" in md and md.count("| 3 | ") == 1


@pytest.mark.world
def test_a_release_that_crashes_here_is_skipped_with_its_reason_never_good(tmp_path, capsys):
    """ZeRO-1 fp32 with a manual loop (B3) on 0.18.6, 0.18.9 and the installed release: 0.18.9's step crashes in
    gloo on this torch, so it is skipped; the two that run agree (B3 is never fixed): no change, exit 1."""
    cfg = tmp_path / "b3.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4,
                               "zero_optimization": {"stage": 1}}))
    out = tmp_path / "bisect.json"
    code = bisect.main([str(cfg), "--loop", "manual", "--releases", "0.18.6,0.18.9,installed",
                        "--stride", "1", "--steps", "2", "--json", str(out)])
    doc = json.loads(out.read_text())
    assert code == 1  # the installed release is measured affected
    assert doc["changes"] == []
    assert [s["release"] for s in doc["skipped"]] == ["0.18.9"]
    assert doc["skipped"][0]["verdict"] == oracle.CANNOT_RUN and doc["skipped"][0]["reason"]
    assert {r: m["verdict"] for r, m in doc["measured"].items() if r != "0.18.9"} == \
        {"0.18.6": oracle.AFFECTED, doc["order"][-1]: oracle.AFFECTED}
    assert "| 0.18.9 | cannot-run | skipped:" in capsys.readouterr().out


def _found(bug, measured, changes):
    return {"bug": bug, "order": list(measured), "measured": {r: {"release": r, **v} for r, v in measured.items()},
            "changes": changes, "skipped": []}


def test_a_known_bugs_bisect_agrees_with_the_table_only_where_its_boundary_lies_inside_a_change():
    from gradkit.notebooks import bisect_known

    ok = _found("B4", {"0.18.9": bad("own rank's boundary micro-batch"), "0.19.0": GOOD},
                [{"before": "0.18.9", "after": "0.19.0", "between": [], "from": bad(), "to": GOOD}])
    assert bisect_known.violations(ok) == []
    # a change the table does not have (B4 fixed in 0.19.0, not 0.19.4)
    late = _found("B4", {"0.19.3": bad(), "0.19.4": GOOD},
                  [{"before": "0.19.3", "after": "0.19.4", "between": [], "from": bad(), "to": GOOD}])
    assert any("pinned" not in v and "a change the table does not have" in v for v in bisect_known.violations(late))
    assert any("0.19.3: measured affected, the table says not-affected" in v for v in bisect_known.violations(late))
    # the table's boundary between two releases that ran, and no change found there
    missed = _found("B2", {"0.18.2": bad("stage 0: sum (x GA); stage 1: sum (x GA)"),
                           "0.18.5": bad("stage 0: sum (x GA); stage 1: sum (x GA)")}, [])
    assert any("boundary at 0.18.5" in v for v in bisect_known.violations(missed))  # a pin of kit/judge/pins.py


@pytest.mark.world
def test_a_probe_is_bisected_over_another_package_and_a_change_of_the_measured_step_is_a_change(tmp_path, capsys):
    """The B1 probe (a real Trainer, no step named) over transformers 5.5.2, 5.6.1 and the installed release: all
    three differ, two of them both affected -- 5.5.2 divides by GA once more than 5.6.1 (ratio 0.23 against 0.91) --
    so the search reports both changes, each with the code that changed in transformers/trainer.py (issue 37)."""
    out = tmp_path / "b1.json"
    code = bisect.main(["--probe", "B1", "--axis", "transformers", "--releases", "5.5.2,5.6.1,installed", "--stride",
                        "1", "--no-confirm", "--no-progress", "--json", str(out)])
    doc = json.loads(out.read_text())
    text = capsys.readouterr().out
    assert code == 0 and doc["axis"] == "transformers", text
    first, second = doc["changes"]
    assert (first["before"], first["after"], second["before"]) == ("5.5.2", "5.6.1", "5.6.1"), text
    assert first["from"]["verdict"] == first["to"]["verdict"] == oracle.AFFECTED
    assert first["from"]["ratios"][0] < 0.3 and 0.85 < first["to"]["ratios"][0] < 0.95, first
    assert "affected on both sides, but the measured step changes: ratio of step 1 0.2" in text
    assert second["to"]["verdict"] == oracle.NOT_AFFECTED
    for ch in (first, second):
        assert ch["diff"]["files"][0]["file"] == "transformers/trainer.py" and ch["diff"]["files"][0]["functions"]
    assert "| transformers | verdict |" in text


def test_the_opt_out_loop_runs_exactly_from_the_release_that_has_the_key():
    from gradkit.notebooks import bisect_known

    ok = _found("B3 opt-out", {"0.19.3": SKIP, "0.19.4": GOOD}, [])
    assert bisect_known.violations(ok) == []
    early = _found("B3 opt-out", {"0.19.3": GOOD, "0.19.4": GOOD}, [])
    assert any("B3 opt-out on 0.19.3: not-affected, but the key arrives in 0.19.4" in v
               for v in bisect_known.violations(early))
