"""B4 on real 2-rank CPU worlds: affected on a pre-fix DeepSpeed, not affected on the installed one."""
import pytest

from kit import oracle, records
from kit.probes import bf16_leak

pytestmark = pytest.mark.world
OLD = "0.18.9"  # allreduce_gradients() before backward_epilogue() (the seed: 0.18.6-0.18.10)
GA = 4


@pytest.fixture(scope="module")
def recs():
    return bf16_leak.run(world_size=2, ga_values=(GA,), versions=(OLD, "installed"),
                         cases=("leak", "workaround", "control"), timeout_s=400)


def test_records_are_complete(recs):
    assert len(recs) == 6
    for r in recs:
        records.check(r)
        assert r["world_size"] == 2 and r["ga"] == GA and r["versions"]["torch"]


def test_controls_match_the_reference_exactly(recs):
    for r in records.select(recs, case="control"):
        assert r["verdict"] == oracle.NOT_AFFECTED, r["reason"]
        assert r["metrics"]["rel_l2"] < 1e-6


def test_old_version_is_affected_with_the_predicted_bias(recs):
    r = records.one(recs, version=OLD, case="leak")
    assert r["optimizer"] == "BF16_Optimizer"
    assert r["verdict"] == oracle.AFFECTED, r["reason"]
    # every rank's accumulator lost exactly the other rank's boundary micro-batch: (W-1)/W * 1/GA
    want = bf16_leak.predicted_misplaced_weight(2, GA)
    for b in r["rank_buffers"]:
        assert b["attribution"]["misplaced_weight"] == pytest.approx(want, abs=0.01)
    norms_before_step = [row[-1] for row in r["accumulator_norms"]]
    assert abs(norms_before_step[0] - norms_before_step[1]) > 1e-3  # ranks disagree after the boundary


def test_installed_version_is_not_affected(recs):
    r = records.one(recs, version="installed", case="leak")
    assert r["optimizer"] == "BF16_Optimizer"
    assert r["verdict"] == oracle.NOT_AFFECTED, r["reason"]
    for b in r["rank_buffers"]:
        assert b["attribution"]["misplaced_weight"] < oracle.tolerance("bf16").misplaced_weight
    norms_before_step = [row[-1] for row in r["accumulator_norms"]]
    assert norms_before_step[0] == pytest.approx(norms_before_step[1], rel=1e-6)


def test_workaround_fixes_the_old_version(recs):
    r = records.one(recs, version=OLD, case="workaround")
    assert r["verdict"] == oracle.NOT_AFFECTED, r["reason"]
