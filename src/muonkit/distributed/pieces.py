"""Where the parts of a Muon tensor live across ranks: the vocabulary of the one planner.

Every distributed placement (DDP, FSDP2 / HSDP / tensor / expert parallel DTensors on any mesh,
DeepSpeed ZeRO flat partitions) is described to :mod:`muonkit.distributed.planner` the same way:

- a :class:`Job` is one unit of orthogonalization: a whole tensor (with its own
  :class:`~muonkit.functional.matrices.MatrixLayout`: split blocks, flatten, transposed) or one
  expert matrix of a stack. One rank, its *owner*, orthogonalizes it.
- a :class:`Piece` says that ``rank`` holds (or needs) the part ``region`` of a job's whole
  tensor, stored in its local tensor at ``where`` (a key the placement reader understands).
- a region is a :class:`Box` (index runs per dimension of the job's whole shape: row blocks of
  ``Shard(0)``, column blocks of ``Shard(1)``, strided row sets of ``_StridedShard``, their
  products on N-D meshes, the whole tensor for a replicated copy) or a :class:`Span` (a range of
  the job's flattened elements: a piece of a DeepSpeed ZeRO flat partition).

Regions read and write their part of a whole tensor as flat data in the holder's storage order,
so pieces travel as flat buffers and any placement reassembles exactly.

A job's pieces are any sequence of :class:`Piece`: a tuple, or a :class:`Pieces`, the compact
form of a regular placement (one row block per rank, one expert per rank): the holders' ranks and
regions as one :class:`Holders` shared by every job laid out alike, and one ``where`` for all.
At thousands of ranks that is one pair of tuples per distinct shape and placement instead of one
object per job and holder, and what the planner derives from a placement (elements per rank, the
distinct regions) is computed once per :class:`Holders`.

Example: a (6, 4) matrix sharded ``Shard(0)`` over 2 ranks::

    >>> Box.full((6, 4)).numel
    24
    >>> Box((((0, 3),), ((0, 4),))).shape      # rows 0-2 of all 4 columns: rank 0's part
    (3, 4)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import overload

from torch import Tensor

from muonkit.functional.matrices import MatrixLayout

__all__ = [
    "At",
    "Box",
    "Expert",
    "Holders",
    "Job",
    "Piece",
    "Pieces",
    "Region",
    "Span",
    "Where",
    "holders_of",
]

Runs = tuple[tuple[int, int], ...]
"""Index runs ``(start, stop)`` of one dimension, in the holder's storage order."""


@dataclass(frozen=True)
class Box:
    """The sub-array ``whole[runs_0 x runs_1 x ...]``: per dimension, index runs in storage order."""

    runs: tuple[Runs, ...]

    @staticmethod
    @functools.lru_cache(maxsize=4096)  # asked per job at every step: one object per shape
    def full(shape: tuple[int, ...]) -> Box:
        return Box(tuple(((0, n),) if n else () for n in shape))

    @functools.cached_property  # read per part at every step of a split job
    def shape(self) -> tuple[int, ...]:
        return tuple(sum(b - a for a, b in runs) for runs in self.runs)

    @functools.cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    def _blocks(self) -> list[tuple[list[tuple[int, int]], list[tuple[int, int]]]]:
        """Each product of runs: (whole slices, local slices) per dimension."""
        out: list[tuple[list[tuple[int, int]], list[tuple[int, int]]]] = [([], [])]
        for runs in self.runs:
            step = []
            local = 0
            for a, b in runs:
                for whole, mine in out:
                    step.append(([*whole, (a, b)], [*mine, (local, local + b - a)]))
                local += b - a
            out = step
        return out

    def read(self, whole: Tensor) -> Tensor:
        """This region of ``whole`` as a new flat tensor, in storage order."""
        if all(len(r) == 1 for r in self.runs):
            return whole[tuple(slice(*r[0]) if r else slice(0, 0) for r in self.runs)].reshape(-1)
        out = whole.new_empty(self.shape)
        for src, dst in self._blocks():
            out[tuple(slice(*d) for d in dst)] = whole[tuple(slice(*s) for s in src)]
        return out.reshape(-1)

    def write(self, whole: Tensor, data: Tensor) -> None:
        """Copy flat ``data`` (storage order) into this region of ``whole``."""
        for dst, src in self.copies(whole, data):
            dst.copy_(src)

    def copies(self, whole: Tensor, data: Tensor) -> list[tuple[Tensor, Tensor]]:
        """``(view of whole, view of data)`` pairs whose copies are :meth:`write` (to batch them)."""
        local = data.view(self.shape)
        return [
            (whole[tuple(slice(*d) for d in dst)], local[tuple(slice(*s) for s in src)]) for dst, src in self._blocks()
        ]


