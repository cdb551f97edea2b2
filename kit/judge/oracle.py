"""The one judge of a gradient: a plain-PyTorch fp32 reference and the comparison against it.

Three questions, in this order:

1. **Reference.** What gradient should one step of this global batch apply?
   ``reference_gradients`` runs the same initial weights in fp32, in one process,
   over every micro-batch of every rank, and returns each micro-batch's own
   gradient (the *basis*) and their sample-weighted mean (the *reference*: the
   gradient of the mean loss over the whole global batch).
2. **Comparison.** How far is an effective gradient from the reference?
   ``compare`` gives the norm ratio, cosine, relative L2 error and max relative
   error. A scaled gradient moves the ratio, a rotated one the cosine, a
   truncated one both.
3. **Attribution.** Which micro-batches reached the optimizer, with what weight?
   ``attribute`` solves effective ~= sum_k w_k * basis_k by least squares. A
   correct engine gives w_k = n_k / N for every (rank, micro-batch) k; "only the
   last micro-batch survives" gives zeros and one big weight; "summed, not
   averaged" gives GA times the right weights. ``misplaced_weight`` =
   1/2 * sum_k |w_k - n_k/N| is the share of the gradient that went to the
   wrong micro-batches (0 = correct).

``signals`` judges every number a measurement carries against its dtype's limits (``gradkit.judge.tolerances``), and
``verdict`` turns a measurement and its control into one of four words. Built on these: each parameter group of
a step judged on its own (``gradkit.judge.parts``), and which named hypothesis a step is, its fitted weights in words
and what a record's steps are called (``gradkit.judge.naming``).
"""
from __future__ import annotations

import math

from gradkit.judge.tolerances import tolerance

AFFECTED = "affected"
NOT_AFFECTED = "not-affected"
INCONCLUSIVE = "inconclusive"
CANNOT_RUN = "cannot-run"
VERDICTS = (AFFECTED, NOT_AFFECTED, INCONCLUSIVE, CANNOT_RUN)
WORST_FIRST = (AFFECTED, INCONCLUSIVE, CANNOT_RUN, NOT_AFFECTED)  # how verdicts of one configuration combine


# ---------------------------------------------------------------- reference

def reference_gradients(model, micro_batches, loss_fn):
    """fp32, one process: per-micro-batch gradients and the global-batch gradient.

    ``micro_batches`` is a list of ``(inputs, targets)``; ``loss_fn(output, targets)``
    returns the *mean* loss of that micro-batch. Returns ``(basis, weights, reference)``:
    basis[k] is the flat fp32 gradient of micro-batch k's mean loss over *every* parameter of the module (module
    order; a frozen parameter, or one this micro-batch does not reach, is 0 there), weights[k] = n_k / N,
    reference = sum_k weights[k] * basis[k] (the gradient of the mean loss over all N samples).
    Floating-point inputs are taken in fp32; integer ones (token ids) as they are.
    """
    import copy

    import torch

    ref_model = copy.deepcopy(model).float()
    params = list(ref_model.parameters())
    trainable = [p for p in params if p.requires_grad]
    sizes = [len(x) for x, _ in micro_batches]
    total = float(sum(sizes))
    basis = []
    for x, y in micro_batches:
        ref_model.zero_grad(set_to_none=True)
        loss = loss_fn(ref_model(x.float() if x.is_floating_point() else x), y.float() if y.is_floating_point() else y)
        grads = dict(zip(map(id, trainable), torch.autograd.grad(loss, trainable, allow_unused=True)))
        basis.append(torch.cat([(grads.get(id(p)) if grads.get(id(p)) is not None else torch.zeros_like(p)).reshape(-1)
                                for p in params]).double())
    basis = torch.stack(basis)
    weights = torch.tensor([n / total for n in sizes], dtype=torch.float64)
    return basis, weights, weights @ basis


# ---------------------------------------------------------------- comparison

def compare(effective, reference) -> dict:
    """Norm ratio, cosine, relative L2 error, max relative error (as plain floats).

    max_rel_err is max_i |eff_i - ref_i| / max_i |ref_i|: an element-wise ratio
    would divide by reference entries that are ~0 and report noise.
    """
    import torch

    e = torch.as_tensor(effective, dtype=torch.float64).reshape(-1)
    r = torch.as_tensor(reference, dtype=torch.float64).reshape(-1)
    if e.shape != r.shape:
        raise ValueError(f"effective has {e.numel()} elements, reference {r.numel()}")
    rn, en = r.norm().item(), e.norm().item()
    if rn == 0.0:
        raise ValueError("the reference gradient is zero: nothing to compare against")
    return {
        "norm_ratio": en / rn,
        "cosine": (e @ r).item() / (en * rn) if en > 0 else 0.0,
        "rel_l2": (e - r).norm().item() / rn,
        "max_rel_err": (e - r).abs().max().item() / r.abs().max().item(),
        "effective_norm": en,
        "reference_norm": rn,
    }


