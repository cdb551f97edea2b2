"""The probes' shared judging pieces (``gradkit.probes.ranks.common``) in one process with a one-rank gloo group: a
plain SGD loop whose exact gradient is known, with a defect planted in the loop, must be judged as that defect, step by
step. The same code runs inside every rank of the world tests; here each behaviour has a test that takes seconds, so a
defect planted in common.py fails one (issue 27's mutation runs use these as their fast stage)."""
import math

import pytest
import torch

from gradkit import shapes
from gradkit.judge import oracle, records, tolerances
from gradkit.probes.ranks import common as c
from gradkit.probes.ranks import judging

SEED, HIDDEN, MB, DEPTH = 0, 8, 3, 2


pytestmark = pytest.mark.usefixtures("one_rank")  # tests/conftest.py: a one-rank gloo world in this process


def loop(ga, steps=2, div=None, keep_grads=False, drop_last=False, clip=0.0, scale=1.0, shape="mlp", **kw):
    """A plain SGD loop (lr = 1) judged by ``judge_steps``; the arguments plant one defect each."""
    sh = shapes.get(shape)
    model = sh.build(SEED, HIDDEN, DEPTH)
    opt = c.sgd(model)

    def take(step, batches):
        for i, (x, y) in enumerate(batches):
            if drop_last and i == ga - 1:
                continue
            (sh.loss_fn(model(x), y) * scale / (div or ga)).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip * scale)
        opt.step()
        if not keep_grads:
            opt.zero_grad(set_to_none=True)
        return 1.5, {"step": step}

    return judging.judge_steps(steps, lambda: judging.plain_read(model), take, seed=SEED, ga=ga, micro_batch=MB, hidden=HIDDEN,
                         depth=DEPTH, clip=clip, loss_scale=scale, shape=sh, **kw)


def verdict(out, dtype="fp32"):
    control = {"metrics": {"rel_l2": 0.0, "norm_ratio": 1.0, "cosine": 1.0}, "dtype": dtype}
    return oracle.verdict(records.judged({**out, "dtype": dtype}), control)[0]


def test_a_correct_loop_is_exact_at_every_step_with_each_micro_batch_weighed_one_over_ga():
    out = loop(ga=4, steps=3)
    assert [s["step"] for s in out["steps"]] == [0, 1, 2]
    for s in out["steps"]:
        assert s["metrics"]["rel_l2"] < 1e-6 and abs(s["metrics"]["norm_ratio"] - 1) < 1e-6
        w = s["attribution"]["weights"]
        assert len(w) == (4 if s["step"] == 0 else 8)  # from step 1 the previous step's micro-batches join, weight 0
        assert all(abs(x - 0.25) < 1e-6 for x in w[:4]) and all(abs(x) < 1e-6 for x in w[4:])
        assert s["read"] == {"judged_from": "fp32 masters", "masters_agree": True, "max_diff": 0.0}
        assert s["logged_norm"] == 1.5 and abs(s["reference_norm"] - s["metrics"]["reference_norm"]) < 1e-12
        assert s["rank_spread"] == {"effective gradients": 0.0}
    assert out["trajectory"]["steps"] == 3 and out["trajectory"]["rel_l2"] < 1e-6
    assert verdict(out) == oracle.NOT_AFFECTED


def test_a_loop_that_sums_its_micro_batches_is_ga_times_the_reference_with_each_weight_one():
    out = loop(ga=3, div=1)
    assert verdict(out) == oracle.AFFECTED
    assert abs(out["metrics"]["norm_ratio"] - 3.0) < 1e-6 and abs(out["metrics"]["cosine"] - 1.0) < 1e-9
    assert all(abs(x - 1.0) < 1e-6 for x in out["attribution"]["weights"][:3])
    assert abs(out["trajectory"]["norm_ratio"] - 1.0) > 0.1  # the drift of the whole run, errors compounded


def test_a_gradient_carried_into_the_next_step_is_fitted_on_the_previous_steps_micro_batches():
    """The bug class a one-step measurement cannot see: step 0 is exact, step 1 applies step 0's gradient again."""
    out = loop(ga=2, steps=3, keep_grads=True)
    first, second = out["steps"][0], out["steps"][1]
    assert first["metrics"]["rel_l2"] < 1e-6
    assert all(abs(x - 0.5) < 1e-6 for x in second["attribution"]["weights"])  # 2 now + 2 from step 0, each 1/2
    assert abs(second["attribution"]["misplaced_weight"] - 0.5) < 1e-6  # 0.5 x the sum of |w - expected|, 2 x 1/2
    assert out["worst_step"] in (1, 2) and out["step"] == out["worst_step"] and verdict(out) == oracle.AFFECTED


def test_a_dropped_micro_batch_has_weight_zero_where_the_others_keep_theirs():
    out = loop(ga=4, steps=1, drop_last=True)
    w = out["attribution"]["weights"]
    assert [round(x, 6) for x in w] == [0.25, 0.25, 0.25, 0.0]
    assert abs(out["attribution"]["misplaced_weight"] - 0.125) < 1e-6 and verdict(out) == oracle.AFFECTED


