"""The watch in real 2-rank training jobs (``examples/watch``), run as users run them (torchrun): a release that has
the bug is ``affected`` and named, one that does not is ``not-affected``, and the verdict agrees with the replica's
(``gradkit check``) where both can judge."""
import json

import pytest

from gradkit.judge import oracle
from gradkit.notebooks import watch



def _run(tmp_path, script, *args, stack=None, paths=()):
    out = tmp_path / "watch"
    rc, stdout, stderr = watch.launch(script, [*args, "--out", out], stack=stack, timeout_s=240, paths=paths)
    assert rc == 0, (stdout + stderr)[-3000:]
    recs = [json.loads(x) for x in (out / "watch.jsonl").read_text().splitlines()]
    lines = [x for x in stdout.splitlines() if x.startswith("gradkit watch: ")]
    assert lines == [r["line"] for r in recs]  # one line in the training log per judged step
    return recs


@pytest.mark.world
def test_zero2_with_several_backwards_per_step_is_b3_and_deepspeeds_own_loop_is_not_as_gradkit_check_says(
        tmp_path, capsys):
    """The watch on the real job, and the replica (``gradkit check`` on the job's own DeepSpeed config, the kit's toy
    model) give the same verdict per loop and name the same bug."""
    from gradkit.commands import check

    manual = _run(tmp_path / "m", "deepspeed_job.py", "--stage", "2", "--loop", "manual")
    assert [r["verdict"] for r in manual] == [oracle.AFFECTED] * 2
    for r in manual:
        assert r["matches"] == "last micro-batch / N" and r["known"].startswith("B3 ("), r["line"]
        assert r["read"] == "fp32 partitions" and r["optimizer"] == "DeepSpeedZeroOptimizer"
        assert r["reference"] == "whole"  # ZeRO-2: every rank holds the model anyway
        weights = r["measured"]["attribution"]["weights"][:8]
        assert weights == pytest.approx([0, 0, 0, 1 / 8] * 2, abs=1e-5)  # each rank's last micro-batch only
    engine = _run(tmp_path / "e", "deepspeed_job.py", "--stage", "2", "--loop", "engine")
    assert [r["verdict"] for r in engine] == [oracle.NOT_AFFECTED] * 2, [r["line"] for r in engine]
    assert all(r["measured"]["metrics"]["rel_l2"] < 1e-5 for r in engine)
    cfg = dict(engine[0]["ds_config"])
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(cfg))  # GA 4 in the config: the check runs each loop style from it
    code = check.main([str(path), "--loop", "engine,manual", "--json", str(tmp_path / "check.json")])
    capsys.readouterr()
    loops = {r["loop"]: r for r in json.loads((tmp_path / "check.json").read_text())["summary"]["loops"]}
    assert code == 1 and loops["manual"]["explained_by"] == "B3"
    for loop, recs in (("manual", manual), ("engine", engine)):
        assert {r["verdict"] for r in recs} == {loops[loop]["verdict"]}, loop


@pytest.mark.world
def test_bf16_optimizer_leaks_on_0_18_9_in_each_ranks_partition_and_not_on_the_installed_release(tmp_path):
    args = ("--stage", "1", "--loop", "engine", "--dtype", "bf16", "--grad-accum-dtype", "fp32")
    old = _run(tmp_path / "old", "deepspeed_job.py", *args, stack={"deepspeed": "0.18.9"})
    for r in old:
        assert r["verdict"] == oracle.AFFECTED and r["optimizer"] == "BF16_Optimizer", r["line"]
        assert r["partitions"] == ["own rank's boundary micro-batch"] * 2 and r["known"].startswith("B4 (")
    new = _run(tmp_path / "new", "deepspeed_job.py", *args)
    assert [r["verdict"] for r in new] == [oracle.NOT_AFFECTED] * 2, [r["line"] for r in new]
    assert all(r["dtype"] == "bf16" for r in new)


