"""Each rank's part of a :class:`~muonkit.distributed.planner.Plan`: what it sends, receives and writes, per group.

The executor (:mod:`muonkit.distributed.executor`) runs two ``all_to_all`` per exchange group:
pieces to their owners, results back. What a rank sends and receives in each is a pure function
of the plan and the rank; :func:`rank_schedule` computes it once per plan, in O(jobs + W + the
rank's own pieces) (the pieces of a regular placement are looked up by rank, not scanned), and keeps
it in the plan's ``memo``. A steady step then does Python work in proportion to what the rank
itself sends, receives and orthogonalizes, however many ranks there are.

Buffers keep the executor's one order, on every rank alike: an ``all_to_all`` buffer is the
concatenation over ranks (rank order) of, per rank, the pieces of the group's jobs in job order
and, within a job, in piece order (its sources on the way in, its receivers on the way back).

Example: two ranks hold the row halves of a (4, 3) matrix; rank 0 owns it, rank 1 sends it its half::

    >>> from muonkit.distributed.pieces import Box, Job, Piece
    >>> from muonkit.distributed.planner import make_plan
    >>> from muonkit.functional.matrices import MatrixLayout
    >>> rows = [Box((((0, 2),), ((0, 3),))), Box((((2, 4),), ((0, 3),)))]
    >>> job = Job(0, (4, 3), MatrixLayout(), (Piece(0, rows[0]), Piece(1, rows[1])))
    >>> plan = make_plan([job], costs=[1.0], world_size=2)
    >>> plan.owners, rank_schedule(plan, 1, 2)[0].gather.input_splits, rank_schedule(plan, 0, 2)[0].gather.output_splits
    ((0,), [6, 0], [0, 6])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from muonkit.distributed.base import Cuts
from muonkit.distributed.pieces import Box, Expert, Job, Piece, Pieces, Region, Span
from muonkit.distributed.planner import Plan

__all__ = ["Assembly", "Exchange", "Grid", "GroupSchedule", "flat_ranges", "local_range", "rank_schedule"]

MAX_RANGES = 64
"""A region cut into more flat ranges than this (narrow column blocks) is read and written by its box."""


@dataclass(frozen=True)
class Exchange:
    """One ``all_to_all`` as one rank sees it: what it sends and what it receives, in buffer order."""

    send: tuple[tuple[int, Piece], ...]
    """``(job, piece)`` this rank sends, in its send buffer's order."""
    input_splits: list[int]
    """Elements this rank sends to each rank."""
    receive: tuple[tuple[int, Piece], ...]
    """``(job, piece)`` this rank receives, in its receive buffer's order."""
    output_splits: list[int]
    """Elements this rank receives from each rank."""
    sizes: list[int]
    """Elements of each received piece, in order (to split the receive buffer in one call)."""
    mine: Cuts
    """Where the pieces of this rank's local tensors in it lie: those it sends (to owners) or
    receives (results)."""
    results: Cuts | None
    """Where the sent pieces lie in the owner's results (keyed by job) when each is a few flat
    ranges of its job's whole (row blocks, strided rows) or a block of a grid (see :attr:`grids`);
    None: read by their regions."""
    grids: dict[int, Grid]
    """The jobs whose results are cut as a grid of blocks: :attr:`results` ranges are those of the
    result with its blocks laid out one after another (:meth:`Grid.blocks`)."""


