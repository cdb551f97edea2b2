"""The oracle's judgement of parameter groups, its words for a step and the logged norm, on hand-made vectors: what
a model some micro-batches do not use entirely shows (the mutation run found these judged only inside worlds)."""
import math

import pytest
import torch

from gradkit.judge import naming, oracle, parts, tolerances

# 2 ranks x 2 micro-batches (rank-major rows 0..3); 7 parameters: the trunk (0-3) every micro-batch reaches, the
# expert (4-6) only micro-batch 1 of each rank (rows 0 and 2) reaches
BASIS = torch.tensor([[1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0],
                      [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                      [0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0],
                      [0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
EXPECTED = torch.full((4,), 0.25, dtype=torch.float64)
TARGET = EXPECTED @ BASIS
GROUPS = {"trunk": torch.tensor([0, 1, 2, 3]), "expert": torch.tensor([4, 5, 6])}


def _judge(weights):
    return parts.judge_groups(torch.tensor(weights, dtype=torch.float64) @ BASIS, BASIS, EXPECTED, TARGET, GROUPS, 2, 2)


def test_an_exact_step_is_exact_in_every_group_and_says_which_micro_batches_reach_it():
    g = _judge([0.25] * 4)
    assert g["expert"]["reached"] == [0, 2] and g["trunk"]["reached"] == [0, 1, 2, 3]
    for name in GROUPS:
        assert g[name]["rel_err"] < 1e-12 and g[name]["lost"] is None and not g[name]["expected_zero"]
        assert g[name]["shape"] == "every micro-batch reaching it x1" and abs(g[name]["norm_ratio"] - 1) < 1e-12
    tiny = parts.judge_groups(TARGET * 1e-12, BASIS * 1e-12, EXPECTED, TARGET * 1e-12, GROUPS, 2, 2)
    assert tiny["expert"]["reached"] == [0, 2]  # reached is relative to the largest micro-batch, at any scale


def test_a_group_that_lost_a_micro_batch_on_every_rank_says_so():
    g = _judge([0.0, 0.25, 0.0, 0.25])  # micro-batch 1 dropped on both ranks
    assert g["expert"]["lost"] == "micro-batch 1 on every rank" and abs(g["expert"]["rel_err"] - 1.0) < 1e-12
    assert g["expert"]["shape"] == "every micro-batch reaching it x0"
    assert g["trunk"]["lost"] == "micro-batch 1 on every rank"
    one = _judge([0.0, 0.25, 0.25, 0.25])  # only rank 0's
    assert one["expert"]["lost"] == "rank 0 micro-batch 1"
    assert one["trunk"]["shape"] == "rank 0 micro-batch 1 x0, the others reaching it x1"
    assert one["expert"]["shape"] == "rank 1 micro-batch 1 x1, the others reaching it x0"  # a tie: the first is "the others"


def test_a_group_with_no_right_update_is_judged_against_the_whole_step():
    target = TARGET.clone()
    target[4:] = 0.0  # the expert's right update is 0 (frozen, or not reached in this step)
    eff = target.clone()
    eff[4] = 0.1 * target.norm()
    g = parts.judge_groups(eff, BASIS, EXPECTED, target, GROUPS, 2, 2)
    assert g["expert"]["expected_zero"] and abs(g["expert"]["rel_err"] - 0.1) < 1e-12 and g["expert"]["norm_ratio"] is None
    assert "attribution" not in g["expert"]


def test_the_previous_steps_micro_batches_and_positions_are_named():
    assert parts._positions([0, 2], 2, 2) == "micro-batch 1 on every rank"
    assert parts._positions([0, 1, 2, 3], 2, 2) == "micro-batches 1,2 on every rank"
    assert parts._positions([1, 5], 2, 2) == "rank 0 micro-batch 2, the previous step's rank 0 micro-batch 2"
    assert parts._positions([6], 2, 2) == "the previous step's rank 1 micro-batch 1"
    shape = parts._group_shape([0, 2, 4], [0.25, 0.25, 0.25], [0.25, 0.25, 0.0], 2, 2)
    assert shape == "every micro-batch reaching it x1; the previous step's micro-batches x1"
    assert parts._group_shape([0, 2, 4], [0.25, 0.25, 0.001], [0.25, 0.25, 0.0], 2, 2) == \
        "every micro-batch reaching it x1"  # a trace of the previous step under 0.05 of a share is not said


def _step(group, **whole):
    return {"metrics": {"rel_l2": 0.0, "norm_ratio": 1.0, "cosine": 1.0}, "groups": {"expert": group}, **whole}


def _group(rel_err=0.0, misplaced=0.0, uses=None, **kw):
    g = {"rel_err": rel_err, "expected_zero": False, "reached": [0, 2], "lost": None, "shape": "s",
         "attribution": {"misplaced_weight": misplaced, "rows": [0, 2], "weights": [0.25, 0.25],
                         "expected_weights": [0.25, 0.25], "residual": 0.0}, **kw}
    if uses is not None:
        g["uses"] = {"misplaced_weight": uses, "residual": 0.0, "shape": "embedding use x1, head use x0"}
    return g


@pytest.mark.parametrize("group, said", [
    (_group(rel_err=2e-4), "rel. error of expert"),
    (_group(misplaced=2e-4), "misplaced weight of expert"),
    (_group(uses=2e-4), "misplaced weight of expert over its uses"),
])
def test_a_group_alone_off_makes_the_step_affected_and_is_named(group, said):
    sigs = oracle.signals({**_step(group), "dtype": "fp32"})
    off = [s["signal"] for s in sigs if not s["ok"]]
    assert off == [said]
    assert oracle.verdict({**_step(group), "dtype": "fp32"}, {"metrics": _step(group)["metrics"], "dtype": "fp32"})[0] \
        == oracle.AFFECTED
    assert oracle.verdict({**_step(_group()), "dtype": "fp32"}, {"metrics": _step(group)["metrics"], "dtype": "fp32"})[0] \
        == oracle.NOT_AFFECTED


def test_parts_a_step_got_wrong_are_named_as_stale_or_lost():
    stale = _group(rel_err=0.5, expected_zero=True)
    assert parts.part_pattern(_step(stale), "fp32", 2, 2) == [parts.PART_STALE]
    old = _group(rel_err=0.5)
    old["attribution"].update(rows=[0, 2, 4], weights=[0.25, 0.25, 0.2], expected_weights=[0.25, 0.25, 0.0])
    assert parts.part_pattern(_step(old), "fp32", 2, 2) == [parts.PART_STALE]  # the previous step's, > half a share
    old["attribution"]["weights"] = [0.25, 0.25, 0.1]
    assert parts.part_pattern(_step(old), "fp32", 2, 2) == []  # under half a share
    lost = _group(rel_err=0.5, lost="micro-batch 1 on every rank")  # rows 0 and 2: no boundary (1, 3) reaches it
    assert parts.part_pattern(_step(lost), "fp32", 2, 2) == [parts.PART_LOST]
    lost["attribution"]["rows"] = [1, 3]  # the boundary micro-batches reach it: not this pattern
    assert parts.part_pattern(_step(lost), "fp32", 2, 2) == []
    assert parts.part_pattern(_step(_group(rel_err=0.9e-4, lost="x")), "fp32", 2, 2) == []  # within the limits


def test_a_whole_step_carrying_the_previous_steps_gradient_is_stale():
    step = {"metrics": {"rel_l2": 0.5, "norm_ratio": 1.5, "cosine": 0.9},
            "attribution": {"weights": [0.25] * 4 + [0.2, 0, 0, 0], "expected_weights": [0.25] * 4 + [0] * 4,
                            "misplaced_weight": 0.1}}
    assert parts.part_pattern(step, "fp32", 2, 2) == [parts.PART_STALE]
    step["attribution"]["weights"] = [0.25] * 4 + [0.1, 0, 0, 0]
    assert parts.part_pattern(step, "fp32", 2, 2) == []


def test_groups_off_says_what_each_wrong_group_did():
    said = parts.groups_off(_step(_group(rel_err=0.3, expected_zero=True)), "fp32")
    assert said == ["expert: updated by 0.3 of the step's norm where its right update is 0"]
    said = parts.groups_off(_step(_group(rel_err=1.0, lost="micro-batch 1 on every rank", shape="x0")), "fp32")
    assert said == ["expert: the gradient from micro-batch 1 on every rank was lost (x0)"]
    said = parts.groups_off(_step(_group(rel_err=0.5, uses=0.5)), "fp32")
    assert said == ["expert: its gradient is embedding use x1, head use x0 (each use's right weight: 1)"]
    assert parts.groups_off(_step(_group(rel_err=0.5e-4)), "fp32") == []  # within the limits: nothing to say
    whole = {"attribution": {"weights": [0.25, 9.0, 0.25, 9.0], "residual": 0.0}}
    assert parts.groups_off(_step(_group(rel_err=0.5), **whole), "fp32") == []  # the whole step's fit explains it
    whole["attribution"]["residual"] = 0.5
    assert parts.groups_off(_step(_group(rel_err=0.5), **whole), "fp32") == ["expert: s (rel. error 0.5)"]


@pytest.mark.parametrize("logged, word", [(None, "n/a"), (math.inf, oracle.AFFECTED), (math.nan, oracle.AFFECTED),
                                          (10.0009, oracle.NOT_AFFECTED), (10.0011, oracle.AFFECTED),
                                          (9.9989, oracle.AFFECTED)])
def test_the_logged_norm_has_a_verdict_of_its_own(logged, word):
    got, why = oracle.norm_verdict(logged, 10.0, "fp32")
    assert got == word, why
    if word == oracle.NOT_AFFECTED:
        assert "within the fp32 limit" in why
    elif logged is not None and math.isfinite(logged):
        assert "outside the fp32 limit" in why


def test_the_verdict_names_the_worst_step_and_the_rounding_of_each_dtype():
    m = {"metrics": {"rel_l2": 0.5, "norm_ratio": 0.5, "cosine": 1.0}, "dtype": "fp32", "steps": [{}, {}],
         "worst_step": 1}
    assert "at step 2 (the worst of 2)" in oracle.verdict(m, {"metrics": {"rel_l2": 0, "norm_ratio": 1, "cosine": 1},
                                                             "dtype": "fp32"})[1]
    assert tolerances.ROUNDING == {"fp32": 2.0 ** -23, "bf16": 2.0 ** -8, "fp16": 2.0 ** -10}  # the formats' unit steps


def test_comparison_and_fit_of_small_vectors_and_non_finite_steps():
    small = torch.tensor([0.3, 0.4], dtype=torch.float64)  # norm 0.5: under 1, still a direction
    m = oracle.compare(small, small * 2)
    assert abs(m["cosine"] - 1.0) < 1e-12 and abs(m["norm_ratio"] - 0.5) < 1e-12
    assert oracle.compare(torch.zeros(2, dtype=torch.float64), small)["cosine"] == 0.0
    a = oracle.attribute(small * 2, small.unsqueeze(0), torch.tensor([1.0], dtype=torch.float64))
    assert abs(a["weight_sum_ratio"] - 2.0) < 1e-12 and abs(a["misplaced_weight"] - 0.5) < 1e-12
    a = oracle.attribute(small * 2, small.unsqueeze(0), torch.tensor([4.0], dtype=torch.float64))
    assert abs(a["weight_sum_ratio"] - 0.5) < 1e-12
    m = oracle.compare(torch.tensor([1.0, 3.0], dtype=torch.float64), torch.tensor([2.0, 4.0], dtype=torch.float64))
    assert abs(m["max_rel_err"] - 0.25) < 1e-12  # max |e - r| / max |r|
    bad = oracle.attribute(torch.tensor([math.nan, 1.0, math.inf]), torch.eye(3, dtype=torch.float64),
                           torch.ones(3, dtype=torch.float64))
    assert bad["non_finite"] == 2 and bad["misplaced_weight"] == math.inf


def test_clipping_coefficient_is_the_engines_on_any_norm():
    v = torch.tensor([1.5e-6, 0.0], dtype=torch.float64)  # the 1e-6 in clip / (norm + 1e-6) matters here
    assert abs(oracle.clipped(v, 1e-6).norm().item() - 1.5e-6 * 1e-6 / 2.5e-6) < 1e-18
    assert torch.equal(oracle.clipped(v, 0.0), v)
    assert torch.equal(oracle.clipped(v, 1.0), v)  # a coefficient above 1 is 1


def test_the_step_in_words_names_the_previous_steps_share():
    cur = [0.25] * 4
    right = [0.25] * 4 + [0.0] * 4
    assert naming.describe_weights(cur + [0.25] * 4, right, 2, 2) == \
        "every micro-batch x1; the previous step's micro-batches x1"
    assert naming.describe_weights(cur + [0.25, 0.0, 0.0, 0.0], right, 2, 2) == \
        "every micro-batch x1; the previous step's micro-batches 1, 0, 0, 0 (x their share)"
    assert naming.describe_weights(cur + [0.01] * 4, right, 2, 2) == "every micro-batch x1"  # under 0.05 of a share


def _rec(steps, **kw):
    return {"dtype": "fp32", "world_size": 2, "ga": 2, "steps": steps, "worst_step": kw.pop("worst_step", 0), **kw}


def test_a_record_takes_its_worst_steps_words_and_names_parts_where_no_whole_step_name_fits():
    stale = {"metrics": {"rel_l2": 0.5, "norm_ratio": 1.5, "cosine": 0.9}, "groups": {"expert": _group(
        rel_err=0.3, expected_zero=True)}, "hypotheses": {"best": "x", "best_matches": False, "ambiguous": []}}
    exact = {"metrics": {"rel_l2": 0.0, "norm_ratio": 1.0, "cosine": 1.0},
             "hypotheses": {"best": "global mean", "best_matches": True, "ambiguous": []}}
    rec = naming.annotate_steps(_rec([exact, stale], worst_step=1, judge_dtype="fp32"))
    assert rec["matches"] == parts.PART_STALE and rec["parts"] == [parts.PART_STALE]
    assert rec["steps"][0]["matches"] == "global mean"
    assert "expert: updated by 0.3 of the step's norm" in rec["shape"]
    tie = {"metrics": {"rel_l2": 0.0, "norm_ratio": 1.0, "cosine": 1.0},
           "hypotheses": {"best": "global mean", "best_matches": True, "ambiguous": ["global mean", "last / N"]}}
    assert naming.annotate_steps(_rec([tie]))["matches"] == "global mean"  # exact on every signal: the mean
    off_tie = {**tie, "metrics": {"rel_l2": 0.5, "norm_ratio": 0.5, "cosine": 1.0}}
    assert naming.annotate_steps(_rec([off_tie]))["matches"] == "ambiguous between 'global mean' and 'last / N'"


def test_the_logged_norm_verdict_of_a_record_is_its_first_off_step():
    steps = [{"step": 0, "reference_norm": 10.0, "logged_norm": 10.0},
             {"step": 1, "reference_norm": 10.0, "logged_norm": 20.0}]
    rec = naming.annotate_norms(_rec(steps))
    assert rec["norm_verdict"] == oracle.AFFECTED and rec["norm_reason"].startswith("step 2: the logged grad norm 20")
    rec = naming.annotate_norms(_rec([steps[0]]))
    assert rec["norm_verdict"] == oracle.NOT_AFFECTED and rec["norm_reason"].startswith("step 1: ")
    rec = naming.annotate_norms(_rec([{"step": 0, "reference_norm": 10.0}]))  # the engine keeps no norm
    assert rec["norm_verdict"] == "n/a"



def test_positions_at_the_edge_of_the_previous_step_and_on_one_rank():
    assert parts._positions([4], 2, 2) == "the previous step's rank 0 micro-batch 1"  # row k: the previous step's first
    assert parts._positions([3, 4], 2, 2) == "rank 1 micro-batch 2, the previous step's rank 0 micro-batch 1"
    assert parts._positions([0], 1, 2) == "rank 0 micro-batch 1"  # one rank: never "on every rank"
    assert parts._positions([7], 2, 2) == "the previous step's rank 1 micro-batch 2"


def test_a_tied_weights_uses_are_fitted_and_said():
    basis = torch.eye(3, dtype=torch.float64)
    uses = {"tied": {"embedding use": torch.tensor([1.0, 0, 0], dtype=torch.float64),
                     "head use": torch.tensor([0, 1.0, 0], dtype=torch.float64)}}
    eff = torch.tensor([1.0, 0.25, 0.0], dtype=torch.float64)  # the head's use a quarter of its right weight
    g = parts.judge_groups(eff, basis, torch.ones(3, dtype=torch.float64) / 3, torch.tensor([1.0, 1.0, 0.0],
                            dtype=torch.float64), {"tied": torch.tensor([0, 1, 2])}, 1, 3, uses)
    assert g["tied"]["uses"]["shape"] == "embedding use x1, head use x0.2"
    assert abs(g["tied"]["uses"]["misplaced_weight"] - 0.375) < 1e-12


def test_a_short_candidate_is_padded_with_zeros_and_a_zero_candidate_predicts_nothing():
    basis = torch.eye(3, dtype=torch.float64)
    eff = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    h = naming.explain(eff, basis, {"first": [1.0], "all": [1.0, 1.0, 1.0], "none": [0.0, 0.0, 0.0]}, "fp32")
    assert h["best"] == "first" and h["best_matches"] and h["ambiguous"] == [] and "none" not in h["candidates"]


def test_the_spread_is_measured_from_rank_0_whatever_the_order_and_a_zero_first_rank_is_infinite_spread():
    v = torch.tensor([1.0, 2.0], dtype=torch.float64)
    assert abs(oracle.spread([v, v * 1.02, v * 1.01]) - 0.02) < 1e-12  # from rank 0, not from the last rank
    assert oracle.spread([torch.zeros(2, dtype=torch.float64), v]) > 1e100


def test_a_signal_at_its_limit_is_within_it_and_a_non_finite_cosine_is_off():
    at = {"metrics": {"rel_l2": 1e-4, "norm_ratio": 1.0, "cosine": 1.0}, "dtype": "fp32"}
    assert all(s["ok"] for s in oracle.signals(at))
    nan = {"metrics": {"rel_l2": 0.0, "norm_ratio": 1.0, "cosine": math.nan}, "dtype": "fp32"}
    assert [s["signal"] for s in oracle.signals(nan) if not s["ok"]] == ["cosine"]


def test_the_step_in_words_where_a_micro_batch_has_no_right_weight_and_the_previous_steps_tenths():
    # rank 1's micro-batch 2 has no right weight (e.g. a frozen part): its weight is said as a share of the step
    assert naming.describe_weights([0.25, 0.25, 0.25, 0.0], [0.25, 0.25, 0.25, 0.0], 2, 2) == \
        "rank 0: every micro-batch x1; rank 1: micro-batch 2 x0, the others x1"
    assert naming.describe_weights([0.25] * 4 + [0.03] * 4, [0.25] * 4 + [0.0] * 4, 2, 2) == \
        "every micro-batch x1; the previous step's micro-batches x0.1"


def test_every_group_is_looked_at_not_only_the_first():
    fine, off = _group(rel_err=0.5e-4), _group(rel_err=0.5, expected_zero=True)
    two = {"metrics": {"rel_l2": 0.0, "norm_ratio": 1.0, "cosine": 1.0}, "groups": {"a": fine, "b": off}}
    assert parts.part_pattern(two, "fp32", 2, 2) == [parts.PART_STALE]
    assert parts.groups_off(two, "fp32") == ["b: updated by 0.5 of the step's norm where its right update is 0"]
    whole = {"attribution": {"weights": [0.25, 9.0, 0.25, 9.0], "residual": 0.0}}  # explains group a, not b
    other = _group(rel_err=0.5, expected_zero=True)
    other["attribution"]["weights"] = [0.5, 0.5]  # not the whole step's weights
    three = {**two, **whole, "groups": {"a": _group(rel_err=0.5), "b": other}}
    assert parts.groups_off(three, "fp32") == ["b: updated by 0.5 of the step's norm where its right update is 0"]


def test_a_record_without_a_worst_step_takes_its_first_and_keeps_a_matching_names_and_ties():
    named = {"metrics": {"rel_l2": 0.5, "norm_ratio": 0.5, "cosine": 1.0}, "groups": {"expert": _group(
        rel_err=0.3, expected_zero=True)}, "hypotheses": {"best": "sum (x GA)", "best_matches": True,
                                                          "ambiguous": ["sum (x GA)", "other"]}}
    rec = naming.annotate_steps({"dtype": "fp32", "world_size": 2, "ga": 2, "steps": [named, {
        "metrics": {"rel_l2": 0.0, "norm_ratio": 1.0, "cosine": 1.0}}]})
    assert rec["matches"] == "ambiguous between 'sum (x GA)' and 'other'" and rec["ties"] == ["sum (x GA)", "other"]
    named["hypotheses"]["ambiguous"] = []
    rec = naming.annotate_steps({"dtype": "fp32", "world_size": 2, "ga": 2, "steps": [named]})
    assert rec["matches"] == "sum (x GA)"  # a name that fits is kept, the parts are said beside it
    assert rec["parts"] == [parts.PART_STALE]
    ctrl = {"metrics": {"rel_l2": 0, "norm_ratio": 1, "cosine": 1}, "dtype": "fp32"}
    one = {"metrics": {"rel_l2": 0.5, "norm_ratio": 0.5, "cosine": 1.0}, "dtype": "fp32", "steps": [{}]}
    assert " at step " not in oracle.verdict(one, ctrl)[1]  # one step: no "worst of"
    two = {**one, "steps": [{}, {}]}  # no worst_step recorded: the first
    assert "at step 1 (the worst of 2)" in oracle.verdict(two, ctrl)[1]


# ---- the third mutation run's survivors: each pins the behaviour a surviving mutant changed

def test_a_weight_with_no_right_one_is_said_as_a_share_to_a_tenth_and_never_as_minus_zero():
    # rows 0-2 of one rank of 3 micro-batches, row 0 has no right weight (x = 0): said as w * k, to a tenth
    third = 1 / 3
    assert parts._group_shape([0, 1, 2], [-0.001, third, third], [0.0, third, third], 1, 3) == \
        "rank 0 micro-batch 1 x0, the others reaching it x1"
    assert parts._group_shape([0, 1, 2], [0.25 / 3, third, third], [0.0, third, third], 1, 3) == \
        "rank 0 micro-batch 1 x0.2, the others reaching it x1"  # 0.25 to a tenth
    assert parts._group_shape([0, 1, 2], [third / 2, third, third], [third, third, third], 1, 3) == \
        "rank 0 micro-batch 1 x0.5, the others reaching it x1"
    assert parts._group_shape([0, 1, 2], [0.5, 0.5, 0.165], [0.5, 0.5, 0.0], 1, 2) == \
        "every micro-batch reaching it x1; the previous step's micro-batches x0.3"  # 0.33 to a tenth
    assert naming.describe_weights([0.5, 0.25], [0.5, 0.0], 1, 2) == "micro-batch 2 x0.5, the others x1"
    assert naming.describe_weights([0.5, -0.001], [0.5, 0.0], 1, 2) == "micro-batch 2 x0, the others x1"


def test_one_micro_batch_on_one_rank_names_the_previous_steps_share():
    assert naming.describe_weights([1.0, 0.5], [1.0, 0.0], 1, 1) == \
        "every micro-batch x1; the previous step's micro-batches x0.5"


def test_rows_past_the_previous_step_are_not_the_previous_steps():
    # k = 2: rows 2-3 are the previous step's micro-batches; a basis longer than that says nothing more of them
    assert naming.describe_weights([0.5, 0.5, 0.0, 0.0, 0.7, 0.7], [0.5, 0.5, 0, 0, 0, 0], 1, 2) == "every micro-batch x1"


def test_a_lost_part_is_named_only_where_no_boundary_micro_batch_of_any_rank_reaches_it():
    def step(rows):
        g = _group(rel_err=0.5, lost="x")
        g["attribution"]["rows"] = rows
        return {"metrics": {"rel_l2": 0.5, "norm_ratio": 0.5, "cosine": 1.0}, "groups": {"expert": g}}

    assert parts.part_pattern(step([0, 1]), "fp32", 1, 2) == []  # row 1: the boundary of one rank of 2
    assert parts.part_pattern(step([0]), "fp32", 1, 2) == [parts.PART_LOST]
    assert parts.part_pattern(step([2, 3]), "fp32", 2, 2) == []  # row 3: rank 1's boundary
    rec = {"dtype": "fp32", "world_size": 2, "ga": 2, "steps": [step([2, 3])]}
    assert naming.annotate_steps(rec)["parts"] == []  # the record's own world size and GA are used
    rec = {"dtype": "fp32", "world_size": 1, "ga": 2, "steps": [step([0])]}
    assert naming.annotate_steps(rec)["parts"] == [parts.PART_LOST]
    rec = {"dtype": "fp32", "world_size": 2, "ga": 2, "steps": [step([1])]}  # rank 0's boundary, with 2 ranks
    assert naming.annotate_steps(rec)["parts"] == []


def test_signals_exactly_at_a_limit_are_within_it():
    tol = tolerances.tolerance("fp32")
    at_rel = {"rel_err": tol.rel_l2, "expected_zero": True, "attribution": {"misplaced_weight": 0.0, "rows": []}}
    assert parts.part_pattern({"groups": {"g": at_rel}}, "fp32", 1, 2) == []
    at_mis = _group(rel_err=0.0, misplaced=tol.misplaced_weight)
    assert parts.groups_off({"groups": {"g": at_mis}}, "fp32") == []
    uses_at = _group(rel_err=0.5, uses=tol.misplaced_weight, expected_zero=True)
    assert parts.groups_off({"groups": {"g": uses_at}}, "fp32") == [
        "g: updated by 0.5 of the step's norm where its right update is 0"]  # the uses are within their limit
    uses_edge = _group(rel_err=0.5, uses=0.5, expected_zero=True)
    uses_edge["uses"]["residual"] = 0.05  # a fit of the uses with this residual does not explain the group
    assert parts.groups_off({"groups": {"g": uses_edge}}, "fp32")[0].startswith("g: updated by 0.5")
    k = 2
    whole = {"metrics": {"rel_l2": 0.5, "norm_ratio": 0.5, "cosine": 1.0},
             "attribution": {"weights": [0.5, 0.5, 0.5 / k, 0.5 / k], "misplaced_weight": 0.5}}
    assert parts.part_pattern(whole, "fp32", 1, k) == []  # exactly half a share: not more than half
    whole["attribution"]["weights"][2] = 0.26
    assert parts.part_pattern(whole, "fp32", 1, k) == [parts.PART_STALE]


def test_a_group_judged_against_a_zero_step_does_not_divide_by_zero():
    basis = torch.eye(2, dtype=torch.float64)
    g = parts.judge_groups(torch.tensor([1.0, 0.0], dtype=torch.float64), basis, torch.zeros(2, dtype=torch.float64),
                            torch.zeros(2, dtype=torch.float64), {"all": torch.tensor([0, 1])}, 1, 2)
    assert g["all"]["expected_zero"] and g["all"]["rel_err"] > 1e100


def test_the_spread_of_three_ranks_is_from_rank_0_when_the_others_differ_from_each_other():
    v = torch.tensor([1.0, 2.0], dtype=torch.float64)
    assert abs(oracle.spread([v, v * 1.01, v * 0.99]) - 0.01) < 1e-12  # from rank 1 it would read 0.02


def test_a_read_floor_doubles_into_the_limits_and_a_nan_cosine_is_said_against_1():
    sigs = oracle.signals({"metrics": {"rel_l2": 0.0, "norm_ratio": 1.0, "cosine": 1.0}, "dtype": "fp32",
                           "read_floor": 0.01})
    assert {s["signal"]: s["limit"] for s in sigs}["rel. error"] == 0.02
    word, why = oracle.verdict({"metrics": {"rel_l2": 0.0, "norm_ratio": 1.0, "cosine": math.nan}, "dtype": "fp32"},
                               {"metrics": {"rel_l2": 0.0, "norm_ratio": 1.0, "cosine": 1.0}, "dtype": "fp32"})
    assert word == oracle.AFFECTED and "cosine nan > 1 (fp32)" in why


def test_the_logged_norm_of_a_step_without_an_index_is_step_1_and_the_first_off_step_is_named():
    rec = naming.annotate_norms(_rec([{"reference_norm": 10.0, "logged_norm": 10.0}]))
    assert rec["norm_reason"].startswith("step 1: ")
    steps = [{"step": s, "reference_norm": 10.0, "logged_norm": 20.0 + s} for s in range(3)]
    assert naming.annotate_norms(_rec(steps))["norm_reason"].startswith("step 1: the logged grad norm 20 ")


def test_the_reference_of_a_model_with_a_part_a_micro_batch_does_not_reach_is_zero_there():
    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)

        def forward(self, x):
            return self.used(x)

    torch.manual_seed(0)
    m = TwoHeads()
    batches = [(torch.randn(3, 2), torch.randn(3, 2)) for _ in range(2)]
    basis, weights, reference = oracle.reference_gradients(m, batches, lambda o, y: ((o - y) ** 2).mean())
    assert basis.shape == (2, 12) and weights.tolist() == [0.5, 0.5]
    assert basis[:, 6:].abs().sum().item() == 0.0 and basis[:, :6].abs().sum().item() > 0


def test_the_fits_residual_is_relative_to_the_fitted_vector_at_any_scale():
    basis = torch.tensor([[0.0, 1.0, 0.0]], dtype=torch.float64)
    for scale in (1e-2, 1.0, 1e2):
        a = oracle.attribute(torch.tensor([scale, 0.0, 0.0], dtype=torch.float64), basis, [1.0])
        assert abs(a["residual"] - 1.0) < 1e-12, scale  # nothing of it is in the basis


def test_a_micro_batch_every_one_of_three_ranks_has_is_said_once():
    assert parts._positions([0, 2, 4], 3, 2) == "micro-batch 1 on every rank"
    assert parts._positions([0, 2], 3, 2) == "rank 0 micro-batch 1, rank 1 micro-batch 1"


def _bf16_rec(step, **kw):
    return {"dtype": "bf16", "world_size": 2, "ga": 2, "steps": [step], "worst_step": 0, **kw}


def test_a_record_without_a_judge_dtype_is_judged_at_its_own_dtypes_limits():
    tie = {"metrics": {"rel_l2": 0.01, "norm_ratio": 1.01, "cosine": 1.0},
           "hypotheses": {"best": "global mean", "best_matches": True, "ambiguous": ["global mean", "last / N"]}}
    assert naming.annotate_steps(_bf16_rec(tie))["matches"] == "global mean"  # within bf16's limits
    assert naming.annotate_steps(_bf16_rec(tie, dtype="fp32"))["matches"].startswith("ambiguous")
    group = {"metrics": {"rel_l2": 0.0, "norm_ratio": 1.0, "cosine": 1.0}, "groups": {"g": _group(rel_err=0.01)}}
    assert naming.annotate_steps(_bf16_rec(group))["shape"] is None  # within bf16's limits: nothing said
    assert "g: s (rel. error 0.01)" in naming.annotate_steps(_bf16_rec(group, dtype="fp32"))["shape"]
    norm = {"step": 0, "reference_norm": 10.0, "logged_norm": 10.1}
    assert naming.annotate_norms(_bf16_rec(norm))["norm_verdict"] == oracle.NOT_AFFECTED
    assert naming.annotate_norms(_bf16_rec(norm, dtype="fp32"))["norm_verdict"] == oracle.AFFECTED


def test_a_whole_step_is_stale_from_just_past_its_limits_and_a_tie_is_the_mean_only_within_them():
    k = 2
    step = {"metrics": {"rel_l2": 1.5e-4, "norm_ratio": 1.0, "cosine": 1.0},  # 1.5x the fp32 limit
            "attribution": {"weights": [0.5, 0.5, 0.3, 0.0], "misplaced_weight": 0.0}}
    assert parts.part_pattern(step, "fp32", 1, k) == [parts.PART_STALE]
    tie = {"metrics": {"rel_l2": 1.5e-4, "norm_ratio": 1.0, "cosine": 1.0},
           "hypotheses": {"best": "global mean", "best_matches": True, "ambiguous": ["global mean", "last / N"]}}
    assert naming._named(tie, "fp32") == "ambiguous between 'global mean' and 'last / N'"


def test_the_reference_takes_token_targets_as_they_are():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5))
    batches = [(torch.tensor([1, 2]), torch.tensor([3, 4])), (torch.tensor([0, 4]), torch.tensor([2, 2]))]
    basis, weights, ref = oracle.reference_gradients(model, batches, torch.nn.functional.cross_entropy)
    assert basis.shape[0] == 2 and torch.isfinite(ref).all() and ref.abs().sum() > 0


def test_a_group_whose_right_update_is_tiny_against_the_whole_step_has_none():
    basis = torch.eye(2, dtype=torch.float64)
    target = torch.tensor([100.0, 1e-8], dtype=torch.float64)  # 1e-10 of the whole step's norm
    g = parts.judge_groups(target, basis, torch.ones(2, dtype=torch.float64), target,
                            {"big": torch.tensor([0]), "tiny": torch.tensor([1])}, 1, 2)
    assert g["tiny"]["expected_zero"] and not g["big"]["expected_zero"]


def test_a_previous_steps_micro_batch_is_never_lost_and_a_uses_weight_is_never_minus_zero():
    basis = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)  # row 1: the previous step's (k = 1)
    eff = basis[0] - 0.1 * basis[1]
    g = parts.judge_groups(eff, basis, torch.tensor([1.0, 0.0], dtype=torch.float64), basis[0],
                            {"all": torch.tensor([0, 1])}, 1, 1)
    assert g["all"]["lost"] is None
    uses = {"all": {"first": torch.tensor([1.0, 0.0], dtype=torch.float64),
                    "second": torch.tensor([0.0, 1.0], dtype=torch.float64)}}
    g = parts.judge_groups(torch.tensor([1.0, -0.001], dtype=torch.float64), torch.eye(2, dtype=torch.float64),
                            torch.ones(2, dtype=torch.float64) / 2, torch.tensor([1.0, 1.0], dtype=torch.float64),
                            {"all": torch.tensor([0, 1])}, 1, 2, uses)
    assert g["all"]["uses"]["shape"] == "first x1, second x0"


