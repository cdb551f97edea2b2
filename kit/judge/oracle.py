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

``verdict`` turns a measurement and its control into one of four words.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

AFFECTED = "affected"
NOT_AFFECTED = "not-affected"
INCONCLUSIVE = "inconclusive"
CANNOT_RUN = "cannot-run"
VERDICTS = (AFFECTED, NOT_AFFECTED, INCONCLUSIVE, CANNOT_RUN)
WORST_FIRST = (AFFECTED, INCONCLUSIVE, CANNOT_RUN, NOT_AFFECTED)  # how verdicts of one configuration combine


@dataclass(frozen=True)
class Tolerance:
    """How far an effective gradient may sit from the fp32 reference and still count as correct."""

    rel_l2: float  # ||eff - ref|| / ||ref||
    norm_ratio: float  # |ratio - 1|
    misplaced_weight: float  # share of the gradient attributed to the wrong micro-batches
    rank_spread: float  # max_r ||v_r - v_0|| / ||v_0|| over ranks that must hold the same vector
    why: str


# Why these numbers (the kit's models are 2-3 layers of width <= 64, batches of <= 64 samples):
# - fp32: unit roundoff 2**-24 ~ 6e-8. Engine and reference add the same terms in different
#   orders (allreduce, flat buffers), which moves each sum by ~sqrt(terms) * 6e-8 ~ 1e-6.
#   1e-4 leaves 100x headroom; the bugs under study move the gradient by >= 1e-2. Attribution
#   (least squares on <= 128 micro-batch gradients) inherits that: measured <= 1e-6 misplaced.
# - bf16: 8 significant bits, unit roundoff 2**-9 ~ 2e-3. Weights, activations and the
#   per-micro-batch gradients are each rounded once or twice, so the effective gradient sits
#   ~0.5-1% from the fp32 reference (measured here: 0.12-0.62% on the fixed engines, B4 probe,
#   W = 2, GA 8-64). 3e-2 is ~3x that; a leak or a missing 1/GA moves the gradient by >= 6e-2
#   for GA <= 8, W >= 2 -- but a leak's rel. error shrinks like 1/(GA * sqrt(micro-batch)): the B4
#   leak at W = 2, GA = 64 is ~2e-2, inside 3e-2. Attribution does not shrink that way: the leak
#   misplaces (W-1)/W * 1/GA = 7.8e-3 of the weight there, while correct engines measured
#   (`scripts/bench.py --noise`, DeepSpeed 0.19.8, W = 2): misplaced weight 3.8e-4 / 5.7e-4 / 6.4e-4
#   at GA 8 / 32 / 64 with an fp32 accumulator, 4.4e-4 / 1.4e-3 / 2.9e-3 with a bf16 one (the noise
#   grows with the number of micro-batches). 5e-3 sits between the largest noise (2.9e-3) and the
#   smallest leak a shipped grid measures (7.8e-3).
# - rank spread: ranks that must hold the same vector (data-parallel replicas after the average,
#   fp32 masters after ZeRO's all-gather) get it from one collective, so it is bit-identical on a
#   correct engine (measured: 0.0 everywhere, fp32 and bf16 models alike: the compared vectors are
#   fp32 masters or accumulators). 1e-6 (~16 fp32 ulps) allows a reduction that rounds per rank.
# - fp16: 11 significant bits, unit roundoff 2**-11 ~ 5e-4, 4x finer than bf16. DeepSpeed's CPU accelerator refuses
#   fp16, so its noise is measured on the engine's arithmetic in plain torch (`scripts/bench.py --noise`, "fp16
#   emulated": the kit's model in fp16, a static loss scale of 2**8, fp16 or fp32 accumulation, an fp16 reduction,
#   unscaled into fp32): rel. error <= 8.0e-4, |ratio - 1| <= 7e-5, misplaced weight 6.8e-5 / 1.6e-4 / 4.1e-4 at
#   GA 8 / 32 / 64. 5e-3 is ~6x the error; 1.5e-3 misplaced is ~3.6x the largest noise and below the smallest
#   loss a grid measures (one micro-batch of W = 2, GA 64: 3.9e-3). On a GPU the same numbers are to be re-measured
#   (`bench.py --noise` there runs the real engine's fp16 cases too).
TOLERANCES = {
    "fp32": Tolerance(rel_l2=1e-4, norm_ratio=1e-4, misplaced_weight=1e-4, rank_spread=1e-6,
                      why="fp32 unit roundoff 6e-8; reduction order changes sums by ~1e-6; 100x headroom"),
    "bf16": Tolerance(rel_l2=3e-2, norm_ratio=3e-2, misplaced_weight=5e-3, rank_spread=1e-6,
                      why="bf16 unit roundoff 2e-3; rounded weights/activations/grads give 0.1-0.6% error "
                          "and <= 2.9e-3 misplaced weight at GA 64; replicas bit-identical"),
    "fp16": Tolerance(rel_l2=5e-3, norm_ratio=5e-3, misplaced_weight=1.5e-3, rank_spread=1e-6,
                      why="fp16 unit roundoff 5e-4; the engine's arithmetic emulated in torch gives <= 8e-4 error "
                          "and <= 4.1e-4 misplaced weight at GA 64; replicas bit-identical"),
}


