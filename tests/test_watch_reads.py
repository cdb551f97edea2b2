"""Where the watch reads the consumed gradient (``gradkit.watch.reads``), in one process, no rank launched: the
layouts whose arithmetic otherwise runs only in real 2-rank jobs (tests/test_watch_jobs.py,
tests/test_watch_sharded.py), each against its definition.

- DeepSpeed ZeRO-1/2: each rank's fp32 partition of a group's flat, the flat as the optimizer lays it out
  (``round_robin_bit16_groups`` in their round-robin order, each at its offset, ``round_robin_bit16_offsets``, where
  a release pads them; one after another where a release keeps no offsets), split evenly over the ranks. Built here
  from that definition for every rank of a world in turn (``torch.distributed``'s rank and size answered by the
  test), each parameter's gradient values telling which coordinate they are: read back over the ranks, every
  coordinate of every parameter must come once, at its place, and no padding ever.
- FSDP2: rank r's chunk of a parameter is ``torch.chunk``'s r-th piece of its rows (ceil(rows / W) rows each, the
  last ranks' short or empty where W does not divide the rows), checked against ``torch.chunk`` itself and against
  torch's own ``fully_shard`` on each rank of a fake process group (``dist`` backend ``fake``: one process that is
  rank r of W, no communication); a ZeRO-3 partition is taken as this rank's chunk only where it is that chunk."""
import contextlib
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from gradkit.watch import sharded
from gradkit.watch.reads import Layout, chunk_of, shard_rows

# ---------------------------------------------------------------- DeepSpeed ZeRO-1/2's flat partitions

SHAPES = [(3, 5), (7,), (2, 2, 3), (1,), (4, 4), (9,), (2, 5), (3,)]  # module order
GROUPS = [[0, 1, 2, 3, 4], [5, 6, 7]]  # two parameter groups (the Trainer's decay and no-decay): two flats
PAD = -1.0  # the flat's padding: never a parameter's value


class Params(nn.Module):
    def __init__(self, shapes):
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.zeros(s)) for s in shapes])


def grad_of(t: int, numel: int) -> torch.Tensor:
    """Parameter t's gradient, flat: coordinate i is 1000 (t + 1) + i (which parameter and where, from the value)."""
    return 1000.0 * (t + 1) + torch.arange(numel, dtype=torch.float32)


def round_robin(indices: list, w: int) -> list:
    """DeepSpeed's round-robin order of a group (``round_robin_gradients``): the group's j-th parameter to bucket
    j mod W, the buckets one after another, each in the group's order."""
    return [t for b in range(w) for j, t in enumerate(indices) if j % w == b]


def zero12(model: nn.Module, w: int, rank: int, rr: bool, param_alignment: int, offsets: bool):
    """DeepSpeed's ZeRO-1/2 optimizer on rank ``rank`` of ``w`` as it lays its groups out (0.19's stage_1_and_2):
    per group its parameters in their (round-robin) order, each padded after to ``param_alignment`` but the last,
    their offsets kept (``offsets``: a release that keeps none pads nothing between them), the flat padded to a
    multiple of 2 x W and split evenly; this rank's fp32 partition of it is what the torch optimizer steps, its
    ``.grad`` this rank's piece of the flat gradient."""
    params = list(model.parameters())
    ds = SimpleNamespace(round_robin_bit16_groups=[], single_partition_of_fp32_groups=[], bit16_groups_flat=[],
                         real_dp_process_group=[], round_robin_bit16_offsets=[])
    for indices in GROUPS:
        order = round_robin(indices, w) if rr else indices
        values, starts, at = [], [], 0
        for k, t in enumerate(order):
            starts.append(at)
            values.append(grad_of(t, params[t].numel()))
            at += params[t].numel()
            pad = (-at) % param_alignment if offsets and k < len(order) - 1 else 0
            values.append(torch.full((pad,), PAD))
            at += pad
        values.append(torch.full(((-at) % (2 * w),), PAD))
        flat = torch.cat(values)
        size = flat.numel() // w
        hp = torch.zeros(size, requires_grad=True)
        hp.grad = flat[rank * size:(rank + 1) * size].clone()
        ds.round_robin_bit16_groups.append([params[t] for t in order])
        ds.round_robin_bit16_offsets.append(starts)
        ds.single_partition_of_fp32_groups.append(hp)
        ds.bit16_groups_flat.append(torch.zeros(flat.numel(), dtype=torch.float16))
        ds.real_dp_process_group.append(object())  # the group's data-parallel ranks: all of them here
    if not offsets:
        del ds.round_robin_bit16_offsets
    ds.optimizer = torch.optim.SGD(ds.single_partition_of_fp32_groups, lr=0.1)
    return ds