def test_a_stepless_record_is_named_at_its_own_dtypes_limits():
    rec = {"dtype": "bf16", "metrics": {"rel_l2": 0.01, "norm_ratio": 1.01, "cosine": 1.0},
           "hypotheses": {"best": "global mean", "best_matches": True, "ambiguous": ["global mean", "last / N"]}}
    assert naming.annotate_steps(rec)["matches"] == "global mean"
    assert rec["ties"] == ["global mean", "last / N"]  # what it could not tell apart, kept
    assert naming.annotate_steps({"dtype": "fp32", "metrics": rec["metrics"]})["ties"] == []


def test_a_groups_previous_step_weight_of_exactly_half_a_share_is_not_stale():
    k = 2
    g = _group(rel_err=0.5)
    g["attribution"].update(rows=[0, k], weights=[0.25, 0.5 / k])
    assert parts.part_pattern({"groups": {"g": g}}, "fp32", 1, k) == []
    g["attribution"]["weights"] = [0.25, 0.26]
    assert parts.part_pattern({"groups": {"g": g}}, "fp32", 1, k) == [parts.PART_STALE]


def test_two_micro_batches_off_alike_are_said_together_in_the_plural():
    w = [0.0, 0.0, 0.2, 0.2, 0.2]
    assert naming.describe_weights(w, [0.2] * 5, 1, 5) == "micro-batches 1,2 x0, the others x1"
    assert naming.describe_weights([0.0, 0.2, 0.2], [0.2] * 3, 1, 3) == "micro-batch 1 x0, the others x1"


