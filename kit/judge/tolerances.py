"""How far an effective gradient may sit from the fp32 reference and still count as correct, per dtype, and why:
``TOLERANCES`` (one ``Tolerance`` per dtype, each limit with the noise it was set against), ``tolerance(dtype)``,
and ``ROUNDING`` (how far a low-precision module weight may sit from its fp32 master). ``gradkit.judge.oracle`` judges
every signal against these."""
from __future__ import annotations

from dataclasses import dataclass


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
# - fp16: 11 significant bits, unit roundoff 2**-11 ~ 5e-4, 4x finer than bf16. Measured on DeepSpeed's own fp16
#   engine on CPU (0.19.8, the CPU accelerator told fp16 is supported: gradkit.probes.ranks.ds_config.allow_fp16_on_cpu;
#   ZeRO-1/2/3, a static loss scale of 256 or a dynamic one, clip 0 and 1, W = 2, the worst of 3 steps): rel. error
#   <= 5.5e-4 / 5.8e-4 / 7.9e-4 / 1.8e-3 and misplaced weight <= 7.8e-5 / 1.1e-4 / 3.9e-4 / 1.0e-3 at GA 4 / 8 / 32 /
#   64, |ratio - 1| <= 1.9e-4 (the engine's arithmetic emulated in plain torch, `scripts/bench.py --noise`, had
#   given 2.5x less misplaced weight at GA 64). 5e-3 is ~2.8x the largest error; 2e-3 misplaced is 2x the largest
#   noise and half the smallest loss a grid measures (one micro-batch of W = 2, GA 64: 3.9e-3).
TOLERANCES = {
    "fp32": Tolerance(rel_l2=1e-4, norm_ratio=1e-4, misplaced_weight=1e-4, rank_spread=1e-6,
                      why="fp32 unit roundoff 6e-8; reduction order changes sums by ~1e-6; 100x headroom"),
    "bf16": Tolerance(rel_l2=3e-2, norm_ratio=3e-2, misplaced_weight=5e-3, rank_spread=1e-6,
                      why="bf16 unit roundoff 2e-3; rounded weights/activations/grads give 0.1-0.6% error "
                          "and <= 2.9e-3 misplaced weight at GA 64; replicas bit-identical"),
    "fp16": Tolerance(rel_l2=5e-3, norm_ratio=5e-3, misplaced_weight=2e-3, rank_spread=1e-6,
                      why="fp16 unit roundoff 5e-4; DeepSpeed's fp16 engine (on CPU) gives <= 1.8e-3 error and "
                          "<= 1.0e-3 misplaced weight at GA 64; replicas bit-identical"),
}


# How far a module's weight may sit from its fp32 master: its own rounding (half an ulp, with room for a
# round-to-nearest-even tie) relative to the master. fp32 modules are the masters' own copies: bit-equal.
ROUNDING = {"fp32": 2.0 ** -23, "bf16": 2.0 ** -8, "fp16": 2.0 ** -10}
# Below its smallest normal number (6.1e-5) fp16 keeps a fixed spacing of 2**-24 (subnormals), so a relative limit
# alone calls a correctly rounded tiny weight off (a master of 2.41e-7 is 2.384e-7 in fp16). bf16 has fp32's range.
SUBNORMAL = {"fp16": 2.0 ** -24}


def tolerance(dtype: str) -> Tolerance:
    if dtype not in TOLERANCES:
        raise ValueError(f"no tolerance for dtype {dtype!r}; known: {sorted(TOLERANCES)}")
    return TOLERANCES[dtype]
