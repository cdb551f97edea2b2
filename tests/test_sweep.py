"""The sweep on a small spec in real 2-rank worlds: groups B3 exactly, survives a point that kills a rank,
resumes without re-running anything, and its standalone reproduction script reproduces (and only then)."""
import json

import pytest

from gradkit import config, launch, shapes
from gradkit.commands import repro
from gradkit.commands.sweep import grouping
from gradkit.commands.sweep import run as sweep_run
from gradkit.commands.sweep import spec as sweep_spec
from gradkit.judge import naming, oracle, records

SPEC = {
    "world_size": 2,
    "base": {"train_micro_batch_size_per_gpu": 4},
    "axes": {"zero_optimization.stage": [2, 0], "gradkit_fault_kill_rank": [-1, 1], "ga": [1, 4],
             "loop": ["engine", "manual"]},
    # one point only kills its rank 1 (ZeRO-2, GA 4, manual), in the middle of the world's work
    "skip": [{"gradkit_fault_kill_rank": 1, "zero_optimization.stage": 0}, {"gradkit_fault_kill_rank": 1, "ga": 1},
             {"gradkit_fault_kill_rank": 1, "loop": "engine"}],
}


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    spec = sweep_spec.check_spec(json.loads(json.dumps(SPEC)))
    return spec, out, sweep_run.run(spec, out, progress=False)


@pytest.mark.world
def test_a_point_that_kills_a_rank_costs_only_itself(swept):
    spec, _, recs = swept
    assert len(recs) == len(sweep_spec.points(spec)) == 9
    (crashed,) = [r for r in recs if r["point"]["gradkit_fault_kill_rank"] == 1]
    assert crashed["verdict"] == oracle.CANNOT_RUN and crashed["crashed_world"] and "SIGKILL" in crashed["reason"]
    after = [r for r in recs if r["point"]["zero_optimization.stage"] == 0]  # run by the relaunched world
    assert len(after) == 4 and {r["verdict"] for r in after} == {oracle.NOT_AFFECTED}


@pytest.mark.world
def test_the_affected_points_are_grouped_by_the_smallest_key_set_and_named(swept):
    spec, _, recs = swept
    (group,) = grouping.groups(recs, spec["axes"])
    # the point that killed its rank (ZeRO-2, GA 4, manual) is cannot-run: it never widens a condition, so the
    # group keeps the one key that leaves it out
    assert group["when"] == {"zero_optimization.stage": [2], "ga": [4], "loop": ["manual"],
                             "gradkit_fault_kill_rank": [-1]}
    assert group["known_bug"] == "B3" and group["count"] == 1 and group["matches"] == ["last micro-batch / N"]
    assert "[B3]" in grouping.describe(group)


@pytest.mark.world
def test_a_rerun_into_the_same_folder_skips_what_is_done(swept, monkeypatch):
    spec, out, recs = swept
    monkeypatch.setattr(launch, "run_world", lambda *a, **k: pytest.fail("a finished point was launched again"))
    again = sweep_run.run(spec, out, progress=False)
    assert len(again) == len(recs) and len((out / "records.jsonl").read_text().splitlines()) == 9


@pytest.mark.world
def test_the_reproduction_script_reproduces_b3_and_not_a_correct_loop(swept, tmp_path):
    _, _, recs = swept
    bad = next(r for r in recs if r["verdict"] == oracle.AFFECTED)
    good = records.one(recs, verdict=oracle.NOT_AFFECTED, id=next(r["id"] for r in recs if r["verdict"] == oracle.NOT_AFFECTED
                                                                 and r["point"]["loop"] == "engine" and r["ga"] == 4))
    script = repro.write(bad, tmp_path / "repro_b3.py", "ZeRO-2, config GA = 1, 4 backward() per step()")
    text = script.read_text()
    model = shapes.of_case(bad["config"]).source()
    assert model in text  # the model is the shape's own code, embedded
    assert "import gradkit" not in text and "from gradkit" not in text
    assert len(text.replace(model, "").splitlines()) <= 100  # the harness around it stays short enough to read
    rc, output = repro.verify(script)
    assert rc == 1 and "REPRODUCED" in output, output
    # judged by what it printed, step by step: B3's shape (each rank's last micro-batch at its right weight 1/(W N),
    # the others 0) at every one of the point's steps, with the script's own data and model
    shape = repro.shape_of(bad)
    assert shape["weights"] == [0.0, 0.0, 0.0, 1.0] * 2 and shape["residual"] < repro.STRUCTURAL, shape
    said = repro.said(output)
    assert len(said["steps"]) == bad["step_count"] == 3 and all(s["off"] for s in said["steps"]), said
    assert repro.reproduced(rc, output, shape)
    assert not repro.reproduced(rc, output, {"weights": [1.0] * 8, "residual": 0.0})  # another structural shape
    assert not repro.reproduced(rc, output, {**shape, "residual": 0.5})  # a step the basis does not explain
    rc, output = repro.verify(repro.write(good, tmp_path / "repro_ok.py", "ZeRO-2, DeepSpeed's own loop"))
    assert rc == 0 and "not reproduced" in output, output


