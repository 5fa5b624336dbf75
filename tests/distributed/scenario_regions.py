"""``Strategy.regions``: which part of which whole tensor each rank holds, read against the local tensors.

Every strategy is asked about params laid out with the APIs that make them (a plain tensor on one
device and under DDP, ``fully_shard`` and ``distribute_tensor`` over 1-D and 2-D meshes, DeepSpeed's
ZeRO-1/2 and ZeRO-3 flat partitions built by the layouts' arithmetic from the whole tensors). For
each held part, the view of the local tensor it names equals ``region.read`` of the whole tensor,
the whole shapes are :meth:`~muonkit.distributed.base.Strategy.whole_shapes`, the parts tile the
local tensor, and over all ranks they cover each whole tensor (exactly once where it is sharded).
The N-D layouts (HSDP, TP, FSDP2 + TP, EP, pipeline stages) are read in scenario_dtensor_placement.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from harness import Context, check
from torch import Tensor, nn

from muonkit.distributed import ReplicatedStrategy, SingleDeviceStrategy, Strategy
from muonkit.distributed.base import Held
from muonkit.distributed.pieces import Box, Span

SHAPES = [(5, 3), (3, 7), (1, 1), (0, 4), (6,), (2, 5, 3)]


def _whole(shape: tuple[int, ...], seed: int) -> Tensor:
    return torch.arange(math.prod(shape), dtype=torch.float32).view(shape) + 1000.0 * seed


def _check(strategy: Strategy, param: Tensor, wholes: dict[str, Tensor] | Tensor, *, label: str) -> list[Held]:
    """The held parts of ``param`` are what its local tensor stores; returns them (non-empty ones)."""
    held = strategy.regions(param)
    local = strategy.local(param)
    assert [h.shape for h in held] == [tuple(s) for s in strategy.whole_shapes(param)], label
    stored = 0
    for h in held:
        whole = wholes if isinstance(wholes, Tensor) else wholes[str(h.name)]
        assert tuple(whole.shape) == h.shape, (label, h)
        if not h.region.numel:
            continue
        part = h.part_of(local)
        assert part.numel() == h.region.numel, (label, h)
        assert torch.equal(part.reshape(-1), h.region.read(whole)), (label, h)
        assert part.data_ptr() == local.reshape(-1)[h.offset :].data_ptr(), f"{label}: {h} is not a view"
        stored += h.region.numel
    assert stored <= local.numel(), label
    return [h for h in held if h.region.numel]


def _covered(held: Sequence[Held], names: Sequence[str], *, group: Any = None) -> list[int]:
    """Per name, how many elements every rank together holds (one all_reduce)."""
    counts = torch.tensor([sum(h.region.numel for h in held if h.name == n) for n in names], dtype=torch.int64)
    dist.all_reduce(counts, group=group)
    return counts.tolist()


@check(2, 4)
def regions_of_one_device_and_ddp_are_the_whole_tensors(ctx: Context) -> None:
    del ctx
    for strategy in (SingleDeviceStrategy(), ReplicatedStrategy(dist.group.WORLD)):
        for i, shape in enumerate(SHAPES):
            param = nn.Parameter(_whole(shape, i))
            held = strategy.regions(param)
            assert held == (Held(shape, Box.full(shape)),), (strategy.name, held)
            _check(strategy, param, param.detach(), label=f"{strategy.name} {shape}")
            if param.numel():
                assert held[0].part_of(param) is param, "a whole local tensor is its own part"
        placeholder = nn.Parameter(torch.empty(0))  # a ZeRO-3 param outside forward: its shape in ds_shape
        placeholder.ds_shape = torch.Size([4, 6])  # type: ignore[attr-defined]
        (held,) = strategy.regions(placeholder)
        assert held.shape == (4, 6) and held.region.numel == 0, held


@check(2, 4)
def regions_of_dtensors_are_their_local_shards(ctx: Context) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from muonkit.distributed import DTensorStrategy

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 7, bias=False), nn.Linear(7, 1))  # uneven and empty shards
    wholes = {}
    for i, (name, p) in enumerate(model.named_parameters()):
        wholes[name] = _whole(tuple(p.shape), i)
        with torch.no_grad():
            p.copy_(wholes[name])
    fully_shard(model, mesh=mesh)
    strategy = DTensorStrategy(mesh)
    for name, p in model.named_parameters():
        assert all(isinstance(h.region, Box) for h in _check(strategy, p, wholes[name], label=f"FSDP2 {name}"))
        counts = torch.tensor([sum(h.region.numel for h in strategy.regions(p))])
        dist.all_reduce(counts)
        assert counts.item() == p.numel(), f"FSDP2 {name}: shards cover {counts.item()} of {p.numel()}"
    layouts: list[tuple[Any, list[Any]]] = [(mesh, [Shard(1)]), (mesh, [Replicate()])]
    if ctx.world_size == 4:
        grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
        layouts += [(grid, [Shard(0), Shard(1)]), (grid, [Shard(1), Replicate()])]
    for where, placements in layouts:
        for i, shape in enumerate(SHAPES[:4]):
            whole = _whole(shape, i)
            t = distribute_tensor(whole, where, placements, src_data_rank=None)
            _check(DTensorStrategy(where), t, whole, label=f"{placements} {shape}")


@check(2, 4)
def regions_of_zero_partitions_are_spans_of_each_param(ctx: Context) -> None:
    from muonkit.distributed.zero import ZeroStrategy
    from muonkit.distributed.zero_partition import contiguous_partition, per_param_partition

    names = [f"p{i}" for i in range(len(SHAPES))]
    wholes = {n: _whole(s, i) for i, (n, s) in enumerate(zip(names, SHAPES, strict=True))}
    numels = [math.prod(s) for s in SHAPES]
    offsets = [sum(numels[:i]) + 2 * i for i in range(len(numels))]  # alignment gaps between params
    layouts = {
        "ZeRO-1/2": contiguous_partition(
            names=names,
            shapes=SHAPES,
            offsets=offsets,
            partition_size=math.ceil((offsets[-1] + numels[-1]) / ctx.world_size),
            world_size=ctx.world_size,
        ),
        "ZeRO-3": per_param_partition(names=names, shapes=SHAPES, world_size=ctx.world_size),
    }
    for label, layout in layouts.items():
        flat = torch.full((layout.numel,), float("nan"))  # padding and gaps: never read
        for param in layout.params:
            piece = param.piece_on(ctx.rank)
            if piece is not None:
                data = wholes[param.name].reshape(-1)[piece.param_offset : piece.param_offset + piece.length]
                flat[piece.local_offset : piece.local_offset + piece.length] = data
        strategy = ZeroStrategy()
        strategy.bind(flat, layout)
        held = _check(strategy, flat, wholes, label=label)
        assert all(isinstance(h.region, Span) for h in held), label
        assert [h.name for h in strategy.regions(flat)] == names, "every param of the partition, in order"
        offsets_here = [h.offset for h in held]
        assert offsets_here == sorted(offsets_here), f"{label}: not in local storage order"
        assert _covered(held, names) == numels, f"{label}: the ranks' spans do not cover each param once"
        other = nn.Parameter(_whole((3, 2), 9))  # not a bound partition: whole and local
        assert strategy.regions(other) == (Held((3, 2), Box.full((3, 2))),)
