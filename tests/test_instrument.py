"""Tests that fail when the instrument is wrong: each asserts one behaviour of the judging code (issue 27), with
numbers docs/judge.md states and records made by hand, so that a planted defect in kit/ fails here with its name."""
import pytest

from gradkit import launch
from gradkit.commands import check, repro
from gradkit.commands.sweep import grouping
from gradkit.commands.check import summary as summary_module
from gradkit.judge import oracle, records

CONTROL = {"metrics": {"rel_l2": 0.0, "norm_ratio": 1.0, "cosine": 1.0}, "dtype": "fp32"}
# The limits docs/judge.md states (kit/judge/tolerances.py's TOLERANCES, set from measured noise): written here, not
# read from the module, so that a limit changed there fails here.
LIMITS = {"fp32": {"rel_l2": 1e-4, "norm_ratio": 1e-4, "misplaced_weight": 1e-4, "rank_spread": 1e-6},
          "bf16": {"rel_l2": 3e-2, "norm_ratio": 3e-2, "misplaced_weight": 5e-3, "rank_spread": 1e-6},
          "fp16": {"rel_l2": 5e-3, "norm_ratio": 5e-3, "misplaced_weight": 2e-3, "rank_spread": 1e-6}}


def _measured(dtype, rel_l2=0.0, ratio_off=0.0, misplaced=0.0, spread=0.0, rank_buffers=None):
    m = {"metrics": {"rel_l2": rel_l2, "norm_ratio": 1.0 + ratio_off, "cosine": 1.0}, "dtype": dtype,
         "attribution": {"misplaced_weight": misplaced}, "rank_spread": {"effective gradients": spread}}
    if rank_buffers is not None:
        m["rank_buffers"] = [{"attribution": {"misplaced_weight": w}} for w in rank_buffers]
    return m


@pytest.mark.parametrize("dtype", sorted(LIMITS))
@pytest.mark.parametrize("signal", ["rel_l2", "norm_ratio", "misplaced_weight", "rank_spread"])
def test_each_tolerance_holds_just_below_its_limit_and_fails_just_above(dtype, signal):
    limit = LIMITS[dtype][signal]
    kw = {"rel_l2": "rel_l2", "norm_ratio": "ratio_off", "misplaced_weight": "misplaced", "rank_spread": "spread"}[signal]
    below, _ = oracle.verdict(_measured(dtype, **{kw: 0.9 * limit}), CONTROL)
    above, why = oracle.verdict(_measured(dtype, **{kw: 1.1 * limit}), CONTROL)
    assert (below, above) == (oracle.NOT_AFFECTED, oracle.AFFECTED), (dtype, signal, why)


def test_a_rank_accumulator_alone_off_makes_the_record_affected_through_the_records_judgement():
    """Per-rank accumulators are judged: the effective gradient exact, one rank's own accumulator off."""
    rec = {**_measured("fp32", rank_buffers=[2e-3, 0.0]), "verdict": None}
    verdict, reason = oracle.verdict(records.judged(rec), records.judged({**CONTROL}))
    assert verdict == oracle.AFFECTED and "rank 0's accumulator" in reason
    assert oracle.verdict(records.judged({**_measured("fp32", rank_buffers=[0.0, 0.0])}), CONTROL)[0] == \
        oracle.NOT_AFFECTED


def test_the_spread_of_ranks_sees_any_rank_that_disagrees():
    import torch

    v = torch.arange(1.0, 5.0, dtype=torch.float64)
    assert oracle.spread([v, v.clone()]) == 0.0
    assert abs(oracle.spread([v, v, v * 1.01]) - 0.01) < 1e-12  # the last of three ranks
    assert abs(oracle.spread([v * 1.02, v]) - 0.02 / 1.02) < 1e-12


@pytest.mark.world
def test_a_world_whose_ranks_applied_different_steps_reports_their_spread():
    target = "gradkit.launch.selftest:judge_with_rank_offset"
    agree = launch.run_world(target, {"offset": 0.0}, world_size=2, timeout_s=120)
    differ = launch.run_world(target, {"offset": 1e-3}, world_size=2, timeout_s=120)
    assert agree[0]["rank_spread"]["effective gradients"] == 0.0
    assert abs(differ[0]["rank_spread"]["effective gradients"] - 1e-3) < 1e-9  # rank 1's step is 1.001 x rank 0's