def test_a_clipped_step_is_judged_against_the_clipped_reference_with_its_coefficient():
    free = loop(ga=2, steps=1)
    clip = 0.5 * free["reference_norm"]
    out = loop(ga=2, steps=1, clip=clip)
    assert abs(out["clip_coef"] - 0.5) < 1e-6 and out["metrics"]["rel_l2"] < 1e-6 and verdict(out) == oracle.NOT_AFFECTED
    assert all(abs(x - 0.25) < 1e-6 for x in out["attribution"]["weights"])  # each micro-batch's 1/2, clipped by 1/2
    assert abs(out["reference_norm"] - free["reference_norm"]) < 1e-9  # the unclipped reference's norm
    assert "clip_coef" not in free
    unclipped = loop(ga=2, steps=1, clip=10 * free["reference_norm"])
    assert unclipped["clip_coef"] == 1.0


def test_a_scaled_loss_is_judged_against_the_reference_of_the_same_scale():
    assert verdict(loop(ga=2, steps=2, scale=8.0)) == oracle.NOT_AFFECTED
    assert verdict(loop(ga=2, steps=2, scale=8.0, div=16)) == oracle.AFFECTED  # a loop that divides by the scale too


def test_hypotheses_and_extra_measurements_see_the_world_and_the_step_they_judge():
    seen = []

    def hypotheses(w, n, previous, update=None):
        seen.append((w, n, previous, update is None))  # the previous step's applied update, from the second step
        return {"exact": [1 / n] * n + ([0.0] * n if previous else []),
                "sum": [1.0] * n + ([0.0] * n if previous else [])}

    def extra(judged, step, gathered, basis, weights, reference):
        judged["extra"] = {"step": step, "gathered": gathered, "rows": len(basis), "weights": weights.tolist()}

    out = loop(ga=2, steps=2, div=1, hypotheses=hypotheses, extra=extra)
    assert seen == [(1, 2, False, True), (1, 2, True, False)]
    assert [s["extra"] for s in out["steps"]] == [{"step": s, "gathered": {"step": s}, "rows": 2, "weights": [0.5, 0.5]}
                                                 for s in (0, 1)]
    assert all(s["hypotheses"]["best"] == "sum" for s in out["steps"]), out["steps"][0]["hypotheses"]
    for s in out["steps"]:  # the ratio each hypothesis predicts, against the step's own (unclipped) reference
        assert s["hypotheses"]["predicted_ratio"]["exact"] == pytest.approx(1.0)
        assert s["hypotheses"]["predicted_ratio"]["sum"] == pytest.approx(2.0)


def test_the_worst_step_is_the_one_reported_and_every_step_is_kept():
    out = loop(ga=2, steps=3, keep_grads=True)
    sev = [oracle.severity({**s, "dtype": "fp32"}) for s in out["steps"]]
    assert out["worst_step"] == sev.index(max(sev)) and len(out["steps"]) == 3
    assert out["metrics"] == out["steps"][out["worst_step"]]["metrics"]


def test_judging_stops_after_a_step_that_leaves_non_finite_weights():
    sh = shapes.get("mlp")
    model = sh.build(SEED, HIDDEN, DEPTH)

    def take(step, batches):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(math.inf if step == 0 else 1.0)
        return None, None

    out = judging.judge_steps(3, lambda: judging.plain_read(model), take, seed=SEED, ga=1, micro_batch=MB, hidden=HIDDEN,
                        shape=sh)
    assert len(out["steps"]) == 1 and out["trajectory"]["steps"] == 1


def test_a_judgement_that_raises_is_raised_after_every_step_is_taken():
    taken = []

    def take(step, batches):
        taken.append(step)
        return None, None

    model = shapes.get("mlp").build(SEED, HIDDEN, DEPTH)
    with pytest.raises(ValueError, match="reference|zero|nothing"):  # nothing moved: a zero effective gradient is fine,
        judging.judge_steps(3, lambda: judging.plain_read(model), take, seed=SEED, ga=1, micro_batch=MB, hidden=HIDDEN,
                      hypotheses=lambda w, n, p, u: (_ for _ in ()).throw(ValueError("nothing to explain")))
    assert taken == [0, 1, 2]  # every rank takes every step's collectives, whatever rank 0's judgement did


def test_a_shape_with_parameter_groups_is_judged_per_group():
    out = loop(ga=2, steps=1, shape="conditional")
    assert out.get("groups") and all(g["rel_err"] < 1e-6 for g in out["groups"].values())
    idx = judging.group_index(shapes.get("conditional").build(SEED, HIDDEN, DEPTH), shapes.get("conditional"))
    n = sum(p.numel() for p in shapes.get("conditional").build(SEED, HIDDEN, DEPTH).parameters())
    assert len(idx) > 1 and all(0 <= int(i.min()) and int(i.max()) < n for i in idx.values())


def test_the_read_of_a_step_uses_the_masters_only_where_both_reads_agree_with_the_module():
    before = {"module": torch.tensor([1.0, 2.0]), "masters": torch.tensor([1.5, 2.5]), "agree": True}
    after = {"module": torch.tensor([0.0, 0.0]), "masters": torch.tensor([1.0, 1.0]), "agree": True}
    assert c.applied(before, after)[0].tolist() == [0.5, 1.5] and c.applied(before, after)[1] is True
    for b, a in (({**before, "agree": False}, after), (before, {**after, "agree": False})):
        eff, agree = c.applied(b, a)
        assert eff.tolist() == [1.0, 2.0] and agree is False


def test_the_rounding_floor_is_zero_for_fp32_and_the_weights_rounding_against_the_step_otherwise():
    w = torch.full((4,), 2.0, dtype=torch.float64)
    assert c.rounding_floor(w, "fp32", 1.0) == 0.0 and c.rounding_floor(w, "bf16", 0.0) == 0.0
    expect = (w.abs() * tolerances.ROUNDING["bf16"] / 2).norm().item() / 0.5
    assert abs(c.rounding_floor(w, "bf16", 0.5) - expect) < 1e-15 and expect > 0