# How far a module's weight may sit from its fp32 master: its own rounding (half an ulp, with room for a
# round-to-nearest-even tie) relative to the master. fp32 modules are the masters' own copies: bit-equal.
ROUNDING = {"fp32": 2.0 ** -23, "bf16": 2.0 ** -8, "fp16": 2.0 ** -10}


def tolerance(dtype: str) -> Tolerance:
    if dtype not in TOLERANCES:
        raise ValueError(f"no tolerance for dtype {dtype!r}; known: {sorted(TOLERANCES)}")
    return TOLERANCES[dtype]


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
    residual = (v - w @ b).norm().item() / max(v.norm().item(), 1e-300)
    return {
        "weights": [float(x) for x in w],
        "expected_weights": [float(x) for x in w_exp],
        "misplaced_weight": 0.5 * (w - w_exp).abs().sum().item(),
        "weight_sum_ratio": w.sum().item() / w_exp.sum().item(),
        "residual": residual,
    }


def judge_groups(effective, basis, expected, target, groups: dict, ranks: int, n: int, uses: dict | None = None
                 ) -> dict:
    """Each parameter group of a step on its own (a frozen block, a tied weight, an expert): ``{group: {"rel_err",
    "norm_ratio", "expected_zero", "reached", "attribution", "lost", "shape"}}``.

    ``rel_err``: the group's error against its share of ``target`` (the step's right update), relative to that
    share; where the group's right update is 0 (frozen, or no micro-batch reached it) relative to the whole step's
    norm instead: the share of the step applied where none belongs. The fitted weights use only the micro-batches
    that reach the group (``reached``: basis rows, rank-major, then the previous step's, with a gradient there); a
    reached micro-batch whose fitted weight is under half its right one is ``lost`` ("rank r micro-batch i").
    ``uses`` ({group: {use: gradient}}, a tied weight's gradient split by where it is used): the group's step is
    also fitted over its uses (``uses``: weights, right ones all 1, ``misplaced_weight``, ``shape``)."""
    import torch

    eff = torch.as_tensor(effective, dtype=torch.float64)
    b = torch.as_tensor(basis, dtype=torch.float64)
    w_exp = torch.as_tensor(expected, dtype=torch.float64)
    tgt = torch.as_tensor(target, dtype=torch.float64)
    whole = max(tgt.norm().item(), 1e-300)
    out = {}
    for name, idx in groups.items():
        e, t, sub = eff[idx], tgt[idx], b[:, idx]
        norms = sub.norm(dim=1)
        reached = [int(q) for q in torch.nonzero(norms > 1e-9 * max(norms.max().item(), 1e-300)).reshape(-1)]
        zero = t.norm().item() <= 1e-9 * whole
        g = {"expected_zero": zero, "reached": reached, "effective_norm": e.norm().item(), "reference_norm": t.norm().item(),
             "rel_err": (e.norm().item() / whole) if zero else (e - t).norm().item() / t.norm().item(),
             "norm_ratio": None if zero else e.norm().item() / t.norm().item()}
        if not bool(torch.isfinite(e).all()):
            g["rel_err"] = math.inf
        if reached and not zero:
            a = attribute(e, sub[reached], w_exp[reached])
            g["attribution"] = {**a, "rows": reached}
            lost = [q for q, w, x in zip(reached, a["weights"], a["expected_weights"]) if x > 0 and w < 0.5 * x]
            g["lost"] = _positions(lost, ranks, n) if lost else None
            g["shape"] = _group_shape(reached, a["weights"], a["expected_weights"], ranks, n)
        if (uses or {}).get(name):
            names = list(uses[name])
            u = attribute(e, torch.stack([uses[name][x] for x in names]), torch.ones(len(names), dtype=torch.float64))
            g["uses"] = {"names": names, **u,
                         "shape": ", ".join(f"{x} x{_num(round(w, 1) + 0.0)}" for x, w in zip(names, u["weights"]))}
        out[name] = g
    return out