def test_a_micro_batch_reaches_a_group_only_above_a_billionth_of_the_largest():
    basis = torch.tensor([[1.0, 0.0], [1e-9, 0.0], [0.0, 1.0]], dtype=torch.float64)  # row 1: exactly 1e-9 of row 0
    g = parts.judge_groups(torch.tensor([1.0, 1.0], dtype=torch.float64), basis, torch.ones(3, dtype=torch.float64),
                            torch.tensor([1.0, 1.0], dtype=torch.float64), {"first": torch.tensor([0])}, 1, 3)
    assert g["first"]["reached"] == [0]


def test_a_group_the_whole_steps_fit_explains_to_a_tenth_of_its_right_weight_is_not_said_again():
    whole = {"attribution": {"weights": [0.5], "residual": 0.0}}
    g = _group(rel_err=0.5)
    g["attribution"].update(rows=[0], weights=[0.75], expected_weights=[2.5])  # 0.25 off: exactly a tenth of 2.5
    assert parts.groups_off({**whole, "groups": {"g": g}}, "fp32") == []
    g["attribution"]["weights"] = [0.76]
    assert parts.groups_off({**whole, "groups": {"g": g}}, "fp32") == ["g: s (rel. error 0.5)"]


def test_a_tiny_negative_share_is_zero_and_exactly_at_a_limit_is_within_it():
    third = 1 / 3
    assert parts._group_shape([0, 1, 2], [-0.001, third, third], [third] * 3, 1, 3) == \
        "rank 0 micro-batch 1 x0, the others reaching it x1"
    at = {"metrics": {"rel_l2": 1e-4, "norm_ratio": 1.0, "cosine": 1.0},  # severity exactly 1: within
          "attribution": {"weights": [0.5, 0.5, 0.3, 0.0], "misplaced_weight": 0.0}}
    assert parts.part_pattern(at, "fp32", 1, 2) == []
    assert parts.groups_off({"groups": {"g": _group(rel_err=1e-4)}}, "fp32") == []
    tie = {"metrics": {"rel_l2": 1e-4, "norm_ratio": 1.0, "cosine": 1.0},
           "hypotheses": {"best": "global mean", "best_matches": True, "ambiguous": ["global mean", "last / N"]}}
    assert naming._named(tie, "fp32") == "global mean"


