"""The sweep's logic without a world (``gradkit.commands.sweep``): the spec and its points, each point's config and id, resuming,
the grouping of affected points, a tie separated by a sibling, the summary, notebook 06's assertions, the tables
and main's flow with the worlds replaced by records. tests/test_sweep.py runs the same code on real 2-rank worlds."""
import hashlib
import json
import os

import pytest

from gradkit import config
from gradkit.commands import sweep
from gradkit.commands.sweep import grouping
from gradkit.notebooks import sweep as sweep_notebook
from gradkit.commands.sweep import run as sweep_run
from gradkit.commands.sweep import spec as sweep_spec
from gradkit.commands.sweep import tables as sweep_tables
from gradkit.judge import oracle
from gradkit.probes import ds_config

BASE = {"train_micro_batch_size_per_gpu": 4}


def _spec(**kw):
    return sweep_spec.check_spec(json.loads(json.dumps({"base": BASE, **kw})))


# ------------------------------------------------------------------------------------------- the spec

def test_a_spec_gets_its_defaults_and_every_point_resolves():
    spec = _spec(axes={"ga": [2, 4]})
    assert (spec["world_size"], spec["stacks"], spec["device"], spec["timeout_s"], spec["steps"]) == \
        (2, [{}], "cpu", 1800, ds_config.STEPS)
    assert sweep_spec.check_spec({"axes": {"ga": [2]}})["base"] == {}


@pytest.mark.parametrize("bad, needle", [
    ("just text", "needs 'axes'"),
    ({"axes": ["ga"]}, "needs 'axes'"),
    ({"axes": {"ga": []}}, "axis 'ga' must be a non-empty list"),
    ({"axes": {"ga": 2}}, "axis 'ga' must be a non-empty list"),
    ({"axes": {"dtype": ["fp8"]}}, "dtype values must be among"),
    ({"axes": {"model": ["gpt9"]}}, "^unknown model shape 'gpt9'"),
    ({"axes": {"ga": [2]}, "skip": ["ga"]}, "a skip rule maps axes"),
    ({"axes": {"ga": [2, 65]}}, "^gradient accumulation steps must be an integer in 1..64, got 65"),
    ({"axes": {"ga": [2]}, "steps": 0}, "steps"),
    ({"axes": {"ga": [2]}, "world_size": 99}, "world_size=99"),
    ({"axes": {"ga": [2]}, "timeout_s": -1}, "timeout"),
    ({"axes": {"ga": [2]}, "stacks": {"deepspeed": "0.18.6"}}, "stacks is a list of mappings"),
    ({"axes": {"ga": [2]}, "stacks": ["0.18.6"]}, "stacks is a list of mappings"),
    ({"axes": {"ga": [2]}, "one_at_a_time": {"keys": {"gradient_clipping": [1.0]}}}, "one_at_a_time is"),
    ({"axes": {"ga": [2]}, "one_at_a_time": {"over": {}, "keys": {}}}, "one_at_a_time is"),
    ({"axes": {"ga": [2]}, "one_at_a_time": {"over": {"ga": [3]}, "keys": {"gradient_clipping": [1.0]}}},
     "one_at_a_time.over.ga must list values of the axis ga"),
    ({"axes": {"ga": [2]}, "one_at_a_time": {"over": {"dtype": ["fp32"]}, "keys": {"gradient_clipping": [1.0]}}},
     "one_at_a_time.over.dtype"),
    ({"axes": {"ga": [2]}, "one_at_a_time": {"over": {}, "keys": {"ga": [1.0]}}}, "one_at_a_time.keys.ga"),
    ({"axes": {"ga": [2]}, "one_at_a_time": {"over": {}, "keys": {"loop": ["manual"]}}}, "one_at_a_time.keys.loop"),
    ({"axes": {"ga": [2]}, "one_at_a_time": {"over": {}, "keys": {"gradient_clipping": 1.0}}},
     "one_at_a_time.keys.gradient_clipping"),
    ({"axes": {"ga": [2]}, "one_at_a_time": {"over": {}, "keys": {"gradient_clipping": []}}},
     "one_at_a_time.keys.gradient_clipping"),
    ({"axes": {"ga": [2]}, "one_at_a_time": {"over": {}, "keys": {"gradient_clipping": ["default"]}}},
     "one_at_a_time.keys.gradient_clipping"),
    ({"axes": {"ga": [2], "zero_optimization.stage": [2]}, "one_at_a_time": {
        "over": {}, "keys": {"zero_optimization.stage": [1]}}}, "one_at_a_time.keys.zero_optimization.stage"),
])
def test_a_spec_that_cannot_be_swept_is_refused_with_what_is_wrong(bad, needle):
    with pytest.raises(config.ConfigError, match=needle):
        sweep_spec.check_spec(json.loads(json.dumps(bad)) if not isinstance(bad, str) else bad, "my spec")


def test_a_point_deepspeed_would_refuse_is_named_in_the_refusal():
    with pytest.raises(config.ConfigError, match=r"my spec: the point \{'ga': 2\} is not a config DeepSpeed accepts"):
        sweep_spec.check_spec({"axes": {"ga": [2]}, "base": {"train_micro_batch_size_per_gpu": -1}}, "my spec")


def test_a_spec_file_is_read_and_a_bad_one_said_in_one_sentence(tmp_path):
    good = tmp_path / "s.yaml"
    good.write_text("axes:\n  ga: [2]\nbase:\n  train_micro_batch_size_per_gpu: 4\n")
    assert sweep_spec.load_spec(str(good))["axes"] == {"ga": [2]}
    bad = tmp_path / "bad.yaml"
    bad.write_text("axes: [unclosed\n")
    with pytest.raises(config.ConfigError, match="is not valid YAML"):
        sweep_spec.load_spec(str(bad))
    with pytest.raises(config.ConfigError, match="cannot read the sweep spec .*absent.yaml: No such file or directory$"):
        sweep_spec.load_spec(str(tmp_path / "absent.yaml"))


def test_the_points_are_the_product_then_each_extra_key_alone_less_the_skipped():
    spec = _spec(axes={"ga": [2, 4], "zero_optimization.stage": [1, 2]},
                 skip=[{"ga": 4, "zero_optimization.stage": [2]}],
                 one_at_a_time={"over": {"ga": [2, 4]}, "keys": {"gradient_clipping": [1.0, 2.0], "prescale_gradients": [True]}})
    pts = sweep_spec.points(spec)
    main = [p for p in pts if sweep_spec.is_main(spec, p)]
    assert main == [{"ga": 2, "zero_optimization.stage": 1, "gradient_clipping": "default", "prescale_gradients": "default"},
                    {"ga": 2, "zero_optimization.stage": 2, "gradient_clipping": "default", "prescale_gradients": "default"},
                    {"ga": 4, "zero_optimization.stage": 1, "gradient_clipping": "default", "prescale_gradients": "default"}]
    extra = [p for p in pts if not sweep_spec.is_main(spec, p)]
    # each key's value alone, over ga (both values) and the first stage only (an axis `over` does not name)
    assert [(p["ga"], p["zero_optimization.stage"], p["gradient_clipping"], p["prescale_gradients"]) for p in extra] == [
        (2, 1, 1.0, "default"), (4, 1, 1.0, "default"), (2, 1, 2.0, "default"), (4, 1, 2.0, "default"),
        (2, 1, "default", True), (4, 1, "default", True)]
    assert sweep_spec.all_axes(spec) == {"ga": [2, 4], "zero_optimization.stage": [1, 2],
                                    "gradient_clipping": ["default", 1.0, 2.0], "prescale_gradients": ["default", True]}
    assert sweep_spec.is_main(_spec(axes={"ga": [2]}), {"ga": 2})


def test_a_points_config_is_the_base_with_its_axes_set_as_a_user_would_write_it():
    spec = _spec(axes={"ga": [2]})
    spec["base"] = {**BASE, "bf16": {"loss_scale": 0}, "gradient_accumulation_steps": 8,
                    "zero_optimization": {"reduce_bucket_size": 5}}
    cfg = sweep_spec.user_config(spec, {"zero_optimization.stage": 2, "loop": "manual", "dtype": "bf16", "model": "x",
                                   "gradient_clipping": "default", "a.b.c": 1})
    assert cfg == {**BASE, "gradient_accumulation_steps": 8, "bf16": {"loss_scale": 0, "enabled": True},
                   "zero_optimization": {"reduce_bucket_size": 5, "stage": 2}, "a": {"b": {"c": 1}}}
    assert sweep_spec.user_config(spec, {"ga": 3, "dtype": "fp16"})["fp16"] == {"enabled": True}
    assert sweep_spec.user_config(spec, {"ga": 3, "dtype": "fp32"}).get("bf16") == {"loss_scale": 0}
    assert sweep_spec.user_config(spec, {"ga": 3})["gradient_accumulation_steps"] == 3
    assert sweep_spec.user_config(_spec(axes={"ga": [2]}), {})["gradient_accumulation_steps"] == 4
    assert spec["base"]["zero_optimization"] == {"reduce_bucket_size": 5}  # the spec itself is untouched


def test_the_default_spec_runs_fp16_at_every_zero_stage_with_deepspeeds_own_accumulator():
    """fp16 points leave ``grad_accum_dtype`` unset: with an fp32 accumulator DeepSpeed refuses fp16 at ZeRO-0, and
    B9's path (FP16_UnfusedOptimizer) would never be swept; the other precisions keep their fp32 / bf16 one."""
    spec = sweep_spec.load_spec("scripts/sweeps/default.yaml")
    fp16 = [p for p in sweep_spec.points(spec) if p["dtype"] == "fp16"]
    assert {p["zero_optimization.stage"] for p in fp16} == {0, 1, 2, 3}
    assert {p["data_types.grad_accum_dtype"] for p in fp16} == {"default"}
    assert "data_types" not in sweep_spec.user_config(spec, fp16[0])
    assert not [p for p in sweep_spec.points(spec) if p["dtype"] != "fp16" and p["data_types.grad_accum_dtype"] ==
                "default"]


