"""The planner and the DTensor job builder as they were before they became linear (main 3a3594f).

Kept verbatim (only renamed imports) as the reference the fast versions must equal exactly:
:func:`dim_runs` splits ``arange(size)`` anew for each coordinate (O(W^2) per shape),
:func:`choose_owners` scans every rank for every free job (O(jobs x W x pieces)). Readable and
never optimized: tests compare owners, sources, groups and every job's pieces with them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Hashable, Sequence

import torch
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from muonkit.distributed.dtensor_placement import check_placements
from muonkit.distributed.pieces import At, Box, Expert, Job, Piece, Runs, Span
from muonkit.distributed.planner import TOLERANCE, Plan
from muonkit.functional.matrices import MatrixLayout

Split = tuple[Shard | _StridedShard, int, int]


def dim_runs(size: int, splits: tuple[Split, ...]) -> Runs:
    index = torch.arange(size)
    for placement, parts, coordinate in splits:
        index = placement._split_tensor(index, parts, with_padding=False, contiguous=False)[0][coordinate]
    return _runs(index.tolist())


def _runs(index: list[int]) -> Runs:
    runs: list[tuple[int, int]] = []
    for i in index:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return tuple(runs)


def mesh_boxes(
    shape: tuple[int, ...], placements: tuple[Placement, ...], mesh_shape: tuple[int, ...]
) -> dict[tuple[int, ...], Box]:
    check_placements(shape, placements, mesh_shape)
    ndim = len(shape)
    cuts: list[list[tuple[int, Shard | _StridedShard]]] = [[] for _ in shape]
    for i, p in enumerate(placements):
        if isinstance(p, _StridedShard):
            cuts[p.dim % ndim].append((i, _StridedShard(0, split_factor=p.split_factor)))
        elif isinstance(p, Shard):
            cuts[p.dim % ndim].append((i, Shard(0)))
    boxes = {}
    for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
        runs = (
            dim_runs(size, tuple((p, mesh_shape[i], coordinate[i]) for i, p in dim_cuts))
            for size, dim_cuts in zip(shape, cuts, strict=True)
        )
        boxes[coordinate] = Box(tuple(runs))
    return boxes


def rank_boxes(shape: Sequence[int], placements: Sequence[Placement], ranks: torch.Tensor) -> list[tuple[int, Box]]:
    boxes = mesh_boxes(tuple(int(n) for n in shape), tuple(placements), tuple(ranks.shape))
    return sorted(zip(ranks.reshape(-1).tolist(), boxes.values(), strict=True))


def tensor_jobs(
    tensor: int, shape: Sequence[int], layout: MatrixLayout, holders: Sequence[tuple[int, Box]]
) -> list[Job]:
    shape = tuple(int(n) for n in shape)
    if not math.prod(shape):
        return []
    kind = layout.resolved(len(shape))
    if kind == "transposed" or (kind != "experts" and layout.split_sizes is None):
        return [Job(tensor, shape, layout, tuple(Piece(rank, box) for rank, box in holders if box.numel))]
    if kind == "experts":
        units = _experts(shape, holders)
        base = MatrixLayout("matrix")
    else:
        units = [(shape, [Piece(rank, box) for rank, box in holders if box.numel])]
        base = MatrixLayout(kind)
    if layout.split_sizes is None:
        return [Job(tensor, whole, base, tuple(pieces)) for whole, pieces in units]
    jobs = []
    for whole, pieces in units:
        start = 0
        for size in layout.split_sizes:
            block = (_rows(piece, start, start + size) for piece in pieces)
            jobs.append(Job(tensor, (size, *whole[1:]), base, tuple(p for p in block if p is not None)))
            start += size
    return jobs


def _experts(shape: tuple[int, ...], holders: Sequence[tuple[int, Box]]) -> list[tuple[tuple[int, ...], list[Piece]]]:
    lead = shape[:-2]
    experts: list[list[Piece]] = [[] for _ in range(math.prod(lead))]
    for rank, box in holders:
        if not box.numel:
            continue
        region = Box(box.runs[-2:])
        held_lead = [[i for a, b in runs for i in range(a, b)] for runs in box.runs[:-2]]
        for k, index in enumerate(itertools.product(*held_lead)):
            experts[_flat(index, lead)].append(Piece(rank, region, Expert(k)))
    return [(shape[-2:], pieces) for pieces in experts]


def _rows(piece: Piece, start: int, stop: int) -> Piece | None:
    region = piece.region
    assert isinstance(region, Box) and not isinstance(piece.where, At), piece
    runs, inner = region.runs[0], math.prod(region.shape[1:])
    kept: list[tuple[int, int]] = []
    first = local = 0
    for a, b in runs:
        lo, hi = max(a, start), min(b, stop)
        if lo < hi:
            first = first if kept else local + lo - a
            kept.append((lo - start, hi - start))
        local += b - a
    if not kept or not inner:
        return None
    matrix = 0 if piece.where is None else piece.where.index * region.numel
    return Piece(piece.rank, Box((tuple(kept), *region.runs[1:])), At(matrix + first * inner))


def _flat(index: Sequence[int], shape: Sequence[int]) -> int:
    flat = 0
    for i, n in zip(index, shape, strict=True):
        flat = flat * n + i
    return flat


def held_by(job: Job, rank: int) -> int:
    return sum(p.region.numel for p in job.held if p.rank == rank)


def make_plan(
    jobs: Sequence[Job],
    *,
    costs: Sequence[float],
    world_size: int,
    keys: Sequence[Hashable] | None = None,
    tolerance: float = TOLERANCE,
) -> Plan:
    owners = choose_owners(jobs, costs, world_size, tolerance=tolerance)
    sent = [0] * world_size
    order = sorted(range(len(jobs)), key=lambda j: (-costs[j], j))
    chosen: dict[int, tuple[Piece, ...]] = {}
    for j in order:
        chosen[j] = choose_sources(jobs[j], owners[j], sent) if owners[j] >= 0 else ()
    by_key: dict[Hashable, list[int]] = {}
    for j in order:
        if owners[j] >= 0:
            by_key.setdefault(keys[j] if keys is not None else None, []).append(j)
    return Plan(
        jobs=tuple(jobs),
        owners=tuple(owners),
        sources=tuple(chosen[j] for j in range(len(jobs))),
        groups=tuple(tuple(sorted(members)) for members in by_key.values()),
    )


def choose_owners(
    jobs: Sequence[Job], costs: Sequence[float], world_size: int, *, tolerance: float = TOLERANCE
) -> list[int]:
    load = [0.0] * world_size
    owners = [-1] * len(jobs)
    free = []
    for j, job in enumerate(jobs):
        holders = {p.rank for p in job.held}
        if not holders:
            continue
        if len(holders) == 1 and held_by(job, next(iter(holders))) >= job.numel:
            owners[j] = holders.pop()
            load[owners[j]] += costs[j]
        else:
            free.append(j)
    slack = tolerance * (sum(costs) / world_size)
    for j in sorted(free, key=lambda j: (-costs[j], j)):
        held = [held_by(jobs[j], r) for r in range(world_size)]
        near = [r for r in range(world_size) if load[r] <= min(load) + slack]
        whole = [r for r in near if held[r] >= jobs[j].numel]
        part = [r for r in near if held[r] > 0]
        pick = whole or part or list(range(world_size))
        owners[j] = min(pick, key=lambda r: (load[r], -held[r], r))
        load[owners[j]] += costs[j]
    return owners


def choose_sources(job: Job, owner: int, sent: list[int]) -> tuple[Piece, ...]:
    regions: dict[object, list[Piece]] = {}
    for piece in job.held:
        regions.setdefault(piece.region, []).append(piece)
    chosen = []
    for holders in regions.values():
        mine = [p for p in holders if p.rank == owner]
        piece = mine[0] if mine else min(holders, key=lambda p: (sent[p.rank], p.rank))
        if piece.rank != owner:
            sent[piece.rank] += piece.region.numel
        chosen.append(piece)
    return tuple(chosen)


def whole_jobs(tensor: int, shape: tuple[int, ...], layout: MatrixLayout, ranks: Sequence[int]) -> list[Job]:
    kind = layout.resolved(len(shape))
    if kind == "transposed" or (kind != "experts" and layout.split_sizes is None):
        return [Job(tensor, shape, layout, tuple(Piece(r, Box.full(shape)) for r in ranks))]
    count, rows, cols = layout.base_shape(shape)
    matrix_layout = MatrixLayout("matrix")
    if layout.split_sizes is None:
        matrix = (rows, cols)
        return [
            Job(tensor, matrix, matrix_layout, tuple(Piece(r, Box.full(matrix), Expert(k)) for r in ranks))
            for k in range(count)
        ]
    jobs = []
    for k in range(count):
        start = k * rows
        for size in layout.split_sizes:
            held = tuple(Piece(r, Span(0, size * cols), At(start * cols)) for r in ranks)
            jobs.append(Job(tensor, (size, cols), matrix_layout, held))
            start += size
    return jobs
