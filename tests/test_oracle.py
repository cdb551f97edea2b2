"""The oracle's math on hand-made gradients: each kind of wrong gradient gets the right verdict."""
import math

import pytest
import torch

from kit import oracle


def basis_and_ref(k=8, n=500, seed=0):
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(k, n, generator=g, dtype=torch.float64) + 0.5  # a shared direction, like real grads
    weights = torch.full((k,), 1.0 / k, dtype=torch.float64)
    return basis, weights, weights @ basis


def judged(vec, ref, dtype="fp32"):
    return {"metrics": oracle.compare(vec, ref), "dtype": dtype}


def test_exact_gradient_is_not_affected():
    _, _, ref = basis_and_ref()
    word, why = oracle.verdict(judged(ref.clone(), ref), judged(ref.clone(), ref))
    assert word == oracle.NOT_AFFECTED, why


@pytest.mark.parametrize("ga", [2, 4, 8])
def test_summed_not_averaged_is_affected_with_ratio_ga(ga):
    _, _, ref = basis_and_ref()
    m = oracle.compare(ga * ref, ref)
    assert m["norm_ratio"] == pytest.approx(ga)
    assert m["cosine"] == pytest.approx(1.0)
    assert oracle.verdict(judged(ga * ref, ref), judged(ref, ref))[0] == oracle.AFFECTED


def test_rotated_gradient_is_affected_with_same_norm():
    _, _, ref = basis_and_ref()
    other = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    other -= (other @ ref) / (ref @ ref) * ref
    angle = 0.2
    rotated = math.cos(angle) * ref + math.sin(angle) * other * ref.norm() / other.norm()
    m = oracle.compare(rotated, ref)
    assert m["norm_ratio"] == pytest.approx(1.0)
    assert m["cosine"] == pytest.approx(math.cos(angle))
    assert oracle.verdict(judged(rotated, ref), judged(ref, ref))[0] == oracle.AFFECTED


def test_truncated_to_last_micro_batch_is_affected_and_attributed():
    basis, weights, ref = basis_and_ref()
    last_only = basis[-1] / len(basis)  # "only the last micro-batch survives", still divided by N
    assert oracle.verdict(judged(last_only, ref), judged(ref, ref))[0] == oracle.AFFECTED
    a = oracle.attribute(last_only, basis, weights)
    assert a["weights"][-1] == pytest.approx(1.0 / len(basis))
    assert all(abs(w) < 1e-9 for w in a["weights"][:-1])
    # the other N-1 micro-batches lost their 1/N each; half the L1 distance: (N-1)/(2N)
    assert a["misplaced_weight"] == pytest.approx((len(basis) - 1) / (2 * len(basis)))
    assert a["weight_sum_ratio"] == pytest.approx(1.0 / len(basis))


def test_leak_attribution_recovers_the_formula():
    # W ranks x GA micro-batches; rank 0's buffer after the leak: avg(prior) + its own last micro-batch.
    w_ranks, ga = 2, 4
    basis, weights, ref = basis_and_ref(k=w_ranks * ga)
    leaked = weights.clone()
    for r in range(w_ranks):
        leaked[r * ga + ga - 1] = 0.0
    leaked[ga - 1] = 1.0 / ga
    a = oracle.attribute(leaked @ basis, basis, weights)
    assert a["misplaced_weight"] == pytest.approx((w_ranks - 1) / w_ranks / ga)
    assert a["residual"] < 1e-9


def test_bf16_noise_is_tolerated_but_not_in_fp32():
    _, _, ref = basis_and_ref()
    noisy = ref * (1 + 0.004 * torch.randn(ref.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64))
    assert oracle.verdict(judged(noisy, ref, "bf16"), judged(ref, ref))[0] == oracle.NOT_AFFECTED
    assert oracle.verdict(judged(noisy, ref, "fp32"), judged(ref, ref))[0] == oracle.AFFECTED


def test_control_off_makes_any_verdict_inconclusive():
    _, _, ref = basis_and_ref()
    assert oracle.verdict(judged(ref, ref), judged(2 * ref, ref))[0] == oracle.INCONCLUSIVE
    assert oracle.verdict(judged(2 * ref, ref), None)[0] == oracle.INCONCLUSIVE
    assert oracle.verdict(judged(2 * ref, ref), {"error": "boom", "dtype": "fp32"})[0] == oracle.INCONCLUSIVE


def test_a_measurement_that_did_not_run_is_cannot_run_never_not_affected():
    _, _, ref = basis_and_ref()
    word, why = oracle.verdict({"error": "RuntimeError: Output 0 of Split is a view", "dtype": "fp32"}, judged(ref, ref))
    assert word == oracle.CANNOT_RUN and "Split" in why
    assert oracle.verdict(None, judged(ref, ref))[0] == oracle.CANNOT_RUN


def test_compare_rejects_shape_mismatch_and_zero_reference():
    with pytest.raises(ValueError):
        oracle.compare(torch.ones(3), torch.ones(4))
    with pytest.raises(ValueError):
        oracle.compare(torch.ones(3), torch.zeros(3))
    with pytest.raises(ValueError):
        oracle.tolerance("fp8")


def test_reference_is_the_gradient_of_the_global_mean_loss():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    xs, ys = torch.randn(6, 3), torch.randn(6, 2)
    mse = lambda o, t: ((o - t) ** 2).mean()
    batches = [(xs[:2], ys[:2]), (xs[2:6], ys[2:6])]  # unequal micro-batches weigh by their size
    basis, weights, ref = oracle.reference_gradients(model, batches, mse)
    assert weights.tolist() == pytest.approx([2 / 6, 4 / 6])
    full = torch.autograd.grad(mse(model(xs), ys), list(model.parameters()))
    assert torch.allclose(ref, torch.cat([g.reshape(-1) for g in full]).double(), atol=1e-6)


def test_explain_names_the_hypothesis_that_holds():
    basis, weights, ref = basis_and_ref(k=8)
    last_only = torch.zeros(8, dtype=torch.float64)
    last_only[3], last_only[7] = 1 / 8, 1 / 8  # two ranks of N=4: each rank's last micro-batch, still / N
    candidates = {"global mean": weights, "last micro-batch / N": last_only, "sum of micro-batches": 4 * weights}
    got = oracle.explain(last_only @ basis, basis, candidates, "fp32", reference=ref)
    assert got["best"] == "last micro-batch / N" and got["best_matches"]
    assert got["candidates"]["global mean"]["rel_l2"] > 0.1
    assert got["predicted_ratio"]["sum of micro-batches"] == pytest.approx(4.0)
    noisy = oracle.explain(0.5 * ref, basis, candidates, "fp32")  # half the mean: none of the three
    assert not noisy["best_matches"]
