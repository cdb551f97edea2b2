"""FSDP2 (``fully_shard``) on real 2-rank gloo worlds, judged by the same oracle as every DeepSpeed probe."""
import pytest

from gradkit.judge import oracle, records
from gradkit.probes import fsdp2

pytestmark = pytest.mark.usefixtures("warm_module")


@pytest.fixture(scope="module")
def mlp_records():
    return fsdp2.run(world_sizes=(2,), ga_values=(1, 4), timeout_s=180)


@pytest.mark.world
def test_every_correct_fsdp2_loop_matches_the_reference_and_the_loop_bugs_do_not(mlp_records):
    judged = [r for r in mlp_records if r["case"] in ("control", "sync_last", "sync_every")]
    assert len(judged) == 2 * (1 + len(fsdp2.SETTINGS) + 2)  # two GAs: the control, sync_last x5, sync_every x2
    for r in judged:
        assert r["verdict"] == oracle.NOT_AFFECTED, (r["case"], r["setting"], r["ga"], r["reason"])
        assert len(r["steps"]) == 2 and r["rank_spread"]["effective gradients"] < 1e-6
    assert {r["dtype"] for r in judged if r["setting"].startswith("bf16")} == {"bf16"}  # judged at bf16's limits
    summed = records.one(mlp_records, case="sum_not_mean", ga=4)
    assert summed["verdict"] == oracle.AFFECTED and abs(summed["metrics"]["norm_ratio"] - 4) < 1e-4
    assert summed["shape"] == "every micro-batch x4"
    assert records.one(mlp_records, case="sum_not_mean", ga=1)["verdict"] == oracle.NOT_AFFECTED
    for ga in (1, 4):  # sync never back on: nothing is reduce-scattered, the sharded grads stay None, nothing moves
        never = records.one(mlp_records, case="sync_kept_off", ga=ga)
        assert never["verdict"] == oracle.AFFECTED and never["metrics"]["norm_ratio"] == 0.0
        assert never["shape"] == "every micro-batch x0"
    assert fsdp2.violations(mlp_records) == []
    assert not any(r["imported_deepspeed"] for r in mlp_records)


@pytest.mark.world
def test_a_part_some_micro_batches_skip_is_exact_in_fp32_and_fails_loudly_under_bf16_with_fp32_reduce():
    """The conditional model at GA = 2: ``skip_first`` is first used by the last micro-batch. In fp32 every loop is
    exact. With bf16 params and an fp32 reduce FSDP2 raises (torch 2.13): one unit per layer in
    ``to_accumulated_grad_if_needed`` (an expert that sat out a micro-batch was never unsharded, pytorch#194058), the
    whole model as one unit in ``foreach_reduce`` (fresh bf16 and accumulated fp32 gradients, pytorch#196996). A
    raise is ``cannot-run`` with FSDP's sentence, never a verdict."""
    recs = fsdp2.run(world_sizes=(2,), ga_values=(2,), models=("conditional",), loops=("sync_last",), timeout_s=180)
    by = {r["setting"]: r for r in recs if r["case"] == "sync_last"}
    assert set(by) == set(fsdp2.SETTINGS)
    for s in ("fp32", "fp32 no-reshard", "bf16 / bf16 reduce"):
        assert by[s]["verdict"] == oracle.NOT_AFFECTED, (s, by[s]["reason"])
        assert by[s]["steps"][0]["groups"]["expert skip_first"]["shape"] == "every micro-batch reaching it x1"
    per_layer, one_unit = by["bf16 / fp32 reduce"], by["bf16 / fp32 reduce, one unit"]
    assert per_layer["verdict"] == oracle.CANNOT_RUN and "_unsharded_param" in per_layer["reason"]
    assert one_unit["verdict"] == oracle.CANNOT_RUN and "uniform gradient dtype" in one_unit["reason"]
    assert fsdp2.violations(recs) == []


def test_a_setting_the_probe_does_not_know_is_refused_before_any_launch():
    from gradkit import config as kconfig

    with pytest.raises(kconfig.ConfigError, match="unknown FSDP2 setting 'bf16'"):
        fsdp2.run(settings=("bf16",))


def test_violations_name_a_control_off_a_summed_loop_judged_exact_and_a_raise_given_a_verdict():
    base = {"world_size": 2, "config": {"model": "mlp", "setting": "fp32"}, "reason": "r", "metrics": {"norm_ratio": 1.0}}
    recs = [{**base, "case": "control", "role": "control", "ga": 4, "verdict": oracle.AFFECTED},
            {**base, "case": "sum_not_mean", "role": "comparison", "ga": 4, "verdict": oracle.NOT_AFFECTED},
            {**base, "case": "sync_kept_off", "role": "comparison", "ga": 1, "verdict": oracle.NOT_AFFECTED},
            {**base, "case": "sync_last", "role": "measured", "ga": 4, "verdict": oracle.NOT_AFFECTED, "error": "boom"}]
    said = fsdp2.violations(recs)
    assert len(said) == 4
    assert "the control is affected" in said[0] and "summed loop is not-affected" in said[1]
    assert "never syncs is not-affected" in said[2] and "raised but its verdict is not-affected" in said[3]
