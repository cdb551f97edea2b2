"""The watch in real 2-rank jobs of the Hugging Face side (``examples/watch``: the Trainer, TRL's ``SFTTrainer``,
Accelerate), run as users run them (torchrun): a release that has the bug is ``affected`` and named, one that does
not is ``not-affected``, and the verdict agrees with the replica's (``gradkit check``) where both can judge. The
DeepSpeed and FSDP2 jobs are tests/test_watch_jobs.py (two files: the two test workers take one each)."""
import re

import pytest

from gradkit.judge import oracle
from gradkit.notebooks import watch
from gradkit.watch import guard
from tests.test_watch_jobs import _run


def _verdicts(recs, logged: bool = False) -> list:
    return [r["verdict"] for r in recs if ("logged_norm" in r) == logged]


@pytest.mark.world
def test_the_trainer_on_a_tiny_llama_with_padded_rows_of_every_length_is_exact_and_4_46_3_miscounts(tmp_path, capsys):
    """... as ``gradkit check --path trainer`` says of 4.46.3 on the kit's own model and data."""
    from gradkit.commands import check

    now = _run(tmp_path / "now", "trainer_job.py", "--collator", "pad")
    assert _verdicts(now) == _verdicts(now, logged=True) == [oracle.NOT_AFFECTED] * 2, [r["line"] for r in now]
    assert all(r["loss"] == "mean over label tokens" and r["read"] == "parameters" for r in now if "ga" in r)
    old = _run(tmp_path / "old", "trainer_job.py", "--collator", "pad",
               stack={"transformers": "4.46.3", "accelerate": "1.0.1"})
    assert _verdicts(old) == _verdicts(old, logged=True) == [oracle.AFFECTED] * 2, [r["line"] for r in old]
    ratio = old[0]["measured"]["metrics"]["norm_ratio"]
    assert 0.85 < ratio < 0.95  # unshifted labels counted: one more per row in the divisor
    assert check.main(["--path", "trainer", "--transformers", "4.46.3"]) == 1, capsys.readouterr().out


@pytest.mark.world
@pytest.mark.parametrize("how", [("1", "--precision", "bf16"), ("2", "--precision", "fp16"),
                                 ("3", "--lora", "--gradient-checkpointing")],
                         ids=["zero1-bf16", "zero2-fp16", "zero3-lora-checkpointing"])
def test_the_trainer_on_deepspeed_with_its_own_optimizer_and_its_two_parameter_groups_is_exact(tmp_path, how):
    """The Trainer on the DeepSpeed config LLaMA-Factory ships (every size "auto"), its own AdamW with a decay and a
    no-decay group, rows of 3 to 60 tokens half of them prompt-masked. ZeRO-1/2 step one group at a time with the
    torch optimizer's groups cut down to it (the watch reads every group's partition: it used to stop the job here),
    here in bf16 mixed precision, and in fp16 with DeepSpeed's dynamic loss scale (the Trainer's "auto": its scaler,
    overflow check and unscale run on the CPU, told fp16 is supported, as ``gradkit check`` does); ZeRO-3 reads its
    sub-groups' partitions, here of a LoRA adapter (the base model frozen: never stepped, never judged) with gradient
    checkpointing (the reference's copy recomputes too). ZeRO-0 is the plain parameters' read, ZeRO-2 ZeRO-1's,
    offloaded optimizers their partitions on the CPU (tests/test_watch_jobs.py reads each in DeepSpeed's own loop)."""
    recs = _run(tmp_path, "trainer_job.py", "--deepspeed", *how, "--rows", "prompts", "--ga", "4")
    assert _verdicts(recs) == _verdicts(recs, logged=True) == [oracle.NOT_AFFECTED] * 2, [r["line"] for r in recs]
    assert all(r["read"] == "fp32 partitions" and r["versions"]["deepspeed"] for r in recs if "ga" in r)
    dtype = "bf16" if "bf16" in how else "fp16" if "fp16" in how else "fp32"
    assert all(r["dtype"] == dtype for r in recs if "ga" in r)
    if "--lora" in how:
        assert all(r["judged_parameters"] == 8 for r in recs if "ga" in r)  # A and B of q and v, 2 layers


@pytest.mark.world
def test_the_trainer_on_deepspeed_fp16_applies_half_the_step_where_its_loss_scale_grows_and_the_watch_names_it(
        tmp_path):
    """Issue 47's finding, on the user's own job: ZeRO-2 in fp16 with DeepSpeed's dynamic loss scale, its window 2.
    After two clean steps the scale doubles, and step 3's gradient is unscaled by the new scale: half the reference,
    named as the loss scale's change; the steps around it, same job, same world, are exact."""
    from gradkit.watch.judge import SCALE_GREW

    recs = _run(tmp_path, "trainer_job.py", "--deepspeed", "2", "--precision", "fp16", "--rows", "prompts", "--ga",
                "4", "--steps", "4", "--every", "1", "--loss-scale-window", "2")
    steps = [r for r in recs if "ga" in r]
    assert [r["verdict"] for r in steps] == [oracle.NOT_AFFECTED] * 2 + [oracle.AFFECTED, oracle.NOT_AFFECTED], \
        [r["line"] for r in steps]
    third = steps[2]
    assert third["matches"] == SCALE_GREW and third["loss_scale_change"] == 0.5, third["line"]
    assert third["partitions"] == [SCALE_GREW] * 2  # each rank's partition, named from its own view, the same
    assert third["measured"]["metrics"]["norm_ratio"] == pytest.approx(0.5, abs=1e-3)
    assert third["measured"]["metrics"]["cosine"] > 0.9999  # the direction is right: only its size is halved
    assert third["known"].startswith("B10 (") and "static loss scale" in third["known"], third["known"]
    assert third["known"].endswith("a patch the kit verified: docs/reports/B10/report.md"), third["known"]