def attribute(vector, basis, expected_weights) -> dict:
    """Least-squares weights w with vector ~= w @ basis, and how far they are from ``expected_weights``."""
    import torch

    v = torch.as_tensor(vector, dtype=torch.float64).reshape(-1)
    b = torch.as_tensor(basis, dtype=torch.float64)
    w_exp = torch.as_tensor(expected_weights, dtype=torch.float64)
    if not (bool(torch.isfinite(v).all()) and bool(torch.isfinite(b).all())):  # no weights (LAPACK fails on NaN)
        return {"weights": [math.nan] * len(b), "expected_weights": [float(x) for x in w_exp],
                "misplaced_weight": math.inf, "weight_sum_ratio": math.nan, "residual": math.nan,
                "non_finite": int((~torch.isfinite(v)).sum())}
    w = torch.linalg.lstsq(b.T, v.unsqueeze(1)).solution.squeeze(1)
    fit = w @ b
    residual = (v - fit).norm().item() / max(v.norm().item(), 1e-300)
    return {
        "weights": [float(x) for x in w],
        "expected_weights": [float(x) for x in w_exp],
        "misplaced_weight": 0.5 * (w - w_exp).abs().sum().item(),
        "weight_sum_ratio": w.sum().item() / w_exp.sum().item(),
        "residual": residual,
        "distinct": distinct(v, fit, w_exp @ b, len(b)),
    }


def distinct(v, fit, expected, k: int) -> float:
    """How much better the fitted weights explain ``v`` than the expected ones, in units of the noise: the drop of the
    squared residual from the expected combination to the fitted one over ``sigma^2``, the residual's variance per
    coordinate (``n - k`` degrees of freedom, from the better of the two). Where ``v`` is the expected combination plus
    noise this is chi-squared with ``k`` degrees of freedom (for a least-squares fit the drop is
    ``||fit - expected||^2``: the Mahalanobis distance of the fitted weights from the expected). Where micro-batches'
    gradients are nearly alike, or alike outright, the weights are not identifiable: the fit may put weight anywhere
    between them (or fail) while explaining ``v`` no better than the expected weights, and this stays small. ``inf``
    where the expected weights leave a residual and the fit none (no noise to measure: taken at its word)."""
    dof = v.numel() - k
    left_fit, left_expected = float((v - fit).norm()) ** 2, float((v - expected).norm()) ** 2
    drop = left_expected - left_fit
    noise = min(left_fit, left_expected) / dof if dof > 0 else 0.0
    return drop / noise if noise > 0 else (math.inf if drop > 0 else 0.0)


def indistinct(attribution: dict) -> bool:
    """The fitted weights cannot be told from the expected ones: their distance (``distinct``) is within the
    chi-squared bound of ``k`` weights at 6 standard deviations (``k + 6 sqrt(2k)``), so a misplaced weight is the
    fit's freedom between alike micro-batches, not the step's."""
    k = len(attribution.get("weights") or ())
    return bool(k) and attribution.get("distinct", math.inf) <= k + 6.0 * math.sqrt(2.0 * k)


def clipped(vector, clip: float):
    """``vector`` as an engine clipping at ``clip`` applies it (DeepSpeed's and torch's coefficient
    clip / (norm + 1e-6), never above 1); ``clip`` 0: no clipping."""
    if not clip:
        return vector
    return vector * min(1.0, clip / (float(vector.norm()) + 1e-6))


# ---------------------------------------------------------------- verdict

def spread(vectors) -> float:
    """max_r ||v_r - v_0|| / ||v_0||: how far ranks that must hold the same vector are apart (0 = identical)."""
    import torch

    vs = [torch.as_tensor(v, dtype=torch.float64).reshape(-1) for v in vectors]
    base = max(vs[0].norm().item(), 1e-300)
    return max((v - vs[0]).norm().item() for v in vs) / base