def test_a_points_case_is_its_measured_loop_named_by_its_id():
    spec = _spec(axes={"ga": [2], "loop": ["manual"]}, steps=2)
    case = sweep_spec.point_case(spec, {"ga": 2, "loop": "manual"})
    assert case["role"] == "measured" and case["loop"] == "manual" and case["steps"] == 2
    assert case["point"] == {"ga": 2, "loop": "manual"} and case["id"] == case["name"] == \
        sweep_spec.point_id(spec, {"ga": 2, "loop": "manual"})
    assert sweep_spec.point_case(spec, {"ga": 2})["loop"] == "engine"
    assert sweep_spec.point_case(spec, {"ga": 2, "model": "conditional"})["model"] == "conditional"
    assert sweep_spec.point_case(spec, {"ga": 2, "model": "default"}).get("model") in (None, "mlp")


def test_a_point_id_and_the_spec_key_change_with_what_the_verdict_depends_on_only():
    spec = _spec(axes={"ga": [2]})
    pid, key = sweep_spec.point_id(spec, {"ga": 2}), sweep_spec.spec_key(spec)
    assert len(pid) == 12 and len(key) == 12
    same = {**spec, "stacks": [{"deepspeed": "0.18.6"}], "timeout_s": 5}
    assert sweep_spec.point_id(same, {"ga": 2}) == pid and sweep_spec.spec_key(same) == key
    for other in ({**spec, "base": {"train_micro_batch_size_per_gpu": 2}}, {**spec, "world_size": 3},
                  {**spec, "steps": 1}):
        assert sweep_spec.point_id(other, {"ga": 2}) != pid and sweep_spec.spec_key(other) != key
    assert sweep_spec.point_id(spec, {"ga": 4}) != pid
    assert sweep_spec.point_id(spec, {"ga": 2, "loop": "manual"}) == sweep_spec.point_id(spec, {"loop": "manual", "ga": 2})
    assert sweep_spec.spec_key({**spec, "device": "cuda"}) != key
    assert sweep_spec.spec_key(dict(reversed(list(spec.items())))) == key  # the same spec, whatever its keys' order


def test_a_stack_is_named_by_the_release_it_resolves_to():
    from gradkit.stacks import patched, versions

    assert sweep_spec.release_of({"deepspeed": "0.18.6"}) == "0.18.6"
    assert sweep_spec.release_of({}) == versions.installed_version("deepspeed")
    # a patched release names its patch by the first 12 hex digits of the diff's sha256 (shown in the records)
    digest = hashlib.sha256(patched.patch_file("deepspeed", "b10").read_bytes()).hexdigest()
    assert sweep_spec.release_of({"deepspeed": "0.19.8+b10"}) == f"0.19.8+b10 (b10.diff {digest[:12]})"


# ------------------------------------------------------------------------------------------- running

def test_each_world_gets_one_control_per_ga_clip_steps_and_model():
    cases = [{"ga": 4, "steps": 3}, {"ga": 4, "steps": 3, "model": "mlp"}, {"ga": 2, "clip": 1.0, "steps": 3},
             {"ga": 2, "steps": 3, "model": "conditional"}, {"ga": 2}]
    got = sweep_run._controls(cases)
    assert [c["name"] for c in got] == ["control GA 2 clip 0 mlp", "control GA 2 clip 0 conditional",
                                        "control GA 2 clip 1 mlp", "control GA 4 clip 0 mlp"]
    assert [c["steps"] for c in got] == [1, 3, 3, 3]  # a case that names no step count takes one step
    assert all(c["role"] == "control" and c["loop"] == "torch" and c["dtype"] == "fp32" for c in got)


def test_cases_are_dealt_in_turn_into_non_empty_shares():
    assert sweep_run._deal([1, 2, 3, 4, 5], 2) == [[1, 3, 5], [2, 4]]
    assert sweep_run._deal([1], 3) == [[1]] and sweep_run._deal([], 2) == []


def test_the_current_records_are_the_newest_per_point_and_release_of_this_spec():
    spec = _spec(axes={"ga": [2]}, stacks=[{}, {"deepspeed": "0.18.6"}])
    key = sweep_spec.spec_key(spec)
    mine = {"stack": {}, "release": sweep_spec.release_of({}), "spec_key": key, "id": "p", "n": 1}
    newer = {**mine, "n": 2}
    old = {**mine, "stack": {"deepspeed": "0.18.6"}, "release": "0.18.6", "n": 3}
    wrong = {**old, "release": "0.18.5"}  # the stack names 0.18.6 but the record ran another release
    got = sweep_run.current([mine, old, newer, wrong, {**mine, "spec_key": "other"}], spec)
    assert sorted(r["n"] for r in got) == [2, 3]
    unsorted = _spec(axes={"ga": [2]}, stacks=[{"transformers": "5.3.0", "deepspeed": "0.18.6"}])
    rec = {"stack": {"deepspeed": "0.18.6", "transformers": "5.3.0"}, "release": "0.18.6",
           "spec_key": sweep_spec.spec_key(unsorted), "id": "p"}
    assert sweep_run.current([rec], unsorted) == [rec]  # the same stack, whatever the order of its keys
    ordered = _spec(axes={"ga": [2]}, stacks=[{"deepspeed": "0.18.6", "transformers": "5.3.0"}])
    rec = {"stack": {"transformers": "5.3.0", "deepspeed": "0.18.6"}, "release": "0.18.6",
           "spec_key": sweep_spec.spec_key(ordered), "id": "p"}
    assert sweep_run.current([rec], ordered) == [rec]
    # an affected record is explained by the table as it is now, not as it was when it ran
    stale = {**mine, "verdict": oracle.AFFECTED, "explained_by": "B99", "explanation": "an old table's",
             "config": {"loop": "manual", "ds_config": {"zero_optimization": {"stage": 2}}}, "zero_stage": 2, "ga": 2,
             "optimizer": "DeepSpeedZeroOptimizer", "versions": {"deepspeed": "0.18.6"},
             "matches": "last micro-batch / N"}
    (got,) = sweep_run.current([stale], _spec(axes={"ga": [2]}, stacks=[{}]))
    assert got["explained_by"] == "B3" and got["explanation"].startswith("B3 (")


def test_a_sweep_run_writes_each_record_as_it_comes_and_resumes_from_them(tmp_path, monkeypatch):
    spec = _spec(axes={"ga": [2, 4], "zero_optimization.stage": [1, 2]})
    ran = []

    def run_stack(spec_, stack, todo, sink, bar=None):
        ran.append([c["id"] for c in todo])
        for c in todo:
            sink({"stack": stack, "release": sweep_spec.release_of(stack), "spec_key": sweep_spec.spec_key(spec_), "id": c["id"],
                  "verdict": oracle.CANNOT_RUN if c["point"]["ga"] == 4 else oracle.NOT_AFFECTED})

    monkeypatch.setattr(sweep_run, "run_stack", run_stack)
    recs = sweep_run.run(spec, tmp_path, progress=False, jobs=2)
    assert len(recs) == 4 and sorted(len(share) for share in ran) == [2, 2]  # two worlds, two points each
    assert json.loads((tmp_path / "spec.json").read_text())["axes"] == spec["axes"]
    lines = (tmp_path / "records.jsonl").read_text().splitlines()
    assert len(lines) == 4 and all(list(json.loads(x)) == sorted(json.loads(x)) for x in lines)
    ran.clear()
    assert len(sweep_run.run(spec, tmp_path, progress=False)) == 4 and ran == []  # everything done: no world
    sweep_run.run(spec, tmp_path, progress=False, retry=True, jobs=1)
    ga4 = sorted(sweep_spec.point_id(spec, p) for p in sweep_spec.points(spec) if p["ga"] == 4)
    assert len(ran) == 1 and sorted(ran[0]) == ga4  # the two cannot-run points, in one world
    with pytest.raises(config.ConfigError):
        sweep_run.run(spec, tmp_path, progress=False, jobs=0)


def test_a_record_coming_back_is_named_by_its_point_and_explained_when_affected():
    rec = {"config": {"point": {"ga": 2}, "id": "abc"}, "verdict": oracle.NOT_AFFECTED, "case": "x", "role": "measured"}
    done = sweep_run._finish(rec)
    assert done["point"] == {"ga": 2} and done["id"] == "abc" and "explained_by" not in done


# ------------------------------------------------------------------------------------------- grouping

def _p(a, b, verdict, bug=None, shape=None, ratio=0.5, worst=0, i=None):
    return {"point": {"a": a, "b": b}, "verdict": verdict, "id": i or f"{a}{b}", "explained_by": bug, "shape": shape,
            "matches": "m" if bug else "none", "ga": 4, "stack": {}, "worst_step": worst,
            "metrics": {"norm_ratio": ratio} if verdict != oracle.CANNOT_RUN else None}


def test_a_group_says_its_conditions_members_bug_ratios_and_worst_steps():
    recs = [_p(1, 0, oracle.AFFECTED, "B3", ratio=0.25, worst=1), _p(1, 1, oracle.AFFECTED, "B3", ratio=0.5, worst=2),
            _p(0, 0, oracle.NOT_AFFECTED), _p(0, 1, oracle.NOT_AFFECTED)]
    (g,) = grouping.groups(recs, {"a": [0, 1], "b": [0, 1], "c": ["only"]})
    assert g == {"when": {"a": [1]}, "count": 2, "ids": ["10", "11"], "known_bug": "B3", "tie": [],
                 "explained_by": ["B3"], "matches": ["m"], "shapes": ["None"], "worst_steps": [2, 3], "ratio_range": [0.25, 0.5], "example": "10"}
    assert grouping.groups([_p(0, 0, oracle.NOT_AFFECTED)], {"a": [0], "b": [0]}) == []


