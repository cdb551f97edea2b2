"""B2 on real 2-rank pipelines (2 stages): every stage sums on DeepSpeed 0.18.2, every stage is a mean on the installed one."""
import pytest

from gradkit import config as kconfig
from gradkit.judge import oracle, records
from gradkit.probes import pipeline_ga as pg
from gradkit.probes.ranks.judging import STEPS

pytestmark = pytest.mark.usefixtures("warm_module")  # one import per stack for the module's runs

OLD = "0.18.2"  # the report's release
GA = 4


@pytest.fixture(scope="module")
def recs():
    return pg.run(world_sizes=(2,), splits=((8, 1), (2, GA)), dtypes=("fp32",), zero_stages=(0,),
                  versions=(OLD, "installed"), timeout_s=400)


@pytest.mark.world
def test_records_are_complete_and_controls_exact(recs):
    assert len(recs) == 2 * 3  # per version: control, pipeline, loss_div_ga
    for r in recs:
        records.check(r)
        assert r["verdict"] != oracle.CANNOT_RUN, r["reason"]
        assert [s["stage"] for s in r["stages"]] == [0, 1]
    for r in records.select(recs, role="control"):
        assert r["verdict"] == oracle.NOT_AFFECTED and r["metrics"]["rel_l2"] < 1e-6, r["reason"]


@pytest.mark.world
def test_old_release_sums_on_every_stage(recs):
    r = records.one(recs, version=OLD, case="pipeline")
    assert r["verdict"] == oracle.AFFECTED and r["affected_stages"] == [0, 1], r["reason"]
    for s in r["stages"]:
        assert s["matches"] == "sum (x GA)" and s["metrics"]["norm_ratio"] == pytest.approx(GA, rel=1e-4)
    assert r["logged_grad_norm"] / r["reference_grad_norm"] == pytest.approx(GA, rel=1e-4)  # the report's symptom
    assert r["engine_loss"] == pytest.approx(r["reference_loss"], rel=1e-5)  # while the reported loss looks right
    fixed = records.one(recs, version=OLD, case="loss_div_ga")
    assert fixed["verdict"] == oracle.NOT_AFFECTED, fixed["reason"]
    # every step is judged from its own starting weights: each is the same sum, and the run drifts by all of them
    assert len(r["steps"]) == STEPS and [st["verdict"] for st in r["steps"]] == [oracle.AFFECTED] * STEPS
    for st in r["steps"]:
        assert {s["matches"] for s in st["stages"]} == {"sum (x GA)"}
        assert st["metrics"]["norm_ratio"] == pytest.approx(GA, rel=1e-4)
    assert r["trajectory"]["steps"] == STEPS and r["trajectory"]["norm_ratio"] > 2


@pytest.mark.world
def test_installed_release_averages_on_every_stage(recs):
    r = records.one(recs, version="installed", case="pipeline")
    assert r["verdict"] == oracle.NOT_AFFECTED and r["affected_stages"] == [], r["reason"]
    assert [st["verdict"] for st in r["steps"]] == [oracle.NOT_AFFECTED] * STEPS
    assert r["trajectory"]["rel_l2"] < 1e-5
    wrong = records.one(recs, version="installed", case="loss_div_ga")  # the old workaround now hurts
    assert wrong["verdict"] == oracle.AFFECTED and {s["matches"] for s in wrong["stages"]} == {"mean / GA"}
    assert pg.violations(recs) == []


@pytest.mark.parametrize("kwargs, words", [
    ({"world_sizes": (3,)}, "not a multiple"),
    ({"zero_stages": (2,)}, "does not combine with pipeline"),
    ({"splits": ((8, 1), (2, 2))}, "one global batch"),
    ({"splits": ((8,),)}, r"\[micro_batch, GA\]"),
    ({"splits": ((0, 8),)}, "micro-batch size"),
    ({"dtypes": "fp32"}, "non-empty list"),
])
def test_bad_b2_parameters_fail_before_any_launch(kwargs, words):
    with pytest.raises(kconfig.ConfigError, match=words):
        pg.run(**{"versions": ("installed",), **kwargs})


def _stage(s, ratio, share):
    """A stage's numbers: ``ratio`` of its reference, on a stage that holds ``share`` of the squared norm."""
    m = {"norm_ratio": ratio, "cosine": 1.0, "rel_l2": abs(ratio - 1), "max_rel_err": abs(ratio - 1),
         "effective_norm": ratio * share ** 0.5, "reference_norm": share ** 0.5}
    return {"stage": s, "metrics": m, "attribution": {"misplaced_weight": 0.0},
            "hypotheses": {"best": "mean" if ratio == 1 else "mean / GA", "best_matches": True},
            "rank_spread": {"data-parallel replicas": 0.0}}


def test_a_record_takes_the_verdict_of_its_worst_stage_not_of_the_whole_model():
    """A stage with 1 % of the norm, off by 1/GA, hides inside the whole model's bf16 tolerance."""
    stages = [_stage(0, 0.25, 0.01), _stage(1, 1.0, 0.99)]
    whole = (0.01 * 0.25 ** 2 + 0.99) ** 0.5  # ~0.996: the whole model looks right
    rec = {"dtype": "bf16", "role": "measured", "verdict": oracle.NOT_AFFECTED, "reason": "whole model ok",
           "metrics": {"norm_ratio": whole, "cosine": 0.9999, "rel_l2": 0.075 * 0.1}, "stages": stages}
    control = {"dtype": "bf16", "role": "control", "stages": [_stage(0, 1.0, 0.01), _stage(1, 1.0, 0.99)]}
    out = pg.annotate_record(rec, control)
    assert out["verdict"] == oracle.AFFECTED and out["affected_stages"] == [0], out["reason"]
    assert out["reason"].startswith("stage 0:")
    assert out["whole_model_verdict"] == oracle.NOT_AFFECTED  # kept, as information
    # an off control stage makes the record inconclusive, whatever the whole model says
    bad = pg.annotate_record({**rec, "stages": [_stage(0, 1.0, 0.01), _stage(1, 1.0, 0.99)]},
                             {**control, "stages": [_stage(0, 0.5, 0.01), _stage(1, 1.0, 0.99)]})
    assert bad["verdict"] == oracle.INCONCLUSIVE
    # replicas that disagree are judged too
    split = [_stage(0, 1.0, 0.01), {**_stage(1, 1.0, 0.99), "rank_spread": {"data-parallel replicas": 1e-3}}]
    assert pg.annotate_record({**rec, "stages": split}, control)["verdict"] == oracle.AFFECTED


@pytest.mark.world
def test_a_bf16_pipeline_that_keeps_its_gradient_is_found_at_step_2_and_is_not_called_b2():
    """DeepSpeed 0.18.2, bf16, ZeRO-0 (FP16_UnfusedOptimizer), GA = 1: step 1 is the mean; step 2 applies its own
    gradient and step 1's again. One step from a fresh engine never sees it; it is a finding, not B2."""
    recs = pg.run(world_sizes=(2,), splits=((8, 1),), dtypes=("bf16",), zero_stages=(0,), versions=(OLD,),
                  timeout_s=400)
    control = records.one(recs, case="control")
    assert control["first_step_verdict"] == oracle.NOT_AFFECTED
    assert [s["matches"] for s in control["steps"][1]["stages"]] == ["mean" + pg.STALE] * 2
    assert pg.violations(recs) == [] and len(pg.stale_findings(recs)) == 1
