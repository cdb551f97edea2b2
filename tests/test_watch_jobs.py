"""The watch in real 2-rank training jobs (``examples/watch``), run as users run them (torchrun): a release that has
the bug is ``affected`` and named, one that does not is ``not-affected``, and the verdict agrees with the replica's
(``gradkit check``) where both can judge."""
import json
from pathlib import Path

import pytest

from kit.judge import oracle
from kit.launch import scripts

JOBS = Path(__file__).resolve().parent.parent / "examples" / "watch"


def _run(tmp_path, script, *args, stack=None):
    out = tmp_path / "watch"
    rc, stdout, stderr = scripts.torchrun(JOBS / script, [*args, "--out", out], stack=stack, kit_on_path=True,
                                          timeout_s=240)
    assert rc == 0, (stdout + stderr)[-3000:]
    recs = [json.loads(x) for x in (out / "watch.jsonl").read_text().splitlines()]
    lines = [x for x in stdout.splitlines() if x.startswith("gradkit watch: ")]
    assert lines == [r["line"] for r in recs]  # one line in the training log per judged step
    return recs


@pytest.mark.world
def test_zero2_with_several_backwards_per_step_is_b3_and_deepspeeds_own_loop_is_not(tmp_path):
    manual = _run(tmp_path / "m", "deepspeed_job.py", "--stage", "2", "--loop", "manual")
    assert [r["verdict"] for r in manual] == [oracle.AFFECTED] * 2
    for r in manual:
        assert r["matches"] == "last micro-batch / N" and r["known"].startswith("B3 ("), r["line"]
        assert r["read"] == "fp32 partitions" and r["optimizer"] == "DeepSpeedZeroOptimizer"
        weights = r["measured"]["attribution"]["weights"][:8]
        assert weights == pytest.approx([0, 0, 0, 1 / 8] * 2, abs=1e-5)  # each rank's last micro-batch only
    engine = _run(tmp_path / "e", "deepspeed_job.py", "--stage", "2", "--loop", "engine")
    assert [r["verdict"] for r in engine] == [oracle.NOT_AFFECTED] * 2, [r["line"] for r in engine]
    assert all(r["measured"]["metrics"]["rel_l2"] < 1e-5 for r in engine)


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
