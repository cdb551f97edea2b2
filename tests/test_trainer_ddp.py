"""The HF Trainer on 2 DDP ranks without DeepSpeed, on both sides of transformers' October 2024 accumulation fix."""
import pytest

from gradkit.judge import oracle, records
from gradkit.probes import trainer_ddp

pytestmark = pytest.mark.usefixtures("warm_module")


@pytest.fixture(scope="module")
def recs():
    return trainer_ddp.run(stacks=list(trainer_ddp.STACKS.values()), gas_values=(4,), timeout_s=600)


def _one(recs, label, case):
    return records.one(recs, version=label, case=case)


@pytest.mark.world
def test_the_installed_trainer_takes_the_global_token_mean_and_per_rank_counts_do_not(recs):
    for case in ("trainer", "avg_tokens_on"):
        r = _one(recs, "installed", case)
        assert r["verdict"] == oracle.NOT_AFFECTED and r["shape"] == "every micro-batch x1", (case, r["reason"])
    off = _one(recs, "installed", "avg_tokens_off")  # each rank divides by its own token count
    assert off["verdict"] == oracle.AFFECTED and off["metrics"]["cosine"] < 0.9999
    assert off["shape"].startswith("rank 0: every micro-batch x") and "; rank 1: every micro-batch x" in off["shape"]
    summed = _one(recs, "installed", "sum_not_mean")
    assert summed["verdict"] == oracle.AFFECTED and summed["shape"] == "every micro-batch x4"
    assert all(r["verdict"] == oracle.NOT_AFFECTED for r in records.select(recs, case="harness"))
    assert trainer_ddp.violations(recs) == []


@pytest.mark.world
def test_4_45_weights_each_micro_batch_by_its_own_tokens_and_4_46_3_counts_one_token_too_many_per_sequence(recs):
    old = _one(recs, "accelerate=1.0.1 transformers=4.45.2", "trainer")
    assert old["versions"]["transformers"] == "4.45.2"
    assert old["verdict"] == oracle.AFFECTED and old["metrics"]["cosine"] < 0.999  # the mean of micro-batch means
    weights = old["steps"][0]["attribution"]["weights"]
    assert len(weights) == 8 and max(weights) - min(weights) > 0.2  # micro-batches weighted unequally
    for case in ("avg_tokens_on", "avg_tokens_off"):  # 4.45 has no such argument: said, not judged
        r = _one(recs, "accelerate=1.0.1 transformers=4.45.2", case)
        assert r["verdict"] == oracle.CANNOT_RUN and "average_tokens_across_devices" in r["reason"]
    fixed = _one(recs, "accelerate=1.0.1 transformers=4.46.3", "avg_tokens_on")
    assert fixed["verdict"] == oracle.AFFECTED and fixed["metrics"]["cosine"] > 1 - 1e-9  # the right direction
    assert abs(fixed["metrics"]["norm_ratio"] / fixed["token_factor"] - 1) < 1e-6  # all of it the token count
    calls = [t for trace in fixed["steps"][0]["rank_traces"] for t in trace if t["call"] == "compute_loss"]
    assert len(calls) == 8  # 2 ranks x 4 micro-batches, every one divided by the count of both ranks' unshifted labels
    assert {t["num_items_in_batch"] for t in calls} == {sum(t["label_tokens_unshifted"] for t in calls)}


def test_a_stack_with_deepspeed_is_refused_before_any_launch():
    from gradkit import config as kconfig

    with pytest.raises(kconfig.ConfigError, match="pins transformers and accelerate only"):
        trainer_ddp.run(stacks=({"deepspeed": "0.18.6"},))