def test_a_micro_batch_at_exactly_half_its_right_weight_is_not_lost_and_no_share_reads_minus_zero():
    g = parts.judge_groups(torch.tensor([0.25, 0.5], dtype=torch.float64), torch.eye(2, dtype=torch.float64),
                            torch.tensor([0.5, 0.5], dtype=torch.float64), torch.tensor([0.5, 0.5], dtype=torch.float64),
                            {"all": torch.tensor([0, 1])}, 1, 2)
    assert g["all"]["lost"] is None
    g = parts.judge_groups(torch.tensor([0.2, 0.5], dtype=torch.float64), torch.eye(2, dtype=torch.float64),
                            torch.tensor([0.5, 0.5], dtype=torch.float64), torch.tensor([0.5, 0.5], dtype=torch.float64),
                            {"all": torch.tensor([0, 1])}, 1, 2)
    assert g["all"]["lost"] == "rank 0 micro-batch 1"
    assert parts._group_shape([0, 1, 2, 3], [0.5, 0.5, 0.2, -0.001], [0.5, 0.5, 0.0, 0.0], 1, 2) == \
        "every micro-batch reaching it x1; the previous step's micro-batches x0.4, 0"
    third = 1 / 3
    assert naming.describe_weights([-0.001, third, third], [third] * 3, 1, 3) == "micro-batch 1 x0, the others x1"
    assert naming.describe_weights([third, third, third / 2], [third] * 3, 1, 3) == "micro-batch 3 x0.5, the others x1"
    assert naming.describe_weights([0.5, 0.5, 0.2, -0.001], [0.5, 0.5, 0, 0], 1, 2) == \
        "every micro-batch x1; the previous step's micro-batches 0.4, 0 (x their share)"