def _check_recs(fix_verdict):
    base = {"metrics": {"norm_ratio": 0.25, "cosine": 1.0, "rel_l2": 0.75}, "attribution": {"misplaced_weight": 0.375},
            "ga": 4, "dtype": "fp32", "judge_dtype": "fp32", "reason": "r", "matches": "last micro-batch / N",
            "shape": "micro-batch 4 x1, the others x0", "steps": []}
    return [{**base, "role": "control", "case": "control", "config": {"loop": "torch"}, "verdict": oracle.NOT_AFFECTED},
            {**base, "role": "measured", "case": "manual", "config": {"loop": "manual"}, "verdict": oracle.AFFECTED},
            {**base, "role": "fix", "case": "manual fix:B3", "config": {"loop": "manual", "fix": "fix:B3"},
             "verdict": fix_verdict, "metrics": {**base["metrics"], "norm_ratio": 1.0 if fix_verdict ==
                                                 oracle.NOT_AFFECTED else 0.5}}]


@pytest.mark.parametrize("fix_verdict", [oracle.NOT_AFFECTED, oracle.AFFECTED, oracle.CANNOT_RUN])
def test_the_check_reports_the_fix_re_run_as_measured_a_fix_that_does_not_fix_included(monkeypatch, fix_verdict):
    monkeypatch.setattr(summary_module, "explain", lambda rec: ("B3", "B3 (report): the pattern"))
    summary = check.summarise(_check_recs(fix_verdict))
    (row,) = summary["loops"]
    assert row["fix"]["verdict"] == fix_verdict and summary["exit"] == 1
    assert row["fix"]["ratio"] == (1.0 if fix_verdict == oracle.NOT_AFFECTED else 0.5)


def _point(i, a, b, verdict):
    return {"id": i, "point": {"a": a, "b": b}, "verdict": verdict, "explained_by": "B3" if verdict == "affected" else None}


def test_the_sweep_groups_by_the_last_axis_when_that_is_what_the_affected_points_share():
    axes = {"a": [1, 2], "b": ["x", "y"]}
    recs = [_point(0, 1, "x", oracle.NOT_AFFECTED), _point(1, 2, "x", oracle.NOT_AFFECTED),
            _point(2, 1, "y", oracle.AFFECTED), _point(3, 2, "y", oracle.AFFECTED)]
    (group,) = grouping.groups(recs, axes)
    assert group["when"] == {"b": ["y"]} and group["count"] == 2
    recs = [_point(0, 1, "x", oracle.NOT_AFFECTED), _point(1, 2, "x", oracle.AFFECTED),
            _point(2, 1, "y", oracle.NOT_AFFECTED), _point(3, 2, "y", oracle.AFFECTED)]
    (group,) = grouping.groups(recs, axes)  # the first axis alone
    assert group["when"] == {"a": [2]} and group["count"] == 2
    recs = [_point(0, 1, "x", oracle.NOT_AFFECTED), _point(1, 2, "x", oracle.NOT_AFFECTED),
            _point(2, 1, "y", oracle.NOT_AFFECTED), _point(3, 2, "y", oracle.AFFECTED)]
    (group,) = grouping.groups(recs, axes)  # both axes
    assert group["when"] == {"a": [2], "b": ["y"]} and group["count"] == 1


def _said(reproduced, off=True, weights=(0.0, 1.0)):
    import json

    step = {"off": off, "weights_x_right": list(weights), "residual": 0.0}
    return json.dumps({"deepspeed": "0.18.6", "steps": [step], "reproduced": reproduced})


@pytest.mark.parametrize("rc, output, shape, want", [
    (1, _said(True), None, True),
    (1, _said(False), None, False),                                   # it says it did not
    (0, _said(True), None, False),                                    # its exit status disagrees
    (1, "Traceback (most recent call last):\n  RuntimeError: gloo", None, False),  # a crash judges nothing
    (1, _said(True) + "\n" + _said(True), None, False),               # two judged lines: which one?
    (1, _said(True, weights=(0.0, 1.0)), {"weights": [0.0, 1.0], "residual": 0.0}, True),
    (1, _said(True, weights=(1.0, 1.0)), {"weights": [0.0, 1.0], "residual": 0.0}, False),  # another shape of step
    (1, _said(True, off=False), {"weights": [0.0, 1.0], "residual": 0.0}, False),  # the matching step was not off
])
def test_a_reproduction_reproduces_only_by_its_own_judgement_and_shape(rc, output, shape, want):
    assert repro.reproduced(rc, output, shape) is want
