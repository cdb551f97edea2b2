"""The watch's judgement of one consumed step, the oracle's way (``gradkit.judge.oracle``): the exact numbers of the
verdict (norm ratio, cosine, rel. L2 error, max rel. error) from dot products taken piece by piece where the
optimizer holds the gradient (``Tally``), the fitted weights from the sketches (``gradkit.watch.sketch``), the ranks'
agreement, and a **control** in the same world: the reference itself sent through the very same read (the same
pieces, offsets, sums over ranks and sketch) must come out as the reference, so a read that misses, repeats or
misplaces a piece, or a basis the sketch cannot tell apart, makes the verdict ``inconclusive``, never ``affected``.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from gradkit.judge import naming, oracle, tolerances
from gradkit.judge.parts import PART_LOST, PART_STALE
from gradkit.watch.reference import Whole, all_gather, all_sum, dot64, world
from gradkit.watch.sketch import Sketch

_CHUNK = 1 << 20  # values converted to fp64 at a time (two vectors: 16 MB)
STALE = "the previous step's gradient applied again"
SCALE_GREW = naming.SCALE_GREW  # the loss scale changed before the gradient was unscaled (B10)


class Tally:
    """Sums over the pieces of a consumed gradient, against the reference (``ref``: one tensor per parameter, the
    global-batch gradient; ``coef``: the clip coefficient the engine should apply to it)."""

    def __init__(self, ref, coef: float, sketch: Sketch):
        self.piece = (ref if hasattr(ref, "piece") else Whole(ref)).piece  # a list: one tensor per parameter
        self.coef, self.sketch = coef, sketch
        self.ee = self.er = self.dd = self.rr = 0.0
        self.per = torch.zeros(len(ref), 2, dtype=torch.float64)  # per parameter: consumed and reference norm**2
        self.maxdiff = 0.0
        self.se, self.sr = sketch.zeros(), sketch.zeros()

    def add(self, t: int, start: int, values: torch.Tensor) -> None:
        n = values.numel()
        r_all = self.piece(t, start, n)
        for lo in range(0, n, _CHUNK):  # fp64 dot products (as the reference's own norm, dot64)
            v = values[lo:lo + _CHUNK].double()
            r = r_all[lo:lo + v.numel()].to(v.device).double()
            vv, rr = float(torch.dot(v, v)), float(torch.dot(r, r))
            self.ee += vv
            self.per[t, 0] += vv
            self.per[t, 1] += rr
            self.er += float(torch.dot(v, r))
            d = v.sub_(r, alpha=self.coef)  # v is a copy of its own: the difference in place
            self.dd += float(torch.dot(d, d))
            self.rr += rr
            self.maxdiff = max(self.maxdiff, float(d.abs().max()) if d.numel() else 0.0)
        self.sketch.add(self.se, t, values, start)
        self.sketch.add(self.sr, t, r_all, start)

    def finish(self, replicated: bool) -> list:
        """Sums over the ranks where each holds its own pieces (a collective). Returns every rank's own sketch of
        what it read: with a replicated read, for the ranks' agreement; with a partitioned one, each partition's
        step, fitted on its own (a leak in one rank's accumulator shows in its partition only)."""
        own = all_gather(self.se)
        if replicated:
            return own
        nums = torch.tensor([self.ee, self.er, self.dd, self.rr], dtype=torch.float64)
        all_sum(nums)
        self.ee, self.er, self.dd, self.rr = nums.tolist()
        self.maxdiff = float(all_sum(torch.tensor([self.maxdiff], dtype=torch.float64), dist.ReduceOp.MAX))
        all_sum(self.se)
        all_sum(self.sr)
        all_sum(self.per)
        return own


def hypotheses(counts: list, per_rank: list, coef: float, loss_scale: float = 1.0, previous=None,
               own: int | None = None, declared_ga: int | None = None, scale_change: float = 1.0) -> dict:
    """Named steps as weights over the rank-major basis (each micro-batch's mean-loss gradient), from the
    micro-batches' counts: the global mean (each n_k / N), only each rank's last micro-batch, every micro-batch's
    mean summed (1/W each: a missing division by the accumulation), each micro-batch's mean averaged equally (a
    mean over micro-batches, not over samples or tokens), each rank's own count (a per-rank mean, then averaged),
    each rank's first and last micro-batch alone (the ones between lost, B5; offered where every rank ran three or
    more),
    the global mean over the loss scale, the previous step's gradient applied again, and, seen from partition
    ``own``, that rank's boundary micro-batch whole and the other ranks' missing (BF16_Optimizer's leak, B4), and where
    the step came after fewer micro-batches than the ``declared_ga`` the loop divides by, the mean / that GA, and where
    the engine's loss scale changed between the step's backward passes and its read (``scale_change``: the scale the
    losses had over the scale at the read), the mean times that change (the gradient unscaled by the new scale)."""
    total = float(sum(counts)) or 1.0
    w = len(per_rank)
    k = len(counts)
    starts = [sum(per_rank[:r]) for r in range(w)]
    last = {starts[r] + per_rank[r] - 1 for r in range(w) if per_rank[r]}
    rank_of = [r for r in range(w) for _ in range(per_rank[r])]
    rank_total = [sum(counts[s:s + n]) or 1.0 for s, n in zip(starts, per_rank)]
    live = [c > 0 for c in counts]
    n_live = sum(live) or 1
    out = {"global mean": [c / total for c in counts],
           "last micro-batch / N": [c / total if i in last else 0.0 for i, c in enumerate(counts)],
           "sum of micro-batches": [1.0 / w if live[i] else 0.0 for i in range(k)],
           "mean of micro-batch means": [1.0 / n_live if live[i] else 0.0 for i in range(k)],
           "each rank's own mean": [counts[i] / (w * rank_total[rank_of[i]]) for i in range(k)]}
    if per_rank and min(per_rank) > 2:  # each rank's first and last alone (B5); of two or fewer that is all of them
        ends = last | {starts[r] for r in range(w)}
        out["first and last micro-batch"] = [c / total if i in ends else 0.0 for i, c in enumerate(counts)]
    if own is not None and w > 1:
        out["own rank's boundary micro-batch"] = [
            (w * counts[i] / total if rank_of[i] == own else 0.0) if i in last else counts[i] / total for i in range(k)]
    if declared_ga and declared_ga > max(per_rank or [0]):
        out["global mean / GA"] = [c / (total * declared_ga) for c in counts]
    if loss_scale > 1.0:
        out[naming.UNSCALED] = [c / (total * loss_scale) for c in counts]
    if scale_change != 1.0:
        out[SCALE_GREW] = [c * scale_change / total for c in counts]
    out = {name: [x * coef for x in ws] for name, ws in out.items()}
    if previous is not None and len(previous):  # the previous step's own weights over its micro-batches
        out[STALE] = out["global mean"] + [coef * float(x) for x in previous]
    return out


def _parts(tally: Tally, names: list, whole_norm: float) -> tuple[dict, dict]:
    """``({name: share}, {name: share})``: the parameters stepped without a gradient of their own (reference 0, the
    consumed gradient not), and those reached but given nothing; each with its share of the whole step's norm."""
    stale, lost = {}, {}
    for t, (ee, rr) in enumerate(tally.per.tolist()):
        name = names[t] if t < len(names) else f"parameter {t}"
        if rr == 0.0 and ee > 0.0:
            stale[name] = ee ** 0.5 / whole_norm
        elif rr > 0.0 and ee == 0.0:
            lost[name] = tally.coef * rr ** 0.5 / whole_norm
    return stale, lost


def clipped_by_own_norm(cands: dict, full: torch.Tensor, effective: torch.Tensor, en: float, clip: float | None,
                        coef: float, dtype: str) -> dict:
    """Where the engine clips (``clip``) and the applied step's norm ``en`` sits at the clip, the step it took was
    clipped by its own norm: a wrong step (a sum, a stale part added) is scaled by its own coefficient, not the
    reference's (``coef``, which ``hypotheses`` carries). So each named step whose own norm reaches the clip (on the
    sketch, within 4/sqrt(size) of it) is predicted at the applied step's norm: compared by direction alone. Named
    steps that differ only by scale then all match, and the tie is said. Returns ``{name: factor}`` for the
    weights (1.0 where nothing changes)."""
    out = {name: 1.0 for name in cands}
    if not clip or not coef or abs(en / clip - 1) > tolerances.tolerance(dtype).norm_ratio:
        return out
    reach = clip * (1 - 4 / math.sqrt(full.shape[1]))
    target = float(effective.norm())
    for name, w in cands.items():
        weights = torch.zeros(len(full), dtype=torch.float64)
        weights[:len(w)] = torch.as_tensor(w[:len(full)], dtype=torch.float64)
        norm = float((weights @ full).norm())
        if norm and norm / coef >= reach:
            out[name] = target / norm
    return out


FIT_KEYS = ("attribution", "rank_buffers")  # the fitted weights: an explanation of the step, not a measure of it


def exact_first(measured: dict, control: dict) -> tuple[str, str]:
    """The oracle's verdict, where the fitted weights alone never make a step affected or its control off: a step
    (or a control) that matches the reference on every exact signal (ratio, cosine, rel. and max error, the ranks'
    spread, each part's error) is right whatever the fit says, since the fit's weights may not be identifiable on
    the user's micro-batches (alike ones, a repeated row, the same data on two ranks); that is said."""
    word, why = oracle.verdict(measured, control)
    if word in (oracle.NOT_AFFECTED, oracle.CANNOT_RUN):
        return word, why
    bare = [{k: v for k, v in d.items() if k not in FIT_KEYS} for d in (measured, control)]
    exact, exact_why = oracle.verdict(*bare)
    if exact != oracle.NOT_AFFECTED:
        return word, why
    off = [s for d in (control, measured) for s in oracle.signals(d) if not s["ok"]]
    return exact, (f"{exact_why}; the fitted weights are not identifiable on these micro-batches "
                   f"({off[0]['signal']} {off[0]['value']:.2e} where the exact signals agree)")


def judgement(tally: Tally, rr_all: float, maxref: float, basis: torch.Tensor, counts: list, per_rank: list,
              dtype: str, own_sketches: list, prev: tuple | None = None, loss_scale: float = 1.0,
              parts: torch.Tensor | None = None, names: list | None = None, declared_ga: int | None = None,
              clip: float | None = None, scale_change: float = 1.0) -> dict:
    """``{"measured", "control", "verdict", "why", "attribution", "explained", "shape"}`` of one consumed step.
    ``rr_all``: the squared norm of the reference over every parameter the optimizer steps; ``maxref`` its largest
    entry; ``basis``: each micro-batch's sketch of its summed-loss gradient (rank-major); ``prev``: the previous
    step's ``(rows, weights)`` where it was judged too (its micro-batches' mean-loss sketches and right weights);
    ``parts``: where each rank's optimizer holds its own partition, the basis restricted to each partition (each
    partition is then fitted and named on its own, ``rank_buffers``), and ``own_sketches`` each partition's read;
    ``names``: the parameters' names, for the parts a step got wrong on their own: a parameter no micro-batch reached
    that was stepped anyway (an old gradient: ``PART_STALE``), one that was reached and got nothing (``PART_LOST``),
    each judged as its share of the whole step (``groups``); ``clip``: the norm the engine clips at, where a wrong
    step is clipped by its own norm (``clipped_by_own_norm``); ``scale_change``: the fp16 loss scale the step's losses
    had over the one at its read (``hypotheses``)."""
    c = tally.coef
    rn = c * math.sqrt(rr_all)
    en = math.sqrt(max(tally.ee, 0.0))
    missing = max(rr_all - tally.rr, 0.0) * c * c  # the reference where no piece was read (a read that misses parts)
    metrics = {"norm_ratio": en / rn, "cosine": c * tally.er / (en * rn) if en > 0 else 0.0,
               "rel_l2": math.sqrt(max(tally.dd + missing, 0.0)) / rn, "max_rel_err": tally.maxdiff / (c * maxref),
               "effective_norm": en, "reference_norm": rn}
    total = float(sum(counts)) or 1.0
    rows = torch.stack([b / n if n else b for b, n in zip(basis, counts)]) if len(basis) else basis
    expected = torch.tensor([c * n / total for n in counts], dtype=torch.float64)
    full, want = rows, expected
    if prev is not None and len(prev[0]):
        full = torch.cat([rows, prev[0]])
        want = torch.cat([expected, torch.zeros(len(prev[0]), dtype=torch.float64)])
    attribution = oracle.attribute(tally.se, full, want)
    measured = {"metrics": metrics, "dtype": dtype, "attribution": attribution}
    stale, lost = _parts(tally, names or [], rn)
    if stale or lost:
        measured["groups"] = {f"{n} ({why})": {"rel_err": share} for why, found in
                              (("no gradient of its own, stepped", stale), ("reached, given nothing", lost))
                              for n, share in found.items()}
    part_names = []
    if parts is not None:
        measured["rank_buffers"] = []
        for q, (mine, rows_q) in enumerate(zip(own_sketches, parts)):
            basis_q = torch.stack([b / n if n else b for b, n in zip(rows_q, counts)])
            measured["rank_buffers"].append({"attribution": oracle.attribute(mine, basis_q, expected)})
            hyp = hypotheses(counts, per_rank, c, loss_scale, own=q, scale_change=scale_change)
            scale = clipped_by_own_norm(hyp, rows, tally.se, en, clip, c, dtype)
            h = naming.explain(mine, basis_q, {k: [x * scale[k] for x in w] for k, w in hyp.items()}, dtype)
            part_names.append(naming.step_name(h))
    elif len(own_sketches) > 1:
        measured["rank_spread"] = {"consumed gradients": oracle.spread(own_sketches)}
    through = math.sqrt(tally.rr / rr_all) if rr_all else 0.0
    control = {"metrics": {"norm_ratio": through, "cosine": through if through <= 1 else 1 / through,
                           "rel_l2": math.sqrt(abs(rr_all - tally.rr) / rr_all) if rr_all else math.inf,
                           "max_rel_err": 0.0},
               "dtype": "fp32", "attribution": oracle.attribute(c * tally.sr, full, want)}
    word, why = exact_first(measured, control)
    cands = hypotheses(counts, per_rank, c, loss_scale, prev[1] if prev is not None else None,
                       declared_ga=declared_ga, scale_change=scale_change)
    scale = clipped_by_own_norm(cands, full, tally.se, en, clip, c, dtype)
    cands = {k: [x * scale[k] for x in w] for k, w in cands.items()}
    explained = naming.explain(tally.se, full, cands, dtype)
    n = max(per_rank) if per_rank else 1
    shape = naming.describe_weights(attribution["weights"], want.tolist(), len(per_rank), n)
    matches = naming.step_name(explained)
    whole = " and ".join(w for w, found in ((PART_STALE, stale), (PART_LOST, lost)) if found)
    if matches == "none" and whole:
        matches = whole  # the step is right but for parts: named by what those parts got
        shape += f"; {whole}: " + ", ".join(list(stale) + list(lost))
    if matches == "none" and part_names and len(set(part_names)) == 1 and part_names[0] not in (None, "none"):
        matches = part_names[0]  # every partition is the same named step, each from its own rank's view
    if part_names and matches != naming.step_name(explained):
        shape += "; per partition: " + ", ".join(f"rank {q}'s {n!r}" for q, n in enumerate(part_names))
    return {"measured": measured, "control": control, "verdict": word, "why": why, "explained": explained,
            "matches": matches, "shape": shape, "partitions": part_names}