def test_the_edges_of_a_groups_judgement():
    # a right update exactly a billionth of the whole step's is none
    target = torch.tensor([1.0, 1e-9], dtype=torch.float64)
    g = parts.judge_groups(target, torch.eye(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64), target,
                            {"b": torch.tensor([1])}, 1, 2)
    assert g["b"]["expected_zero"]
    # a misplaced weight exactly at its limit, or a group with no fit at all, is within it
    tol = tolerances.tolerance("fp32")
    at = {"rel_err": 0.0, "expected_zero": True, "attribution": {"misplaced_weight": tol.misplaced_weight, "rows": []}}
    assert parts.part_pattern({"groups": {"g": at}}, "fp32", 1, 2) == []
    bare = {"rel_err": 0.0, "expected_zero": True}
    assert parts.part_pattern({"groups": {"g": bare}}, "fp32", 1, 2) == []
    # a whole step within its limits is never stale, whatever its fit says
    within = {"metrics": {"rel_l2": 0.5e-4, "norm_ratio": 1.0, "cosine": 1.0},
              "attribution": {"weights": [0.5, 0.5, 0.3, 0.0], "misplaced_weight": 0.0}}
    assert parts.part_pattern(within, "fp32", 1, 2) == []
    # a whole-step fit with a residual of exactly 0.05 does not explain a group
    whole = {"attribution": {"weights": [0.75], "residual": 0.05}}
    g = _group(rel_err=0.5)
    g["attribution"].update(rows=[0], weights=[0.75], expected_weights=[2.5])
    assert parts.groups_off({**whole, "groups": {"g": g}}, "fp32") == ["g: s (rel. error 0.5)"]
    # shares to a tenth, never a hundredth
    third = 1 / 3
    assert parts._group_shape([0, 1, 2], [0.33 * third, third, third], [third] * 3, 1, 3) == \
        "rank 0 micro-batch 1 x0.3, the others reaching it x1"
    assert naming.describe_weights([0.33 * third, third, third], [third] * 3, 1, 3) == "micro-batch 1 x0.3, the others x1"
    assert naming.describe_weights([0.11, third, third], [0.0, third, third], 1, 3) == "micro-batch 1 x0.3, the others x1"


