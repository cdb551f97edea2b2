"""Fitting and naming a step: which named hypothesis the effective gradient is (``explain``: each candidate's
weights over the per-micro-batch basis, compared with the step; ``step_name``, its answer in words), the fitted
weights in words (``describe_weights``: each micro-batch position's weight as a multiple of its right one), and
what a record's judged steps are called, written onto the record (``annotate_steps``: per step the name, the
hypotheses it cannot tell apart, the step in words and what its parts did; ``annotate_norms``: the logged grad
norm's verdict), the record's own being its worst step's."""
from __future__ import annotations

import math

from gradkit.judge.oracle import AFFECTED, clipped, compare, norm_verdict, severity, signals
from gradkit.judge.parts import groups_off, multiple, part_pattern, unclipped
from gradkit.judge.tolerances import TOLERANCES

# named steps of an fp16 loss scaler: the optimizer divides by a loss scale the loss never got (B9), and the scale
# changed between the backward that scaled the loss and the unscale (B10: ``_update_scale`` runs first)
UNSCALED = "global mean / loss scale"
GROWN = " x old / new loss scale"  # a named step, then the scale's growth (B10) on top of it: B3's, halved
SCALE_GREW = "global mean" + GROWN
# a CPU gradient accumulator never reset (B11): this step's micro-batches but the first, and the last update again
CARRIED = "first micro-batch lost, the previous update applied again"
# no all-reduce at all (B8): each rank's partition stepped with the sum of that rank's own micro-batches
OWN_PARTITION = "each rank's partition: its own micro-batches, summed"
LOCAL = " without the all-reduce"  # a named step, then B8 on top of it: each rank's partition from its own micro-batches


def grown(hypotheses: dict, scale_change: float) -> dict:
    """Each named step of ``hypotheses`` (weights over the basis) as the scale's growth leaves it (B10 on a step
    another bug already made: the weights times old / new), named ``<name> x old / new loss scale``; "global mean"'s
    is ``SCALE_GREW``, B10 alone. None where the scale did not move; none for a step that is the mean at this N (at
    GA 1 "last micro-batch / N" is the mean: its growth is B10's own step, ``SCALE_GREW``, not a second name)."""
    if scale_change == 1.0:
        return {}
    mean = hypotheses["global mean"]  # every hypothesis weighs the same basis (the mean's length)
    return {name + GROWN: [x * scale_change for x in w] for name, w in hypotheses.items()
            if name == "global mean" or not _is(w, mean)}


def _is(weights, mean) -> bool:
    """``weights`` are the mean's at this N (to rounding): a named step that is no step of its own here."""
    return all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15) for a, b in zip(weights, mean))


def local(hypotheses: dict, w: int, n: int, split) -> dict:
    """Each named step of ``hypotheses`` (weights over the rank-major basis, ``w`` ranks x ``n`` micro-batches) as it is
    where nothing is all-reduced (B8 on a step another bug already made): rank r's partition of the flat parameters
    (``split(size)``: each rank's ``(lo, hi)``) gets rank r's own rows of the step, not averaged over the ranks (x w),
    named ``<name> without the all-reduce``. The mean's is B8 alone (``OWN_PARTITION``); a step that is the mean at
    this N gets none; a step over more than this step's micro-batches (an earlier one's) gets none."""
    import torch

    k, mean = w * n, hypotheses["global mean"]
    out = {}
    for name, weights in hypotheses.items():
        if callable(weights) or len(weights) != k or (name != "global mean" and _is(weights, mean)):
            continue

        def step(b, weights=weights):
            v, x = b.new_zeros(b.shape[1]), torch.as_tensor(weights, dtype=b.dtype) * w
            for r, (lo, hi) in enumerate(split(b.shape[1])):
                v[lo:hi] = x[r * n:(r + 1) * n] @ b[r * n:(r + 1) * n, lo:hi]
            return v
        out[OWN_PARTITION if name == "global mean" else name + LOCAL] = step
    return out


def grown_base(name, suffix: str = GROWN) -> str | None:
    """The named step a grown one was before the scale's growth (``grown``), except B10's own (``SCALE_GREW``);
    with ``suffix=LOCAL``, the one a step without the all-reduce was (``local``). None for any other name."""
    if isinstance(name, str) and name.endswith(suffix) and name != SCALE_GREW:
        return name[:-len(suffix)]
    return None


