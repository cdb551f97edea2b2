"""The check of a DeepSpeed config as its ranks run it (``gradkit.probes.ranks.ds_config``), in this process: one rank
in a one-rank gloo group, DeepSpeed's own engine, and the kit's whole path from the resolved config to the verdict
(``gradkit.probes.ds_config.run``, the world's launch replaced by a call here). The same code runs in every rank of
the world tests (test_check.py, test_check_corpus.py, test_shapes.py); here each behaviour takes a second or two, so
a defect in the rank's code fails a test of the mutation run's fast stage and of ``--changed`` (issue 58). A bug that
needs two ranks (a partition, a rank's own boundary) stays the world tests'."""
import importlib

import pytest

from gradkit import shapes
from gradkit.judge import naming, oracle, records
from gradkit.probes import ds_config, runner
from gradkit.probes.ranks import ds_config as ranks

MB = {"train_micro_batch_size_per_gpu": 4}


@pytest.fixture(scope="module", autouse=True)
def here(deepspeed_here):
    """A one-rank world in this process (tests/conftest.py's ``deepspeed_here``), ``run_world`` calling the rank's
    target here."""
    def run_here(target, payload, world=None, on_partial=None, **kw):
        module, fn = target.split(":")
        return [getattr(importlib.import_module(module), fn)(payload)]

    deepspeed_here.setattr(runner.launch, "run_world", run_here)
    yield


STEPS = 2  # a step, and one with what the first left behind


def check(user: dict, ga: int, loops=ds_config.LOOPS, model=None) -> list[dict]:
    return ds_config.run(ds_config.resolve({**MB, **user}, 1, ga, "fp32"), loops, world_size=1, model=model,
                         steps=STEPS)


def steps_of(r: dict, key: str) -> list:
    return [s.get(key) for s in r["steps"]]


def test_b3s_pattern_keeps_the_last_micro_batch_in_the_users_loop_and_every_other_loop_and_the_fix_are_exact():
    recs = check({"gradient_accumulation_steps": 1, "zero_optimization": {"stage": 2}}, 4)
    for name in ("control", "engine", "boundary", "unmanaged", "manual fix:B3"):
        r = records.one(recs, case=name)
        assert r["verdict"] == oracle.NOT_AFFECTED and r["matches"] == "global mean", (name, r["reason"])
        assert all(w == pytest.approx(0.25, abs=1e-5) for w in r["steps"][0]["attribution"]["weights"])
    manual = records.one(recs, case="manual")
    assert manual["verdict"] == oracle.AFFECTED and manual["matches"] == "last micro-batch / N", manual["reason"]
    assert manual["steps"][0]["attribution"]["weights"] == pytest.approx([0, 0, 0, 0.25], abs=1e-5)
    assert manual["steps"][1]["attribution"]["weights"][:4] == pytest.approx([0, 0, 0, 0.25], abs=1e-5)
    assert [records.one(recs, case=c)["engine_ga"] for c in ("control", "engine", "manual")] == [4, 4, 1]
    assert records.one(recs, case="control")["optimizer"] == "torch.optim.SGD"
    assert records.one(recs, case="engine")["optimizer"] == "DeepSpeedZeroOptimizer"
    assert all(len(r["steps"]) == STEPS for r in recs)


def test_every_loop_on_zero3_is_exact_through_its_partitions():
    for r in check({"gradient_accumulation_steps": 2, "zero_optimization": {"stage": 3}}, 2):
        assert r["verdict"] == oracle.NOT_AFFECTED and r["matches"] == "global mean", (r["case"], r["reason"])
        assert r["config_stripped"] == [] and "replicas" not in r
    assert records.one(check({"zero_optimization": {"stage": 3}}, 2, ("engine",)), case="engine")[
        "optimizer"] == "DeepSpeedZeroOptimizer_Stage3"


