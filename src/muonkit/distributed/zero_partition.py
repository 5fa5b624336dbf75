"""Where the pieces of each parameter live in DeepSpeed ZeRO's flat fp32 partitions.

DeepSpeed hands its client optimizer one flat fp32 tensor per param group and rank (ZeRO-1/2)
or per sub-group and rank (ZeRO-3), not the parameters. A :class:`FlatPartition` describes such a
tensor on every rank at once: for each original parameter, its shape and the :class:`Piece` s
of its flattened elements, each on one rank at one offset of that rank's flat partition.

Two partitionings occur, both pure arithmetic on shapes (no DeepSpeed import):

ZeRO-1 and ZeRO-2 (and DeepSpeed's BF16 optimizer), :func:`contiguous_partition`: the params are
concatenated (at ``offsets``) into one flat buffer that is cut into ``world_size`` equal
partitions of ``partition_size`` elements; rank ``r`` holds ``[r*P, (r+1)*P)``. A param lies
inside one partition or straddles a boundary::

    flat:   | a a a a b b | b b b c c c |      a: whole on rank 0, c: whole on rank 1
            |   rank 0    |   rank 1    |      b: straddles, pieces on ranks 0 and 1

ZeRO-3, :func:`per_param_partition`: every param is cut on its own into ``world_size`` pieces of
``ceil(numel/W)`` elements (the last padded); a rank's flat tensor is its piece of each param
of the sub-group, one after another::

    rank 0: | a[0:3] b[0:2] |       rank 1: | a[3:6] b[2:4] |

Example::

    >>> partition = contiguous_partition(names=["a", "b"], shapes=[(2, 2), (2, 3)], offsets=[0, 4],
    ...                                  partition_size=5, world_size=2)
    >>> [(p.rank, p.local_offset, p.param_offset, p.length) for p in partition.params[1].pieces]
    [(0, 4, 0, 1), (1, 0, 1, 5)]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["FlatParam", "FlatPartition", "Piece", "contiguous_partition", "per_param_partition"]


@dataclass(frozen=True)
class Piece:
    """``length`` elements of a flattened param, from ``param_offset``, stored by ``rank`` at ``local_offset``."""

    rank: int
    local_offset: int
    param_offset: int
    length: int


@dataclass(frozen=True)
class FlatParam:
    """One original parameter: its name, shape, and where its elements are."""

    name: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def holders(self) -> tuple[int, ...]:
        """The ranks that store a piece of this param, in piece order."""
        return tuple(p.rank for p in self.pieces)

    def piece_on(self, rank: int) -> Piece | None:
        return next((p for p in self.pieces if p.rank == rank), None)


@dataclass(frozen=True)
class FlatPartition:
    """A flat partition (``numel`` elements on every rank) and the params whose pieces it holds."""

    params: tuple[FlatParam, ...]
    numel: int
    world_size: int

    def __post_init__(self) -> None:
        for param in self.params:
            covered = 0
            for piece in param.pieces:
                if piece.param_offset != covered or piece.length <= 0:
                    raise ValueError(f"pieces of {param.name!r} must cover it in order, without gaps: {param.pieces}")
                if not 0 <= piece.rank < self.world_size or piece.local_offset + piece.length > self.numel:
                    raise ValueError(f"piece {piece} of {param.name!r} lies outside the {self.numel}-element partition")
                covered += piece.length
            if covered != param.numel:
                raise ValueError(f"pieces of {param.name!r} cover {covered} of its {param.numel} elements")


def contiguous_partition(
    *,
    names: Sequence[str],
    shapes: Sequence[Sequence[int]],
    offsets: Sequence[int],
    partition_size: int,
    world_size: int,
) -> FlatPartition:
    """ZeRO-1/2 (and BF16 optimizer) partitioning: params at ``offsets`` of one buffer cut into equal partitions."""
    if partition_size <= 0 or world_size <= 0:
        raise ValueError(f"Invalid partition_size={partition_size}, world_size={world_size}: must be > 0")
    params = []
    for name, shape, offset in zip(names, shapes, offsets, strict=True):
        numel = math.prod(shape)
        pieces, done = [], 0
        while done < numel:
            start = offset + done
            rank = start // partition_size
            length = min(numel - done, (rank + 1) * partition_size - start)
            pieces.append(Piece(rank, start - rank * partition_size, done, length))
            done += length
        params.append(FlatParam(name, tuple(shape), tuple(pieces)))
    return FlatPartition(tuple(params), partition_size, world_size)


def per_param_partition(*, names: Sequence[str], shapes: Sequence[Sequence[int]], world_size: int) -> FlatPartition:
    """ZeRO-3 partitioning: each param cut into ``world_size`` pieces of ``ceil(numel/W)``, stacked per rank."""
    if world_size <= 0:
        raise ValueError(f"Invalid world_size={world_size}: must be > 0")
    params, local = [], 0
    for name, shape in zip(names, shapes, strict=True):
        numel = math.prod(shape)
        size = math.ceil(numel / world_size)
        pieces = tuple(
            Piece(rank, local, rank * size, min(size, numel - rank * size))
            for rank in range(world_size)
            if rank * size < numel
        )
        params.append(FlatParam(name, tuple(shape), pieces))
        local += size
    return FlatPartition(tuple(params), local, world_size)