def _position(row: int, ranks: int, n: int) -> str:
    k = ranks * n
    if row >= k:
        return f"the previous step's rank {(row - k) // n} micro-batch {(row - k) % n + 1}"
    return f"rank {row // n} micro-batch {row % n + 1}"


def _positions(rows, ranks: int, n: int) -> str:
    """Basis rows in words; "micro-batch i on every rank" where every rank has the same ones."""
    k = ranks * n
    now = sorted(q for q in rows if q < k)
    per_rank = {tuple(q % n for q in now if q // n == r) for r in range(ranks)}
    if ranks > 1 and len(per_rank) == 1 and len(now) == ranks * len(next(iter(per_rank))):
        text = f"micro-batch{'es' if len(now) > ranks else ''} {','.join(str(i + 1) for i in next(iter(per_rank)))} " \
               "on every rank"
    else:
        text = ", ".join(_position(q, ranks, n) for q in now)
    old = [q for q in rows if q >= k]
    return ", ".join([*([text] if now else []), *(_position(q, ranks, n) for q in old)])


def _group_shape(rows, weights, expected, ranks: int, n: int) -> str:
    """A group's fitted weights in words: each reached micro-batch's weight as a multiple of its right one."""
    k = ranks * n
    parts: dict = {}
    for q, w, x in zip(rows, weights, expected):
        if q < k:
            parts.setdefault(round(w / x, 1) + 0.0 if x else round(w * k, 1) + 0.0, []).append(q)
    if len(parts) == 1:
        text = f"every micro-batch reaching it x{_num(next(iter(parts)))}"
    else:
        main = max(parts, key=lambda v: len(parts[v]))
        text = ", ".join(f"{_positions(qs, ranks, n)} x{_num(v)}" for v, qs in parts.items() if v != main) + \
            f", the others reaching it x{_num(main)}"
    prev = [round(w * k, 1) + 0.0 for q, w in zip(rows, weights) if q >= k]
    if any(abs(v) > 0.05 for v in prev):
        text += f"; the previous step's micro-batches x{', '.join(_num(v) for v in prev)}"
    return text


def clipped(vector, clip: float):
    """``vector`` as an engine clipping at ``clip`` applies it (DeepSpeed's and torch's coefficient
    clip / (norm + 1e-6), never above 1); ``clip`` 0: no clipping."""
    if not clip:
        return vector
    return vector * min(1.0, clip / (float(vector.norm()) + 1e-6))


def explain(effective, basis, candidates: dict, dtype: str, reference=None, clip: float = 0.0) -> dict:
    """Which hypothesis is the effective gradient? Compare it with ``sum_k w_k * basis_k`` for each candidate.

    ``candidates`` maps a name ("global mean", "last micro-batch / N", ...) to its weights over
    the basis (a candidate shorter than the basis weighs the rest 0). Returns ``{"candidates": {name:
    compare(...)}, "best": name, "best_matches": bool, "ambiguous": [names]}``: the candidate with the smallest
    relative error, whether it is within the dtype's tolerance, and -- where two or more candidates match (they
    predict the same step, e.g. at N = 2) -- every matching name: the measurement cannot tell them apart, so no
    one of them may be claimed. ``clip``: the engine clips whatever it accumulated at this norm, so each
    candidate is clipped as it would be. With ``reference``, also ``predicted_ratio``: each candidate's norm over
    the reference's, i.e. the effective/reference ratio a user would measure if that hypothesis were true.
    """
    import torch

    b = torch.as_tensor(basis, dtype=torch.float64)
    vectors = {}
    for name, w in candidates.items():
        w = torch.as_tensor(w, dtype=torch.float64)
        if len(w) < len(b):
            w = torch.cat([w, torch.zeros(len(b) - len(w), dtype=torch.float64)])
        vectors[name] = clipped(w @ b, clip)
    vectors = {name: v for name, v in vectors.items() if v.norm() > 0}  # "all but the first" of one: no prediction
    out = {name: compare(effective, v) for name, v in vectors.items()}
    best = min(out, key=lambda n: out[n]["rel_l2"])
    matching = sorted(n for n in out if matches_reference(out[n], dtype))
    res = {"candidates": out, "best": best, "best_matches": best in matching,
           "ambiguous": matching if len(matching) > 1 else []}
    if reference is not None:
        rn = torch.as_tensor(reference, dtype=torch.float64).norm().item()
        res["predicted_ratio"] = {name: v.norm().item() / rn for name, v in vectors.items()}
    return res


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
    if not math.isfinite(m["cosine"]):
        out.append({"signal": "cosine", "value": m["cosine"], "limit": 1.0, "ok": False})
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


def describe_weights(weights, expected, ranks: int, n: int) -> str:
    """The step in words, from its fitted weights over a rank-major basis (rank r, micro-batch i -> r*n + i; a
    longer vector continues with the previous step's micro-batches): each micro-batch position's weight as a
    multiple of its right weight, e.g. "micro-batch 1 x0, the others x1". Ranks are named where they differ."""
    k = ranks * n
    if not all(math.isfinite(w) for w in weights[:k]):
        return "not finite: the applied step holds NaN or inf"
    # to a tenth: what tells one pattern from another; finer digits are the dtype's noise (bf16: ~1e-2)
    rel = [round(w / e, 1) + 0.0 if e else round(w * k, 1) + 0.0 for w, e in zip(weights[:k], expected[:k])]
    prev = [round(w * k, 1) + 0.0 for w in weights[k:2 * k]]

    def positions(vals):
        groups: dict = {}
        for i, v in enumerate(vals):
            groups.setdefault(v, []).append(i + 1)
        if len(groups) == 1:
            return f"every micro-batch x{_num(next(iter(groups)))}"
        main = max(groups, key=lambda v: len(groups[v]))
        parts = [f"micro-batch{'es' if len(ix) > 1 else ''} {','.join(map(str, ix))} x{_num(v)}"
                 for v, ix in groups.items() if v != main]
        return ", ".join(parts) + f", the others x{_num(main)}"

    per_rank = [tuple(rel[r * n:(r + 1) * n]) for r in range(ranks)]
    text = positions(list(per_rank[0])) if len(set(per_rank)) == 1 else \
        "; ".join(f"rank {r}: {positions(list(v))}" for r, v in enumerate(per_rank))
    if prev and any(abs(v) > 0.05 for v in prev):
        same = len(set(prev)) == 1
        text += f"; the previous step's micro-batches x{_num(prev[0])}" if same else \
            f"; the previous step's micro-batches {', '.join(_num(v) for v in prev)} (x their share)"
    return text


def step_name(h: dict | None) -> str | None:
    """The named hypothesis a step is (``explain``'s answer): its name; "ambiguous between 'A' and 'B'" where the
    measurement cannot tell two apart; "none" where no name fits; None where nothing was explained."""
    if not h:
        return None
    if h.get("ambiguous"):
        return "ambiguous between " + " and ".join(f"'{n}'" for n in h["ambiguous"])
    return h["best"] if h["best_matches"] else "none"


def annotate_steps(rec: dict) -> dict:
    """Per judged step of a record: ``matches`` (``step_name``), ``ties`` (the named hypotheses it cannot tell apart,
    [] where it can) and ``shape`` (``describe_weights``); the record's own are its worst step's (a one-step
    record: its own)."""
    dtype = rec.get("judge_dtype") or rec.get("dtype") or "fp32"
    for s in rec.get("steps") or []:
        s["matches"] = _named(s, dtype)
        s["ties"] = list((s.get("hypotheses") or {}).get("ambiguous") or [])
        s["parts"] = part_pattern(s, dtype, rec.get("world_size") or 1, rec.get("ga") or 1)
        if s["matches"] in (None, "none") and s["parts"]:  # a whole-step name fits nothing: say what the parts did
            s["matches"] = " and ".join(s["parts"])
        a = s.get("attribution")
        if a and rec.get("world_size") and rec.get("ga"):
            s["shape"] = describe_weights(a["weights"], a["expected_weights"], rec["world_size"], rec["ga"])
        off = groups_off(s, rec.get("judge_dtype") or rec.get("dtype") or "fp32")
        if off:
            s["shape"] = "; ".join([*([s["shape"]] if s.get("shape") else []), *off])
    if rec.get("steps"):
        worst = rec["steps"][rec.get("worst_step", 0)]
        rec["matches"], rec["shape"], rec["ties"] = worst["matches"], worst.get("shape"), worst["ties"]
        rec["parts"] = sorted({p for s in rec["steps"] for p in s["parts"]})
    else:
        rec["matches"] = _named(rec, rec.get("judge_dtype") or rec.get("dtype"))
        rec["ties"] = list((rec.get("hypotheses") or {}).get("ambiguous") or [])
    return annotate_norms(rec)


def annotate_norms(rec: dict) -> dict:
    """The logged grad norm of every judged step (``logged_norm``: what the engine reports) against the reference's
    (``reference_norm``): ``norm_verdict`` per step, and the record's (its first off step's, else its first step's)
    with ``norm_reason``; "n/a" where the engine reports none."""
    dtype = rec.get("judge_dtype") or rec.get("dtype") or "fp32"
    norms = []
    for s in rec.get("steps") or []:
        if s.get("reference_norm"):
            word, why = norm_verdict(s.get("logged_norm"), s["reference_norm"], dtype)
            s["norm_verdict"] = word
            norms.append((s.get("step", 0), word, why))
    if not rec.get("steps"):
        return rec
    off = [x for x in norms if x[1] == AFFECTED]
    step, word, why = (off or norms or [(0, "n/a", "no step ran")])[0]
    rec["norm_verdict"], rec["norm_reason"] = word, f"step {step + 1}: {why}" if norms else why
    return rec


PART_STALE = "an old gradient applied (to a part with none of its own, or the previous step's added)"
PART_LOST = "a part the boundary micro-batch missed lost its gradient"


def part_pattern(step: dict, dtype: str, ranks: int, n: int) -> list[str]:
    """What a step did to its parameter groups, named where it is one of two patterns that only a model whose
    parts some micro-batches miss can show: ``PART_STALE`` (a group whose right update is 0 moved, or whose fitted
    weights put more than half a share on the previous step's micro-batches) and ``PART_LOST`` (a group no
    boundary micro-batch reaches lost the micro-batches that do reach it). A model of one group is judged on its
    whole step the same way (``PART_STALE`` where the previous step's micro-batches carry more than half a share)."""
    tol, k, out = tolerance(dtype), ranks * n, set()
    boundary = {r * n + n - 1 for r in range(ranks)}
    whole = step.get("attribution") or {}
    if not step.get("groups") and whole and severity({**step, "dtype": dtype}) > 1 and \
            any(w > 0.5 / k for w in whole.get("weights", [])[k:]):
        out.add(PART_STALE)
    for g in (step.get("groups") or {}).values():
        a = g.get("attribution") or {}
        off = g["rel_err"] > tol.rel_l2 or a.get("misplaced_weight", 0.0) > tol.misplaced_weight
        if not off:
            continue
        if g["expected_zero"] or any(q >= k and w > 0.5 / k for q, w in zip(a.get("rows", []), a.get("weights", []))):
            out.add(PART_STALE)
        if g.get("lost") and a and not boundary & {q for q in a["rows"] if q < k}:
            out.add(PART_LOST)
    return sorted(out)


def groups_off(step: dict, dtype: str) -> list[str]:
    """Each parameter group a step got wrong, in words: what was lost, or applied where nothing belongs. A group
    whose fitted weights are the whole step's (the whole step's fit explains it) adds nothing and is not said."""
    tol, out = tolerance(dtype), []
    whole = step.get("attribution") or {}
    for name, g in (step.get("groups") or {}).items():
        misplaced = max((g.get(w) or {}).get("misplaced_weight", 0.0) for w in ("attribution", "uses"))
        if not (g["rel_err"] > tol.rel_l2 or misplaced > tol.misplaced_weight):
            continue
        a = g.get("attribution")
        if a and not g.get("uses") and whole.get("residual", 1.0) < 0.05 and all(
                abs(w - whole["weights"][q]) <= 0.1 * abs(x) for q, w, x in zip(a["rows"], a["weights"],
                                                                             a["expected_weights"])):
            continue
        if g.get("uses") and g["uses"]["misplaced_weight"] > tol.misplaced_weight and g["uses"]["residual"] < 0.05:
            out.append(f"{name}: its gradient is {g['uses']['shape']} (each use's right weight: 1)")
        elif g["expected_zero"]:
            out.append(f"{name}: updated by {g['rel_err']:.3g} of the step's norm where its right update is 0")
        elif g.get("lost"):
            out.append(f"{name}: the gradient from {g['lost']} was lost ({g['shape']})")
        else:
            out.append(f"{name}: {g.get('shape') or 'off'} (rel. error {g['rel_err']:.3g})")
    return out


def _named(step: dict, dtype: str | None) -> str | None:
    """``step_name``, except that a step on every signal the reference's is "global mean": a tie there is only with
    hypotheses that coincide with the reference at this N (at N = 1 "last micro-batch / N" is the mean)."""
    name = step_name(step.get("hypotheses"))
    if "'global mean'" in str(name) and step.get("metrics") and dtype in TOLERANCES \
            and severity({**step, "dtype": dtype}) <= 1.0:
        return "global mean"
    return name


def _num(v: float) -> str:
    return f"{v:g}"


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
    m, sigs = measured["metrics"], signals(measured)
    numbers = f"ratio {m['norm_ratio']:.4f}, cosine {m['cosine']:.5f}, rel. error {m['rel_l2']:.2e}"
    steps = measured.get("steps") or []
    where = f" at step {measured.get('worst_step', 0) + 1} (the worst of {len(steps)})" if len(steps) > 1 else ""
    if all(s["ok"] for s in sigs):
        return NOT_AFFECTED, (f"effective gradient matches the fp32 reference on every signal{where} ({numbers}; "
                              f"{len(sigs)} signals within the {measured['dtype']} limits)")
    return AFFECTED, (f"effective gradient is off the fp32 reference{where} ({numbers}): {_off(sigs)} "
                      f"({measured['dtype']})")