def test_a_dynamic_fp16_scale_skips_its_overflow_on_both_sides_and_the_step_where_it_grows_is_b10s_half_step():
    recs = check({"gradient_accumulation_steps": 4, "fp16": {"enabled": True, "loss_scale_window": 2,
                                                              "initial_scale_power": 8, "opt_level": "O2"},
                  "zero_optimization": {"stage": 1}}, 4, ("engine",))
    control, engine, fix = (records.one(recs, case=c) for c in ("control", "engine", "engine fix:B10"))
    skipped = ds_config.OVERFLOW_STEP
    for r in (control, engine):  # the overflow: nothing applied by either, said as skipped
        assert steps_of(r, "skipped") == [True if s == skipped else None for s in range(ds_config.DYNAMIC_STEPS)]
        assert r["steps"][skipped]["attribution"]["weights"] == pytest.approx([0.0] * 8, abs=1e-6)
    scales = list(zip(steps_of(engine, "loss_scale"), steps_of(engine, "loss_scale_after")))
    assert scales[0] == (256.0, 256.0) and (256.0, 512.0) in scales  # the window of 2 clean steps doubles it
    grew = scales.index((256.0, 512.0))
    assert engine["steps"][grew]["matches"] == naming.SCALE_GREW, engine["steps"][grew]
    assert engine["steps"][grew]["attribution"]["weights"][:4] == pytest.approx([0.125] * 4, abs=1e-4)
    assert engine["verdict"] == oracle.AFFECTED and engine["matches"] == naming.SCALE_GREW
    others = [s for i, s in enumerate(engine["steps"]) if i not in (grew, skipped)]
    assert all(s["matches"] == "global mean" for s in others)
    assert fix["verdict"] == oracle.NOT_AFFECTED and set(steps_of(fix, "loss_scale")) == {ds_config.FIX_SCALE}
    assert control["verdict"] == oracle.NOT_AFFECTED and control["optimizer"] == "torch.optim.SGD"
    assert steps_of(control, "loss_scale") == steps_of(control, "loss_scale_after") == [None] * ds_config.DYNAMIC_STEPS
    # a key this release's parser refuses is dropped, said, and the rest judged
    assert engine["config_stripped"] == ["fp16.opt_level: Extra inputs are not permitted"]
    assert any("refuses fp16.opt_level" in n for n in engine["config_notes"])


def test_a_clip_is_made_to_act_in_every_step_and_the_engine_is_judged_against_the_clipped_reference():
    recs = check({"gradient_accumulation_steps": 2, "gradient_clipping": 1.0, "zero_optimization": {"stage": 2}}, 2,
                 ("engine",))
    for r in recs:
        assert r["verdict"] == oracle.NOT_AFFECTED, (r["case"], r["reason"])
        coef = steps_of(r, "clip_coef")
        assert coef[0] == pytest.approx(0.5, rel=1e-4) and all(0 < c < 1 for c in coef)  # twice the clip at step 1
    sh = shapes.get(shapes.DEFAULT)
    scale = ranks.loss_scale(1, 2, 1.0, sh)
    assert ranks.case_loss_scale({"clip": 1.0}, 1, 2, 1.0, sh) == scale != 1.0
    assert ranks.loss_scale(1, 2, 0.0, sh) == 1.0 and ranks.case_loss_scale({}, 1, 2, 0.0, sh) == 1.0
    assert ranks.loss_scale(1, 2, 2.0, sh) == pytest.approx(2 * scale)
    # bf16 / fp16 masters, no clip: the first step a fixed share of the weights' norm, far above their rounding
    # (2**-9 of the weights in bf16) and well below the weights themselves
    model = sh.build(ranks.SEED, ranks.HIDDEN, ranks.DEPTH)
    every = [b for b in sh.micro_batches(ranks.SEED, 0, 2, ranks.MICRO_BATCH, ranks.HIDDEN, 0)]
    reference = ranks.oracle.reference_gradients(model, every, sh.loss_fn)[2]
    share = ranks.loss_scale(1, 2, 0.0, sh, "bf16") * reference.norm().item() / ranks.c.flat_params(model).norm().item()
    assert share == pytest.approx(ranks.MASTERS_STEP) and 64 * 2 ** -9 < share < 0.5
    # one cached scale per shape: two shapes never share one
    tied = shapes.get("tied")
    assert ranks.case_loss_scale({"model": "tied"}, 1, 2, 1.0, tied) == ranks.loss_scale(1, 2, 1.0, tied) != scale


def test_the_controls_own_broken_loops_are_judged_as_what_they_break():
    def case(name, model, fault=None, stale=False):
        cfg = {**({ranks.LOOP_FAULT_KEY: fault} if fault else {}), **({ranks.STALE_FAULT_KEY: True} if stale else {})}
        return {"name": name, "role": "control" if name.startswith("control") else "measured", "loop": "torch",
                "ga": 4, "dtype": "fp32", "zero_stage": None, "steps": 2, "clip": 0.0, "model": model, "ds_config": cfg}

    recs = runner.run(ds_config.CHECK, [case("control", "mlp"), case("stale", "mlp", stale=True),
                                        case("control conditional", "conditional"),
                                        case("drop", "conditional", "drop:expert skip_last:1"),
                                        case("control frozen", "frozen"), case("frozen", "frozen", "train_frozen"),
                                        case("control tied", "tied"), case("untie", "tied", "untie")], [{}], (1,))
    stale = records.one(recs, case="stale")
    assert stale["steps"][0]["matches"] == "global mean" and stale["steps"][1]["matches"] == ranks.STALE
    assert records.one(recs, case="drop")["steps"][0]["groups"]["expert skip_last"]["lost"] == "rank 0 micro-batch 2"
    for name in ("stale", "drop", "frozen", "untie"):
        assert records.one(recs, case=name)["verdict"] == oracle.AFFECTED, name
    for name in ("control", "control conditional", "control frozen", "control tied"):
        assert records.one(recs, case=name)["verdict"] == oracle.NOT_AFFECTED, name


