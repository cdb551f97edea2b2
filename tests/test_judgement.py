"""What a CI may bet on (issue 22): exit 1 only for a measured `affected`, ties said and never named, unknown steps
described from their weights, sweep groups that partition what ran, reproductions judged by what they print.
Synthetic records where the logic is the point; real 2-rank worlds where the behaviour is real."""
import json

import pytest
import torch

from gradkit import config, launch
from gradkit.commands import check, repro
from gradkit.commands.sweep import grouping
from gradkit.notebooks import sweep as sweep_notebook
from gradkit.commands.sweep import run as sweep_run
from gradkit.commands.sweep import spec as sweep_spec
from gradkit.judge import expectations, naming, oracle, records
from gradkit.probes import runner
from gradkit.probes import ds_config
from gradkit.probes.ranks import ds_config as ds_ranks


def _basis(k, size=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(k, size, generator=g, dtype=torch.float64)


# ------------------------------------------------------------------------------------------- ties and shapes

def test_at_ga_2_last_micro_batch_and_all_but_the_first_tie_and_no_bug_is_named():
    w, n = 2, 2
    hyp = ds_ranks.hypothesis_weights(w, n)
    basis = _basis(w * n)
    step = torch.tensor(hyp["last micro-batch / N"], dtype=torch.float64) @ basis
    h = naming.explain(step, basis, hyp, "fp32")
    assert h["ambiguous"] == ["all but the first micro-batch", "last micro-batch / N"]
    matches = naming.step_name(h)
    assert matches == "ambiguous between 'all but the first micro-batch' and 'last micro-batch / N'"
    rec = {"config": {"loop": "manual", "ds_config": {}}, "versions": {"deepspeed": "0.19.8"}, "zero_stage": 2,
           "optimizer": "DeepSpeedZeroOptimizer", "ga": n, "matches": matches, "shape": "micro-batch 1 x0, the others x2"}
    assert check.candidates(rec) == ["B3"]  # B3's configuration and release ...
    bug, why = check.explain(rec)
    assert bug is None and "ambiguous between" in why  # ... but its step cannot be told apart: no name
    # at GA 4 the same hypothesis stands alone
    hyp4 = ds_ranks.hypothesis_weights(w, 4)
    b4 = _basis(w * 4)
    h4 = naming.explain(torch.tensor(hyp4["last micro-batch / N"], dtype=torch.float64) @ b4, b4, hyp4, "fp32")
    assert h4["ambiguous"] == [] and h4["best"] == "last micro-batch / N" and h4["best_matches"]


def test_each_named_step_has_its_step_without_the_all_reduce_whatever_comes_before_it():
    """``naming.local``: every named step of this step's micro-batches, in any order, gets rank r's own rows on rank r's
    partition (x W); the mean's is B8's own; one that is the mean here, one over an earlier step's micro-batches, and a
    step given as a function get none, and never stop the ones after them."""
    w, n = 2, 3
    k, hyp = w * n, ds_ranks.hypothesis_weights(w, n)
    last = hyp["last micro-batch / N"]
    ordered = {"global mean": hyp["global mean"], "the mean again": list(hyp["global mean"]),
               "an earlier step's too": [1 / k] * (2 * k), "a function": lambda b: b.sum(0), "last micro-batch / N": last}
    basis = _basis(k, size=10)
    out = naming.local(ordered, w, n, lambda size: [(0, 4), (4, size)])
    assert set(out) == {naming.OWN_PARTITION, "last micro-batch / N" + naming.LOCAL}
    got = out["last micro-batch / N" + naming.LOCAL](basis)
    x = torch.tensor(last, dtype=torch.float64) * w
    assert torch.allclose(got[:4], x[:n] @ basis[:n, :4]) and torch.allclose(got[4:], x[n:] @ basis[n:, 4:])


def test_an_unknown_step_is_described_by_its_weights():
    w, n, k = 2, 4, 8
    expected = [1 / k] * k
    # micro-batch 2 of every rank lost, the others weighed as they should
    got = [0.0 if i % n == 1 else 1 / k for i in range(k)]
    assert naming.describe_weights(got, expected, w, n) == "micro-batch 2 x0, the others x1"
    # ranks that differ are named; the previous step's micro-batches are said when they carry weight
    got = [1 / k] * n + [2 / k] * n + [1 / k] * k
    text = naming.describe_weights(got, expected + [0.0] * k, w, n)
    assert text == "rank 0: every micro-batch x1; rank 1: every micro-batch x2; the previous step's micro-batches x1"


def test_a_config_key_that_is_a_bugs_fix_rules_that_bug_out():
    rec = {"config": {"loop": "manual", "ds_config": {"managed_gradient_accumulation": False}}, "zero_stage": 2,
           "versions": {"deepspeed": "0.19.8"}, "optimizer": "DeepSpeedZeroOptimizer", "ga": 4}
    assert "B3" in check.ruled_out(rec) and check.candidates(rec) == []
    rec["versions"] = {"deepspeed": "0.19.3"}  # before the key existed, it rules nothing out
    assert check.ruled_out(rec) == {} and check.candidates(rec) == ["B3"]
    # a bug no release fixes stays expected on releases newer than the table
    rec["versions"], rec["config"]["ds_config"] = {"deepspeed": "9.0.0"}, {}
    assert check.candidates(rec) == ["B3"]


# ------------------------------------------------------------------------------------------- exit status

def _row(verdict, loop="engine", norm="n/a"):
    base = {"role": "measured", "case": loop, "verdict": verdict, "reason": f"{verdict} here", "config": {"loop": loop},
            "ga": 4, "dtype": "fp32", "norm_verdict": norm}
    if verdict == oracle.CANNOT_RUN:
        return {**base, "metrics": None, "error": "it broke"}
    return {**base, "metrics": {"norm_ratio": 1.0, "cosine": 1.0}, "attribution": {"misplaced_weight": 0.0},
            "matches": "global mean" if verdict == oracle.NOT_AFFECTED else "none",
            "versions": {"deepspeed": "0.19.8"}, "zero_stage": 0}


@pytest.mark.parametrize("verdicts, norm, want", [
    ([oracle.AFFECTED, oracle.CANNOT_RUN], "n/a", (oracle.AFFECTED, 1)),  # a measured affected: 1
    ([oracle.NOT_AFFECTED, oracle.CANNOT_RUN], "n/a", (oracle.CANNOT_RUN, 3)),  # not everything measured: never 0
    ([oracle.NOT_AFFECTED, oracle.INCONCLUSIVE], "n/a", (oracle.INCONCLUSIVE, 3)),
    ([], "n/a", (oracle.CANNOT_RUN, 3)),  # nothing ran: never 0
    ([oracle.NOT_AFFECTED, oracle.NOT_AFFECTED], "n/a", (oracle.NOT_AFFECTED, 0)),
    ([oracle.NOT_AFFECTED], oracle.AFFECTED, (oracle.AFFECTED, 1)),  # the step is right, the logged norm is not
])
def test_exit_1_means_a_measured_affected_and_nothing_else(verdicts, norm, want):
    recs = [_row(v, loop=f"loop{i}", norm=norm) for i, v in enumerate(verdicts)]
    s = check.summarise(recs)
    assert (s["verdict"], s["exit"]) == want
    if norm == oracle.AFFECTED:
        assert s["loops"][0]["off"] == ["logged grad norm"] and s["loops"][0]["step_verdict"] == oracle.NOT_AFFECTED


def test_an_internal_error_is_exit_3_never_1(tmp_path, monkeypatch, capsys):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}))

    def broken(*a, **k):
        raise KeyError("a bug in the kit")

    monkeypatch.setattr(ds_config, "run", broken)
    assert check.main([str(path), "--loop", "engine"]) == 3
    assert "internal error" in capsys.readouterr().out


