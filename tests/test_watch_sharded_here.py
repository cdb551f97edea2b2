"""The sharded reference (``gradkit.watch.sharded``) in this process, one rank in a one-rank gloo group: the same
comparisons as test_watch_sharded.py's 2-rank worlds (the whole copy's reference against the sharded one, under the
user's FSDP2 and on ZeRO-3's layout; the control catching a read that shifts or misses a piece; nothing of the copy
left after the judged step), in seconds, so that a defect in the sharded reference fails the mutation run's fast
stage. What needs two ranks (a rank's chunk, ranks with unequal micro-batches) stays the worlds'."""
import pytest

import tests.test_watch_sharded as worlds


pytestmark = pytest.mark.usefixtures("one_rank")  # tests/conftest.py: a one-rank gloo world in this process


@pytest.fixture(autouse=True)
def w1(monkeypatch):
    monkeypatch.setattr(worlds, "W", 1)


@pytest.mark.parametrize("engine", ["fsdp2", "zero3"])
def test_the_sharded_reference_is_the_whole_one_to_the_fp32_limit(engine):
    r = worlds._compare(0, None, engine)
    assert r["kind"] == ("sharded parameters" if engine == "fsdp2" else "fp32 partitions")
    assert r["per_rank"] == [3] and r["gathered"] == 0
    assert r["rel"] < 1e-6, r
    assert r["rr"][1] == pytest.approx(r["rr"][0], rel=1e-6) and r["top"][1] == pytest.approx(r["top"][0], rel=1e-5)
    assert r["counts"][0] == r["counts"][1] and r["basis"] < 1e-6 and r["parts"] < 1e-6
    whole, shard = r["held"]
    assert shard["copy"] <= whole["copy"] * 1.05 and shard["gradient"] <= whole["gradient"] * 1.05


def test_the_control_still_catches_a_read_that_shifts_or_misses_a_piece(tmp_path):
    r = worlds._control(0, str(tmp_path))
    assert r["clean"][0] == "not-affected" and r["clean"][1] == "sharded", r
    for fault in ("shifted", "missing"):
        assert r[fault][0] == "inconclusive" and "control" in r[fault][1], r[fault]


@pytest.mark.parametrize("shard", [True, False], ids=["sharded", "whole"])
def test_nothing_of_the_reference_stays_after_the_judged_step(tmp_path, shard):
    r = worlds._released(0, str(tmp_path), shard=shard)
    assert r["verdicts"] == ["not-affected"] * 2 and r["pending"]
    assert r["made"] > 0 and r["alive"] == 0, r
