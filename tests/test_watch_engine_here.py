"""The watch on a DeepSpeed engine (``gradkit.watch.deepspeed.watch_engine``) in this process, one rank
(tests/conftest.py's ``deepspeed_here``): what the records say of the engine, DeepSpeed's own loop exact, several
backwards per step with GA 1 in the config judged as the user's manual loop and named B3, a step the fp16 scaler
skipped said as skipped, and an object that is no engine handed back unwatched. The same on 2-rank jobs:
test_watch_jobs.py."""
import deepspeed
import pytest
import torch
import torch.nn as nn

from gradkit.judge import oracle
from gradkit.probes.ranks.ds_config import allow_fp16_on_cpu
from gradkit.watch import watch_engine

pytestmark = pytest.mark.usefixtures("deepspeed_here")


def _engine(ga, stage=2, **cfg):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    if "fp16" in cfg:
        allow_fp16_on_cpu()
        model = model.half()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), config={
        "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": ga, "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage}, "gradient_clipping": 0.0, **cfg})
    return engine


def _run(engine, backwards, steps=2, per_step=False, dtype=torch.float32, tmp=None, first_loss=1.0):
    w = watch_engine(engine, every=1, log=None, out=str(tmp), criterion=nn.MSELoss())
    crit, g = w.gradkit_watch.criterion, torch.Generator().manual_seed(1)
    for step in range(steps):
        for m in range(backwards):
            x, y = torch.randn(3, 8, generator=g).to(dtype), torch.randn(3, 2, generator=g).to(dtype)
            loss = crit(w(x), y) * (first_loss if step == 1 and m == 0 else 1.0)
            w.backward(loss / (backwards if per_step else 1))
            if not per_step:
                w.step()
        if per_step:
            w.step()
    return w.gradkit_watch.records


def test_deepspeeds_own_loop_is_exact_and_each_record_says_what_the_engine_is(tmp_path):
    recs = _run(_engine(4, gradient_clipping=0.5), 4, tmp=tmp_path)
    assert [r["verdict"] for r in recs] == [oracle.NOT_AFFECTED] * 2, [r["line"] for r in recs]
    r = recs[0]
    assert (r["zero_stage"], r["optimizer"], r["engine_ga"], r["engine_dtype"], r["clip"]) == (
        2, "DeepSpeedZeroOptimizer", 4, None, 0.5)
    assert r["versions"]["deepspeed"] == deepspeed.__version__ and r["ds_config"]["zero_optimization"]["stage"] == 2


def test_several_backwards_per_step_with_ga_1_in_the_config_is_the_manual_loop_and_named_b3(tmp_path):
    recs = _run(_engine(1), 4, per_step=True, tmp=tmp_path)
    assert [r["verdict"] for r in recs] == [oracle.AFFECTED] * 2, [r["line"] for r in recs]
    assert recs[0]["engine_ga"] == 1 and recs[0]["ga"] == 4
    assert recs[0]["matches"] == "last micro-batch / N" and recs[0]["known"].startswith("B3"), recs[0]["known"]


def test_a_step_the_fp16_scaler_skips_is_said_as_skipped(tmp_path):
    engine = _engine(2, stage=1, fp16={"enabled": True, "initial_scale_power": 8})
    recs = _run(engine, 2, steps=3, dtype=torch.half, tmp=tmp_path, first_loss=2.0 ** 24)
    assert [r["verdict"] for r in recs] == [oracle.NOT_AFFECTED, "skipped", oracle.NOT_AFFECTED], \
        [r["line"] for r in recs]
    assert recs[0]["engine_dtype"] == "fp16" and recs[0]["loss_scale"] == 256.0
    assert _run(_engine(2), 2, steps=1, tmp=tmp_path / "fp32")[0]["loss_scale"] == 1.0  # no scaler: 1


def test_an_object_that_is_no_engine_comes_back_unwatched_saying_why(capsys):
    thing = object()
    assert watch_engine(thing) is thing
    assert capsys.readouterr().out.startswith("gradkit watch: cannot watch this engine (AttributeError")


def test_a_step_is_explained_as_the_check_explains_the_loop_it_came_from(monkeypatch):
    """GA 1 in the engine's config and more micro-batches than one in the step: the user's manual loop; else the
    engine's own. The engine's config goes with it, and the user's model (whether a step reaches every parameter is
    not known)."""
    from gradkit.watch import deepspeed as wd

    seen = []
    monkeypatch.setattr(wd.kknown, "explain", lambda rec: seen.append(rec) or ("B3", "the check's sentence"))
    cfg = {"zero_optimization": {"stage": 2}}
    for rec, loop in (({"engine_ga": 1, "ga": 4}, "manual"), ({"engine_ga": 1, "ga": 2}, "manual"),
                      ({"engine_ga": 1, "ga": 1}, "engine"), ({"engine_ga": 1}, "engine"),
                      ({"engine_ga": 4, "ga": 4}, "engine"), ({"ga": 4}, "engine")):
        assert wd.explain({**rec, "ds_config": cfg}) == "the check's sentence"
        assert seen[-1]["config"] == {"loop": loop, "ds_config": cfg, "model_config": "user's"}, rec
        assert seen[-1]["ga"] == rec.get("ga")
    wd.explain({"engine_ga": 4, "ga": 4})
    assert seen[-1]["config"]["ds_config"] == {}