@dataclass(frozen=True)
class Span:
    """Elements ``[start, stop)`` of the job's whole tensor, flattened (a ZeRO partition's piece)."""

    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start

    def read(self, whole: Tensor) -> Tensor:
        return whole.reshape(-1)[self.start : self.stop]

    def write(self, whole: Tensor, data: Tensor) -> None:
        whole.view(-1)[self.start : self.stop] = data

    def copies(self, whole: Tensor, data: Tensor) -> list[tuple[Tensor, Tensor]]:
        return [(whole.view(-1)[self.start : self.stop], data)]


Region = Box | Span


@dataclass(frozen=True)
class Expert:
    """Where: matrix ``index`` of the local tensor's leading dims (``local.reshape(-1, rows, cols)[index]``)."""

    index: int


@dataclass(frozen=True)
class At:
    """Where: ``offset`` elements into the flattened local tensor (a ZeRO flat partition)."""

    offset: int


Where = Expert | At | None
"""Where a region lies in a rank's local tensor (see :attr:`Piece.where`)."""


@dataclass(frozen=True)
class Piece:
    """``rank`` holds (or needs) ``region`` of a job, stored in its local tensor at ``where``."""

    rank: int
    region: Region
    where: Where = None
    """Where the region lies in the rank's local tensor: ``None`` the whole local tensor,
    :class:`Expert` one matrix of its leading dims, :class:`At` a range of a flat partition."""


@dataclass(frozen=True)
class Job:
    """One unit of orthogonalization: a whole tensor or one expert matrix, and where its parts are."""

    tensor: int
    """Index of the param (in the strategy call) this job belongs to."""
    shape: tuple[int, ...]
    """The job's whole shape (a tensor's shape, or ``(rows, cols)`` for one expert)."""
    layout: MatrixLayout
    """How the whole is cut into matrices (split blocks, transposed, flatten)."""
    held: Sequence[Piece]
    """Who holds which region of the momentum update (replicated copies listed once per holder): a
    tuple of :class:`Piece`, or :class:`Pieces`."""
    needed: Sequence[Piece] = field(default=())
    """Who needs which region of the direction; empty: the same as ``held``."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def receivers(self) -> Sequence[Piece]:
        return self.needed or self.held


@dataclass(frozen=True, eq=False)
class Holders:
    """Who holds what of a job: ``ranks[i]`` holds ``regions[i]`` (in piece order), and what follows.

    One object per placement, shared by every job placed alike; the derived views (cached) cost
    one pass over the holders, once. Equal when the ranks and regions are.

    >>> rows = (Box((((0, 2),),)), Box((((2, 4),),)))
    >>> h = Holders((0, 1, 2, 3), rows * 2)   # 2 replicas of 2 row blocks
    >>> h.held[1], h.distinct, h.unique
    (2, ((0, 2), (1, 3)), False)
    """

    ranks: tuple[int, ...]
    regions: tuple[Region, ...]

    def __post_init__(self) -> None:
        if len(self.ranks) != len(self.regions):
            raise ValueError(f"{len(self.ranks)} ranks for {len(self.regions)} regions")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Holders):
            return NotImplemented
        return self is other or (
            hash(self) == hash(other) and self.ranks == other.ranks and self.regions == other.regions
        )

    def __hash__(self) -> int:
        return self._hash

    @functools.cached_property
    def _hash(self) -> int:
        return hash((self.ranks, self.regions))

    @functools.cached_property
    def numels(self) -> tuple[int, ...]:
        """Elements of each piece."""
        return tuple(region.numel for region in self.regions)

    @functools.cached_property
    def held(self) -> dict[int, int]:
        """Elements held per rank (ranks with a piece only, in order of their first piece)."""
        out: dict[int, int] = {}
        for rank, n in zip(self.ranks, self.numels, strict=True):
            out[rank] = out.get(rank, 0) + n
        return out

    @functools.cached_property
    def by_rank(self) -> dict[int, tuple[int, ...]]:
        """The indices of each rank's pieces, in piece order."""
        out: dict[int, list[int]] = {}
        for i, rank in enumerate(self.ranks):
            out.setdefault(rank, []).append(i)
        return {rank: tuple(index) for rank, index in out.items()}

    @functools.cached_property
    def distinct(self) -> tuple[tuple[int, ...], ...]:
        """Per distinct region, in order of first appearance: the indices of the pieces holding it."""
        out: dict[Region, list[int]] = {}
        for i, region in enumerate(self.regions):
            out.setdefault(region, []).append(i)
        return tuple(tuple(index) for index in out.values())

    @functools.cached_property
    def unique(self) -> bool:
        """Whether every region is held once (no replicas): then every piece is a source."""
        return len(self.distinct) == len(self.regions)

    @functools.cached_property
    def covered(self) -> int:
        """Elements of the distinct regions together."""
        return sum(self.numels[index[0]] for index in self.distinct)