# the manual loop of a ZeRO-2 + offload config at clip 1 (measured, 0.19.8): the engine's gradient of norm 2.55 was
# scaled by 1 / 2.55, the reference's of norm 1.85 by 0.541; the fitted weights over the expected ones read 0.72 for
# each micro-batch and 0.049 for the previous step's, i.e. x1 and a whole share again before the clip
def _clipped_step(logged=2.5509, coef=0.5409, applied=1.0, prev=0.049):
    engine = 1.0 / logged
    w = [0.0, 0.125 * engine, 0.125 * engine, 0.125 * engine] * 2 + [0.0, prev, prev, prev] * 2
    return {"metrics": {"rel_l2": 0.4, "norm_ratio": 1.0, "cosine": 0.7, "effective_norm": applied},
            "logged_norm": logged, "clip_coef": coef, "reference_norm": 1.85,
            "attribution": {"weights": w, "expected_weights": [0.125 * coef] * 8 + [0.0] * 8, "misplaced_weight": 0.3,
                            "residual": 0.0}}


def test_a_clipped_steps_weights_are_read_as_they_were_before_the_clip():
    step = _clipped_step()
    before = parts.unclipped(step, 1.0, "fp32", 2, 4)
    assert before is not step and abs(before["unclipped_by"] - 1 / 2.5509) < 1e-12
    rel = [w / x for w, x in zip(before["attribution"]["weights"][:8], before["attribution"]["expected_weights"][:8])]
    assert [round(v, 6) for v in rel] == [0.0, 1.0, 1.0, 1.0] * 2
    assert [round(w * 8, 3) for w in before["attribution"]["weights"][9:12]] == [1.0, 1.0, 1.0]  # a whole share again
    assert step["attribution"]["weights"][9] == 0.049  # the record's own fit is left as measured
    # the old gradient is seen only before the clip: as measured its weight (0.049) is under half a share (0.0625)
    assert parts.part_pattern(step, "fp32", 2, 4) == [] and parts.part_pattern(before, "fp32", 2, 4) == [parts.PART_STALE]
    # where no clip acted the step is its own: no clip, no logged norm, a norm within the clip, an applied step
    # whose norm is not the clip (the engine did not scale it as said), a logged norm that is not finite
    for clip, kw in ((0.0, {}), (1.0, {"logged": None}), (1.0, {"logged": 0.9}), (1.0, {"applied": 0.99}),
                     (1.0, {"logged": float("inf")}), (1.0, {"coef": None})):
        s = _clipped_step(**{k: v for k, v in kw.items() if k not in ("logged", "coef")})
        if "logged" in kw:
            s["logged_norm"] = kw["logged"]
        if kw.get("coef", 1) is None:
            s["clip_coef"] = None
        assert parts.unclipped(s, clip, "fp32", 2, 4) is s, (clip, kw)
    # the applied norm is the clip to within the dtype's ratio tolerance: fp32 1e-4, bf16 3e-2
    assert parts.unclipped(_clipped_step(applied=1.00009), 1.0, "fp32", 2, 4) is not None
    assert "unclipped_by" in parts.unclipped(_clipped_step(applied=1.00009), 1.0, "fp32", 2, 4)
    assert "unclipped_by" not in parts.unclipped(_clipped_step(applied=1.00011), 1.0, "fp32", 2, 4)
    assert "unclipped_by" in parts.unclipped(_clipped_step(applied=1.02), 1.0, "bf16", 2, 4)


