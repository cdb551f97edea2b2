"""The watch's judgement (``gradkit.watch.judge``) in one process, on the paths that otherwise run only in 2-rank jobs
(tests/test_watch_jobs.py): a partitioned read (ZeRO-1/2, BF16_Optimizer: rank q's optimizer holds one range of the
flat gradient, here one that cuts a parameter in two), each partition fitted and named on its own, the sums over the
ranks, a replicated read's agreement, the named steps (hypotheses) by their definitions, the parts a step got wrong
on their own, and the control. The ranks are threads of this process meeting in a fake ``all_gather`` / ``all_sum``
(``FakeWorld``); every consumed step is built here from its defect's definition (weights over each micro-batch's
mean-loss gradient), never from ``hypotheses`` itself."""
import math
import threading

import pytest
import torch
import torch.distributed as dist

import gradkit.watch.judge as wj
import gradkit.watch.reference as wref
from gradkit.judge import oracle
from gradkit.judge.parts import PART_LOST, PART_STALE
from gradkit.watch.judge import STALE, Tally, clipped_by_own_norm, dot64, hypotheses, judgement
from gradkit.watch.reference import restricted
from gradkit.watch.sketch import Sketch

SHAPES = [(6, 5), (20,), (2, 5)]
NUMELS = [30, 20, 10]
NAMES = ["body.weight", "body.bias", "head.weight"]
COUNTS = [2.0, 3.0, 5.0, 4.0, 1.0, 7.0]  # rank-major: rank 0 micro-batches 0..2 (10 samples), rank 1 3..5 (12)
PER_RANK = [3, 3]
N = 22.0
LAST = (2, 5)  # each rank's boundary micro-batch
W = 2
HALVES = [(0, 25), (25, 60)]  # rank 0 holds the flat's coordinates 0..25 (most of body.weight), rank 1 the rest
OWN = "own rank's boundary micro-batch"
FP32 = oracle.tolerance("fp32")


class FakeWorld:
    """``w`` ranks as ``w`` threads of this process; ``all_gather`` / ``all_sum`` meet at a barrier as the collectives
    of ``gradkit.watch.reference`` do (every rank's tensor, or their sum / max, on every rank)."""

    def __init__(self, w: int):
        self.w, self.slots, self.me = w, [None] * w, threading.local()
        self.barrier = threading.Barrier(w, timeout=30)

    def _meet(self, t):
        self.slots[self.me.rank] = t.detach().clone()
        self.barrier.wait()
        got = [s.clone() for s in self.slots]
        self.barrier.wait()
        return got

    def all_gather(self, t):
        return self._meet(t)

    def all_sum(self, t, op=None):
        got = torch.stack(self._meet(t))
        t.copy_(got.amax(0) if op == dist.ReduceOp.MAX else got.sum(0))
        return t

    def run(self, fn) -> list:
        out, errors = [None] * self.w, []

        def rank(r):
            self.me.rank = r
            try:
                out[r] = fn(r)
            except BaseException as e:  # noqa: BLE001 -- re-raised below, the others released from the barrier
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(self.w)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        if errors:
            raise errors[0]
        return out


def _world(monkeypatch, w: int) -> FakeWorld:
    world = FakeWorld(w)
    monkeypatch.setattr(wj, "all_gather", world.all_gather)
    monkeypatch.setattr(wj, "all_sum", world.all_sum)
    return world


def pieces(lo: int, hi: int) -> list:
    """``(t, start, numel)`` of the flat gradient's coordinates ``lo .. hi`` (parameters one after another)."""
    out, off = [], 0
    for t, n in enumerate(NUMELS):
        a, b = max(lo, off), min(hi, off + n)
        if a < b:
            out.append((t, a - off, b - a))
        off += n
    return out