class Pieces(Sequence[Piece]):
    """The pieces of one job in compact form: ``Piece(holders.ranks[i], holders.regions[i], where)``.

    A sequence of :class:`Piece` made on demand; equal to another :class:`Pieces` with equal
    holders and ``where`` (not to a tuple of the same pieces).

    >>> pieces = Pieces(Holders((0, 1), (Box((((0, 2),),)), Box((((2, 4),),)))), Expert(3))
    >>> pieces[1]
    Piece(rank=1, region=Box(runs=(((2, 4),),)), where=Expert(index=3))
    """

    __slots__ = ("holders", "where")

    def __init__(self, holders: Holders, where: Where = None) -> None:
        self.holders = holders
        self.where = where

    def __len__(self) -> int:
        return len(self.holders.ranks)

    @overload
    def __getitem__(self, i: int) -> Piece: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[Piece, ...]: ...
    def __getitem__(self, i: int | slice) -> Piece | tuple[Piece, ...]:
        if isinstance(i, slice):
            return tuple(self[k] for k in range(*i.indices(len(self))))
        return Piece(self.holders.ranks[i], self.holders.regions[i], self.where)

    def __iter__(self) -> Iterator[Piece]:
        where = self.where
        for rank, region in zip(self.holders.ranks, self.holders.regions, strict=True):
            yield Piece(rank, region, where)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Pieces):
            return NotImplemented
        return self.where == other.where and self.holders == other.holders

    def __hash__(self) -> int:
        return hash((self.holders, self.where))

    def __repr__(self) -> str:
        return f"Pieces({len(self)} pieces on {len(self.holders.held)} ranks, where={self.where!r})"

    def subset(self, index: Sequence[int]) -> Pieces:
        """The pieces at ``index`` (in that order)."""
        ranks, regions = self.holders.ranks, self.holders.regions
        return Pieces(Holders(tuple(ranks[i] for i in index), tuple(regions[i] for i in index)), self.where)


def holders_of(pieces: Sequence[Piece]) -> Holders:
    """The :class:`Holders` of any sequence of pieces (shared for :class:`Pieces`, built for a tuple)."""
    if isinstance(pieces, Pieces):
        return pieces.holders
    return Holders(tuple(p.rank for p in pieces), tuple(p.region for p in pieces))