@pytest.mark.world
def test_trls_trainer_on_deepspeed_with_packing_at_its_bf16_is_exact(tmp_path):
    recs = _run(tmp_path, "trl_job.py", "--deepspeed", "2", "--packing")
    assert _verdicts(recs) == _verdicts(recs, logged=True) == [oracle.NOT_AFFECTED] * 2, [r["line"] for r in recs]
    assert all(r["read"] == "fp32 partitions" and r["dtype"] == "bf16" for r in recs if "ga" in r)


@pytest.mark.world
def test_the_trainer_on_deepspeed_with_a_compute_loss_that_forgets_to_divide_is_affected(tmp_path):
    recs = _run(tmp_path, "trainer_job.py", "--deepspeed", "2", "--rows", "prompts", "--ga", "4", "--custom-loss")
    assert _verdicts(recs, logged=True) == [oracle.AFFECTED] * 2, [r["line"] for r in recs]
    assert _verdicts(recs)[0] == oracle.AFFECTED and recs[0]["read"] == "fp32 partitions"


@pytest.mark.world
def test_a_compute_loss_that_forgets_to_divide_is_affected_at_every_judged_step(tmp_path):
    """Clipping (the Trainer's max_grad_norm 1.0) makes a step whose gradient is only too large right where the
    reference is clipped too (step 2 here); the norm the Trainer logs for it is ~N/W times the reference's."""
    recs = _run(tmp_path, "trainer_job.py", "--collator", "pad", "--custom-loss")
    assert _verdicts(recs, logged=True) == [oracle.AFFECTED] * 2, [r["line"] for r in recs]
    assert _verdicts(recs)[0] == oracle.AFFECTED
    assert all(r["logged_norm"] / r["reference_norm"] > 30 for r in recs if "logged_norm" in r)


@pytest.mark.world
def test_a_packing_collator_is_exact_where_its_token_count_is_right_and_affected_where_it_is_not(tmp_path):
    right = _run(tmp_path / "right", "trainer_job.py", "--collator", "packed")
    assert _verdicts(right) == [oracle.NOT_AFFECTED] * 2, [r["line"] for r in right]
    wrong = _run(tmp_path / "wrong", "trainer_job.py", "--collator", "packed-wrong")
    assert _verdicts(wrong) == [oracle.AFFECTED] * 2, [r["line"] for r in wrong]
    assert all(r["measured"]["metrics"]["cosine"] < 0.99 for r in wrong if "measured" in r)


@pytest.mark.world
def test_accelerates_deepspeed_plugin_hands_the_watch_to_the_engine_and_is_exact(tmp_path):
    """Accelerate's DeepSpeed plugin (ZeRO-2, GA 4 in the plugin): watch_accelerate hands over to the engine's adapter.
    Its FSDP plugin selects FSDP on a GPU only; FSDP2 itself is tests/test_watch_jobs.py's fsdp2_job."""
    recs = _run(tmp_path, "accelerate_job.py", "--deepspeed", "2")
    assert [r["verdict"] for r in recs] == [oracle.NOT_AFFECTED] * 2, [r["line"] for r in recs]
    assert all(r["read"] == "fp32 partitions" and r["zero_stage"] == 2 and r["ga"] == 4 for r in recs)


@pytest.mark.world
def test_accelerate_0_30_1_steps_on_every_micro_batch_with_sync_each_batch_and_0_31_0_does_not(tmp_path, capsys):
    """... as ``gradkit check --path accelerate`` says of 0.30.1 on the kit's own model and data."""
    from gradkit.commands import check

    old = _run(tmp_path / "old", "accelerate_job.py", "--sync-each-batch", stack={"accelerate": "0.30.1"})
    for r in old:
        assert r["verdict"] == oracle.AFFECTED and r["matches"] == "global mean / GA", r["line"]
        assert r["ga"] == 1 and "after 1 of the 4" in r["short_window"] and r["known"].startswith("ACC (")
        assert r["measured"]["metrics"]["norm_ratio"] == pytest.approx(0.25, abs=1e-5)
    cfg = tmp_path / "acc.yaml"
    cfg.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\ngradient_accumulation_steps: 4\nmixed_precision: no\n")
    code = check.main([str(cfg), "--path", "accelerate", "--sync-each-batch", "--accelerate", "0.30.1"])
    assert code == 1, capsys.readouterr().out
    new = _run(tmp_path / "new", "accelerate_job.py", "--sync-each-batch", stack={"accelerate": "0.31.0"})
    assert [r["verdict"] for r in new] == [oracle.NOT_AFFECTED] * 2 and all(r["ga"] == 4 for r in new)