def test_a_step_read_from_rounded_weights_carries_its_floor():
    sh = shapes.get("mlp")
    model = sh.build(SEED, HIDDEN, DEPTH)
    opt = c.sgd(model)

    def read():
        r = judging.plain_read(model)
        return {**r, "masters": r["masters"] + 1.0, "agree": False, "max_diff": 1.0}

    def take(step, batches):
        for x, y in batches:
            (sh.loss_fn(model(x), y) / len(batches)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return None, None

    out = judging.judge_steps(1, read, take, seed=SEED, ga=2, micro_batch=MB, hidden=HIDDEN, dtype="bf16", shape=sh)
    assert out["read"] == {"judged_from": "module weights", "masters_agree": False, "max_diff": 1.0}
    assert out["read_floor"] > 0 and out["metrics"]["rel_l2"] < 1e-6
    assert "clip_coef" not in out  # no clipping unless asked for


def test_sample_shares_weigh_each_micro_batch_by_its_samples():
    batches = [(torch.zeros(n, 2), torch.zeros(n, 2)) for n in (1, 3, 4)]
    assert c.sample_shares(batches) == [1 / 8, 3 / 8, 4 / 8]
    assert c.sample_shares([(torch.zeros(2, 1), None)] * 4) == [0.25] * 4


def test_average_grads_fills_a_missing_gradient_with_zeros_and_leaves_frozen_ones():
    m = torch.nn.Linear(2, 2)
    m.bias.requires_grad_(False)
    m.weight.grad = torch.full_like(m.weight, 3.0)
    c.average_grads(m)
    assert m.weight.grad.tolist() == [[3.0, 3.0], [3.0, 3.0]] and m.bias.grad is None
    m.weight.grad = None
    c.average_grads(m)
    assert m.weight.grad.abs().sum().item() == 0.0


def test_a_reference_is_remembered_by_its_exact_starting_weights():
    sh = shapes.get("mlp")
    m = sh.build(SEED, HIDDEN, DEPTH)
    every = sh.micro_batches(SEED, 0, 2, MB, HIDDEN, 0)
    key = (SEED, 2, MB, HIDDEN, 0)
    a = judging.reference_at(m, every, sh, 1.0, key)
    assert all(torch.equal(x, y) for x, y in zip(a, judging.reference_at(m, every, sh, 1.0, key)))
    assert torch.allclose(judging.reference_at(m, every, sh, 4.0, key)[2], 4 * a[2])
    with torch.no_grad():
        next(m.parameters()).add_(1e-3)
    assert not torch.equal(judging.reference_at(m, every, sh, 1.0, key)[2], a[2])
    fresh = oracle.reference_gradients(m, every, sh.loss_fn)[2]
    assert torch.equal(judging.reference_at(m, every, sh, 1.0, key)[2], fresh)


def test_a_skeleton_holds_the_weights_it_is_given_and_at_most_eight_are_kept():
    sh = shapes.get("mlp")
    flat = c.flat_params(sh.build(SEED, HIDDEN, DEPTH))
    m = judging.skeleton(sh, SEED, HIDDEN, DEPTH, flat * 2)
    assert torch.equal(c.flat_params(m), (flat * 2).float().double())
    for h in range(10):
        judging.skeleton(sh, SEED, 4 + h, DEPTH, c.flat_params(sh.build(SEED, 4 + h, DEPTH)))
    assert len(judging._SKELETONS) == 8  # at most eight, the newest


def test_a_case_that_raises_becomes_an_error_result_and_the_next_case_still_runs():
    def run_one(case):
        with judging.phase("steps"):
            if case["name"] == "bad":
                raise ValueError("planted")
        return {"value": case["ga"]}

    out = judging.run_cases({"cases": [{"name": "bad", "ga": 1}, {"name": "good", "ga": 2}]}, run_one)
    assert [r["case"] for r in out] == ["bad", "good"] and [r["ga"] for r in out] == [1, 2]
    assert out[0]["error"] == "ValueError: planted" and "Traceback" in out[0]["traceback"] and "value" not in out[0]
    assert out[1]["value"] == 2 and "error" not in out[1]
    for r in out:
        assert r["versions"]["torch"] == torch.__version__ and r["wall_s"] >= 0
        assert set(r["phases"]) == {"steps", "other"} and r["phases"]["other"] >= 0


def test_versions_names_only_the_stack_packages_a_rank_imported():
    import sys

    v = c.versions()
    assert v["torch"] == torch.__version__
    assert ("deepspeed" in v) == ("deepspeed" in sys.modules)


def test_the_micro_batches_are_the_ranks_data_split_in_order():
    x, y = c.rank_samples(SEED, 1, 6, HIDDEN, step=2)
    parts = c.micro_batches(SEED, 1, 3, 2, HIDDEN, step=2)
    assert len(parts) == 3 and torch.equal(torch.cat([p[0] for p in parts]), x)
    assert torch.equal(torch.cat([p[1] for p in parts]), y)
    other = [c.rank_samples(SEED, 0, 6, HIDDEN, 2), c.rank_samples(SEED, 1, 6, HIDDEN, 1),
             c.rank_samples(SEED + 1, 1, 6, HIDDEN, 2)]
    assert all(not torch.equal(o[0], x) for o in other)


# ---- the reads of DeepSpeed's state, with stand-ins for its parameters and optimizers (the world tests run the real
# ones): which weights a step is read from, and where each part of them comes from

def _zero3(module, fill=None):
    """``module``'s parameters as ZeRO-3 leaves them between steps (one rank): the values in ``ds_tensor``, and
    ``p.data`` (here) filled with what the model does not compute with."""
    for p in module.parameters():
        full = p.detach().clone().reshape(-1)
        p.ds_id, p.ds_numel, p.ds_tensor = 0, full.numel(), full.clone()
        if fill is not None:
            p.data = torch.full_like(p.data, fill)  # what p.data holds is not what the model computes with
    return module


@pytest.fixture
def fake_deepspeed(monkeypatch):
    """``deepspeed.utils.safe_get_full_fp32_param`` as a stand-in: the masters a test puts in ``masters``."""
    import sys
    import types

    masters = {}
    ds, utils = types.ModuleType("deepspeed"), types.ModuleType("deepspeed.utils")
    utils.safe_get_full_fp32_param = lambda p: masters.get(id(p))
    ds.utils = utils
    monkeypatch.setitem(sys.modules, "deepspeed", ds)
    monkeypatch.setitem(sys.modules, "deepspeed.utils", utils)
    return masters


def test_a_zero3_models_weights_are_read_from_its_partitions_not_its_empty_data():
    m = _zero3(torch.nn.Linear(2, 2), fill=1e38)
    parts = c.module_parts(m)
    assert [p.numel() for p in parts] == [4, 2] and all(p.dtype == torch.float64 for p in parts)
    assert torch.equal(torch.cat(parts), torch.cat([p.ds_tensor for p in m.parameters()]).double())
    assert torch.equal(c.module_weights(m), torch.cat(parts))
    plain = torch.nn.Linear(2, 2)
    assert torch.equal(c.module_weights(plain), c.flat_params(plain))
    assert c.module_parts(torch.nn.Sequential()) == []


def test_the_masters_come_from_deepspeed_then_the_optimizers_groups_then_the_fallback(fake_deepspeed):
    m = torch.nn.Linear(2, 1)
    w, b = m.weight, m.bias
    fake_deepspeed[id(w)] = torch.full((1, 2), 5.0)
    opt = type("Opt", (), {"fp16_groups": [[b]], "fp32_groups": [[torch.full((1,), 7.0)]]})()
    assert c.full_fp32_params(m, opt).tolist() == [5.0, 5.0, 7.0]
    fallback = [torch.zeros(2), torch.full((1,), 9.0)]
    assert c.full_fp32_params(m, None, fallback).tolist() == [5.0, 5.0, 9.0]
    assert c.full_fp32_params(m).tolist() == [5.0, 5.0, b.item()]
    odd = type("Opt", (), {"fp16_groups": [b], "fp32_groups": [torch.zeros(1)]})()  # not lists of tensors: ignored
    assert c.full_fp32_params(m, odd).tolist() == [5.0, 5.0, b.item()]
    half = type("Opt", (), {"fp16_groups": [[b]], "fp32_groups": [torch.zeros(1)]})()  # one side a list: ignored too
    assert c.full_fp32_params(m, half).tolist() == [5.0, 5.0, b.item()]
    assert c.full_fp32_params(m, object(), fallback).dtype == torch.float64


def test_the_two_reads_agree_within_the_module_dtypes_rounding_and_say_how_far_apart_they_are(fake_deepspeed):
    m = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        m.weight.copy_(torch.tensor([[1.0, 2.0]]))
    fake_deepspeed[id(m.weight)] = torch.tensor([[1.0, 2.0]])
    r = c.read_weights(m, None, "fp32")
    assert r["agree"] is True and r["max_diff"] == 0.0 and r["module"].tolist() == r["masters"].tolist() == [1.0, 2.0]
    with torch.no_grad():
        m.weight.copy_(torch.tensor([[0.0, 1.00390625]]))  # a zero weight, and one exactly bf16's rounding off
    fake_deepspeed[id(m.weight)] = torch.tensor([[0.0, 1.0]])
    assert c.read_weights(m, None, "bf16")["agree"] is True
    with torch.no_grad():
        m.weight.copy_(torch.tensor([[1.0, 2.0]]))
    fake_deepspeed[id(m.weight)] = torch.tensor([[1.0, 2.002]])  # within bf16's rounding, not fp32's
    assert c.read_weights(m, None, "bf16")["agree"] is True
    r = c.read_weights(m, None, "fp32")
    assert r["agree"] is False and abs(r["max_diff"] - 0.002) < 1e-6 and r["masters"][1].item() == pytest.approx(2.002)


def test_the_engines_logged_norm_is_read_where_it_keeps_one():
    class Engine:
        def __init__(self, norm):
            self.norm = norm

        def get_global_grad_norm(self):
            return self.norm

    assert c.engine_norm(Engine(None)) is None and c.engine_norm(object()) is None
    assert c.engine_norm(Engine(torch.tensor(2.5))) == 2.5 and isinstance(c.engine_norm(Engine(3)), float)


def test_a_released_engine_is_destroyed_and_the_seed_reset():
    destroyed = []
    engine = type("E", (), {"destroy": lambda self: destroyed.append(True)})()
    torch.manual_seed(123)
    judging.release(engine)
    judging.release(object())  # an engine with nothing to destroy
    assert destroyed == [True] and torch.initial_seed() == 0


def test_finiteness_and_gathered_floats_over_the_world():
    assert c.all_finite(torch.tensor([1.0, 2.0])) is True
    assert c.all_finite(torch.tensor([1.0, float("nan")])) is False
    assert c.all_finite(torch.tensor([float("inf")])) is False
    assert c.all_gather_floats([1.5, 2.0]) == [[1.5, 2.0]]
    assert [t.tolist() for t in c.all_gather_flat(torch.tensor([3.0]))] == [[3.0]]


def test_a_models_flat_weights_load_into_another_of_its_shape():
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    assert torch.equal(c.flat_params(c.load_flat(b, c.flat_params(a))), c.flat_params(a))
    assert c.mse(torch.tensor([1.0, 3.0], dtype=torch.bfloat16), torch.tensor([0.0, 1.0])).item() == 2.5
    x = torch.tensor([1, 2])
    assert c.to_device(x, "cpu", torch.bfloat16).dtype == torch.int64  # token ids stay integers
    assert c.to_device(torch.ones(1), "cpu", torch.bfloat16).dtype == torch.bfloat16
    opt = c.sgd(a, lr=0.5)
    assert opt.defaults["lr"] == 0.5 and opt.defaults["momentum"] == 0.0 and opt.defaults["weight_decay"] == 0.0
    a.bias.requires_grad_(False)
    assert len(c.sgd(a).param_groups[0]["params"]) == 1  # only what trains


def test_a_rank_s_data_is_the_same_on_every_call_and_its_own():
    x1, y1 = c.rank_samples(3, 0, 4, HIDDEN)
    x2, y2 = c.rank_samples(3, 0, 4, HIDDEN)
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and x1.shape == (4, HIDDEN)
    teacher = torch.randn(HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(3)) / HIDDEN ** 0.5
    assert (y1 - x1 @ teacher).abs().max().item() < 1.0  # a teacher plus noise of 0.1
    assert c.rank() == 0 and c.world_size() == 1 and c.device() == torch.device("cpu")


def test_the_phases_of_a_case_add_up_their_time():
    judging._PHASES.clear()
    with judging.phase("a"):
        pass
    with judging.phase("a"):
        pass
    with pytest.raises(ValueError):
        with judging.phase("b"):
            raise ValueError
    assert set(judging._PHASES) == {"a", "b"} and all(v >= 0 for v in judging._PHASES.values())
    watch = judging.Stopwatch()
    assert 0 <= watch() < 5


def test_outside_a_world_a_process_is_rank_0_of_1():
    import subprocess
    import sys

    code = "from gradkit.probes.ranks import common as c; print(c.rank(), c.world_size())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["0", "1"]


def test_average_grads_reaches_every_trainable_parameter_after_a_frozen_one():
    m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    m[0].weight.requires_grad_(False)
    c.average_grads(m)
    assert m[0].weight.grad is None and all(p.grad is not None for p in list(m.parameters())[1:])


def test_a_model_of_one_group_is_judged_whole_only_and_one_of_two_groups_by_each_too():
    assert "groups" not in loop(ga=2, steps=1)
    assert len(loop(ga=2, steps=1, shape="no_grad_step")["groups"]) == 2


def test_a_tied_weights_uses_are_judged_against_the_scaled_loss():
    out = loop(ga=2, steps=1, shape="tied", scale=8.0)
    uses = [g["uses"] for g in out["groups"].values() if g.get("uses")]
    assert uses and all(u["misplaced_weight"] < 1e-6 for u in uses)


def test_the_shares_of_two_ranks_count_the_samples_of_both(monkeypatch):
    monkeypatch.setattr(c, "world_size", lambda: 2)
    monkeypatch.setattr(c.dist, "all_reduce", lambda t: t.mul_(2))  # the other rank holds as many samples
    batches = [(torch.zeros(n, 2), None) for n in (1, 3)]
    assert c.sample_shares(batches) == [1 * 2 / 8, 3 * 2 / 8]


def test_the_reference_cache_keeps_the_newest_only_when_it_is_over_its_size(monkeypatch):
    monkeypatch.setattr(judging, "_REFERENCE_BYTES", 1)
    sh = shapes.get("mlp")
    m = sh.build(SEED, HIDDEN, DEPTH)
    for step in range(3):
        judging.reference_at(m, sh.micro_batches(SEED, 0, 1, MB, HIDDEN, step), sh, 1.0, ("cache test", step))
    assert len(judging._REFERENCES) == 1 and next(iter(judging._REFERENCES))[2] == ("cache test", 2)


def test_a_phase_adds_the_time_between_its_start_and_end_to_its_name(monkeypatch):
    clock = iter([10.0, 10.123456, 20.0, 20.5])
    monkeypatch.setattr(judging.time, "perf_counter", lambda: next(clock))
    judging._PHASES.clear()
    with judging.phase("steps"):
        pass
    with judging.phase("steps"):
        pass
    assert judging._PHASES == {"steps": pytest.approx(0.623456)}


def test_a_cases_phases_are_kept_to_a_tenth_of_a_millisecond_and_a_long_error_is_cut(monkeypatch):
    def run_one(case):
        if case["name"] == "long":
            raise ValueError("x" * 5000)
        judging._PHASES["steps"] = 0.123456
        return {}

    out = judging.run_cases({"cases": [{"name": "timed", "ga": 1}, {"name": "long", "ga": 1}]}, run_one)
    assert out[0]["phases"]["steps"] == 0.1235
    assert out[1]["error"] == "ValueError: " + "x" * 500 and len(out[1]["traceback"]) == 3000


def test_a_rank_whose_peers_do_not_arrive_after_a_case_stops_the_world_saying_which_case(monkeypatch):
    monkeypatch.setattr(c, "world_size", lambda: 2)
    monkeypatch.setattr(c.dist, "new_group", lambda **k: "side group")

    def barrier(group, timeout, wait_all_ranks):
        assert group == "side group" and wait_all_ranks
        raise RuntimeError("Rank 1 failed to pass monitoredBarrier in 120000 ms" + "." * 400 + "\nmore")

    monkeypatch.setattr(c.dist, "monitored_barrier", barrier)
    with pytest.raises(judging.WorldDesynchronised) as e:
        judging.run_cases({"cases": [{"name": "bad", "ga": 4}]}, lambda case: (_ for _ in ()).throw(KeyError("k")))
    said = str(e.value)
    assert said.startswith("case 'bad' (GA=4) ended on rank 0 (error: KeyError: 'k') but not on every rank within 120 s: ")
    assert said.endswith(": " + ("Rank 1 failed to pass monitoredBarrier in 120000 ms" + "." * 400)[:300])


def test_the_data_and_the_judgement_default_to_the_first_step():
    assert torch.equal(c.rank_samples(SEED, 0, 4, HIDDEN)[0], c.rank_samples(SEED, 0, 4, HIDDEN, step=0)[0])
    assert torch.equal(c.micro_batches(SEED, 0, 2, 2, HIDDEN)[1][0], c.micro_batches(SEED, 0, 2, 2, HIDDEN, step=0)[1][0])
    sh = shapes.get("mlp")
    start = sh.build(SEED, HIDDEN, DEPTH)
    _, _, reference = judging.reference_at(start, sh.micro_batches(SEED, 0, 2, MB, HIDDEN, 0), sh, 1.0, ("default step", 0))
    out, *_ = judging.judge(reference.clone(), start, SEED, 2, MB, HIDDEN, shape=sh)
    assert out["metrics"]["rel_l2"] < 1e-12 and "clip_coef" not in out  # and no clipping unless asked for


def test_the_reference_cache_counts_8_bytes_a_number(monkeypatch):
    sh = shapes.get("mlp")
    m = sh.build(SEED, HIDDEN, DEPTH)
    judging._REFERENCES.clear()
    first = judging.reference_at(m, sh.micro_batches(SEED, 0, 1, MB, HIDDEN, 0), sh, 1.0, ("bytes", 0))
    monkeypatch.setattr(judging, "_REFERENCE_BYTES", 2 * first[0].numel() * 8)  # room for two
    for step in (1, 2):
        judging.reference_at(m, sh.micro_batches(SEED, 0, 1, MB, HIDDEN, step), sh, 1.0, ("bytes", step))
    assert [k[2] for k in judging._REFERENCES] == [("bytes", 1), ("bytes", 2)]
    monkeypatch.setattr(judging, "_REFERENCE_BYTES", 3 * first[0].numel() * 7)  # room for two at 8 bytes, not three
    judging.reference_at(m, sh.micro_batches(SEED, 0, 1, MB, HIDDEN, 3), sh, 1.0, ("bytes", 3))
    assert [k[2] for k in judging._REFERENCES] == [("bytes", 2), ("bytes", 3)]


def test_a_rank_uses_the_gpu_only_where_there_is_one_and_deepspeed_is_not_told_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert c.device() == torch.device("cpu")
    monkeypatch.delenv("DS_ACCELERATOR")
    assert c.device() == torch.device("cuda", 0)


def test_a_cases_other_time_is_what_its_phases_leave_and_never_below_zero():
    def run_one(case):
        judging._PHASES["steps"] = 100.0  # more than the case took: nothing is left for "other"
        return {}

    (out,) = judging.run_cases({"cases": [{"name": "a", "ga": 1}]}, run_one)
    assert out["phases"] == {"steps": 100.0, "other": 0.0}


def test_a_tied_weights_uses_are_judged_against_the_clipped_step():
    free = loop(ga=2, steps=1, shape="tied")
    out = loop(ga=2, steps=1, shape="tied", clip=0.5 * free["reference_norm"])
    uses = [g["uses"] for g in out["groups"].values() if g.get("uses")]
    assert uses and all(u["misplaced_weight"] < 1e-6 for u in uses) and verdict(out) == oracle.NOT_AFFECTED


def test_versions_name_deepspeed_where_a_rank_imported_it(fake_deepspeed):
    import sys

    sys.modules["deepspeed"].__version__ = "9.9.9"
    assert c.versions()["deepspeed"] == "9.9.9"


def test_a_probe_case_takes_two_judged_steps_by_default():
    from gradkit.probes.ranks import ddp_no_sync

    out = ddp_no_sync.run_case({"name": "control", "ga": 2, "micro_batch": MB, "hidden": HIDDEN, "seed": SEED})
    assert [s["step"] for s in out["steps"]] == [0, 1] and judging.STEPS == 2


def test_the_probes_data_is_the_same_as_every_earlier_run_of_the_kit():
    """What the data a (seed, rank, step) names looks like: the sweep reuses records of earlier runs for the same point
    (and the docs' numbers were measured on it), so it must not change between kit versions. Its numbers, not its
    bits: the targets come from a matmul (and the samples from a vectorised sampler) whose last bits depend on the
    CPU's kernels, so a hash of the bytes differs between two machines of the same kind (AVX2 / AVX-512)."""
    def numbers(*args):
        x, y = c.rank_samples(*args)
        return [*x.flatten()[:3].tolist(), *y.flatten()[:3].tolist(), float(x.double().sum()), float(y.double().sum()),
                float((y.double() ** 2).sum())]

    expected = {(0, 0, 4, 8, 0): [-1.525596, -0.750232, -0.653981, 1.126355, 0.777321, -1.125276, -11.07098, -1.86339,
                                  30.8419],
                (0, 1, 4, 8, 0): [-1.612399, 1.016126, 1.588145, -0.418561, 0.019938, 1.141703, -0.52191, -1.5848,
                                  39.1808],
                (0, 0, 4, 8, 1): [0.911387, 3.458215, -0.137214, -0.499383, -0.976504, 0.33449, 1.95588, 3.29439,
                                  33.8055],
                (3, 1, 2, 8, 2): [0.456635, 0.231593, -0.012362, -0.701418, 0.940088, -0.539626, 2.8123, -8.82357,
                                  26.89927]}
    for args, want in expected.items():
        assert numbers(*args) == pytest.approx(want, rel=1e-5, abs=2e-5), args


def test_a_stopwatch_reads_to_the_millisecond(monkeypatch):
    clock = iter([5.0, 6.2346])
    monkeypatch.setattr(judging.time, "perf_counter", lambda: next(clock))
    assert judging.Stopwatch()() == 1.235


def test_a_rank_other_than_0_takes_every_step_and_reports_nothing(monkeypatch):
    monkeypatch.setattr(c, "rank", lambda: 1)
    taken = []
    model = shapes.get("mlp").build(SEED, HIDDEN, DEPTH)

    def take(step, batches):
        taken.append(step)
        return None, None

    assert judging.judge_steps(2, lambda: judging.plain_read(model), take, seed=SEED, ga=1, micro_batch=MB, hidden=HIDDEN) == {}
    assert taken == [0, 1]


def test_a_cases_other_time_is_kept_to_a_tenth_of_a_millisecond(monkeypatch):
    clock = iter([0.0, 1.235])
    monkeypatch.setattr(judging.time, "perf_counter", lambda: next(clock))

    def run_one(case):
        judging._PHASES["steps"] = 0.12345
        return {}

    (out,) = judging.run_cases({"cases": [{"name": "a", "ga": 1}]}, run_one)
    other = out["phases"]["other"]
    assert out["wall_s"] == 1.235 and abs(other - 1.11155) <= 0.00005 and round(other, 4) == other != round(other, 3)


def test_hypotheses_of_a_clipped_step_are_judged_against_the_clipped_reference():
    free = loop(ga=2, steps=1)

    def hypotheses(w, n, previous, update=None):
        return {"exact": [1 / n] * n}

    out = loop(ga=2, steps=1, clip=0.5 * free["reference_norm"], hypotheses=hypotheses)
    assert out["hypotheses"]["best"] == "exact" and out["hypotheses"]["best_matches"]
    assert out["hypotheses"]["predicted_ratio"]["exact"] == pytest.approx(1.0)


class _Gathers(torch.nn.Linear):
    """A linear layer with a ``gather_params`` that puts the whole parameter into each copy it is handed, as
    DeepSpeed's all_gather does (the other rank's half is a stand-in here: this half plus 100), and records what it
    was handed. Without a ``tp_world_size`` it is no AutoTP layer."""

    def __init__(self, *shape, bias=True):
        super().__init__(*shape, bias=bias)
        self.handed = []

    @torch.no_grad()
    def gather_params(self, params_list):
        self.handed.append(list(params_list))
        for q in params_list:
            if q is not None:
                q.data = torch.cat([q.data, q.data + 100])


class _Sharded(_Gathers):
    """An AutoTP column-parallel layer as one rank of two holds it: its half of the output rows."""
    tp_world_size = 2


def _set(layer, weight, bias=None):
    with torch.no_grad():
        layer.weight.copy_(torch.tensor(weight))
        if bias is not None:
            layer.bias.copy_(torch.tensor(bias))
    return layer


def _tp_model():
    """A model with an AutoTP layer (weight and bias), one without a bias, and layers that are not AutoTP's: a plain
    linear layer, one that says a tensor-parallel size but has no gather_params, one with gather_params only."""
    plain = _set(torch.nn.Linear(2, 1), [[1.0, 2.0]], [3.0])
    sized = _set(torch.nn.Linear(1, 1), [[4.0]], [5.0])
    sized.tp_world_size = 2  # no gather_params: not gathered
    tp = _set(_Sharded(2, 1), [[0.5, -0.25]], [0.75])
    nobias = _set(_Sharded(1, 1, bias=False), [[-2.0]])
    lone = _set(_Gathers(1, 1), [[6.0]], [7.0])
    return torch.nn.Sequential(plain, sized, tp, nobias, lone)


def test_under_autotp_a_sharded_layers_weight_and_bias_are_read_whole_on_copies_and_other_layers_as_they_are(
        fake_deepspeed):
    m = _tp_model()
    r = c.read_tp_weights(m, "fp32")
    whole = [1.0, 2.0, 3.0, 4.0, 5.0,  0.5, -0.25, 100.5, 99.75,  0.75, 100.75,  -2.0, 98.0,  6.0, 7.0]
    assert r["module"].tolist() == whole and r["module"].dtype == torch.float64
    assert r["masters"].tolist() == whole  # no master read from DeepSpeed: each parameter is its own master
    assert r["agree"] is True and r["max_diff"] == 0.0
    tp, nobias, lone = m[2], m[3], m[4]
    assert tp.weight.tolist() == [[0.5, -0.25]] and tp.bias.tolist() == [0.75]  # the model's own are left as they are
    assert nobias.weight.tolist() == [[-2.0]] and lone.handed == []
    assert len(tp.handed) == 2  # once for the weights, once for the masters, each time on copies
    for copies in tp.handed:
        assert copies[0] is not tp.weight and copies[1] is not tp.bias
        assert isinstance(copies[0], torch.nn.Parameter)
    assert [x is None for x in nobias.handed[0]] == [False, True]  # no bias: None is handed in its place


def test_under_autotp_a_sharded_layers_masters_are_read_from_deepspeed_and_gathered_the_same_way(fake_deepspeed):
    m = _tp_model()
    tp = m[2]
    fake_deepspeed[id(tp.weight)] = torch.tensor([0.5, -0.25 + 2 ** -11], dtype=torch.float64)  # flat: reshaped
    r = c.read_tp_weights(m, "bf16")
    assert r["masters"].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 0.5, -0.25 + 2 ** -11, 100.5, 99.75 + 2 ** -11,
                                     0.75, 100.75, -2.0, 98.0, 6.0, 7.0]
    assert r["masters"].dtype == torch.float64 and r["module"][5:9].tolist() == [0.5, -0.25, 100.5, 99.75]
    assert r["agree"] is True and r["max_diff"] == 2 ** -11  # within bf16's rounding
    r = c.read_tp_weights(m, "fp32")
    assert r["agree"] is False and r["max_diff"] == 2 ** -11  # not within fp32's


