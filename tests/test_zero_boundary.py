"""B3 on real CPU worlds (W=1 and W=2): the manual loop loses micro-batches under ZeRO-2, the controls and fixes do not."""
import pytest

from gradkit import config as kconfig
from gradkit.judge import oracle, records
from gradkit.probes import zero_boundary as zb
from gradkit.probes.ranks import zero_boundary as zb_ranks

pytestmark = pytest.mark.usefixtures("warm_module")  # one import per stack for the module's runs

N = 4


@pytest.fixture(scope="module")
def recs():
    return zb.run(world_sizes=(1, 2), n_values=(1, N), stages=(0, 2, 3), dtypes=("fp32", "bf16"),
                  versions=("installed",), fix_n_values=(N,), timeout_s=400)


@pytest.mark.world
def test_records_are_complete(recs):
    # per world: 2 controls + 3 stages x 2 dtypes x (2 manual + 3 fixes)
    assert len(recs) == 2 * (2 + 3 * 2 * (2 + 3))
    for r in recs:
        records.check(r)
        assert r["verdict"] != oracle.CANNOT_RUN, r["reason"]


@pytest.mark.world
def test_controls_match_the_reference_exactly(recs):
    ctrl = records.select(recs, role="control")
    assert len(ctrl) == 4
    for r in ctrl:
        assert r["verdict"] == oracle.NOT_AFFECTED and r["metrics"]["rel_l2"] < 1e-6, r["reason"]


@pytest.mark.world
@pytest.mark.parametrize("w", [1, 2])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_zero2_keeps_only_the_last_micro_batch(recs, w, dtype):
    r = records.one(recs, case="manual", zero_stage=2, dtype=dtype, world_size=w, ga=N)
    assert r["verdict"] == oracle.AFFECTED, r["reason"]
    assert r["matches"] == "last micro-batch / N"
    tol = 1e-4 if dtype == "fp32" else 2e-2
    assert len(r["steps"]) == 2 and all(s["matches"] == "last micro-batch / N" for s in r["steps"])
    for step in r["steps"]:  # each step's own micro-batches, then (from step 2 on) the previous step's: never reused
        weights = step["attribution"]["weights"]
        assert len(weights) == w * N * (2 if step["step"] else 1)
        for k, wk in enumerate(weights):
            want = 1 / (w * N) if k < w * N and k % N == N - 1 else 0.0
            assert wk == pytest.approx(want, abs=tol), (step["step"], k, weights)


@pytest.mark.world
@pytest.mark.parametrize("stage", [0, 3])
def test_zero0_and_zero3_accumulate_every_micro_batch(recs, stage):
    for r in records.select(recs, case="manual", zero_stage=stage):
        assert r["verdict"] == oracle.NOT_AFFECTED, r["reason"]
        assert r["matches"] == "global mean"


@pytest.mark.world
def test_one_micro_batch_loses_nothing(recs):
    for r in records.select(recs, case="manual", ga=1):
        assert r["verdict"] == oracle.NOT_AFFECTED, r["reason"]


@pytest.mark.world
@pytest.mark.parametrize("fix", zb.FIXES)
def test_fixes_work_on_every_stage(recs, fix):
    sel = records.select(recs, case=fix)
    assert len(sel) == 2 * 3 * 2
    for r in sel:
        assert r["knows_unmanaged"]  # the installed DeepSpeed has managed_gradient_accumulation
        assert r["verdict"] == oracle.NOT_AFFECTED, (r["zero_stage"], r["dtype"], r["reason"])


def test_hypotheses_are_distinct_weightings():
    h = zb_ranks.hypothesis_weights(2, 4)
    assert sum(h["global mean"]) == pytest.approx(1.0)
    assert sum(h["last micro-batch / N"]) == pytest.approx(0.25)
    assert sum(h["sum of micro-batches"]) == pytest.approx(4.0)
    assert [i for i, x in enumerate(h["last micro-batch / N"]) if x] == [3, 7]


@pytest.mark.parametrize("kwargs, words", [
    ({"stages": (0, 5)}, "unknown ZeRO stage 5"),
    ({"n_values": (1, 0)}, "1..64"),
    ({"n_values": "1,2"}, "non-empty list"),
    ({"fix_n_values": (8,)}, "not in N_VALUES"),
    ({"world_sizes": (2, 64)}, "more than this machine"),
    ({"dtypes": ("fp16",)}, "dtype must be one of"),
    ({"versions": ("latest",)}, "release number"),
    ({"fixes": ("fix_magic",)}, "unknown B3 fix"),
])
def test_bad_b3_parameters_fail_before_any_launch(kwargs, words):
    args = {"world_sizes": (2,), "n_values": (1, 4), "versions": ("installed",), **kwargs}
    with pytest.raises(kconfig.ConfigError, match=words):
        zb.run(**args)


@pytest.mark.world
def test_verdict_per_configuration_and_no_violated_claim(recs):
    cv = zb.config_verdicts(recs)
    assert len(cv) == 2 * 3 * 2  # W x stages x dtypes
    for (version, stage, dtype, w), x in cv.items():
        want = oracle.AFFECTED if stage == 2 else oracle.NOT_AFFECTED
        assert x["verdict"] == want, (stage, dtype, w, x["reason"])
    assert zb.violations(recs) == []


def _rec(case, verdict, ratio, ga=4, stage=2, dtype="fp32", matches="global mean", role=None, knows=True):
    return {"case": case, "role": role or zb.CASES[case]["role"], "verdict": verdict, "reason": verdict,
            "version": "x", "zero_stage": stage, "dtype": dtype, "world_size": 2, "ga": ga, "matches": matches,
            "knows_unmanaged": knows, "metrics": {"norm_ratio": ratio}}


def test_an_off_configuration_at_n1_makes_b3_inconclusive():
    recs = [_rec("manual", oracle.AFFECTED, 1e-5, ga=1, matches="none"),
            _rec("manual", oracle.AFFECTED, 1e-5, ga=4, matches="none")]
    got = zb.config_verdicts(recs)[("x", 2, "fp32", 2)]
    assert got["verdict"] == oracle.INCONCLUSIVE and "N=1" in got["reason"]
    assert zb.violations(recs) == []  # not a B3 claim: the configuration is off for another reason


def test_violations_catch_a_fix_that_differs_from_the_engines_own_loop():
    good = [_rec("control", oracle.NOT_AFFECTED, 1.0, stage=0),
            _rec("manual", oracle.NOT_AFFECTED, 1.0, ga=1),
            _rec("manual", oracle.AFFECTED, 0.4, matches="last micro-batch / N"),
            _rec("fix_config_ga", oracle.NOT_AFFECTED, 1.0),
            _rec("fix_boundary", oracle.NOT_AFFECTED, 1.0)]
    assert zb.violations(good) == []
    assert zb.config_verdicts(good)[("x", 2, "fp32", 2)]["matches"] == ["last micro-batch / N"]
    broken_fix = good[:-1] + [_rec("fix_boundary", oracle.AFFECTED, 0.4)]
    assert any("own GA loop" in v for v in zb.violations(broken_fix))
    unexplained = good[:2] + [_rec("manual", oracle.AFFECTED, 0.7, matches="none")] + good[3:]
    assert any("no named hypothesis" in v for v in zb.violations(unexplained))
    off_control = [_rec("control", oracle.AFFECTED, 0.5, stage=0)] + good[1:]
    assert any("control" in v for v in zb.violations(off_control))