@pytest.mark.world
def test_trls_sft_trainer_takes_the_same_callback_exact_where_it_means_the_token_mean_and_named_where_not(tmp_path):
    """TRL's ``SFTTrainer`` (a Trainer subclass, its own loss through a fused LM head patched onto the model) with
    packing at its default bf16: not-affected. With ``average_tokens_across_devices=False`` each rank divides by its
    own tokens: affected, each step named "each rank's own mean" (rank 0's micro-batches over-weighted, rank 1's
    under), the second one clipped by its own norm."""
    packed = _run(tmp_path / "p", "trl_job.py", "--packing")
    assert [r["verdict"] for r in packed if "measured" in r] == [oracle.NOT_AFFECTED] * 2, [r["line"] for r in packed]
    assert all(r["dtype"] == "bf16" and r["loss"] == "mean over label tokens" for r in packed if "measured" in r)
    per_rank = _run(tmp_path / "r", "trl_job.py", "--fp32", "--per-rank-mean")
    steps = [r for r in per_rank if "measured" in r]
    assert [r["verdict"] for r in steps] == [oracle.AFFECTED] * 2, [r["line"] for r in steps]
    for r in steps:  # step 2's sum reaches the clip (1.0): it is clipped by its own norm, and named all the same
        assert r["matches"] == "each rank's own mean", r["line"]


FAULTS = ("capture", "read", "copy", "reference", "judgement", "records", "report")


def _job(tmp_path, *args, env=None):
    out = tmp_path / "watch"
    rc, stdout, stderr = watch.launch("trainer_job.py", [*args, "--out", out], env=env, timeout_s=240)
    lines = {int(x.split(": step ")[1].split(":")[0]): x for x in stdout.splitlines()
             if x.startswith("gradkit watch: step ") and "logged grad norm" not in x}
    losses = re.findall(r"'loss': '?([0-9.e-]+)", stdout)
    return rc, lines, losses, stdout + stderr


@pytest.mark.world
def test_a_fault_of_the_watch_in_any_phase_ends_its_step_as_cannot_run_and_training_goes_on_unchanged(tmp_path):
    """The watch's first rule: a fault planted in each of its phases, one step each, on rank 0 of a real 2-rank
    Trainer job (kit/watch/guard.py): the job finishes, each step says cannot-run with the fault's own sentence, the
    next step is judged again, and the losses the Trainer logs are those of the same job without the watch."""
    planted = ",".join(f"{phase}@{k}" for k, phase in enumerate(FAULTS, start=1))
    steps = ["--steps", str(len(FAULTS) + 1), "--every", "1"]
    rc, lines, losses, said = _job(tmp_path / "faults", *steps, env={guard.FAULT_ENV: planted})
    assert rc == 0, said[-3000:]
    for k, phase in enumerate(FAULTS, start=1):
        assert lines[k].startswith(f"gradkit watch: step {k}: cannot-run"), lines[k]
        assert f"a fault planted in the watch's {phase} at step {k}" in lines[k], lines[k]
        assert "the watch failed (" in lines[k] and "could not be computed" not in lines[k], lines[k]
    assert lines[len(FAULTS) + 1].startswith(f"gradkit watch: step {len(FAULTS) + 1}: not-affected"), lines
    rc, clean, clean_losses, said = _job(tmp_path / "clean", *steps, "--no-watch")
    assert rc == 0 and clean == {}, said[-3000:]
    assert losses == clean_losses and len(losses) == len(FAULTS) + 1  # the same job without the watch: nothing changed


@pytest.mark.world
def test_a_fault_before_the_sharded_references_collectives_ends_its_step_on_every_rank(tmp_path):
    """Under ZeRO-3 the reference runs under FSDP2, whose every forward is a collective: a fault on rank 0 alone is
    agreed before them (else rank 1 would wait in a gather rank 0 never joins), the next step judged again."""
    rc, lines, _, said = _job(tmp_path, "--deepspeed", "3", env={guard.FAULT_ENV: "reference@1"})
    assert rc == 0, said[-3000:]
    assert "cannot-run (the watch failed (rank 0's reference: RuntimeError: a fault planted" in lines[1], lines
    assert lines[2].startswith("gradkit watch: step 2: not-affected"), lines


@pytest.mark.world
def test_an_error_of_the_users_own_code_reaches_the_user_as_it_would_without_the_watch(tmp_path):
    rc, lines, _, said = _job(tmp_path, "--user-error", "2")
    assert rc != 0 and "ValueError: the user's own error at step 2" in said, said[-3000:]
    assert lines[1].startswith("gradkit watch: step 1: not-affected") and 2 not in lines
