"""A step's parameter groups (a frozen block, a tied weight, an expert) judged each on its own: ``judge_groups``
(each group's error, the micro-batches that reach it, its fitted weights and what it lost), the two patterns only
a model whose parts some micro-batches miss can show (``part_pattern``: ``PART_STALE``, ``PART_LOST``), each
group a step got wrong, in words (``groups_off``; a fitted weight as a multiple of its right one: ``multiple``), and a
clipped step's weights as they were before the clip (``unclipped``), so that a shape is named up to the clip."""
from __future__ import annotations

import math

from gradkit.judge.oracle import attribute, severity
from gradkit.judge.tolerances import tolerance

PART_STALE = "an old gradient applied (to a part with none of its own, or the previous step's added)"
PART_LOST = "a part the boundary micro-batch missed lost its gradient"


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
                         "shape": ", ".join(f"{x} x{multiple(round(w, 1) + 0.0)}" for x, w in zip(names, u["weights"]))}
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
        text = f"every micro-batch reaching it x{multiple(next(iter(parts)))}"
    else:
        main = max(parts, key=lambda v: len(parts[v]))
        text = ", ".join(f"{_positions(qs, ranks, n)} x{multiple(v)}" for v, qs in parts.items() if v != main) + \
            f", the others reaching it x{multiple(main)}"
    prev = [round(w * k, 1) + 0.0 for q, w in zip(rows, weights) if q >= k]
    if any(abs(v) > 0.05 for v in prev):
        text += f"; the previous step's micro-batches x{', '.join(multiple(v) for v in prev)}"
    return text


def unclipped(step: dict, clip: float, dtype: str, ranks: int, n: int) -> dict:
    """The step as the engine had it before its clip, where the engine clipped: the engine scales whatever it
    accumulated by ``clip / its norm`` (the norm it logs), the reference by ``clip_coef``, so the fitted weights over
    the expected ones are off by the ratio of the two even where the step's shape is right. Dividing each fitted
    weight by the engine's coefficient and each expected one by the reference's gives the weights of the step before
    the clip, so a bug's shape (a lost micro-batch, an old gradient applied again) is named with or without clipping.
    Returns ``step`` itself where no clip acted (no clip, no logged norm, a logged norm within the clip, or an applied
    step whose norm is not the clip: then the engine did not scale it as said); else a copy with ``attribution`` and
    each group's rescaled (its ``lost`` and ``shape`` again) and ``unclipped_by``: the engine's coefficient."""
    logged, coef = step.get("logged_norm"), step.get("clip_coef")
    applied = (step.get("metrics") or {}).get("effective_norm")
    if not clip or not coef or not isinstance(logged, (int, float)) or not math.isfinite(logged) or logged <= clip \
            or applied is None or abs(applied - clip) > tolerance(dtype).norm_ratio * clip:
        return step
    engine = clip / logged

    def rescale(a: dict) -> dict:
        return {**a, "weights": [w / engine for w in a["weights"]],
                "expected_weights": [x / coef for x in a["expected_weights"]]}

    out = {**step, "unclipped_by": engine}
    if step.get("attribution"):
        out["attribution"] = rescale(step["attribution"])
    groups = {}
    for name, g in (step.get("groups") or {}).items():
        a = g.get("attribution")
        if a:
            a = rescale(a)
            lost = [q for q, w, x in zip(a["rows"], a["weights"], a["expected_weights"]) if x > 0 and w < 0.5 * x]
            g = {**g, "attribution": a, "lost": _positions(lost, ranks, n) if lost else None,
                 "shape": _group_shape(a["rows"], a["weights"], a["expected_weights"], ranks, n)}
        groups[name] = g
    if groups:
        out["groups"] = groups
    return out


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


def multiple(v: float) -> str:
    """A weight as a multiple of its right one, as written after an "x" (``x0.5``, ``x1``)."""
    return f"{v:g}"