def test_a_refusal_of_the_config_the_kit_runs_is_put_to_deepspeed_as_written_and_blamed_on_whichever_refused():
    cfg = ds_config.resolve({**MB, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 2},
                             ranks.REFUSE_FAULT_KEY: 1}, 1, 2, "fp32")
    (r,) = [r for r in ds_config.run(cfg, ("engine",), world_size=1) if r["case"] == "engine"]
    assert r["verdict"] == oracle.CANNOT_RUN and r["failed_in"] == "initialize"
    assert "the config as written passes it: the kit's change is to blame" in r["reason"]
    case = {"ds_written": {**MB, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 9}}}
    import deepspeed

    said = ranks.ask_as_written(deepspeed, case, shapes.get("mlp").build(0, 8, 2), ValueError("the kit's"))
    assert isinstance(said, ranks.RefusedAsWritten) and "stage" in str(said)
    assert ranks.ask_as_written(deepspeed, {}, None, ValueError("as it was")).args == ("as it was",)

    class Refuses:  # DeepSpeed's own sentence, cut at 400 characters
        @staticmethod
        def initialize(**kw):
            raise ValueError("x" * 1000)

    said = ranks.ask_as_written(Refuses, case, shapes.get("mlp").build(0, 8, 2), ValueError("the kit's"))
    assert str(said) == "ValueError: " + "x" * 400

    class Accepts:  # the config as written passes: the kit's change is to blame, its error cut alike
        @staticmethod
        def initialize(**kw):
            return object(), None, None, None

    said = ranks.ask_as_written(Accepts, case, shapes.get("mlp").build(0, 8, 2), KeyError("y" * 1000))
    assert isinstance(said, ranks.RefusedAsRun) and str(said) == "KeyError: '" + "y" * 399


def test_fp16_is_declared_supported_on_a_cpu_only_and_where_it_is_not_already(monkeypatch):
    import types

    for device, supported, want in (("cpu", False, True), ("cuda", False, False), ("cpu", True, True)):
        accelerator = types.SimpleNamespace(device_name=lambda device=device: device,
                                            is_fp16_supported=lambda supported=supported: supported)
        monkeypatch.setattr("deepspeed.accelerator.get_accelerator", lambda accelerator=accelerator: accelerator)
        before = accelerator.is_fp16_supported
        ranks.allow_fp16_on_cpu()
        assert accelerator.is_fp16_supported() is want, device
        assert (accelerator.is_fp16_supported is before) is (device != "cpu" or supported)  # left as it was


def test_each_named_step_weighs_the_rank_major_basis_as_its_definition_says():
    k = 6  # W = 2 ranks x N = 3 micro-batches, rank r's micro-batch i at r * 3 + i; seen from rank 1
    h = ranks.hypothesis_weights(2, 3, own=1)
    assert h["global mean"] == pytest.approx([1 / k] * k)
    assert h["last micro-batch / N"] == pytest.approx([0, 0, 1 / k, 0, 0, 1 / k])
    assert h["sum of micro-batches"] == pytest.approx([1 / 2] * k)
    assert h["mean / N"] == pytest.approx([1 / (k * 3)] * k)
    assert h["own rank's boundary micro-batch"] == pytest.approx([1 / k, 1 / k, 0, 1 / k, 1 / k, 1 / 3])
    assert h["all but the first micro-batch"] == pytest.approx([0, 1 / k, 1 / k, 0, 1 / k, 1 / k])
    assert h["first and last micro-batch"] == pytest.approx([1 / k, 0, 1 / k, 1 / k, 0, 1 / k])
    assert ranks.hypothesis_weights(2, 2)["first and last micro-batch"] == [0.0] * 4  # N <= 2: that is the mean
    assert set(h) == set(ranks.HYPOTHESES)  # nothing more unless asked
    more = ranks.hypothesis_weights(2, 3, previous=True, loss_scale=4.0, scale_change=0.5)
    assert more[ranks.STALE] == pytest.approx([1 / k] * (2 * k))  # the previous step's micro-batches too
    assert more[ranks.UNSCALED] == pytest.approx([1 / (k * 4)] * k)
    assert more[naming.SCALE_GREW] == pytest.approx([0.5 / k] * k)
    assert ranks.UNSCALED not in ranks.hypothesis_weights(2, 3, loss_scale=1.0)