def test_the_largest_group_comes_first_and_points_no_conjunction_isolates_are_one_group_each():
    recs = [_p(a, b, oracle.AFFECTED if (a + b) % 2 else oracle.NOT_AFFECTED, "B3" if (a + b) % 2 else None)
            for a in range(3) for b in range(3)]
    gs = grouping.groups(recs, {"a": [0, 1, 2], "b": [0, 1, 2]}, max_keys=1)
    assert sum(g["count"] for g in gs) == 4 and all(g["count"] == 1 for g in gs)
    assert sorted(g["ids"][0] for g in gs) == sorted(r["id"] for r in recs if r["verdict"] == oracle.AFFECTED)
    assert all(set(g["when"]) == {"a", "b"} for g in gs)  # each point by its full coordinates
    gs = grouping.groups(recs, {"a": [0, 1, 2], "b": [0, 1, 2]})
    assert sum(g["count"] for g in gs) == 4 and [g["count"] for g in gs] == sorted([g["count"] for g in gs], reverse=True)
    assert all(len(g["when"]) <= 2 for g in gs)
    big = [_p(a, b, oracle.AFFECTED if a else oracle.NOT_AFFECTED, "B3" if a else None) for a in range(2)
           for b in range(3)] + [_p(2, 0, oracle.AFFECTED, "B3")]
    gs = grouping.groups(big, {"a": [0, 1, 2], "b": [0, 1, 2]})
    assert [g["count"] for g in gs] == [4] and gs[0]["when"] == {"a": [1, 2]}


def test_a_group_mixing_no_bug_names_none():
    g = grouping._group([_p(1, 0, oracle.AFFECTED, "B3"), _p(1, 1, oracle.AFFECTED, None)], 0b11, {"a": [1]})
    assert g["known_bug"] is None and g["explained_by"] == ["B3", "None"]
    g = grouping._group([_p(1, 0, oracle.AFFECTED, "B3"), _p(1, 1, oracle.AFFECTED, "B4")], 0b11, {"a": [1]})
    assert g["known_bug"] is None and g["explained_by"] == ["B3", "B4"]
    g = grouping._group([_p(1, 0, oracle.AFFECTED, None)], 0b1, {"a": [1]})
    assert g["known_bug"] is None and g["ratio_range"] == [0.5, 0.5] and g["worst_steps"] == [1]
    g = grouping._group([{**_p(1, 0, oracle.AFFECTED, "B3"), "metrics": None}], 0b1, {"a": [1]})
    assert g["ratio_range"] is None


def test_the_beam_keeps_each_selection_once_and_the_best_when_there_are_too_many(monkeypatch):
    level = [(("x",), 0b0011, 0), (("y",), 0b0011, 1), (("z",), 0b0100, 2)]
    assert [c[0] for c in grouping._beam(level, 0b0111, 0b0111)] == [("x",), ("z",)]
    monkeypatch.setattr(grouping, "BEAM", 1)
    assert [c[0] for c in grouping._beam(level, 0b0111, 0b0111)] == [("x",)]  # covers 2 uncovered, not 1
    level = [(("wrong",), 0b1111, 0), (("right",), 0b0011, 1)]
    assert [c[0] for c in grouping._beam(level, 0b0011, 0b0011)] == [("right",)]  # 2 per 1 beats 2 per 3


def test_a_groups_conditions_in_words():
    assert grouping.when_text({"a": [1]}) == "a = 1"
    assert grouping.when_text({"a": [1, 2], "b": ["x"]}) == "a in {1, 2} x b = x"
    assert grouping.when_text({"a": [1], "k1": ["default"], "k2": ["default"]}) == "a = 1 x k1 = default x k2 = default"
    assert grouping.when_text({"a": [1], "k1": ["default"], "k2": ["default"], "k3": ["default"]}) == \
        "a = 1 x no other key set"
    assert grouping.when_text({}) == "every point"
    assert grouping.when_text({"x.y.stage": [2]}, short=lambda a: a.split(".")[-1]) == "stage = 2"


def test_a_group_is_described_by_its_bug_or_its_step():
    known = {"known_bug": "B3", "when": {"a": [1]}, "count": 2, "ratio_range": [0.25, 0.5], "matches": ["m1", "m2"],
             "shapes": ["s"]}
    assert grouping.describe(known) == "[B3] a = 1: 2 configs; ratio 0.250-0.500; the step is m1, m2"
    unknown = {**known, "known_bug": None, "ratio_range": None}
    assert grouping.describe(unknown) == "[UNKNOWN] a = 1: 2 configs; the step is s"
    assert grouping.describe({**unknown, "shapes": []}) == "[UNKNOWN] a = 1: 2 configs; the step is m1; m2"


def test_a_tie_of_known_bugs_or_of_named_steps_is_a_group_of_its_own_said_as_such_and_never_reproduced(monkeypatch,
                                                                                                         tmp_path):
    """Two known bugs expected here that each leave the very step (``tied``), or two named steps a GA-2 point cannot
    tell apart (``ties``), are a tie: grouped apart from unknown steps and from each other, described and tabled as
    a tie, and given no reproduction of its own (it is no new finding)."""
    both = [{**_p(1, b, oracle.AFFECTED, None, shape="s", i=f"t{b}"), "tied": ["B6", "B7"]} for b in (0, 1)]
    steps = {**_p(2, 0, oracle.AFFECTED, None, shape="s", i="h"), "ties": ["global mean x old / new loss scale",
                                                                          "mean / N"]}
    unknown = _p(3, 0, oracle.AFFECTED, None, shape="s", i="u")
    gs = grouping.groups(both + [steps, unknown, _p(0, 0, oracle.NOT_AFFECTED)], {"a": [0, 1, 2, 3], "b": [0, 1]})
    by = {g["ids"][0]: g for g in gs}
    assert by["t0"]["tie"] == ["B6", "B7"] and by["t0"]["count"] == 2 and by["t0"]["known_bug"] is None
    assert by["h"]["tie"] == ["'global mean x old / new loss scale'", "'mean / N'"] and by["u"]["tie"] == []
    assert grouping.describe(by["t0"]).startswith("[TIE: B6 or B7] a = 1: 2 configs")
    assert grouping.describe(by["u"]).startswith("[UNKNOWN]")
    assert grouping.tie({**both[0], "explained_by": None, "ties": ["x", "y"]}) == ["B6", "B7"]  # the bugs first
    # a known bug's group is no tie, even where its points' steps tie (a sibling GA separated them); nor is a group
    # whose points tie between different names
    separated = [{**r, "explained_by": "B3", "ties": ["a", "b"]} for r in both]
    assert grouping._group(separated, 0b11, {"a": [1]})["tie"] == []
    assert grouping._group([both[0], steps], 0b11, {"a": [1]})["tie"] == []
    made = []

    class Stop(Exception):
        pass

    def write(rec, path, title):
        made.append(rec["id"])
        raise Stop  # written: enough to know which groups get a reproduction

    monkeypatch.setattr(sweep_run.repro, "write", write)
    with pytest.raises(Stop):
        sweep_run.reproduce(_spec(axes={"ga": [2]}), {}, both + [steps, unknown], gs, tmp_path, jobs=1)
    assert made == ["u"]  # the unknown group alone
    summary = {"stacks": [{"deepspeed": "0.19.8", "configs": 5, "counts": {oracle.AFFECTED: 4}, "groups": gs}]}
    cells = {line.split("|")[2].strip(): line.split("|")[-2].strip()
             for line in sweep_tables.table(summary, "c").splitlines()[4:]}
    assert cells["a = 1"] == "tie: B6 or B7 (each expected here leaves this step)"
    assert cells["a = 2"].startswith("tie: 'global mean x old / new loss scale' or 'mean / N' (the measurement cannot")
    assert cells["a = 3"] == "**unknown**"
    # notebook 06: a tie needs no reproduction; an unknown group does
    bad = sweep_notebook.violations(_spec(axes={"ga": [2]}), _recs_for(_spec(axes={"ga": [2]})), summary)
    assert len(bad) == 1 and "[UNKNOWN] a = 3" in bad[0] and "did not reproduce" in bad[0]


def test_a_tie_is_separated_by_the_smallest_sibling_ga_of_the_same_stack_and_axes():
    tie = {"point": {"ga": 2, "s": 1}, "ga": 2, "stack": {}, "verdict": oracle.AFFECTED, "matches": "a or b",
           "id": "two", "ties": ["a", "b"]}

    def sib(ga, matches="a", stack=None, verdict=oracle.AFFECTED, bug="B3"):
        return {"point": {"ga": ga, "s": 1}, "ga": ga, "stack": stack or {}, "verdict": verdict, "id": f"ga{ga}",
                "matches": matches, "explained_by": bug, "explanation": f"{bug} at {ga}"}

    for others, want in (([sib(8), sib(3)], "ga3"), ([sib(2)], None), ([sib(4, stack={"deepspeed": "0.18.6"})], None),
                         ([sib(4, verdict=oracle.NOT_AFFECTED)], None), ([sib(4, bug=None)], None),
                         ([sib(4, "c"), sib(8, "b")], "ga8")):
        r = dict(tie)
        grouping.separate([r, *others])
        assert r.get("separated_by") == want, (others, r)
    r = dict(tie)
    grouping.separate([r, sib(3)])
    assert r["explanation"] == "B3 at 3 (at GA 2 the step is a or b; the same config at GA 3 separates them: 'a')"
    done = {**tie, "explained_by": "B4"}
    grouping.separate([done, sib(4)])
    assert done["explained_by"] == "B4" and "separated_by" not in done
    untied = {**tie, "ties": []}
    grouping.separate([untied, sib(4)])
    assert "explained_by" not in untied