def test_a_clipped_groups_lost_micro_batches_and_shape_are_read_before_the_clip():
    engine, coef = 0.4, 0.5
    g = _group(rel_err=0.5, lost="micro-batch 1 on every rank")
    # fitted at 0.2 of an expected 0.125: x1.6 as measured, x1 before the clip; the second row 0.01: x0.2, lost either way
    g["attribution"].update(rows=[0, 2], weights=[0.125 * engine, 0.01], expected_weights=[0.125 * coef] * 2)
    step = {**_step(g), "logged_norm": 1 / engine, "clip_coef": coef, "attribution": None}
    step["metrics"]["effective_norm"] = 1.0
    before = parts.unclipped(step, 1.0, "fp32", 2, 2)
    ga = before["groups"]["expert"]
    assert [round(w / x, 6) for w, x in zip(ga["attribution"]["weights"], ga["attribution"]["expected_weights"])] == \
        [1.0, 0.2]
    assert ga["lost"] == "rank 1 micro-batch 1" and ga["shape"] == "rank 1 micro-batch 1 x0.2, the others reaching it x1"
    assert "attribution" not in before or before["attribution"] is None
    assert step["groups"]["expert"]["lost"] == "micro-batch 1 on every rank"  # the record's own is left as measured


def test_a_record_names_a_clipped_steps_shape_before_the_clip_and_says_so():
    step = {**_clipped_step(), "hypotheses": {"best": "x", "best_matches": False, "ambiguous": []}}
    rec = naming.annotate_steps(_rec([step], ga=4, config={"clip": 1.0}))
    assert rec["matches"] == parts.PART_STALE and rec["steps"][0]["unclipped_by"] == pytest.approx(1 / 2.5509)
    assert rec["shape"].startswith("before the clip (the engine scaled its gradient of norm 2.551 by 0.392): "
                                   "micro-batch 1 x0, the others x1; the previous step's micro-batches 0, 1, 1, 1, 0, 1, 1, 1 "
                                   "(x their share)")
    plain = naming.annotate_steps(_rec([{**_clipped_step(), "hypotheses": step["hypotheses"]}], ga=4))  # no clip
    assert plain["matches"] == "none" and "before the clip" not in plain["shape"]
    assert naming.annotate_steps(_rec([{**_clipped_step(), "hypotheses": step["hypotheses"]}], ga=4,
                                      clip=1.0))["matches"] == parts.PART_STALE  # the clip on the record itself