@pytest.mark.world
def test_zero3_steps_a_head_no_micro_batch_reached_with_its_old_gradient_b6(tmp_path):
    recs = _run(tmp_path, "deepspeed_job.py", "--stage", "3", "--loop", "engine", "--model", "heads")
    assert [r["verdict"] for r in recs] == [oracle.NOT_AFFECTED, oracle.AFFECTED], [r["line"] for r in recs]
    step2 = recs[1]
    assert step2["read"] == "fp32 partitions" and step2["known"].startswith("B6 (")
    assert [r["reference"] for r in recs] == ["sharded"] * 2  # ZeRO-3 shards the model: so does the reference
    stale = [g for g in step2["measured"]["groups"] if "no gradient of its own" in g]
    assert sorted(g.split(" (")[0] for g in stale) == ["heads.1.bias", "heads.1.weight"]


@pytest.mark.world
def test_fsdp2_sharded_gradients_read_whole_are_exact_and_a_loop_that_sums_is_affected(tmp_path):
    """FSDP2 needs torch alone, and so does the watch: the exact job runs where numpy cannot be imported (torch does
    without it, but its ``all_gather_object`` does not: the watch's collectives gather tensors)."""
    (tmp_path / "no_numpy" / "numpy").mkdir(parents=True)
    (tmp_path / "no_numpy" / "numpy" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n")  # as where it is not installed
    right = _run(tmp_path / "right", "fsdp2_job.py", paths=[tmp_path / "no_numpy"])
    assert [r["verdict"] for r in right] == [oracle.NOT_AFFECTED] * 2, [r["line"] for r in right]
    assert all(r["read"] == "sharded parameters" and r["measured"]["metrics"]["rel_l2"] < 1e-6 for r in right)
    assert all(r["reference"] == "sharded" and r["held_bytes"]["copy"] < r["held_bytes"]["reference pieces"] * 1.05
               for r in right)  # each rank its chunk: the reference as sharded as the job
    summed = _run(tmp_path / "sum", "fsdp2_job.py", "--loop", "sum")
    for r in summed:
        assert r["verdict"] == oracle.AFFECTED and r["matches"] == "sum of micro-batches", r["line"]
        assert r["measured"]["metrics"]["norm_ratio"] == pytest.approx(4.0, rel=1e-5)


@pytest.mark.world
def test_offloaded_optimizers_are_read_from_their_cpu_partitions_and_a_manual_loop_on_them_is_named(tmp_path, capsys):
    """``offload_optimizer: cpu`` (a torch optimizer, ``zero_force_ds_cpu_optimizer: false``): the fp32 partitions the
    optimizer steps live on the CPU. DeepSpeed's own loop on ZeRO-3 is exact. ZeRO-2's manual loop (config GA 1, four
    backwards, one step) on the installed release drops each step's first micro-batch and carries the CPU
    accumulator of the others into the next step (the accumulate-in-CPU path #7981 added for several backwards per
    step, without ``set_gradient_accumulation_boundary``); the replica (``gradkit check``) is affected too."""
    from gradkit.commands import check

    engine = _run(tmp_path / "e", "deepspeed_job.py", "--stage", "3", "--loop", "engine", "--offload")
    assert [r["verdict"] for r in engine] == [oracle.NOT_AFFECTED] * 2, [r["line"] for r in engine]
    assert all(r["measured"]["metrics"]["rel_l2"] < 1e-5 for r in engine)
    assert engine[0]["ds_config"]["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    manual = _run(tmp_path / "m", "deepspeed_job.py", "--stage", "2", "--loop", "manual", "--offload")
    assert [r["verdict"] for r in manual] == [oracle.AFFECTED] * 2, [r["line"] for r in manual]
    first = [0, 1 / 8, 1 / 8, 1 / 8] * 2  # every micro-batch but each rank's first, at its right weight
    assert manual[0]["measured"]["attribution"]["weights"] == pytest.approx(first, abs=1e-5)
    assert manual[1]["measured"]["attribution"]["weights"] == pytest.approx(first * 2, abs=1e-5)  # + the last step's
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(manual[0]["ds_config"]))
    code = check.main([str(path), "--loop", "manual", "--json", str(tmp_path / "check.json")])
    capsys.readouterr()
    loops = {r["loop"]: r for r in json.loads((tmp_path / "check.json").read_text())["summary"]["loops"]}
    assert code == 1 and loops["manual"]["verdict"] == oracle.AFFECTED