def signals(judged: dict) -> list[dict]:
    """Every signal a measurement carries, each against the dtype's tolerance.

    ``judged`` holds ``metrics`` (from ``compare``) and ``dtype``, and where the probe measured them:
    ``attribution`` (of the effective gradient), ``rank_buffers`` (each rank's own accumulator, with its
    ``attribution``: under ZeRO a leak is per rank, and the effective gradient mixes partitions stepped by
    different ranks) and ``rank_spread`` ({what: spread} over ranks that must agree). Returns one
    ``{"signal", "value", "limit", "ok"}`` per signal; an absent measurement is not judged (and not listed).
    """
    m, tol = judged["metrics"], tolerance(judged["dtype"])
    # A step read from rounded low-precision weights (the masters' read disagreed with them) is only known to
    # within their rounding: ``read_floor`` is that rounding's relative size, and widens the limits it can move.
    floor = 2.0 * float(judged.get("read_floor") or 0.0)
    out = [{"signal": "rel. error", "value": m["rel_l2"], "limit": max(tol.rel_l2, floor)},
           {"signal": "norm ratio - 1", "value": abs(m["norm_ratio"] - 1.0), "limit": max(tol.norm_ratio, floor)}]
    if judged.get("attribution"):
        out.append({"signal": "misplaced weight", "value": judged["attribution"]["misplaced_weight"],
                    "limit": max(tol.misplaced_weight, floor)})
    for r, b in enumerate(judged.get("rank_buffers") or []):
        out.append({"signal": f"misplaced weight of rank {r}'s accumulator",
                    "value": b["attribution"]["misplaced_weight"], "limit": tol.misplaced_weight})
    for what, value in (judged.get("rank_spread") or {}).items():
        out.append({"signal": f"spread of the ranks' {what}", "value": value, "limit": tol.rank_spread})
    for name, g in (judged.get("groups") or {}).items():  # a small group can be wrong inside the whole's limits
        out.append({"signal": f"rel. error of {name}", "value": g["rel_err"], "limit": max(tol.rel_l2, floor)})
        for what in ("attribution", "uses"):
            if g.get(what):
                out.append({"signal": f"misplaced weight of {name}{' over its uses' if what == 'uses' else ''}",
                            "value": g[what]["misplaced_weight"], "limit": max(tol.misplaced_weight, floor)})
    for s in out:
        s["ok"] = math.isfinite(s["value"]) and s["value"] <= s["limit"]
    for s, a in zip([s for s in out if s["signal"].startswith("misplaced weight")], _attributions(judged)):
        if not s["ok"] and indistinct(a):  # a fit that cannot tell the weights apart is no evidence either way
            s["ok"], s["indistinct"] = True, True
    if not math.isfinite(m["cosine"]):
        out.append({"signal": "cosine", "value": m["cosine"], "limit": 1.0, "ok": False})
    return out


def _attributions(judged: dict) -> list[dict]:
    """The attributions ``signals`` judges, in the order it lists their misplaced weights."""
    out = [judged["attribution"]] if judged.get("attribution") else []
    out += [b["attribution"] for b in judged.get("rank_buffers") or []]
    for g in (judged.get("groups") or {}).values():
        out += [g[what] for what in ("attribution", "uses") if g.get(what)]
    return out


def matches_reference(metrics: dict, dtype: str) -> bool:
    """Are these numbers (from ``compare``) the reference's, within the dtype's tolerance? (A record is judged on
    all its signals by ``verdict``; this serves a bare comparison, e.g. with a named hypothesis.)"""
    return all(s["ok"] for s in signals({"metrics": metrics, "dtype": dtype}))


def _off(sigs: list[dict]) -> str:
    return "; ".join(f"{s['signal']} {s['value']:.2e} > {s['limit']:g}" for s in sigs if not s["ok"])


def severity(judged: dict) -> float:
    """How far the worst signal of a measurement is past its limit (value / limit; > 1: off). Several steps of one
    case are judged each, and the case is as bad as its most severe step."""
    return max((s["value"] / s["limit"] if math.isfinite(s["value"]) else math.inf) for s in signals(judged))


def detectable_weight(judged: dict) -> float:
    """The smallest misplaced weight this measurement could have seen: the misplaced-weight limit it is judged
    with (a share of the gradient below it passes as noise)."""
    return next(s["limit"] for s in signals({**judged, "attribution": {"misplaced_weight": 0.0}})
                if s["signal"] == "misplaced weight")