def test_the_summary_counts_each_stacks_verdicts_and_groups_its_affected_points():
    spec = _spec(axes={"ga": [2]}, stacks=[{}, {"deepspeed": "0.18.6"}])
    recs = [{**_p(1, 0, oracle.AFFECTED, "B3"), "versions": {"deepspeed": "0.19.8"}, "wall_s": 1.25},
            {**_p(0, 0, oracle.NOT_AFFECTED), "wall_s": 2.0, "crashed_world": True},
            {**_p(0, 0, oracle.CANNOT_RUN, i="no time"), "wall_s": None},
            {**_p(0, 0, oracle.CANNOT_RUN), "stack": {"deepspeed": "0.18.6"}, "wall_s": None}]
    s = sweep_run.summarise({**spec, "axes": {"a": [0, 1], "b": [0]}}, recs)
    mine, other = s["stacks"]
    assert mine["stack"] == {} and mine["deepspeed"] == "0.19.8" and mine["configs"] == 3
    assert mine["counts"][oracle.AFFECTED] == 1 and mine["counts"][oracle.NOT_AFFECTED] == 1
    assert mine["crashed_worlds"] == 1 and mine["wall_s"] == 3.2 and len(mine["groups"]) == 1
    assert other["deepspeed"] is None and other["counts"][oracle.CANNOT_RUN] == 1 and other["groups"] == []


# ------------------------------------------------------------------------------------------- notebook 06's assertions

def _recs_for(spec, verdict=oracle.NOT_AFFECTED, **extra):
    out = []
    for p in sweep_spec.points(spec):
        case = sweep_spec.point_case(spec, p)
        out.append({"stack": {}, "id": case["id"], "point": p, "verdict": verdict, "reason": "r", "ga": case["ga"],
                    "dtype": case["dtype"], "zero_stage": case["zero_stage"], "optimizer": "DeepSpeedZeroOptimizer",
                    "versions": {"deepspeed": "0.18.6"}, **extra})
    return out


def test_violations_find_a_missing_or_doubled_point_and_pass_a_complete_sweep():
    spec = _spec(axes={"ga": [2, 4], "loop": ["engine"]})
    recs = _recs_for(spec)
    assert sweep_notebook.violations(spec, recs, {"stacks": []}) == []
    assert sweep_notebook.violations(spec, recs[:1], {"stacks": []}) == ["2 points x stacks in the spec, 1 distinct records (1 in all)"]
    assert sweep_notebook.violations(spec, recs + recs[:1], {"stacks": []}) == [
        "2 points x stacks in the spec, 2 distinct records (3 in all)"]


def test_violations_hold_the_upstream_tables_b3_prediction_where_it_pins_one():
    spec = _spec(axes={"ga": [2], "loop": ["manual"], "zero_optimization.stage": [2]})
    recs = _recs_for(spec)
    (bad,) = sweep_notebook.violations(spec, recs, {"stacks": []})
    assert "the upstream table says B3 hits here, measured not-affected" in bad
    assert sweep_notebook.violations(spec, _recs_for(spec, oracle.AFFECTED), {"stacks": []}) == []
    assert sweep_notebook.violations(spec, _recs_for(spec, oracle.CANNOT_RUN), {"stacks": []})[0].startswith("every one of the 1")
    for changed in ({"dtype": "bf16"}, {"optimizer": "BF16_Optimizer"}, {"ga": 1}, {"versions": {"deepspeed": "0.18.2"}}):
        assert sweep_notebook.violations(spec, [{**r, **changed} for r in recs], {"stacks": []}) == [], changed
    off = [{**r, "point": {**r["point"], "zero_optimization.offload_optimizer.device": "cpu"}} for r in recs]
    assert not [b for b in sweep_notebook.violations(spec, off, {"stacks": []}) if "B3 hits" in b]


def test_violations_hold_the_kits_own_b6_and_b7_findings_where_they_ran():
    spec = _spec(axes={"ga": [2], "zero_optimization.stage": [3], "model": ["no_grad_step"]})
    recs = _recs_for(spec, oracle.AFFECTED, explained_by="B7", matches="x")
    (bad,) = sweep_notebook.violations(spec, recs, {"stacks": []})
    assert "the table pins B6 here, measured affected (B7)" in bad
    assert sweep_notebook.violations(spec, [{**r, "explained_by": "B6"} for r in recs], {"stacks": []}) == []
    assert sweep_notebook.violations(spec, [{**r, "verdict": oracle.INCONCLUSIVE, "below_floor": True} for r in recs],
                            {"stacks": []}) == []  # it did not run to a verdict: nothing to hold
    assert sweep_notebook.violations(spec, [{**r, "versions": {"deepspeed": "0.20.0"}} for r in recs],
                                     {"stacks": []}) == []  # newer than the table: a finding, nothing to hold
    spec = _spec(axes={"ga": [2], "zero_optimization.stage": [2], "model": ["conditional"],
                       "zero_optimization.offload_optimizer.device": ["cpu"], "loop": ["engine", "manual"]})
    recs = _recs_for(spec, oracle.NOT_AFFECTED)
    (bad,) = sweep_notebook.violations(spec, recs, {"stacks": []})  # DeepSpeed's own loop only
    assert "the table pins B7 here, measured not-affected (None)" in bad and "'loop': 'engine'" in bad
    assert sweep_notebook.violations(spec, [{**r, "zero_stage": 1} for r in recs], {"stacks": []}) == []
    stage3 = _spec(axes={"ga": [2], "zero_optimization.stage": [3], "model": ["conditional"],
                         "zero_optimization.offload_optimizer.device": ["cpu"], "loop": ["engine"]})
    (bad,) = sweep_notebook.violations(stage3, _recs_for(stage3, oracle.AFFECTED, explained_by="B6"), {"stacks": []})
    assert "the table pins B7 here, measured affected (B6)" in bad
    b10 = _recs_for(stage3, oracle.AFFECTED, explained_by="B10", matches="global mean x old / new loss scale")
    for r in b10:
        r["config"] = {"loop": "engine", "model": "conditional", "ds_config": {"fp16": {"enabled": True, "loss_scale": 0},
                       "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}}
    assert sweep_notebook.violations(stage3, b10, {"stacks": []}) == []  # an fp16 point's worse step: B10's own


def test_violations_need_every_group_explained_by_its_bug_and_every_unknown_one_reproduced_with_its_report():
    spec = _spec(axes={"ga": [2]})
    recs = _recs_for(spec)
    g = {"when": {"a": [1]}, "count": 1, "ratio_range": None, "matches": ["m"], "shapes": ["s"]}
    cases = [({**g, "known_bug": "B3", "explained_by": ["B3"]}, []),
             ({**g, "known_bug": "B3", "explained_by": ["B3", "None"]}, ["not every point is explained by B3"]),
             ({**g, "known_bug": None, "explained_by": ["None"]}, ["did not reproduce: None"]),
             ({**g, "known_bug": None, "repro": {"reproduced": False}}, ["did not reproduce", "no upstream report"]),
             ({**g, "known_bug": None, "repro": {"reproduced": True}, "report": "r.md"}, ["no upstream report"]),
             ({**g, "known_bug": None, "repro": {"reproduced": True}, "report": "r.md", "config": "c.json"}, [])]
    for group, needles in cases:
        bad = sweep_notebook.violations(spec, recs, {"stacks": [{"groups": [group]}]})
        assert len(bad) == len(needles) and all(n in b for n, b in zip(needles, bad)), (group, bad)


# ------------------------------------------------------------------------------------------- tables and main

def test_a_points_steps_in_one_line():
    assert sweep_tables.steps_text({}) == "no step judged"
    ok, off = {"norm_ratio": 1.0, "cosine": 1.0, "rel_l2": 0.0}, {"norm_ratio": 0.5, "cosine": 1.0, "rel_l2": 0.5}
    rec = {"steps": [{"metrics": ok}, {"metrics": off}], "worst_step": 1, "dtype": "fp32"}
    assert sweep_tables.steps_text(rec) == "ratio per step 1.000 / 0.500* (* off); worst: step 2"
    assert sweep_tables.steps_text({"steps": [{"metrics": ok}], "dtype": "fp32"}).endswith("worst: step 1")


def test_the_one_at_a_time_table_counts_each_keys_values_and_says_why_a_point_could_not_run():
    spec = _spec(axes={"ga": [2]}, one_at_a_time={"over": {}, "keys": {"gradient_clipping": [1.0, 2.0]}})
    assert sweep_tables.one_at_a_time_table(_spec(axes={"ga": [2]}), []) == "no one-at-a-time keys in this spec"
    recs = [{"stack": {}, "point": {"gradient_clipping": 1.0}, "verdict": oracle.CANNOT_RUN,
             "reason": "a | b" + "c" * 300},
            {"stack": {}, "point": {"gradient_clipping": 1.0}, "verdict": oracle.AFFECTED, "reason": ""}]
    lines = sweep_tables.one_at_a_time_table(spec, recs).splitlines()
    assert len(lines) == 3 and "`gradient_clipping` = 1.0" in lines[2] and f"| a / b{'c' * 155} |" in lines[2]
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[2:2 + len(oracle.VERDICTS)] == [str(int(v in (oracle.CANNOT_RUN, oracle.AFFECTED)))
                                                 for v in oracle.VERDICTS]


def test_the_model_table_gives_each_shapes_verdict_per_precision_and_release():
    spec = _spec(axes={"ga": [2], "model": ["conditional", "no_grad_step"]})
    assert sweep_tables.model_table(spec, []) == "no model shape other than the MLP in this spec"

    def r(model, dtype, verdict, bug=None, stage=3):
        return {"stack": {}, "point": {"model": model}, "zero_stage": stage, "dtype": dtype, "verdict": verdict,
                "explained_by": bug}

    recs = [r("no_grad_step", "fp32", oracle.AFFECTED, "B6"), r("no_grad_step", "bf16", oracle.CANNOT_RUN),
            r("conditional", "fp32", oracle.NOT_AFFECTED), r("conditional", "bf16", oracle.AFFECTED),
            r("conditional", "fp32", oracle.INCONCLUSIVE, stage=2), r("mlp", "fp32", oracle.AFFECTED)]
    text = sweep_tables.model_table(spec, recs)
    assert text.startswith("cells: bf16 / fp32\n\n")
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()[4:]]
    assert [row[:4] for row in rows] == [["conditional", "2", "engine", "none"], ["conditional", "3", "engine", "none"],
                                         ["no_grad_step", "3", "engine", "none"]]
    assert [row[4] for row in rows] == ["- / ~", "? / ok", "x / B6"]


def test_the_readme_table_has_a_row_per_known_bug_and_per_unknown_group():
    g = {"when": {"zero_optimization.stage": [2]}, "count": 3, "ratio_range": [0.25, 0.5], "matches": ["m"],
         "shapes": ["s"], "known_bug": "B3"}
    summary = {"wall_s": 12.5, "stacks": [{"deepspeed": "0.18.6", "configs": 9, "wall_s": 9.5,
                                           "counts": {oracle.AFFECTED: 5, oracle.NOT_AFFECTED: 4, oracle.CANNOT_RUN: 0},
                                           "groups": [g, {**g, "count": 1, "ratio_range": [0.1, 0.2]},
                                                      {**g, "known_bug": None, "when": {"x.offload_optimizer.device": ["cpu"]},
                                                       "count": 1, "repro": {"script": "repro_1.py", "reproduced": True}},
                                                      {**g, "known_bug": None, "count": 1}]}]}
    text = sweep_tables.table(summary, "python -m gradkit.commands.sweep s.yaml")
    assert text.startswith("<sub>generated by `python -m gradkit.commands.sweep s.yaml` (12.5 s; the points' own time "
                           f"in their worlds: 9.5 s on 0.18.6; {os.cpu_count()}-core CPU, gloo)</sub>\n\n")
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()[4:]]
    assert rows[0][:2] == ["0.18.6", "*9 configs: 5 affected, 4 not-affected*"]
    assert rows[1] == ["0.18.6", "stage = 2 (+ 1 smaller group)", "4", "0.100–0.500", "m", "B3"]
    assert rows[2][1:] == ["offload = cpu", "1", "0.25–0.5", "s", "**unknown**: `repro_1.py` reproduces"]
    assert rows[3][-1] == "**unknown**"


