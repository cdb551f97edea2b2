"""A random projection of a gradient into a few thousand numbers, for the fitted weights of a real model's step.

The fitted weights (which micro-batch, rank and step a consumed gradient came from) are a least-squares fit of the
consumed gradient over every micro-batch's own gradient. On a real model those gradients are each as large as the
model, and a step has W x GA of them: keeping them all is what the watch may not do. A *CountSketch* keeps each in
``size`` numbers: coordinate i of parameter tensor t goes, with a random sign s(t, i), into bucket h(t, i). The map
is linear (the sketch of a sum is the sum of the sketches, of a gradient split over ranks the sum of each rank's
part) and keeps inner products in expectation, so the least-squares fit over sketches is the fit over the gradients
themselves where the consumed gradient is a combination of them (a residual of 0, as every accumulation bug leaves
it), and within ``residual / sqrt(size)`` of it otherwise. Every rank draws the same h and s (seeded by the
tensor's place in module order), so sketches of one vector made on different ranks add up.

The verdict's own numbers (ratio, cosine, rel. error) are never sketched: they are exact dot products.
"""
from __future__ import annotations

import torch

SIZE = 4096  # buckets: the fit's error is ~ residual / sqrt(SIZE) (measured in tests/test_watch.py)
SEED = 0x5EED
_CHUNK = 1 << 21  # coordinates hashed at a time: the hash's own memory stays a few MB whatever the tensor


class Sketch:
    """CountSketch of vectors laid out as the tensors of a module's parameters (module order). Bucket and sign of a
    coordinate come from a multiply-shift hash of its index (``(a * i mod 2**64) >> (64 - bits)``, a odd and drawn
    per tensor from the seed; the sign from the top bit of a second product), computed chunk by chunk as needed:
    nothing the size of the model is kept. ``size`` is a power of two."""

    def __init__(self, numels: list[int], size: int = SIZE, seed: int = SEED, device=None):
        self.numels, self.size, self.seed = list(numels), int(size), int(seed)
        if self.size & (self.size - 1) or self.size < 2:
            raise ValueError(f"gradkit watch: the sketch's size must be a power of two (got {size})")
        self.bits = self.size.bit_length() - 1
        self.device = torch.device(device or "cpu")
        g = torch.Generator(device="cpu").manual_seed(self.seed)
        odd = torch.randint(0, 2 ** 62, (len(self.numels), 2), generator=g) * 2 + 1  # per tensor: a, c (odd)
        self._ac = odd.tolist()

    def zeros(self) -> torch.Tensor:
        return torch.zeros(self.size, dtype=torch.float64, device=self.device)

    def add(self, out: torch.Tensor, t: int, values: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Adds the sketch of ``values`` -- coordinates ``start .. start + len`` of tensor ``t`` -- into ``out``."""
        a, c = self._ac[t]
        a, c = a - 2 ** 63 if a >= 2 ** 63 else a, c - 2 ** 63 if c >= 2 ** 63 else c  # as int64 (the bits are kept)
        v = values.detach().reshape(-1)
        for lo in range(0, v.numel(), _CHUNK):
            part = v[lo:lo + _CHUNK].to(out.device, torch.float64)
            i = torch.arange(start + lo, start + lo + part.numel(), dtype=torch.int64, device=out.device)
            bucket = torch.bitwise_right_shift(i * a, 64 - self.bits) & (self.size - 1)  # int64 products wrap mod 2**64
            negative = (i * c) < 0  # the product's top bit
            out.index_add_(0, bucket, torch.where(negative, -part, part))
        return out

    def of(self, tensors) -> torch.Tensor:
        """The sketch of a whole vector given as one tensor per parameter (None: zeros there)."""
        out = self.zeros()
        for t, x in enumerate(tensors):
            if x is not None:
                self.add(out, t, x)
        return out
