"""ZeroStrategy on hand-made flat layouts, 4 ranks, no DeepSpeed: the sharding edge cases.

Each check cuts whole momentum updates into the flat partitions DeepSpeed would hand the
optimizer, runs :class:`ZeroStrategy` on every rank, gathers the directions and compares them
with ``muon_directions`` on the whole tensors (the single-device path). Newton-Schulz runs in
float64 on both sides, so the stated tolerance is 1e-12 (only batching differs).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from ds_worker import Context, check
from torch import Tensor

from muonkit.config import MuonConfig, group_config
from muonkit.distributed.zero import ZeroStrategy
from muonkit.distributed.zero_partition import FlatPartition, contiguous_partition, per_param_partition
from muonkit.functional.muon import muon_directions

TOL = 1e-12


def _config(layout: str = "auto", split_sizes: tuple[int, ...] | None = None, split_along: str = "rows") -> MuonConfig:
    group = {"split_along": split_along,
        "algorithm": "muon", "lr": 0.02, "momentum": 0.95, "nesterov": True, "ns_coefficients": "polar_express",
        "ns_steps": None, "eps": 1e-7, "weight_decay": 0.0, "adjust_lr": "keller", "layout": layout,
        "split_sizes": split_sizes, "ns_dtype": torch.float64, "ns_method": "newton_schulz",
    }  # fmt: skip
    config = group_config(group)
    assert isinstance(config, MuonConfig)
    return config


def _run(layout: FlatPartition, config: MuonConfig, ctx: Context) -> tuple[list[Tensor], list[Tensor], ZeroStrategy]:
    """(whole updates, gathered directions, strategy) for random updates laid out by ``layout``."""
    gen = torch.Generator().manual_seed(7)
    wholes = [torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in layout.params]
    flats = [torch.zeros(layout.numel, dtype=torch.float64) for _ in range(ctx.world_size)]
    for param, whole in zip(layout.params, wholes, strict=True):
        for piece in param.pieces:
            src = whole.reshape(-1)[piece.param_offset : piece.param_offset + piece.length]
            flats[piece.rank][piece.local_offset : piece.local_offset + piece.length] = src
    mine = flats[ctx.rank]
    strategy = ZeroStrategy()
    partition = torch.zeros_like(mine)  # stands for DeepSpeed's fp32 partition (the optimizer's param)
    strategy.bind(partition, layout)
    local = strategy.directions([partition], [mine], config)[0]
    gathered = [torch.empty_like(local) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, local)
    directions = []
    for param in layout.params:
        whole = torch.empty(param.numel, dtype=torch.float64)
        for piece in param.pieces:
            whole[piece.param_offset : piece.param_offset + piece.length] = gathered[piece.rank][
                piece.local_offset : piece.local_offset + piece.length
            ]
        directions.append(whole.view(param.shape))
    return wholes, directions, strategy


def _compare(layout: FlatPartition, config: MuonConfig, ctx: Context) -> ZeroStrategy:
    wholes, directions, strategy = _run(layout, config, ctx)
    expected = muon_directions(wholes, [config.layout] * len(wholes), config.ns_options)
    for param, got, want in zip(layout.params, directions, expected, strict=True):
        err = (got - want).abs().max().item()
        assert err <= TOL, f"{param.name}: max error {err}"
    _exactly_once(layout, config, strategy)
    return strategy


def _exactly_once(layout: FlatPartition, config: MuonConfig, strategy: ZeroStrategy) -> None:
    total = torch.tensor([strategy.stats.matrices])
    dist.all_reduce(total)
    expected = sum(b.count for p in layout.params for b in config.layout.blocks(p.shape))
    assert total.item() == expected, f"{total.item()} matrices orthogonalized across ranks, expected {expected}"


def _names(n: int) -> list[str]:
    return [f"p{i}" for i in range(n)]


@check
def contiguous_partitions_straddled_and_spanned(ctx: Context) -> None:
    # ZeRO-1/2: params cut by partition boundaries, one spanning three partitions, padding at the end.
    shapes = [(5, 7), (3, 4), (6, 9), (40, 3), (4, 4), (2, 3)]
    numels = [math.prod(s) for s in shapes]
    offsets = [sum(numels[:i]) for i in range(len(numels))]
    size = math.ceil((sum(numels) + 3) / ctx.world_size)
    layout = contiguous_partition(
        names=_names(len(shapes)), shapes=shapes, offsets=offsets, partition_size=size, world_size=ctx.world_size
    )
    assert max(len(p.pieces) for p in layout.params) >= 3, "a param must span three partitions"
    strategy = _compare(layout, _config(), ctx)
    plan = strategy.plan(strategy.partitions[0], _config())
    for i, param in enumerate(layout.params):
        assert plan.owners[i] in param.holders, f"{param.name} owned by {plan.owners[i]}, a rank without a piece"


@check
def contiguous_alignment_gaps(ctx: Context) -> None:
    # parameter_alignment leaves gaps between params; the gaps must come back as zeros.
    shapes = [(3, 5), (7, 2), (4, 6)]
    offsets = [0, 16, 32]
    layout = contiguous_partition(names=_names(3), shapes=shapes, offsets=offsets, partition_size=15, world_size=4)
    wholes, _, strategy = _run(layout, _config(), ctx)
    del wholes
    flat = strategy.partitions[0]
    local = strategy.directions([flat], [torch.ones(layout.numel, dtype=torch.float64)], _config())[0]
    covered = torch.zeros(layout.numel, dtype=torch.bool)
    for param in layout.params:
        for piece in param.pieces:
            if piece.rank == ctx.rank:
                covered[piece.local_offset : piece.local_offset + piece.length] = True
    assert torch.all(local[~covered] == 0), "padding and gaps must get a zero direction"


@check
def per_param_uneven_tiny_and_empty_shards(ctx: Context) -> None:
    # ZeRO-3: numels not divisible by 4; (1, 2) leaves ranks 2 and 3 without a piece.
    shapes = [(5, 7), (1, 2), (9, 3), (3, 3), (8, 8), (8, 8), (8, 8), (2, 11)]
    layout = per_param_partition(names=_names(len(shapes)), shapes=shapes, world_size=ctx.world_size)
    assert len(layout.params[1].pieces) == 2
    strategy = _compare(layout, _config(), ctx)
    flat = strategy.partitions[0]
    owners = strategy.plan(flat, _config()).owners
    counts = [sum(owners[i] == r for i in (4, 5, 6)) for r in range(ctx.world_size)]
    assert max(counts) == 1, f"equal matrices must spread over ranks, got {counts}"


@check
def per_param_experts_and_split_blocks(ctx: Context) -> None:
    experts = per_param_partition(names=_names(2), shapes=[(3, 5, 4), (2, 6, 6)], world_size=ctx.world_size)
    _compare(experts, _config("experts"), ctx)
    split = per_param_partition(names=_names(2), shapes=[(9, 4), (9, 6)], world_size=ctx.world_size)
    _compare(split, _config("matrix", (3, 3, 3)), ctx)
    gpt2 = per_param_partition(names=_names(1), shapes=[(18, 6)], world_size=ctx.world_size)
    _compare(gpt2, _config("transposed", (2, 2, 2)), ctx)
    heads = contiguous_partition(  # per-head output projections (column blocks), straddling partitions
        names=_names(2), shapes=[(5, 12), (7, 12)], offsets=[0, 60], partition_size=36, world_size=ctx.world_size
    )
    _compare(heads, _config("matrix", (4, 4, 4), "cols"), ctx)
    conv1d_heads = per_param_partition(names=_names(1), shapes=[(8, 6)], world_size=ctx.world_size)
    _compare(conv1d_heads, _config("transposed", (4, 4), "cols"), ctx)


@check
def bytes_counted_are_the_split_pieces(ctx: Context) -> None:
    shapes = [(5, 7), (3, 4), (6, 9), (40, 3)]
    numels = [math.prod(s) for s in shapes]
    layout = contiguous_partition(
        names=_names(4),
        shapes=shapes,
        offsets=[sum(numels[:i]) for i in range(4)],
        partition_size=math.ceil(sum(numels) / ctx.world_size),
        world_size=ctx.world_size,
    )
    _, _, strategy = _run(layout, _config(), ctx)
    flat = strategy.partitions[0]
    owners = strategy.plan(flat, _config()).owners
    expected = 0
    for i, param in enumerate(layout.params):
        for piece in param.pieces:  # each piece not on its owner travels there and back
            if piece.rank != owners[i] and ctx.rank in (piece.rank, owners[i]):
                expected += piece.length * 8
    assert strategy.stats.bytes_sent == expected, (strategy.stats.bytes_sent, expected)


@check
def all_finite_agrees_and_unknown_tensor_raises(ctx: Context) -> None:
    strategy = ZeroStrategy()
    assert strategy.guard.all_true(torch.tensor(True))[0]
    assert not strategy.guard.all_true(torch.tensor(ctx.rank != 2))[0]
    try:
        strategy.directions([torch.zeros(4)], [torch.zeros(4)], _config())
    except RuntimeError as e:
        assert "not a ZeRO flat partition" in str(e)
    else:
        raise AssertionError("an unbound tensor must raise")


@check
def zero_size_params_are_skipped(ctx: Context) -> None:
    shapes = [(5, 7), (0, 8), (3, 4), (8, 0), (6, 9), (2, 0, 3)]
    numels = [math.prod(s) for s in shapes]
    layouts = [
        contiguous_partition(
            names=_names(len(shapes)),
            shapes=shapes,
            offsets=[sum(numels[:i]) for i in range(len(shapes))],
            partition_size=math.ceil(sum(numels) / ctx.world_size),
            world_size=ctx.world_size,
        ),
        per_param_partition(names=_names(len(shapes)), shapes=shapes, world_size=ctx.world_size),
    ]
    for layout in layouts:
        wholes, directions, strategy = _run(layout, _config(), ctx)
        expected = muon_directions(wholes, [_config().layout] * len(wholes), _config().ns_options)
        for param, got, want in zip(layout.params, directions, expected, strict=True):
            assert got.shape == want.shape == param.shape, (param.name, got.shape, want.shape)
            assert got.numel() == 0 or (got - want).abs().max().item() <= TOL, param.name
        total = torch.tensor([strategy.stats.matrices])
        dist.all_reduce(total)
        assert total.item() == 3, f"{total.item()} matrices orthogonalized, expected the 3 non-empty ones"