def test_main_sweeps_summarises_prints_and_fills_the_readme(tmp_path, monkeypatch, capsys):
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text("axes:\n  ga: [2]\nbase:\n  train_micro_batch_size_per_gpu: 4\n")
    seen = {}

    def run(spec, out, progress=True, retry=False, jobs=2):
        seen.update(stacks=spec["stacks"], progress=progress, retry=retry, jobs=jobs)
        (case,) = [sweep_spec.point_case(spec, p) for p in sweep_spec.points(spec)]
        return [{"stack": st, "id": case["id"], "point": case["point"], "verdict": oracle.AFFECTED, "explained_by": "B3",
                 "matches": "m", "ga": 2, "metrics": {"norm_ratio": 0.5}, "versions": {"deepspeed": "0.18.6"}}
                for st in spec["stacks"]]

    monkeypatch.setattr(sweep_run, "run", run)
    readme = tmp_path / "sweep.md"  # the page of the sweep table, docs/sweep.md
    readme.write_text("x\n<!-- gradkit:table SWEEP -->\nold\n<!-- /gradkit:table -->\n")
    out = tmp_path / "out"
    out.mkdir()
    argv = [str(spec_file), "--out", str(out), "--deepspeed", "0.18.6, installed", "--no-progress",
            "--retry-cannot-run", "--jobs", "1", "--readme", str(readme)]
    assert sweep.main(argv) == 0
    printed = capsys.readouterr().out
    assert seen == {"stacks": [{"deepspeed": "0.18.6"}, {}], "progress": False, "retry": True, "jobs": 1}
    assert "stack 0.18.6 (DeepSpeed 0.18.6): 1 configs, 1 affected" in printed
    assert "  [B3] every point: 1 configs; ratio 0.500-0.500; the step is m" in printed
    assert f"2 records in {out / 'records.jsonl'}" in printed and "replaced the sweep table" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["stacks"]) == 2 and summary["wall_s"] >= 0
    text = readme.read_text()
    assert "python -m gradkit.commands.sweep " + " ".join(argv) in text and "old" not in text


# ------------------------------------------------------------------------------------------- one stack's world
# (runner.world_for and launch.run_world replaced: the pieces rank 0 would report, a world that breaks)

EXACT = {"metrics": {"norm_ratio": 1.0, "cosine": 1.0, "rel_l2": 0.0}}
OFF = {"metrics": {"norm_ratio": 0.25, "cosine": 1.0, "rel_l2": 0.75}}


class _Bar:
    def __init__(self):
        self.n = 0

    def update(self, k):
        self.n += k


def _world(monkeypatch, script):
    """``script(cases) -> list of pieces, or a piece list ending in an exception``: one entry per launch."""
    from gradkit import launch
    from gradkit.probes import runner

    launches = []
    monkeypatch.setattr(runner, "world_for", lambda *a, **k: ("world", None))

    def run_world(target, payload, world, on_partial=None):
        launches.append([c["name"] for c in payload["cases"]])
        for piece in script(len(launches), payload["cases"]):
            if isinstance(piece, Exception):
                raise piece
            on_partial(piece)
        return []

    monkeypatch.setattr(launch, "run_world", run_world)
    return launches


def _stack_spec():
    return _spec(axes={"ga": [2, 4], "zero_optimization.stage": [1, 2]})


def test_one_stacks_points_are_judged_against_their_own_gas_control_as_each_comes_back(monkeypatch):
    spec = _stack_spec()
    todo = [sweep_spec.point_case(spec, p) for p in sweep_spec.points(spec)]
    off_id = todo[3]["id"]

    def script(n, cases):
        return [EXACT if c["role"] == "control" or c["id"] != off_id else OFF for c in cases]

    launches = _world(monkeypatch, script)
    got, bar = [], _Bar()
    sweep_run.run_stack(spec, {}, todo, got.append, bar)
    assert len(launches) == 1 and launches[0][:2] == ["control GA 2 clip 0 mlp", "control GA 4 clip 0 mlp"]
    assert [r["id"] for r in got] == [c["id"] for c in todo] and bar.n == 4
    assert [r["verdict"] for r in got] == [oracle.NOT_AFFECTED] * 3 + [oracle.AFFECTED]
    assert all(r["spec_key"] == sweep_spec.spec_key(spec) and r["release"] == sweep_spec.release_of({}) and r["stack"] == {}
               and r["point"] == c["point"] and r["step_count"] == spec["steps"] for r, c in zip(got, todo))
    assert got[3]["explained_by"] is None and "explanation" in got[3]  # an affected point is explained (or said not)


def test_a_point_judged_against_an_off_control_is_inconclusive_and_one_without_a_control_too(monkeypatch):
    spec = _stack_spec()
    todo = [sweep_spec.point_case(spec, p) for p in sweep_spec.points(spec)]

    def script(n, cases):  # GA 2's control is off; GA 4's never reports (the world ends after GA 2's points)
        pieces = []
        for c in cases:
            if c["role"] == "control":
                pieces.append(OFF if c["ga"] == 2 else EXACT)
        return pieces + [EXACT for c in cases if c["role"] != "control"]

    _world(monkeypatch, script)
    got = []
    sweep_run.run_stack(spec, {}, todo, got.append)
    assert {r["verdict"] for r in got if r["ga"] == 2} == {oracle.INCONCLUSIVE}
    assert {r["verdict"] for r in got if r["ga"] == 4} == {oracle.NOT_AFFECTED}


def test_a_point_that_breaks_its_world_costs_only_itself_and_the_world_goes_on_after_it(monkeypatch):
    from gradkit import launch

    spec = _stack_spec()
    todo = [sweep_spec.point_case(spec, p) for p in sweep_spec.points(spec)]
    crash = todo[1]["id"]

    def script(n, cases):
        out = []
        for c in cases:
            if c["role"] != "control" and c["id"] == crash:
                return out + [launch.LaunchError("rank 1 died: planted" + "." * 400 + "\nits traceback")]
            out.append(EXACT)
        return out

    launches = _world(monkeypatch, script)
    got, bar = [], _Bar()
    sweep_run.run_stack(spec, {}, todo, got.append, bar)
    assert len(launches) == 2 and bar.n == 4
    assert launches[1] == [c["name"] for c in sweep_run._controls(todo[2:])] + [c["name"] for c in todo[2:]]
    assert [r["id"] for r in got] == [c["id"] for c in todo]
    broken = got[1]
    assert broken["verdict"] == oracle.CANNOT_RUN and broken["crashed_world"] is True
    assert f"this point broke the world (rank 1 died: planted{'.' * 280}); the sweep relaunched it" in broken["reason"]
    assert [r["verdict"] for r in got if r["id"] != crash] == [oracle.NOT_AFFECTED] * 3
    assert not any(r.get("crashed_world") for r in got if r["id"] != crash)


def test_a_world_that_fails_before_its_controls_makes_every_remaining_point_cannot_run(monkeypatch):
    from gradkit import launch

    spec = _stack_spec()
    todo = [sweep_spec.point_case(spec, p) for p in sweep_spec.points(spec)]
    launches = _world(monkeypatch, lambda n, cases: [EXACT, launch.LaunchError("gloo: planted\nmore")])
    got, bar = [], _Bar()
    sweep_run.run_stack(spec, {}, todo, got.append, bar)
    assert len(launches) == 1 and bar.n == 4 and [r["id"] for r in got] == [c["id"] for c in todo]
    assert all(r["verdict"] == oracle.CANNOT_RUN and "the world failed before its controls: gloo: planted" in r["reason"]
               for r in got)