def test_under_autotp_the_two_reads_agree_within_the_module_dtypes_rounding_exactly_to_its_edge(fake_deepspeed):
    m = torch.nn.Sequential(_set(_Sharded(2, 1), [[0.0, 2.0]], [1.0]))
    r = c.read_tp_weights(m, "fp32")  # a zero weight, equal in both reads: they agree
    assert r["agree"] is True and r["max_diff"] == 0.0 and r["module"].tolist() == [0.0, 2.0, 100.0, 102.0, 1.0, 101.0]
    w = m[0].weight
    with torch.no_grad():
        w.copy_(torch.tensor([[0.0, 2.0078125]]))  # 2 * (1 + 2**-8): exactly bf16's rounding of a master of 2 off
    fake_deepspeed[id(w)] = torch.tensor([[0.0, 2.0]])
    r = c.read_tp_weights(m, "bf16")
    assert r["agree"] is True and r["max_diff"] == 2 ** -7
    with torch.no_grad():
        w.copy_(torch.tensor([[0.0, 2.0 + 2 ** -6]]))  # twice as far: not
    assert c.read_tp_weights(m, "bf16")["agree"] is False
    with torch.no_grad():
        w.copy_(torch.tensor([[0.0, 2.002]]))  # 0.002 off: within no rounding of fp32
    r = c.read_tp_weights(m, "fp32")
    assert r["agree"] is False and abs(r["max_diff"] - 0.002) < 1e-6


