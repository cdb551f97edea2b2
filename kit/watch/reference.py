"""The reference of a judged step, computed beside the user's job: an fp32 copy of the user's model holding the
step's starting weights, fed each micro-batch this rank recorded (same inputs, same random-number state), its loss
taken by the user's loss definition (``gradkit.watch.losses``), one backward each. The copy's ``.grad`` accumulates the
sum of the micro-batches' summed-loss gradients; after each one the *sketch* of what it added is taken (the
micro-batch's own gradient, for the fitted weights). Memory: the copy's weights and its gradient, two copies of one
gradient in fp32, and the sketches.

The copy is made module by module (``copy_of``) with every parameter a fresh fp32 one (never copied from the
engine's, which under ZeRO-3 is an empty placeholder) and every module hook dropped (DeepSpeed's and FSDP's
gathering hooks belong to the code under test), and so is every method patched onto a module instance (TRL's fused
LM head, which returns log-probabilities instead of logits; Accelerate's fp32 outputs): the copy computes with its
class's own forward, and the keywords only the patch took are not passed to it. An FSDP2 module goes back to its own
class. The starting weights
are read without the engine: a ZeRO-3 partition is gathered from every rank's ``ds_tensor`` with plain
``torch.distributed``, an FSDP2 ``DTensor`` by ``full_tensor()``.
"""
from __future__ import annotations

import collections
import inspect
import math
import os
import types

import torch
import torch.distributed as dist
import psutil
import torch.nn as nn

from gradkit.watch.sketch import SIGNS, Sketch

COMPOSABLE = "__composable_api_state_key"  # torch's composable APIs (fully_shard) keep their state there
_DOT_CHUNK = 1 << 20  # values converted to fp64 at a time (dot64: 8 MB)
HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
              "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")


def world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def whole(p: torch.Tensor) -> torch.Tensor:
    """A parameter as the model computes with it, whole, on every rank (a collective where it is partitioned)."""
    if hasattr(p, "ds_tensor"):  # ZeRO-3: each rank holds a partition
        parts = all_gather(p.ds_tensor.detach().reshape(-1))
        return torch.cat(parts)[:p.ds_numel].reshape(p.ds_shape)
    if hasattr(p, "full_tensor"):  # an FSDP2 / tensor-parallel DTensor
        return p.full_tensor().detach()
    return p.detach()


def _fsdp_class(cls):
    bases = cls.__bases__
    if len(bases) == 2 and bases[0].__name__ == "FSDPModule":
        return bases[1]
    return cls


def copy_of(model: nn.Module, make=None) -> nn.Module:
    """An fp32 copy of ``model`` that shares no parameter, buffer or hook with it: each module a new object of its
    own class (an FSDP2 module's original class) with its attributes (configuration and the like, read only by the
    forward) shared, fresh parameters holding the weights (gathered where they are partitioned; a parameter two
    modules share stays one), copied buffers, no hooks. Not ``copy.deepcopy``: FSDP2 refuses it, and under ZeRO-3
    it would copy the engine's state hanging off each parameter. ``make(p)``: the copy's parameter for the user's
    ``p`` (the sharded reference makes placeholders on the meta device, ``gradkit.watch.sharded``)."""
    fresh: dict = {}
    make = make or (lambda p: nn.Parameter(whole(p).float().clone(), requires_grad=p.requires_grad))
    done: dict = {}
    patched: set = set()

    def param(p):
        if p is None:
            return None
        if id(p) not in fresh:
            fresh[id(p)] = make(p)
        return fresh[id(p)]

    def clone(m):
        if id(m) in done:
            return done[id(m)]
        new = object.__new__(_fsdp_class(type(m)))
        new.__dict__.update(m.__dict__)
        for name, v in list(new.__dict__.items()):  # every hook dict the copy's own (FSDP2 on the sharded copy
            if isinstance(v, dict) and (name in HOOK_DICTS or "hook" in name):  # adds state-dict hooks: never the user's)
                new.__dict__[name] = collections.OrderedDict()
        for name in [k for k in new.__dict__ if k.startswith(COMPOSABLE)]:  # FSDP2's state of the user's module
            del new.__dict__[name]
        for name, v in list(new.__dict__.items()):  # methods bound to the user's module, kept on the instance
            if not (isinstance(v, types.MethodType) and v.__self__ is m):
                continue
            if hasattr(type(new), name):  # one of the class's patched over (TRL's fused LM head, Accelerate's fp32
                del new.__dict__[name]  # outputs): code under test; the copy computes with the class's own
                if name == "forward" and m is model:
                    patched.update(_own_keywords(v, type(new).forward))
            else:  # a method kept as an attribute (self.act = self.gelu): the copy's own
                new.__dict__[name] = types.MethodType(v.__func__, new)
        new.__dict__["_non_persistent_buffers_set"] = set(m.__dict__.get("_non_persistent_buffers_set", ()))
        new.__dict__["_parameters"] = {k: param(p) for k, p in m._parameters.items()}
        new.__dict__["_buffers"] = {k: None if b is None else (b.detach().float() if b.is_floating_point()
                                                                 else b.detach()).clone()
                                    for k, b in m._buffers.items()}
        done[id(m)] = new
        new.__dict__["_modules"] = {k: None if c is None else clone(c) for k, c in m._modules.items()}
        return new

    out = clone(model)
    fresh.clear()  # ``clone`` calls itself: its closure is a cycle, which must not keep the copy's tensors
    done.clear()
    out.__dict__[PATCHED_KEYWORDS] = frozenset(patched)
    return out


