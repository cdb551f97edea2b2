"""The reference sharded over the ranks, for a job whose engine shards the model (ZeRO-3, FSDP2): a judged step's
memory per rank falls with W as the job's own does, instead of a whole fp32 copy of the model on every rank.

It is built from what torch provides, with no sharding of the kit's own:
- **the copy under FSDP2.** The copy (``reference.copy_of``) is made with placeholders on the meta device and put
  under ``fully_shard`` a *unit* at a time (``units``: the largest subtrees that hold at most a 16th of the model,
  or its largest tensor, and share no parameter with the rest); only then are each rank's chunks made, and filled
  with the step's starting weights in fp32: from what this rank already holds where that is its chunk (ZeRO-3's
  partition of a parameter whose rows W divides, or a vector; FSDP2's chunk: no collective), else from the
  parameter gathered whole (``reference.whole``), one at a time. FSDP2 gathers a unit for its forward and backward,
  and reduce-scatters its gradient: summed over the ranks (its divide factor 1), each rank keeps its chunk.
- **each micro-batch's own gradient, sketched as the backward runs.** The fitted weights need every rank's
  micro-batches' gradients apart, before FSDP2 sums them over the ranks: a hook on each gathered parameter
  (``register_post_accumulate_grad_hook``, which runs where autograd has just written that micro-batch's gradient,
  before FSDP2 reduces it) adds it to the micro-batch's sketch, restricted to each rank's optimizer pieces where the
  read is partitioned. The gathered parameters are the ones FSDP2 swaps into the unit for its forward, found by a
  forward pre-hook that runs after FSDP2's own.
- **exact dot products piece by piece.** The pieces this rank's optimizer holds (``reads.Layout``) are taken from
  the reduced reference's chunk where they lie in it (ZeRO-3's and FSDP2's own layouts, as above), else from the
  parameter gathered, one at a time; only they are kept (``Aligned``), and the tally takes its dot products against
  them. The copy is dropped before that.

FSDP2 runs a unit's collectives on every rank, so every rank runs as many micro-batches: a rank that recorded fewer
runs its last one again with its loss times 0 (a gradient of exact zeros, not sketched).

Held at the peak, per rank: the copy's chunk of the weights and of the gradient (2 x the fp32 model / W), one unit
gathered with its gradient, one micro-batch's activations, the sketches; then the reference's pieces this rank's
optimizer holds (the fp32 model / W under ZeRO-3) beside the gradient's chunk, and one parameter gathered.
"""
from __future__ import annotations

import collections
import gc
import time

import torch
import torch.nn as nn

from gradkit.watch.reads import chunk_of, shard_rows
from gradkit.watch.reference import (all_gather, all_sum, backward, comm_device, copy_of, dot64, gathered, room, whole,
                                     world)
from gradkit.watch.sketch import SIGNS, Sketch

UNIT_SHARE = 16  # a unit holds at most 1 / UNIT_SHARE of the model's parameters (or its largest tensor)
_MESHES: dict = {}


def shape_of(p: torch.Tensor) -> torch.Size:
    """A parameter's shape as the model computes with it (ZeRO-3 keeps an empty placeholder in ``p``)."""
    return torch.Size(p.ds_shape) if hasattr(p, "ds_shape") else p.shape


def partitioned(model: nn.Module) -> bool:
    """Whether the engine shards ``model``'s parameters over the ranks (ZeRO-3's partitions, FSDP2's DTensors)."""
    return any(hasattr(p, "ds_tensor") or hasattr(p, "full_tensor") for p in model.parameters())


