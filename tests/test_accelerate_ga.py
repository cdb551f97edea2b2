"""Accelerate's ``accumulate()`` on real 2-rank worlds: the installed release and the two on either side of
huggingface/accelerate#2790 (0.30.1 stepped the optimizer on every micro-batch under ``sync_each_batch``)."""
import pytest

from gradkit.judge import oracle, records
from gradkit.probes import accelerate_ga

pytestmark = pytest.mark.usefixtures("warm_module")


@pytest.fixture(scope="module")
def installed():
    return accelerate_ga.run(world_sizes=(2,), ga_values=(1, 4), models=("mlp", "conditional"), timeout_s=180)


@pytest.mark.world
def test_the_documented_loop_is_exact_and_a_loop_without_accelerator_backward_is_ga_times_too_big(installed):
    for model in ("mlp", "conditional"):
        for case in ("control", "accumulate", "sync_each_batch"):
            for ga in (1, 4):
                r = records.one(installed, case=case, ga=ga, model=model)
                assert r["verdict"] == oracle.NOT_AFFECTED, (model, case, ga, r["reason"])
                assert case == "control" or r["optimizer_steps_per_window"] == [1, 1]
        summed = records.one(installed, case="sum_not_mean", ga=4, model=model)
        assert summed["verdict"] == oracle.AFFECTED and summed["shape"].startswith("every micro-batch x4")
    assert accelerate_ga.violations(installed) == []
    assert all(r["versions"].get("accelerate") and "deepspeed" not in r["versions"] for r in installed)


@pytest.mark.world
def test_the_last_incomplete_window_applies_its_share_of_the_full_ga_as_accelerate_documents(installed):
    for ga in (1, 4):  # a dataloader of ga micro-batches, Accelerate told GA = ga + 1
        r = records.one(installed, case="last_window", ga=ga, model="mlp")
        assert r["config"]["accumulation_steps"] == ga + 1 and r["optimizer_steps_per_window"] == [1, 1]
        assert r["verdict"] == oracle.AFFECTED and abs(r["metrics"]["norm_ratio"] - ga / (ga + 1)) < 1e-6
        assert r["shape"] == f"every micro-batch x{ga / (ga + 1):.2g}"


@pytest.mark.world
def test_fsdp2_through_accelerate_is_cannot_run_on_cpu_never_a_verdict_on_ddp(installed):
    for r in records.select(installed, case="accumulate_fsdp2"):
        assert r["verdict"] == oracle.CANNOT_RUN and "selects FSDP on a GPU only" in r["reason"]
    assert len(records.select(installed, case="accumulate_fsdp2")) == 4


@pytest.mark.world
def test_sync_each_batch_stepped_every_micro_batch_before_accelerate_0_31_and_not_after():
    recs = accelerate_ga.run(world_sizes=(2,), ga_values=(4,), stacks=({"accelerate": "0.30.1"}, {"accelerate": "0.31.0"}),
                             cases=("sync_each_batch",), timeout_s=300)
    old = records.one(recs, case="sync_each_batch", version="accelerate=0.30.1")
    new = records.one(recs, case="sync_each_batch", version="accelerate=0.31.0")
    assert old["versions"]["accelerate"] == "0.30.1" and new["versions"]["accelerate"] == "0.31.0"
    assert old["verdict"] == oracle.AFFECTED and old["optimizer_steps_per_window"] == [4, 4]
    assert "stepped 4 times in one accumulation window" in old["reason"]
    assert new["verdict"] == oracle.NOT_AFFECTED and new["optimizer_steps_per_window"] == [1, 1]
    assert all(records.one(recs, case="control", version=v)["verdict"] == oracle.NOT_AFFECTED
               for v in ("accelerate=0.30.1", "accelerate=0.31.0"))


def test_a_stack_naming_another_package_is_refused_before_any_launch():
    from gradkit import config as kconfig

    with pytest.raises(kconfig.ConfigError, match="runs accelerate releases only"):
        accelerate_ga.run(stacks=({"deepspeed": "0.18.6"},))


@pytest.mark.world
def test_micro_batches_of_different_sizes_need_the_item_count_gathered_over_every_rank(installed):
    """The ragged shape (token counts that differ): mean losses weigh micro-batches alike, a rank's own count weighs
    ranks alike; the count gathered over every rank (Accelerate's documented normalisation) is exact."""
    for ga in (1, 4):
        assert records.one(installed, case="control", ga=ga, model="ragged")["verdict"] == oracle.NOT_AFFECTED
        assert records.one(installed, case="tokens_global", ga=ga)["verdict"] == oracle.NOT_AFFECTED
        local = records.one(installed, case="tokens_local", ga=ga)
        assert local["verdict"] == oracle.AFFECTED and local["shape"].startswith("rank 0: ")
        assert local["metrics"]["cosine"] < 0.999
    mean = records.one(installed, case="accumulate_ragged", ga=4)
    fitted = mean["steps"][0]["attribution"]
    assert mean["verdict"] == oracle.AFFECTED and len(fitted["weights"]) == 8
    assert all(abs(w - 1 / 8) < 1e-6 for w in fitted["weights"])  # every micro-batch's mean alike: 1 / (W x GA)
    assert max(fitted["expected_weights"]) / min(fitted["expected_weights"]) > 2  # its share of the samples is not
    assert {r["model"] for r in records.select(installed, case="tokens_global")} == {"ragged"}