PATCHED_KEYWORDS = "_gradkit_patched_keywords"  # on a copy: the keywords only a patched-away forward took


def _own_keywords(patch, forward) -> set:
    """The keywords ``patch`` names that the class's ``forward`` does not (e.g. TRL's ``fused_lm_head``): a call
    recorded through the patch passes them, and the class's forward must not get them."""
    try:
        mine = inspect.signature(patch).parameters
        theirs = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return set()
    kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return {k for k, q in mine.items() if q.kind in kinds and k not in theirs}


def load(clone: nn.Module, model: nn.Module) -> nn.Module:
    """``clone`` holding ``model``'s current weights (the next judged step's starting weights)."""
    with torch.no_grad():
        for c, p in zip(clone.parameters(), model.parameters()):
            c.copy_(whole(p))
    return clone


def _moved(x, device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (list, tuple)):
        return type(x)(_moved(v, device) for v in x)
    if isinstance(x, dict):
        return {k: _moved(v, device) for k, v in x.items()}
    return x


def _floated(x):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.float()
    if isinstance(x, (list, tuple)):
        return type(x)(_floated(v) for v in x)
    if isinstance(x, dict):
        return {k: _floated(v) for k, v in x.items()}
    return x


def restricted(sketch: Sketch, grads: list, partitions: list) -> torch.Tensor:
    """One sketch per partition (``partitions[q]``: the ``(t, start, numel)`` pieces rank q's optimizer holds) of the
    vector ``grads``: (W x size). The partitions do not overlap, so this is one pass over the vector."""
    out = torch.zeros(len(partitions), sketch.size, dtype=torch.float64, device=sketch.device)
    for q, pieces in enumerate(partitions):
        for t, start, numel in pieces:
            if grads[t] is not None:
                sketch.add(out[q], t, grads[t].reshape(-1)[start:start + numel], start)
    return out


def backward(clone: nn.Module, mb, loss, device, scale: float = 1.0) -> tuple[torch.Tensor, int]:
    """One micro-batch through ``clone`` and back (its summed loss times ``scale``): the loss sum and its count. The
    forward runs with the micro-batch's own random-number state (dropout as it was), without autocast (fp32), and
    with gradients on (the optimizer's hook may run under no_grad: DeepSpeed's optimizers step inside one)."""
    args, kwargs = loss.inputs(mb)
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.autocast(device.type, enabled=False), torch.enable_grad():
        torch.set_rng_state(mb.rng["cpu"])
        if devices and mb.rng.get("cuda") is not None:
            torch.cuda.set_rng_state(mb.rng["cuda"], device)
        kwargs = {k: v for k, v in kwargs.items() if k not in clone.__dict__.get(PATCHED_KEYWORDS, ())}
        output = clone(*_floated(_moved(args, device)), **_floated(_moved(kwargs, device)))
        total, count = loss.sum_and_count(output, mb)
        (total * scale if scale != 1.0 else total).backward()
    return total.detach(), count


def run_window(clone: nn.Module, window, loss, sketch: Sketch, partitions: list | None = None) -> dict:
    """This rank's micro-batches through ``clone``: ``{"sketches": [one per micro-batch, of its summed-loss
    gradient], "counts": [its count], "sums": [its loss sum]}``, and with ``partitions`` (where each rank's optimizer
    holds its own pieces) ``"parts"``: per micro-batch its sketch restricted to each rank's pieces (W x size);
    ``clone``'s ``.grad`` holds the sum of those gradients afterwards. The forward runs with the micro-batch's own
    random-number state (dropout as it was) and without autocast (fp32)."""
    device = next(clone.parameters()).device
    params = list(clone.parameters())
    for p in params:
        p.grad = None
    clone.train()
    before, out = sketch.zeros(), {"sketches": [], "counts": [], "sums": [], "parts": []}
    parts_before = None if partitions is None else torch.zeros(len(partitions), sketch.size, dtype=torch.float64,
                                                               device=sketch.device)
    for mb in window.micro_batches:
        total, count = backward(clone, mb, loss, device)
        grads = [p.grad for p in params]
        if partitions is None:
            after = sketch.of(grads)
        else:
            parts_after = restricted(sketch, grads, partitions)
            out["parts"].append(parts_after - parts_before)
            parts_before, after = parts_after, parts_after.sum(0)
        out["sketches"].append(after - before)
        out["counts"].append(count)
        out["sums"].append(float(total.detach()))
        before = after
    return out


