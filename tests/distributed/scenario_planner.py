"""The one executor on hand-made layouts no torch API builds yet, 4 ranks as a 2 x 2 grid.

Rank ``r`` sits at ``(rep, sh) = divmod(r, 2)``. A :class:`PlannedStrategy` reader that just
returns hand-made jobs describes: rows sharded over ``sh`` and replicated over ``rep`` (HSDP),
strided row sets x column blocks (FSDP2 + TP's ``_StridedShard``), expert stacks split over
``rep`` with their columns over ``sh``, a tensor whole on one rank, one whole on every rank, and
a fused-QKV ``split_sizes`` matrix cut into strided rows x columns (a per-element lr scale on
arrival). Each rank's directions must equal its regions of ``muon_directions`` on the whole
tensors (the single-device path) bit for bit: the same values in the same dtypes, only the
batches differ, and the batched products on the x86 CPUs we run do not depend on the batch.
Every matrix is orthogonalized once, and the bytes sent are exactly the planned pieces: each
replicated region once to its owner (fp32) and each region of a result once to each rank that
needs it (bf16, the compute dtype, narrower than the fp32 updates).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from harness import Context, check
from torch import Tensor

from muonkit.config import MuonConfig, group_config
from muonkit.distributed.executor import PlannedStrategy
from muonkit.distributed.pieces import Box, Expert, Job, Piece
from muonkit.functional.matrices import MatrixLayout
from muonkit.functional.muon import muon_directions

MATRIX = MatrixLayout()


def _config(split_sizes: tuple[int, ...] | None = None) -> MuonConfig:
    group = {
        "algorithm": "muon", "lr": 0.02, "momentum": 0.95, "nesterov": True, "ns_coefficients": "polar_express",
        "ns_steps": None, "eps": 1e-7, "weight_decay": 0.0, "adjust_lr": "keller", "layout": "auto",
        "split_sizes": split_sizes, "ns_dtype": torch.bfloat16, "ns_method": "newton_schulz",
    }  # fmt: skip
    config = group_config(group)
    assert isinstance(config, MuonConfig)
    return config


class HandMade(PlannedStrategy):
    name = "hand-made"

    def __init__(self, jobs: list[Job]) -> None:
        super().__init__(dist.group.WORLD)
        self.planned = jobs

    def jobs(self, params: list[Tensor], updates: list[Tensor], config: MuonConfig) -> list[Job]:
        del params, updates, config
        return self.planned


def _cols(n: int, part: int, parts: int) -> tuple[tuple[int, int], ...]:
    size = n // parts
    return ((part * size, (part + 1) * size),)


def _strided(rows: int, part: int) -> tuple[tuple[int, int], ...]:
    """Rows of ``_StridedShard``: two interleaved chunks of each half (TP 2 x FSDP 2)."""
    q = rows // 4
    return ((part * q, (part + 1) * q), (2 * q + part * q, 2 * q + (part + 1) * q))


def _matrix_jobs() -> list[Job]:
    """Jobs of tensors 0-4 (see the module docstring)."""
    grid = [divmod(r, 2) for r in range(4)]
    hsdp = [Box((((0, 5),) if sh == 0 else ((5, 9),), ((0, 7),))) for _, sh in grid]
    tp = [Box((_strided(8, sh), _cols(6, rep, 2))) for rep, sh in grid]
    jobs = [
        Job(0, (9, 7), MATRIX, tuple(Piece(r, hsdp[r]) for r in range(4))),
        Job(1, (8, 6), MATRIX, tuple(Piece(r, tp[r]) for r in range(4))),
    ]
    for expert in range(4):  # stack (4, 5, 6): experts over rep, columns over sh
        rep, k = divmod(expert, 2)
        held = tuple(Piece(r, Box((((0, 5),), _cols(6, r % 2, 2))), Expert(k)) for r in (2 * rep, 2 * rep + 1))
        jobs.append(Job(2, (5, 6), MATRIX, held))
    jobs.append(Job(3, (6, 4), MATRIX, (Piece(3, Box.full((6, 4))),)))
    jobs.append(Job(4, (5, 3), MATRIX, tuple(Piece(r, Box.full((5, 3))) for r in range(4))))
    return jobs


def _locals(jobs: list[Job], wholes: list[Tensor], rank: int) -> list[Tensor]:
    """This rank's local tensor of each whole: its regions, stacked by expert where there are experts."""
    out = []
    for t, whole in enumerate(wholes):
        mine = [(job, p) for job in jobs if job.tensor == t for p in job.held if p.rank == rank]
        if whole.ndim == 3:  # expert k of the local stack: the k-th expert job this rank holds
            out.append(torch.stack([p.region.read(whole[_expert(jobs, job)]).view(p.region.shape) for job, p in mine]))
        elif mine:
            out.append(mine[0][1].region.read(whole).view(mine[0][1].region.shape))
        else:
            out.append(whole.new_empty(0))
    return out


