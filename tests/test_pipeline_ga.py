"""B2 on real 2-rank pipelines (2 stages): every stage sums on DeepSpeed 0.18.2, every stage is a mean on the installed one."""
import pytest

from kit import config as kconfig
from kit import oracle, records
from kit.probes import pipeline_ga as pg

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


@pytest.mark.world
def test_installed_release_averages_on_every_stage(recs):
    r = records.one(recs, version="installed", case="pipeline")
    assert r["verdict"] == oracle.NOT_AFFECTED and r["affected_stages"] == [], r["reason"]
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