def test_one_rank_is_refused_unless_asked_for(tmp_path, monkeypatch):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}))
    monkeypatch.setattr(launch, "run_world", lambda *a, **k: pytest.fail("a world was launched"))
    with pytest.raises(config.ConfigError, match="--allow-one-rank"):
        check.main([str(path), "--world-size", "1"])


def test_an_optimizer_with_its_own_communication_is_cannot_run_not_replaced(tmp_path, monkeypatch, capsys):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4,
                                "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-4, "freeze_step": 10}}}))
    monkeypatch.setattr(launch, "run_world", lambda *a, **k: pytest.fail("a world was launched"))
    assert check.main([str(path), "--loop", "engine"]) == 3
    assert "OneBitAdam" in capsys.readouterr().out


def test_auto_precision_checks_every_precision_it_could_resolve_to():
    user = {"bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}
    assert check.precisions(user, None) == ["fp32", "bf16", "fp16"]
    assert check.precisions({"bf16": {"enabled": True}}, None) == ["fp32"]  # nothing auto: the config decides
    assert check.precisions(user, "bf16") == ["bf16"]
    cfg = ds_config.resolve(user, 2, 4, "bf16")
    assert cfg["bf16"]["enabled"] is True and not cfg.get("fp16", {}).get("enabled")


def test_a_not_affected_below_its_detection_floor_is_inconclusive():
    # bf16 sees a misplaced weight of 5e-3; one lost micro-batch of W = 2, N = 64 weighs 1/256 = 3.9e-3 < 5e-3
    rec = {"verdict": oracle.NOT_AFFECTED, "reason": "every signal within", "dtype": "bf16", "world_size": 2,
           "ga": 64, "metrics": {"norm_ratio": 1.0, "cosine": 1.0, "rel_l2": 0.0}, "attribution": {"misplaced_weight": 0.0}}
    ds_config.judge_floor(rec)
    assert rec["verdict"] == oracle.INCONCLUSIVE and "one lost micro-batch" in rec["reason"] and rec["below_floor"]
    ok = {**rec, "verdict": oracle.NOT_AFFECTED, "reason": "every signal within", "ga": 4}
    ds_config.judge_floor(ok)
    assert ok["verdict"] == oracle.NOT_AFFECTED and ok["detectable_weight"] == pytest.approx(5e-3)


# ------------------------------------------------------------------------------------------- the sweep

def _point(a, b, verdict, bug=None, shape=None):
    return {"point": {"a": a, "b": b}, "verdict": verdict, "id": f"{a}{b}", "explained_by": bug, "shape": shape,
            "matches": "none", "ga": 4, "stack": {}, "metrics": {"norm_ratio": 0.5} if verdict == oracle.AFFECTED else None}


def test_a_cannot_run_point_never_widens_a_group_and_groups_partition_the_affected_points():
    recs = [_point(1, 0, oracle.AFFECTED, "B3"), _point(1, 1, oracle.AFFECTED, "B3"), _point(1, 2, oracle.CANNOT_RUN),
            _point(0, 0, oracle.NOT_AFFECTED), _point(0, 1, oracle.NOT_AFFECTED), _point(0, 2, oracle.NOT_AFFECTED)]
    (g,) = grouping.groups(recs, {"a": [0, 1], "b": [0, 1, 2]})
    assert g["when"] == {"a": [1], "b": [0, 1]} and g["count"] == 2  # not "a = 1": (1, 2) did not run
    # two labels: each group holds one label, and the groups' counts add up to the affected points
    recs[1] = _point(1, 1, oracle.AFFECTED, None, "micro-batch 2 x0, the others x1")
    recs[4] = _point(0, 1, oracle.AFFECTED, None, "micro-batch 2 x0, the others x1")
    gs = grouping.groups(recs, {"a": [0, 1], "b": [0, 1, 2]})
    assert sum(g["count"] for g in gs) == 3 and sorted(sum((g["ids"] for g in gs), [])) == ["01", "10", "11"]
    assert {tuple(g["explained_by"]) for g in gs} == {("B3",), ("None",)}


def test_unknown_points_of_different_shapes_are_never_one_group():
    recs = [_point(1, 0, oracle.AFFECTED, None, "micro-batch 1 x0, the others x1"),
            _point(1, 1, oracle.AFFECTED, None, "micro-batch 4 x2, the others x0"),
            _point(0, 0, oracle.NOT_AFFECTED), _point(0, 1, oracle.NOT_AFFECTED)]
    gs = grouping.groups(recs, {"a": [0, 1], "b": [0, 1]})
    assert len(gs) == 2 and all(len(g["shapes"]) == 1 for g in gs)


def test_a_tie_at_ga_2_is_separated_by_the_same_config_at_ga_4():
    tie = "ambiguous between 'all but the first micro-batch' and 'last micro-batch / N'"
    two = {"point": {"ga": 2, "s": 1}, "ga": 2, "stack": {}, "verdict": oracle.AFFECTED, "matches": tie, "id": "two",
           "ties": ["all but the first micro-batch", "last micro-batch / N"]}
    four = {"point": {"ga": 4, "s": 1}, "ga": 4, "stack": {}, "verdict": oracle.AFFECTED, "id": "four",
            "matches": "last micro-batch / N", "explained_by": "B3", "explanation": "B3 (...)"}
    other = {**two, "point": {"ga": 2, "s": 2}, "id": "other"}  # no GA 4 sibling: stays a tie
    elsewhere = {**two, "point": {"ga": 2, "s": 1}, "id": "elsewhere", "ties": ["first micro-batch", "sum"]}
    grouping.separate([two, four, other, elsewhere])
    assert two["explained_by"] == "B3" and two["separated_by"] == "four" and "GA 4 separates" in two["explanation"]
    assert other.get("explained_by") is None
    assert elsewhere.get("explained_by") is None  # GA 4's step is not one of the names this tie is between


def test_resume_never_reuses_a_record_of_another_release_or_spec(monkeypatch):
    spec = sweep_spec.check_spec({"axes": {"ga": [2]}, "base": {"train_micro_batch_size_per_gpu": 4}})
    case = sweep_spec.point_case(spec, {"ga": 2})
    rec = {"stack": {}, "release": sweep_spec.release_of({}), "spec_key": sweep_spec.spec_key(spec), "id": case["id"]}
    assert sweep_run.current([rec], spec) == [rec]
    assert sweep_run.current([{**rec, "release": "0.0.1"}], spec) == []  # the installed release was upgraded since
    other = sweep_spec.check_spec({**json.loads(json.dumps(spec)), "steps": 1})
    assert sweep_run.current([rec], other) == []


def test_violations_fail_a_sweep_where_nothing_ran():
    spec = sweep_spec.check_spec({"axes": {"ga": [2]}, "base": {"train_micro_batch_size_per_gpu": 4}})
    (case,) = [sweep_spec.point_case(spec, p) for p in sweep_spec.points(spec)]
    recs = records.failed_records([case], {"stack": {}}, "installed", "no DeepSpeed")
    for r in recs:
        r["point"], r["id"] = case["point"], case["id"]
    bad = sweep_notebook.violations(spec, recs, sweep_run.summarise(spec, recs))
    assert any("cannot-run" in b and "measured nothing" in b for b in bad)


def test_a_reproduction_reproduces_only_by_its_own_printed_judgement():
    said = json.dumps({"deepspeed": "0.19.8", "reproduced": True, "ratio": 0.5})
    assert repro.reproduced(1, said + "\nREPRODUCED")
    assert not repro.reproduced(1, "Traceback (most recent call last):\n  ...\nRuntimeError: boom")  # a crash
    assert not repro.reproduced(1, json.dumps({"deepspeed": "0.19.8", "reproduced": False}))
    assert not repro.reproduced(0, said)  # its exit status disagrees with what it printed


# ------------------------------------------------------------------------------------------- a real world

@pytest.mark.world
def test_a_loop_that_keeps_the_previous_steps_gradient_is_affected_from_step_2_with_that_weight_fitted():
    """The control's own torch loop with zero_grad forgotten: step 1 is exact, step 2 applies step 1's gradient
    again. One step from a fresh engine could never see it."""
    cases = [{"name": "control", "role": "control", "loop": "torch", "ga": 4, "dtype": "fp32", "zero_stage": None,
              "steps": 3, "clip": 0.0},
             {"name": "stale", "role": "measured", "loop": "torch", "ga": 4, "dtype": "fp32", "zero_stage": None,
              "steps": 3, "clip": 0.0, "ds_config": {ds_ranks.STALE_FAULT_KEY: True}}]
    recs = runner.run(ds_config.CHECK, cases, [{}], (2,))
    rec = records.one(recs, case="stale")
    assert rec["verdict"] == oracle.AFFECTED, rec["reason"]
    s1, s2 = rec["steps"][0], rec["steps"][1]
    assert oracle.severity({**s1, "dtype": "fp32"}) <= 1.0 and s1["matches"] == "global mean"
    assert oracle.severity({**s2, "dtype": "fp32"}) > 1.0 and s2["matches"] == ds_ranks.STALE
    k = 2 * 4
    prev = s2["attribution"]["weights"][k:]
    assert len(prev) == k and all(abs(x - 1 / k) < 1e-6 for x in prev), prev
    assert s2["shape"] == "every micro-batch x1; the previous step's micro-batches x1"
    assert rec["trajectory"]["rel_l2"] > 0.1
    assert records.one(recs, case="control")["verdict"] == oracle.NOT_AFFECTED


def test_a_step_is_judged_at_the_coarsest_precision_its_gradient_passes_through():
    assert ds_config.judge_dtype({"communication_data_type": "bf16"}) == "bf16"  # an fp32 model reduced in bf16
    assert ds_config.judge_dtype({"communication_data_type": "fp32"}) == "fp32"
    assert ds_config.judge_dtype({"fp16": {"enabled": True}, "communication_data_type": "bf16"}) == "bf16"
    assert ds_config.judge_dtype({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}) == "bf16"
    cfg = ds_config.resolve({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4,
                             "communication_data_type": "bf16"}, 2, 4, "fp32")
    (case,) = [c for c in ds_config.plan(cfg, ("engine",))[0] if c["role"] == "measured"]
    rec = records.base({}, case, "installed")
    assert rec["dtype"] == "fp32" and records.judged({**rec, "metrics": None})["dtype"] == "bf16"


def test_violations_accept_a_point_below_its_floor_but_not_one_whose_control_was_off():
    spec = sweep_spec.check_spec({"axes": {"ga": [2]}, "base": {"train_micro_batch_size_per_gpu": 4}})
    (case,) = [sweep_spec.point_case(spec, p) for p in sweep_spec.points(spec)]
    rec = {**records.base({"stack": {}}, case, "installed"), "point": case["point"], "id": case["id"],
           "verdict": oracle.INCONCLUSIVE, "reason": "no signal is off, but ...", "below_floor": True}
    assert not [b for b in sweep_notebook.violations(spec, [rec], {"stacks": []}) if "inconclusive" in b]
    off = {**rec, "below_floor": False, "reason": "the control is off the reference itself"}
    assert [b for b in sweep_notebook.violations(spec, [off], {"stacks": []}) if "inconclusive" in b]


def test_a_step_divided_by_the_optimizers_loss_scale_is_named_where_the_optimizer_has_one():
    """B9: FP16_UnfusedOptimizer divides by its loss scale (256 in the check) a loss the engine did not scale; the
    hypothesis exists only where the optimizer's scale is above 1, and a step 1/256 of the mean is that one alone."""
    w, n = 2, 4
    assert ds_ranks.UNSCALED not in ds_ranks.hypothesis_weights(w, n)
    assert ds_ranks.UNSCALED not in ds_ranks.hypothesis_weights(w, n, loss_scale=1.0)
    hyp = ds_ranks.hypothesis_weights(w, n, loss_scale=256.0)
    assert hyp[ds_ranks.UNSCALED] == [1 / (8 * 256)] * 8
    basis = _basis(w * n)
    h = naming.explain(torch.tensor(hyp[ds_ranks.UNSCALED], dtype=torch.float64) @ basis, basis, hyp, "fp16")
    assert naming.step_name(h) == ds_ranks.UNSCALED
    exact = naming.explain(torch.tensor(hyp["global mean"], dtype=torch.float64) @ basis, basis, hyp, "fp16")
    assert naming.step_name(exact) == "global mean"
    rec = {"config": {"loop": "engine", "ds_config": {}}, "versions": {"deepspeed": "0.19.8"}, "zero_stage": 0,
           "optimizer": "FP16_UnfusedOptimizer", "ga": n, "matches": ds_ranks.UNSCALED}
    bug, why = check.explain(rec)
    assert bug == "B9" and why.startswith("B9 (deepspeedai/DeepSpeed#8393): FP16_UnfusedOptimizer divides")


def test_a_step_unscaled_by_a_grown_loss_scale_is_named_b10_and_a_tiny_step_is_named_within_its_reads_rounding():
    """B10: the scale the losses got over the one the step was unscaled by (old / new); the hypothesis exists only
    where the scale moved, and is named only on a dynamic fp16 scale. A step 1 / 65536 of the mean, read as the
    difference of two weight vectors each rounded, is named within that rounding (``floor``) and not without it."""
    w, n = 2, 4
    assert ds_ranks.SCALE_GREW not in ds_ranks.hypothesis_weights(w, n, loss_scale=512.0)
    hyp = ds_ranks.hypothesis_weights(w, n, loss_scale=1024.0, scale_change=0.5)
    assert hyp[ds_ranks.SCALE_GREW] == [0.5 / 8] * 8
    basis = _basis(w * n)
    h = naming.explain(torch.tensor(hyp[ds_ranks.SCALE_GREW], dtype=torch.float64) @ basis, basis, hyp, "fp16")
    assert naming.step_name(h) == ds_ranks.SCALE_GREW
    rec = {"config": {"loop": "engine", "ds_config": {"fp16": {"enabled": True, "loss_scale": 0}}},
           "versions": {"deepspeed": "0.19.8"}, "zero_stage": 2, "optimizer": "DeepSpeedZeroOptimizer", "ga": n,
           "matches": ds_ranks.SCALE_GREW}
    assert check.explain(rec)[0] == "B10"
    static = {**rec, "config": {**rec["config"], "ds_config": {"fp16": {"enabled": True, "loss_scale": 1024}}}}
    assert check.explain(static)[0] is None  # a static scale never moves: B10 is not a candidate there
    tiny = ds_ranks.hypothesis_weights(w, n, loss_scale=65536.0)
    step = torch.tensor(tiny[ds_ranks.UNSCALED], dtype=torch.float64) @ basis
    noisy = step + 0.02 * step.norm() * torch.randn(step.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) / step.numel() ** 0.5
    assert naming.step_name(naming.explain(noisy, basis, tiny, "fp16")) == "none"
    within = naming.explain(noisy, basis, tiny, "fp16", floor=0.05 * step.norm().item())
    assert naming.step_name(within) == ds_ranks.UNSCALED


def test_another_bugs_step_halved_by_a_grown_scale_is_named_by_that_bug_with_b10_beside_it():
    """B10 on top of B3 (the manual loop's last micro-batch, then x old / new) or B5 (offload's first and last): each
    named step exists grown where the scale moved, and the check names the bug that made the step, with B10 said
    beside it; without B10 a candidate (a static scale), or without the other bug, the step is no known bug's."""
    w, n = 2, 4
    hyp = ds_ranks.hypothesis_weights(w, n, loss_scale=1024.0, scale_change=0.5)
    assert not [h for h in ds_ranks.hypothesis_weights(w, n, loss_scale=1024.0) if h.endswith(naming.GROWN)]
    last = "last micro-batch / N" + naming.GROWN
    assert hyp[last] == [0.5 * x for x in hyp["last micro-batch / N"]] and naming.grown_base(last) == \
        "last micro-batch / N" and naming.grown_base(naming.SCALE_GREW) is None and naming.grown_base(7) is None
    one = ds_ranks.hypothesis_weights(w, 1, loss_scale=1024.0, scale_change=0.5)  # GA 1: the last is the mean
    assert not {"last micro-batch / N", "mean / N", "sum of micro-batches"} & {naming.grown_base(h) for h in one}
    b1 = _basis(w)
    grew = naming.explain(torch.tensor(one[naming.SCALE_GREW], dtype=torch.float64) @ b1, b1, one, "fp16")
    assert naming.step_name(grew) == naming.SCALE_GREW  # B10 alone at GA 1, not a tie with names of the same step
    basis = _basis(w * n)
    for name in (last, "first and last micro-batch" + naming.GROWN):
        h = naming.explain(torch.tensor(hyp[name], dtype=torch.float64) @ basis, basis, hyp, "fp16")
        assert naming.step_name(h) == name
    dynamic = {"fp16": {"enabled": True, "loss_scale": 0}}
    rec = {"config": {"loop": "manual", "ds_config": dynamic}, "versions": {"deepspeed": "0.18.6"}, "zero_stage": 2,
           "optimizer": "DeepSpeedZeroOptimizer", "ga": n, "matches": last}
    bug, why = check.explain(rec)
    assert bug == "B3" and "and B10 on this step" in why and why.startswith("B3 (allenai/open-instruct#1498)")
    off = {"offload_optimizer": {"device": "cpu"}}
    b5 = {**rec, "config": {"loop": "engine", "ds_config": {**dynamic, "zero_optimization": off}},
          "matches": "first and last micro-batch" + naming.GROWN}
    assert check.explain(b5)[0] == "B5"
    static = {**rec, "config": {**rec["config"], "ds_config": {"fp16": {"enabled": True, "loss_scale": 1024}}}}
    assert check.explain(static)[0] is None  # no growth on a static scale: B3's step would not be halved
    assert check.explain({**rec, "config": {**rec["config"], "loop": "engine"}})[0] is None  # no B3 in this loop
    assert check.explain({**rec, "matches": "mean / N" + naming.GROWN})[0] is None  # B3's candidates, not its step


def test_steps_no_single_weighting_gives_are_named_b11_with_the_previous_update_and_b8_per_partition():
    """B11: this step's micro-batches but each rank's first, plus the update the previous step applied; B8: each
    rank's partition of the flat vector (split as ZeRO-1/2 split it) the sum of that rank's own micro-batches / N.
    Neither is a weighting of the basis; each is named, and the bugs only where their configuration is."""
    w, n = 2, 4
    basis = _basis(2 * w * n)  # this step's micro-batches, then the previous step's
    update = torch.linspace(-1, 1, basis.shape[1], dtype=torch.float64)
    named = ds_ranks.hypothesis_weights(w, n, previous=True)
    hyp = {**named, **ds_ranks.stepwise_hypotheses(w, n, update, 2, named)}
    carried = torch.tensor([0.0 if i % n == 0 else 1 / 8 for i in range(8)], dtype=torch.float64) @ basis[:8] + update
    assert naming.step_name(naming.explain(carried, basis, hyp, "fp32")) == ds_ranks.CARRIED
    size, part = basis.shape[1], -(-basis.shape[1] // 4) * 2
    own = torch.cat([basis[:n, :part].sum(0) / n, basis[n:2 * n, part:].sum(0) / n])
    assert own.shape[0] == size and naming.step_name(naming.explain(own, basis, hyp, "fp32")) == ds_ranks.OWN_PARTITION
    # B3 on B8 (the manual loop, no all-reduce): each rank's partition its own last micro-batch / N
    last = torch.cat([basis[n - 1, :part] / n, basis[2 * n - 1, part:] / n])
    assert naming.step_name(naming.explain(last, basis, hyp, "fp32")) == "last micro-batch / N" + naming.LOCAL
    assert ds_ranks.CARRIED not in ds_ranks.stepwise_hypotheses(w, n, None, 2, named)  # the first step has none before
    assert ds_ranks.OWN_PARTITION not in ds_ranks.stepwise_hypotheses(w, n, None, 3, named)  # ZeRO-3 splits otherwise
    at1 = ds_ranks.hypothesis_weights(w, 1)
    assert "last micro-batch / N" + naming.LOCAL not in ds_ranks.stepwise_hypotheses(w, 1, None, 2, at1)  # the mean
    manual = {"config": {"loop": "manual", "ds_config": {"zero_optimization": {"stage": 2, "offload_optimizer": {
        "device": "cpu"}}}}, "versions": {"deepspeed": "0.19.8"}, "zero_stage": 2, "ga": n,
        "optimizer": "DeepSpeedZeroOptimizer", "matches": ds_ranks.CARRIED}
    assert check.explain(manual)[0] == "B11"
    assert check.explain({**manual, "versions": {"deepspeed": "0.18.6"}})[0] is None  # before #7981 the loop is B3's
    engine = {**manual, "config": {"loop": "engine", "ds_config": {"zero_optimization": {"stage": 2}}},
              "matches": "last micro-batch / N"}
    assert check.explain({**engine, "versions": {"deepspeed": "0.18.2"}})[0] == "B12"
    assert check.explain({**engine, "versions": {"deepspeed": "0.18.3"}})[0] is None
    b8 = {**engine, "config": {"loop": "engine", "ds_config": {"zero_optimization": {
        "stage": 1, "contiguous_gradients": False}}}, "matches": ds_ranks.OWN_PARTITION}
    assert check.explain({**b8, "versions": {"deepspeed": "0.19.7"}})[0] == "B8"
    assert check.explain({**b8, "versions": {"deepspeed": "0.19.8"}})[0] is None  # fixed there
    b3 = {**b8, "config": {**b8["config"], "loop": "manual"}, "matches": "last micro-batch / N" + naming.LOCAL,
          "versions": {"deepspeed": "0.19.7"}}
    bug, said = check.explain(b3)
    assert bug == "B3" and "and B8 on this step (no all-reduce" in said and "each expected here" not in said
    assert said.startswith(f"B3 ({expectations.KNOWN['B3'].report}): {expectations.KNOWN['B3'].explains[0]}; and B8")
    assert check.explain({**b3, "versions": {"deepspeed": "0.19.8"}})[0] is None  # no B8 there: not B3's own step
    # fp16 + an fp32 accumulator at ZeRO-1 without contiguous gradients: B8 and B13 each remake B3's step so
    both_top = {**b3, "dtype": "fp16", "config": {**b3["config"], "ds_config": {"data_types": {"grad_accum_dtype": "fp32"},
                "zero_optimization": {"stage": 1, "contiguous_gradients": False}}}, "versions": {"deepspeed": "0.19.6"},
                "zero_stage": 1}
    bug, said = check.explain(both_top)
    assert bug == "B3" and "and B8 or B13 on this step" in said and "each expected here" in said
    # B4 at GA 1: the boundary micro-batch is the only one, so no rank's reaches another's partition (B8's step)
    b4 = {**b8, "config": {"loop": "engine", "ds_config": {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}},
          "optimizer": "BF16_Optimizer", "ga": 1, "zero_stage": 1, "versions": {"deepspeed": "0.18.6"}}
    assert check.explain(b4)[0] == "B4"
    both = {**b4, "config": {**b4["config"], "ds_config": {**b4["config"]["ds_config"], "zero_optimization": {
        "stage": 1, "contiguous_gradients": False}}}}
    bug, why = check.explain(both)  # B4 and B8 both expected, both leave this step: a tie, said, never list order
    assert bug is None and why.startswith("not explained by one known bug: B4 and B8 are expected here"), why


def test_an_optimizers_own_loss_scale_is_read_from_its_property_or_its_older_attributes():
    from types import SimpleNamespace as NS

    assert ds_ranks.own_loss_scale(NS(loss_scale=256.0, cur_scale=2.0)) == 256.0  # the property first
    assert ds_ranks.own_loss_scale(NS(cur_scale=65536.0)) == 65536.0  # 0.18's attribute
    assert ds_ranks.own_loss_scale(NS(loss_scale_config=NS(cur_scale=128.0))) == 128.0  # 0.19's config
    assert ds_ranks.own_loss_scale(NS(loss_scale=None, cur_scale=64.0)) == 64.0  # not a number: the next one
    assert ds_ranks.own_loss_scale(None) == 1.0 and ds_ranks.own_loss_scale(NS()) == 1.0  # none: 1
    assert ds_ranks.own_loss_scale(NS(loss_scale=0.0)) == 1.0
