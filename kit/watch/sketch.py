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
_CHUNK = 1 << 18  # coordinates signed at a time: the working memory stays a few MB whatever the tensor
PERIOD = 262139  # the sign pattern's length, a prime (coprime to every size)
SIGNS = (PERIOD + _CHUNK) * 4  # the bytes of the sign pattern a sketch holds
_BLOCK = 32  # rows of a chunk summed in fp32 before their sums are summed in fp64 (_rows_summed)


def _rows_summed(rows: torch.Tensor, block: int = _BLOCK) -> torch.Tensor:
    """The sum of ``rows`` (n x size) down its rows, in fp64: fp32 rows are summed ``block`` at a time in fp32 (an
    error of about fp32's epsilon of the sum, 9e-8 measured on 4.5M normal values) and those sums in fp64, 15x
    faster on a CPU than converting every value to fp64."""
    if rows.dtype == torch.float64:
        return rows.sum(0)
    whole = rows.shape[0] - rows.shape[0] % block
    out = rows[:whole].view(-1, block, rows.shape[1]).sum(1).sum(0, dtype=torch.float64)
    if whole < rows.shape[0]:
        out += rows[whole:].sum(0, dtype=torch.float64)
    return out


class Sketch:
    """CountSketch of vectors laid out as the tensors of a module's parameters (module order). Coordinate i of tensor
    t goes into bucket ``(i + s_t) mod size`` with the sign ``pattern[(i + o_t) mod PERIOD]``, a fixed random pattern
    of +1 / -1 (s_t, o_t and the pattern drawn from the seed): coordinates that share a bucket (i, i + size, ...)
    take their signs from different places of the pattern, and PERIOD is a prime, so a bucket and a sign repeat
    together only after ``size x PERIOD`` coordinates of one tensor (1.07e9 at the default size; in a larger tensor
    such pairs only add to the sketch's noise): inner products are kept in expectation as with hashed signs. A
    chunk's signs are one slice of the pattern (held once, 2 MB), so a chunk is signed and summed down its whole rows
    of ``size`` (a ragged head and tail added on their own) with no hashing, no scatter and no padded copy, and no
    per-coordinate state is kept. ``size`` is a power of two."""

    def __init__(self, numels: list[int], size: int = SIZE, seed: int = SEED, device=None):
        self.numels, self.size, self.seed = list(numels), int(size), int(seed)
        if self.size & (self.size - 1) or self.size < 2:
            raise ValueError(f"gradkit watch: the sketch's size must be a power of two (got {size})")
        self.device = torch.device(device or "cpu")
        g = torch.Generator(device="cpu").manual_seed(self.seed)
        self._shift = torch.randint(0, self.size, (len(self.numels),), generator=g).tolist()
        self._offset = torch.randint(0, PERIOD, (len(self.numels),), generator=g).tolist()
        pattern = 1.0 - 2.0 * torch.randint(0, 2, (PERIOD,), generator=g, dtype=torch.float32)
        self._pattern = torch.cat([pattern, pattern[:_CHUNK]]).to(self.device)  # any chunk's signs are one slice

    def held_bytes(self) -> int:
        """What the sign pattern holds."""
        return self._pattern.numel() * self._pattern.element_size()

    def signs(self, t: int, first: int, n: int) -> torch.Tensor:
        """The signs of coordinates ``first .. first + n`` of tensor ``t`` (``n`` at most a chunk): a view."""
        j = (first + self._offset[t]) % PERIOD
        return self._pattern[j:j + n]

    def zeros(self) -> torch.Tensor:
        return torch.zeros(self.size, dtype=torch.float64, device=self.device)

    def add(self, out: torch.Tensor, t: int, values: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Adds the sketch of ``values`` -- coordinates ``start .. start + len`` of tensor ``t`` -- into ``out``."""
        shift = self._shift[t]
        v = values.detach().reshape(-1)
        for lo in range(0, v.numel(), _CHUNK):
            part = v[lo:lo + _CHUNK].to(out.device, torch.float32 if v.dtype != torch.float64 else torch.float64)
            first = start + lo
            signed = part * self.signs(t, first, part.numel())  # one pass
            head = (first + shift) % self.size
            lead = min((-head) % self.size, signed.numel())  # up to the first whole row, then whole rows, then a tail
            body = (signed.numel() - lead) // self.size * self.size
            if lead:
                out[head:head + lead] += signed[:lead]
            if body:
                out += _rows_summed(signed[lead:lead + body].view(-1, self.size))
            if lead + body < signed.numel():
                out[:signed.numel() - lead - body] += signed[lead + body:]
        return out

    def of(self, tensors) -> torch.Tensor:
        """The sketch of a whole vector given as one tensor per parameter (None: zeros there)."""
        out = self.zeros()
        for t, x in enumerate(tensors):
            if x is not None:
                self.add(out, t, x)
        return out