def _expert(jobs: list[Job], job: Job) -> int:
    """The expert of a stack's job (its position among the stack's jobs)."""
    return [j for j in jobs if j.tensor == job.tensor].index(job)


def _run(ctx: Context, jobs: list[Job], shapes: list[tuple[int, ...]], config: MuonConfig) -> None:
    gen = torch.Generator().manual_seed(11)
    wholes = [torch.randn(s, generator=gen) for s in shapes]
    strategy = HandMade(jobs)
    updates = _locals(jobs, wholes, ctx.rank)
    got = strategy.directions([torch.empty(0)] * len(updates), [u.clone() for u in updates], config)
    layouts = [MatrixLayout("experts" if len(s) == 3 else "matrix", config.layout.split_sizes) for s in shapes]
    expected = muon_directions(wholes, layouts, config.ns_options)
    want = _locals(jobs, expected, ctx.rank)
    for t, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.dtype == w.dtype and g.shape == w.shape, (t, g.shape, w.shape)
        assert torch.equal(g, w), f"tensor {t}: max difference {(g - w).abs().max().item():.3e}"
    total = torch.tensor([strategy.stats.matrices, strategy.stats.bytes_sent])
    dist.all_reduce(total)
    matrices = sum(b.count for s, layout in zip(shapes, layouts, strict=True) for b in layout.blocks(s))
    assert total[0].item() == matrices, f"{total[0].item()} matrices orthogonalized, expected {matrices}"
    plan = strategy.plan_of(jobs, updates, config)
    planned = sum(
        p.region.numel * (4 if p in plan.sources[j] else 0)
        for j, job in enumerate(jobs)
        for p in job.held
        if p.rank != plan.owners[j]
    ) + sum(p.region.numel * 2 for j, job in enumerate(jobs) for p in job.receivers if p.rank != plan.owners[j])
    assert total[1].item() == planned, f"{total[1].item()} bytes sent, planned {planned}"


@check(4)
def hsdp_tp_experts_and_whole_tensors(ctx: Context) -> None:
    _run(ctx, _matrix_jobs(), [(9, 7), (8, 6), (4, 5, 6), (6, 4), (5, 3)], _config())


@check(4)
def split_blocks_scaled_per_element_on_arrival(ctx: Context) -> None:
    grid = [divmod(r, 2) for r in range(4)]
    boxes = [Box((_strided(12, sh), _cols(6, rep, 2))) for rep, sh in grid]
    jobs = [Job(0, (12, 6), MatrixLayout("matrix", (3, 9)), tuple(Piece(r, boxes[r]) for r in range(4)))]
    assert math.prod((12, 6)) == sum(b.numel for b in boxes)
    _run(ctx, jobs, [(12, 6)], _config((3, 9)))


@check(4)
def grids_strided_rows_and_column_blocks_travel_as_views(ctx: Context) -> None:
    """The executor's cut paths: a 2 x 2 grid of blocks (Shard(0) x Shard(1)), rows strided over
    ranks with whole columns (several flat ranges per piece), column blocks replicated twice, and
    experts' row blocks (flat ranges at Expert(k))."""
    grid = [Box((((4 * (r // 2), 4 * (r // 2) + 4),), ((3 * (r % 2), 3 * (r % 2) + 3),))) for r in range(4)]
    strided = [Box((((r, r + 1), (r + 4, r + 5)), ((0, 5),))) for r in range(4)]
    columns = [Box((((0, 6),), ((2 * (r % 2), 2 * (r % 2) + 2),))) for r in range(4)]
    jobs = [
        Job(0, (8, 6), MATRIX, tuple(Piece(r, grid[r]) for r in range(4))),
        Job(1, (8, 5), MATRIX, tuple(Piece(r, strided[r]) for r in range(4))),
        Job(2, (6, 4), MATRIX, tuple(Piece(r, columns[r]) for r in range(4))),
    ]
    for expert in range(2):  # stack (2, 4, 3): both experts on every rank, rows split over rank pairs
        rows = [Box((((2 * (r % 2), 2 * (r % 2) + 2),), ((0, 3),))) for r in range(4)]
        jobs.append(Job(3, (4, 3), MATRIX, tuple(Piece(r, rows[r], Expert(expert)) for r in range(4))))
    _run(ctx, jobs, [(8, 6), (8, 5), (6, 4), (2, 4, 3)], _config())