def units(model: nn.Module) -> list:
    """The modules to put under ``fully_shard``, the root last: from the root down, each child subtree that holds at
    most a ``UNIT_SHARE``-th of the model's parameters (or its largest tensor, whichever is more) and none that a
    module outside it holds too (a tied weight stays with the module above both); larger ones are split further.
    Their parameters not in a smaller unit stay with the root's."""
    numel = {id(p): shape_of(p).numel() for p in model.parameters()}
    holders: dict = collections.defaultdict(set)
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                holders[id(p)].add(id(m))
    limit = max([sum(numel.values()) // UNIT_SHARE, *numel.values()] or [0])
    out = []

    def visit(m):
        for child in m.children():
            inside = {id(x) for x in child.modules()}
            mine = {id(p) for p in child.parameters()}
            if not mine:
                continue
            closed = all(holders[q] <= inside for q in mine)
            if closed and sum(numel[q] for q in mine) <= limit:
                out.append(child)
            else:
                visit(child)

    visit(model)
    return [*out, model]


def own_part(p: torch.Tensor, w: int, r: int) -> torch.Tensor | None:
    """This rank's FSDP2 chunk of the user's parameter ``p``, flat, where this rank already holds exactly it (a ZeRO-3
    partition that is the chunk: a first dimension that W divides, or a vector; an FSDP2 chunk; a whole tensor);
    None where it must be gathered."""
    chunk = chunk_of(shape_of(p), w, r)
    if chunk is None:
        return None
    start, n = chunk
    if hasattr(p, "ds_tensor"):  # ZeRO-3: rank r holds coordinates r x ceil(numel / W) on, padded
        each = -(-p.ds_numel // w)
        mine = p.ds_tensor.reshape(-1)
        ok = start == min(r * each, p.ds_numel) and mine.numel() >= n
        return mine[:n] if ok else None
    if hasattr(p, "full_tensor"):  # FSDP2 (or a DTensor of another layout: gathered)
        ok = shard_rows(p) == chunk and p.device_mesh.size() == w and p.device_mesh.get_local_rank() == r
        return p.to_local().reshape(-1) if ok else None
    return p.detach().reshape(-1)[start:start + n]


def mesh(device: torch.device):
    """A one-dimensional device mesh over every rank (made once per process and device type)."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (device.type, world()[1])
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(device.type, (world()[1],))
    return _MESHES[key]


class Aligned:
    """The reference's pieces this rank's optimizer holds: ``(t, start) -> values``."""

    def __init__(self, pieces: dict, count: int):
        self.pieces, self.count = pieces, count
        self.by_t: dict = collections.defaultdict(list)
        for (t, lo), values in pieces.items():
            self.by_t[t].append((lo, values))

    def __len__(self) -> int:
        return self.count

    def piece(self, t: int, start: int, n: int) -> torch.Tensor:
        """Coordinates ``start .. start + n`` of parameter ``t``'s reference, from the kept piece that holds them (a
        read that shifts or repeats a piece is served as the whole reference would serve it: the control judges)."""
        for lo, values in self.by_t.get(t, ()):
            if lo <= start and start + n <= lo + values.numel():
                return values[start - lo:start - lo + n]
        raise KeyError(f"the sharded reference holds no piece of parameter {t} at {start} ({n} values)")

    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.pieces.values())


class Sharded:
    """The reference under FSDP2 (the module's docstring); ``run`` and ``finish`` as ``reference.Copy``'s."""

    MODE = "sharded"

    def __init__(self, model: nn.Module):
        """The copy's skeleton, on this rank alone (no collective): placeholders on the meta device."""
        self.model, self.device = model, comm_device()
        self.clone = copy_of(model, make=lambda p: nn.Parameter(torch.empty(shape_of(p), device="meta"),
                                                                requires_grad=p.requires_grad))
        self.numels = [shape_of(p).numel() for p in model.parameters()]
        w = world()[1]
        self.plan = units(self.clone)  # the units, once: their sizes here, fully_shard in _build
        *smaller, root = self.plan
        sizes = [sum(p.numel() for p in u.parameters()) for u in smaller]
        unit = max([*sizes, sum(self.numels) - sum(sizes)])  # the root's own: what no smaller unit holds
        # its chunk of the weights and gradient; a unit gathered with its gradient, and the next FSDP2 fetches
        # meanwhile; the sketch's sign pattern
        room((8 * sum(self.numels)) // w + 12 * unit + SIGNS, self.device)
        self.handles, self.summed, self.largest, self.build_s = [], True, 0, 0.0

    def _build(self, judged: set) -> list:
        """The units under ``fully_shard`` while their parameters are placeholders, then each rank's chunks filled with
        the step's starting weights: from what this rank holds where that is the chunk (``own_part``: no collective),
        else from the parameter gathered whole (every rank in the same order)."""
        from torch.distributed.fsdp import fully_shard

        user, placeholders = list(self.model.parameters()), list(self.clone.parameters())
        index = {id(p): t for t, p in enumerate(placeholders)}
        slots: dict = collections.defaultdict(list)  # t -> every (module, name) that holds it
        for m in self.clone.modules():
            for name, p in m._parameters.items():
                if p is not None and id(p) in index:
                    slots[index[id(p)]].append((m, name))
        for t, p in enumerate(placeholders):
            p.requires_grad_(t in judged)
        done = set()
        for unit in self.plan:
            size = 0
            for p in unit.parameters():
                if id(p) in index and index[id(p)] not in done:  # not a smaller unit's, already sharded
                    done.add(index[id(p)])
                    size += p.numel() * 4
            self.largest = max(self.largest, size)
            fully_shard(unit, mesh=mesh(self.device), reshard_after_forward=True)
        buffers = [(m, name, b) for m in self.clone.modules() for name, b in m._buffers.items() if b is not None]
        self.clone.to_empty(device=self.device)  # each rank's chunks only
        for m, name, b in buffers:
            m._buffers[name] = b
        rank, w = world()
        parts = [own_part(p, w, rank) for p in user]
        local = torch.tensor([0.0 if x is None else 1.0 for x in parts])
        all_sum(local, torch.distributed.ReduceOp.MIN)  # every rank gathers the same parameters
        with torch.no_grad():
            for t, p in enumerate(self.clone.parameters()):
                dst = p.to_local().reshape(-1)
                if local[t] > 0:
                    dst.copy_(parts[t])
                else:
                    start, n = chunk_of(shape_of(user[t]), w, rank)
                    dst.copy_(whole(user[t]).reshape(-1)[start:start + n])
        self.gathered_params = int((local == 0).sum())
        for m in self.clone.modules():  # FSDP2 averages over the ranks: sum instead, where this torch can
            if hasattr(m, "set_gradient_divide_factor") and hasattr(m, "set_force_sum_reduction_for_comms"):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum
            elif hasattr(m, "set_gradient_divide_factor") or hasattr(m, "set_reduce_scatter_divide_factor"):
                self.summed = False  # the average, times W afterwards
        return [(unit, {(id(m), name): t for t, held in slots.items() for m, name in held
                        if any(m is x for x in unit.modules())}) for unit in self.plan]

    def run(self, window, loss, sketch: Sketch, partitions: list | None, judged: set) -> dict:
        """Every rank's micro-batches through the sharded copy (collectives): this rank's sketches, counts and loss
        sums as ``reference.run_window`` gives them."""
        ks = [int(x) for x in all_gather(torch.tensor([len(window.micro_batches)]))]
        if min(ks) == 0:
            raise RuntimeError("a rank recorded no micro-batch of this step, and the sharded reference runs every "
                               "rank's micro-batches in step")
        t0 = time.perf_counter()
        plan = self._build(judged)
        self.build_s = time.perf_counter() - t0
        rows = sketch.zeros() if partitions is None else torch.zeros(len(partitions), sketch.size,
                                                                    dtype=torch.float64, device=sketch.device)
        by_t = None if partitions is None else collections.defaultdict(list)
        for q, pieces in enumerate(partitions or ()):
            for t, start, numel in pieces:
                by_t[t].append((q, start, numel))
        live = [True]

        def hook(t, p):
            if not live[0] or p.grad is None:
                return
            if by_t is None:
                sketch.add(rows, t, p.grad)
                return
            flat = p.grad.reshape(-1)
            for q, start, numel in by_t.get(t, ()):
                sketch.add(rows[q], t, flat[start:start + numel], start)

        seen = set()

        def gathered(unit, slot):  # after FSDP2's own pre-forward (put on first): the unit's parameters gathered
            def pre(*_):
                for m in unit.modules():
                    for name, p in m._parameters.items():
                        t = slot.get((id(m), name))
                        if t is None or p is None or hasattr(p, "full_tensor") or id(p) in seen or not p.requires_grad:
                            continue
                        seen.add(id(p))  # FSDP2 keeps one gathered parameter for every forward and backward
                        self.handles.append(p.register_post_accumulate_grad_hook(lambda q, t=t: hook(t, q)))
            return pre

        for unit, slot in plan:
            self.handles.append(unit.register_forward_pre_hook(gathered(unit, slot)))
        self.clone.train()
        out = {"sketches": [], "counts": [], "sums": [], "parts": []}
        mbs = window.micro_batches
        for i in range(max(ks)):
            live[0] = i < len(mbs)
            rows.zero_()
            total, count = backward(self.clone, mbs[min(i, len(mbs) - 1)], loss, self.device,
                                    scale=1.0 if live[0] else 0.0)
            if live[0]:
                out["sketches"].append(rows.clone() if partitions is None else rows.sum(0))
                if partitions is not None:
                    out["parts"].append(rows.clone())
                out["counts"].append(count)
                out["sums"].append(float(total))
        return out

    def finish(self, local: dict, sketch: Sketch, layout, judged: set) -> dict:
        """As ``reference.Copy.finish``, with ``ref`` the pieces this rank's optimizer holds (``Aligned``)."""
        info = gathered(local, sketch)
        total = float(sum(info["counts"])) or 1.0
        params = list(self.clone.parameters())
        held = {"copy": sum(p.to_local().numel() * 4 for p in params),
                "gradient": sum(p.grad.to_local().numel() * 4 for p in params if p.grad is not None),
                "gathered unit": self.largest}
        grads = [p.grad if t in judged else None for t, p in enumerate(params)]
        self.release()
        del params
        gc.collect()  # FSDP2's states and the copy's modules hold each other: the copy's weights go now
        scale = (1.0 if self.summed else world()[1]) / total
        sums = torch.zeros(2, dtype=torch.float64)
        for g in grads:
            if g is not None:
                mine = g.to_local()
                mine.mul_(scale)
                sums[0] += dot64(mine)
                sums[1] = max(float(sums[1]), float(mine.abs().max()) if mine.numel() else 0.0)
        all_sum(sums[:1])
        top = all_sum(sums[1:].clone(), torch.distributed.ReduceOp.MAX)
        wanted = collections.defaultdict(list)
        for pieces in layout.by_tensor.values():
            for pc in pieces:
                wanted[pc.t].append((pc.start, pc.numel))
        chunks = [None if g is None else shard_rows(g) for g in grads]  # where each gradient's local chunk sits
        here = torch.tensor([float(g is None or c is not None and all(c[0] <= a and a + n <= c[0] + c[1]
                                                                      for a, n in wanted.get(t, ())))
                             for t, (g, c) in enumerate(zip(grads, chunks))])  # the pieces wanted lie in the chunk
        all_sum(here, torch.distributed.ReduceOp.MIN)  # else every rank gathers that parameter
        kept = {}
        for t, g in enumerate(grads):  # every rank, in module order: one parameter gathered at a time
            if t not in judged:
                continue
            lo, flat = 0, None
            if g is not None and here[t] > 0:
                lo, flat = chunks[t][0], g.to_local().reshape(-1)
            elif g is not None:
                flat = g.full_tensor().reshape(-1)
            grads[t] = None
            for start, n in wanted.get(t, ()):
                if flat is None:
                    kept[(t, start)] = torch.zeros(n)
                else:
                    kept[(t, start)] = flat if (start - lo, n) == (0, flat.numel()) else \
                        flat[start - lo:start - lo + n].clone()
        ref = Aligned(kept, len(grads))
        held["reference pieces"] = ref.nbytes()
        held["peak"] = max(held["copy"] + held["gradient"] + held["gathered unit"],
                           held["gradient"] + held["reference pieces"] + max(self.numels, default=0) * 4)
        return {"info": info, "ref": ref, "rr": float(sums[0]), "top": float(top[0]), "held": held}

    def release(self) -> None:
        """Drops every reference to the copy (its units included): the garbage collector can take it at once."""
        for h in self.handles:
            h.remove()
        self.handles, self.clone, self.plan = [], None, None