def _nothing_read(model) -> tuple[list, list]:
    """Per parameter: the values read back at each coordinate (summed), and how many times each was read."""
    return [torch.zeros(p.numel()) for p in model.parameters()], [torch.zeros(p.numel()) for p in model.parameters()]


def _read_all(layout, stepped, got, seen, who=""):
    for t, start, values in layout.fragments(stepped):
        assert (values != PAD).all(), f"{who}read the flat's padding as parameter {t}'s at {start}"
        got[t][start:start + values.numel()] += values
        seen[t][start:start + values.numel()] += 1


def _whole_once(model, got, seen):
    for t, p in enumerate(model.parameters()):
        assert torch.equal(seen[t], torch.ones(p.numel())), f"parameter {t}: coordinates read {seen[t].tolist()} times"
        assert torch.equal(got[t], grad_of(t, p.numel())), f"parameter {t} read as {got[t].tolist()}"


@pytest.mark.parametrize("w,rr,param_alignment,offsets", [(2, True, 8, True), (3, True, 8, True), (4, True, 1, True),
                                                          (2, False, 1, False), (3, True, 1, False)])
def test_zero12s_flat_partitions_are_read_back_as_every_parameters_own_gradient_once(monkeypatch, w, rr,
                                                                                    param_alignment, offsets):
    """Every rank's pieces of every group's flat, over the ranks: each parameter's gradient whole, each coordinate
    read once on one rank at its own place, no padding read; partitions that cut parameters in two included."""
    model = Params(SHAPES)
    assert not rr or any(round_robin(g, w) != g for g in GROUPS)  # the flat's order is not the groups' own
    got, seen = _nothing_read(model)
    for rank in range(w):
        monkeypatch.setattr(dist, "get_rank", lambda group=None, rank=rank: rank)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: w)
        ds = zero12(model, w, rank, rr, param_alignment, offsets)
        layout = Layout(model, ds, ds.optimizer)
        assert layout.kind == "fp32 partitions" and not layout.replicated, layout.kind
        _read_all(layout, ds.single_partition_of_fp32_groups, got, seen, f"rank {rank} ")
    _whole_once(model, got, seen)


def test_fp16_optimizers_flat_groups_and_the_unfused_ones_masters_are_each_parameters_gradient_in_order():
    """DeepSpeed's FP16_Optimizer (ZeRO-0, fp16): one fp32 flat per group, its parameters one after another in the
    group's order, stepped whole on every rank (replicated); FP16_UnfusedOptimizer: one fp32 master per parameter,
    ``fp32_groups`` beside ``fp16_groups``."""
    model = Params(SHAPES)
    params = list(model.parameters())
    groups = [[params[t] for t in g] for g in GROUPS]
    flats = [torch.zeros(sum(p.numel() for p in g), requires_grad=True) for g in groups]
    for flat, g in zip(flats, GROUPS):
        flat.grad = torch.cat([grad_of(t, params[t].numel()) for t in g])
    fused = SimpleNamespace(fp32_groups_flat=flats, fp16_groups=groups)
    masters = [[torch.zeros(params[t].shape, requires_grad=True) for t in g] for g in GROUPS]
    for ms, g in zip(masters, GROUPS):
        for m, t in zip(ms, g):
            m.grad = grad_of(t, params[t].numel()).reshape(params[t].shape)
    unfused = SimpleNamespace(fp32_groups=masters, fp16_groups=groups)
    for wrapper, stepped, kind in ((fused, flats, "fp32 flat groups"),
                                   (unfused, [m for ms in masters for m in ms], "fp32 masters")):
        layout = Layout(model, wrapper, torch.optim.SGD(stepped, lr=0.1))
        assert (layout.kind, layout.replicated) == (kind, True)
        got, seen = _nothing_read(model)
        _read_all(layout, stepped, got, seen)
        _whole_once(model, got, seen)