def test_the_clip_is_read_only_where_the_engine_clipped_and_a_groups_lost_rows_are_its_own_micro_batches():
    # a logged norm exactly at the clip: the engine scaled by 1, nothing to undo
    s = _clipped_step(logged=1.0)
    assert parts.unclipped(s, 1.0, "fp32", 2, 4) is s
    # the applied norm's limit is relative to the clip: at clip 4, 4 * (1 + 0.9e-4) is the clip, 4 * (1 + 1.1e-4) not
    assert "unclipped_by" in parts.unclipped(_clipped_step(logged=8.0, applied=4.00036), 4.0, "fp32", 2, 4)
    assert "unclipped_by" not in parts.unclipped(_clipped_step(logged=8.0, applied=4.00044), 4.0, "fp32", 2, 4)
    # before the clip a reached micro-batch at exactly half its right weight is not lost; a previous step's row
    # (expected 0) is never lost, whatever its weight
    engine, coef = 0.5, 0.25
    g = _group(rel_err=0.5)
    g["attribution"].update(rows=[0, 2, 4], weights=[0.125 * engine, 0.0625 * engine, -0.3 * engine],
                            expected_weights=[0.125 * coef, 0.125 * coef, 0.0])
    step = {**_step(g), "logged_norm": 1 / engine, "clip_coef": coef, "attribution": None}
    step["metrics"]["effective_norm"] = 1.0
    assert parts.unclipped(step, 1.0, "fp32", 2, 2)["groups"]["expert"]["lost"] is None
    g["attribution"]["weights"][1] = 0.0624 * engine
    assert parts.unclipped(step, 1.0, "fp32", 2, 2)["groups"]["expert"]["lost"] == "rank 1 micro-batch 1"