def dot64(a: torch.Tensor, b: torch.Tensor | None = None) -> float:
    """The dot product of two tensors' values (``a`` with itself without ``b``) in fp64, a chunk at a time: the
    products of fp32 values are exact there, so sums taken over different pieces agree to fp64's rounding."""
    a, b = a.reshape(-1), None if b is None else b.reshape(-1)
    total = 0.0
    for lo in range(0, a.numel(), _DOT_CHUNK):
        x = a[lo:lo + _DOT_CHUNK].double()
        total += float(torch.dot(x, x if b is None else b[lo:lo + _DOT_CHUNK].double()))  # a square: one conversion
    return total


MARGIN = 1.25  # a judged step goes ahead only where this much more than its estimate is free


def room(need: int, device: torch.device) -> None:
    """Raises ``MemoryError`` where this rank has not ``need`` bytes (times ``MARGIN``) free where the reference
    will live: the GPU's free memory and its allocator's cached blocks, or the host's available memory shared by
    the ranks on it (``LOCAL_WORLD_SIZE``). The watch's first rule: a judged step never takes the job's memory."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) \
            - torch.cuda.memory_allocated(device)
    else:
        free = psutil.virtual_memory().available // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if need * MARGIN > free:
        gib = lambda x: f"{x / 2 ** 30:.2f} GiB"  # noqa: E731
        raise MemoryError(f"the reference needs about {gib(need)} on this rank, {gib(need * MARGIN)} with the watch's "
                          f"margin, and {gib(free)} is free for it: the step is not judged, so that the job keeps its "
                          "memory")


class Whole:
    """The reference gradient as one tensor per parameter, whole on every rank."""

    def __init__(self, grads: list):
        self.grads = grads

    def __len__(self) -> int:
        return len(self.grads)

    def piece(self, t: int, start: int, n: int) -> torch.Tensor:
        return self.grads[t].reshape(-1)[start:start + n]


class Copy:
    """The reference on a whole fp32 copy on every rank (``copy_of``): where every rank holds the model anyway (a
    plain loop, DDP, ZeRO-0/1/2), or asked for. Held at its peak: the copy's weights and its gradient (two fp32
    models), one micro-batch's activations, the sketches."""

    MODE = "whole"
    build_s = 0.0  # the copy is made in __init__ (the sharded one builds in ``run``: its seconds apart)

    def __init__(self, model: nn.Module):
        numel = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        device = next(model.parameters()).device
        room(8 * numel + SIGNS, device)  # fp32 weights and gradient, the sketch's sign pattern
        self.clone = copy_of(model)
        self.device = next(self.clone.parameters()).device

    def release(self) -> None:
        self.clone = None

    def run(self, window, loss, sketch: Sketch, partitions: list | None, judged: set) -> dict:
        for t, p in enumerate(self.clone.parameters()):
            p.requires_grad_(t in judged)
        return run_window(self.clone, window, loss, sketch, partitions)

    def finish(self, local: dict, sketch: Sketch, layout, judged: set) -> dict:
        """The reference over every rank (collectives): ``info`` (``gathered``), ``ref`` (``Whole``: the global-batch
        mean gradient), ``rr`` its squared norm over the judged parameters (fp64), ``top`` its largest magnitude,
        ``held`` the bytes held. The copy is dropped: nothing of it outlives the judged step but the gradient."""
        info = gathered(local, sketch)
        total = float(sum(info["counts"])) or 1.0
        params = list(self.clone.parameters())
        grads, rr, top = [], 0.0, 0.0
        for t, p in enumerate(params):
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            if t in judged:
                all_sum(g)  # a collective on every rank, in module order
                g.div_(total)
                rr += dot64(g)  # as the tally sums its pieces
                top = max(top, float(g.abs().max()) if g.numel() else 0.0)
            grads.append(g)
        held = {"copy": sum(q.numel() * q.element_size() for q in params),
                "gradient": sum(g.numel() * g.element_size() for g in grads)}
        held["peak"] = held["copy"] + held["gradient"]
        for q in params:
            q.grad = None  # the gradient is the reference's now, not the copy's
        for m in self.clone.modules():  # the copy's own dicts: its tensors go now, by their counts (a module's own
            m._parameters.clear()  # bound methods hold it in a cycle, and a full collection costs ~0.2 s in a
            m._buffers.clear()  # process that imported transformers)
        self.clone = params = None
        return {"info": info, "ref": Whole(grads), "rr": rr, "top": top, "held": held}