@dataclass(frozen=True)
class Grid:
    """A 2-D whole cut into ``count[0] x count[1]`` blocks of ``block`` (row blocks x column blocks,
    as ``Shard(0)`` on one mesh dim and ``Shard(1)`` on another cut it)."""

    count: tuple[int, int]
    block: tuple[int, int]

    def blocks(self, whole: Tensor) -> Tensor:
        """The whole's blocks one after another, each in row-major order (one copy)."""
        (m, n), (r, c) = self.count, self.block
        return whole.reshape(m, r, n, c).permute(0, 2, 1, 3).reshape(-1)

    def whole(self, blocks: Tensor, shape: tuple[int, ...]) -> Tensor:
        """The inverse of :meth:`blocks`: the whole from its blocks laid out one after another."""
        (m, n), (r, c) = self.count, self.block
        return blocks.view(m, n, r, c).permute(0, 2, 1, 3).reshape(shape)

    def cell(self, region: Region) -> int | None:
        """The block ``region`` is (its index, row-major), or None."""
        if not isinstance(region, Box) or len(region.runs) != 2 or any(len(r) != 1 for r in region.runs):
            return None
        (a, b), (c0, c1) = region.runs[0][0], region.runs[1][0]
        (r, c), n = self.block, self.count[1]
        if a % r or b - a != r or c0 % c or c1 - c0 != c:
            return None
        return a // r * n + c0 // c

    @staticmethod
    def of(regions: Sequence[Region], shape: tuple[int, ...]) -> Grid | None:
        """The grid whose blocks ``regions`` all are (at least two columns of blocks), or None."""
        if len(shape) != 2 or not regions or not all(isinstance(r, Box) and len(r.runs) == 2 for r in regions):
            return None
        first = regions[0]
        assert isinstance(first, Box)
        if any(len(r) != 1 for r in first.runs):
            return None
        block = (first.runs[0][0][1] - first.runs[0][0][0], first.runs[1][0][1] - first.runs[1][0][0])
        if not all(block) or shape[0] % block[0] or shape[1] % block[1] or block[1] == shape[1]:
            return None
        grid = Grid((shape[0] // block[0], shape[1] // block[1]), block)
        return grid if all(grid.cell(r) is not None for r in regions) else None


@dataclass(frozen=True)
class Assembly:
    """How an owner builds one job's whole from its sources."""

    sources: tuple[tuple[Piece, int], ...]
    """Each source piece and where its data is: -1 this rank's own update, else its index in the
    gather's :attr:`Exchange.receive`."""
    tiles: tuple[tuple[int, int, int], ...] | None
    """When every source is a few flat ranges of the whole (row blocks, strided rows, flat spans):
    ``(source, start in its data, length)`` of each range in the whole's flat order (the whole is
    their concatenation); else None."""
    grid: tuple[Grid, tuple[int, ...]] | None = None
    """When the sources are the blocks of a :class:`Grid`: it and the source of each block, in
    order (the whole is :meth:`Grid.whole` of their concatenation); else None (and no
    :attr:`tiles`: each source is written by its region)."""


@dataclass(frozen=True)
class GroupSchedule:
    """One exchange group of the plan, as one rank runs it."""

    mine: tuple[int, ...]
    """The jobs this rank orthogonalizes, in job order."""
    ready: tuple[int, ...]
    """Of :attr:`mine`, those whose sources are all on this rank (computed while the gather travels)."""
    assembly: dict[int, Assembly]
    """Per job of :attr:`mine`: how to assemble it."""
    gather: Exchange | None
    """Pieces to owners; None where no piece of the group travels (the same on every rank)."""
    back: Exchange | None
    """Results to the ranks that need them; None where only owners need them (the same on every rank)."""
    local: tuple[tuple[int, Piece], ...]
    """This rank's receiver pieces of its own jobs (written from the result, nothing travels)."""
    local_cuts: Cuts
    """Where :attr:`local` lies in this rank's local tensors."""
    local_results: Cuts | None
    """Where :attr:`local` lies in the results (see :attr:`Exchange.results`)."""
    local_grids: dict[int, Grid]
    """As :attr:`Exchange.grids`, for :attr:`local`."""


def rank_schedule(plan: Plan, rank: int, world_size: int) -> tuple[GroupSchedule, ...]:
    """``rank``'s part of every exchange group of ``plan``, in group order (computed once, kept in ``plan.memo``)."""
    key = ("schedule", rank, world_size)
    cached = plan.memo.get(key)
    if cached is None:
        cached = plan.memo[key] = tuple(_group(plan, group, rank, world_size) for group in plan.groups)
    return cached


def _group(plan: Plan, group: tuple[int, ...], me: int, world: int) -> GroupSchedule:
    mine = tuple(j for j in group if plan.owners[j] == me)
    others = [j for j in group if plan.owners[j] != me]
    sources = {j: list(plan.sources[j]) for j in mine}  # the owner reads each of them once per step
    gather = back = None
    slots: dict[tuple[int, int], int] = {}
    if plan.gathers(group):
        send = [(plan.owners[j], j, p) for j in others for p in _of_rank(plan.sources[j], me)]
        incoming = [(p.rank, j, i, p) for j in mine for i, p in enumerate(sources[j]) if p.rank != me]
        incoming.sort(key=lambda t: t[0])  # stable: by sender, then job, then piece
        slots = {(j, i): k for k, (_, j, i, _) in enumerate(incoming)}
        gather = _exchange(plan, send, [(r, j, p) for r, j, _, p in incoming], world, mine_sent=True)
    if plan.returns(group):
        send = [(p.rank, j, p) for j in mine for p in plan.jobs[j].receivers if p.rank != me]
        receive = [(plan.owners[j], j, p) for j in others for p in _of_rank(plan.jobs[j].receivers, me)]
        back = _exchange(plan, send, receive, world, mine_sent=False)
    assembly = {
        j: _assembly(plan.jobs[j], [(p, slots.get((j, i), -1)) for i, p in enumerate(sources[j])]) for j in mine
    }
    ready = tuple(j for j in mine if all(slot < 0 for _, slot in assembly[j].sources))
    local = tuple((j, p) for j in mine for p in _of_rank(plan.jobs[j].receivers, me))
    results, grids = _result_cuts(plan, local)
    return GroupSchedule(
        mine=mine,
        ready=ready,
        assembly=assembly,
        gather=gather,
        back=back,
        local=local,
        local_cuts=_cuts(plan, local),
        local_results=results,
        local_grids=grids,
    )


def _exchange(
    plan: Plan,
    send: list[tuple[int, int, Piece]],
    receive: list[tuple[int, int, Piece]],
    world: int,
    *,
    mine_sent: bool,
) -> Exchange:
    """Both sides in buffer order: by peer rank, then job, then piece (``sort`` is stable)."""
    send.sort(key=lambda t: t[0])
    receive.sort(key=lambda t: t[0])
    input_splits, output_splits = [0] * world, [0] * world
    for peer, _, piece in send:
        input_splits[peer] += piece.region.numel
    sizes = []
    for peer, _, piece in receive:
        sizes.append(piece.region.numel)
        output_splits[peer] += sizes[-1]
    sent = tuple((j, p) for _, j, p in send)
    received = tuple((j, p) for _, j, p in receive)
    results, grids = (None, {}) if mine_sent else _result_cuts(plan, sent)
    return Exchange(
        send=sent,
        input_splits=input_splits,
        receive=received,
        output_splits=output_splits,
        sizes=sizes,
        mine=_cuts(plan, sent if mine_sent else received),
        results=results,
        grids=grids,
    )


def _cuts(plan: Plan, pieces: Sequence[tuple[int, Piece]]) -> Cuts:
    return Cuts.of([(plan.jobs[j].tensor, (local_range(p),)) for j, p in pieces])


def _result_cuts(plan: Plan, pieces: Sequence[tuple[int, Piece]]) -> tuple[Cuts | None, dict[int, Grid]]:
    """Where ``pieces`` lie in their jobs' results: flat ranges, or blocks of a grid; None: not all do."""
    grids: dict[int, Grid | None] = {}
    ranges = []
    for j, piece in pieces:
        flat = flat_ranges(piece.region, plan.jobs[j].shape)
        if flat is None:
            if j not in grids:
                grids[j] = Grid.of([p.region for p in plan.jobs[j].receivers], plan.jobs[j].shape)
            grid = grids[j]
            cell = None if grid is None else grid.cell(piece.region)
            if grid is None or cell is None:
                return None, {}
            size = piece.region.numel
            flat = ((cell * size, (cell + 1) * size),)
        elif grids.get(j) is not None:
            return None, {}  # a flat piece of a job read as a grid: not a placement torch makes
        ranges.append((j, flat))
    return Cuts.of(ranges), {j: g for j, g in grids.items() if g is not None}


def local_range(piece: Piece) -> tuple[int, int]:
    """Where ``piece`` lies in its holder's local tensor, flattened (see :func:`~muonkit.distributed.base.local_part`)."""
    n = piece.region.numel
    where = piece.where
    if where is None:
        return 0, n
    if isinstance(where, Expert):
        return where.index * n, (where.index + 1) * n
    return where.offset, where.offset + n


def _assembly(job: Job, sources: list[tuple[Piece, int]]) -> Assembly:
    """How to assemble ``job``: by tiles (flat ranges), by a grid of blocks, or region by region."""
    tiles = _tiles(job, [p for p, _ in sources])
    if tiles is not None:
        return Assembly(tuple(sources), tiles)
    grid = Grid.of([p.region for p, _ in sources], job.shape)
    if grid is not None:
        cells = [grid.cell(p.region) for p, _ in sources]
        if sorted(cells) == list(range(grid.count[0] * grid.count[1])):  # type: ignore[type-var]
            order = sorted(range(len(sources)), key=lambda i: cells[i])  # type: ignore[arg-type,return-value]
            return Assembly(tuple(sources), None, (grid, tuple(order)))
    return Assembly(tuple(sources), None)


def _tiles(job: Job, sources: list[Piece]) -> tuple[tuple[int, int, int], ...] | None:
    """The tiles of the whole when every source is a few flat ranges of it and together they cover it."""
    segments = []
    for i, piece in enumerate(sources):
        ranges = flat_ranges(piece.region, job.shape)
        if ranges is None:
            return None
        offset = 0
        for a, b in ranges:
            segments.append((a, b, i, offset))
            offset += b - a
    segments.sort()
    end = 0
    for a, b, _, _ in segments:
        if a != end:
            return None
        end = b
    return tuple((i, offset, b - a) for a, b, i, offset in segments) if end == job.numel else None


def _of_rank(pieces: Sequence[Piece], rank: int) -> list[Piece]:
    """The pieces ``rank`` holds, in piece order (looked up, not scanned, for :class:`Pieces`)."""
    if isinstance(pieces, Pieces):
        return [pieces[i] for i in pieces.holders.by_rank.get(rank, ())]
    return [p for p in pieces if p.rank == rank]


def flat_ranges(region: Region, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...] | None:
    """The flat ranges of a whole of ``shape`` that ``region`` is, in the holder's storage order,
    when the trailing dims are whole and there are at most :data:`MAX_RANGES`; else None.

    >>> flat_ranges(Box((((2, 4), (5, 6)), ((0, 3),))), (6, 3)), flat_ranges(Box((((2, 4),), ((0, 2),))), (6, 3))
    (((6, 12), (15, 18)), None)
    """
    if isinstance(region, Span):
        return ((region.start, region.stop),)
    runs = region.runs
    if len(runs) != len(shape) or any(r != ((0, n),) for r, n in zip(runs[1:], shape[1:], strict=True)):
        return None
    if not runs[0] or len(runs[0]) > MAX_RANGES:
        return None
    inner = math.prod(shape[1:])
    return tuple((a * inner, b * inner) for a, b in runs[0])