def explain(effective, basis, candidates: dict, dtype: str, reference=None, clip: float = 0.0,
            floor: float = 0.0) -> dict:
    """Which hypothesis is the effective gradient? Compare it with ``sum_k w_k * basis_k`` for each candidate.

    ``candidates`` maps a name ("global mean", "last micro-batch / N", ...) to its weights over
    the basis (a candidate shorter than the basis weighs the rest 0), or to a function of the basis that returns the
    step it predicts (a step no single weighting gives: B8's, per partition; B11's, with the previous update). Returns ``{"candidates": {name:
    compare(...)}, "best": name, "best_matches": bool, "ambiguous": [names]}``: the candidate with the smallest
    relative error, whether it is within the dtype's tolerance, and -- where two or more candidates match (they
    predict the same step, e.g. at N = 2) -- every matching name: the measurement cannot tell them apart, so no
    one of them may be claimed. ``clip``: the engine clips whatever it accumulated at this norm, so each
    candidate is clipped as it would be. With ``reference``, also ``predicted_ratio``: each candidate's norm over
    the reference's, i.e. the effective/reference ratio a user would measure if that hypothesis were true.
    ``floor``: the norm of the error the step's read may carry (the rounding of the weights it is the difference
    of): a candidate much smaller than the weights' own step is known only to within it (``read_floor``).
    """
    import torch

    b = torch.as_tensor(basis, dtype=torch.float64)
    vectors = {}
    for name, w in candidates.items():
        if callable(w):  # a step that is no one weighting of the basis (per partition, or with an earlier update)
            vectors[name] = clipped(torch.as_tensor(w(b), dtype=torch.float64), clip)
            continue
        w = torch.as_tensor(w, dtype=torch.float64)
        if len(w) < len(b):
            w = torch.cat([w, torch.zeros(len(b) - len(w), dtype=torch.float64)])
        vectors[name] = clipped(w @ b, clip)
    vectors = {name: v for name, v in vectors.items() if v.norm() > 0}  # "all but the first" of one: no prediction
    out = {name: compare(effective, v) for name, v in vectors.items()}
    best = min(out, key=lambda n: out[n]["rel_l2"])
    matching = sorted(n for n in out if all(s["ok"] for s in signals(
        {"metrics": out[n], "dtype": dtype, "read_floor": floor / max(vectors[n].norm().item(), 1e-300)})))
    res = {"candidates": out, "best": best, "best_matches": best in matching,
           "ambiguous": matching if len(matching) > 1 else []}
    if reference is not None:
        rn = torch.as_tensor(reference, dtype=torch.float64).norm().item()
        res["predicted_ratio"] = {name: v.norm().item() / rn for name, v in vectors.items()}
    return res


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
            return f"every micro-batch x{multiple(next(iter(groups)))}"
        main = max(groups, key=lambda v: len(groups[v]))
        parts = [f"micro-batch{'es' if len(ix) > 1 else ''} {','.join(map(str, ix))} x{multiple(v)}"
                 for v, ix in groups.items() if v != main]
        return ", ".join(parts) + f", the others x{multiple(main)}"

    per_rank = [tuple(rel[r * n:(r + 1) * n]) for r in range(ranks)]
    text = positions(list(per_rank[0])) if len(set(per_rank)) == 1 else \
        "; ".join(f"rank {r}: {positions(list(v))}" for r, v in enumerate(per_rank))
    if prev and any(abs(v) > 0.05 for v in prev):
        same = len(set(prev)) == 1
        text += f"; the previous step's micro-batches x{multiple(prev[0])}" if same else \
            f"; the previous step's micro-batches {', '.join(multiple(v) for v in prev)} (x their share)"
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
    ranks, n = rec.get("replicas") or rec.get("world_size") or 1, rec.get("ga") or 1
    clip = rec.get("clip") or (rec.get("config") or {}).get("clip") or 0.0
    for s in rec.get("steps") or []:
        s["matches"] = _named(s, dtype)  # the hypotheses are clipped as the engine clips (``explain``)
        s["ties"] = list((s.get("hypotheses") or {}).get("ambiguous") or [])
        before = unclipped(s, clip, dtype, ranks, n)  # the weights and parts up to the clip
        s["parts"] = part_pattern(before, dtype, ranks, n)
        if s["matches"] in (None, "none") and s["parts"]:  # a whole-step name fits nothing: say what the parts did
            s["matches"] = " and ".join(s["parts"])
        a = before.get("attribution")
        if a and rec.get("world_size") and rec.get("ga"):
            s["shape"] = describe_weights(a["weights"], a["expected_weights"], ranks, rec["ga"])
            if before is not s:
                s["unclipped_by"] = before["unclipped_by"]
                s["shape"] = (f"before the clip (the engine scaled its gradient of norm {s['logged_norm']:.4g} by "
                              f"{before['unclipped_by']:.3g}): ") + s["shape"]
        off = groups_off(before, dtype)
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
        if s.get("reference_norm") and not s.get("skipped"):  # a skipped step's norm is the overflow's
            word, why = norm_verdict(s.get("logged_norm"), s["reference_norm"], dtype)
            s["norm_verdict"] = word
            norms.append((s.get("step", 0), word, why))
    if not rec.get("steps"):
        return rec
    off = [x for x in norms if x[1] == AFFECTED]
    step, word, why = (off or norms or [(0, "n/a", "no step ran")])[0]
    rec["norm_verdict"], rec["norm_reason"] = word, f"step {step + 1}: {why}" if norms else why
    return rec


def _named(step: dict, dtype: str | None) -> str | None:
    """``step_name``, except that a step on every signal the reference's is "global mean": a tie there is only with
    hypotheses that coincide with the reference at this N (at N = 1 "last micro-batch / N" is the mean)."""
    name = step_name(step.get("hypotheses"))
    if "'global mean'" in str(name) and step.get("metrics") and dtype in TOLERANCES \
            and severity({**step, "dtype": dtype}) <= 1.0:
        return "global mean"
    return name