def test_a_stack_that_does_not_install_makes_each_of_its_points_cannot_run_with_why(monkeypatch):
    from gradkit.probes import runner

    class CannotRun(Exception):
        reason = "no such release: planted"

    def fail(*a, **k):
        raise CannotRun("x")

    monkeypatch.setattr(runner, "world_for", fail)
    spec = _stack_spec()
    todo = [sweep_spec.point_case(spec, p) for p in sweep_spec.points(spec)]
    got = []
    sweep_run.run_stack(spec, {"deepspeed": "0.0.1"}, todo, got.append)
    assert len(got) == 4 and all(r["verdict"] == oracle.CANNOT_RUN and "no such release: planted" in r["reason"]
                                 and r["release"] == "0.0.1" for r in got)


def test_the_groups_come_largest_first():
    recs = [_p(1, 0, oracle.AFFECTED, "B3"), _p(1, 1, oracle.AFFECTED, "B3"), _p(1, 2, oracle.AFFECTED, "B3"),
            _p(0, 0, oracle.AFFECTED, "B4"), _p(0, 1, oracle.NOT_AFFECTED), _p(0, 2, oracle.NOT_AFFECTED)]
    gs = grouping.groups(recs, {"a": [0, 1], "b": [0, 1, 2]})
    assert [(g["known_bug"], g["count"]) for g in gs] == [("B3", 3), ("B4", 1)]
    assert grouping._group([{k: v for k, v in recs[0].items() if k != "worst_step"}], 1, {})["worst_steps"] == [1]


def test_the_beam_ranks_by_new_points_per_point_wrongly_selected():
    import pytest as _pytest

    level = [(("b",), 0b1111, 0), (("a",), 0b0011, 1)]  # b: 3 new, 1 wrong; a: 2 new, none wrong
    with _pytest.MonkeyPatch.context() as mp:
        mp.setattr(grouping, "BEAM", 1)
        assert [c[0] for c in grouping._beam(level, 0b0111, 0b0111)] == [("a",)]  # 2 / 1 beats 3 / 2


def test_a_three_part_key_is_named_by_its_last_part_in_the_readme_table():
    g = {"when": {"x.y.z": [1]}, "count": 1, "ratio_range": [0.5, 0.5], "matches": ["m"], "shapes": ["s"],
         "known_bug": "B3"}
    summary = {"stacks": [{"deepspeed": "0.18.6", "configs": 1, "counts": {oracle.AFFECTED: 1}, "groups": [g]}]}
    assert "| z = 1 |" in sweep_tables.table(summary, "c")


def test_the_model_table_keeps_the_specs_order_of_models():
    spec = _spec(axes={"ga": [2], "model": ["no_grad_step", "conditional"]})
    recs = [{"stack": {}, "point": {"model": m}, "zero_stage": 3, "dtype": "fp32", "verdict": oracle.NOT_AFFECTED}
            for m in ("conditional", "no_grad_step")]
    rows = sweep_tables.model_table(spec, recs).splitlines()[4:]
    assert [r.split("|")[1].strip() for r in rows] == ["no_grad_step", "conditional"]


def test_the_model_tables_rows_of_one_model_go_by_zero_stage_then_loop_then_offload():
    spec = _spec(axes={"ga": [2], "model": ["conditional"]})
    points = [(3, "engine", "none"), (2, "manual", "cpu"), (2, "manual", "none"), (2, "engine", "none")]
    recs = [{"stack": {}, "point": {"model": "conditional", "loop": loop,
                                    "zero_optimization.offload_optimizer.device": off},
             "zero_stage": stage, "dtype": "fp32", "verdict": oracle.NOT_AFFECTED} for stage, loop, off in points]
    rows = sweep_tables.model_table(spec, recs).splitlines()[4:]
    assert [tuple(c.strip() for c in r.split("|")[2:5]) for r in rows] == \
        [("2", "engine", "none"), ("2", "manual", "cpu"), ("2", "manual", "none"), ("3", "engine", "none")]


def test_a_run_shows_its_bar_makes_its_folder_and_writes_its_spec(tmp_path, monkeypatch, capsys):
    spec = _spec(axes={"ga": [2]})

    def run_stack(spec_, stack, todo, sink, bar=None):
        for c in todo:
            sink({"stack": stack, "release": sweep_spec.release_of(stack), "spec_key": sweep_spec.spec_key(spec_), "id": c["id"],
                  "verdict": oracle.NOT_AFFECTED})
            bar.update(1)

    monkeypatch.setattr(sweep_run, "run_stack", run_stack)
    out = tmp_path / "new" / "folder"
    assert len(sweep_run.run(spec, out, progress=True)) == 1
    assert "sweep: 100%" in capsys.readouterr().err
    assert (out / "spec.json").read_text().startswith('{\n "base": {\n  "train_micro_batch_size_per_gpu": 4\n }')
    sweep_run.run(spec, tmp_path / "other", progress=False)  # work to do, and no bar asked for
    assert "sweep" not in capsys.readouterr().err


def test_violations_match_a_records_stack_whatever_the_order_of_its_keys_and_cut_a_long_reason():
    spec = _spec(axes={"ga": [2]}, stacks=[{"deepspeed": "0.18.6", "transformers": "5.3.0"}])
    recs = _recs_for(spec)
    for r in recs:
        r["stack"] = {"transformers": "5.3.0", "deepspeed": "0.18.6"}
    assert sweep_notebook.violations(spec, recs, {"stacks": []}) == []
    failed = [{**r, "verdict": oracle.CANNOT_RUN, "reason": "x" * 300} for r in recs]
    (bad,) = sweep_notebook.violations(spec, failed, {"stacks": []})
    assert bad.endswith(f"(first reason: {'x' * 200})")
    two = _spec(axes={"ga": [2, 4]})
    failed = [{**r, "verdict": oracle.CANNOT_RUN, "reason": f"reason {i}"} for i, r in enumerate(_recs_for(two))]
    assert sweep_notebook.violations(two, failed, {"stacks": []})[0].endswith("(first reason: reason 0)")