def test_the_stepwise_steps_are_b11s_carried_update_and_at_zero_1_2_b8s_partitions_split_as_zero_splits_them(
        monkeypatch):
    import torch

    basis = torch.arange(12.0).reshape(6, 2)
    update = torch.tensor([100.0, 200.0])
    out = ranks.stepwise_hypotheses(2, 3, update, 0, {})
    assert set(out) == {ranks.CARRIED}  # ZeRO-0: no partition of its own
    weights = torch.tensor([0, 1 / 6, 1 / 6, 0, 1 / 6, 1 / 6])  # each rank's first micro-batch lost
    assert torch.allclose(out[ranks.CARRIED](basis), weights @ basis + update)
    assert ranks.stepwise_hypotheses(2, 3, None, 0, {}) == {}
    seen = {}
    monkeypatch.setattr(ranks.naming, "local", lambda named, w, n, split: seen.update(split=split, w=w) or {"B8": 1})
    assert ranks.stepwise_hypotheses(2, 3, None, 2, {"global mean": []}) == {"B8": 1}
    assert ranks.stepwise_hypotheses(2, 3, None, 1, {"global mean": []}) == {"B8": 1}  # ZeRO-1 partitions alike
    assert seen["split"](10) == [(0, 6), (6, 10)] and seen["split"](3) == [(0, 2), (2, 3)]  # padded to 2 W
    assert ranks.stepwise_hypotheses(1, 3, None, 1, {}) == {} and ranks.stepwise_hypotheses(2, 3, None, 3, {}) == {}


def test_an_fp16_optimizers_own_scale_is_read_from_whichever_attribute_its_release_has():
    class Scaled:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    assert ranks.own_loss_scale(Scaled(loss_scale=512.0, cur_scale=2.0)) == 512.0
    assert ranks.own_loss_scale(Scaled(cur_scale=64)) == 64.0
    assert ranks.own_loss_scale(Scaled(loss_scale_config=Scaled(cur_scale=8.0))) == 8.0
    assert ranks.own_loss_scale(Scaled(loss_scale="dynamic", cur_scale=4.0)) == 4.0  # not a number: the next
    assert ranks.own_loss_scale(Scaled(loss_scale=0.0)) == 1.0 and ranks.own_loss_scale(Scaled()) == 1.0
    assert ranks.own_loss_scale(Scaled(loss_scale=0.5)) == 0.5  # a scale below 1 is a scale (DeepSpeed's minimum)


def test_the_tensor_parallel_degree_is_the_configs_autotp_size_and_one_for_the_control():
    tp = {"tensor_parallel": {"autotp_size": 2}}
    assert ranks.tp_size({"ds_config": tp}) == 2 and ranks.tp_size({"loop": "torch", "ds_config": tp}) == 1
    assert ranks.tp_size({"ds_config": {"tensor_parallel": {"tp_size": 4}}}) == 4
    assert ranks.tp_size({"ds_config": {"tensor_parallel": {"autotp_size": 0}}}) == 1
    assert ranks.tp_size({"ds_config": {"tensor_parallel": True}}) == 1 and ranks.tp_size({}) == 1


class ValidationError(Exception):  # the shape of pydantic's, as DeepSpeed's config models raise it
    def __init__(self, title, errors):
        super().__init__(title)
        self.title, self._errors = title, errors

    def errors(self):
        return self._errors