@pytest.mark.parametrize("w", [2, 3])
def test_zero3s_partitions_are_read_back_over_the_ranks_as_every_parameters_gradient_once(monkeypatch, w):
    """DeepSpeed ZeRO-3: a parameter of ``ds_numel`` coordinates is cut into W partitions of ceil(ds_numel / W)
    (its ``ds_tensor``, the last padded); rank r's holds coordinates r x size on; a sub-group's fp32 flat is its
    parameters' partitions one after another. Read on every rank in turn: each coordinate once, no padding."""
    model = Params(SHAPES)
    params = list(model.parameters())
    for p in params:
        p.ds_numel = p.numel()
    got, seen = _nothing_read(model)
    for rank in range(w):
        monkeypatch.setattr(dist, "get_rank", lambda group=None, rank=rank: rank)
        flats, parts = [], []
        for g in GROUPS:
            pieces, group_parts = [], []
            for t in g:
                size = -(-params[t].numel() // w)
                whole = torch.cat([grad_of(t, params[t].numel()), torch.full((size * w - params[t].numel(),), PAD)])
                pieces.append(whole[rank * size:(rank + 1) * size])
                group_parts.append(SimpleNamespace(ds_numel=size))
            flat = torch.zeros(sum(x.numel() for x in pieces), requires_grad=True)
            flat.grad = torch.cat(pieces)
            flats.append(flat)
            parts.append(group_parts)
        wrapper = SimpleNamespace(fp32_partitioned_groups_flat=flats, fp16_partitioned_groups=parts,
                                  fp16_groups=[[params[t] for t in g] for g in GROUPS])
        layout = Layout(model, wrapper, torch.optim.SGD(flats, lr=0.1))
        assert (layout.kind, layout.replicated) == ("fp32 partitions", False)
        _read_all(layout, flats, got, seen, f"rank {rank} ")
    _whole_once(model, got, seen)


def test_bf16_optimizers_fragment_links_find_each_pieces_flat_by_its_address_and_read_it_at_its_place():
    """DeepSpeed's BF16_Optimizer links each parameter to its fragment of a flat fp32 partition (``_hp_mapping``:
    the fragment itself, its place in the flat, its place in the parameter). Two flats, one per group, each holding
    a piece of each of its parameters; the flat a fragment lives in is found by the fragment's address. A fragment
    in no flat the optimizer steps is refused (a read that cannot be placed)."""
    model = Params(SHAPES)
    params = list(model.parameters())
    flats = []
    for g in GROUPS:  # each parameter's second half, one after another
        halves = [grad_of(t, params[t].numel())[params[t].numel() // 2:] for t in g]
        flat = torch.zeros(sum(h.numel() for h in halves), requires_grad=True)
        flat.grad = torch.cat(halves)
        k = 0
        for t, h in zip(g, halves):
            params[t]._hp_mapping = SimpleNamespace(
                hp_fragment=flat.data.narrow(0, k, h.numel()),
                get_hp_fragment_address=lambda k=k, n=h.numel(): SimpleNamespace(start=k, numel=n),
                lp_fragment_address=SimpleNamespace(start=params[t].numel() // 2, numel=h.numel()))
            k += h.numel()
        flats.append(flat)
    layout = Layout(model, SimpleNamespace(), torch.optim.SGD(flats, lr=0.1))
    assert (layout.kind, layout.replicated) == ("fp32 partitions", False)
    assert set(layout.by_tensor) == {id(f) for f in flats}
    read = {t: (start, values) for t, start, values in layout.fragments(flats)}
    assert sorted(read) == list(range(len(params)))
    for t, (start, values) in read.items():
        n = params[t].numel()
        assert start == n // 2 and torch.equal(values, grad_of(t, n)[n // 2:]), t
    params[0]._hp_mapping.hp_fragment = torch.zeros(3)  # a fragment of no stepped flat
    with pytest.raises(TypeError, match="in no tensor the optimizer steps"):
        Layout(model, SimpleNamespace(), torch.optim.SGD(flats, lr=0.1))


# ---------------------------------------------------------------- FSDP2's chunks of rows

@contextlib.contextmanager
def fake_rank(rank: int, w: int):
    """This process as rank ``rank`` of a world of ``w`` that never communicates (torch's fake process group)."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=w)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_fsdp2s_chunk_is_torch_chunks_piece_of_the_rows_for_every_rows_and_world_size():
    """rank r's chunk is ``torch.chunk(rows, W)[r]``, an empty one where torch.chunk makes fewer than W pieces (5 rows
    over 4 ranks: 2, 2, 1, 0 rows), for every number of rows up to 10 and W up to 5; None for a scalar."""
    for rows in range(11):
        for row_shape in ((), (3,), (2, 2)):
            shape = torch.Size((rows, *row_shape))
            x = torch.arange(shape.numel()).reshape(shape)
            for w in range(1, 6):
                pieces = torch.chunk(x, w, dim=0) if rows else ()
                for r in range(w):
                    start, n = chunk_of(shape, w, r)
                    want = pieces[r].reshape(-1) if r < len(pieces) else torch.zeros(0, dtype=x.dtype)
                    assert torch.equal(x.reshape(-1)[start:start + n], want), \
                        f"{tuple(shape)} over W {w}: rank {r}'s chunk said ({start}, {n}), torch.chunk's is " \
                        f"{want.tolist()}"
    assert chunk_of(torch.Size(()), 2, 0) is None


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 7), nn.Linear(7, 1),
                         nn.Linear(1, 2))


@pytest.mark.parametrize("w", [2, 3, 4])
def test_fsdp2s_chunk_and_the_layouts_pieces_are_where_fully_shard_puts_each_ranks_rows(w):
    """torch's own ``fully_shard`` over W ranks (rows 10, 5, 7, 1 and 2: W divides some, not others, and leaves some
    ranks none): on each rank the watch's chunk (``chunk_of``, ``shard_rows``), the read's pieces (``Layout``) and
    the sharded reference's own part (``sharded.own_part``) are exactly the values FSDP2 gave that rank, at their
    place in the whole parameter."""
    for rank in range(w):
        with fake_rank(rank, w):
            model = _model()
            whole = [p.detach().reshape(-1).clone() for p in model.parameters()]
            shapes = [p.shape for p in model.parameters()]
            fully_shard(model, mesh=init_device_mesh("cpu", (w,)))
            params = list(model.parameters())
            for t, (p, shape) in enumerate(zip(params, shapes)):
                local = p.to_local().reshape(-1)
                start, n = chunk_of(shape, w, rank)
                assert n == local.numel() and torch.equal(whole[t][start:start + n], local), \
                    f"W {w} rank {rank}: parameter {t} {tuple(shape)}'s chunk said ({start}, {n}), FSDP2 holds " \
                    f"{local.numel()} values"
                assert shard_rows(p) == (start, n), (w, rank, t, shard_rows(p))
            opt = torch.optim.SGD(params, lr=0.1)
            layout = Layout(model, opt, opt)
            assert layout.kind == "sharded parameters", layout.kind
            for t, (p, shape) in enumerate(zip(params, shapes)):
                local, (start, n) = p.to_local().reshape(-1), chunk_of(shape, w, rank)
                pieces = [(pc.t, pc.start, pc.hp_start, pc.numel) for pc in layout.by_tensor.get(id(p), [])]
                assert pieces == ([(t, start, 0, n)] if n else []), (w, rank, t, pieces)
                assert torch.equal(sharded.own_part(p, w, rank), local), (w, rank, t)


@pytest.mark.parametrize("w", [2, 3, 4])
def test_a_zero3_partition_is_taken_as_the_fsdp2_chunk_only_where_it_is_that_chunk(w):
    """ZeRO-3's partition of a parameter (rank r holds flat coordinates r x ceil(numel / W) on, padded) is this
    rank's FSDP2 chunk where W divides the rows or the parameter is a vector; elsewhere it is taken only if it holds
    exactly the chunk's values, else gathered (None): never another rank's rows."""
    for shape in ((10, 6), (5, 3), (7, 5), (1, 7), (2, 3), (8, 2), (7,), (1,), (12, 1)):
        p = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape) + shape[0]))
        n = p.numel()
        each = -(-n // w)
        flat = torch.cat([p.reshape(-1), torch.zeros(each * w - n)])
        chunks = torch.chunk(p, w, dim=0)
        for rank in range(w):
            z = nn.Parameter(torch.empty(0))
            z.ds_tensor, z.ds_numel, z.ds_shape = flat[rank * each:(rank + 1) * each].clone(), n, shape
            want = chunks[rank].reshape(-1) if rank < len(chunks) else torch.zeros(0)
            mine = sharded.own_part(z, w, rank)
            if len(shape) == 1 or shape[0] % w == 0:
                assert mine is not None, (shape, w, rank)
            assert mine is None or torch.equal(mine, want), \
                f"{shape} W {w} rank {rank}: its partition ({mine.numel()} values) taken as its chunk " \
                f"({want.numel()} values), not the chunk's values"