def test_a_step_read_from_agreeing_masters_carries_a_floor_only_where_they_are_low_precision():
    assert "read_floor" not in loop(1, steps=1)  # fp32 masters: the step is read exactly
    out = loop(1, steps=1, masters_dtype="bf16")
    assert out["read"]["judged_from"] == "fp32 masters" and out["read_floor"] > 0


def test_a_failed_case_names_the_innermost_phase_its_error_passed_through():
    def run_one(case):
        with judging.phase("outer"):
            with judging.phase("inner"):
                raise ValueError("planted")

    out = judging.run_cases({"cases": [{"name": "bad", "ga": 1}]}, run_one)
    assert out[0]["failed_in"] == "inner"


def test_a_cases_loss_scale_is_computed_once_per_rank_and_is_always_the_one_its_own_shape_world_ga_clip_and_masters_give(
        monkeypatch):
    """``case_loss_scale`` keeps each answer of ``loss_scale`` (a whole reference gradient) for the next case of a warm
    world that asks the same; any of what the scale depends on that differs is computed again."""
    from gradkit.probes.ranks import ds_config

    monkeypatch.setattr(ds_config, "_SCALES", {})
    calls = []
    real = ds_config.loss_scale
    monkeypatch.setattr(ds_config, "loss_scale", lambda *a: calls.append(a) or real(*a))

    def scale(w=2, n=4, clip=1.0, **case):
        case = {"ga": n, **case}
        return ds_config.case_loss_scale(case, w, n, clip, shapes.of_case(case))

    first = scale()
    assert first == real(2, 4, 1.0, shapes.get(shapes.DEFAULT)) and scale() == first and len(calls) == 1
    others = {"ga 1": scale(n=1), "world 1": scale(w=1), "clip 0.5": scale(clip=0.5),
              "bf16 masters": scale(clip=0.0, masters_dtype="bf16"),
              "another shape": scale(model=next(s for s in shapes.registry() if s != shapes.DEFAULT))}
    assert len(calls) == 6 and len(set(others.values()) | {first}) == 6, others
    assert others["bf16 masters"] == real(2, 4, 0.0, shapes.get(shapes.DEFAULT), "bf16")
    assert scale(clip=0.0) == 1.0 and len(calls) == 6  # no clip, fp32 masters: 1, nothing computed
