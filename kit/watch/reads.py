"""Where the watch reads the gradient an optimizer step consumes: in the innermost ``torch.optim.Optimizer`` (the
one that turns a gradient into an update), just before it steps, from the ``.grad`` of the tensors it steps. That
is the gradient after everything the engine did to it (accumulation, reduction, loss-scale division, clipping), and
before the optimizer's own arithmetic; buffers that carry state between steps are seen because their effect is in
it.

What those tensors are depends on the engine, and each is mapped back to the model's parameters (module order):
- a plain loop, DDP, Accelerate, the Trainer without DeepSpeed: the model's own parameters; every rank holds the
  whole gradient (``replicated``);
- FSDP2: each rank's chunk of the model's own parameters (``DTensor``, rows of the first dimension: ``shard_rows``),
  ``partitioned``; another placement is gathered whole with ``full_tensor()``;
- DeepSpeed ZeRO-1/2 and its ``BF16_Optimizer``: each rank's fp32 partition of a flat group, mapped by the
  fragment links DeepSpeed keeps on each parameter (``_hp_mapping``: where a parameter's piece sits in the partition
  and in the parameter); each rank holds its own pieces (``partitioned``);
- DeepSpeed ZeRO-3: each rank's fp32 partition of a sub-group, its parameters' partitions one after another;
- DeepSpeed's ``FP16_Optimizer`` (one fp32 flat per group) and ``FP16_UnfusedOptimizer`` (one fp32 master per
  parameter), every rank the whole;
- DeepSpeed ZeRO-0 with fp32: the model's parameters, as a plain loop.

``Layout.fragments(current)`` gives, for the tensors the optimizer is about to step (``current``), pieces
``(t, start, values)``: coordinates ``start ..`` of parameter ``t``'s flat gradient.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn


# the flat fp32 partitions, one per parameter group, of DeepSpeed's ZeRO-1/2 optimizer and of its BF16_Optimizer
HP_FLATS = ("single_partition_of_fp32_groups", "fp32_groups_flat_partition")


@dataclass
class Piece:
    t: int  # the parameter's index in module order
    start: int  # where the piece starts in the parameter's flat
    hp_start: int  # where it starts in the consumed tensor's flat
    numel: int


def chain(optimizer) -> list:
    """The optimizer and the ones it wraps (``.optimizer``: Accelerate's, DeepSpeed's, the Trainer's), down to the
    ``torch.optim.Optimizer`` that steps: ``[outermost, ..., innermost]``."""
    out = [optimizer]
    while True:  # Accelerate's wrapper is a torch Optimizer subclass that wraps one: go down while there is one
        inner = getattr(out[-1], "optimizer", None)
        if inner is None or any(inner is o for o in out):
            break
        out.append(inner)
    if not isinstance(out[-1], torch.optim.Optimizer):
        raise TypeError(f"gradkit watch: found no torch.optim.Optimizer inside {type(optimizer).__name__}")
    return out


def innermost(optimizer):
    """The ``torch.optim.Optimizer`` at the bottom of the wrappers."""
    return chain(optimizer)[-1]


def chunk_of(shape: torch.Size, w: int, r: int) -> tuple[int, int] | None:
    """Where rank ``r``'s chunk of a parameter of ``shape`` sits in its flat under FSDP2 (``torch.chunk``'s rows of
    its first dimension, the last ranks' chunks short or empty): ``(start, numel)``; None for a scalar."""
    if len(shape) == 0:
        return None
    rows = shape[0]
    row = shape.numel() // rows if rows else 0
    each = -(-rows // w)
    lo, hi = min(r * each, rows), min(r * each + each, rows)
    return lo * row, (hi - lo) * row


def shard_rows(p) -> tuple[int, int] | None:
    """Where this rank's chunk of a DTensor sharded on its first dimension over a one-dimensional mesh (FSDP2's
    layout, ``chunk_of``) sits in the parameter's flat: ``(start, numel)``; None for any other placement (a plain
    tensor, a replicated or two-dimensional one)."""
    placements = getattr(p, "placements", None)
    if placements is None or len(placements) != 1 or not placements[0].is_shard(0) or p.dim() == 0:
        return None
    start, n = chunk_of(p.shape, p.device_mesh.size(), p.device_mesh.get_local_rank())
    return (start, n) if p.to_local().numel() == n else None


class Layout:
    """Which consumed tensor holds which piece of which parameter's gradient."""

    def __init__(self, model: nn.Module, wrapper, basic: torch.optim.Optimizer):
        self.params = list(model.parameters())
        self.kind, self.replicated, self.by_tensor = self._map(wrapper, basic)

    def _map(self, wrapper, basic):
        index = {id(p): t for t, p in enumerate(self.params)}
        stepped = [q for g in basic.param_groups for q in g["params"]]
        if any(id(q) in index for q in stepped):  # the optimizer steps the model's own parameters
            own = [q for q in stepped if id(q) in index]
            rows = [shard_rows(q) for q in own]
            if any(hasattr(q, "full_tensor") for q in own) and all(r is not None for r in rows):  # FSDP2's chunks
                return "sharded parameters", False, {id(q): [Piece(index[id(q)], start, 0, numel)] for q, (start, numel)
                                                     in zip(own, rows) if numel}
            return "parameters", True, {id(q): [Piece(index[id(q)], 0, 0, q.numel())] for q in own}
        if hasattr(wrapper, "fp32_partitioned_groups_flat") and hasattr(wrapper, "fp16_partitioned_groups"):  # ZeRO-3
            return "fp32 partitions", False, self._zero3_pieces(wrapper, index)
        if hasattr(wrapper, "round_robin_bit16_groups") and hasattr(wrapper, "single_partition_of_fp32_groups"):
            return "fp32 partitions", False, self._flat_pieces(wrapper, index)  # ZeRO-1/2: its flat layout itself
        if any(getattr(p, "_hp_mapping", None) is not None for p in self.params):  # BF16_Optimizer
            # they step one parameter group at a time, the torch optimizer's groups cut down to that one while it
            # steps: every group's flat partition is the wrapper's
            every = [*stepped, *(q for name in HP_FLATS for q in getattr(wrapper, name, None) or () if q is not None)]
            return "fp32 partitions", False, self._hp_pieces(every)
        if hasattr(wrapper, "fp32_groups_flat") and hasattr(wrapper, "fp16_groups"):  # FP16_Optimizer
            out = {}
            for flat, group in zip(wrapper.fp32_groups_flat, wrapper.fp16_groups):
                k, pieces = 0, []
                for p in group:
                    pieces.append(Piece(index[id(p)], 0, k, p.numel()))
                    k += p.numel()
                out[id(flat)] = pieces
            return "fp32 flat groups", True, out
        if hasattr(wrapper, "fp32_groups") and hasattr(wrapper, "fp16_groups"):  # FP16_UnfusedOptimizer
            return "fp32 masters", True, {id(m): [Piece(index[id(p)], 0, 0, p.numel())]
                                          for ms, ps in zip(wrapper.fp32_groups, wrapper.fp16_groups)
                                          for m, p in zip(ms, ps)}
        raise TypeError(f"gradkit watch: cannot map what {type(wrapper).__name__} steps back to the model's "
                        "parameters")

    @staticmethod
    def _zero3_pieces(wrapper, index) -> dict:
        """ZeRO-3: each sub-group's fp32 flat partition is its parameters' partitions one after another (each the
        parameter's ``ds_tensor``, ``ds_numel`` long, padded); this rank's partition of a parameter holds the
        parameter's coordinates from rank x partition size on."""
        rank = dist.get_rank(group=wrapper.dp_process_group) if hasattr(wrapper, "dp_process_group") else \
            dist.get_rank()
        out = {}
        for flat, params, parts in zip(wrapper.fp32_partitioned_groups_flat, wrapper.fp16_groups,
                                       wrapper.fp16_partitioned_groups):
            k, pieces = 0, []
            for p, part in zip(params, parts):
                size = int(part.ds_numel)
                start = rank * size
                numel = max(0, min(size, int(p.ds_numel) - start))
                if numel and id(p) in index:
                    pieces.append(Piece(index[id(p)], start, k, numel))
                k += size
            out[id(flat)] = pieces
        return out

    @staticmethod
    def _flat_pieces(wrapper, index: dict) -> dict:
        """ZeRO-1/2's flat groups as the optimizer lays them out: each group's parameters in their round-robin order
        (``round_robin_bit16_groups``, at their offsets where a release pads them), the flat split evenly over the
        data-parallel ranks, this rank's piece its fp32 partition. Not the fragment links: with
        ``round_robin_gradients`` and no padding DeepSpeed links each parameter at its offset in the group's own
        order, which is not the flat's (0.19.8: ``_link_all_hp_params``), so those links, and the debug API
        ``safe_get_full_fp32_param`` that reads them, name the wrong parameter's piece."""
        out: dict = {}
        offsets = getattr(wrapper, "round_robin_bit16_offsets", None)
        for i, (params, hp) in enumerate(zip(wrapper.round_robin_bit16_groups, wrapper.single_partition_of_fp32_groups)):
            group = wrapper.real_dp_process_group[i]
            size = wrapper.bit16_groups_flat[i].numel() // dist.get_world_size(group=group)
            lo_part = dist.get_rank(group=group) * size
            # where a release keeps no offsets, the parameters sit one after another
            starts = offsets[i] if offsets else itertools.accumulate((p.numel() for p in params[:-1]), initial=0)
            for p, start in zip(params, starts):
                lo, hi = max(int(start), lo_part), min(int(start) + p.numel(), lo_part + size)
                if lo < hi and id(p) in index:
                    out.setdefault(id(hp), []).append(Piece(index[id(p)], lo - int(start), lo - lo_part, hi - lo))
        return out

    def _hp_pieces(self, stepped) -> dict:
        """DeepSpeed's fragment links: for each parameter with a piece on this rank, the flat fp32 partition that
        holds it (found by address) and the piece's place in both."""
        out: dict = {}
        spans = [(q.data_ptr(), q.data_ptr() + q.numel() * q.element_size(), q) for q in stepped]
        for t, p in enumerate(self.params):
            m = getattr(p, "_hp_mapping", None)
            if m is None:
                continue
            frag = m.hp_fragment
            owner = next((q for lo, hi, q in spans if lo <= frag.data_ptr() < hi), None)
            if owner is None:
                raise TypeError("gradkit watch: a parameter's fp32 fragment is in no tensor the optimizer steps")
            hp, lp = m.get_hp_fragment_address(), m.lp_fragment_address
            out.setdefault(id(owner), []).append(Piece(t, int(lp.start), int(hp.start), int(hp.numel)))
        return out

    def covered(self) -> set[int]:
        """The parameters some consumed tensor holds a piece of (on some rank: a collective is not needed, every
        rank maps every parameter it steps; a parameter no optimizer steps is nowhere)."""
        return {piece.t for pieces in self.by_tensor.values() for piece in pieces}

    def fragments(self, current) -> list[tuple[int, int, torch.Tensor]]:
        """``(t, start, values)`` of the tensors in ``current`` (what the optimizer steps now) that have a gradient."""
        out = []
        for q in current:
            pieces = self.by_tensor.get(id(q))
            if not pieces or q.grad is None:
                continue
            g = q.grad
            if hasattr(g, "full_tensor"):  # this rank's chunk where the layout maps chunks, else gathered whole
                g = g.to_local() if not self.replicated else g.full_tensor()
            flat = g.detach().reshape(-1)
            out.extend((pc.t, pc.start, flat.narrow(0, pc.hp_start, pc.numel)) for pc in pieces)
        return out