def test_a_bad_spec_file_says_yamls_first_line_and_the_command_says_what_it_does(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("axes: [unclosed\n")
    with pytest.raises(config.ConfigError, match="is not valid YAML: while parsing a flow sequence$"):
        sweep_spec.load_spec(str(bad))
    with pytest.raises(SystemExit):
        sweep.main(["--help"])
    assert "Sweep the DeepSpeed configuration space with the check's oracle, and group what is affected." in \
        " ".join(capsys.readouterr().out.split())  # the first paragraph of its docstring, as argparse wraps it


def test_each_unknown_group_gets_a_verified_script_its_config_and_its_report(tmp_path, monkeypatch):
    from gradkit.commands import repro

    spec = _spec(axes={"ga": [2, 4], "loop": ["manual"]})
    recs = []
    for i, p in enumerate(sweep_spec.points(spec)):
        case = sweep_spec.point_case(spec, p)
        recs.append({"id": case["id"], "point": p, "config": case, "world_size": 2, "ga": case["ga"], "stack": {},
                     "verdict": oracle.AFFECTED, "explained_by": None, "matches": "none", "shape": f"shape {i}",
                     "versions": {"deepspeed": "0.18.6", "torch": "2.13.0"}, "metrics": {"norm_ratio": 0.5,
                     "cosine": 1.0, "rel_l2": 0.5}, "attribution": {"weights": [0.0] * 8, "expected_weights": [0.125] * 8,
                     "residual": 0.0, "misplaced_weight": 0.875}, "reason": "r", "dtype": "fp32", "case": case["name"], "role": "measured"})
    gs = grouping.groups(recs, sweep_spec.all_axes(spec)) + [{"known_bug": "B3", "example": recs[0]["id"]}]
    ran = []

    def verify(path, world_size, stack, device):  # prints what the script would: its point's W x N weights
        import re

        ran.append((path.name, world_size, stack, device))
        n = int(re.search(r"STEPS = '\w+', (\d+),", path.read_text()).group(1))
        return 1, json.dumps({"deepspeed": "0.18.6", "steps": [{"off": True, "weights_x_right": [0.0] * (world_size * n),
                                                                 "residual": 0.0}], "reproduced": True})

    monkeypatch.setattr(repro, "verify", verify)
    sweep_run.reproduce(spec, {}, recs, gs, tmp_path, jobs=1)
    tag = __import__("gradkit.probes.runner", fromlist=["x"]).stack_label({}).replace(" ", "_").replace("=", "-")
    assert sorted(r[0] for r in ran) == [f"repro_{tag}_1.py", f"repro_{tag}_2.py"]  # not the known bug's group
    assert all(r[1:] == (2, {}, "cpu") for r in ran)
    for k, g in enumerate(gs[:2]):
        assert g["repro"]["script"] == f"repro_{tag}_{k + 1}.py" and g["repro"]["exit"] == 1
        assert g["repro"]["reproduced"] is True and set(g["repro"]["shape"]["weights"]) == {0.0}
        assert g["config"] == f"config_{tag}_{k + 1}.json" and g["report"] == f"report_{tag}_{k + 1}.md"
        text = (tmp_path / g["config"]).read_text()
        assert json.loads(text)["gradient_accumulation_steps"] in (2, 4)
        assert text == json.dumps(json.loads(text), indent=1, sort_keys=True)  # the same config, the same file
        assert "gradkit bisect" in (tmp_path / g["report"]).read_text()
    assert "repro" not in gs[2]


def test_of_two_conditions_that_select_the_same_points_the_first_axis_names_the_group():
    recs = [_p(1, 1, oracle.AFFECTED, "B3"), _p(0, 0, oracle.NOT_AFFECTED), _p(1, 1, oracle.AFFECTED, "B3", i="x"),
            _p(0, 0, oracle.NOT_AFFECTED, i="y")]
    (g,) = grouping.groups(recs, {"a": [0, 1], "b": [0, 1]})
    assert g["when"] == {"a": [1]}
    (g,) = grouping.groups(recs, {"b": [0, 1], "a": [0, 1]})
    assert g["when"] == {"b": [1]}


def test_main_says_whether_each_unknown_groups_script_reproduces_and_writes_the_summary(tmp_path, monkeypatch, capsys):
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text("axes:\n  ga: [2]\nbase:\n  train_micro_batch_size_per_gpu: 4\n")
    monkeypatch.setattr(sweep_run, "run", lambda spec, out, **k: (tmp_path / "o").mkdir() or [])  # run() makes the folder
    g = {"when": {}, "count": 1, "ratio_range": None, "matches": ["m"], "shapes": ["s"], "known_bug": None}
    summary = {"stacks": [{"stack": {}, "deepspeed": "0.18.6", "configs": 2, "counts": {oracle.AFFECTED: 2}, "groups": [
        {**g, "repro": {"script": "repro_1.py", "reproduced": True, "exit": 1, "output": "o" * 300 + "\nline two"}},
        {**g, "repro": {"script": "repro_2.py", "reproduced": False, "exit": 0, "output": "not reproduced"}}]}]}
    monkeypatch.setattr(sweep_run, "summarise", lambda spec, recs, out: json.loads(json.dumps(summary)))
    assert sweep.main([str(spec_file), "--out", str(tmp_path / "o"), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert f"    repro_1.py: reproduces (exit 1): {'o' * 200}\n" in printed
    assert "    repro_2.py: does NOT reproduce (exit 0): not reproduced\n" in printed
    assert (tmp_path / "o" / "summary.json").read_text().startswith('{\n "stacks": [\n  {')


def test_one_known_bug_group_has_no_smaller_groups_to_mention():
    g = {"when": {"a": [1]}, "count": 2, "ratio_range": [0.5, 0.5], "matches": ["m"], "shapes": ["s"], "known_bug": "B3"}
    summary = {"stacks": [{"deepspeed": "0.18.6", "configs": 2, "counts": {oracle.AFFECTED: 2}, "groups": [g]}]}
    assert "| a = 1 | 2 |" in sweep_tables.table(summary, "c")


def test_notebook_06s_stacks_replace_the_specs_only_when_given():
    p = {"SPEC": "scripts/sweeps/default.yaml", "STACKS": []}
    own = sweep_spec.load_spec("scripts/sweeps/default.yaml")["stacks"]
    assert sweep_notebook.notebook_spec(p)["stacks"] == own
    assert sweep_notebook.notebook_spec({**p, "STACKS": [{"deepspeed": "0.18.6"}]})["stacks"] == [{"deepspeed": "0.18.6"}]
    assert [s for _, s in sweep_notebook.check_notebook({**p, "SWEEP_DIR": ""})] == own
    with pytest.raises(config.ConfigError, match="SWEEP_DIR must be"):
        sweep_notebook.check_notebook({**p, "SWEEP_DIR": 3})
    with pytest.raises(config.ConfigError, match="STACKS must be a list of mappings"):
        sweep_notebook.check_notebook({**p, "SWEEP_DIR": "", "STACKS": ["0.18.6"]})


def test_a_tie_after_a_point_without_one_is_still_separated():
    plain = {"point": {"ga": 4, "s": 2}, "ga": 4, "stack": {}, "verdict": oracle.NOT_AFFECTED, "id": "plain"}
    tie = {"point": {"ga": 2, "s": 1}, "ga": 2, "stack": {}, "verdict": oracle.AFFECTED, "matches": "a or b",
           "id": "two", "ties": ["a", "b"]}
    four = {"point": {"ga": 4, "s": 1}, "ga": 4, "stack": {}, "verdict": oracle.AFFECTED, "id": "four", "matches": "a",
            "explained_by": "B3", "explanation": "B3"}
    grouping.separate([plain, tie, four])
    assert tie["separated_by"] == "four"


def test_a_group_needs_at_most_five_conditions_else_its_points_are_said_one_by_one():
    import itertools

    axes = {f"x{i}": [0, 1] for i in range(7)}
    recs = []
    for values in itertools.product([0, 1], repeat=7):
        hit = all(values[:6])  # x0..x5 all 1: six conditions, whatever x6
        recs.append({"point": dict(zip(axes, values)), "verdict": oracle.AFFECTED if hit else oracle.NOT_AFFECTED,
                     "id": "".join(map(str, values)), "explained_by": "B3" if hit else None, "matches": "m", "ga": 4,
                     "stack": {}, "metrics": {"norm_ratio": 0.5}})
    gs = grouping.groups(recs, axes)
    assert [g["count"] for g in gs] == [1, 1] and all(len(g["when"]) == 7 for g in gs)
    (g,) = grouping.groups(recs, axes, max_keys=6)
    assert g["when"] == {f"x{i}": [1] for i in range(6)}


def test_points_said_one_by_one_name_only_the_axes_that_vary():
    recs = [_p(a, b, oracle.AFFECTED if (a + b) % 2 else oracle.NOT_AFFECTED, "B3" if (a + b) % 2 else None)
            for a in range(3) for b in range(3)]
    for r in recs:
        r["point"]["c"] = "only"
    gs = grouping.groups(recs, {"a": [0, 1, 2], "b": [0, 1, 2], "c": ["only"]}, max_keys=1)
    assert gs and all(set(g["when"]) == {"a", "b"} for g in gs)


def test_a_reproduction_that_fails_to_run_is_not_swallowed(tmp_path, monkeypatch):
    from gradkit.commands import repro

    spec = _spec(axes={"ga": [2]})
    (p,) = sweep_spec.points(spec)
    case = sweep_spec.point_case(spec, p)
    rec = {"id": case["id"], "point": p, "config": case, "world_size": 2, "versions": {"deepspeed": "0.18.6"}}
    monkeypatch.setattr(repro, "verify", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("planted")))
    with pytest.raises(RuntimeError, match="planted"):
        sweep_run.reproduce(spec, {}, [rec], [{"known_bug": None, "example": case["id"], "when": {}, "count": 1,
                                           "ratio_range": None, "matches": [], "shapes": []}], tmp_path, jobs=1)


def test_main_from_the_command_line_names_its_own_command_and_its_wall_time(tmp_path, monkeypatch, capsys):
    import sys

    spec_file = tmp_path / "s.yaml"
    spec_file.write_text("axes:\n  ga: [2]\nbase:\n  train_micro_batch_size_per_gpu: 4\n")
    monkeypatch.setattr(sweep_run, "run", lambda spec, out, **k: (tmp_path / "o").mkdir() or [])
    readme = tmp_path / "sweep.md"  # the page of the sweep table, docs/sweep.md
    readme.write_text("<!-- gradkit:table SWEEP -->\n<!-- /gradkit:table -->\n")
    monkeypatch.setattr(sys, "argv", ["sweep.py", str(spec_file), "--out", str(tmp_path / "o"), "--readme", str(readme),
                                      "--no-progress"])
    monkeypatch.setattr(sweep_tables, "table", lambda summary, command: f"{command}\n")
    assert sweep.main() == 0
    assert f"python -m gradkit.commands.sweep {spec_file} --out" in readme.read_text()
    assert 0 <= json.loads((tmp_path / "o" / "summary.json").read_text())["wall_s"] < 3600  # a duration, not a date


def test_the_fewest_conditions_come_first_even_where_more_would_cover_more():
    import itertools

    axes = {"a": [0, 1], "b": [0, 1], "c": [0, 1, 2, 3, 4]}
    recs = []
    for a, b, cc in itertools.product(*axes.values()):
        hit = (a == 1 and b == 1) or cc == 4
        recs.append({"point": {"a": a, "b": b, "c": cc}, "verdict": oracle.AFFECTED if hit else oracle.NOT_AFFECTED,
                     "id": f"{a}{b}{cc}", "explained_by": "B3" if hit else None, "matches": "m", "ga": 4, "stack": {},
                     "metrics": {"norm_ratio": 0.5}})
    gs = grouping.groups(recs, axes)
    assert [(g["when"], g["count"]) for g in gs] == [({"c": [4]}, 4), ({"a": [1], "b": [1]}, 4)]


def test_one_at_a_time_keys_that_are_not_a_mapping_are_refused():
    with pytest.raises(config.ConfigError, match="one_at_a_time is"):
        sweep_spec.check_spec({"axes": {"ga": [2]}, "one_at_a_time": {"over": {}, "keys": ["gradient_clipping"]}})


def test_a_world_error_is_said_by_its_first_line_cut_at_300_characters(monkeypatch):
    from gradkit import launch

    spec = _stack_spec()
    todo = [sweep_spec.point_case(spec, p) for p in sweep_spec.points(spec)]
    _world(monkeypatch, lambda n, cases: [launch.LaunchError("e" * 400 + "\nsecond line")])
    got = []
    sweep_run.run_stack(spec, {}, todo, got.append)
    assert all(r["reason"].endswith(f"the world failed before its controls: {'e' * 300}") for r in got)


def test_a_point_that_breaks_the_world_right_after_its_controls_is_that_point(monkeypatch):
    from gradkit import launch

    spec = _stack_spec()
    todo = [sweep_spec.point_case(spec, p) for p in sweep_spec.points(spec)]

    def script(n, cases):
        if n == 1:
            return [EXACT for c in cases if c["role"] == "control"] + [launch.LaunchError("planted")]
        return [EXACT] * len(cases)

    launches = _world(monkeypatch, script)
    got = []
    sweep_run.run_stack(spec, {}, todo, got.append)
    assert len(launches) == 2 and got[0]["crashed_world"] is True and got[0]["id"] == todo[0]["id"]
    assert [r["verdict"] for r in got[1:]] == [oracle.NOT_AFFECTED] * 3


def test_a_stack_named_with_its_keys_in_any_order_runs_its_points(tmp_path, monkeypatch):
    spec = _spec(axes={"ga": [2]}, stacks=[{"transformers": "5.3.0", "deepspeed": "0.18.6"}])
    seen = []
    monkeypatch.setattr(sweep_run, "run_stack", lambda spec_, stack, todo, sink, bar=None: seen.append(len(todo)))
    sweep_run.run(spec, tmp_path, progress=False)
    assert seen == [1]


def test_the_one_at_a_time_table_goes_on_past_a_stack_without_a_value():
    spec = _spec(axes={"ga": [2]}, stacks=[{}, {"deepspeed": "0.18.6"}],
                 one_at_a_time={"over": {}, "keys": {"gradient_clipping": [1.0]}})
    recs = [{"stack": {"deepspeed": "0.18.6"}, "point": {"gradient_clipping": 1.0}, "verdict": oracle.AFFECTED}]
    lines = sweep_tables.one_at_a_time_table(spec, recs).splitlines()
    assert len(lines) == 3 and "| 0.18.6 |" in lines[2]


def test_an_inconclusive_points_reason_is_cut_at_200_and_an_unknown_group_without_ratios_reads_0():
    spec = _spec(axes={"ga": [2]})
    recs = _recs_for(spec, oracle.INCONCLUSIVE, reason="w" * 300)
    (bad,) = sweep_notebook.violations(spec, recs, {"stacks": []})
    assert bad.endswith(f"inconclusive: {'w' * 200}")
    g = {"when": {"a": [1]}, "count": 1, "ratio_range": None, "matches": ["m"], "shapes": ["s"], "known_bug": None}
    summary = {"stacks": [{"deepspeed": "0.18.6", "configs": 1, "counts": {oracle.AFFECTED: 1}, "groups": [g]}]}
    assert "| a = 1 | 1 | 0–0 | s | **unknown** |" in sweep_tables.table(summary, "c")


def test_every_point_affected_alike_is_one_group_of_every_point():
    recs = [_p(a, b, oracle.AFFECTED, "B3") for a in range(2) for b in range(2)]
    (g,) = grouping.groups(recs, {"a": [0, 1], "b": [0, 1]})
    assert g["when"] == {} and g["count"] == 4 and grouping.when_text(g["when"]) == "every point"


def test_more_stacks_than_worlds_at_a_time_still_run_every_point_and_the_bar_shows_by_default(tmp_path, monkeypatch,
                                                                                                capsys):
    spec = _spec(axes={"ga": [2]}, stacks=[{}, {"deepspeed": "0.18.6"}, {"deepspeed": "0.19.0"}])
    seen = []

    def run_stack(spec_, stack, todo, sink, bar=None):
        seen.append((json.dumps(stack), len(todo)))
        bar.update(len(todo))

    monkeypatch.setattr(sweep_run, "run_stack", run_stack)
    sweep_run.run(spec, tmp_path, jobs=2)
    assert sorted(seen) == sorted((json.dumps(st), 1) for st in spec["stacks"])
    assert "sweep: 100%" in capsys.readouterr().err


def test_a_tie_finds_its_sibling_and_notebook_06_its_points_whatever_the_order_of_their_keys():
    tie = {"point": {"s": 1, "ga": 2}, "ga": 2, "stack": {"deepspeed": "0.18.6", "transformers": "5.3.0"},
           "verdict": oracle.AFFECTED, "matches": "a or b", "id": "two", "ties": ["a", "b"]}
    four = {"point": {"ga": 4, "s": 1}, "ga": 4, "stack": {"transformers": "5.3.0", "deepspeed": "0.18.6"},
            "verdict": oracle.AFFECTED, "id": "four", "matches": "a", "explained_by": "B3", "explanation": "B3"}
    grouping.separate([tie, four])
    assert tie["separated_by"] == "four"
    spec = _spec(axes={"ga": [2]}, stacks=[{"transformers": "5.3.0", "deepspeed": "0.18.6"}])
    recs = _recs_for(spec)
    for r in recs:
        r["stack"] = {"deepspeed": "0.18.6", "transformers": "5.3.0"}
    assert sweep_notebook.violations(spec, recs, {"stacks": []}) == []


def test_the_beam_keeps_the_order_it_was_given_while_it_holds_them_all(monkeypatch):
    monkeypatch.setattr(grouping, "BEAM", 2)
    level = [(("worse",), 0b1111, 0), (("better",), 0b0011, 1)]
    assert [c[0] for c in grouping._beam(level, 0b0011, 0b0011)] == [("worse",), ("better",)]


def test_b6_is_pinned_only_for_no_grad_step_on_zero3():
    spec = _spec(axes={"ga": [2], "zero_optimization.stage": [3], "loop": ["engine"]})
    assert sweep_notebook.violations(spec, _recs_for(spec), {"stacks": []}) == []


def test_a_tie_on_a_point_that_is_not_affected_is_left_alone():
    quiet = {"point": {"ga": 2, "s": 1}, "ga": 2, "stack": {}, "verdict": oracle.NOT_AFFECTED, "matches": "a or b",
             "id": "two", "ties": ["a", "b"]}
    four = {"point": {"ga": 4, "s": 1}, "ga": 4, "stack": {}, "verdict": oracle.AFFECTED, "id": "four", "matches": "a",
            "explained_by": "B3", "explanation": "B3"}
    grouping.separate([quiet, four])
    assert "explained_by" not in quiet


def test_of_two_conditions_that_cover_as_many_points_the_first_comes_first():
    import itertools

    axes = {"a": [0, 1], "b": [0, 1], "c": [0, 1]}
    recs = []
    for a, b, cc in itertools.product(*axes.values()):
        hit = a == 1 or b == 1
        recs.append({"point": {"a": a, "b": b, "c": cc}, "verdict": oracle.AFFECTED if hit else oracle.NOT_AFFECTED,
                     "id": f"{a}{b}{cc}", "explained_by": "B3" if hit else None, "matches": "m", "ga": 4, "stack": {},
                     "metrics": {"norm_ratio": 0.5}})
    assert [(g["when"], g["count"]) for g in grouping.groups(recs, axes)] == [({"a": [1]}, 4), ({"b": [1]}, 2)]


def test_a_group_of_five_conditions_is_found_by_default():
    import itertools

    axes = {f"x{i}": [0, 1] for i in range(6)}
    recs = []
    for values in itertools.product([0, 1], repeat=6):
        hit = all(values[:5])
        recs.append({"point": dict(zip(axes, values)), "verdict": oracle.AFFECTED if hit else oracle.NOT_AFFECTED,
                     "id": "".join(map(str, values)), "explained_by": "B3" if hit else None, "matches": "m", "ga": 4,
                     "stack": {}, "metrics": {"norm_ratio": 0.5}})
    (g,) = grouping.groups(recs, axes)
    assert g["when"] == {f"x{i}": [1] for i in range(5)} and g["count"] == 2


def test_main_says_its_wall_time_to_a_tenth_of_a_second(tmp_path, monkeypatch):
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text("axes:\n  ga: [2]\nbase:\n  train_micro_batch_size_per_gpu: 4\n")
    monkeypatch.setattr(sweep_run, "run", lambda spec, out, **k: (tmp_path / "o").mkdir() or [])
    calls = []
    monkeypatch.setattr(sweep.time, "time", lambda: 100.0 if not calls.append(1) and len(calls) == 1 else 112.345)
    sweep.main([str(spec_file), "--out", str(tmp_path / "o"), "--no-progress"])
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["wall_s"] == 12.3


def test_a_bug_with_three_groups_mentions_two_smaller_ones_and_one_shaped_point_is_a_table():
    g = {"when": {"a": [1]}, "count": 3, "ratio_range": [0.5, 0.5], "matches": ["m"], "shapes": ["s"], "known_bug": "B3"}
    summary = {"stacks": [{"deepspeed": "0.18.6", "configs": 5, "counts": {oracle.AFFECTED: 5},
                           "groups": [g, {**g, "count": 1}, {**g, "count": 1}]}]}
    assert "| a = 1 (+ 2 smaller groups) | 5 |" in sweep_tables.table(summary, "c")
    spec = _spec(axes={"ga": [2], "model": ["conditional"]})
    one = [{"stack": {}, "point": {"model": "conditional"}, "zero_stage": 3, "dtype": "fp32",
            "verdict": oracle.NOT_AFFECTED}]
    assert sweep_tables.model_table(spec, one).splitlines()[-1].startswith("| conditional | 3 | engine | none | ok")


def test_a_bugs_row_shows_its_largest_groups_conditions_and_a_stack_without_groups_is_one_row():
    g = {"when": {"a": [1]}, "count": 3, "ratio_range": [0.5, 0.5], "matches": ["m"], "shapes": ["s"], "known_bug": "B3"}
    summary = {"stacks": [{"deepspeed": "0.18.6", "configs": 4, "counts": {oracle.AFFECTED: 4},
                           "groups": [g, {**g, "when": {"b": [2]}, "count": 1}]}]}
    assert "| a = 1 (+ 1 smaller group) | 4 |" in sweep_tables.table(summary, "c")
    alone = {"stacks": [{"deepspeed": "0.18.6", "configs": 2, "counts": {oracle.NOT_AFFECTED: 2}, "groups": []}]}
    assert sweep_tables.table(alone, "c").splitlines()[-1].startswith("| 0.18.6 | *2 configs: 2 not-affected* |")