def grads_of(k: int = len(COUNTS), seed: int = 0, unreached=()) -> list:
    """Each micro-batch's summed-loss gradient, one tensor per parameter (``unreached``: parameters no micro-batch
    reaches, 0 there)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(k):
        per = [torch.randn(s, generator=g) for s in SHAPES]
        out.append([torch.zeros(s) if t in unreached else x for t, (s, x) in enumerate(zip(SHAPES, per))])
    return out


def combo(grads, weights, counts=COUNTS) -> list:
    """``sum_k weights[k] * (micro-batch k's mean-loss gradient)``, per parameter."""
    return [sum((w * g[t] / n for g, w, n in zip(grads, weights, counts) if w), torch.zeros(s))
            for t, s in enumerate(SHAPES)]


def reference(grads, counts=COUNTS) -> list:
    total = float(sum(counts)) or 1.0
    return [sum((g[t] for g in grads), torch.zeros(s)) / total for t, s in enumerate(SHAPES)]


def flat(vec) -> torch.Tensor:
    return torch.cat([x.reshape(-1) for x in vec]).double()


def unflat(v: torch.Tensor) -> list:
    return [x.reshape(s).float() for x, s in zip(v.split(NUMELS), SHAPES)]


def stitched(steps: list, holds=HALVES) -> list:
    """One step made of partition q's coordinates from ``steps[q]`` (each partition's own accumulator)."""
    v = torch.zeros(sum(NUMELS), dtype=torch.float64)
    for (lo, hi), s in zip(holds, steps):
        v[lo:hi] = flat(s)[lo:hi]
    return unflat(v)


def boundary_leak(grads, own: int) -> list:
    """BF16_Optimizer's leak (B4) as rank ``own``'s partition sees it: its own rank's boundary micro-batch whole (W x
    its right weight), the other ranks' boundary micro-batches missing, every other micro-batch right."""
    return combo(grads, [(W * n / N if k // 3 == own else 0.0) if k in LAST else n / N for k, n in enumerate(COUNTS)])


def judged(monkeypatch, step, grads, counts=COUNTS, per_rank=PER_RANK, coef=1.0, holds=HALVES,
           replicated=False, steps=None, read=None, names=NAMES, size=256, **kw) -> list:
    """Every rank's judgement of one consumed step, read as the watch reads it: rank q's optimizer holds the flat
    range ``holds[q]`` (partitioned: the basis also restricted to each partition) or, ``replicated``, every rank the
    whole (``steps``: each rank's own, where they differ). ``read(q, fragments)``: what rank q's read gives instead
    of its fragments ``(t, start, values)`` (a read that misses, repeats or misplaces a piece)."""
    w = len(per_rank)
    ref = reference(grads, counts)
    rr_all = sum(dot64(r) for r in ref)  # as gradkit.watch.core sums the reference's norm
    maxref = max(float(r.abs().max()) for r in ref)
    sketch = Sketch(NUMELS, size)
    basis = torch.stack([sketch.of(g) for g in grads])
    partitions = [[(t, 0, n) for t, n in enumerate(NUMELS)]] * w if replicated else [pieces(*h) for h in holds]
    parts = None if replicated else torch.stack([restricted(sketch, g, partitions) for g in grads]).transpose(0, 1)
    tallies = []
    for q in range(w):
        mine = (steps or [step] * w)[q]
        frags = [(t, start, mine[t].reshape(-1)[start:start + n]) for t, start, n in partitions[q]]
        tally = Tally(ref, coef, sketch)
        for t, start, values in (read(q, frags) if read else frags):
            tally.add(t, start, values)
        tallies.append(tally)
    world = _world(monkeypatch, w)
    return world.run(lambda q: judgement(tallies[q], rr_all, maxref, basis, counts, per_rank, "fp32",
                                         tallies[q].finish(replicated), parts=parts, names=names, **kw))


def _same_on_every_rank(recs: list) -> dict:
    """Every rank judges the same step the same way (each raises ``Affected`` or none does)."""
    for r in recs[1:]:
        assert (r["verdict"], r["matches"], r["partitions"], r["shape"]) == \
               (recs[0]["verdict"], recs[0]["matches"], recs[0]["partitions"], recs[0]["shape"])
    return recs[0]


# ---------------------------------------------------------------- the named steps, by their definitions

def test_each_named_step_is_its_definition_over_the_rank_major_micro_batches():
    c = 0.5  # a clipped step: every named step scaled by the clip coefficient
    h = hypotheses(COUNTS, PER_RANK, c)
    assert set(h) == {"global mean", "last micro-batch / N", "sum of micro-batches", "mean of micro-batch means",
                      "each rank's own mean", "first and last micro-batch"}  # no loss scale, GA, partition or
    # previous step given: none of those
    assert h["global mean"] == pytest.approx([c * n / 22 for n in COUNTS])
    assert h["last micro-batch / N"] == pytest.approx([0, 0, c * 5 / 22, 0, 0, c * 7 / 22])
    assert h["sum of micro-batches"] == pytest.approx([c / 2] * 6)  # each mean whole, averaged over 2 ranks
    assert h["mean of micro-batch means"] == pytest.approx([c / 6] * 6)
    assert h["first and last micro-batch"] == pytest.approx([c * n / 22 if k != 1 and k != 4 else 0.0
                                                            for k, n in enumerate(COUNTS)])  # each rank's middle lost
    assert h["each rank's own mean"] == pytest.approx([c * n / (2 * 10) for n in COUNTS[:3]]
                                                      + [c * n / (2 * 12) for n in COUNTS[3:]])
    for own in (0, 1):  # from partition ``own``: that rank's boundary micro-batch whole, the other rank's missing
        seen = hypotheses(COUNTS, PER_RANK, c, own=own)[OWN]
        right = [c * n / 22 for n in COUNTS]
        right[LAST[own]] *= 2
        right[LAST[1 - own]] = 0.0
        assert seen == pytest.approx(right), own


def test_first_and_last_is_a_candidate_only_where_every_rank_ran_more_than_two_micro_batches():
    assert "first and last micro-batch" in hypotheses(COUNTS, PER_RANK, 1.0)
    for per_rank in ([2, 4], [4, 2], [1, 5]):  # a rank of two: its first and last are all it has (the global mean)
        assert "first and last micro-batch" not in hypotheses(COUNTS, per_rank, 1.0), per_rank


def test_micro_batches_that_count_nothing_weigh_nothing_and_never_divide_by_zero():
    h = hypotheses([1.0, 0.0, 3.0, 2.0, 2.0, 2.0], PER_RANK, 1.0)
    live = [1, 0, 1, 1, 1, 1]  # a micro-batch of one sample is live, one of none is not
    assert h["sum of micro-batches"] == pytest.approx([x / 2 for x in live])
    assert h["mean of micro-batch means"] == pytest.approx([x / 5 for x in live])
    h = hypotheses([0.0, 0.0, 3.0, 1.0], [2, 2], 1.0)  # rank 0's micro-batches count nothing
    assert h["each rank's own mean"] == pytest.approx([0, 0, 3 / 8, 1 / 8])
    assert h["global mean"] == pytest.approx([0, 0, 3 / 4, 1 / 4])
    h = hypotheses([0.0, 0.0], [1, 1], 1.0, own=0, declared_ga=4, loss_scale=2.0)  # nothing counted anywhere
    assert all(w == 0.0 for ws in h.values() for w in ws) and len(h) == 8


def test_the_partition_hypothesis_is_only_seen_from_a_partition_of_several_ranks():
    assert OWN not in hypotheses(COUNTS, PER_RANK, 1.0)  # no partition: not a candidate
    assert OWN not in hypotheses([2.0, 3.0, 5.0], [3], 1.0, own=0)  # one rank: it would be the global mean
    assert OWN in hypotheses(COUNTS, PER_RANK, 1.0, own=1)


def test_a_step_after_fewer_micro_batches_than_declared_is_a_candidate_only_then():
    h = hypotheses([3.0, 5.0], [1, 1], 1.0, declared_ga=4)
    assert h["global mean / GA"] == pytest.approx([3 / 32, 5 / 32])
    assert "global mean / GA" not in hypotheses(COUNTS, PER_RANK, 1.0, declared_ga=3)  # the whole window came
    assert "global mean / GA" not in hypotheses(COUNTS, PER_RANK, 1.0, declared_ga=2)  # more than declared came
    assert "global mean / GA" not in hypotheses([3.0, 5.0], [1, 1], 1.0)  # nothing declared
    assert hypotheses([], [], 1.0, declared_ga=1)["global mean / GA"] == []  # no micro-batch is short of any GA


def test_a_loss_scale_that_changed_before_the_read_is_a_candidate_only_where_it_changed():
    """DeepSpeed's fp16 ZeRO steps grow the scale before they unscale (issue 47): a step the scale doubled in is the
    mean times old / new; no change, no candidate."""
    from gradkit.watch.judge import SCALE_GREW

    half = hypotheses(COUNTS, PER_RANK, 1.0, scale_change=0.5)[SCALE_GREW]
    assert half == pytest.approx([0.5 * w for w in hypotheses(COUNTS, PER_RANK, 1.0)["global mean"]])
    assert SCALE_GREW not in hypotheses(COUNTS, PER_RANK, 1.0)


def test_a_loss_scale_not_divided_out_is_a_candidate_only_where_there_is_a_scale():
    assert hypotheses(COUNTS, PER_RANK, 0.5, loss_scale=2.0)["global mean / loss scale"] == \
        pytest.approx([0.5 * n / (22 * 2) for n in COUNTS])
    assert hypotheses(COUNTS, PER_RANK, 1.0, loss_scale=8.0)["global mean / loss scale"] == \
        pytest.approx([n / (22 * 8) for n in COUNTS])
    assert "global mean / loss scale" not in hypotheses(COUNTS, PER_RANK, 1.0, loss_scale=1.0)
    assert "global mean / loss scale" not in hypotheses(COUNTS, PER_RANK, 1.0)


def test_the_previous_steps_gradient_is_a_candidate_only_where_it_was_judged():
    h = hypotheses([1.0, 3.0], [2], 0.5, previous=[0.25, 0.75])
    assert h[STALE] == pytest.approx([0.5 / 4, 0.5 * 3 / 4, 0.5 / 4, 0.5 * 3 / 4])  # this step's mean, then the last
    assert STALE not in hypotheses([1.0, 3.0], [2], 0.5, previous=[])
    assert STALE not in hypotheses([1.0, 3.0], [2], 0.5)


# ---------------------------------------------------------------- the tally's sums over the ranks

def test_a_partitioned_tally_sums_every_ranks_pieces_and_each_rank_keeps_its_own_sketch(monkeypatch):
    """Pieces summed a few coordinates at a time (``_CHUNK`` 7 here: pieces of 25, 5, 20 and 10), on two ranks that
    each hold a range cutting body.weight in two: after ``finish`` every rank holds the whole step's sums."""
    monkeypatch.setattr(wj, "_CHUNK", 7)
    grads = grads_of()
    ref, step, c = reference(grads), combo(grads, [0.5] * 6), 0.5
    sketch = Sketch(NUMELS, 256)
    tallies = []
    for lo, hi in HALVES:
        tally = Tally(ref, c, sketch)
        for t, start, n in pieces(lo, hi):
            tally.add(t, start, step[t].reshape(-1)[start:start + n])
        tallies.append(tally)
    own = _world(monkeypatch, 2).run(lambda q: tallies[q].finish(False))
    v, r = flat(step).float().double(), flat(ref).float().double()
    mine = [restricted(sketch, step, [pieces(*h) for h in HALVES])[q] for q in range(2)]
    for tally, sketches in zip(tallies, own):
        assert tally.ee == pytest.approx(float(v @ v), rel=1e-6)
        assert tally.er == pytest.approx(float(v @ r), rel=1e-6)
        assert tally.rr == pytest.approx(float(r @ r), rel=1e-6)
        assert tally.dd == pytest.approx(float((v - c * r) @ (v - c * r)), rel=1e-6)
        assert tally.maxdiff == pytest.approx(float((v - c * r).abs().max()), rel=1e-6)
        assert sum(tally.per.tolist(), []) == pytest.approx(
            [float((x.double() ** 2).sum()) for s, r_t in zip(step, ref) for x in (s, r_t)], rel=1e-6)
        assert torch.allclose(tally.se, sketch.of(step), atol=1e-9)
        assert torch.allclose(tally.sr, sketch.of(ref), atol=1e-9)
        assert [torch.allclose(a, b, atol=1e-9) for a, b in zip(sketches, mine)] == [True, True]


def test_a_replicated_tally_keeps_each_ranks_own_sums(monkeypatch):
    grads = grads_of()
    ref = reference(grads)
    steps = [ref, combo(grads, [0.5] * 6)]  # rank 1 steps another gradient than rank 0
    sketch = Sketch(NUMELS, 256)
    tallies = []
    for s in steps:
        tally = Tally(ref, 1.0, sketch)
        for t in range(len(SHAPES)):
            tally.add(t, 0, s[t].reshape(-1))
        tallies.append(tally)
    own = _world(monkeypatch, 2).run(lambda q: tallies[q].finish(True))
    for q, (tally, s) in enumerate(zip(tallies, steps)):
        assert tally.ee == pytest.approx(float(flat(s) @ flat(s)), rel=1e-6), q  # not summed over the ranks
        assert torch.allclose(tally.se, sketch.of(s), atol=1e-9)
        assert [torch.allclose(a, sketch.of(x), atol=1e-9) for a, x in zip(own[q], steps)] == [True, True]


def test_dot64_is_the_fp64_dot_product_over_every_chunk_of_any_layout(monkeypatch):
    """``_DOT_CHUNK`` 7 over 30 values: four whole chunks and a part of one; ``a`` a transposed (non-contiguous) 2-D
    tensor, ``b`` another shape of as many values, each read in its flat (row-major) order."""
    monkeypatch.setattr(wref, "_DOT_CHUNK", 7)
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(6, 5, generator=g).t(), torch.randn(3, 10, generator=g)
    assert not a.is_contiguous()
    fa, fb = a.reshape(-1).double(), b.reshape(-1).double()
    assert dot64(a) == pytest.approx(float(fa @ fa), rel=1e-12)  # a with itself
    assert dot64(a, b) == pytest.approx(float(fa @ fb), rel=1e-12)  # a with b, chunk by chunk alike
    assert dot64(b, a) == pytest.approx(dot64(a, b), rel=1e-12) and dot64(a, a) == pytest.approx(dot64(a), rel=1e-12)
    assert dot64(a, -a) == pytest.approx(-dot64(a), rel=1e-12)
    assert dot64(torch.zeros(0)) == 0.0 and dot64(torch.zeros(0), torch.zeros(0)) == 0.0


def test_a_tally_sums_a_piece_over_every_chunk_as_over_one(monkeypatch):
    """``_CHUNK`` 7 over a piece of 30 values at an offset (four whole chunks and a part of one): every sum, the
    largest difference and both sketches as one chunk gives them."""
    g = torch.Generator().manual_seed(4)
    ref = [torch.randn(3, 4, generator=g), torch.randn(40, generator=g)]
    values = ref[1][5:35] * 0.9 + 0.01 * torch.randn(30, generator=g)
    got = []
    for chunk in (7, 1 << 20):
        monkeypatch.setattr(wj, "_CHUNK", chunk)
        t = Tally(ref, 0.8, Sketch([12, 40], 64))
        t.add(1, 5, values.clone())
        got.append((t.ee, t.er, t.dd, t.rr, t.maxdiff, t.per[1].tolist(), t.se, t.sr))
    (ee, er, dd, rr, mx, per, se, sr), whole = got
    assert (ee, er, dd, rr, mx) == pytest.approx(whole[:5], rel=1e-12) and per == pytest.approx(whole[5], rel=1e-12)
    assert torch.allclose(se, whole[6]) and torch.allclose(sr, whole[7])
    r = ref[1][5:35].double()
    assert rr == pytest.approx(float(r @ r), rel=1e-12) and mx == pytest.approx(float((values.double() - 0.8 * r).abs().max()))


def test_dot64_sums_exact_products_where_fp32_would_round():
    """4097**2 = 16785409 needs 25 bits: fp32 rounds each product, fp64 holds it and the sum exactly."""
    a = torch.full((2, 3), 4097.0)
    assert dot64(a) == 6 * 4097 ** 2 and dot64(a, torch.ones(6)) == 6 * 4097
    assert float(torch.dot(a.reshape(-1), a.reshape(-1))) != 6 * 4097 ** 2


# ---------------------------------------------------------------- a partitioned read, judged

def test_a_correct_partitioned_step_is_not_affected_and_every_partition_is_the_global_mean(monkeypatch):
    grads = grads_of()
    rec = _same_on_every_rank(judged(monkeypatch, reference(grads), grads))
    m = rec["measured"]["metrics"]
    assert rec["verdict"] == oracle.NOT_AFFECTED, rec["why"]
    assert rec["matches"] == "global mean" and rec["partitions"] == ["global mean", "global mean"]
    assert abs(m["norm_ratio"] - 1) < 1e-6 and m["cosine"] > 1 - 1e-9 and m["rel_l2"] < 1e-6
    assert m["max_rel_err"] < 1e-6
    assert len(rec["measured"]["rank_buffers"]) == 2 and "rank_spread" not in rec["measured"]
    for buf in rec["measured"]["rank_buffers"]:
        assert buf["attribution"]["weights"] == pytest.approx([n / N for n in COUNTS], abs=1e-6)
    assert "per partition" not in rec["shape"] and "groups" not in rec["measured"]
    ctl = rec["control"]["metrics"]
    assert ctl["norm_ratio"] == pytest.approx(1.0) and ctl["rel_l2"] < 1e-6 and ctl["max_rel_err"] == 0.0


def test_bf16_optimizers_leak_is_named_in_each_partition_from_its_own_ranks_view(monkeypatch):
    """B4: rank q's partition holds its own rank's boundary micro-batch whole and misses the other's. No one set of
    weights over the whole basis is that step, so the step is named by its partitions, which agree."""
    grads = grads_of()
    step = stitched([boundary_leak(grads, 0), boundary_leak(grads, 1)])
    rec = _same_on_every_rank(judged(monkeypatch, step, grads))
    assert rec["verdict"] == oracle.AFFECTED and rec["explained"]["best_matches"] is False
    assert rec["partitions"] == [OWN, OWN] and rec["matches"] == OWN
    assert rec["shape"].endswith(f"; per partition: rank 0's {OWN!r}, rank 1's {OWN!r}")
    for q, buf in enumerate(rec["measured"]["rank_buffers"]):  # each partition's fit: its own view of the leak
        right = [n / N for n in COUNTS]
        right[LAST[q]], right[LAST[1 - q]] = 2 * right[LAST[q]], 0.0
        assert buf["attribution"]["weights"] == pytest.approx(right, abs=1e-6), q
        assert buf["attribution"]["misplaced_weight"] > FP32.misplaced_weight


def test_a_leak_in_one_partition_only_is_named_there_and_not_for_the_step(monkeypatch):
    grads = grads_of()
    step = stitched([boundary_leak(grads, 0), reference(grads)])
    rec = _same_on_every_rank(judged(monkeypatch, step, grads))
    assert rec["verdict"] == oracle.AFFECTED and rec["matches"] == "none"
    assert rec["partitions"] == [OWN, "global mean"]
    assert "per partition" not in rec["shape"]  # the step's name is the whole fit's own: the partitions named none
    off = rec["measured"]["rank_buffers"]
    assert off[0]["attribution"]["misplaced_weight"] > FP32.misplaced_weight > off[1]["attribution"]["misplaced_weight"]


DEFECTS = {  # a step's weights over each micro-batch's mean-loss gradient (rank-major), by the defect's definition
    "sum of micro-batches": lambda: [1 / W] * 6,  # each micro-batch's mean summed, the ranks averaged
    "last micro-batch / N": lambda: [n / N if k in LAST else 0.0 for k, n in enumerate(COUNTS)],  # B3
    "mean of micro-batch means": lambda: [1 / 6] * 6,
    "each rank's own mean": lambda: [n / (W * (10 if k < 3 else 12)) for k, n in enumerate(COUNTS)],  # rank totals
    "first and last micro-batch": lambda: [n / N if k not in (1, 4) else 0.0 for k, n in enumerate(COUNTS)],  # B5
}


@pytest.mark.parametrize("name", list(DEFECTS))
def test_a_step_wrong_the_same_way_everywhere_is_named_for_the_step_and_in_every_partition(monkeypatch, name):
    grads = grads_of()
    weights = DEFECTS[name]()
    rec = _same_on_every_rank(judged(monkeypatch, combo(grads, weights), grads))
    assert rec["verdict"] == oracle.AFFECTED and rec["matches"] == name and rec["partitions"] == [name, name]
    assert rec["measured"]["attribution"]["weights"] == pytest.approx(weights, abs=1e-6)
    assert "per partition" not in rec["shape"]
    assert rec["control"]["metrics"]["rel_l2"] < 1e-6  # the read itself is right: the engine is to blame


def test_the_whole_steps_shape_is_per_micro_batch_position(monkeypatch):
    grads = grads_of()
    rec = judged(monkeypatch, combo(grads, DEFECTS["last micro-batch / N"]()), grads)[0]
    assert rec["shape"] == "micro-batch 3 x1, the others x0"  # of 3 per rank: the boundary one alone, whole


def test_a_loss_scale_not_divided_out_is_named_where_the_engine_had_one(monkeypatch):
    grads = grads_of()
    step = [x / 8 for x in reference(grads)]
    rec = judged(monkeypatch, step, grads, loss_scale=8.0)[0]
    assert rec["verdict"] == oracle.AFFECTED and rec["matches"] == "global mean / loss scale"
    assert rec["measured"]["metrics"]["norm_ratio"] == pytest.approx(1 / 8)
    rec = judged(monkeypatch, step, grads)[0]  # no loss scale said: not a candidate
    assert "global mean / loss scale" not in rec["explained"]["candidates"] and rec["matches"] == "none"


def test_a_step_unscaled_by_a_loss_scale_that_grew_is_named_on_a_replicated_read_and_on_each_partition(monkeypatch):
    from gradkit.watch.judge import SCALE_GREW

    grads = grads_of()
    step = [x / 2 for x in reference(grads)]
    for replicated in (True, False):  # one read of the whole step, or each rank's partition named on its own
        rec = judged(monkeypatch, step, grads, replicated=replicated, scale_change=0.5)[0]
        assert rec["verdict"] == oracle.AFFECTED and rec["matches"] == SCALE_GREW, rec["shape"]
        assert rec["partitions"] == ([] if replicated else [SCALE_GREW] * 2)
    rec = judged(monkeypatch, step, grads, replicated=True)[0]  # the scale did not change: not a candidate
    assert SCALE_GREW not in rec["explained"]["candidates"] and rec["matches"] == "none"


def test_a_step_after_one_of_four_declared_micro_batches_is_the_mean_over_ga(monkeypatch):
    counts = [3.0, 5.0]
    grads = grads_of(k=2)
    step = [x / 4 for x in reference(grads, counts)]
    rec = judged(monkeypatch, step, grads, counts=counts, per_rank=[1, 1], declared_ga=4)[0]
    assert rec["verdict"] == oracle.AFFECTED and rec["matches"] == "global mean / GA"
    rec = judged(monkeypatch, step, grads, counts=counts, per_rank=[1, 1])[0]
    assert "global mean / GA" not in rec["explained"]["candidates"]


def test_the_previous_steps_gradient_applied_again_is_named(monkeypatch):
    grads, old = grads_of(), grads_of(seed=1)
    sketch = Sketch(NUMELS, 256)  # the same draw as ``judged``'s: the previous step's rows sketched alike
    prev_rows = torch.stack([sketch.of(g) / n for g, n in zip(old, COUNTS)])
    step = [a + b for a, b in zip(reference(grads), reference(old))]
    rec = _same_on_every_rank(judged(monkeypatch, step, grads, prev=(prev_rows, [n / N for n in COUNTS])))
    assert rec["verdict"] == oracle.AFFECTED and rec["matches"] == STALE
    assert rec["measured"]["attribution"]["weights"] == pytest.approx([n / N for n in COUNTS] * 2, abs=1e-6)
    assert "per partition" not in rec["shape"]  # the partitions cannot see the previous step: the whole names it


# ---------------------------------------------------------------- a replicated read: the ranks must agree

def test_replicated_ranks_that_agree_are_judged_on_their_spread_too(monkeypatch):
    grads = grads_of()
    rec = _same_on_every_rank(judged(monkeypatch, reference(grads), grads, replicated=True))
    assert rec["verdict"] == oracle.NOT_AFFECTED and rec["measured"]["rank_spread"] == {"consumed gradients": 0.0}
    assert rec["partitions"] == [] and "rank_buffers" not in rec["measured"]


def test_replicated_ranks_that_step_different_gradients_are_affected_where_rank_0s_is_right(monkeypatch):
    grads = grads_of()
    mine = combo(grads[3:], [n / 12 for n in COUNTS[3:]], COUNTS[3:])  # rank 1 steps its own micro-batches' mean
    rec = judged(monkeypatch, None, grads, replicated=True, steps=[reference(grads), mine])[0]
    assert rec["measured"]["metrics"]["rel_l2"] < 1e-6  # rank 0's own step is the reference
    assert rec["verdict"] == oracle.AFFECTED and "spread of the ranks' consumed gradients" in rec["why"]


def test_one_rank_has_no_spread_to_judge(monkeypatch):
    counts, grads = COUNTS[:3], grads_of(k=3)
    rec = judged(monkeypatch, reference(grads, counts), grads, counts=counts, per_rank=[3], replicated=True)[0]
    assert rec["verdict"] == oracle.NOT_AFFECTED and "rank_spread" not in rec["measured"]


# ---------------------------------------------------------------- parts a step got wrong on their own

def test_a_part_no_micro_batch_reached_stepped_with_an_old_gradient_is_named_with_its_share(monkeypatch):
    """B6 (ZeRO-3's head): head.weight has no gradient of its own this step, yet is stepped (rank 1's partition)."""
    grads = grads_of(unreached=(2,))
    old = 0.05 * torch.randn(SHAPES[2], generator=torch.Generator().manual_seed(7))
    step = reference(grads)[:2] + [old]
    rec = _same_on_every_rank(judged(monkeypatch, step, grads, coef=0.5))  # the clip: reference and share alike
    assert float((old ** 2).sum()) < 1.0  # a small old gradient is seen as well as a large one
    rn = 0.5 * float(flat(reference(grads)).norm())
    assert rec["verdict"] == oracle.AFFECTED and rec["matches"] == PART_STALE
    assert rec["measured"]["groups"] == {
        "head.weight (no gradient of its own, stepped)": {"rel_err": pytest.approx(float(old.norm()) / rn, rel=1e-6)}}
    assert f"; {PART_STALE}: head.weight" in rec["shape"]


def test_a_reached_part_given_nothing_is_named_with_its_share(monkeypatch):
    grads = grads_of()
    ref = reference(grads)
    step = [0.5 * ref[0], 0.5 * ref[1], torch.zeros(SHAPES[2])]  # clipped at 0.5, head.weight's gradient lost
    rec = judged(monkeypatch, step, grads, coef=0.5)[0]
    assert float((ref[2] ** 2).sum()) < 1.0  # a small reference is seen as well as a large one
    share = float(ref[2].norm()) / float(flat(ref).norm())  # of the whole step, both at the clip
    assert rec["verdict"] == oracle.AFFECTED and rec["matches"] == PART_LOST
    assert rec["measured"]["groups"] == {
        "head.weight (reached, given nothing)": {"rel_err": pytest.approx(share, rel=1e-6)}}
    assert rec["shape"].endswith(f"; {PART_LOST}: head.weight; per partition: rank 0's 'global mean', rank 1's 'none'")


def test_a_stale_part_and_a_lost_one_are_both_named_and_unnamed_parameters_by_their_index(monkeypatch):
    grads = grads_of(unreached=(2,))
    ref = reference(grads)
    step = [torch.zeros(SHAPES[0]), ref[1], 0.1 * torch.ones(SHAPES[2])]
    rec = judged(monkeypatch, step, grads, names=None)[0]
    assert rec["matches"] == f"{PART_STALE} and {PART_LOST}"
    assert set(rec["measured"]["groups"]) == {"parameter 2 (no gradient of its own, stepped)",
                                              "parameter 0 (reached, given nothing)"}
    assert f"; {PART_STALE} and {PART_LOST}: parameter 2, parameter 0; per partition: " in rec["shape"]


def test_a_part_no_micro_batch_reached_and_nothing_stepped_is_right(monkeypatch):
    grads = grads_of(unreached=(2,))
    rec = _same_on_every_rank(judged(monkeypatch, reference(grads), grads))
    assert rec["verdict"] == oracle.NOT_AFFECTED and rec["matches"] == "global mean"
    assert "groups" not in rec["measured"]


# ---------------------------------------------------------------- the numbers and the control

def test_a_clipped_steps_numbers_are_against_the_clipped_reference(monkeypatch):
    grads = grads_of()
    ref = reference(grads)
    step = combo(grads, [0.25] * 6)  # the clip said 0.5 x the reference; this is another step
    rec = judged(monkeypatch, step, grads, coef=0.5)[0]
    m = rec["measured"]["metrics"]
    v, r = flat(step), 0.5 * flat(ref)
    assert m["norm_ratio"] == pytest.approx(float(v.norm() / r.norm()), rel=1e-6)
    assert m["cosine"] == pytest.approx(float(v @ r / (v.norm() * r.norm())), rel=1e-6)
    assert m["rel_l2"] == pytest.approx(float((v - r).norm() / r.norm()), rel=1e-6)
    assert m["max_rel_err"] == pytest.approx(float((v - r).abs().max() / r.abs().max()), rel=1e-6)
    assert m["reference_norm"] == pytest.approx(float(r.norm()), rel=1e-6)


def test_a_read_that_misses_a_piece_is_inconclusive_with_the_missing_share_in_both(monkeypatch):
    grads = grads_of()
    ref = reference(grads)
    step = [0.5 * x for x in ref]  # right, at the clip
    rec = _same_on_every_rank(judged(monkeypatch, step, grads, coef=0.5,
                                     read=lambda q, frags: [f for f in frags if f[0] != 1]))  # body.bias unread
    share = float(ref[1].norm()) / float(flat(ref).norm())
    assert rec["verdict"] == oracle.INCONCLUSIVE and "control" in rec["why"]
    assert rec["measured"]["metrics"]["rel_l2"] == pytest.approx(share, rel=1e-6)  # what was not read is off
    ctl = rec["control"]["metrics"]
    through = math.sqrt(1 - share ** 2)
    assert ctl["norm_ratio"] == pytest.approx(through) and ctl["cosine"] == pytest.approx(through)
    assert ctl["rel_l2"] == pytest.approx(share, rel=1e-6) and ctl["max_rel_err"] == 0.0


def test_a_read_that_repeats_a_piece_is_inconclusive_and_its_error_not_lowered(monkeypatch):
    grads = grads_of()
    ref = reference(grads)
    step = combo(grads, [0.5] * 6)
    twice = lambda q, frags: frags + [f for f in frags if f[0] == 1]  # noqa: E731 -- rank 1 reads body.bias twice
    rec = _same_on_every_rank(judged(monkeypatch, step, grads, read=twice))
    assert rec["verdict"] == oracle.INCONCLUSIVE and "control" in rec["why"]
    extra = float((ref[1].double() ** 2).sum()) / float((flat(ref) ** 2).sum())
    through = math.sqrt(1 + extra)
    ctl = rec["control"]["metrics"]
    assert ctl["norm_ratio"] == pytest.approx(through) and ctl["cosine"] == pytest.approx(1 / through)
    d = flat(step) - flat(ref)
    dd = float(d @ d) + float(((step[1] - ref[1]).double() ** 2).sum())  # the repeated piece's error counted twice
    assert rec["measured"]["metrics"]["rel_l2"] == pytest.approx(math.sqrt(dd) / float(flat(ref).norm()), rel=1e-6)


def test_a_read_that_misplaces_a_piece_is_inconclusive(monkeypatch):
    grads = grads_of()

    def shifted(q, frags):  # rank 1 puts its piece of body.weight one coordinate on
        return [(t, s + 1, v[:-1]) if (q, t) == (1, 0) else (t, s, v) for t, s, v in frags]

    rec = _same_on_every_rank(judged(monkeypatch, reference(grads), grads, read=shifted))
    assert rec["verdict"] == oracle.INCONCLUSIVE and "control" in rec["why"]


def test_a_read_that_finds_nothing_is_inconclusive_with_nothing_measured(monkeypatch):
    grads = grads_of()
    rec = _same_on_every_rank(judged(monkeypatch, reference(grads), grads, read=lambda q, frags: []))
    m = rec["measured"]["metrics"]
    assert (m["norm_ratio"], m["cosine"], m["max_rel_err"], m["effective_norm"]) == (0.0, 0.0, 0.0, 0.0)
    assert m["rel_l2"] == pytest.approx(1.0)  # the whole reference missed
    assert rec["verdict"] == oracle.INCONCLUSIVE and rec["control"]["metrics"]["norm_ratio"] == 0.0



# ---------------------------------------------------------------- a wrong step clipped by its own norm

def _at_the_clip(clip=2.0, size=256):
    """Named steps over three micro-batch rows of a sketch of ``size`` (orthogonal, unit), an applied step at
    ``clip``'s norm. With 256 coordinates a named step reaches the clip from clip * (1 - 4/16) = 1.5 on."""
    full = torch.zeros(3, size, dtype=torch.float64)
    full[0, 0] = full[1, 1] = full[2, 2] = 1.0
    effective = torch.zeros(size, dtype=torch.float64)
    effective[5] = clip
    cands = {"at the reach": [1.5], "just above": [0.0, 1.6], "just below": [0.0, 0.0, 1.4], "over": [2.5, 0.0, 1.0],
             "nothing": [0.0, 0.0, 0.0], "short": [], "long": [0.0, 3.0, 0.0, 9.0]}
    return cands, full, effective


def test_a_named_step_that_reaches_the_clip_is_predicted_at_the_applied_norm():
    cands, full, effective = _at_the_clip()
    for coef in (1.0, 0.5):  # the reference's own clip coefficient is in every named step: its norm is divided by it
        scale = clipped_by_own_norm({k: [coef * x for x in w] for k, w in cands.items()}, full, effective, 2.0, 2.0,
                                    coef, "fp32")
        assert scale == pytest.approx({"at the reach": 2.0 / 1.5 / coef, "just above": 2.0 / 1.6 / coef,
                                       "just below": 1.0, "over": 2.0 / math.hypot(2.5, 1.0) / coef, "nothing": 1.0,
                                       "short": 1.0, "long": 2.0 / 3.0 / coef}, rel=1e-12), coef
    # the reach on another sketch size: 1 - 4/sqrt(64) = 0.5 of the clip
    cands, full, effective = _at_the_clip(size=64)
    scale = clipped_by_own_norm({"half": [1.0], "under half": [0.0, 0.99]}, full, effective, 2.0, 2.0, 1.0, "fp32")
    assert scale == {"half": 2.0, "under half": 1.0}


def test_nothing_is_rescaled_without_a_clip_or_where_the_applied_step_is_off_the_clip():
    cands, full, effective = _at_the_clip()
    ones = {k: 1.0 for k in cands}
    assert clipped_by_own_norm(cands, full, effective, 2.0, None, 1.0, "fp32") == ones  # no clip
    assert clipped_by_own_norm(cands, full, effective, 2.0, 0.0, 1.0, "fp32") == ones
    assert clipped_by_own_norm(cands, full, effective, 2.0, 2.0, 0.0, "fp32") == ones  # a zero coefficient
    for en in (1.0, 3.0, 2.0 * (1 + 2 * FP32.norm_ratio), 2.0 * (1 - 2 * FP32.norm_ratio)):  # off by > fp32's limit
        assert clipped_by_own_norm(cands, full, effective, en, 2.0, 1.0, "fp32") == ones, en
    for en, dtype in ((2.0 * (1 + FP32.norm_ratio / 2), "fp32"), (2.0 * (1 - FP32.norm_ratio / 2), "fp32"),
                      (2.0 * 1.02, "bf16")):  # within the dtype's limit: at the clip
        scale = clipped_by_own_norm(cands, full, effective, en, 2.0, 1.0, dtype)
        assert scale["just above"] == pytest.approx(2.0 / 1.6) and scale["just below"] == 1.0, (en, dtype)


def _clipped(grads, weights, clip):
    step = combo(grads, weights)
    return [x * clip / float(flat(step).norm()) for x in step]


def test_a_partitioned_step_clipped_by_its_own_norm_is_named_for_the_step_and_in_every_partition(monkeypatch):
    """A summed step (about 5x the reference) clipped at twice the reference's norm (the right step is not
    clipped): its direction at the clip. The sum and the mean of micro-batch means differ only by scale, so both
    match and the tie is said, for the whole step and in each partition (each scaled by the whole step's factor)."""
    grads = grads_of()
    clip = 2 * float(flat(reference(grads)).norm())
    step = _clipped(grads, DEFECTS["sum of micro-batches"](), clip)
    tie = "ambiguous between 'mean of micro-batch means' and 'sum of micro-batches'"
    rec = _same_on_every_rank(judged(monkeypatch, step, grads, clip=clip))
    assert rec["measured"]["metrics"]["effective_norm"] == pytest.approx(clip, rel=1e-6)
    assert rec["verdict"] == oracle.AFFECTED and rec["matches"] == tie and rec["partitions"] == [tie, tie]
    rec = _same_on_every_rank(judged(monkeypatch, step, grads))  # the clip not said: no named step at that scale
    assert rec["matches"] == "none" and rec["partitions"] == ["none", "none"]


def test_a_wrong_step_clipped_by_its_own_norm_where_the_reference_is_clipped_too(monkeypatch):
    """The clip at half the reference's norm: the reference's coefficient 0.5, the per-rank mean (about the
    reference's norm) clipped by its own, 0.5 / 1.005: named, uniquely, for the step and in each partition."""
    grads = grads_of()
    clip = 0.5 * float(flat(reference(grads)).norm())
    name = "each rank's own mean"
    step = _clipped(grads, DEFECTS[name](), clip)
    rec = _same_on_every_rank(judged(monkeypatch, step, grads, coef=0.5, clip=clip))
    assert rec["verdict"] == oracle.AFFECTED and rec["matches"] == name and rec["partitions"] == [name, name]
    rec = _same_on_every_rank(judged(monkeypatch, step, grads, coef=0.5))
    assert rec["matches"] == "none" and rec["partitions"] == ["none", "none"]


def test_an_exact_step_over_micro_batches_fed_twice_is_not_affected_whatever_the_fit_says(monkeypatch):
    """Two ranks fed the same data (the same three micro-batches each, as a loop that seeds its data by a rank it
    reads wrong does): the weights over the basis are not identifiable, the fit may put them anywhere; the step and
    its control match the reference on every exact signal, so neither the step nor the control is called off."""
    grads = grads_of(3)
    grads = grads + [[x.clone() for x in g] for g in grads]  # rank 1's micro-batches are rank 0's
    counts = COUNTS[:3] * 2
    recs = judged(monkeypatch, reference(grads, counts), grads, counts=counts)
    rec = recs[0]  # the weights, free between alike micro-batches, may differ from rank to rank: the verdict may not
    assert [r["verdict"] for r in recs] == [oracle.NOT_AFFECTED] * W, rec["why"]
    m = rec["measured"]["metrics"]
    assert m["rel_l2"] < 1e-6 and abs(m["norm_ratio"] - 1) < 1e-6
    # where the fit went astray it is excused by the oracle (indistinct) or by exact_first: either way not judged


def test_exact_first_never_excuses_a_step_off_on_an_exact_signal():
    ref = {"metrics": {"norm_ratio": 1.0, "cosine": 1.0, "rel_l2": 0.0, "max_rel_err": 0.0}, "dtype": "fp32"}
    astray = {"weights": [1.0, 0.0], "expected_weights": [0.5, 0.5], "misplaced_weight": 0.5, "distinct": math.inf}
    second = {**astray, "misplaced_weight": 0.25}
    word, why = wj.exact_first({**ref, "attribution": astray, "rank_buffers": [{"attribution": second}]}, ref)
    assert word == oracle.NOT_AFFECTED and "not identifiable" in why
    assert why.endswith("(misplaced weight 5.00e-01 where the exact signals agree)"), why  # the first signal off
    off = {**ref, "metrics": {**ref["metrics"], "rel_l2": 1e-2}, "attribution": astray}
    assert wj.exact_first(off, ref)[0] == oracle.AFFECTED
    assert wj.exact_first(ref, {**ref, "metrics": {**ref["metrics"], "norm_ratio": 0.9}})[0] == oracle.INCONCLUSIVE