def gathered(local: dict, sketch: Sketch) -> dict:
    """Every rank's ``run_window`` answer, rank-major (a collective): ``counts`` and ``sums`` as flat lists,
    ``basis`` the micro-batch sketches as a (W x n) x size tensor, ``per_rank`` the micro-batches each rank had,
    ``parts`` (where partitions were given) a W x (W x n) x size tensor: per partition, the basis restricted to it.
    A rank with fewer micro-batches than another sends padding rows, dropped again here."""
    rank, w = world()
    k = len(local["counts"])
    rows = torch.stack(local["sketches"]) if k else torch.zeros(0, sketch.size, dtype=torch.float64)
    nums = torch.tensor([[c, s] for c, s in zip(local["counts"], local["sums"])], dtype=torch.float64).reshape(-1, 2)
    parts = torch.stack(local["parts"]).cpu() if local.get("parts") else None  # k x W x size
    if w == 1:
        return {"basis": rows, "counts": nums[:, 0].tolist(), "sums": nums[:, 1].tolist(), "per_rank": [k],
                "parts": None if parts is None else parts.transpose(0, 1)}
    ks = [int(x) for x in all_gather(torch.tensor([k], dtype=torch.int64))]
    most = max(ks)
    pad = lambda t, width: torch.cat([t, torch.zeros(most - len(t), width, dtype=t.dtype)])  # noqa: E731
    all_rows = all_gather(pad(rows.cpu(), sketch.size))
    all_nums = all_gather(pad(nums, 2))
    basis = torch.cat([r[:n] for r, n in zip(all_rows, ks)])
    nums = torch.cat([r[:n] for r, n in zip(all_nums, ks)])
    out = {"basis": basis, "counts": nums[:, 0].tolist(), "sums": nums[:, 1].tolist(), "per_rank": ks, "parts": None}
    if parts is not None:  # per partition q: every micro-batch's sketch restricted to q's pieces, rank-major
        padded = torch.cat([parts, torch.zeros(most - k, w, sketch.size, dtype=torch.float64)])
        every = all_gather(padded.reshape(most, -1))
        out["parts"] = torch.cat([e.reshape(most, w, -1)[:n] for e, n in zip(every, ks)]).transpose(0, 1)
    return out


def comm_device() -> torch.device:
    """Where a collective's tensors must be: the GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_sum(t: torch.Tensor, op=None) -> torch.Tensor:
    """``t`` reduced over every rank in place (a sum, or ``op``), moved to where the collective needs it and back."""
    if world()[1] == 1:
        return t
    dev = comm_device()
    moved = t if t.device == dev else t.to(dev)
    dist.all_reduce(moved, op=op or dist.ReduceOp.SUM)
    if moved is not t:
        t.copy_(moved)
    return t


def all_gather(t: torch.Tensor) -> list:
    """Every rank's ``t`` (same shape on every rank), on ``t``'s device."""
    if world()[1] == 1:
        return [t]
    dev = comm_device()
    moved = t.to(dev).contiguous()
    rows = [torch.empty_like(moved) for _ in range(world()[1])]
    dist.all_gather(rows, moved)
    return [r.to(t.device) for r in rows]


def all_gather_ragged(t: torch.Tensor) -> list:
    """Every rank's ``t``, whose first dimension may differ between ranks: gathered as tensors, never pickled (torch's
    ``all_gather_object`` needs numpy, which an environment of torch alone does not have)."""
    sizes = [int(n) for n in all_gather(torch.tensor([t.shape[0]], dtype=torch.int64))]
    padded = t.new_zeros((max(max(sizes), 1), *t.shape[1:]))
    padded[:t.shape[0]] = t
    return [row[:n] for row, n in zip(all_gather(padded), sizes)]


def clip_coef(norm: float, clip: float | None) -> float:
    """The coefficient an engine clipping at ``clip`` applies to a gradient of norm ``norm`` (torch's and
    DeepSpeed's ``clip / (norm + 1e-6)``, never above 1)."""
    if not clip or not math.isfinite(norm):
        return 1.0
    return min(1.0, clip / (norm + 1e-6))