def norm_verdict(logged: float | None, reference_norm: float, dtype: str) -> tuple[str, str]:
    """The grad norm the engine reports (what a user's curves show) against the reference's norm: a second
    verdict next to the applied step's. ``logged`` None: the engine keeps no norm there (e.g. ZeRO-0 with a plain
    torch optimizer): "n/a", nothing to judge; a non-finite one is off."""
    if logged is None:
        return "n/a", "the engine reports no gradient norm here (get_global_grad_norm() is None)"
    if not math.isfinite(logged):
        return AFFECTED, f"the engine reports a gradient norm of {logged}"
    ratio, limit = logged / reference_norm, tolerance(dtype).norm_ratio
    word = NOT_AFFECTED if abs(ratio - 1.0) <= limit else AFFECTED
    return word, (f"the logged grad norm {logged:.6g} is {ratio:.4f} x the reference's {reference_norm:.6g} "
                  f"({'within' if word == NOT_AFFECTED else 'outside'} the {dtype} limit {limit:g})")


JUDGED_KEYS = ("metrics", "dtype", "error", "attribution", "rank_buffers", "rank_spread", "read_floor", "steps",
               "worst_step", "groups")


def verdict(measured: dict | None, control: dict | None) -> tuple[str, str]:
    """One word and one sentence for a measurement judged next to its control.

    Each argument is ``None`` (did not run) or a dict with ``metrics`` (from ``compare``), ``dtype``
    and the other signals of ``signals``; an optional ``error`` key means it ran and failed.
    - the measurement could not run               -> cannot-run
    - the control did not run, or is off          -> inconclusive (the harness itself is suspect)
    - every signal is within the dtype's limit    -> not-affected
    - otherwise                                   -> affected (the sentence names each signal that is off)
    """
    if measured is None or measured.get("error"):
        why = (measured or {}).get("error", "the measured configuration did not run")
        return CANNOT_RUN, f"could not run: {why}"
    if control is None or control.get("error"):
        why = (control or {}).get("error", "no control was run")
        return INCONCLUSIVE, f"the control did not run ({why}), so a mismatch cannot be blamed on the engine"
    control_sigs = signals(control)
    if not all(s["ok"] for s in control_sigs):
        m = control["metrics"]
        return INCONCLUSIVE, (f"the control is off the reference itself (ratio {m['norm_ratio']:.4f}; "
                              f"{_off(control_sigs)}): the harness, not the engine, is suspect")
    steps = measured.get("steps") or []
    skipped = skipped_text(steps)
    if steps and all(s.get("skipped") for s in steps):
        return INCONCLUSIVE, f"nothing was applied to judge: {skipped}"
    m, sigs = measured["metrics"], signals(measured)
    numbers = f"ratio {m['norm_ratio']:.4f}, cosine {m['cosine']:.5f}, rel. error {m['rel_l2']:.2e}"
    applied = len([s for s in steps if not s.get("skipped")])
    where = (f" at step {measured.get('worst_step', 0) + 1} (the worst of {applied}{' applied' if skipped else ''})"
             if applied > 1 else "")
    skipped = f"; {skipped}" if skipped else ""
    if all(s["ok"] for s in sigs):
        return NOT_AFFECTED, (f"effective gradient matches the fp32 reference on every signal{where} ({numbers}; "
                              f"{len(sigs)} signals within the {measured['dtype']} limits){skipped}")
    return AFFECTED, (f"effective gradient is off the fp32 reference{where} ({numbers}): {_off(sigs)} "
                      f"({measured['dtype']}){skipped}")


def skipped_text(steps: list[dict]) -> str:
    """The steps an fp16 loss scaler skipped (an overflow: nothing applied, by design), with their scales; "" where
    none was."""
    skipped = [s for s in steps if s.get("skipped")]
    if not skipped:
        return ""
    if not any(s.get("loss_scale") for s in skipped):  # the control: no loss scaler, it skips where one would
        return f"step{'s' if len(skipped) > 1 else ''} {', '.join(str(s['step'] + 1) for s in skipped)} skipped, as " \
               "the loss scaler must skip its overflow (not judged)"
    each = ", ".join(f"{s['step'] + 1} (loss scale {s.get('loss_scale', 0):g}"
                     + (f" -> {s['loss_scale_after']:g})" if s.get("loss_scale_after") != s.get("loss_scale") else
                        " kept: hysteresis)") for s in skipped)
    return (f"step{'s' if len(skipped) > 1 else ''} {each} skipped by the fp16 loss scaler on an overflow: nothing "
            "applied, as designed (not judged)")