@pytest.mark.parametrize("bad, needle", [
    ({"axes": {}}, "needs 'axes'"),
    ({"axes": {"loop": ["sideways"]}}, "loop values"),
    ({"axes": {"ga": [0]}}, "gradient accumulation"),
    ({"axes": {"ga": [2]}, "colour": "red"}, "unknown key"),
    ({"axes": {"ga": [2]}, "skip": [{"stage": 1}]}, "skip rule"),
    ({"axes": {"zero_optimization.stage": [5]}}, "stage"),
    ({"axes": {"ga": [2]}, "stacks": [{"deepspeed": "newest"}]}, "newest"),
])
def test_a_bad_spec_is_refused_before_anything_launches(bad, needle, monkeypatch):
    monkeypatch.setattr(launch, "run_world", lambda *a, **k: pytest.fail("a world was launched"))
    with pytest.raises(config.ConfigError, match=needle):
        sweep_spec.check_spec(bad)


def test_the_default_spec_has_at_least_200_points_that_run_on_cpu():
    spec = sweep_spec.load_spec("scripts/sweeps/default.yaml")
    pts = sweep_spec.points(spec)
    assert len(pts) >= 200 and spec["world_size"] == 2
    fp16 = [p for p in pts if p.get("dtype") == "fp16"]  # DeepSpeed's dynamic scale judged (B10), ZeRO-0 to 3
    assert len(fp16) >= 50 and {p["zero_optimization.stage"] for p in fp16} == {0, 1, 2, 3}
    assert not any(p["data_types.grad_accum_dtype"] == "bf16" for p in fp16)


@pytest.mark.world
def test_an_unknown_group_gets_a_report_ready_to_paste_upstream_with_its_config_and_verified_reproduction(swept,
                                                                                                        tmp_path):
    """The sweep writes, for a group no known bug explains, the config a user would bisect, the reproduction it ran
    and a report that holds both; ``gradkit report`` rebuilds it from the folder (here B3's group, its name taken
    away, stands for an unknown one)."""
    from gradkit.commands import report

    spec, out, recs = swept
    (group,) = grouping.groups(recs, spec["axes"])
    group["known_bug"] = None
    sweep_run.reproduce(spec, {}, recs, [group], tmp_path)
    assert group["repro"]["reproduced"] and group["report"] == "report_installed_1.md"
    user = json.loads((tmp_path / group["config"]).read_text())
    assert user["gradient_accumulation_steps"] == 4 and user["zero_optimization"]["stage"] == 2
    (tmp_path / "summary.json").write_text(json.dumps({"stacks": [{"stack": {}, "groups": [group]}]}, default=str))
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r, default=str) + "\n" for r in recs))
    assert report.main([str(tmp_path), "--group", "repro_installed_1", "--out", str(tmp_path / "again.md")]) == 0
    for name in (group["report"], "again.md"):
        text = (tmp_path / name).read_text()
        assert text.startswith("# [DeepSpeed ") and "ZeRO-2 fp32, GA 4, manual loop" in text.splitlines()[0]
        assert ("the affected ones are exactly: zero_optimization.stage = 2 x gradkit_fault_kill_rank = -1 x ga = 4 x "
                "loop = manual") in text
        assert '"gradient_accumulation_steps": 1' in text  # the config as run: the manual loop's GA 1
        assert "| 1 | 0." in text and "micro-batch 4 x1, the others x0" in text  # each step, in words
        assert f"gradkit bisect {tmp_path / group['config']} --loop manual" in text
        assert "REPRODUCED" in text and "engine, *_ = deepspeed.initialize(" in text  # the script inline, with what it printed
    with pytest.raises(config.ConfigError, match="no unknown group with the reproduction repro_x.py"):
        report.main([str(tmp_path), "--group", "repro_x"])


FP16_SPEC = {  # DeepSpeed's dynamic fp16 loss scale against a static one and bf16, at ZeRO-1 and ZeRO-3
    "world_size": 2,
    "base": {"train_micro_batch_size_per_gpu": 4},
    "axes": {"zero_optimization.stage": [1, 3], "dtype": ["fp16", "bf16"], "fp16.loss_scale": [0, 1024], "ga": [4]},
    "skip": [{"dtype": "bf16", "fp16.loss_scale": 1024}],
}


@pytest.mark.world
def test_the_sweep_groups_the_dynamic_fp16_scale_alone_and_names_b10(tmp_path):
    """The scale's growth step is unscaled by the new scale on both stages (B10); a static scale never grows and bf16
    has no scale: the group's condition is the dynamic scale itself, and the step it leaves is named."""
    spec = sweep_spec.check_spec(json.loads(json.dumps(FP16_SPEC)))
    recs = sweep_run.run(spec, tmp_path, progress=False)
    assert len(recs) == 6 and oracle.CANNOT_RUN not in {r["verdict"] for r in recs}, [r["reason"] for r in recs]
    (group,) = grouping.groups(recs, spec["axes"])
    assert group["when"] == {"dtype": ["fp16"], "fp16.loss_scale": [0]}, group["when"]
    assert group["known_bug"] == "B10" and group["count"] == 2 and group["matches"] == [naming.SCALE_GREW]
    assert "[B10]" in grouping.describe(group)

