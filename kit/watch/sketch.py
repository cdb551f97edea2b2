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
_CHUNK = 1 << 20  # coordinates hashed at a time: the hash's own memory stays a few MB whatever the tensor
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
    t goes into bucket ``(i + s_t) mod size`` with the sign of ``c_t * i`` as an int64 product (its top bit; c_t odd,
    s_t and c_t drawn per tensor from the seed): the sign is the random part, so inner products are kept in
    expectation as with hashed buckets, and a chunk of coordinates is signed and summed down its whole rows of
    ``size`` (a ragged head and tail added on their own), with no scatter and no padded copy. The signs of a tensor
    are kept once drawn (one byte per coordinate, a quarter of an fp32 gradient: a judged step sketches every tensor
    K + 2 times) until the sketch is dropped with its judged step, up to ``keep`` bytes (the sharded reference keeps
    the rank's share, so that they fall with W as its copy does). ``size`` is a power of two."""

    def __init__(self, numels: list[int], size: int = SIZE, seed: int = SEED, device=None, keep: int | None = None):
        self.numels, self.size, self.seed = list(numels), int(size), int(seed)
        self.keep = keep  # the most bytes of signs kept (None: every tensor's); the others are drawn at each use
        if self.size & (self.size - 1) or self.size < 2:
            raise ValueError(f"gradkit watch: the sketch's size must be a power of two (got {size})")
        self.device = torch.device(device or "cpu")
        g = torch.Generator(device="cpu").manual_seed(self.seed)
        shifts = torch.randint(0, self.size, (len(self.numels),), generator=g).tolist()
        odd = (torch.randint(0, 2 ** 62, (len(self.numels),), generator=g) * 2 + 1).tolist()
        self._sc = [(sh, c - 2 ** 63 if c >= 2 ** 63 else c) for sh, c in zip(shifts, odd)]  # c as an int64
        self._signs: dict[int, torch.Tensor] = {}  # tensor -> its coordinates' signs (int8)

    def held_bytes(self) -> int:
        """What the kept signs hold."""
        return sum(m.numel() * m.element_size() for m in self._signs.values())

    def signs(self, t: int) -> torch.Tensor:
        """Tensor ``t``'s signs, one int8 of +1 / -1 per coordinate (drawn on first use, then kept)."""
        hit = self._signs.get(t)
        if hit is None:
            c = self._sc[t][1]
            hit = torch.empty(self.numels[t], dtype=torch.int8, device=self.device)
            for lo in range(0, self.numels[t], _CHUNK):  # int64 products wrap mod 2**64: the top bit is the sign
                i = torch.arange(lo, min(lo + _CHUNK, self.numels[t]), dtype=torch.int64, device=self.device)
                hit[lo:lo + i.numel()] = 1 - 2 * (i.mul_(c) < 0).to(torch.int8)
            if self.keep is None or self.held_bytes() + hit.numel() <= self.keep:
                self._signs[t] = hit
        return hit

    def zeros(self) -> torch.Tensor:
        return torch.zeros(self.size, dtype=torch.float64, device=self.device)

    def add(self, out: torch.Tensor, t: int, values: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Adds the sketch of ``values`` -- coordinates ``start .. start + len`` of tensor ``t`` -- into ``out``."""
        shift = self._sc[t][0]
        v = values.detach().reshape(-1)
        signs = self.signs(t)
        for lo in range(0, v.numel(), _CHUNK):
            part = v[lo:lo + _CHUNK].to(out.device, torch.float32 if v.dtype != torch.float64 else torch.float64)
            first = start + lo
            signed = part * signs[first:first + part.numel()]  # one pass; int8 times fp32 is fp32
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