def test_only_keys_this_release_does_not_know_and_refused_loss_scaling_knobs_are_dropped_and_said():
    unknown = {"loc": ("opt_level",), "type": "extra_forbidden", "msg": "Extra inputs are not permitted"}
    knob = {"loc": ("hysteresis",), "type": "greater_than", "msg": "must be > 0"}
    other = {"loc": ("enabled",), "type": "bool_type", "msg": "not a bool"}
    assert ranks._refused_keys(ValidationError("DeepSpeedFP16Config", [unknown, knob])) == [
        ("fp16", "opt_level", unknown["msg"]), ("fp16", "hysteresis", knob["msg"])]
    assert ranks._refused_keys(ValidationError("DeepSpeedFP16Config", [unknown, other])) == []  # never papered over
    assert ranks._refused_keys(ValidationError("SomeOtherConfig", [unknown])) == []
    assert ranks._refused_keys(ValueError("DeepSpeedFP16Config")) == []
    assert ranks._refused_keys(ValidationError("DeepSpeedZeroOffloadOptimizerConfig", [{**unknown, "loc": ("x",)}])) \
        == [("zero_optimization.offload_optimizer", "x", unknown["msg"])]

    calls = []

    class Refusing:  # refuses each droppable key once, then initializes
        @staticmethod
        def initialize(model, optimizer, config):
            calls.append(dict(config["fp16"]))
            if "opt_level" in config["fp16"]:
                raise ValidationError("DeepSpeedFP16Config", [unknown])
            return "engine", optimizer, None, None

    ds = {"fp16": {"enabled": True, "opt_level": "O2"}}
    engine, stripped = ranks.initialize_leniently(Refusing, shapes.get("mlp").build(0, 8, 2), ds)
    assert engine == "engine" and stripped == ["fp16.opt_level: Extra inputs are not permitted"]
    assert ds == {"fp16": {"enabled": True}} and len(calls) == 2

    class Stubborn:
        @staticmethod
        def initialize(model, optimizer, config):
            raise ValidationError("DeepSpeedFP16Config", [unknown])

    with pytest.raises(RuntimeError, match="kept refusing"):
        ranks.initialize_leniently(Stubborn, shapes.get("mlp").build(0, 8, 2), {"fp16": {}})


def test_each_loop_style_calls_the_engine_as_that_loop_does():
    class Engine:
        def __init__(self):
            self.calls = []

        def __call__(self, x):
            return x

        def backward(self, loss):
            self.calls.append(("backward", loss))

        def step(self):
            self.calls.append(("step",))

        def set_gradient_accumulation_boundary(self, is_boundary):
            self.calls.append(("boundary", is_boundary))

    def run(loop):
        e = Engine()
        ranks._step(e, loop, [(1.0, 0), (2.0, 0)], lambda out, y: out, lambda: e.calls.append(("before",)))
        return e.calls

    assert run("engine") == [("backward", 1.0), ("step",), ("backward", 2.0), ("before",), ("step",)]
    assert run("boundary") == [("boundary", False), ("backward", 1.0), ("boundary", True), ("backward", 2.0),
                               ("before",), ("step",)]
    assert run("fix:B3") == [("boundary", False), ("backward", 0.5), ("boundary", True), ("backward", 1.0),
                             ("before",), ("step",)]
    assert run("manual") == [("backward", 0.5), ("backward", 1.0), ("before",), ("step",)]
    fn = ranks.overflowing(lambda out, y: out)
    assert [fn(1.0, 0), fn(1.0, 0)] == [ranks.OVERFLOW, 1.0]  # the first micro-batch only


def test_a_release_without_managed_accumulation_refuses_the_unmanaged_loop_only_and_every_engine_is_released(
        monkeypatch):
    class Older:  # the engine as a release before 0.19.4 has it: no managed_gradient_accumulation
        def __init__(self, engine):
            self.__dict__["engine"] = engine

        def __getattr__(self, name):
            if name == "managed_gradient_accumulation":
                raise AttributeError(name)
            return getattr(self.engine, name)

        def __call__(self, *args, **kwargs):
            return self.engine(*args, **kwargs)

    lenient = ranks.initialize_leniently
    monkeypatch.setattr(ranks, "initialize_leniently", lambda *a: (Older(lenient(*a)[0]), []))
    released = []
    real = ranks.judging.release
    monkeypatch.setattr(ranks.judging, "release", lambda engine: released.append(engine) or real(engine))
    recs = check({"gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1}}, 2, ("engine", "unmanaged"))
    assert records.one(recs, case="engine")["verdict"] == oracle.NOT_AFFECTED
    unmanaged = records.one(recs, case="unmanaged")
    assert unmanaged["verdict"] == oracle.CANNOT_RUN and unmanaged["reason"] == (
        "not available: RuntimeError: this DeepSpeed has no managed_gradient_accumulation (added in "
        f"{ranks.UNMANAGED_SINCE})")
    assert len(released) == 2 and all(e is not None for e in released)  # each engine freed; the control has none
    control = records.one(recs, case="control")  # fp32, no scaler: no loss-scale facts on any step
    assert steps_of(control, "loss_scale") == [None] * STEPS and steps_of(control, "skipped") == [None] * STEPS
